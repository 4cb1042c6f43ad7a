"""The adapter kinds, one folder each (florg/, lora/, lora_sb/), registered in registry.py."""
