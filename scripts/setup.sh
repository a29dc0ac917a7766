#!/usr/bin/env bash
# Create ./.venv with the CPU build of PyTorch and Murmur (editable) with the extras named (idempotent):
#   scripts/setup.sh lab                      what the demo needs (the default)
#   scripts/setup.sh lab,test,hf,lightning    what the tests need (scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-lab}"
PYTHON="${PYTHON:-python3}"
declare -A MODULES=([lab]="matplotlib" [test]="pytest xdist hypothesis dockerfile_parse sklearn tensorboard wandb"
                    [hf]="transformers accelerate" [lightning]="lightning")
imports="murmur.node.cli, torch, libp2p"
for extra in ${EXTRAS//,/ }; do
    [ -n "${MODULES[$extra]+set}" ] || { echo "scripts/setup.sh: unknown extra '$extra' (${!MODULES[*]})" >&2; exit 2; }
    for module in ${MODULES[$extra]}; do imports+=", $module"; done
done
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# The entry-point check also catches a virtualenv made before node/ moved under murmur.node.
if ! .venv/bin/python -c "import $imports
from importlib.metadata import distribution, entry_points
distribution('murmur-gossip')  # an older .venv holds this project under the name 'murmur'
(ep,) = entry_points(group='console_scripts', name='murmur'); assert ep.value == 'murmur.node.cli:entry'" 2>/dev/null; then
    # Pin torch first: an unpinned torch would pull a multi-GB CUDA build.
    .venv/bin/pip install --quiet torch==2.13.0
    .venv/bin/pip uninstall --quiet --yes murmur 2>/dev/null || true  # this project under its old name, if any
    .venv/bin/pip install --quiet -e ".[$EXTRAS]"
fi
