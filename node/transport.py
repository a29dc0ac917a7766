"""How peers reach each other: one small `Transport` interface, two implementations.

`Libp2pTransport` is the real path (TCP + Noise + yamux via py-libp2p);
`MemoryTransport` connects transports of one `MemoryNetwork` inside a process, for
simulation and tests. Both pass the same conformance test (`tests/test_transport.py`).

Streams are byte streams: `receive_some` returns `b""` once the peer has closed its
side; every transport failure surfaces as `TransportError`.
"""

from __future__ import annotations

import abc
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
import multiaddr
from anyio.abc import TaskGroup
from libp2p.abc import INetConn, INetwork, INotifee
from libp2p.crypto.keys import KeyPair
from libp2p.host.basic_host import BasicHost
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.stream.net_stream import INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils.address_validation import expand_wildcard_address

from node.host import build_host
from node.relay import CircuitRelay, RelayError, is_circuit

READ_CHUNK = 1 << 20
# When a peer offers a relayed address too, a direct dial gets this long before we use the relay:
# an unreachable NAT address may hang until the TCP timeout.
DIRECT_DIAL_TIMEOUT = 2.0
log = logging.getLogger("murmur.transport")


class TransportError(Exception):
    """Dialing, opening, reading or writing a stream failed."""


class ByteStream(abc.ABC):
    """A reliable, ordered, bidirectional byte stream to one remote peer."""

    remote_peer: str

    @abc.abstractmethod
    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        """Return up to `max_bytes` bytes; `b""` when the peer has closed its side."""

    @abc.abstractmethod
    async def send_all(self, data: bytes) -> None:
        """Send all of `data`; raises `TransportError` if the stream is broken."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close our side gracefully (never raises)."""

    @abc.abstractmethod
    async def reset(self) -> None:
        """Abort the stream in both directions (never raises)."""


StreamHandler = Callable[[ByteStream], Awaitable[None]]


class Transport(abc.ABC):
    """Identity, listening addresses, handlers and outbound streams of one node."""

    peer_id: str

    @abc.abstractmethod
    def run(self, listen: Sequence[str]) -> AbstractAsyncContextManager[None]:
        """Listen on `listen` and serve handlers for the duration of the context."""

    @abc.abstractmethod
    def addresses(self) -> list[str]:
        """Dialable addresses of this node, each ending in `/p2p/<peer id>`."""

    @abc.abstractmethod
    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        """Serve inbound streams of `protocol` with `handler` (one task per stream)."""

    @abc.abstractmethod
    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        """Connect to `peer_id` (dialing `addrs` if needed) and open a `protocol` stream."""

    @abc.abstractmethod
    async def hang_up(self, peer_id: str) -> None:
        """Close every connection to `peer_id` (never raises)."""


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
    ) -> None:
        self.peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
        self.announce = [_own_address(a, self.peer_id) for a in announce]
        # Identify advertises the announced addresses only: py-libp2p's get_addrs() cuts an
        # address at its first /p2p/, which would turn a circuit address into the relay's own.
        factory = (lambda _listen: [multiaddr.Multiaddr(a) for a in self.announce]) if announce or relays else None
        self.host: BasicHost = build_host(key_pair, max_connections=max_connections, addrs_factory=factory)
        self.relay = CircuitRelay(self.host, relays=relays, hop=relay_service)

    def gate_connections(self, refuse: Callable[[str], str | None]) -> None:
        """Close every new connection whose peer ID `refuse` gives a reason for."""
        self.host.get_network().register_notifee(_ConnectionGate(refuse))

    @asynccontextmanager
    async def run(self, listen: Sequence[str]) -> AsyncIterator[None]:
        """Listen on `listen` (may be empty: dial out only) and hold the relay reservations."""
        async with self.host.run([multiaddr.Multiaddr(a) for a in listen]), self.relay.run():
            yield

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
            if pid not in self.host.get_connected_peers():
                await self._connect(pid, addrs)
            return _Libp2pStream(await self.host.new_stream(pid, [protocol]))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            raise TransportError(f"cannot open {protocol} to {peer_id[-8:]}: {exc!r}") from exc

    async def _connect(self, pid: ID, addrs: Sequence[str]) -> None:
        """Dial directly first, then through each relay of a `/p2p-circuit` address; raise if all fail."""
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


