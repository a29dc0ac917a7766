"""Build the node's libp2p host: TCP, Noise only, yamux.

py-libp2p's default host also accepts plaintext and secio sessions; Murmur offers
Noise alone, so an unencrypted or secio dial fails during negotiation.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IMuxedConn, INetworkService, IRawConnection, ISecureConn
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.network.connection.exceptions import RawConnError
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

# A write still unfinished after this long means the peer stopped reading: the connection is dropped.
WRITE_TIMEOUT = 10.0


class WholeMessageNoise(NoiseTransport):
    """Noise whose sessions write each message whole, even when the writing task is cancelled.

    py-libp2p 0.8.1 encrypts (using up a nonce) before it awaits the socket. A
    cancellation in between, say an exchange timeout, or a read under `move_on_after`
    that was sending a yamux window update, drops that ciphertext: the peer's next
    decryption fails and it closes the connection, killing every stream on it. Here a
    started write is shielded and finishes; the cancellation lands just after it. A
    write stuck for `WRITE_TIMEOUT` (the peer stopped reading) closes the connection
    and raises `RawConnError`, so nothing hangs behind the shield.
    """

    async def secure_inbound(self, conn: IRawConnection) -> ISecureConn:
        return _write_whole(await super().secure_inbound(conn))

    async def secure_outbound(self, conn: IRawConnection, peer_id: ID) -> ISecureConn:
        return _write_whole(await super().secure_outbound(conn, peer_id))


def _write_whole(session: ISecureConn) -> ISecureConn:
    write = session.write

    async def write_whole(data: bytes) -> None:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(WRITE_TIMEOUT):
                await write(data)
                return
            with trio.move_on_after(1.0):  # a half-written message spoils the rest: hang up
                await session.close()
        raise RawConnError(f"write to {session.get_remote_peer()} stalled for {WRITE_TIMEOUT:g}s; connection closed")

    session.write = write_whole  # type: ignore[method-assign]
    return session


def build_host(
    key_pair: KeyPair,
    *,
    max_connections: int = 300,
    addrs_factory: Callable[[list[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]] | None = None,
) -> BasicHost:
    """Return an unstarted host with identity `key_pair` that speaks only Noise.

    At most `max_connections` connections in all, and 3 per peer. `addrs_factory`, if
    given, maps the listen addresses to the ones identify advertises (announced addresses).
    Its Noise sessions finish every write they start (`WholeMessageNoise`).
    """
    noise = WholeMessageNoise(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    # Murmur chooses whom to dial itself: no auto-connecting to reach watermarks.
    limits = ConnectionConfig(
        max_connections=max_connections, max_connections_per_peer=3,
        min_connections=0, low_watermark=0, high_watermark=max_connections,
    )
    host = new_host(
        key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX", connection_config=limits,
        addrs_factory=addrs_factory,
    )
    assert isinstance(host, BasicHost)
    _end_inbound_handlers_with_their_connection(host.get_network())
    return host


# The raw stream an inbound handler task serves. Tasks it starts inherit the value, hence the identity check.
_serving_inbound: contextvars.ContextVar[object] = contextvars.ContextVar("murmur_serving_inbound", default=None)


def has_open_connection(host: BasicHost, peer: ID) -> bool:
    """Whether `host` holds an open connection to `peer`; forgets the dead ones it still lists.

    py-libp2p lists a connection until its close completes, which over a dead relay can take seconds,
    and meanwhile opens streams on it that fail at once, and dials no new one.
    """
    swarm = host.get_network()
    is_open = False
    for conn in swarm.get_connections(peer):
        if _is_dead(conn):
            swarm.remove_conn(conn)  # what its close ends with; removing twice is harmless
        else:
            is_open = True
    return is_open


def _is_dead(conn: Any) -> bool:
    """Closed, or closing: the muxer shuts down as soon as it reads a broken connection."""
    muxed = conn.muxed_conn
    shutting_down = getattr(muxed, "event_shutting_down", None)  # Yamux's; Mplex has none
    return conn.is_closed or muxed.is_closed or (shutting_down is not None and shutting_down.is_set())


class InboundConnectionClosed(Exception):
    """An inbound connection's handler ends with this once the connection closed (see below)."""


def _end_inbound_handlers_with_their_connection(swarm: INetworkService) -> None:
    """End each inbound connection's handler task when that connection closes.

    py-libp2p keeps the task, and its token of the inbound cap (`max_connections`), until the
    whole swarm stops: a long-lived node would gather one task per inbound connection it ever
    accepted and, after `max_connections` of them, refuse every inbound connection. Here the
    upgrade, when the inbound handler calls it, returns only once the connection closed (or
    the swarm stopped), by raising: the handler then ends as after a failed upgrade. Other
    callers of the upgrade (hole punching, relays) get the connection back at once.
    """
    handle, upgrade = swarm._do_handle_inbound_connection, swarm.upgrade_inbound_raw_conn  # type: ignore[attr-defined]

    async def handle_inbound(read_write_closer: Any, *args: Any) -> None:
        _serving_inbound.set(read_write_closer)  # in this handler task's own context only
        await handle(read_write_closer, *args)

    async def upgrade_inbound(raw_conn: IRawConnection, maddr: multiaddr.Multiaddr) -> IMuxedConn:
        muxed = await upgrade(raw_conn, maddr)
        if getattr(raw_conn, "stream", None) is not _serving_inbound.get():
            return muxed
        async with trio.open_nursery() as nursery:  # until the connection closes or, as before, the swarm stops
            for wait in (muxed.event_closed.wait, swarm.manager.wait_finished):  # type: ignore[attr-defined]
                nursery.start_soon(_cancel_after, wait, nursery.cancel_scope)
        raise InboundConnectionClosed(f"inbound connection from {muxed.peer_id} closed")

    swarm._do_handle_inbound_connection = handle_inbound  # type: ignore[attr-defined]
    swarm.upgrade_inbound_raw_conn = upgrade_inbound  # type: ignore[method-assign]


async def _cancel_after(wait: Callable[[], Awaitable[Any]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()
