"""AutoNAT: the verdict aggregator, the dial-back rules for untrusted requests, and real hosts on loopback.

Through real NAT (namespaces) in `tests/test_nat.py`.
"""

import random
from contextlib import AsyncExitStack
from types import SimpleNamespace

import anyio
import multiaddr
import pytest
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from murmur.node.net.autonat import (
    MAX_DIAL_BACK_ADDRS,
    PRIVATE,
    PUBLIC,
    UNKNOWN,
    AutoNatClient,
    RateLimit,
    Reachability,
    dial_back_candidates,
)
from murmur.node.net.libp2p_transport import Libp2pTransport

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def test_reachability_needs_agreeing_peers_and_forgets_old_verdicts() -> None:
    r = Reachability(confirmations=2, max_age=100)
    assert r.status(0) == (UNKNOWN, "no dial-back verdicts yet")
    r.record("s1", True, 0)
    r.record("s1", True, 1)  # one peer counts once, however often it answers
    assert r.status(1)[0] == UNKNOWN
    r.record("s2", True, 2)
    assert r.status(2) == (PUBLIC, "2 of 2 peers dialed us back")
    r.record("s3", False, 3)
    assert r.status(3)[0] == PUBLIC  # 2 yes, 1 no
    r.record("s1", False, 4)
    r.record("s2", False, 5)
    assert r.status(5) == (PRIVATE, "3 of 3 peers could not dial us back")
    assert r.status(104)[0] == PRIVATE  # s3 expired, s1 and s2 still count...
    assert r.status(300)[0] == UNKNOWN  # ...and once all expire, it is unknown again


def test_a_tie_goes_to_public_and_too_few_keep_the_last_status() -> None:
    r = Reachability(confirmations=2, max_age=100)
    r.record("a", False, 0)
    r.record("b", False, 0)
    assert r.status(0)[0] == PRIVATE
    r.record("c", True, 1)
    r.record("d", True, 1)  # a dial-back that worked is the stronger evidence
    assert r.status(1)[0] == PUBLIC
    r = Reachability(confirmations=3, max_age=100)
    for server in "abc":
        r.record(server, False, 0)
    assert r.status(0)[0] == PRIVATE
    r.record("a", True, 1)
    r.record("b", True, 1)  # 2 yes, 1 no: neither side confirmed
    assert r.status(1)[0] == PRIVATE


def test_rate_limit_per_key_and_overall() -> None:
    limit = RateLimit(per_key=10, burst=3, window=60)
    assert limit.allow("1.2.3.4", 0) is None
    assert "per peer" in limit.allow("1.2.3.4", 5)
    assert limit.allow("1.2.3.4", 10) is None
    assert limit.allow("5.6.7.8", 11) is None
    assert "at most 3" in limit.allow("9.9.9.9", 12)
    assert limit.allow("9.9.9.9", 70) is None  # the window moved on


def test_dial_back_uses_the_observed_ip_only() -> None:
    listed = [multiaddr.Multiaddr(a).to_bytes() for a in (
        "/ip4/203.0.113.9/tcp/4001",  # a third party's IP: only its port is used
        "/ip4/10.0.0.5/tcp/4002",
        "/ip4/10.0.0.5/udp/4003/quic-v1",  # not TCP: skipped
        "/ip4/10.0.0.5/tcp/4002",  # duplicate
    )] + [b"\xff\x00garbage"]
    got = [str(a) for a in dial_back_candidates(listed, "198.51.100.7")]
    assert got == ["/ip4/198.51.100.7/tcp/4001", "/ip4/198.51.100.7/tcp/4002"]
    many = [multiaddr.Multiaddr(f"/ip4/10.0.0.5/tcp/{p}").to_bytes() for p in range(1000, 1100)]
    assert len(dial_back_candidates(many, "198.51.100.7")) == MAX_DIAL_BACK_ADDRS
    assert dial_back_candidates(listed, None) == []
    assert dial_back_candidates(listed, "0.0.0.0") == []
    assert dial_back_candidates(listed, "not an ip") == []


def _dial_request(peer: ID, addrs: list[str]) -> Message:
    request = Message(type=Message.DIAL)
    request.dial.peer.id = peer.to_bytes()
    request.dial.peer.addrs.extend(multiaddr.Multiaddr(a).to_bytes() for a in addrs)
    return request


