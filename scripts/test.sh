#!/usr/bin/env bash
# Install what the tests need (first run only) and run the whole test suite, slow tests included.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow"  or  bash scripts/test.sh -k generate
source "$(dirname "$0")/env.sh"
python -m pytest -q --durations=15 "$@"
