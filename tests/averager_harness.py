"""Averager test peers: digits peers on the in-memory transport, wired as the node wires them, on simulated time."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
import torch

from murmur.node.averaging.averager import Averager
from murmur.node.averaging.factory import build_averager
from murmur.node.averaging.outcome import Result
from murmur.node.learn.deltas import Compression
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import MergeRule
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.tasks import DigitsTask
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import (
    ByteStream,
    FaultInjector,
    MemoryNetwork,
    MemoryTransport,
)

TIMEOUT = 1.0  # simulated seconds
BATCH = DigitsTask().batch_size


@dataclass
class Peer:
    transport: FaultInjector
    loop: TrainingLoop
    averager: Averager

    @property
    def id(self) -> str:
        return self.transport.peer_id

    @property
    def replica(self) -> Replica:
        return self.loop.replica

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.replica.snapshot().state)

    def know(self, *others: Peer) -> None:
        for other in others:
            self.averager.table.observe(other.id, other.transport.addresses(), 0.0)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.loop.step()


def make_peer(
    net: MemoryNetwork, name: str, shard: int, *, run_id: str = "digits", wire_dtype: str = "float32",
    bans: BanList | None = None, transport: MemoryTransport | None = None, rule: MergeRule | None = None,
    compression: Compression | None = None,
) -> Peer:  # fmt: skip
    """A digits peer called `name` on `net`, its averager built as the node builds it, on simulated time
    (a delta gossiper with `compression`)."""
    transport = FaultInjector(transport or net.transport(name))
    loop = TrainingLoop(DigitsTask(), shard=shard, rule=rule, compression=compression)
    averager = build_averager(
        transport, loop.replica, run_id=run_id, table=PeerTable(name, liveness_timeout=1e9), bans=bans,
        rng=random.Random(shard), exchange_timeout=TIMEOUT, min_link_mbit=math.inf,  # timeouts: exactly TIMEOUT
        wire_dtype=wire_dtype, runtime=Runtime.simulated(),
    )  # fmt: skip
    return Peer(transport, loop, averager)


@asynccontextmanager
async def running(*peers: Peer) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        for peer in peers:
            await stack.enter_async_context(peer.transport.run([]))
        yield


@asynccontextmanager
async def peers(n: int, **kwargs) -> AsyncIterator[list[Peer]]:
    net = MemoryNetwork()
    out = [make_peer(net, f"peer{i}", i, **kwargs) for i in range(n)]
    async with running(*out):
        yield out


async def settled(*peers: Peer) -> None:
    """Wait (bounded, in simulated time) until no peer is in an exchange: a responder finishes after its initiator."""
    with anyio.fail_after(10):
        while any(p.averager.in_exchange for p in peers):
            await anyio.sleep(0.01)
        await anyio.sleep(0.01)  # the responder records its outcome right after leaving the exchange


def assert_state_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


def last(peer: Peer) -> tuple[Result, str]:
    outcome = peer.averager.recent[-1]
    return outcome.result, outcome.reason


async def stall(stream: ByteStream) -> None:
    """A partner that opens the conversation and then never answers."""
    await anyio.sleep_forever()
