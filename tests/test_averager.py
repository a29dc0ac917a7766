"""The averager's exchanges and state sync, over the in-memory transport under Trio's MockClock.

Peers are wired by `build_averager` with `Runtime.simulated()`: torch work runs inline
and every clock is the event loop's mock clock, which jumps to the next deadline as
soon as every task waits, so a partner that stalls until the exchange timeout costs no
real time. Real libp2p is covered by `tests/test_averaging_libp2p.py`.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
import torch
import trio.testing

from murmur.node.averaging.averager import AVERAGE_PROTOCOL, STATE_PROTOCOL, Averager
from murmur.node.averaging.factory import build_averager
from murmur.node.learn.rules import MergeRule, OuterRule, WorkRule
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.tasks import DigitsTask
from murmur.node.learn.trainer import Trainer
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import (
    READ_CHUNK,
    ByteStream,
    FaultInjector,
    ForwardingStream,
    MemoryNetwork,
    MemoryTransport,
)
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Accept, Chunk, Offer, Params, encode_frame

pytestmark = pytest.mark.anyio
TIMEOUT = 1.0  # simulated seconds
BATCH = DigitsTask().batch_size


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


@dataclass
class Peer:
    transport: FaultInjector
    trainer: Trainer
    averager: Averager

    @property
    def id(self) -> str:
        return self.transport.peer_id

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.trainer.snapshot().state)

    def know(self, *others: Peer) -> None:
        for other in others:
            self.averager.table.observe(other.id, other.transport.addresses(), 0.0)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.trainer.step()


def make_peer(
    net: MemoryNetwork, name: str, shard: int, *, run_id: str = "digits", wire_dtype: str = "float32",
    bans: BanList | None = None, transport: MemoryTransport | None = None, rule: MergeRule | None = None,
) -> Peer:  # fmt: skip
    """A digits peer called `name` on `net`, its averager built as the node builds it, on simulated time."""
    transport = FaultInjector(transport or net.transport(name))
    trainer = Trainer(DigitsTask(), shard=shard, rule=rule)
    averager = build_averager(
        transport, trainer, run_id=run_id, table=PeerTable(name, liveness_timeout=1e9), bans=bans,
        rng=random.Random(shard), exchange_timeout=TIMEOUT, min_link_mbit=math.inf,  # timeouts: exactly TIMEOUT
        wire_dtype=wire_dtype, runtime=Runtime.simulated(),
    )  # fmt: skip
    return Peer(transport, trainer, averager)


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


def last(peer: Peer) -> tuple[str, str]:
    outcome = peer.averager.recent[-1]
    return outcome.result, outcome.reason


# --- merges ------------------------------------------------------------------------------


async def test_exchange_merges_both_sides_to_the_work_weighted_mean() -> None:
    async with peers(2) as (a, b):
        a.steps(3)
        b.steps(1)
        sa, sb = a.trainer.snapshot(), b.trainer.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert (outcome.result, outcome.reason) == ("merged", "work: partner holds 25% of the pair's work")
        assert last(b) == ("merged", "work: partner holds 75% of the pair's work")
        assert outcome.remote_share == pytest.approx(0.25) and outcome.bytes_sent == a.trainer.spec.wire_size("float32")
        expected = {n: (sa.weight * sa.state[n] + sb.weight * sb.state[n]) / (sa.weight + sb.weight) for n in sa.state}
        assert_state_close(a.state(), expected)
        assert_state_close(b.state(), expected)
        assert a.trainer.weight == b.trainer.weight == (sa.weight + sb.weight) / 2
        assert a.averager.outcomes["merged"] == b.averager.outcomes["merged"] == 1


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
        assert a.averager.outcomes == b.averager.outcomes == {"merged": 1}  # then nothing new again
        assert a.averager.table.members[b.id].exchanges == b.averager.table.members[a.id].exchanges == 1


async def test_a_peer_waits_so_that_its_exchanges_take_at_most_their_share_of_wall_time() -> None:
    async with peers(2) as (a, b):
        a.know(b)
        a.steps(1)
        a.averager.typical_exchange_s = 1.0  # as if each exchange had taken 1 s
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(a.averager.run, 0.1, max_share=0.25))
            await anyio.sleep(1.99)  # the wait is 1 s / 0.25 = 4 s, jittered to 2-6 s
            assert not a.averager.outcomes
            await anyio.sleep(4.02)
            tg.cancel_scope.cancel()
        assert a.averager.outcomes == {"merged": 1}


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
        assert outcome.result == "merged" and outcome.remote_share == pytest.approx(0.5)
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
        exact_a, exact_b = a.trainer.snapshot(), b.trainer.snapshot()
        qa, qb = a.trainer.snapshot(wire_dtype).state, b.trainer.snapshot(wire_dtype).state
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == "merged", outcome.reason
        assert outcome.bytes_sent == a.trainer.spec.wire_size(wire_dtype) < a.trainer.spec.wire_size("float32")
        wa, wb = exact_a.weight, exact_b.weight
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
        a.trainer.step()
        progressed.append(a.state())

    a = make_peer(net, "a", 0, transport=_TapFirstStream(net, "a", step_meanwhile))
    b = make_peer(net, "b", 1)
    async with running(a, b):
        a.steps(1)
        b.steps(1)
        sa, sb = a.trainer.snapshot(), b.trainer.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
    assert outcome.result == "merged" and outcome.remote_share == 0.5 and len(progressed) == 1
    merged = {n: (sa.state[n] + sb.state[n]) / 2 for n in sa.state}
    assert_state_close(b.state(), merged)
    # a adds the merge's change to the model it has now: its extra step survives the merge.
    assert_state_close(a.state(), {n: progressed[0][n] + 0.5 * (sb.state[n] - sa.state[n]) for n in sa.state})
    assert any(not torch.allclose(a.state()[n], merged[n]) for n in merged)
    assert a.trainer.weight == b.trainer.weight + BATCH  # the pair's mean, plus a's own step


async def test_a_newcomer_adopts_its_partners_model_without_screening_it() -> None:
    async with peers(2) as (veteran, newcomer):
        veteran.steps(5)
        with torch.no_grad():  # a model 10x our norm away: screening would reject it (see below)
            for p in veteran.trainer.model.parameters():
                p.mul_(10)
        before = veteran.state()
        outcome = await veteran.averager.exchange_with(newcomer.id, newcomer.transport.addresses())
        await settled(veteran, newcomer)
        assert (outcome.result, outcome.reason) == ("merged", "partner has no work yet: keep the local model")
        assert last(newcomer) == ("merged", "local model has no work yet: adopt the partner's")
        assert_state_close(newcomer.state(), before)
        assert_state_close(veteran.state(), before)
        assert not newcomer.averager.screening.history  # nothing was screened
        assert newcomer.trainer.weight == veteran.trainer.weight == 5 * BATCH / 2


# --- busy, refused, rejected -------------------------------------------------------------


async def _stall(stream: ByteStream) -> None:
    """A partner that opens the conversation and then never answers."""
    await anyio.sleep_forever()


async def test_a_busy_partner_answers_at_once_and_the_initiator_tries_another() -> None:
    net = MemoryNetwork()
    a, b, c = (make_peer(net, name, i) for i, name in enumerate("abc"))
    staller = net.transport("staller")
    staller.set_handler(AVERAGE_PROTOCOL, _stall)
    async with running(a, b, c), staller.run():
        for p in (a, b, c):
            p.steps(1)
        a.know(b, c)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.averager.exchange_with, staller.peer_id, staller.addresses())  # b waits out its timeout
            with anyio.fail_after(TIMEOUT / 2):
                while not b.averager.in_exchange:
                    await anyio.sleep(0)
            start = anyio.current_time()
            busy = await a.averager.exchange_with(b.id, b.transport.addresses())
            assert (busy.result, busy.reason) == ("busy", "already in an exchange")
            outcome = await a.averager.average_once(max_attempts=3)
            assert anyio.current_time() == start  # no waiting on the busy partner
        assert outcome.result == "merged" and outcome.partner == c.id
        assert last(b) == ("failed", f"timed out after {TIMEOUT:g}s")


async def test_two_peers_picking_each_other_do_not_deadlock() -> None:
    async with peers(2) as (a, b):
        a.steps(1)
        b.steps(1)
        results = {}

        async def go(x: Peer, y: Peer) -> None:
            results[x.id] = await x.averager.exchange_with(y.id, y.transport.addresses())

        async with anyio.create_task_group() as tg:
            tg.start_soon(go, a, b)
            tg.start_soon(go, b, a)
        assert anyio.current_time() == 0  # nobody waited for a timeout
        assert {o.result for o in results.values()} <= {"merged", "busy"}
        await settled(a, b)


async def test_another_run_is_refused_with_the_reason_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="murmur")
    net = MemoryNetwork()
    a, b = make_peer(net, "a", 0), make_peer(net, "b", 1, run_id="other-run")
    async with running(a, b):
        a.steps(1)
        b.steps(1)
        before_a, before_b = a.state(), b.state()
        outcome = await b.averager.exchange_with(a.id, a.transport.addresses())
        await settled(a, b)
    reason = "task mismatch: run id 'other-run' != 'digits'"
    assert (outcome.result, outcome.reason) == ("refused", reason)
    assert last(a) == ("refused", reason)
    assert_state_close(a.state(), before_a)
    assert_state_close(b.state(), before_b)
    assert sum(f"exchange with {b.id[-8:]}: refused ({reason})" in r.getMessage() for r in caplog.records) == 1


async def test_a_non_finite_model_fails_the_exchange_on_both_sides_and_earns_a_strike(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with peers(2) as (a, b):
        a.steps(1)
        b.steps(1)
        with torch.no_grad():
            next(a.trainer.model.parameters()).view(-1)[0] = math.nan  # a's model is poisoned
        before_a, before_b = a.state(), b.state()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == "failed" and outcome.reason.startswith("PeerAborted: NonFiniteTensor")
        assert last(b)[0] == "failed" and last(b)[1].startswith("NonFiniteTensor")
        assert_state_close(b.state(), before_b)
        torch.testing.assert_close(a.state(), before_a, equal_nan=True)  # b refused before committing
    strikes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("strike")]
    assert strikes == [f"strike 1/3 for {a.id[-8:]}: {last(b)[1]}"]


async def test_a_scaled_model_is_rejected_before_any_merge_and_banned_at_once() -> None:
    net = MemoryNetwork()
    a, b = make_peer(net, "a", 0), make_peer(net, "b", 1, bans=BanList(strikes_to_ban=1))
    async with running(a, b):
        a.know(b)
        b.know(a)
        a.steps(1)
        b.steps(1)
        with torch.no_grad():
            for p in a.trainer.model.parameters():
                p.mul_(1000)
        before_a, before_b = a.state(), b.state()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        result, reason = last(b)
        assert result == "rejected" and "more than 3x our norm" in reason
        assert (outcome.result, outcome.reason) == ("failed", f"PeerAborted: your model was rejected: {reason}")
        assert_state_close(a.state(), before_a)
        assert_state_close(b.state(), before_b)
        assert b.averager.bans.is_banned(a.id) and a.id not in b.averager.table.members


async def test_an_inflated_work_claim_is_capped_and_struck(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with peers(2) as (liar, honest):
        liar.steps(1)
        honest.steps(1)
        liar.trainer.weight = 1e6  # claims a million samples after one step
        s_liar, s_honest = liar.state(), honest.state()
        outcome = await liar.averager.exchange_with(honest.id, honest.transport.addresses())
        await settled(liar, honest)
        assert outcome.result == "merged"
        # The honest side credits at most 4x its own weight (32): 128, not a million.
        assert last(honest) == ("merged", "work: partner holds 80% of the pair's work")
        assert_state_close(honest.state(), {n: s_honest[n] + 0.8 * (s_liar[n] - s_honest[n]) for n in s_honest})
        assert honest.trainer.weight == (BATCH + 4 * BATCH) / 2
    assert f"strike 1/3 for {liar.id[-8:]}: claimed work 1e+06 capped at 128 (ours 32)" in caplog.text


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
        assert (a.trainer.weight, a.trainer.fresh, b.trainer.fresh) == (64, 0, 0)
        a.steps(1)
        b.steps(3)  # now b did 3x a's work since the anchor both share, a is the stale side
        sa, sb = a.trainer.snapshot(), b.trainer.snapshot()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        share = 0.5 * 160 / 256 + 0.5 * 96 / 128  # (1 - κ)·w_b/(w_a + w_b) + κ·f_b/(f_a + f_b)
        assert outcome.reason == "outer step toward the work: partner holds 62% of the pair's work; partner did 75% of the fresh work: share 69%"
        assert outcome.remote_share == pytest.approx(share)
        assert b.averager.recent[-1].remote_share == pytest.approx(1 - share)
        expected = {n: sa.state[n] + share * (sb.state[n] - sa.state[n]) for n in sa.state}
        assert_state_close(a.state(), expected)
        assert_state_close(b.state(), expected)
        assert a.trainer.weight + b.trainer.weight == 96 + 160 and a.trainer.fresh == b.trainer.fresh == 0


async def test_a_partner_that_states_no_fresh_work_leaves_the_outer_rule_to_the_weights() -> None:
    net = MemoryNetwork()
    outer, work = make_peer(net, "outer", 0, rule=averaging_outer()), make_peer(net, "work", 1, rule=WorkRule())
    async with running(outer, work):
        outer.steps(3)
        work.steps(1)
        outcome = await outer.averager.exchange_with(work.id, work.transport.addresses())
        await settled(outer, work)
        assert (outcome.reason, outcome.remote_share) == ("outer step toward the work: partner holds 25% of the pair's work", 0.25)
        assert last(work) == ("merged", "work: partner holds 75% of the pair's work")


async def test_a_fresh_work_claim_is_capped_at_the_credited_weight() -> None:
    net = MemoryNetwork()
    liar, honest = (make_peer(net, f"peer{i}", i, rule=averaging_outer()) for i in range(2))
    async with running(liar, honest):
        liar.steps(1)
        honest.steps(1)
        liar.trainer.weight = liar.trainer.fresh = 1e6  # a million samples, all since its anchor
        await liar.averager.exchange_with(honest.id, honest.transport.addresses())
        await settled(liar, honest)
        # Credited 128 (4x ours) and so fresh 128 at most: shares 0.8 and 0.8, not ~0.9.
        assert honest.averager.recent[-1].remote_share == pytest.approx(0.8)


# --- failures and timeouts ---------------------------------------------------------------


async def test_a_partner_that_dies_mid_transfer_times_out_and_leaves_the_model_untouched() -> None:
    net = MemoryNetwork()
    a = make_peer(net, "a", 0)
    spec = a.trainer.spec
    victim = net.transport("victim")

    async def accept_then_stall(stream: ByteStream) -> None:
        ex = Exchange(Role.RESPONDER, AVERAGE, max_params_bytes=spec.wire_size("float32"))
        ex.receive_data(await stream.receive_some())
        assert isinstance(ex.next_event(), Offer)
        await stream.send_all(ex.send(Accept(10.0)))
        # Announce the model, send half a chunk, then silence.
        await stream.send_all(ex.send(Params("float32", spec.layout, spec.wire_size("float32"))))
        frame = encode_frame(Chunk(b"\0" * 1000))
        await stream.send_all(frame[: len(frame) // 2])
        await anyio.sleep_forever()

    victim.set_handler(AVERAGE_PROTOCOL, accept_then_stall)
    async with running(a), victim.run():
        a.steps(2)
        before = a.state()
        outcome = await a.averager.exchange_with(victim.peer_id, victim.addresses())
    assert (outcome.result, outcome.reason) == ("failed", f"timed out after {TIMEOUT:g}s")
    assert outcome.duration_s == pytest.approx(TIMEOUT)  # simulated: no real second passed
    assert_state_close(a.state(), before)
    assert not a.averager.in_exchange


async def test_an_initiator_that_stalls_after_its_offer_times_out_the_responder_which_stays_available() -> None:
    async with peers(3) as (a, b, c):
        for p in (a, b, c):
            p.steps(1)
        before = b.state()
        stream = await a.transport.open_stream(b.id, b.transport.addresses(), AVERAGE_PROTOCOL)
        offer = Offer("digits", b.trainer.fingerprint, 32.0)
        await stream.send_all(Exchange(Role.INITIATOR, AVERAGE).send(offer))  # ... then nothing more
        with anyio.fail_after(2 * TIMEOUT):
            while not b.averager.recent:
                await anyio.sleep(0.01)
        assert last(b) == ("failed", f"timed out after {TIMEOUT:g}s")
        assert_state_close(b.state(), before)
        outcome = await c.averager.exchange_with(b.id, b.transport.addresses())
        assert outcome.result == "merged"
        await stream.reset()


async def test_partitioned_peers_fail_at_once_and_merge_again_once_healed() -> None:
    async with peers(2) as (a, b):
        a.steps(1)
        b.steps(1)
        start = anyio.current_time()
        a.transport.blocked.add(b.id)
        cut = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert cut.result == "failed" and "partitioned (fault injection)" in cut.reason
        a.transport.blocked.clear()
        b.transport.blocked.add(a.id)  # b resets a's stream before anything is answered
        reset = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert reset.result == "failed"
        assert anyio.current_time() == start  # neither waited for a timeout
        b.transport.blocked.clear()
        healed = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert healed.result == "merged"


# --- state sync --------------------------------------------------------------------------


async def test_a_newcomer_adopts_a_live_peers_model_by_state_sync() -> None:
    async with peers(2) as (veteran, newcomer):
        veteran.steps(5)
        newcomer.know(veteran)
        outcome = await newcomer.averager.sync_from_swarm()
        assert (outcome.result, outcome.reason) == ("synced", f"adopted a model of weight {5 * BATCH}")
        assert_state_close(newcomer.state(), veteran.state())
        assert newcomer.trainer.weight == veteran.trainer.weight == 5 * BATCH


async def test_a_resumed_peer_far_behind_catches_up_but_a_current_one_keeps_its_model() -> None:
    async with peers(3) as (veteran, stale, current):
        veteran.steps(10)
        stale.steps(1)
        current.steps(8)
        stale.know(veteran)
        current.know(veteran)
        before = current.state()
        caught_up = await stale.averager.sync_from_swarm(behind_ratio=2.0)
        kept = await current.averager.sync_from_swarm(behind_ratio=2.0)
        assert caught_up.result == "synced"
        assert_state_close(stale.state(), veteran.state())
        assert (kept.result, kept.reason) == ("kept", "peer's weight 320 is not 2x ours (256)")
        assert_state_close(current.state(), before)
        assert current.trainer.weight == 256


async def test_state_sync_is_refused_across_runs_and_a_stalled_peer_times_out() -> None:
    net = MemoryNetwork()
    newcomer, other = make_peer(net, "newcomer", 0), make_peer(net, "other", 1, run_id="other-run")
    staller = net.transport("staller")
    staller.set_handler(STATE_PROTOCOL, _stall)
    async with running(newcomer, other), staller.run():
        other.steps(1)
        before = newcomer.state()
        newcomer.know(other)
        refused = await newcomer.averager.sync_from_swarm(attempts=1)
        assert (refused.result, refused.reason) == (
            "failed", "StateSyncRefused: task mismatch: run id 'digits' != 'other-run'"
        )  # fmt: skip
        newcomer.averager.table.forget(other.id)
        newcomer.averager.table.observe(staller.peer_id, staller.addresses(), 0.0)
        stalled = await newcomer.averager.sync_from_swarm(attempts=1)
        assert stalled.result == "failed" and stalled.reason.startswith("TimeoutError")
        assert anyio.current_time() == pytest.approx(TIMEOUT)
        assert_state_close(newcomer.state(), before)
        assert newcomer.trainer.weight == 0
