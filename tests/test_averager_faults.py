"""The averager under refusals, hostile partners, failures and timeouts, over the in-memory transport.

Simulated time and peers as in `test_averager.py` (`averager_harness`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import anyio
import anyio.lowlevel
import pytest
import torch
import trio.testing
from averager_harness import BATCH, TIMEOUT, Peer, assert_state_close, last, make_peer, peers, running, settled, stall

from murmur.node.averaging.averager import AVERAGE_PROTOCOL
from murmur.node.averaging.outcome import Result
from murmur.node.learn.rules import MergeDelta, WorkRule
from murmur.node.net.security import BanList
from murmur.node.net.transport import (
    ByteStream,
    MemoryNetwork,
)
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Accept, Chunk, Offer, Params, encode_frame

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


# --- busy, refused, rejected -------------------------------------------------------------


async def test_a_busy_partner_answers_at_once_and_the_initiator_tries_another() -> None:
    net = MemoryNetwork()
    a, b, c = (make_peer(net, name, i) for i, name in enumerate("abc"))
    staller = net.transport("staller")
    staller.set_handler(AVERAGE_PROTOCOL, stall)
    async with running(a, b, c), staller.run():
        for p in (a, b, c):
            p.steps(1)
        a.know(b, c)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.averager.exchange_with, staller.peer_id, staller.addresses())  # b waits out its timeout
            with anyio.fail_after(TIMEOUT / 2):
                while not b.averager.in_exchange:
                    await anyio.lowlevel.checkpoint()
            assert not b.averager.table.exchanging  # an attempt nobody answered keeps nobody alive
            start = anyio.current_time()
            busy = await a.averager.exchange_with(b.id, b.transport.addresses())
            assert (busy.result, busy.reason) == (Result.BUSY, "already in an exchange")
            outcome = await a.averager.average_once(max_attempts=3)
            assert anyio.current_time() == start  # no waiting on the busy partner
        assert outcome.result == Result.MERGED and outcome.partner == c.id
        assert last(b) == (Result.FAILED, f"timed out after {TIMEOUT:g}s")


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
        assert {o.result for o in results.values()} <= {Result.MERGED, Result.BUSY}
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
    assert (outcome.result, outcome.reason) == (Result.REFUSED, reason)
    assert last(a) == (Result.REFUSED, reason)
    assert_state_close(a.state(), before_a)
    assert_state_close(b.state(), before_b)
    assert sum(f"exchange with {b.id[-8:]}: refused ({reason})" in r.getMessage() for r in caplog.records) == 1


async def test_a_non_finite_model_fails_the_exchange_on_both_sides_and_earns_a_strike(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with peers(2) as (a, b):
        a.steps(1)
        b.steps(1)
        with torch.no_grad():
            next(a.replica.model.parameters()).view(-1)[0] = math.nan  # a's model is poisoned
        before_a, before_b = a.state(), b.state()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.FAILED and outcome.reason.startswith("PeerAborted: NonFiniteTensor")
        assert last(b)[0] == Result.FAILED and last(b)[1].startswith("NonFiniteTensor")
        assert_state_close(b.state(), before_b)
        torch.testing.assert_close(a.state(), before_a, equal_nan=True)  # b refused before committing
    strikes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("strike")]
    assert strikes == [f"strike 1/3 for {a.id[-8:]}: {last(b)[1]}"]


class _OverflowingRule(WorkRule):
    """A test-only rule whose merge overflows: finite models in, a non-finite one out."""

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> MergeDelta:
        return MergeDelta(snapshot, {n: t * 1e39 for n, t in remote.items()}, share)


async def test_a_merge_that_would_not_be_finite_is_rejected_and_the_model_kept() -> None:
    net = MemoryNetwork()
    a, b = make_peer(net, "a", 0), make_peer(net, "b", 1, rule=_OverflowingRule())
    async with running(a, b):
        a.know(b)
        a.steps(1)
        b.steps(1)
        before_b, work_b = b.state(), b.replica.work
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        assert outcome.result == Result.MERGED  # both committed; a's rule merged finitely
        result, reason = last(b)
        assert result == Result.REJECTED and reason.startswith("MergeRefused: the merged model would not be finite")
        assert_state_close(b.state(), before_b)
        assert b.replica.work == work_b


async def test_a_scaled_model_is_rejected_before_any_merge_and_banned_at_once() -> None:
    net = MemoryNetwork()
    a, b = make_peer(net, "a", 0), make_peer(net, "b", 1, bans=BanList(strikes_to_ban=1))
    async with running(a, b):
        a.know(b)
        b.know(a)
        a.steps(1)
        b.steps(1)
        with torch.no_grad():
            for p in a.replica.model.parameters():
                p.mul_(1000)
        before_a, before_b = a.state(), b.state()
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        result, reason = last(b)
        assert result == Result.REJECTED and "more than 3x our norm" in reason
        assert (outcome.result, outcome.reason) == (Result.FAILED, f"PeerAborted: your model was rejected: {reason}")
        assert_state_close(a.state(), before_a)
        assert_state_close(b.state(), before_b)
        assert b.averager.bans.is_banned(a.id) and a.id not in b.averager.table.members


async def test_an_inflated_work_claim_is_capped_and_struck(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with peers(2) as (liar, honest):
        liar.steps(1)
        honest.steps(1)
        liar.replica.work = 1e6  # claims a million samples after one step
        s_liar, s_honest = liar.state(), honest.state()
        outcome = await liar.averager.exchange_with(honest.id, honest.transport.addresses())
        await settled(liar, honest)
        assert outcome.result == Result.MERGED
        # The honest side credits at most 4x its own weight (32): 128, not a million.
        assert last(honest) == (Result.MERGED, "work: partner holds 80% of the pair's work")
        assert_state_close(honest.state(), {n: s_honest[n] + 0.8 * (s_liar[n] - s_honest[n]) for n in s_honest})
        assert honest.replica.work == (BATCH + 4 * BATCH) / 2
    assert f"strike 1/3 for {liar.id[-8:]}: claimed work 1e+06 capped at 128 (ours 32)" in caplog.text


# --- failures and timeouts ---------------------------------------------------------------


async def test_a_partner_that_dies_mid_transfer_times_out_and_leaves_the_model_untouched() -> None:
    net = MemoryNetwork()
    a = make_peer(net, "a", 0)
    spec = a.replica.spec
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
    assert (outcome.result, outcome.reason) == (Result.FAILED, f"timed out after {TIMEOUT:g}s")
    assert outcome.duration_s == pytest.approx(TIMEOUT)  # simulated: no real second passed
    assert_state_close(a.state(), before)
    assert not a.averager.in_exchange


async def test_an_initiator_that_stalls_after_its_offer_times_out_the_responder_which_stays_available() -> None:
    async with peers(3) as (a, b, c):
        for p in (a, b, c):
            p.steps(1)
        before = b.state()
        stream = await a.transport.open_stream(b.id, b.transport.addresses(), AVERAGE_PROTOCOL)
        offer = Offer("digits", b.replica.fingerprint, 32.0)
        await stream.send_all(Exchange(Role.INITIATOR, AVERAGE).send(offer))  # ... then nothing more
        with anyio.fail_after(2 * TIMEOUT):
            while not b.averager.recent:
                await anyio.sleep(0.01)
        assert last(b) == (Result.FAILED, f"timed out after {TIMEOUT:g}s")
        assert_state_close(b.state(), before)
        outcome = await c.averager.exchange_with(b.id, b.transport.addresses())
        assert outcome.result == Result.MERGED
        await stream.reset()


async def test_partitioned_peers_fail_at_once_and_merge_again_once_healed() -> None:
    async with peers(2) as (a, b):
        a.steps(1)
        b.steps(1)
        start = anyio.current_time()
        a.transport.blocked.add(b.id)
        cut = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert cut.result == Result.FAILED and "partitioned (fault injection)" in cut.reason
        a.transport.blocked.clear()
        b.transport.blocked.add(a.id)  # b resets a's stream before anything is answered
        reset = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert reset.result == Result.FAILED
        assert anyio.current_time() == start  # neither waited for a timeout
        b.transport.blocked.clear()
        healed = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert healed.result == Result.MERGED
