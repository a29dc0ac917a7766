"""The real transport: py-libp2p over TCP with Noise (only) and yamux, relays included.

Behind the `Transport` interface of `murmur.node.net.transport`; passes the same conformance
test as `MemoryTransport` (`tests/test_transport.py`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
import multiaddr
from libp2p.abc import INetConn, INetwork, INotifee
from libp2p.crypto.keys import KeyPair
from libp2p.host.basic_host import BasicHost
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.stream.net_stream import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.address_validation import expand_wildcard_address

from murmur.node.net.autonat import UNKNOWN, AutoNatClient, AutoNatServer
from murmur.node.net.autorelay import RelayFinder
from murmur.node.net.dial_failure import dial_failure
from murmur.node.net.holepunch import HolePuncher, connection_kinds
from murmur.node.net.host import build_host, has_open_connection
from murmur.node.net.relay import CircuitRelay, RelayError, is_circuit
from murmur.node.net.transport import READ_CHUNK, ByteStream, CannotListen, StreamHandler, Transport, TransportError

# When a peer offers a relayed address too, a direct dial gets this long before we use the relay:
# an unreachable NAT address may hang until the TCP timeout.
DIRECT_DIAL_TIMEOUT = 2.0
log = logging.getLogger("murmur.transport")


def _bind_failure(address: str) -> str | None:
    """Why a TCP address cannot be bound, as the OS says it; None if it can.

    The probe binds without `SO_REUSEPORT`, which py-libp2p's own listeners set (for hole punching): a
    port that another listener holds, a Murmur node's included, fails here instead of being shared.
    """
    try:
        addr = multiaddr.Multiaddr(address)
        family = socket.AF_INET6 if "ip6" in {p.name for p in addr.protocols()} else socket.AF_INET
        host = addr.value_for_protocol("ip6" if family == socket.AF_INET6 else "ip4")
        port = int(addr.value_for_protocol("tcp"))
    except Exception:  # not an IP and TCP address: the multiaddr library raises assorted types
        return "not a TCP address this node can listen on (/ip4/ADDRESS/tcp/PORT or /ip6/…)"
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as trio's listeners do: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            return (exc.strerror or str(exc)).lower()
    return None


class _Libp2pStream(ByteStream):
    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.remote_peer = stream.muxed_conn.peer_id.to_base58()

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        try:
            return await self._stream.read(max_bytes)
        except StreamEOF:
            return b""
        except Exception as exc:  # py-libp2p raises several unrelated types here
            raise TransportError(f"read from {self.remote_peer} failed: {exc!r}") from exc

    async def send_all(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except Exception as exc:
            raise TransportError(f"write to {self.remote_peer} failed: {exc!r}") from exc

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.close()
            except Exception:
                pass

    async def reset(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.reset()
            except Exception:
                pass


class _ConnectionGate(INotifee):
    """Closes a new connection at once when `refuse(peer_id)` gives a reason."""

    def __init__(self, refuse: Callable[[str], str | None]) -> None:
        self.refuse = refuse
        self._logged: set[tuple[str, str]] = set()

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer_id = conn.muxed_conn.peer_id
        reason = self.refuse(peer_id.to_base58())
        if reason:
            if (peer_id.to_base58(), reason) not in self._logged:  # once per peer and reason
                self._logged.add((peer_id.to_base58(), reason))
                log.warning("closing connections from %s: %s", peer_id.to_base58()[-8:], reason)
            await network.close_peer(peer_id)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None: ...
    async def closed_stream(self, network: INetwork, stream: INetStream) -> None: ...
    async def disconnected(self, network: INetwork, conn: INetConn) -> None: ...
    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None: ...
    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None: ...


class Libp2pTransport(Transport):
    """The real transport: a Noise-only py-libp2p host over TCP with yamux.

    Behind NAT: `announce` lists public addresses (`/ip4/…/tcp/…`, optionally ending in our
    `/p2p/<id>`) that replace the listen addresses in what peers are told; `relays` are
    circuit-relay v2 peers (`…/p2p/<relay id>`) to reserve a slot on, whose circuit
    addresses are advertised too; `relay_service` makes this node relay for others.
    `nat_traversal` turns on AutoNAT (serving and asking), DCUtR hole punching and, with
    `auto_relay`, relay discovery once AutoNAT says this node is private. `bootstrap_peers`
    (peer IDs) are the peers this node joins through: AutoNAT takes one of their verdicts
    alone while no other peer disputes it (`murmur.node.net.autonat.Reachability`).
    Raises `ValueError` for a malformed address.
    """

    def __init__(
        self,
        key_pair: KeyPair,
        *,
        max_connections: int = 300,
        announce: Sequence[str] = (),
        relays: Sequence[str] = (),
        relay_service: bool = False,
        nat_traversal: bool = False,
        auto_relay: bool = False,
        bootstrap_peers: Sequence[str] = (),
    ) -> None:
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        self.announce = [_own_address(a, self.peer_id) for a in announce]
        # Identify advertises the announced addresses only: py-libp2p's get_addrs() cuts an
        # address at its first /p2p/, which would turn a circuit address into the relay's own.
        factory = (lambda _listen: [multiaddr.Multiaddr(a) for a in self.announce]) if announce or relays else None
        self.host: BasicHost = build_host(key_pair, max_connections=max_connections, addrs_factory=factory)
        self.relay = CircuitRelay(self.host, relays=relays, hop=relay_service, auto=nat_traversal and auto_relay)
        self.nat_traversal = nat_traversal
        self.known_peers: Callable[[], dict[str, list[str]]] = dict  # the node sets this (its membership table)
        if nat_traversal:
            self.autonat_server = AutoNatServer(self.host)
            self.autonat = AutoNatClient(self.host, self.listen_addresses, trusted=frozenset(bootstrap_peers))
            self.puncher = HolePuncher(self.host)
            self.finder = RelayFinder(self.host, self.relay, self.reachability, lambda: self.known_peers(),
                                      want=2 if auto_relay else 0)

    def gate_connections(self, refuse: Callable[[str], str | None]) -> None:
        """Close every new connection whose peer ID `refuse` gives a reason for."""
        self.host.get_network().register_notifee(_ConnectionGate(refuse))

    @asynccontextmanager
    async def run(self, listen: Sequence[str]) -> AsyncIterator[None]:
        """Listen on `listen` (may be empty: dial out only) and hold the relay reservations.

        Raises `CannotListen` for the first address that another socket holds, or that py-libp2p could not
        listen on (it only logs that).
        """
        for address in listen:  # before py-libp2p binds: its SO_REUSEPORT would share a port another node holds
            if (reason := _bind_failure(address)) is not None:
                raise CannotListen(address, reason)
        async with self.host.run([multiaddr.Multiaddr(a) for a in listen]), self.relay.run():
            opened = self.host.get_network().listeners  # py-libp2p keeps only the listeners that opened
            for address in listen:
                if str(multiaddr.Multiaddr(address)) not in opened:
                    raise CannotListen(address, _bind_failure(address) or "py-libp2p could not open it")
            if not self.nat_traversal:
                yield
                return
            async with background_trio_service(self.puncher), anyio.create_task_group() as tg:
                tg.start_soon(self.autonat.run)
                tg.start_soon(self.finder.run)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()

    def reachability(self) -> str:
        """AutoNAT's verdict: "public", "private" or "unknown" (always unknown without `nat_traversal`)."""
        return self.autonat.status()[0] if self.nat_traversal else UNKNOWN

    def network_info(self) -> dict:
        """For status: reachability (and why), each connected peer's connection kind, relays in use."""
        reason = self.autonat.status()[1] if self.nat_traversal else "NAT traversal is off"
        kinds, via = connection_kinds(self.host)
        return {
            "reachability": self.reachability(), "reachability_reason": reason,
            "connections": kinds, "relayed_via": via, "relays": self.relay.addresses(),
            "hole_punched": len(self.puncher.punched) if self.nat_traversal else 0,
            "relayed_bytes": self.relay.relayed_bytes,
        }

    def addresses(self) -> list[str]:
        """What peers are told: announced and relayed addresses if configured, else the listen addresses."""
        if not self.announce and not self.relay.relays:
            return self.listen_addresses()
        return [f"{a}/p2p/{self.peer_id}" for a in self.announce] + self.relay.addresses()

    def listen_addresses(self) -> list[str]:
        """The addresses this host really listens on (wildcards expanded), each ending in `/p2p/<id>`."""
        addrs: list[str] = []
        for addr in self.host.get_transport_addrs():
            if addr.value_for_protocol("ip4") == "0.0.0.0":
                concrete = [multiaddr.Multiaddr(str(addr).replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/", 1))]
                concrete += expand_wildcard_address(addr)
            else:
                concrete = [addr]
            addrs += [f"{a}/p2p/{self.peer_id}" for a in concrete if f"{a}/p2p/{self.peer_id}" not in addrs]
        return addrs

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def serve(stream: INetStream) -> None:
            await handler(_Libp2pStream(stream))

        self.host.set_stream_handler(protocol, serve)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        try:
            pid = ID.from_base58(peer_id)
            if not has_open_connection(self.host, pid):
                # Murmur paces redials itself (`PeerTable`'s backoff): py-libp2p's 60 s negative cache
                # would otherwise turn a bootstrap's retry into an instant "recently failed" error.
                self.host.get_network().unblock_peer(pid)
                await self._connect(pid, addrs)
            return _Libp2pStream(await self.host.new_stream(pid, [protocol]))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            raise TransportError(f"cannot open {protocol} to {peer_id[-8:]}: {dial_failure(exc)}") from exc

    async def _connect(self, pid: ID, addrs: Sequence[str]) -> None:
        """Dial directly first, then through each relay of a `/p2p-circuit` address; raise if all fail."""
        # py-libp2p dials every address in its peerstore, where identify leaves the peer's unexpanded
        # listen address (/ip4/0.0.0.0/...): dialing that reaches this machine, often this very node.
        self.host.get_peerstore().clear_addrs(pid)
        direct = [a for a in addrs if not is_circuit(a)]
        circuits = [a for a in addrs if is_circuit(a)]
        if not circuits:
            await self.host.connect(PeerInfo(pid, [multiaddr.Multiaddr(_strip_p2p(a)) for a in direct]))
            return
        failures: list[str] = []
        if direct:
            try:
                with anyio.fail_after(DIRECT_DIAL_TIMEOUT):
                    await self.host.connect(PeerInfo(pid, [multiaddr.Multiaddr(_strip_p2p(a)) for a in direct]))
                return
            except Exception as exc:
                failures.append(f"direct: {exc!r}")
        for addr in circuits:
            try:
                await self.relay.dial(addr)
                return
            except RelayError as exc:
                failures.append(str(exc))
        raise TransportError("; ".join(failures))

    async def hang_up(self, peer_id: str) -> None:
        """Close every connection to `peer_id`, except to our own relays: those carry our reservation."""
        if peer_id in self.relay.relay_ids():
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(2):
            try:
                await self.host.disconnect(ID.from_base58(peer_id))
            except Exception:
                pass


def _strip_p2p(addr: str) -> str:
    return addr.split("/p2p/")[0]


def _own_address(addr: str, peer_id: str) -> str:
    """`addr` without a trailing `/p2p/<peer_id>`; raises `ValueError` if malformed or another peer's."""
    try:
        multiaddr.Multiaddr(addr)
    except Exception as exc:
        raise ValueError(f"announce address {addr!r} is not a valid multiaddr: {exc}") from exc
    if is_circuit(addr):
        raise ValueError(f"announce address {addr!r} is a relay circuit: use --relay <relay address> instead")
    head, sep, tail = addr.rpartition("/p2p/")
    if not sep:
        return addr
    if tail != peer_id:
        raise ValueError(f"announce address {addr!r} names peer {tail}, not this node ({peer_id})")
    return head
