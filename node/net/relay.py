"""Circuit relay v2 (py-libp2p's implementation): take part from behind NAT through a relay peer.

- A node given `relays` keeps a reservation on each and is reachable at
  `<relay addr>/p2p-circuit/p2p/<own id>`; it accepts the connections a relay forwards.
- Any node can dial such an address: the relay connects the two peers (HOP CONNECT).
- A node with `hop=True` relays for others within `RELAY_LIMITS`.
- With `auto=True` it serves relayed connections even without configured relays, and
  `adopt()` adds relays found at run time (`murmur.node.net.autorelay`); a discovered relay that
  stops answering is dropped instead of being retried forever, and `release()` lets go of one
  that is no longer needed (the node turned out to be public).

A circuit carries an ordinary libp2p connection: the two ends run their own Noise
handshake and yamux inside it, so the relay forwards ciphertext and both ends
authenticate each other's peer IDs exactly as on a direct connection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import multiaddr
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from murmur.node.net.host import has_open_connection

log = logging.getLogger("murmur.relay")

# A full relay for Murmur's traffic, not go-libp2p's 2-minute/128-KiB "limited" relay
# (which only suits hole punching). A circuit that hits a limit is reset; Murmur dials
# on demand, so the next exchange opens a fresh circuit. The totals bound the relay's load.
RELAY_LIMITS = RelayLimits(
    duration=30 * 60, data=1 << 30, max_circuit_conns=16, max_reservations=64, reservation_ttl=3600,
)
RESERVE_TIMEOUT = 10.0  # one reservation attempt: connect to the relay, RESERVE, answer
REFRESH_EVERY = 300.0  # re-reserve this often (and at half the TTL, and whenever the relay connection drops)
RETRY_MAX = 60.0


class RelayError(Exception):
    """Reserving a slot on a relay, or dialing through one, failed; the message says why."""


def is_circuit(addr: str) -> bool:
    """True for a `/p2p-circuit` address (reachable only through a relay)."""
    return "/p2p-circuit" in addr


def is_relayed(conn: Any) -> bool:
    """True when `conn` (a py-libp2p connection) runs through a relay; unknown counts as relayed."""
    try:
        return any(is_circuit(str(a)) for a in conn.get_transport_addresses())
    except Exception:
        return True


def split_peer(addr: str) -> tuple[str, str]:
    """Split `<transport addr>/p2p/<id>` into (id, transport addr); raises `ValueError`."""
    head, sep, peer_id = addr.rpartition("/p2p/")
    if not sep or not head or not peer_id or "/" in peer_id:
        raise ValueError(f"relay address {addr!r} must be a multiaddr ending in /p2p/<relay peer id>")
    try:
        multiaddr.Multiaddr(addr)
        ID.from_base58(peer_id)
    except Exception as exc:
        raise ValueError(f"relay address {addr!r} is not a valid multiaddr: {exc}") from exc
    return peer_id, head


def circuit_address(relay_addr: str, peer_id: str) -> str:
    """The address at which `peer_id` is reachable through the relay at `relay_addr`."""
    return f"{relay_addr}/p2p-circuit/p2p/{peer_id}"


class _CountingHop(CircuitV2Protocol):
    """py-libp2p's circuit v2 protocol, counting the bytes it forwards as a relay (`relayed_bytes`)."""

    relayed_bytes = 0

    async def _relay_data(self, src_stream: Any, dst_stream: Any, *args: Any, **kwargs: Any) -> None:
        await super()._relay_data(src_stream, _CountedWrites(dst_stream, self), *args, **kwargs)


