"""Averaging over real libp2p (TCP, Noise, yamux on 127.0.0.1): one merge and one state sync.

The averager's behaviour in detail is unit-tested on the in-memory transport
(`tests/test_averager.py`, `test_averager_faults.py`, `test_state_sync.py`); this keeps the real path covered end to end.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
from averager_harness import assert_state_close
from libp2p.crypto.ed25519 import create_new_key_pair

from lab.outer_merge import OuterRule
from murmur.node.averaging.averager import AVERAGE_PROTOCOL, Averager
from murmur.node.averaging.factory import build_averager
from murmur.node.averaging.outcome import Result
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.rules import MergeRule, WorkRule
from murmur.node.learn.tasks import DigitsTask
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.peers import PeerTable
from murmur.node.net.transport import TransportError
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Accept, Chunk, Offer, Params, encode_frame

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def libp2p_peers(n: int, rule: Callable[[], MergeRule] = WorkRule) -> AsyncIterator[list[tuple[Libp2pTransport, Averager, TrainingLoop]]]:
    async with AsyncExitStack() as stack:
        out = []
        for i in range(n):
            transport = Libp2pTransport(create_new_key_pair())
            loop = TrainingLoop(DigitsTask(), shard=i, rule=rule())
            table = PeerTable(transport.peer_id, liveness_timeout=1e9)
            averager = build_averager(transport, loop.replica, table=table, rng=random.Random(i), exchange_timeout=10.0)
            await stack.enter_async_context(transport.run(["/ip4/127.0.0.1/tcp/0"]))
            out.append((transport, averager, loop))
        yield out


async def test_two_libp2p_peers_merge_once_to_the_work_weighted_mean() -> None:
    async with libp2p_peers(2) as [(_, a, la), (tb, b, lb)]:
        for _ in range(3):
            la.step()
        lb.step()
        sa, sb = a.replica.snapshot(), b.replica.snapshot()
        with anyio.fail_after(20):
            outcome = await a.exchange_with(tb.peer_id, tb.addresses())
            while b.outcomes[Result.MERGED] < 1:  # the responder finishes a moment after the initiator
                await anyio.sleep(0.01)
        assert (outcome.result, outcome.reason) == (Result.MERGED, "work: partner holds 25% of the pair's work")
        expected = {n: (3 * sa.state[n] + sb.state[n]) / 4 for n in sa.state}
        assert_state_close(a.replica.snapshot().state, expected)
        assert_state_close(b.replica.snapshot().state, expected)
        assert a.replica.work == b.replica.work == (sa.work + sb.work) / 2


async def test_outer_peers_discount_the_staler_side_over_libp2p() -> None:
    async with libp2p_peers(2, lambda: OuterRule(lr=1.0, momentum=0.0, discount=0.5)) as [(_, a, la), (tb, b, lb)]:
        for steps_a, steps_b, merges in ((3, 1, 1), (1, 3, 2)):  # the second time, a is the stale side
            for _ in range(steps_a):
                la.step()
            for _ in range(steps_b):
                lb.step()
            with anyio.fail_after(20):
                outcome = await a.exchange_with(tb.peer_id, tb.addresses())
                while b.outcomes[Result.MERGED] < merges:
                    await anyio.sleep(0.01)
        # weights 96 and 160, fresh work 32 and 96: (1 - κ)·160/256 + κ·96/128
        assert outcome.remote_share == pytest.approx(0.5 * 160 / 256 + 0.5 * 96 / 128)
        assert b.recent[-1].remote_share == pytest.approx(1 - outcome.remote_share)
        assert a.replica.fresh == b.replica.fresh == 0
        assert_state_close(a.replica.snapshot().state, b.replica.snapshot().state)


async def test_a_newcomer_syncs_a_libp2p_peers_model() -> None:
    async with libp2p_peers(2) as [(tv, veteran, lv), (_, newcomer, _)]:
        for _ in range(5):
            lv.step()
        newcomer.table.observe(tv.peer_id, tv.addresses(), 0.0)
        with anyio.fail_after(20):
            outcome = await newcomer.state_sync.sync_from_swarm()
        assert outcome.result == Result.SYNCED and outcome.partner == tv.peer_id
        assert_state_close(newcomer.replica.snapshot().state, veteran.replica.snapshot().state)
        assert newcomer.replica.work == veteran.replica.work


async def test_a_trickling_initiator_is_cut_off_at_the_exchange_timeout_and_the_responder_merges_next() -> None:
    # The averaging case of tests/test_trickle.py (simulated time) over real libp2p, in real time.
    async with libp2p_peers(2) as [(tv, victim, lv), (_, honest, lh)], AsyncExitStack() as stack:
        victim.timeout_s = 2.0  # the bound under test; the default (10 s plus the transfer time) would only be slower
        trickler = Libp2pTransport(create_new_key_pair())
        await stack.enter_async_context(trickler.run(["/ip4/127.0.0.1/tcp/0"]))
        lv.step()
        lh.step()
        spec = victim.replica.spec
        stream = await trickler.open_stream(tv.peer_id, tv.addresses(), AVERAGE_PROTOCOL)
        ex = Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=spec.wire_size("float32"))
        await stream.send_all(ex.send(Offer(victim.identity.run_id, victim.replica.fingerprint, 32.0, "float32")))
        with anyio.fail_after(20):
            while not isinstance(ex.next_event(), Accept):
                ex.receive_data(await stream.receive_some())
        await stream.send_all(ex.send(Params("float32", spec.layout, spec.wire_size("float32"))))
        frame = encode_frame(Chunk(b"\0" * 4096))
        with anyio.fail_after(20):
            with pytest.raises(TransportError):  # the victim resets the stream at its timeout
                for start in range(0, len(frame), 4):  # a few bytes every 0.1 s: 40 bytes/s
                    await stream.send_all(frame[start : start + 4])
                    await anyio.sleep(0.1)
            while not victim.recent:
                await anyio.sleep(0.01)
        failed = victim.recent[-1]
        assert (failed.result, failed.partner, failed.reason) == (Result.FAILED, trickler.peer_id, "timed out after 2s")
        assert not victim.in_exchange
        with anyio.fail_after(20):
            merged = await honest.exchange_with(tv.peer_id, tv.addresses())
        assert merged.result == Result.MERGED, merged.reason
