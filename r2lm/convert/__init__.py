"""Checkpoint conversion (docs/design.md section 7): `r2lm-convert --help` (or `python -m r2lm.convert --help`).

The converters build models; every checkpoint they read or write goes through r2lm.checkpoints."""
