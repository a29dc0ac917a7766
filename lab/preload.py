"""Imported once by the fork server that `lab.swarm.ForkedPeer` peers (and the benchmark's sync ranks) fork from.

It loads torch, libp2p, the node and its tasks (each process would otherwise spend seconds
importing them, the torch._dynamo that creating an optimizer imports included), then
freezes everything loaded out of the garbage collector: forked children would otherwise
rescan the whole inherited heap at every full collection, which slows training
(docs/history/2026-12-06-lab-calibration.md).
"""

import gc

import torch._dynamo  # noqa: F401

import murmur.node.learn.tasks.charlm  # noqa: F401
import murmur.node.ops.node  # noqa: F401
import murmur.node.ops.run  # noqa: F401

gc.collect()
gc.freeze()
