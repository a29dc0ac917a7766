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
