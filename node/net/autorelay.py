"""Relay discovery: a node that AutoNAT finds private reserves slots on relays among the peers it knows.

A relay is a peer that speaks circuit relay v2 HOP (`murmur run --relay-service`), which identify
tells us once we are connected to it. The finder keeps `want` reservations (dropping relays that
stop answering, see `CircuitRelay.adopt`), so no relay address has to be typed. With a single
public bootstrap that relays, that one reservation is what lets NATed peers meet. A node that
AutoNAT later finds public releases the relays it found (`relay_plan` decides, and says why), so
a wrong "private" verdict does not keep its traffic on a relay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import multiaddr
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL

from murmur.node.net.autonat import PRIVATE, PUBLIC
from murmur.node.net.relay import CircuitRelay, RelayError, is_circuit, is_relayed

log = logging.getLogger("murmur.autorelay")

PROBE_TIMEOUT = 5.0  # connecting to a known peer to learn (through identify) whether it relays
PROBES_PER_ROUND = 2
RETRY_DROPPED_AFTER = 120.0  # a relay we gave up on is tried again after this long
RESERVE, RELEASE, HOLD = "reserve", "release", "hold"


def relay_plan(reachability: str, reserved: int, found: int, want: int) -> tuple[str, str]:
    """What the finder does now, and why: `RESERVE` more relays, `RELEASE` the ones it found, or `HOLD`.

    `reserved`: relays holding a reservation for us now (configured or found); `found`: relays
    adopted at run time. Only a "private" node looks for relays; an "unknown" one keeps what it
    has (a verdict can expire for a while); a "public" one needs none of the relays it found
    (relays named with `--relay` are the operator's choice and never released).
    """
    if reachability == PRIVATE:
        if reserved < want:
            return RESERVE, f"private, and {reserved} of {want} relays reserved"
        return HOLD, f"private, and {reserved} of {want} relays reserved"
    if reachability == PUBLIC and found:
        return RELEASE, "this node is public: peers can dial it directly"
    return HOLD, f"{reachability}: relays are looked for only when private"


class RelayFinder:
    """Keeps `want` relay reservations while `reachability()` says "private".

    `known_peers()` gives peers learned elsewhere (the membership table: id -> addresses); the
    finder may connect to a couple of them per round to learn whether they relay.
    """

    def __init__(
        self, host: BasicHost, relay: CircuitRelay, reachability: Callable[[], str],
        known_peers: Callable[[], dict[str, list[str]]] = dict, *, want: int = 2,
    ) -> None:
        self.host = host
        self.relay = relay
        self.reachability = reachability
        self.known_peers = known_peers
        self.want = want
        self.acceptable: Callable[[str], bool] = lambda peer_id: True  # e.g. on the allow-list and not banned
        self._probed: set[str] = set()
        self.plan: tuple[str, str] = (HOLD, "not started")

    def relay_candidates(self) -> list[str]:
        """`<transport addr>/p2p/<id>` of connected peers that relay, over a direct connection, best first."""
        out = []
        store = self.host.get_peerstore()
        in_use = self.relay.relay_ids()
        for pid, conns in self.host.get_network().connections.items():
            key = pid.to_base58()
            if key in in_use or time.time() - self.relay.dropped.get(key, -1e18) < RETRY_DROPPED_AFTER:
                continue
            if not self.acceptable(key):
                continue
            try:
                if HOP_PROTOCOL not in store.get_protocols(pid):
                    continue
            except Exception:
                continue
            for conn in conns:
                addr = _dialable_remote(conn)
                if addr is not None:
                    out.append(f"{addr}/p2p/{key}")
                    break
        return out

    async def probe(self) -> None:
        """Connect to up to `PROBES_PER_ROUND` known, unconnected peers with direct addresses (identify runs)."""
        connected = {p.to_base58() for p in self.host.get_connected_peers()}
        picks = [(pid, [a for a in addrs if not is_circuit(a)]) for pid, addrs in self.known_peers().items()
                 if pid not in connected and pid not in self._probed]
        picks = [(pid, addrs) for pid, addrs in picks if addrs][:PROBES_PER_ROUND]
        for pid, addrs in picks:
            self._probed.add(pid)
            try:
                with anyio.fail_after(PROBE_TIMEOUT):
                    await self.host.connect(PeerInfo(ID.from_base58(pid), [
                        multiaddr.Multiaddr(a.split("/p2p/")[0]) for a in addrs[:4]]))
                    await anyio.sleep(0.5)  # identify answers right after the handshake
            except Exception as exc:
                log.debug("probing %s for relaying failed: %r", pid[-8:], exc)

    async def step(self) -> int:
        """One round of `relay_plan`: adopt relays until `want` hold a reservation, or release the
        found ones of a public node; return how many hold a reservation."""
        plan = relay_plan(self.reachability(), len(self.relay.addresses()), len(self.relay.discovered), self.want)
        if plan != self.plan:
            self.plan = plan
            log.debug("relays: %s (%s)", *plan)
        if plan[0] == RELEASE:
            for relay in sorted(self.relay.discovered):
                self.relay.release(relay, plan[1])
        if plan[0] != RESERVE:
            return len(self.relay.addresses())
        if len(self.relay.addresses()) < self.want and not self.relay_candidates():
            await self.probe()
        for candidate in self.relay_candidates():
            if len(self.relay.addresses()) >= self.want:
                break
            try:
                if await self.relay.adopt(candidate):
                    log.info("using relay %s (found among known peers)", candidate)
            except (ValueError, RelayError) as exc:
                log.debug("not using relay %s: %s", candidate, exc)
        return len(self.relay.addresses())

    async def run(self, every: float = 2.0) -> None:
        """Call `step` every `every` s until cancelled."""
        while True:
            await self.step()
            await anyio.sleep(every)


def _dialable_remote(conn) -> str | None:  # noqa: ANN001 (py-libp2p's INetConn)
    """The remote transport address of a direct, outbound-dialable connection, or None."""
    if is_relayed(conn):
        return None
    try:
        addrs = [str(a) for a in conn.get_transport_addresses()]
    except Exception:
        return None
    for addr in addrs:
        if "/tcp/" in addr and "/0.0.0.0/" not in addr:
            return addr.split("/p2p/")[0]
    return None