class MemoryNetwork:
    """A registry of in-process transports that can reach each other by peer ID."""

    def __init__(self) -> None:
        self.transports: dict[str, MemoryTransport] = {}

    def transport(self, peer_id: str) -> MemoryTransport:
        return MemoryTransport(self, peer_id)


class _MemoryStream(ByteStream):
    def __init__(self, remote_peer: str, send: anyio.abc.ObjectSendStream[bytes], receive: anyio.abc.ObjectReceiveStream[bytes]) -> None:
        self.remote_peer = remote_peer
        self._send, self._receive = send, receive
        self._pending = b""

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        if not self._pending:
            try:
                self._pending = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return b""
            except anyio.BrokenResourceError as exc:
                raise TransportError(f"stream from {self.remote_peer} was reset") from exc
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def send_all(self, data: bytes) -> None:
        try:
            await self._send.send(bytes(data))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise TransportError(f"write to {self.remote_peer} failed: stream closed") from exc

    async def close(self) -> None:
        self._send.close()

    async def reset(self) -> None:
        self._send.close()
        self._receive.close()


class MemoryTransport(Transport):
    """An in-process transport: streams are pairs of memory channels."""

    def __init__(self, network: MemoryNetwork, peer_id: str) -> None:
        self.network = network
        self.peer_id = peer_id
        self._handlers: dict[str, StreamHandler] = {}
        self._task_group: TaskGroup | None = None

    @asynccontextmanager
    async def run(self, listen: Sequence[str] = ()) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            self.network.transports[self.peer_id] = self
            try:
                yield
            finally:
                del self.network.transports[self.peer_id]
                self._task_group = None
                tg.cancel_scope.cancel()

    def addresses(self) -> list[str]:
        return [f"/memory/{self.peer_id}/p2p/{self.peer_id}"]

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        self._handlers[protocol] = handler

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        remote = self.network.transports.get(peer_id)
        if remote is None or remote._task_group is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: unreachable")
        handler = remote._handlers.get(protocol)
        if handler is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: protocol not supported")
        a_send, b_receive = anyio.create_memory_object_stream[bytes](math.inf)
        b_send, a_receive = anyio.create_memory_object_stream[bytes](math.inf)
        remote._task_group.start_soon(handler, _MemoryStream(self.peer_id, b_send, b_receive))
        return _MemoryStream(peer_id, a_send, a_receive)

    async def hang_up(self, peer_id: str) -> None:
        return None


class FaultInjector(Transport):
    """Wraps a transport and cuts it off from the peers in `blocked`: a partition inside the node.

    Outbound streams to a blocked peer fail with `TransportError`; inbound streams from
    one are reset before any handler sees them. Tests and chaos tooling flip `blocked`.
    """

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.peer_id = inner.peer_id
        self.blocked: set[str] = set()

    def run(self, listen: Sequence[str]) -> AbstractAsyncContextManager[None]:
        return self.inner.run(listen)

    def addresses(self) -> list[str]:
        return self.inner.addresses()

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def guarded(stream: ByteStream) -> None:
            if stream.remote_peer in self.blocked:
                await stream.reset()
                return
            await handler(stream)

        self.inner.set_handler(protocol, guarded)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        if peer_id in self.blocked:
            raise TransportError(f"cannot open {protocol} to {peer_id[-8:]}: partitioned (fault injection)")
        return await self.inner.open_stream(peer_id, addrs, protocol)

    async def hang_up(self, peer_id: str) -> None:
        await self.inner.hang_up(peer_id)
