"""The libp2p transport's own behaviour: announced addresses behind a port mapping, and the connection gate.

What every transport promises is in `tests/test_transport.py`; Noise-only hosts in `tests/test_host.py`.
"""

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

import anyio
import multiaddr
import pytest
from anyio.abc import ByteStream, SocketAttribute
from libp2p.abc import INetConn
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.identity.identify.identify import ID as IDENTIFY
from libp2p.identity.identify.identify import parse_identify_response
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.membership import PEERS_PROTOCOL, Membership, TaskIdentity
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import GuardedTransport
from murmur.node.net.transport import TransportError

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def port_mapping(target_port: Callable[[], int]) -> AsyncIterator[int]:
    """Forward a fresh loopback port to `target_port()`, as a NAT or `docker run -p` does; yield the public port."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def handle(client: ByteStream) -> None:
        server = await anyio.connect_tcp("127.0.0.1", target_port())
        async with client, server, anyio.create_task_group() as tg:

            async def pipe(src: ByteStream, dst: ByteStream) -> None:
                with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    async for chunk in src:
                        await dst.send(chunk)
                tg.cancel_scope.cancel()  # either side closing ends the mapping of this connection

            tg.start_soon(pipe, client, server)
            tg.start_soon(pipe, server, client)

    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handle)
        yield listener.extra(SocketAttribute.local_port)
        tg.cancel_scope.cancel()


def member(transport: Libp2pTransport) -> Membership:
    table = PeerTable(transport.peer_id, 1e9)
    membership = Membership(transport, table, TaskIdentity("digits", "f"), rng=random.Random(0))
    transport.set_handler(PEERS_PROTOCOL, membership.serve)
    return membership


async def test_a_third_peer_learns_and_dials_the_announced_address() -> None:
    x_box: list[Libp2pTransport] = []  # the mapping exists before X, whose announce names its port

    def x_listen_port() -> int:
        return int(multiaddr.Multiaddr(x_box[0].listen_addresses()[0].split("/p2p/")[0]).value_for_protocol("tcp"))

    with anyio.fail_after(30):
        async with port_mapping(x_listen_port) as public_port:
            announced = f"/ip4/127.0.0.1/tcp/{public_port}"
            x = Libp2pTransport(create_new_key_pair(), announce=[announced])
            x_box.append(x)
            b, c = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
            mx, mc = member(x), member(c)
            member(b)
            loopback = ["/ip4/127.0.0.1/tcp/0"]
            async with x.run(loopback), b.run(loopback), c.run(loopback):
                assert x_listen_port() != public_port
                assert x.addresses() == [f"{announced}/p2p/{x.peer_id}"]
                assert await mx.greet(b.peer_id, b.addresses()) == "ok"
                assert await mc.greet(b.peer_id, b.addresses()) == "ok"
                # C heard of X from B's peer exchange: under the announced address only.
                assert mc.table.candidates[x.peer_id] == [f"{announced}/p2p/{x.peer_id}"]
                assert ID.from_base58(x.peer_id) not in c.host.get_connected_peers()
                # ...and reaches X through the mapping.
                assert await mc.greet(x.peer_id, mc.table.candidates[x.peer_id]) == "ok"
                assert mc.table.members[x.peer_id].addrs == [f"{announced}/p2p/{x.peer_id}"]
                # Identify tells the announced address too, not the listen address.
                stream = await c.host.new_stream(ID.from_base58(x.peer_id), [IDENTIFY])
                raw = b""
                with suppress(StreamEOF):
                    while chunk := await stream.read():
                        raw += chunk
                told = [str(multiaddr.Multiaddr(a)) for a in parse_identify_response(raw).listen_addrs]
                assert told == [announced]


async def test_libp2p_connections_from_strangers_are_closed_as_they_open(caplog: pytest.LogCaptureFixture) -> None:
    node = Libp2pTransport(create_new_key_pair())
    guarded = GuardedTransport(node, allow=set())
    node.gate_connections(guarded.refusal)
    stranger = Libp2pTransport(create_new_key_pair())
    async with node.run(["/ip4/127.0.0.1/tcp/0"]), stranger.run(["/ip4/127.0.0.1/tcp/0"]):
        with anyio.fail_after(20):
            try:
                await stranger.open_stream(node.peer_id, node.addresses(), "/test/echo/1.0.0")
            except TransportError:
                pass
            while ID.from_base58(stranger.peer_id) in node.host.get_connected_peers():
                await anyio.sleep(0.01)
    assert f"closing connections from {stranger.peer_id[-8:]}: not on the allow-list" in caplog.text


async def test_a_bootstrap_with_another_peer_id_or_a_closed_port_gets_a_short_specific_reason() -> None:
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    node, joiner = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    other_id = Libp2pTransport(create_new_key_pair()).peer_id
    async with node.run(loopback), joiner.run(loopback):
        greeter = member(joiner)
        member(node)
        host = node.listen_addresses()[0].split("/p2p/")[0]
        wrong = await greeter.greet(other_id, [f"{host}/p2p/{other_id}"])
        assert wrong == f"peer ID mismatch: expected …{other_id[-8:]}, got {node.peer_id}"
        absent_id = Libp2pTransport(create_new_key_pair()).peer_id
        closed = f"/ip4/127.0.0.1/tcp/1/p2p/{absent_id}"
        assert await greeter.greet(absent_id, [closed]) == "unreachable: connection refused"
        # A retry too: py-libp2p's negative cache must not hide the real reason.
        assert await greeter.greet(absent_id, [closed]) == "unreachable: connection refused"
        assert await greeter.greet(node.peer_id, node.listen_addresses()) == "ok"


@pytest.mark.parametrize("state", ["closed", "shutting down"])
async def test_a_dead_connection_still_listed_is_redialed_not_a_failed_stream(state: str) -> None:
    """py-libp2p lists a dead connection until its close completes (slow over a relay that died);
    a stream opened meanwhile must dial afresh rather than fail on the corpse."""
    loopback = ["/ip4/127.0.0.1/tcp/0"]
    a, b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    member(b)
    async with a.run(loopback), b.run(loopback):
        with anyio.fail_after(20):
            b_id = ID.from_base58(b.peer_id)
            await (await a.open_stream(b.peer_id, b.addresses(), PEERS_PROTOCOL)).close()
            (corpse,) = a.host.get_network().get_connections(b_id)
            if state == "closed":
                await a.hang_up(b.peer_id)
                a.host.get_network().connections[b_id] = [corpse]  # as if its cleanup had not run yet
            else:
                corpse.muxed_conn.event_shutting_down.set()  # as when the muxer reads a broken connection
            stream = await a.open_stream(b.peer_id, b.addresses(), PEERS_PROTOCOL)
            await stream.close()
            assert corpse not in a.host.get_network().get_connections(b_id)


async def test_a_redial_dials_the_addresses_given_not_the_wildcard_identify_reported() -> None:
    """Identify reports a peer's listen address as bound (`/ip4/0.0.0.0/...`); dialing that would reach
    this machine itself, so a redial dials the addresses the caller knows and nothing else."""
    a, b = Libp2pTransport(create_new_key_pair()), Libp2pTransport(create_new_key_pair())
    member(b)
    async with a.run(["/ip4/127.0.0.1/tcp/0"]), b.run(["/ip4/0.0.0.0/tcp/0"]):
        with anyio.fail_after(20):
            b_id, known = ID.from_base58(b.peer_id), b.listen_addresses()[:1]
            swarm, peerstore = a.host.get_network(), a.host.get_peerstore()
            await (await a.open_stream(b.peer_id, known, PEERS_PROTOCOL)).close()
            while not any("/ip4/0.0.0.0/" in str(addr) for addr in peerstore.addrs(b_id)):
                await anyio.sleep(0.05)  # identify has run
            await a.hang_up(b.peer_id)
            dialed: list[list[str]] = []
            dial_peer = swarm.dial_peer

            async def recording_dial_peer(peer: ID) -> list[INetConn]:
                dialed.append([f"{addr}/p2p/{b.peer_id}" for addr in peerstore.addrs(peer)])
                return await dial_peer(peer)

            swarm.dial_peer = recording_dial_peer
            await (await a.open_stream(b.peer_id, known, PEERS_PROTOCOL)).close()
            assert dialed == [known]
