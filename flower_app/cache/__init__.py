"""Caches: offline assets, on-disk derived artefacts, and per-process models and tokenizers."""
