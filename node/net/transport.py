"""How peers reach each other: one small `Transport` interface, two implementations.

`Libp2pTransport` (`murmur.node.net.libp2p_transport`) is the real path (TCP + Noise + yamux);
`MemoryTransport` connects transports of one `MemoryNetwork` inside a process, for
simulation and tests. Both pass the same conformance test (`tests/test_transport.py`).

Streams are byte streams: `receive_some` returns `b""` once the peer has closed its
side; every transport failure surfaces as `TransportError`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio
from anyio.abc import TaskGroup

READ_CHUNK = 1 << 20


class TransportError(Exception):
    """Dialing, opening, reading or writing a stream failed."""


class CannotListen(Exception):
    """A listen address could not be opened (taken, not this machine's, not supported); the message names it and why."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"cannot listen on {address}: {reason}")
        self.address = address
        self.reason = reason


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


class ForwardingStream(ByteStream):
    """A stream that hands everything to `inner`: wrappers override only what they change."""

    def __init__(self, inner: ByteStream) -> None:
        self.inner = inner
        self.remote_peer = inner.remote_peer

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data: bytes) -> None:
        await self.inner.send_all(data)

    async def close(self) -> None:
        await self.inner.close()

    async def reset(self) -> None:
        await self.inner.reset()


class Transport(abc.ABC):
    """Identity, listening addresses, handlers and outbound streams of one node."""

    peer_id: str

    @abc.abstractmethod
    def run(self, listen: Sequence[str]) -> AbstractAsyncContextManager[None]:
        """Listen on `listen` and serve handlers for the duration of the context; raises `CannotListen`
        on entry if any address in `listen` cannot be listened on."""

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


class ForwardingTransport(Transport):
    """A transport that hands everything to `inner`: wrappers override only what they change."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.peer_id = inner.peer_id

    def run(self, listen: Sequence[str]) -> AbstractAsyncContextManager[None]:
        return self.inner.run(listen)

    def addresses(self) -> list[str]:
        return self.inner.addresses()

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        self.inner.set_handler(protocol, handler)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        return await self.inner.open_stream(peer_id, addrs, protocol)

    async def hang_up(self, peer_id: str) -> None:
        await self.inner.hang_up(peer_id)


class FaultInjector(ForwardingTransport):
    """Wraps a transport and cuts it off from the peers in `blocked`: a partition inside the node.

    Outbound streams to a blocked peer fail with `TransportError`; inbound streams from
    one are reset before any handler sees them. Tests and chaos tooling flip `blocked`.
    """

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.blocked: set[str] = set()

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
