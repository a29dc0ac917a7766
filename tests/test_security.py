"""Allow-lists, the swarm secret, bans and stream caps, over the conformance transports."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.security import BanList, GuardedTransport, load_allow_list, load_secret
from murmur.node.net.transport import ByteStream, MemoryNetwork, Transport, TransportError

pytestmark = pytest.mark.anyio
ECHO = "/test/echo/1.0.0"
SECRET = b"correct horse battery staple"


async def echo(stream: ByteStream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)
    await stream.close()


@asynccontextmanager
async def pair(kind: str, a_kwargs: dict, b_kwargs: dict) -> AsyncIterator[tuple[Transport, Transport]]:
    if kind == "libp2p":
        inner_a, inner_b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    else:
        net = MemoryNetwork()
        inner_a, inner_b = net.transport("a"), net.transport("b")
    a, b = GuardedTransport(inner_a, **a_kwargs), GuardedTransport(inner_b, **b_kwargs)
    b.set_handler(ECHO, echo)
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        yield a, b


async def round_trip(a: Transport, b: Transport) -> bytes:
    with anyio.fail_after(20):
        stream = await a.open_stream(b.peer_id, b.addresses(), ECHO)
        await stream.send_all(b"hello")
        data = b""
        while len(data) < 5 and (chunk := await stream.receive_some()):
            data += chunk
        await stream.close()
        return data


@pytest.fixture(params=["libp2p", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_holders_of_the_secret_talk(kind: str) -> None:
    async with pair(kind, {"secret": SECRET}, {"secret": SECRET}) as (a, b):
        assert await round_trip(a, b) == b"hello"


async def test_a_wrong_secret_is_refused_and_struck(kind: str) -> None:
    async with pair(kind, {"secret": b"x" * 20}, {"secret": SECRET, "bans": BanList(strikes_to_ban=1)}) as (a, b):
        with pytest.raises(TransportError, match="failed swarm-secret authentication"):
            await round_trip(a, b)
        with anyio.fail_after(10):
            while not b.bans.is_banned(a.peer_id):  # one strike bans here: the strike was recorded
                await anyio.sleep(0.01)


async def test_a_peer_without_the_secret_gets_nothing(kind: str) -> None:
    async with pair(kind, {}, {"secret": SECRET}) as (a, b):
        with anyio.fail_after(20):
            stream = await a.open_stream(b.peer_id, b.addresses(), ECHO)
            await stream.send_all(b"x" * 32 + b"hello")  # a guessed nonce, then data
            reply = await stream.receive_some()
        assert b"hello" not in reply  # only the responder's challenge, never an echo


async def test_peers_off_the_allow_list_are_refused(kind: str, tmp_path: Path) -> None:
    async with pair(kind, {}, {"allow": set()}) as (a, b):
        assert b.refusal(a.peer_id) == "not on the allow-list"
        with pytest.raises((TransportError, AssertionError)):
            assert await round_trip(a, b) == b"hello"
    path = tmp_path / "allow.txt"
    path.write_text("# friends\n12D3KooWabc  # laptop\n\n12D3KooWdef\n")
    assert load_allow_list(path) == {"12D3KooWabc", "12D3KooWdef"}


async def test_banned_peers_are_refused_both_ways(kind: str) -> None:
    async with pair(kind, {}, {}) as (a, b):
        for _ in range(3):
            b.bans.strike(a.peer_id, "sent NaN")
        assert b.bans.is_banned(a.peer_id) and b.refusal(a.peer_id) == "banned"
        with pytest.raises((TransportError, AssertionError)):
            assert await round_trip(a, b) == b"hello"
        with pytest.raises(TransportError, match="banned"):
            await b.open_stream(a.peer_id, a.addresses(), ECHO)


def test_bans_survive_a_restart_and_expire(tmp_path: Path) -> None:
    bans = BanList(tmp_path / "bans.json", strikes_to_ban=2, ban_seconds=100)
    assert not bans.strike("evil", "scaled x1000", now=0.0)
    assert bans.strike("evil", "scaled x1000", now=1.0)
    reloaded = BanList(tmp_path / "bans.json")
    assert reloaded.is_banned("evil", now=50.0) and not reloaded.is_banned("evil", now=101.0)


def test_strikes_outside_the_window_do_not_add_up() -> None:
    bans = BanList(strikes_to_ban=2, window=10)
    bans.strike("p", "x", now=0.0)
    assert not bans.strike("p", "x", now=20.0)


def test_short_secrets_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(b"short\n")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        load_secret(tmp_path / "s")
