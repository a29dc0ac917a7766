"""DCUtR wiring: which addresses from a peer's CONNECT are dialed, and how connections are told apart.

The hole punch itself, through real NAT routers, is in `tests/test_nat.py`.
"""

import multiaddr
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from murmur.node.net.holepunch import MAX_PUNCH_ADDRS, HolePuncher, connection_kinds, punch_addrs
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.relay import circuit_address


def _raw(*addrs: str) -> list[bytes]:
    return [multiaddr.Multiaddr(a).to_bytes() for a in addrs]


def test_only_plain_tcp_to_routable_ips_is_dialed() -> None:
    got = punch_addrs(_raw(
        "/ip4/198.51.100.7/tcp/4001",
        "/ip4/127.0.0.1/tcp/4001",  # our own machine: never
        "/ip4/0.0.0.0/tcp/4001",
        "/ip4/224.0.0.1/tcp/4001",
        "/ip4/198.51.100.7/tcp/4001/p2p-circuit",  # a relay, not a hole
        "/ip4/198.51.100.7/udp/4001/quic-v1",
        "/ip6/2001:db8::1/tcp/4002",
        "/ip4/198.51.100.7/tcp/4001",  # duplicate
    ) + [b"\x00\xffnot a multiaddr"])
    assert [str(a) for a in got] == ["/ip4/198.51.100.7/tcp/4001", "/ip6/2001:db8::1/tcp/4002"]
    many = _raw(*(f"/ip4/198.51.100.7/tcp/{p}" for p in range(4000, 4050)))
    assert len(punch_addrs(many)) == MAX_PUNCH_ADDRS


@pytest.mark.anyio
async def test_connections_on_loopback_are_direct() -> None:
    a = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    b = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        assert connection_kinds(a.host) == ({}, {})
        await a.host.connect(PeerInfo(b.host.get_id(), b.host.get_transport_addrs()))
        assert connection_kinds(a.host) == ({b.peer_id: "direct"}, {})
        # DCUtR sees the real listen address even when identify advertises announced ones only.
        assert a.puncher.host.get_addrs()[0].value_for_protocol("tcp") == a.host.get_transport_addrs()[0].value_for_protocol("tcp")



@pytest.mark.anyio
async def test_a_direct_connection_is_counted_even_after_dcutrs_cache_forgot_it() -> None:
    # py-libp2p drops a peer from its cache whenever any connection to it closes (a duplicate of a
    # simultaneous open, say); the punch must still be counted from the live connections.
    a = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    b = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/127.0.0.1/tcp/0"]):
        await a.host.connect(PeerInfo(b.host.get_id(), b.host.get_transport_addrs()))
        a.puncher.on_peer_disconnected(b.host.get_id())
        assert await a.puncher.initiate_hole_punch(b.host.get_id())
        assert list(a.puncher.punched) == [b.peer_id]

def test_dcutr_sees_only_punchable_addresses_of_a_peer() -> None:
    transport = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    peer = Libp2pTransport(create_new_key_pair()).host.get_id()
    transport.host.get_peerstore().add_addrs(peer, [multiaddr.Multiaddr(a) for a in (
        "/ip4/127.0.0.1/tcp/4001", "/ip4/0.0.0.0/tcp/4001", "/ip4/198.51.100.7/tcp/4001")], 600)
    assert [str(a) for a in transport.puncher.host.get_peerstore().addrs(peer)] == ["/ip4/198.51.100.7/tcp/4001"]
    assert len(transport.host.get_peerstore().addrs(peer)) == 3  # the host's own view is untouched


@pytest.mark.anyio
async def test_both_ends_of_a_circuit_see_it_relayed_and_name_the_relay() -> None:
    relay = Libp2pTransport(create_new_key_pair(), relay_service=True)
    async with relay.run(["/ip4/127.0.0.1/tcp/0"]):
        relay_addr = relay.listen_addresses()[0]
        b = Libp2pTransport(create_new_key_pair(), relays=[relay_addr])
        a = Libp2pTransport(create_new_key_pair())
        async with b.run(["/ip4/127.0.0.1/tcp/0"]), a.run(["/ip4/127.0.0.1/tcp/0"]):
            await a.relay.dial(circuit_address(relay_addr, b.peer_id))
            for me, other in ((a, b), (b, a)):  # the dialing end, and the accepting one
                kinds, via = connection_kinds(me.host)
                assert (kinds[other.peer_id], kinds[relay.peer_id]) == ("relayed", "direct")
                assert via == {other.peer_id: relay.peer_id}


class _Conn:
    def __init__(self, peer_id, addr: str) -> None:
        self.peer_id, self._addr = peer_id, multiaddr.Multiaddr(addr)

    def get_transport_addresses(self) -> list:
        return [self._addr]


class _Stream:
    """Records what the DCUtR handler does with it."""

    def __init__(self, conn: _Conn) -> None:
        self.muxed_conn, self.calls = conn, []

    async def read(self, n: int = -1) -> bytes:
        self.calls.append("read")
        return b""

    async def write(self, data: bytes) -> None:
        self.calls.append("write")

    async def reset(self) -> None:
        self.calls.append("reset")

    async def close(self) -> None:
        self.calls.append("close")


@pytest.mark.anyio
async def test_dcutr_sessions_only_over_relayed_connections_and_few_per_peer() -> None:
    # Driven through py-libp2p's DCUtR stream handler, which HolePuncher overrides to guard it.
    now = [0.0]
    puncher = HolePuncher(Libp2pTransport(create_new_key_pair()).host, clock=lambda: now[0])
    peer = Libp2pTransport(create_new_key_pair()).host.get_id()
    direct = _Stream(_Conn(peer, "/ip4/198.51.100.7/tcp/4001"))
    await puncher._handle_dcutr_stream(direct)
    assert direct.calls == ["reset"]  # refused before reading a byte
    relayed = [_Stream(_Conn(peer, f"/p2p/{peer}/p2p-circuit/p2p/{peer}")) for _ in range(5)]
    for stream in relayed[:4]:
        await puncher._handle_dcutr_stream(stream)
    assert [s.calls[0] for s in relayed[:4]] == ["read", "read", "read", "reset"]  # the 4th within a minute is refused
    now[0] = 61.0
    await puncher._handle_dcutr_stream(relayed[4])
    assert relayed[4].calls[0] == "read"  # a minute later the peer may try again
