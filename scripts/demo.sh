#!/usr/bin/env bash
# Install what is needed, then run `murmur demo` (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/murmur demo "$@"
