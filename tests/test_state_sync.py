"""State sync: a newcomer or a peer far behind adopts a live peer's model, over the in-memory transport.

Simulated time and peers as in `test_averager.py` (`averager_harness`).
"""

from __future__ import annotations

import anyio
import pytest
import trio.testing
from averager_harness import BATCH, TIMEOUT, assert_state_close, make_peer, peers, running, stall

from murmur.node.averaging.outcome import Result
from murmur.node.averaging.state_sync import STATE_PROTOCOL
from murmur.node.net.transport import MemoryNetwork

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


async def test_a_newcomer_adopts_a_live_peers_model_by_state_sync() -> None:
    async with peers(2) as (veteran, newcomer):
        veteran.steps(5)
        newcomer.know(veteran)
        outcome = await newcomer.averager.state_sync.sync_from_swarm()
        assert (outcome.result, outcome.reason) == (Result.SYNCED, f"adopted a model of work {5 * BATCH}")
        assert_state_close(newcomer.state(), veteran.state())
        assert newcomer.replica.work == veteran.replica.work == 5 * BATCH


async def test_a_resumed_peer_far_behind_catches_up_but_a_current_one_keeps_its_model() -> None:
    async with peers(3) as (veteran, stale, current):
        veteran.steps(10)
        stale.steps(1)
        current.steps(8)
        stale.know(veteran)
        current.know(veteran)
        before = current.state()
        caught_up = await stale.averager.state_sync.sync_from_swarm(behind_ratio=2.0)
        kept = await current.averager.state_sync.sync_from_swarm(behind_ratio=2.0)
        assert caught_up.result == Result.SYNCED
        assert_state_close(stale.state(), veteran.state())
        assert (kept.result, kept.reason) == (Result.KEPT, "peer's work 320 is not 2x ours (256)")
        assert_state_close(current.state(), before)
        assert current.replica.work == 256


async def test_state_sync_is_refused_across_runs_and_a_stalled_peer_times_out() -> None:
    net = MemoryNetwork()
    newcomer, other = make_peer(net, "newcomer", 0), make_peer(net, "other", 1, run_id="other-run")
    staller = net.transport("staller")
    staller.set_handler(STATE_PROTOCOL, stall)
    async with running(newcomer, other), staller.run():
        other.steps(1)
        before = newcomer.state()
        newcomer.know(other)
        refused = await newcomer.averager.state_sync.sync_from_swarm(attempts=1)
        assert (refused.result, refused.reason) == (
            Result.FAILED, "StateSyncRefused: task mismatch: run id 'digits' != 'other-run'"
        )  # fmt: skip
        newcomer.averager.table.forget(other.id)
        newcomer.averager.table.observe(staller.peer_id, staller.addresses(), 0.0)
        stalled = await newcomer.averager.state_sync.sync_from_swarm(attempts=1)
        assert stalled.result == Result.FAILED and stalled.reason.startswith("TimeoutError")
        assert anyio.current_time() == pytest.approx(TIMEOUT)
        assert_state_close(newcomer.state(), before)
        assert newcomer.replica.work == 0
