"""Averaging and state sync between real libp2p hosts over loopback, in one Trio process."""

import logging
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair

from node.averaging.averager import AVERAGE_PROTOCOL, Averager
from node.averaging.factory import build_averager
from node.learn.tasks import DigitsTask
from node.learn.trainer import Trainer
from node.net.libp2p_transport import Libp2pTransport
from node.net.membership import PEERS_PROTOCOL, Membership
from node.net.peers import PeerTable
from node.net.transport import ByteStream
from protocol.exchange import AVERAGE, Exchange, Role
from protocol.messages import Accept, Chunk, Offer, Params, encode_frame

pytestmark = pytest.mark.anyio


@dataclass
class Peer:
    transport: Libp2pTransport
    trainer: Trainer
    table: PeerTable
    averager: Averager
    membership: Membership

    @property
    def id(self) -> str:
        return self.transport.peer_id

    def state(self) -> dict[str, torch.Tensor]:
        return self.trainer.snapshot().state

    def know(self, *others: "Peer") -> None:
        for other in others:
            self.table.observe(other.id, other.transport.addresses(), 0.0)


@asynccontextmanager
async def peers(n: int, run_ids: list[str] | None = None, timeout: float = 5.0) -> AsyncIterator[list[Peer]]:
    async with AsyncExitStack() as stack:
        out = []
        for i in range(n):
            transport = Libp2pTransport(create_new_key_pair())
            trainer = Trainer(DigitsTask(), shard=i)
            table = PeerTable(transport.peer_id, liveness_timeout=1e9)
            rng = random.Random(i)
            averager = build_averager(
                transport, trainer, run_id=(run_ids or ["digits"] * n)[i], table=table, rng=rng, exchange_timeout=timeout
            )
            membership = Membership(transport, table, averager.identity, rng=rng, clock=lambda: 0.0)
            transport.set_handler(PEERS_PROTOCOL, membership.serve)
            await stack.enter_async_context(transport.run(["/ip4/127.0.0.1/tcp/0"]))
            out.append(Peer(transport, trainer, table, averager, membership))
        yield out


