"""`python -m convert ...` in a checkout runs the conversion CLI of the library, r2lm.convert (`r2lm-convert`)."""

import sys

from r2lm.convert.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
