"""A checkout's shortcut: `python -m convert ...` is `r2lm-convert ...` (r2lm.convert). Not installed."""
