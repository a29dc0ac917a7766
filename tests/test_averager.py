"""The averager's exchanges: merges, and the staleness rule's fresh work, over the in-memory transport.

Peers are wired by `build_averager` with `Runtime.simulated()` (`averager_harness`): torch work
runs inline and every clock is the event loop's mock clock, which jumps to the next deadline as
soon as every task waits, so a partner that stalls until the exchange timeout costs no real time.
Real libp2p is covered by `tests/test_averaging_libp2p.py`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import anyio
import pytest
import torch
import trio.testing
from averager_harness import BATCH, assert_state_close, last, make_peer, peers, running, settled

from lab.outer_merge import OuterRule
from murmur.node.averaging.outcome import Result
from murmur.node.learn.rules import WorkRule
from murmur.node.learn.scoring import HELD_SHARD, MergeScorer, held_batches
from murmur.node.net.transport import (
    READ_CHUNK,
    ByteStream,
    ForwardingStream,
    MemoryNetwork,
    MemoryTransport,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


# --- merges ------------------------------------------------------------------------------


async def test_exchange_merges_both_sides_to_the_work_weighted_mean() -> None:
    async with peers(2) as (a, b):
        a.steps(3)
        b.steps(1)
        sa, sb = a.replica.snapshot(), b.replica.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert (outcome.result, outcome.reason) == (Result.MERGED, "work: partner holds 25% of the pair's work")
        assert last(b) == (Result.MERGED, "work: partner holds 75% of the pair's work")
        assert outcome.remote_share == pytest.approx(0.25) and outcome.bytes_sent == a.replica.spec.wire_size("float32")
        expected = {n: (sa.work * sa.state[n] + sb.work * sb.state[n]) / (sa.work + sb.work) for n in sa.state}
        assert_state_close(a.state(), expected)
        assert_state_close(b.state(), expected)
        assert a.replica.work == b.replica.work == (sa.work + sb.work) / 2
        assert a.averager.outcomes[Result.MERGED] == b.averager.outcomes[Result.MERGED] == 1


async def test_a_peer_initiates_only_with_work_since_its_last_merge_and_both_sides_record_the_exchange() -> None:
    # Peers waiting for a common start would otherwise swap identical models, filling slow links for nothing.
    async with peers(2) as (a, b):
        a.know(b)
        b.know(a)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.averager.run, 0.1)
            await anyio.sleep(5.0)  # simulated: ~50 rounds
            assert not a.averager.outcomes and not b.averager.outcomes
            a.steps(1)
            await anyio.sleep(5.0)
            tg.cancel_scope.cancel()
        assert a.averager.outcomes == b.averager.outcomes == {Result.MERGED: 1}  # then nothing new again
        assert a.averager.table.members[b.id].exchanges == b.averager.table.members[a.id].exchanges == 1


@pytest.mark.parametrize(("share_of", "wall_s", "cpu_s"), [("wall", 1.0, 0.0), ("cpu", 100.0, 1.0)])
async def test_a_peer_waits_so_that_its_exchanges_take_at_most_their_share_of_its_time(share_of: str, wall_s: float, cpu_s: float) -> None:
    async with peers(2) as (a, b):
        a.know(b)
        a.steps(1)
        # As if each exchange had taken `wall_s` and `cpu_s` of it computing: only `share_of`'s 1 s counts.
        a.averager.typical_exchange_s, a.averager.typical_exchange_cpu_s = wall_s, cpu_s
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(a.averager.run, 0.1, max_share=0.25, share_of=share_of))
            await anyio.sleep(1.99)  # the wait is 1 s / 0.25 = 4 s, jittered to 2-6 s
            assert not a.averager.outcomes
            await anyio.sleep(4.02)
            tg.cancel_scope.cancel()
        assert a.averager.outcomes == {Result.MERGED: 1}
        with pytest.raises(ValueError, match=r"unknown exchange share 'disk'; choose from \['cpu', 'wall'\]"):
            await a.averager.run(0.1, share_of="disk")


async def test_an_exchange_counts_the_cpu_time_of_its_work_on_worker_threads_and_on_the_event_loop() -> None:
    # Each thread's CPU clock moves on at every read: a computation on a worker thread (read before and
    # after) costs 0.25 s, and the event loop's part of an exchange (read at its start and end) 0.01 s.
    clocks = {"worker": itertools.count(step=0.25), "loop": itertools.count(step=0.01)}
    thread = "loop"

    async def run_sync(func: Callable[..., Any], *args: Any) -> Any:
        nonlocal thread
        thread = "worker"
        try:
            return func(*args)
        finally:
            thread = "loop"

    async def slow_partner(func: Callable[..., Any], *args: Any) -> Any:
        await anyio.sleep(0.2)  # within the exchange timeout
        return func(*args)

    async with peers(2) as (a, b):
        a.know(b)
        a.steps(1)
        b.steps(1)
        a.averager.runtime = replace(a.averager.runtime, cpu_time=lambda: next(clocks[thread]), run_sync=run_sync)
        b.averager.runtime = replace(b.averager.runtime, run_sync=slow_partner)
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.MERGED, outcome.reason
        assert outcome.duration_s >= 0.4  # waiting on the partner is not computing
        # Four computations (snapshot, the received model's check, screening, merge) and the event loop's part.
        assert outcome.cpu_s == pytest.approx(4 * 0.25 + 0.01)


async def test_both_sides_hold_their_partner_alive_while_their_models_swap() -> None:
    async def slow(func: Callable[..., Any], *args: Any) -> Any:
        await anyio.sleep(0.2)
        return func(*args)

    async with peers(2) as (a, b):
        a.know(b)
        b.know(a)
        a.steps(1)
        for p in (a, b):
            p.averager.runtime = replace(p.averager.runtime, run_sync=slow)
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.averager.exchange_with, b.id, b.transport.addresses())
            with anyio.fail_after(5):
                while not (a.averager.table.exchanging and b.averager.table.exchanging):
                    await anyio.sleep(0.01)
            assert a.averager.table.exchanging == {b.id: 1} and b.averager.table.exchanging == {a.id: 1}
        await settled(a, b)
        assert not a.averager.table.exchanging and not b.averager.table.exchanging


async def test_exchanges_before_anyone_trained_do_not_stop_later_merges() -> None:
    # Peers that join and wait for a common start exchange identical, work-free models many
    # times; none of that may teach screening a zero radius that clips every later merge.
    async with peers(2) as (a, b):
        for _ in range(12):
            await a.averager.exchange_with(b.id, b.transport.addresses())
            await settled(a, b)
        a.steps(2)
        b.steps(2)
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.MERGED and outcome.remote_share == pytest.approx(0.5)
        assert_state_close(a.state(), b.state())  # both moved to the mean


@pytest.mark.parametrize(("wire_dtype", "resolution"), [("bfloat16", 2**-8), ("int8", 1 / 127)])
async def test_lossy_wire_dtypes_move_both_sides_by_the_difference_of_their_quantized_models(
    wire_dtype: str, resolution: float
) -> None:
    net = MemoryNetwork()
    a = make_peer(net, "a", 0, wire_dtype=wire_dtype)  # the initiator's choice binds both sides
    b = make_peer(net, "b", 1)
    async with running(a, b):
        a.steps(3)
        b.steps(1)
        exact_a, exact_b = a.replica.snapshot(), b.replica.snapshot()
        qa, qb = a.replica.snapshot(wire_dtype).state, b.replica.snapshot(wire_dtype).state
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.MERGED, outcome.reason
        assert outcome.bytes_sent == a.replica.spec.wire_size(wire_dtype) < a.replica.spec.wire_size("float32")
        wa, wb = exact_a.work, exact_b.work
        share = wb / (wa + wb)
        # Both apply the same quantized difference with opposite signs: models that agree stay put.
        assert_state_close(a.state(), {n: exact_a.state[n] + share * (qb[n] - qa[n]) for n in qa})
        assert_state_close(b.state(), {n: exact_b.state[n] + (1 - share) * (qa[n] - qb[n]) for n in qb})
        for name in qa:  # ... and land within the wire's resolution of the exact merge
            mean = (wa * exact_a.state[name] + wb * exact_b.state[name]) / (wa + wb)
            scale = max(exact_a.state[name].abs().max(), exact_b.state[name].abs().max())
            assert (a.state()[name] - mean).abs().max() <= resolution * scale


class _Tapped(ForwardingStream):
    """A stream that calls `hook` once, just before its first read."""

    def __init__(self, inner: ByteStream, hook: Callable[[], None]) -> None:
        super().__init__(inner)
        self.hook: Callable[[], None] | None = hook

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return await self.inner.receive_some(max_bytes)


class _TapFirstStream(MemoryTransport):
    """An in-memory transport whose first outbound stream is `_Tapped` with `hook`."""

    def __init__(self, network: MemoryNetwork, peer_id: str, hook: Callable[[], None]) -> None:
        super().__init__(network, peer_id)
        self.hook: Callable[[], None] | None = hook

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        stream = await super().open_stream(peer_id, addrs, protocol)
        hook, self.hook = self.hook, None
        return _Tapped(stream, hook) if hook is not None else stream


async def test_steps_taken_while_an_exchange_is_in_flight_are_kept() -> None:
    net = MemoryNetwork()
    progressed: list[dict[str, torch.Tensor]] = []

    def step_meanwhile() -> None:  # after the Offer (and its snapshot) left, before the answer arrives
        a.loop.step()
        progressed.append(a.state())

    a = make_peer(net, "a", 0, transport=_TapFirstStream(net, "a", step_meanwhile))
    b = make_peer(net, "b", 1)
    async with running(a, b):
        a.steps(1)
        b.steps(1)
        sa, sb = a.replica.snapshot(), b.replica.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
    assert outcome.result == Result.MERGED and outcome.remote_share == 0.5 and len(progressed) == 1
    merged = {n: (sa.state[n] + sb.state[n]) / 2 for n in sa.state}
    assert_state_close(b.state(), merged)
    # a adds the merge's change to the model it has now: its extra step survives the merge.
    assert_state_close(a.state(), {n: progressed[0][n] + 0.5 * (sb.state[n] - sa.state[n]) for n in sa.state})
    assert any(not torch.allclose(a.state()[n], merged[n]) for n in merged)
    assert a.replica.work == b.replica.work + BATCH  # the pair's mean, plus a's own step


async def test_a_newcomer_adopts_its_partners_model_without_screening_it() -> None:
    async with peers(2) as (veteran, newcomer):
        veteran.steps(5)
        with torch.no_grad():  # a model 10x our norm away: screening would reject it (see below)
            for p in veteran.replica.model.parameters():
                p.mul_(10)
        before = veteran.state()
        outcome = await veteran.averager.exchange_with(newcomer.id, newcomer.transport.addresses())
        await settled(veteran, newcomer)
        assert (outcome.result, outcome.reason) == (Result.MERGED, "partner has no work yet: keep the local model")
        assert last(newcomer) == (Result.MERGED, "local model has no work yet: adopt the partner's")
        assert_state_close(newcomer.state(), before)
        assert_state_close(veteran.state(), before)
        assert not newcomer.averager.screening.history  # nothing was screened
        assert newcomer.replica.work == veteran.replica.work == 5 * BATCH / 2


async def test_a_transfer_announced_as_the_deadline_fires_still_ends_in_a_timeout() -> None:
    """Extending a deadline that already fired must not turn the timeout into a silent exit (no outcome)."""
    async with peers(1) as (a,):
        attempt = a.averager._begin("partner")

        async def announce_late(attempt: Any) -> None:
            try:
                await anyio.sleep(10 * a.averager.timeout_s)
            finally:
                attempt.extend(100.0)  # e.g. a delta announced while the cancellation unwinds

        outcome = await a.averager._attempt(attempt, announce_late)
        assert (outcome.result, outcome.reason) == (Result.FAILED, f"timed out after {a.averager.timeout_s:.3g}s")


# --- staleness: fresh work stated in Offer and Accept -------------------------------------


def averaging_outer() -> OuterRule:
    return OuterRule(lr=1.0, momentum=0.0, discount=0.5)  # an outer step that lands on the pair's target


async def test_outer_peers_state_their_fresh_work_and_discount_the_staler_side() -> None:
    net = MemoryNetwork()
    a, b = (make_peer(net, f"peer{i}", i, rule=averaging_outer()) for i in range(2))
    async with running(a, b):
        a.steps(3)
        b.steps(1)
        await a.averager.exchange_with(b.id, b.transport.addresses())  # first merge: fresh work = weight
        await settled(a, b)
        assert (a.replica.work, a.replica.fresh, b.replica.fresh) == (64, 0, 0)
        a.steps(1)
        b.steps(3)  # now b did 3x a's work since the anchor both share, a is the stale side
        sa, sb = a.replica.snapshot(), b.replica.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        share = 0.5 * 160 / 256 + 0.5 * 96 / 128  # (1 - κ)·w_b/(w_a + w_b) + κ·f_b/(f_a + f_b)
        assert outcome.reason == "outer step toward the work: partner holds 62% of the pair's work; partner did 75% of the fresh work: share 69%"
        assert outcome.remote_share == pytest.approx(share)
        assert b.averager.recent[-1].remote_share == pytest.approx(1 - share)
        expected = {n: sa.state[n] + share * (sb.state[n] - sa.state[n]) for n in sa.state}
        assert_state_close(a.state(), expected)
        assert_state_close(b.state(), expected)
        assert a.replica.work + b.replica.work == 96 + 160 and a.replica.fresh == b.replica.fresh == 0


async def test_a_partner_that_states_no_fresh_work_leaves_the_outer_rule_to_the_weights() -> None:
    net = MemoryNetwork()
    outer, work = make_peer(net, "outer", 0, rule=averaging_outer()), make_peer(net, "work", 1, rule=WorkRule())
    async with running(outer, work):
        outer.steps(3)
        work.steps(1)
        outcome = await outer.averager.exchange_with(work.id, work.transport.addresses())
        await settled(outer, work)
        assert (outcome.reason, outcome.remote_share) == ("outer step toward the work: partner holds 25% of the pair's work", 0.25)
        assert last(work) == (Result.MERGED, "work: partner holds 75% of the pair's work")


async def test_a_fresh_work_claim_is_capped_at_the_credited_weight() -> None:
    net = MemoryNetwork()
    liar, honest = (make_peer(net, f"peer{i}", i, rule=averaging_outer()) for i in range(2))
    async with running(liar, honest):
        liar.steps(1)
        honest.steps(1)
        liar.replica.work = liar.replica.fresh = 1e6  # a million samples, all since its anchor
        await liar.averager.exchange_with(honest.id, honest.transport.addresses())
        await settled(liar, honest)
        # Credited 128 (4x ours) and so fresh 128 at most: shares 0.8 and 0.8, not ~0.9.
        assert honest.averager.recent[-1].remote_share == pytest.approx(0.8)


async def test_a_scoring_peer_refuses_a_model_that_raises_its_held_loss_and_says_by_how_much() -> None:
    async with peers(2) as (a, b):
        a.steps(20)
        b.steps(20)
        task = a.loop.task
        a.averager.vetting.scorer = MergeScorer(a.replica.model, task.loss, held_batches(task.train_batches(HELD_SHARD), 64))
        with torch.no_grad():
            for parameter in b.replica.model.parameters():  # inside the distance bound, far from honest
                parameter.neg_()
        before = a.state()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.REJECTED
        assert outcome.reason.startswith("scored: merging the partner's model raises our held loss by")
        assert_state_close(a.state(), before)
        assert a.averager.bans._strikes[b.id]  # far past the tolerance: a strike too