@pytest.mark.anyio
async def test_server_refuses_what_the_rules_forbid_and_dials_back_what_they_allow() -> None:
    server = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    client = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    async with server.run([LOOPBACK]), client.run([LOOPBACK]):
        port = client.host.get_transport_addrs()[0].value_for_protocol("tcp")
        me = client.host.get_id()
        answer = server.autonat_server.answer

        other = ID.from_pubkey(create_new_key_pair().public_key)
        reply = await answer(_dial_request(other, [f"/ip4/127.0.0.1/tcp/{port}"]), me, "127.0.0.1", False)
        assert reply.dialResponse.status == Message.E_DIAL_REFUSED  # a dial-back for someone else
        reply = await answer(_dial_request(me, [f"/ip4/127.0.0.1/tcp/{port}"]), me, "127.0.0.1", True)
        assert reply.dialResponse.statusText == "requests over relayed connections are refused"
        reply = await answer(Message(type=Message.DIAL_RESPONSE), me, "127.0.0.1", False)
        assert reply.dialResponse.status == Message.E_BAD_REQUEST

        reply = await answer(_dial_request(me, [f"/ip4/127.0.0.1/tcp/{port}"]), me, "127.0.0.1", False)
        assert reply.dialResponse.status == Message.OK
        assert multiaddr.Multiaddr(reply.dialResponse.addr) == multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
        assert me not in server.host.get_connected_peers()  # the dial-back connection was closed again

        reply = await answer(_dial_request(me, [f"/ip4/127.0.0.1/tcp/{port}"]), me, "127.0.0.1", False)
        assert "per peer" in reply.dialResponse.statusText  # rate-limited
        server.autonat_server.limit = type(server.autonat_server.limit)(0, 100, 60)
        closed = 1 if port != "1" else 2  # a port nobody listens on
        reply = await answer(_dial_request(me, [f"/ip4/127.0.0.1/tcp/{closed}"]), me, "127.0.0.1", False)
        assert reply.dialResponse.status == Message.E_DIAL_ERROR


@pytest.mark.anyio
async def test_peers_on_loopback_find_each_other_public() -> None:
    transports = [Libp2pTransport(create_new_key_pair(), nat_traversal=True) for _ in range(3)]
    async with AsyncExitStack() as stack:
        for t in transports:
            await stack.enter_async_context(t.run([LOOPBACK]))
        me, servers = transports[0], transports[1:]
        for s in servers:
            await me.host.connect(PeerInfo(s.host.get_id(), s.host.get_transport_addrs()))
        with anyio.fail_after(30):
            status, reason = await me.autonat.check_once()
        assert (status, reason) == (PUBLIC, "2 of 2 peers dialed us back")
        info = me.network_info()
        assert info["reachability"] == PUBLIC
        assert set(info["connections"].values()) == {"direct"}
        assert info["relayed_via"] == {}


def test_a_bootstrap_peer_decides_alone_until_another_peer_disputes_it() -> None:
    boot = "12D3KooWBootstrapPeer"
    r = Reachability(confirmations=2, max_age=100, trusted=frozenset({boot}))
    r.record("stranger", False, 0)
    assert r.status(0) == (UNKNOWN, "0 of 1 peers dialed us back; 2 must agree to decide")  # a stranger alone: no
    r = Reachability(confirmations=2, max_age=100, trusted=frozenset({boot}))
    r.record(boot, False, 0)
    assert r.status(0) == (PRIVATE, "bootstrap peer trapPeer could not dial us back; no other peer has answered")
    r.record("s1", False, 1)
    assert r.status(1) == (PRIVATE, "2 of 2 peers could not dial us back")
    r.record("s1", True, 2)  # disputed: the bootstrap no longer decides alone...
    assert r.status(2)[0] == PRIVATE  # ...what it decided stands, like any decided status...
    r.record("s2", True, 3)
    assert r.status(3) == (PUBLIC, "2 of 3 peers dialed us back")  # ...until two peers decide against it
    r = Reachability(confirmations=2, max_age=100, trusted=frozenset({boot}))
    r.record(boot, True, 0)
    assert r.status(0) == (PUBLIC, "bootstrap peer trapPeer dialed us back; no other peer has answered")
    r.record("s1", False, 50)
    assert r.status(50)[0] == PUBLIC  # a 1-1 dispute keeps the decided status until it is too old
    r.record(boot, True, 60)
    assert r.status(101) == (UNKNOWN, "1 of 2 peers dialed us back; 2 must agree to decide")


