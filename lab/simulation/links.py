"""Simulated links: a `MemoryTransport` whose streams take latency and bandwidth in simulated time.

Run under Trio's autojumping `MockClock`: waiting costs no real time, so a link's
latency and serialization delay only order events.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from murmur.node.net.transport import READ_CHUNK, ByteStream, MemoryNetwork, MemoryTransport, TransportError


class _LinkStream(ByteStream):
    """One end of a simulated link: writes take size/bandwidth of sender time and arrive `latency` later."""

    def __init__(self, remote_peer: str, send: Any, receive: Any, latency: float, bandwidth: float) -> None:
        self.remote_peer = remote_peer
        self._send, self._receive = send, receive
        self.latency, self.bandwidth = latency, bandwidth
        self._free_at = 0.0  # when our side of the link has sent its last queued byte
        self._pending = b""
        self._pending_at = 0.0

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        if not self._pending:
            try:
                self._pending_at, self._pending = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return b""
            except anyio.BrokenResourceError as exc:
                raise TransportError(f"stream from {self.remote_peer} was reset") from exc
        await anyio.sleep_until(self._pending_at)
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def send_all(self, data: bytes) -> None:
        # Serialization holds the sender; propagation does not (the next write may follow at once).
        done = max(anyio.current_time(), self._free_at) + len(data) / self.bandwidth
        self._free_at = done
        await anyio.sleep_until(done)
        try:
            self._send.send_nowait((done + self.latency, bytes(data)))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise TransportError(f"write to {self.remote_peer} failed: stream closed") from exc

    async def close(self) -> None:
        self._send.close()

    async def reset(self) -> None:
        self._send.close()
        self._receive.close()


class LinkTransport(MemoryTransport):
    """A `MemoryTransport` whose streams follow `links(a, b) -> (latency s, bytes/s)` in simulated time.

    Opening a stream costs one round trip (protocol negotiation), then each write
    costs its serialization time on the sender and arrives one latency later. Opening
    to a peer that is gone or lacks the protocol raises `TransportError` after the round trip.
    """

    def __init__(self, network: MemoryNetwork, peer_id: str, links: Callable[[str, str], tuple[float, float]]) -> None:
        super().__init__(network, peer_id)
        self._links = links

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        latency, bandwidth = self._links(self.peer_id, peer_id)
        await anyio.sleep(2 * latency)
        remote = self.network.transports.get(peer_id)
        if not isinstance(remote, LinkTransport) or remote._task_group is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: unreachable")
        handler = remote._handlers.get(protocol)
        if handler is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: protocol not supported")
        a_send, b_receive = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)
        b_send, a_receive = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)
        remote._task_group.start_soon(handler, _LinkStream(self.peer_id, b_send, b_receive, latency, bandwidth))
        return _LinkStream(peer_id, a_send, a_receive, latency, bandwidth)
