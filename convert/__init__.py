"""Checkpoint conversion: `python -m convert --help`."""