def test_unknown_says_how_many_verdicts_came_in() -> None:
    r = Reachability(confirmations=2, max_age=100)
    assert r.status(1000)[0] == UNKNOWN
    r.record("s1", False, 1001)  # the reason is not stuck at "no verdicts yet"
    assert r.status(1001) == (UNKNOWN, "0 of 1 peers dialed us back; 2 must agree to decide")


@pytest.mark.anyio
async def test_a_node_whose_only_peer_is_its_bootstrap_decides_on_its_word() -> None:
    boot = Libp2pTransport(create_new_key_pair(), nat_traversal=True)
    stranger = Libp2pTransport(create_new_key_pair(), nat_traversal=True)  # joined through someone else
    me = Libp2pTransport(create_new_key_pair(), nat_traversal=True, bootstrap_peers=[boot.peer_id])
    async with boot.run([LOOPBACK]), stranger.run([LOOPBACK]), me.run([LOOPBACK]):
        boot.autonat_server.limit = RateLimit(0, 100, 60)  # both ask from 127.0.0.1
        for t in (stranger, me):
            await t.host.connect(PeerInfo(boot.host.get_id(), boot.host.get_transport_addrs()))
        with anyio.fail_after(30):
            assert await stranger.autonat.check_once() == (
                UNKNOWN, "1 of 1 peers dialed us back; 2 must agree to decide")
            status, reason = await me.autonat.check_once()
        assert (status, reason) == (PUBLIC, f"bootstrap peer {boot.peer_id[-8:]} dialed us back; no other peer has answered")


class _FakeHost:
    """Just enough of a host for `AutoNatClient`: each of `peers` directly connected."""

    def __init__(self, peers: list[ID]) -> None:
        direct = SimpleNamespace(get_transport_addresses=lambda: [multiaddr.Multiaddr("/ip4/192.0.2.1/tcp/4001")])
        self._network = SimpleNamespace(connections={p: [direct] for p in peers})

    def get_network(self) -> SimpleNamespace:
        return self._network

    def get_peerstore(self) -> None:
        return None


class _NatedQueries:
    """The answers a NATed node gets: each server tries for `DIAL_BACK_TIMEOUT`-like 5 s, then fails."""

    def __init__(self) -> None:
        self.asked: list[tuple[float, ID]] = []

    async def query_server(self, server: ID, addrs: list[bytes], timeout: float) -> tuple[int, None]:
        self.asked.append((anyio.current_time(), server))
        await anyio.sleep(5)
        return Message.E_DIAL_ERROR, None


def _peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})])
async def test_a_nated_node_that_knows_only_its_bootstrap_is_private_after_one_dial_back() -> None:
    boot = _peer()
    client = AutoNatClient(_FakeHost([boot]), lambda: ["/ip4/10.0.0.2/tcp/4001"], clock=anyio.current_time,
                           trusted=frozenset({boot.to_base58()}))
    client._query = queries = _NatedQueries()
    start = anyio.current_time()
    with anyio.move_on_after(300):
        await client.run()  # every 3 s while unknown, then every 120 s
    assert client.status() == (PRIVATE, f"bootstrap peer {boot.to_base58()[-8:]} could not dial us back; no other peer has answered")
    assert [t - start for t, _ in queries.asked] == [0, 125, 250]  # decided by the first answer


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})])
async def test_bootstrap_peers_are_asked_first() -> None:
    boot, strangers = _peer(), [_peer() for _ in range(5)]
    for seed in range(10):
        client = AutoNatClient(_FakeHost([*strangers, boot]), lambda: ["/ip4/10.0.0.2/tcp/4001"],
                               clock=anyio.current_time, rng=random.Random(seed), trusted=frozenset({boot.to_base58()}))
        client._query = queries = _NatedQueries()
        assert await client.check_once(max_servers=2) == (PRIVATE, "2 of 2 peers could not dial us back")
        assert len(queries.asked) == 2 and boot in {server for _, server in queries.asked}  # 2 of 6, boot always
