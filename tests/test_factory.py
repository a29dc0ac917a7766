"""`build_averager`: the one way to wire a peer's averaging, its defaults and the handlers it registers."""

from __future__ import annotations

import random

import anyio
import pytest

from murmur.node.averaging.averager import AVERAGE_PROTOCOL
from murmur.node.averaging.factory import build_averager
from murmur.node.averaging.state_sync import STATE_PROTOCOL
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.tasks import DigitsTask
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import MemoryNetwork, TransportError

pytestmark = pytest.mark.anyio


def test_defaults_name_the_run_after_the_task_and_identify_the_model() -> None:
    net = MemoryNetwork()
    replica = TrainingLoop(DigitsTask(), shard=0).replica
    averager = build_averager(net.transport("a"), replica)
    assert averager.identity.run_id == "digits" and averager.identity.fingerprint == replica.fingerprint
    assert averager.table.self_id == "a" and not averager.table.members
    assert averager.wire_dtype == "float32" and averager.runtime == Runtime()


async def test_what_is_passed_in_is_what_the_averager_uses() -> None:  # simulated time needs the loop
    net = MemoryNetwork()
    table, bans, rng, runtime = PeerTable("a", liveness_timeout=5.0), BanList(), random.Random(1), Runtime.simulated()
    averager = build_averager(
        net.transport("a"), TrainingLoop(DigitsTask(), shard=0).replica, run_id="run-7", table=table, bans=bans, rng=rng,
        exchange_timeout=2.5, min_link_mbit=8.0, wire_dtype="int8", runtime=runtime,
    )  # fmt: skip
    assert (averager.table, averager.bans, averager.rng, averager.runtime) == (table, bans, rng, runtime)
    assert (averager.identity.run_id, averager.wire_dtype) == ("run-7", "int8")
    # The timeout gives the largest wire form of the model (float32) its transfer time at 8 Mbit/s: 1 s per MB.
    float32_bytes = averager.replica.spec.wire_size("float32")
    assert averager.timeout_s == pytest.approx(2.5 + 1.25 * float32_bytes / 1e6)  # with room for framing (LINK_OVERHEAD)


async def test_it_serves_averaging_and_state_sync_and_refuses_an_unknown_wire_dtype_first() -> None:
    net = MemoryNetwork()
    served, refused, caller = net.transport("served"), net.transport("refused"), net.transport("caller")
    build_averager(served, TrainingLoop(DigitsTask(), shard=0).replica)
    with pytest.raises(ValueError, match="float64"):
        build_averager(refused, TrainingLoop(DigitsTask(), shard=1).replica, wire_dtype="float64")
    async with served.run(), refused.run(), caller.run():
        with anyio.fail_after(10):
            for protocol in (AVERAGE_PROTOCOL, STATE_PROTOCOL):
                await (await caller.open_stream("served", served.addresses(), protocol)).reset()
                with pytest.raises(TransportError, match="protocol not supported"):
                    await caller.open_stream("refused", refused.addresses(), protocol)
