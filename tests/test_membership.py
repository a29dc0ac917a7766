"""Peer exchange (`/murmur/peers`) over the in-memory transport, under Trio's MockClock."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import pytest
import trio.testing

from murmur.node.net.membership import PEERS_PROTOCOL, Membership, TaskIdentity, parse_bootstrap
from murmur.node.net.peers import PeerTable
from murmur.node.net.transport import ByteStream, MemoryNetwork

pytestmark = pytest.mark.anyio
HELLO_TIMEOUT = 3.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


@asynccontextmanager
async def members(*run_ids: str) -> AsyncIterator[list[Membership]]:
    net = MemoryNetwork()
    out = []
    async with AsyncExitStack() as stack:
        for i, run_id in enumerate(run_ids):
            transport = net.transport(f"peer{i}")
            membership = Membership(
                transport, PeerTable(transport.peer_id, liveness_timeout=1e9), TaskIdentity(run_id, "fingerprint"),
                rng=random.Random(i), hello_timeout=HELLO_TIMEOUT, clock=anyio.current_time,
            )  # fmt: skip
            transport.set_handler(PEERS_PROTOCOL, membership.serve)
            await stack.enter_async_context(transport.run())
            out.append(membership)
        yield out


def addrs(m: Membership) -> list[str]:
    return m.transport.addresses()


async def test_peer_exchange_learns_peers_it_was_not_told_about() -> None:
    async with members("digits", "digits", "digits") as (a, b, c):
        assert await c.greet(b.transport.peer_id, addrs(b)) == "ok"  # b knows c
        assert await a.greet(b.transport.peer_id, addrs(b)) == "ok"  # a bootstraps from b
        c_id = c.transport.peer_id
        assert a.table.candidates == {c_id: addrs(c)}  # rumoured, not yet a member
        assert await a.greet(c_id, a.table.candidates[c_id]) == "ok"
        assert a.table.members.keys() == {b.transport.peer_id, c_id}
        assert a.transport.peer_id in c.table.members and not a.table.candidates


async def test_another_task_is_refused_with_a_reason_both_sides_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="murmur")
    async with members("digits", "other-run") as (a, b):
        a_id, b_id = a.transport.peer_id, b.transport.peer_id
        result = await b.greet(a_id, addrs(a))
        assert result == "refused: task mismatch: run id 'other-run' != 'digits'"
        assert not a.table.members and not b.table.members
        assert not b.table.may_dial(a_id, anyio.current_time() + 29)  # backs off for 30 s
    logged = [r.getMessage() for r in caplog.records]
    assert f"refused peer {b_id[-8:]}: task mismatch: run id 'other-run' != 'digits'" in logged  # a's side
    assert f"peer {a_id[-8:]} refused us: task mismatch: run id 'other-run' != 'digits'" in logged  # b's side


async def test_a_leaving_peer_is_forgotten_by_those_it_greets() -> None:
    async with members("digits", "digits") as (a, b):
        assert await a.greet(b.transport.peer_id, addrs(b)) == "ok"
        assert a.transport.peer_id in b.table.members
        await a.announce_leaving()
        assert a.transport.peer_id not in b.table.members and not b.table.candidates


async def test_a_silent_peer_times_out_and_is_backed_off() -> None:
    async with members("digits") as (a,):
        net = a.transport.network
        silent = net.transport("silent")

        async def never_answer(stream: ByteStream) -> None:
            await anyio.sleep_forever()

        silent.set_handler(PEERS_PROTOCOL, never_answer)
        async with silent.run():
            result = await a.greet("silent", silent.addresses())
        assert result == "unreachable: no answer within 3 s"
        assert anyio.current_time() == pytest.approx(HELLO_TIMEOUT)  # simulated seconds
        assert not a.table.may_dial("silent", anyio.current_time()) and "silent" not in a.table.members
        assert (await a.greet("gone", ["/memory/gone/p2p/gone"])).startswith("unreachable: cannot open")


async def test_join_greets_every_bootstrap_peer_and_counts_the_answers() -> None:
    async with members("digits", "digits", "digits") as (a, b, c):
        bootstrap = [addrs(b)[0], addrs(c)[0], "/memory/gone/p2p/gone"]
        assert [parse_bootstrap(x)[0] for x in bootstrap] == [b.transport.peer_id, c.transport.peer_id, "gone"]
        assert await a.join(bootstrap) == 2
        assert a.table.members.keys() == {b.transport.peer_id, c.transport.peer_id}


async def test_an_alone_node_retries_its_bootstrap_with_backoff_until_it_joins(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="murmur")
    async with members("digits") as (a,):
        late = a.transport.network.transport("late")  # the bootstrap peer, not up yet
        bootstrap = "/memory/late/p2p/late"
        attempts: list[float] = []
        greet_bootstrap = a.greet_bootstrap

        async def counted(addr: str) -> str:
            attempts.append(anyio.current_time())
            return await greet_bootstrap(addr)

        a.greet_bootstrap = counted  # type: ignore[method-assign]
        assert a.alone_reason([]) == "no bootstrap peers given: waiting for peers to join this one"
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.run, [bootstrap], 1.0)
            await anyio.sleep(300)
            gaps = [t1 - t0 for t0, t1 in itertools.pairwise(attempts)]
            # Each wait at least doubles the one before, up to the 60 s cap; it keeps trying past the cap.
            assert [g >= min(2**i, 60) for i, g in enumerate(gaps)] == [True] * len(gaps)
            assert max(gaps) < 60 + 1.2 * 2 and len(attempts) >= 7
            assert a.join_results[bootstrap].startswith("unreachable: ")
            assert a.alone_reason([bootstrap]) == "/memory/late: " + a.join_results[bootstrap]

            late_membership = Membership(late, PeerTable("late", 1e9), TaskIdentity("digits", "fingerprint"), rng=random.Random(9))
            late.set_handler(PEERS_PROTOCOL, late_membership.serve)
            async with late.run():
                await anyio.sleep(61.2 * 2)
                assert "late" in a.table.members and a.join_results[bootstrap] == "ok"
                assert a.alone_reason([bootstrap]) is None
                joined_after = len(attempts)
                await anyio.sleep(300)
                assert len(attempts) == joined_after  # a member known: no more bootstrap retries
                tg.cancel_scope.cancel()
    logged = [r.getMessage() for r in caplog.records if r.name == "murmur.membership"]
    # One warning per distinct reason, not one per retry; then one line when it joins.
    assert [m for m in logged if m.startswith("bootstrap /memory/late:")] == [
        "bootstrap /memory/late: unreachable: cannot open /murmur/peers/1.0.0 to late: unreachable",
        "bootstrap /memory/late: joined"]


async def test_a_refusing_bootstrap_is_an_alone_reason() -> None:
    async with members("digits", "other-run") as (a, b):
        bootstrap = addrs(b)[0]
        assert await a.join([bootstrap]) == 0
        assert a.alone_reason([bootstrap]) == "/memory/peer1: refused: task mismatch: run id 'digits' != 'other-run'"
