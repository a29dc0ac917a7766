#!/usr/bin/env bash
# Create ./.venv with the CPU build of PyTorch, Murmur and the lab's extra installed (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
# The NAT tests build namespaces with iptables (they skip, saying so, when not root).
if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null; then apt-get update -qq && apt-get install -y -qq iptables >/dev/null; fi
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# The entry-point check also catches a virtualenv made before node/ moved under murmur.node.
if ! .venv/bin/python -c "import murmur.node.cli, torch, libp2p, pytest, xdist, hypothesis, prometheus_client, dockerfile_parse, transformers, lightning, matplotlib, tensorboard, wandb
from importlib.metadata import distribution, entry_points
distribution('murmur-gossip')  # an older .venv holds this project under the name 'murmur'
(ep,) = entry_points(group='console_scripts', name='murmur'); assert ep.value == 'murmur.node.cli:entry'" 2>/dev/null; then
    # Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/pip install --quiet torch==2.13.0
    .venv/bin/pip uninstall --quiet --yes murmur 2>/dev/null || true  # this project under its old name, if any
    .venv/bin/pip install --quiet -e '.[test,hf,lightning,lab]'
fi
# The dashboard's browser test needs a headless Chromium (Debian's package); as root, install it where missing.
command -v chromium >/dev/null || { [ "$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq chromium; } || true