async def wait_until(predicate, timeout: float = 10.0) -> None:
    """Poll `predicate` (bounded): the responder finishes a moment after the initiator."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def train_steps(peer: Peer, n: int) -> None:
    for _ in range(n):
        peer.trainer.step()


def assert_state_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)


async def test_exchange_merges_to_the_work_weighted_mean() -> None:
    async with peers(2) as (a, b):
        train_steps(a, 3)
        train_steps(b, 1)
        sa, sb = a.trainer.snapshot(), b.trainer.snapshot()
        with anyio.fail_after(20):
            outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert outcome.result == "merged", outcome.reason
        assert outcome.reason == "work: partner holds 25% of the pair's work"
        await wait_until(lambda: b.averager.outcomes["merged"] == 1)
        expected = {n: (sa.weight * sa.state[n] + sb.weight * sb.state[n]) / (sa.weight + sb.weight) for n in sa.state}
        assert_state_close(a.state(), expected)
        assert_state_close(b.state(), expected)
        assert a.trainer.weight == b.trainer.weight == (sa.weight + sb.weight) / 2


@pytest.mark.parametrize(("wire_dtype", "resolution"), [("bfloat16", 2**-8), ("int8", 1 / 127)])
async def test_lossy_wire_dtypes_move_both_sides_by_the_difference_of_their_quantized_models(
    wire_dtype: str, resolution: float
) -> None:
    async with peers(2) as (a, b):
        train_steps(a, 3)
        train_steps(b, 1)
        a.averager.wire_dtype = wire_dtype  # the initiator's choice binds both sides
        exact_a, exact_b = a.trainer.snapshot(), b.trainer.snapshot()
        qa, qb = a.trainer.snapshot(wire_dtype).state, b.trainer.snapshot(wire_dtype).state
        with anyio.fail_after(20):
            outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        assert outcome.result == "merged", outcome.reason
        assert outcome.bytes_sent == a.trainer.spec.wire_size(wire_dtype)
        await wait_until(lambda: b.averager.outcomes["merged"] == 1)
        wa, wb = exact_a.weight, exact_b.weight
        share = wb / (wa + wb)
        # Both apply the same quantized difference with opposite signs: models that agree stay put.
        assert_state_close(a.state(), {n: exact_a.state[n] + share * (qb[n] - qa[n]) for n in qa})
        assert_state_close(b.state(), {n: exact_b.state[n] + (1 - share) * (qa[n] - qb[n]) for n in qb})
        for name in qa:  # ... and land within the wire's resolution of the exact merge
            mean = (wa * exact_a.state[name] + wb * exact_b.state[name]) / (wa + wb)
            scale = max(exact_a.state[name].abs().max(), exact_b.state[name].abs().max())
            assert (a.state()[name] - mean).abs().max() <= resolution * scale


async def test_busy_partner_answers_at_once_and_initiator_tries_another() -> None:
    async with peers(3) as (a, b, c):
        for p in (a, b, c):
            train_steps(p, 1)
        a.know(b, c)
        b.averager.in_exchange = True  # b is in the middle of another exchange
        with anyio.fail_after(20):
            busy = await a.averager.exchange_with(b.id, b.transport.addresses())
            assert (busy.result, busy.reason) == ("busy", "already in an exchange")
            outcome = await a.averager.average_once(max_attempts=3)
        assert outcome.result == "merged" and outcome.partner == c.id


async def test_two_peers_picking_each_other_do_not_deadlock() -> None:
    async with peers(2) as (a, b):
        train_steps(a, 1)
        train_steps(b, 1)
        results = {}

        async def go(x: Peer, y: Peer) -> None:
            results[x.id] = await x.averager.exchange_with(y.id, y.transport.addresses())

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(go, a, b)
                tg.start_soon(go, b, a)
        assert {o.result for o in results.values()} <= {"merged", "busy"}
        await wait_until(lambda: not a.averager.in_exchange and not b.averager.in_exchange)


async def test_partner_vanishing_mid_transfer_leaves_model_untouched() -> None:
    async with peers(1, timeout=1.0) as (a,):
        train_steps(a, 2)
        before = a.state()
        victim = Libp2pTransport(create_new_key_pair())
        trainer = Trainer(DigitsTask(), shard=9)

        async def accept_then_stall(stream: ByteStream) -> None:
            ex = Exchange(Role.RESPONDER, AVERAGE, max_params_bytes=trainer.spec.wire_size("float32"))
            ex.receive_data(await stream.receive_some())
            assert isinstance(ex.next_event(), Offer)
            await stream.send_all(ex.send(Accept(10.0)))
            # Announce the model, send half a chunk, then silence: a partner that died mid-transfer.
            await stream.send_all(ex.send(Params("float32", trainer.spec.layout, trainer.spec.wire_size("float32"))))
            frame = encode_frame(Chunk(b"\0" * 1000))
            await stream.send_all(frame[: len(frame) // 2])
            await anyio.sleep_forever()

        victim.set_handler(AVERAGE_PROTOCOL, accept_then_stall)
        async with victim.run(["/ip4/127.0.0.1/tcp/0"]):
            with anyio.fail_after(20):
                outcome = await a.averager.exchange_with(victim.peer_id, victim.addresses())
        assert (outcome.result, outcome.reason) == ("failed", "timed out after 1s")
        assert_state_close(a.state(), before)
        assert not a.averager.in_exchange


async def test_invalid_tensors_are_rejected_before_any_merge() -> None:
    async with peers(2) as (a, b):
        train_steps(a, 1)
        train_steps(b, 1)
        before, a_before = b.state(), a.state()
        evil = a.trainer.snapshot()
        evil.state.tensors[next(iter(evil.state))].view(-1)[0] = float("nan")
        original_snapshot = a.trainer.snapshot
        a.trainer.snapshot = lambda *wire_dtype: evil  # a sends a poisoned model
        with anyio.fail_after(20):
            outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        a.trainer.snapshot = original_snapshot
        assert outcome.result == "failed" and "NonFiniteTensor" in outcome.reason
        await wait_until(lambda: b.averager.outcomes["failed"] == 1)
        assert_state_close(b.state(), before)
        assert_state_close(a.state(), a_before)  # b refused before committing, so a merged nothing either


async def test_newcomer_adopts_a_live_peers_model_by_state_sync() -> None:
    async with peers(2) as (veteran, newcomer):
        train_steps(veteran, 5)
        newcomer.know(veteran)
        with anyio.fail_after(20):
            outcome = await newcomer.averager.sync_from_swarm()
        assert outcome.result == "synced"
        assert_state_close(newcomer.state(), veteran.state())
        assert newcomer.trainer.weight == veteran.trainer.weight == 5 * 32


async def test_peer_exchange_learns_peers_it_was_not_told_about() -> None:
    async with peers(3) as (a, b, c):
        with anyio.fail_after(20):
            assert await c.membership.greet(b.id, b.transport.addresses()) == "ok"  # b knows c
            assert await a.membership.greet(b.id, b.transport.addresses()) == "ok"  # a bootstraps from b
            assert c.id in a.table.candidates
            await a.membership.greet(c.id, a.table.candidates[c.id])
        assert {b.id, c.id} <= a.table.members.keys()
        assert a.id in c.table.members


async def test_task_mismatch_is_refused_with_a_reason_both_sides_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with peers(2, run_ids=["digits", "other-run"]) as (a, b):
        with anyio.fail_after(20):
            result = await b.membership.greet(a.id, a.transport.addresses())
            outcome = await b.averager.exchange_with(a.id, a.transport.addresses())
        assert result == "refused: task mismatch: run id 'other-run' != 'digits'"
        assert outcome.result == "refused" and "task mismatch" in outcome.reason
        assert b.id not in a.table.members and a.id not in b.table.members
        logged = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"refused peer {b.id[-8:]}: task mismatch") for m in logged)  # a's side
        assert any(m.startswith(f"peer {a.id[-8:]} refused us: task mismatch") for m in logged)  # b's side


async def test_resumed_peer_far_behind_catches_up_but_a_current_one_keeps_its_model() -> None:
    async with peers(3) as (veteran, stale, current):
        train_steps(veteran, 10)
        train_steps(stale, 1)
        train_steps(current, 8)
        stale.know(veteran)
        current.know(veteran)
        with anyio.fail_after(20):
            caught_up = await stale.averager.sync_from_swarm(behind_ratio=2.0)
            kept = await current.averager.sync_from_swarm(behind_ratio=2.0)
        assert caught_up.result == "synced"
        assert_state_close(stale.state(), veteran.state())
        assert (kept.result, kept.reason) == ("kept", "peer's weight 320 is not 2x ours (256)")
        assert current.trainer.weight == 256
