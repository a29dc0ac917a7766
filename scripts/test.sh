#!/usr/bin/env bash
# Install what the tests need, then run the whole test suite, slow swarm tests included.
# Pass pytest arguments to narrow it, e.g. `scripts/test.sh -m "not slow"`; `-n 0` runs it in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh lab,test,hf,lightning
# As root, the system packages some tests use, where missing: iptables (the NAT namespaces) and Chromium (the
# dashboard's browser test). Without root those tests skip, saying why.
if [ "$(id -u)" = 0 ]; then
    missing=()
    command -v iptables >/dev/null || missing+=(iptables)
    command -v chromium >/dev/null || missing+=(chromium)
    if [ ${#missing[@]} -gt 0 ]; then apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; fi
fi
# --dist loadfile: one worker runs each file, so a module's shared swarms (test_attack, test_poisoning) run once.
exec .venv/bin/python -m pytest -m "slow or not slow" -n 2 --dist loadfile "$@"