class _CountedWrites:
    def __init__(self, stream: Any, counter: _CountingHop) -> None:
        self._stream, self._counter = stream, counter

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)
        self._counter.relayed_bytes += len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class CircuitRelay:
    """Circuit relay v2 on one host: reservations on `relays`, dialing circuits, and (with `hop`) relaying.

    Use `run()` inside the host's `run()`. `addresses()` lists the circuit addresses
    backed by a live reservation; `dial()` connects to a peer through its relay.
    """

    def __init__(
        self, host: BasicHost, *, relays: Sequence[str] = (), hop: bool = False, limits: RelayLimits = RELAY_LIMITS,
        auto: bool = False,
    ) -> None:
        self.host = host
        self.peer_id = host.get_id().to_base58()
        self.relays = list(relays)
        self._relay_ids = {addr: split_peer(addr)[0] for addr in self.relays}  # validates every address
        self.hop = hop
        self._protocol = _CountingHop(host, limits=limits, allow_hop=hop)
        # STOP only: a CLIENT-role dialer would also make a reservation on every relay it dials through.
        self._dialer = CircuitV2Transport(host, self._protocol, RelayConfig(roles=RelayRole.STOP, limits=limits))
        self._reserved: dict[str, float] = {}  # relay addr -> reservation expiry (Unix time)
        self._last_problem: dict[str, str] = {}
        self.auto = auto
        self.discovered: set[str] = set()  # relay addrs adopted at run time
        self.dropped: dict[str, float] = {}  # relay peer id -> when a discovered relay was given up (Unix time)
        self._keeping: dict[str, anyio.CancelScope] = {}  # relay addr -> the scope of the task that keeps it
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def relayed_bytes(self) -> int:
        """Bytes this node has forwarded for others as a relay (both directions of every circuit)."""
        return self._protocol.relayed_bytes

    def relay_ids(self) -> set[str]:
        """Peer IDs of the relays this node reserves on."""
        return set(self._relay_ids.values())

    def addresses(self) -> list[str]:
        """Circuit addresses through relays that hold a reservation for us now."""
        return [circuit_address(r, self.peer_id) for r in self.relays if r in self._reserved]

    @asynccontextmanager
    async def run(self) -> AsyncIterator[None]:
        """Serve relayed connections (and HOP with `hop`); keep the reservations while inside.

        Entering waits for one reservation attempt per relay (each bounded by
        `RESERVE_TIMEOUT`); failed ones are retried with backoff in the background.
        """
        if not self.hop and not self.relays and not self.auto:
            yield  # a plain node dials circuits but accepts none: nothing to serve
            return
        async with background_trio_service(self._protocol), anyio.create_task_group() as tg:
            await self._protocol.event_started.wait()  # STOP/HOP handlers are registered
            for relay in self.relays:
                await tg.start(self._keep_reserved, relay)
            self._tg = tg
            try:
                yield
            finally:
                self._tg = None
                tg.cancel_scope.cancel()

    async def adopt(self, relay: str) -> bool:
        """Reserve on `relay` (found at run time) and keep it while it answers; True once reserved.

        Waits for the first attempt. Raises `ValueError` for a malformed address and `RelayError`
        outside `run()` or for our own address.
        """
        relay_id, _ = split_peer(relay)
        if relay_id == self.peer_id:
            raise RelayError("cannot reserve on this node itself")
        if self._tg is None:
            raise RelayError("adopt() needs run()")
        if relay in self.relays:
            return relay in self._reserved
        self.relays.append(relay)
        self._relay_ids[relay] = relay_id
        self.discovered.add(relay)
        await self._tg.start(self._keep_reserved, relay)
        return relay in self._reserved

    def release(self, relay: str, reason: str) -> None:
        """Stop keeping the reservation on `relay`, one found at run time, and stop advertising its circuit.

        The relay connection stays (it may carry other traffic); the relay frees the slot when its
        TTL ends. Raises `RelayError` for a relay that was configured, not found, or is not in use.
        """
        if relay not in self.discovered:
            raise RelayError(f"{relay} is not a relay found at run time")
        scope = self._keeping.pop(relay, None)
        if scope is not None:
            scope.cancel()
        self.relays.remove(relay)
        self._relay_ids.pop(relay, None)
        self.discovered.discard(relay)
        self._reserved.pop(relay, None)
        log.info("released relay %s: %s", relay, reason)

    def _drop(self, relay: str) -> None:
        self.relays.remove(relay)
        self.dropped[self._relay_ids.pop(relay)] = time.time()
        self.discovered.discard(relay)
        self._reserved.pop(relay, None)
        log.warning("gave up relay %s: no reservation", relay)

    async def dial(self, circuit_addr: str) -> None:
        """Connect to the peer at `circuit_addr` through its relay; raises `RelayError`."""
        relay_addr = circuit_addr.split("/p2p-circuit", 1)[0]
        try:
            relay_id, relay_transport = split_peer(relay_addr)
        except ValueError as exc:
            raise RelayError(str(exc)) from exc
        if relay_id == self.peer_id:
            raise RelayError("the circuit runs through this node itself")
        try:
            await self._connect(relay_id, relay_transport)
            await self._dialer.dial(multiaddr.Multiaddr(circuit_addr))
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:  # py-libp2p raises ConnectionError, SwarmException, ...
            raise RelayError(f"through relay {relay_id[-8:]}: {exc}") from exc
        log.info("connected to %s through relay %s", circuit_addr.rsplit("/p2p/", 1)[1][-8:], relay_id[-8:])

    async def _connect(self, relay_id: str, transport_addr: str) -> ID:
        pid = ID.from_base58(relay_id)
        if not has_open_connection(self.host, pid):
            await self.host.connect(PeerInfo(pid, [multiaddr.Multiaddr(transport_addr)]))
        return pid

    async def _reserve(self, relay: str) -> float:
        """Make (or refresh) our reservation on `relay`; return its expiry. Raises on failure."""
        relay_id, transport_addr = split_peer(relay)
        pid = await self._connect(relay_id, transport_addr)
        stream = await self.host.new_stream(pid, [HOP_PROTOCOL])
        try:
            await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
            reply = await read_delimited_msg(stream, HopMessage)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await stream.close()
        status = StatusCode(reply.status) if reply.HasField("status") else StatusCode.OK
        if status != StatusCode.OK:
            raise RelayError(f"relay refused the reservation: {status.name}")
        return float(reply.reservation.expire) if reply.HasField("reservation") else time.time() + 60

    async def _try_reserve(self, relay: str) -> float | None:
        """One bounded reservation attempt: the expiry, or None (the reason is logged when it changes)."""
        try:
            with anyio.fail_after(RESERVE_TIMEOUT):
                expires = await self._reserve(relay)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            self._reserved.pop(relay, None)
            problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if self._last_problem.get(relay) != problem:
                self._last_problem[relay] = problem
                log.warning("no reservation on relay %s: %s (retrying with backoff)", relay, problem)
            return None
        if relay not in self._reserved:
            log.info("reserved a slot on relay %s; reachable at %s", relay, circuit_address(relay, self.peer_id))
        self._reserved[relay] = expires
        self._last_problem.pop(relay, None)
        return expires

    async def _keep_reserved(
        self, relay: str, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold a reservation on `relay` until it is dropped or released; `started` after the first attempt."""
        with anyio.CancelScope() as scope:
            self._keeping[relay] = scope
            try:
                await self._hold(relay, task_status)
            finally:
                if self._keeping.get(relay) is scope:
                    del self._keeping[relay]
                if relay not in self.relays:  # released while a reservation attempt was finishing
                    self._reserved.pop(relay, None)

    async def _hold(self, relay: str, task_status: anyio.abc.TaskStatus[None]) -> None:
        pid = ID.from_base58(self._relay_ids[relay])
        expires = await self._try_reserve(relay)
        task_status.started()
        retry = 1.0
        while True:
            if expires is None and relay in self.discovered:
                self._drop(relay)  # the finder picks another; a configured relay is retried forever
                return
            if expires is None:
                await anyio.sleep(retry)
                retry = min(RETRY_MAX, retry * 2)
            else:
                retry = 1.0
                # Refresh well before expiry, and at once if the relay connection drops
                # (a relay holds a reservation only while its peer stays connected).
                refresh_at = time.time() + min(REFRESH_EVERY, max(1.0, (expires - time.time()) / 2))
                while time.time() < refresh_at and has_open_connection(self.host, pid):
                    await anyio.sleep(1.0)
                if not has_open_connection(self.host, pid):
                    self._reserved.pop(relay, None)
                    log.warning("lost the connection to relay %s; reserving again", relay)
            expires = await self._try_reserve(relay)
