"""Simulate Murmur's swarm at 100, 300 and 1,000 peers in simulated time (see `murmur.node.lab.simulation.cli`).

    .venv/bin/python scripts/simulate.py                  # 100, 300, 1000 peers (~15-20 min on 2 cores)
    .venv/bin/python scripts/simulate.py --quick          # 20 and 50 peers, ~1 min
    .venv/bin/python scripts/simulate.py --peers 1000 --topologies gossip,partial

Results go to docs/sim (--quick: results/sim-quick) in this checkout unless --out says otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from murmur.node.lab.simulation.cli import main

if __name__ == "__main__":
    sys.exit(main(root=Path(__file__).resolve().parents[1]))
