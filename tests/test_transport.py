"""One conformance suite for both transports: the real libp2p one and the in-memory one."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.transport import ByteStream, MemoryNetwork, Transport, TransportError

pytestmark = pytest.mark.anyio
ECHO = "/test/echo/1.0.0"
PAYLOAD = bytes(range(256)) * 4096  # 1 MiB: several yamux windows' worth


@asynccontextmanager
async def pair(kind: str) -> AsyncIterator[tuple[Transport, Transport]]:
    if kind == "libp2p":
        a, b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    else:
        net = MemoryNetwork()
        a, b = net.transport("a"), net.transport("b")
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        yield a, b


async def echo(stream: ByteStream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)
    await stream.close()


async def read_exactly(stream: ByteStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some()
        assert chunk, "EOF before all bytes arrived"
        buf += chunk
    return bytes(buf)


@pytest.fixture(params=["libp2p", "memory"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


async def test_round_trip_and_eof(kind: str) -> None:
    async with pair(kind) as (a, b):
        b.set_handler(ECHO, echo)
        with anyio.fail_after(20):
            stream = await a.open_stream(b.peer_id, b.addresses(), ECHO)
            assert stream.remote_peer == b.peer_id
            async with anyio.create_task_group() as tg:
                # Write and read concurrently: a stalled reader would stall the writer.
                tg.start_soon(stream.send_all, PAYLOAD)
                assert await read_exactly(stream, len(PAYLOAD)) == PAYLOAD
            await stream.close()
            assert await stream.receive_some() == b""


async def test_addresses_name_the_peer(kind: str) -> None:
    async with pair(kind) as (a, _):
        assert a.addresses() and all(addr.endswith(f"/p2p/{a.peer_id}") for addr in a.addresses())


async def test_unsupported_protocol_is_a_transport_error(kind: str) -> None:
    async with pair(kind) as (a, b):
        with anyio.fail_after(20), pytest.raises(TransportError):
            await a.open_stream(b.peer_id, b.addresses(), "/test/unknown/1.0.0")


async def test_unreachable_peer_is_a_transport_error(kind: str) -> None:
    async with pair(kind) as (a, b):
        addrs = b.addresses()
        peer_id = b.peer_id
    async with pair(kind) as (c, _):
        with anyio.fail_after(20), pytest.raises(TransportError):
            await c.open_stream(peer_id, addrs, ECHO)
