"""Learning per sample: gossip merge rules vs synchronous training in event time (see node/lab/learning.py)."""

import sys

from murmur.node.lab.learning import main

if __name__ == "__main__":
    sys.exit(main())
