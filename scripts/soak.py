#!/usr/bin/env python3
"""Soak run (issue 32): 8 `murmur run` peers under churn for an hour, sampled every minute.

    .venv/bin/python scripts/soak.py --duration 3600 --churn-every 180 --out results/soak

The run lives in the lab (`lab/soak.py`, its targets in `lab/soak_report.py`); this puts the
checkout on the path so it runs from anywhere. See docs/soak.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.soak import main  # after the checkout is on the path

if __name__ == "__main__":
    sys.exit(main())
