"""DCUtR hole punching (py-libp2p's protocol code): turn a relayed connection into a direct one.

Two peers behind NATs that meet through a relay exchange the addresses their NATs show the world
(DCUtR CONNECT), then dial each other at the same moment from their listen ports (TCP simultaneous
open). py-libp2p's `DCUtRProtocol` does the protocol, the timing and the dials; this module wires it
to Murmur's host and adds the rules for untrusted input:

- a DCUtR session is accepted only over a relayed connection (its only purpose), at most
  `MAX_SESSIONS_PER_PEER` per `SESSION_WINDOW` per peer;
- of the addresses a peer sends, only plain `/ip4|ip6/…/tcp/…` ones are kept (no loopback,
  unspecified or multicast IPs), at most `MAX_PUNCH_ADDRS`; every dial must authenticate as that
  peer (Noise), so nothing is ever sent to a third party beyond a TCP SYN.

Once a direct connection is up, new streams use it (py-libp2p prefers direct over relayed), and
the relayed connection is closed after a grace period. When punching fails the relayed one stays.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Any

import multiaddr
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import dcutr
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol

from murmur.node.net.relay import is_relayed

log = logging.getLogger("murmur.holepunch")

MAX_PUNCH_ADDRS = 4
MAX_SESSIONS_PER_PEER = 3
SESSION_WINDOW = 60.0
RELAY_CLOSE_GRACE = 10.0  # py-libp2p's 60 s keeps a relay circuit open for nothing once new streams go direct


class _ListenAddrsHost:
    """The host as DCUtR should see it: `get_addrs()` gives the real TCP listen addresses, and the
    peerstore hands out only addresses `punch_addrs` accepts.

    Murmur's host may advertise only announced or relayed addresses through identify; DCUtR needs the
    listen port (to dial from it) and predicts `<NAT IP>:<listen port>` from identify's observations.
    DCUtR also dials what a peer's identify claimed (its "unilateral upgrade"): those claims are
    filtered like CONNECT's addresses.
    """

    def __init__(self, host: BasicHost) -> None:
        self._host = host
        self._peerstore = _PunchablePeerstore(host.get_peerstore())

    def get_addrs(self) -> list[multiaddr.Multiaddr]:
        own = multiaddr.Multiaddr(f"/p2p/{self._host.get_id()}")
        return [a.encapsulate(own) for a in self._host.get_transport_addrs()]

    def get_peerstore(self) -> Any:
        return self._peerstore

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


class _PunchablePeerstore:
    def __init__(self, peerstore: Any) -> None:
        self._peerstore = peerstore

    def addrs(self, peer_id: ID) -> list[multiaddr.Multiaddr]:
        return punch_addrs([a.to_bytes() for a in self._peerstore.addrs(peer_id)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peerstore, name)


def punch_addrs(raw_addrs: list[bytes]) -> list[multiaddr.Multiaddr]:
    """The addresses from a DCUtR CONNECT worth dialing: plain TCP, routable IPs, at most `MAX_PUNCH_ADDRS`."""
    out: list[multiaddr.Multiaddr] = []
    for raw in raw_addrs[: dcutr.MAX_OBSERVED_ADDRS]:
        try:
            addr = multiaddr.Multiaddr(raw)
            protocols = [p.name for p in addr.protocols()]
            if protocols not in (["ip4", "tcp"], ["ip6", "tcp"]):
                continue
            ip = ipaddress.ip_address(addr.value_for_protocol(protocols[0]))
            port = int(addr.value_for_protocol("tcp"))
        except Exception:
            continue
        if ip.is_loopback or ip.is_unspecified or ip.is_multicast or not 0 < port < 65536:
            continue
        if addr not in out:
            out.append(addr)
        if len(out) == MAX_PUNCH_ADDRS:
            break
    return out


class HolePuncher(DCUtRProtocol):
    """DCUtR on Murmur's host; run it with `background_trio_service(puncher)` inside the host's run.

    It drives hole punching itself for every relayed connection (py-libp2p's auto-drive loop, every
    2 s, at most 3 attempts per peer) and answers the peer's sessions.
    """

    def __init__(self, host: BasicHost, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(_ListenAddrsHost(host))  # type: ignore[arg-type]
        host._dcutr_protocol = self  # type: ignore[attr-defined]  # so disconnects reset its per-peer state
        self.clock = clock
        self._sessions: dict[ID, list[float]] = {}
        self.punched: dict[str, float] = {}  # peer id -> when its direct connection was verified (clock)

    async def _close_relayed_conns_after_grace(self, peer_id: ID, grace: float = RELAY_CLOSE_GRACE) -> None:
        await super()._close_relayed_conns_after_grace(peer_id, grace)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[multiaddr.Multiaddr]:
        return punch_addrs(addr_bytes)

    def _allow_session(self, peer_id: ID) -> bool:
        now = self.clock()
        recent = [t for t in self._sessions.get(peer_id, []) if now - t < SESSION_WINDOW]
        if len(self._sessions) > 4096:
            self._sessions.clear()
        self._sessions[peer_id] = recent + [now]
        return len(recent) < MAX_SESSIONS_PER_PEER

    async def _handle_dcutr_stream(self, stream) -> None:  # noqa: ANN001 (py-libp2p's INetStream)
        peer_id = stream.muxed_conn.peer_id
        if not is_relayed(stream.muxed_conn) or not self._allow_session(peer_id):
            log.debug("refusing a DCUtR session from %s (not relayed, or too many)", peer_id)
            await stream.reset()
            return
        await super()._handle_dcutr_stream(stream)
        await self._note(peer_id)

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        ok = await super().initiate_hole_punch(peer_id)
        await self._note(peer_id)
        return ok

    async def _note(self, peer_id: ID) -> None:
        # Not the `_direct_connections` cache alone: py-libp2p evicts a peer from it whenever any of
        # its connections closes (the duplicates of a simultaneous open, a relayed one after its
        # grace), so a punched connection could go unrecorded on both sides.
        key = peer_id.to_base58()
        if key not in self.punched and await self._have_direct_connection(peer_id):
            self.punched[key] = self.clock()
            log.info("direct connection to %s (hole punched)", key[-8:])


def connection_kinds(host: BasicHost) -> tuple[dict[str, str], dict[str, str]]:
    """Each connected peer's kind ("direct" if any live connection to it is, else "relayed"), and
    for the relayed ones the relay's peer ID ("" if it cannot be told)."""
    kinds, via = {}, {}
    own = host.get_id().to_base58()
    for pid, conns in host.get_network().connections.items():
        live = [c for c in conns if not getattr(c, "is_closed", False)]
        if not live:
            continue
        peer = pid.to_base58()
        kinds[peer] = "relayed" if all(is_relayed(c) for c in live) else "direct"
        if kinds[peer] == "relayed":
            via[peer] = next((r for c in live if (r := _relay_of(c, {peer, own}))), "")
    return kinds, via


def _relay_of(conn: Any, not_relay: set[str]) -> str | None:
    """The relay's peer ID of a circuit connection, or None.

    A dialed circuit's address names the relay (`/p2p/<relay>/p2p-circuit/p2p/<peer>`); py-libp2p 0.8.1
    puts our own ID there on an accepted one, so then the relay is the peer of the stream the circuit
    runs in (SwarmConn → Yamux → SecureSession → Noise → RawConnection → the relay's stream).
    """
    try:
        for addr in conn.get_transport_addresses():
            for part in str(addr).split("/p2p/")[1:]:
                if (pid := part.split("/")[0]) and pid not in not_relay:
                    return pid
    except Exception:
        return None
    obj = conn
    for _ in range(8):
        stream = getattr(obj, "stream", None)
        if stream is not None and hasattr(getattr(stream, "muxed_conn", None), "peer_id"):
            pid = stream.muxed_conn.peer_id.to_base58()
            return pid if pid not in not_relay else None
        obj = next((getattr(obj, n) for n in ("muxed_conn", "secured_conn", "conn") if hasattr(obj, n)), None)
        if obj is None:
            return None
    return None
