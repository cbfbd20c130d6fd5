"""Command-line programs installed with r2lm: r2lm-generate (r2lm.cli.generate); r2lm-convert is r2lm.convert."""
