"""The node's host speaks Noise only: plaintext and secio dialers are refused."""

import anyio
import multiaddr
import pytest
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.secio.transport import ID as SECIO_ID
from libp2p.security.secio.transport import Transport as SecioTransport

from murmur.node.net.libp2p_transport import Libp2pTransport

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("scheme", ["plaintext", "secio"])
async def test_dialer_without_noise_is_refused(scheme: str) -> None:
    node = Libp2pTransport(create_new_key_pair())
    key_pair = create_new_key_pair()
    security = (
        {PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)} if scheme == "plaintext" else {SECIO_ID: SecioTransport(key_pair)}
    )
    dialer = new_host(key_pair=key_pair, sec_opt=security)
    async with node.run(["/ip4/127.0.0.1/tcp/0"]), dialer.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        addr = multiaddr.Multiaddr(node.addresses()[0].split("/p2p/")[0])
        with anyio.fail_after(20), pytest.raises(Exception):  # noqa: B017  (py-libp2p raises several types here)
            await dialer.connect(PeerInfo(ID.from_base58(node.peer_id), [addr]))
        assert ID.from_base58(node.peer_id) not in dialer.get_connected_peers()
        assert not node.host.get_connected_peers()


async def test_noise_dialer_connects() -> None:
    a, b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        with anyio.fail_after(20):
            await a.host.connect(PeerInfo(ID.from_base58(b.peer_id), [multiaddr.Multiaddr(b.addresses()[0].split("/p2p/")[0])]))
        assert ID.from_base58(b.peer_id) in a.host.get_connected_peers()


async def test_standard_identify_and_ping_answer() -> None:
    from libp2p.host.ping import PingService
    from libp2p.identity.identify.identify import ID as IDENTIFY
    from libp2p.identity.identify.identify import parse_identify_response

    node, client = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    async with node.run(["/ip4/127.0.0.1/tcp/0"]), client.run(["/ip4/127.0.0.1/tcp/0"]):
        peer = ID.from_base58(node.peer_id)
        with anyio.fail_after(20):
            await client.host.connect(PeerInfo(peer, [multiaddr.Multiaddr(node.addresses()[0].split("/p2p/")[0])]))
            rtts = await PingService(client.host).ping(peer, ping_amt=2)
            stream = await client.host.new_stream(peer, [IDENTIFY])
            raw = b""
            while chunk := await _read_or_eof(stream):
                raw += chunk
        assert len(rtts) == 2
        info = parse_identify_response(raw)
        assert "/ipfs/ping/1.0.0" in info.protocols and info.listen_addrs


async def _read_or_eof(stream) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    try:
        return await stream.read()
    except StreamEOF:
        return b""


async def test_a_write_cancelled_on_its_way_to_the_socket_still_goes_out_whole() -> None:
    # py-libp2p encrypts a Noise message before it awaits the socket; a write cancelled in
    # between lost that message and its nonce, so the peer failed to decrypt the next one
    # and dropped the connection (the live fuzz test's flake, under CPU load).
    from murmur.node.net.transport import ByteStream

    a, b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    received: list[bytes] = []

    async def collect(stream: ByteStream) -> None:
        while chunk := await stream.receive_some():
            received.append(chunk)

    b.set_handler("/test/collect", collect)
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        with anyio.fail_after(20):
            stream = await a.open_stream(b.peer_id, b.addresses(), "/test/collect")
            await stream.send_all(b"first ")
            # Slow the socket write that follows encryption, and cancel the write meanwhile.
            noise = stream._stream.muxed_conn.secured_conn.conn  # type: ignore[attr-defined]
            to_socket = noise.read_writer.write_msg

            async def slow_socket(msg: bytes) -> None:
                await anyio.sleep(0.2)
                await to_socket(msg)

            noise.read_writer.write_msg = slow_socket
            with anyio.move_on_after(0.05) as cancelled:
                await stream.send_all(b"second ")
            noise.read_writer.write_msg = to_socket
            await stream.send_all(b"third")
            await stream.close()
            while b"".join(received) != b"first second third":
                assert ID.from_base58(a.peer_id) in b.host.get_connected_peers(), b"".join(received)
                await anyio.sleep(0.02)
        assert cancelled.cancel_called
        # The same connection still carries new streams both ways.
        with anyio.fail_after(20):
            again = await a.open_stream(b.peer_id, b.addresses(), "/test/collect")
            await again.send_all(b"!")
            await again.close()
            while b"".join(received) != b"first second third!":
                await anyio.sleep(0.02)
        assert len(a.host.get_network().get_connections(ID.from_base58(b.peer_id))) == 1


async def test_an_inbound_connection_leaves_no_task_and_no_inbound_slot_once_it_closed() -> None:
    from murmur.node.ops.node_status import current_trio_task_names

    def handlers() -> int:  # tasks serving an inbound TCP connection (the clients only dial out)
        return current_trio_task_names(top=100).get("trio._highlevel_serve_listeners._run_handler", 0)

    node = Libp2pTransport(create_new_key_pair())
    async with node.run(["/ip4/127.0.0.1/tcp/0"]):
        swarm = node.host.get_network()
        info = PeerInfo(ID.from_base58(node.peer_id), [multiaddr.Multiaddr(node.addresses()[0].split("/p2p/")[0])])
        for _ in range(5):  # each a new peer: connects, then hangs up
            client = Libp2pTransport(create_new_key_pair())
            async with client.run(["/ip4/127.0.0.1/tcp/0"]):
                with anyio.fail_after(20):
                    await client.host.connect(info)
                assert swarm._inbound_limiter.borrowed_tokens >= 1 and handlers() >= 1
                await client.hang_up(node.peer_id)
        with anyio.fail_after(20):  # the node notices each hang-up after a round trip
            while swarm._inbound_limiter.borrowed_tokens or swarm.get_connections():
                await anyio.sleep(0.05)
        assert handlers() == 0
