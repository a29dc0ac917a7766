"""An example `NodeStatus` for tests of what reads one (status, dashboard, metrics)."""

from __future__ import annotations

import dataclasses
from typing import Any

from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.ops.node_status import NetworkStatus, NodeStatus

EXAMPLE = NodeStatus(
    peer_id="12D3KooWself", addrs=("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWself",), task="digits", device="cpu",
    t=100.0, phase="training", uptime_s=2.0, samples=640, samples_per_s=320.0, work=640.0, loss=0.5,
    eval={"accuracy": 0.8}, exchanges={Result.MERGED: 1, Result.BUSY: 1},
    recent_exchanges=(Outcome(Result.MERGED, "peerA", "work: partner holds 50% of the pair's work", 0.01, 0.5, 4096),
                      Outcome(Result.BUSY, "peerB", "this node is already in an exchange")),
    mean_exchange_s=0.01, bytes_sent=4096, bytes_per_merge=4096.0, model_bytes=8192, known_peers=2, peers=("peerA", "peerB"), compute_fraction=0.75,
    eval_fraction=0.05, pid=4242, status_interval=1.0, bytes_in=1000, bytes_out=2000, partner_distance=1.5,
    metrics_url=None, dashboard_url=None,
    network=NetworkStatus("private", "dial-backs failed", {"peerA": "direct", "peerB": "relayed"}, {"peerB": "relay"},
                    ("/ip4/1.2.3.4/tcp/4001/p2p/relay/p2p-circuit/p2p/12D3KooWself",), 1, 0),
)  # fmt: skip


def example_status(**changes: Any) -> NodeStatus:
    """`EXAMPLE` with `changes` (field names of `NodeStatus`)."""
    return dataclasses.replace(EXAMPLE, **changes)
