#!/usr/bin/env bash
# Install what is needed, then run the whole test suite, slow swarm tests included.
# Pass pytest arguments to narrow it, e.g. `scripts/test.sh -m "not slow"`; `-n 0` runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -m "slow or not slow" -n 2 "$@"
