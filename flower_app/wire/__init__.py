"""What travels between ServerApp and ClientApps: records, encodings, adapter ranks."""
