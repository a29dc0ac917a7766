#!/usr/bin/env bash
# Install what the demo needs (PyTorch, Murmur, the lab's plots), then run `murmur demo` (extra arguments are passed on).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh lab
exec .venv/bin/murmur demo "$@"
