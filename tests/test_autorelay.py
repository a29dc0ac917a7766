"""Relay discovery on loopback: a node that AutoNAT calls private reserves on known peers that relay.

Through real NAT, with relays killed mid-run, in `tests/test_nat.py`.
"""

import time

import anyio
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from murmur.node.net.autonat import PRIVATE, PUBLIC, UNKNOWN
from murmur.node.net.autorelay import HOLD, RELEASE, RESERVE, relay_plan
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.relay import RelayError

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _say(transport: Libp2pTransport, status: str) -> None:
    """Five peers' verdicts, as AutoNAT would record them: more than the real peers here can outvote."""
    for server in ("s1", "s2", "s3", "s4", "s5"):
        transport.autonat.reachability.record(server, status == PUBLIC, time.monotonic())


@pytest.mark.anyio
async def test_a_private_node_reserves_on_relaying_peers_it_knows_and_only_then() -> None:
    relay = Libp2pTransport(create_new_key_pair(), relay_service=True, nat_traversal=True)
    plain = Libp2pTransport(create_new_key_pair(), nat_traversal=True)  # knows HOP? no: does not relay
    node = Libp2pTransport(create_new_key_pair(), nat_traversal=True, auto_relay=True)
    async with relay.run(LOOPBACK), plain.run(LOOPBACK), node.run(LOOPBACK):
        node.known_peers = lambda: {
            t.peer_id: [f"{a}/p2p/{t.peer_id}" for a in t.host.get_transport_addrs()] for t in (relay, plain)}
        _say(node, PUBLIC)
        assert await node.finder.step() == 0  # a public node needs no relay
        assert node.addresses() == node.listen_addresses()

        _say(node, PRIVATE)
        with anyio.fail_after(20):
            while await node.finder.step() == 0:  # probes the known peers, identify says which relays
                await anyio.sleep(0.2)
        assert node.relay.addresses() == [f"{a}/p2p/{relay.peer_id}/p2p-circuit/p2p/{node.peer_id}"
                                          for a in relay.host.get_transport_addrs()]
        assert node.addresses() == node.relay.addresses()  # only circuits are advertised now
        assert node.network_info()["relays"] == node.relay.addresses()
        assert plain.peer_id not in node.relay.relay_ids()


@pytest.mark.anyio
async def test_a_discovered_relay_that_stops_answering_is_dropped() -> None:
    node = Libp2pTransport(create_new_key_pair(), nat_traversal=True, auto_relay=True)
    async with node.run(LOOPBACK):
        relay = Libp2pTransport(create_new_key_pair(), relay_service=True)
        async with relay.run(LOOPBACK):
            addr = f"{relay.host.get_transport_addrs()[0]}/p2p/{relay.peer_id}"
            with anyio.fail_after(15):
                assert await node.relay.adopt(addr)
        with anyio.fail_after(30):  # the relay is gone: the connection drops and the reservation fails
            while relay.peer_id in node.relay.relay_ids():
                await anyio.sleep(0.2)
        assert relay.peer_id in node.relay.dropped
        assert node.relay.addresses() == []


@pytest.mark.anyio
async def test_only_acceptable_peers_are_taken_as_relays() -> None:
    relay = Libp2pTransport(create_new_key_pair(), relay_service=True)
    node = Libp2pTransport(create_new_key_pair(), nat_traversal=True, auto_relay=True)
    async with relay.run(LOOPBACK), node.run(LOOPBACK):
        _say(node, PRIVATE)
        await node.host.connect(PeerInfo(relay.host.get_id(), relay.host.get_transport_addrs()))
        with anyio.fail_after(10):  # until identify has told the node that this peer relays
            while not node.finder.relay_candidates():
                await anyio.sleep(0.05)
        assert node.finder.relay_candidates() == [f"{relay.host.get_transport_addrs()[0]}/p2p/{relay.peer_id}"]
        node.finder.acceptable = lambda peer: peer != relay.peer_id  # say, not on the allow-list
        assert node.finder.relay_candidates() == []
        assert await node.finder.step() == 0
        assert node.relay.relay_ids() == set()


def test_relay_plan_reserves_when_private_and_releases_found_relays_when_public() -> None:
    assert relay_plan(PRIVATE, reserved=0, found=0, want=2) == (RESERVE, "private, and 0 of 2 relays reserved")
    assert relay_plan(PRIVATE, reserved=1, found=1, want=2) == (RESERVE, "private, and 1 of 2 relays reserved")
    assert relay_plan(PRIVATE, reserved=2, found=2, want=2)[0] == HOLD
    assert relay_plan(UNKNOWN, reserved=1, found=1, want=2) == (HOLD, "unknown: relays are looked for only when private")
    assert relay_plan(PUBLIC, reserved=1, found=1, want=2) == (RELEASE, "this node is public: peers can dial it directly")
    assert relay_plan(PUBLIC, reserved=1, found=0, want=2)[0] == HOLD  # a configured relay is the operator's choice


@pytest.mark.anyio
async def test_a_node_found_public_again_releases_the_relays_it_found() -> None:
    relay = Libp2pTransport(create_new_key_pair(), relay_service=True)
    node = Libp2pTransport(create_new_key_pair(), nat_traversal=True, auto_relay=True)
    async with relay.run(LOOPBACK), node.run(LOOPBACK):
        node.known_peers = lambda: {relay.peer_id: [f"{a}/p2p/{relay.peer_id}" for a in relay.host.get_transport_addrs()]}
        _say(node, PRIVATE)  # say, a lying bootstrap's word
        with anyio.fail_after(20):
            while await node.finder.step() == 0:
                await anyio.sleep(0.2)
        assert node.addresses() == node.relay.addresses()
        _say(node, PUBLIC)  # other peers dialed it back
        assert await node.finder.step() == 0
        assert node.finder.plan == (RELEASE, "this node is public: peers can dial it directly")
        assert node.relay.relay_ids() == set() and relay.peer_id not in node.relay.dropped
        assert node.addresses() == node.listen_addresses()  # direct addresses are advertised again
        with pytest.raises(RelayError, match="not a relay found at run time"):
            node.relay.release(f"{relay.host.get_transport_addrs()[0]}/p2p/{relay.peer_id}", "test")
        _say(node, PRIVATE)  # and it can take the relay again
        with anyio.fail_after(20):
            while await node.finder.step() == 0:
                await anyio.sleep(0.2)


@pytest.mark.anyio
async def test_a_configured_relay_is_kept_when_public() -> None:
    relay = Libp2pTransport(create_new_key_pair(), relay_service=True)
    async with relay.run(LOOPBACK):
        addr = f"{relay.host.get_transport_addrs()[0]}/p2p/{relay.peer_id}"
        node = Libp2pTransport(create_new_key_pair(), nat_traversal=True, relays=[addr])
        async with node.run(LOOPBACK):
            _say(node, PUBLIC)
            assert await node.finder.step() == 1
            assert node.relay.relay_ids() == {relay.peer_id}
