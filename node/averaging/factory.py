"""The one way to wire a peer's averaging: used by the node, the simulator and the tests."""

from __future__ import annotations

import random

from murmur.node.averaging.averager import Averager
from murmur.node.averaging.delta_gossip import DeltaGossiper
from murmur.node.averaging.state_sync import STATE_PROTOCOL
from murmur.node.learn.replica import Replica
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.scoring import MergeScorer
from murmur.node.learn.screening import ClippedGossip, WorkClaimLimiter
from murmur.node.net.membership import TaskIdentity
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import Transport


def build_averager(
    transport: Transport,
    replica: Replica,
    *,
    run_id: str | None = None,
    table: PeerTable | None = None,
    bans: BanList | None = None,
    rng: random.Random | None = None,
    exchange_timeout: float = 10.0,
    min_link_mbit: float = 5.0,
    wire_dtype: str = "float32",
    screening: ClippedGossip | None = None,
    claims: WorkClaimLimiter | None = None,
    scorer: MergeScorer | None = None,
    runtime: Runtime = Runtime(),
) -> Averager:
    """An `Averager` for `replica` over `transport`, serving the averaging and state-sync protocols
    (a `DeltaGossiper`, serving delta gossip instead of averaging, for a replica with compression).

    Defaults: the run is the task's name, a `PeerTable` without liveness expiry beyond
    10 s, a fresh ban list, default screening and claim limits, no scored merges
    (`scorer`: `murmur.node.learn.scoring`; delta gossip does not score), and real clocks
    and threads. Raises `ValueError` for an unknown `wire_dtype`.
    """
    kind = DeltaGossiper if replica.compression is not None else Averager
    averager = kind(
        transport, replica,
        table if table is not None else PeerTable(transport.peer_id, liveness_timeout=10.0),
        TaskIdentity(run_id or replica.name, replica.fingerprint, replica.spec),
        screening=screening if screening is not None else ClippedGossip(),
        claims=claims if claims is not None else WorkClaimLimiter(),
        scorer=scorer,
        bans=bans if bans is not None else BanList(),
        exchange_timeout=exchange_timeout,
        min_link_mbit=min_link_mbit,
        rng=rng if rng is not None else random.Random(),
        wire_dtype=wire_dtype,
        runtime=runtime,
    )  # fmt: skip
    transport.set_handler(averager.protocol, averager.serve_exchange)
    transport.set_handler(STATE_PROTOCOL, averager.state_sync.serve)
    return averager
