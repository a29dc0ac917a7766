"""AutoNAT v1 (py-libp2p's protocol code): is this node publicly reachable? Peers dial us back to tell.

- Server: every node answers dial-back requests, but only to the requester's *observed* IP (the IP its
  connection comes from), only to ports the requester listed, at most `MAX_DIAL_BACK_ADDRS` of them,
  never over a relayed connection, at most once per 10 s per source IP and 8 times a minute in all. So a request can never
  make us dial a third party. The dial-back is a fresh connection that must authenticate as the
  requester (Noise), and is closed at once.
- Client: `AutoNatClient.run()` asks a few directly connected peers now and then; `Reachability`
  turns their verdicts into "public", "private" or "unknown" (with a reason).

Verdicts are untrusted input: one peer counts once (its latest verdict), a status needs
`confirmations` agreeing peers, and verdicts expire. One exception makes the smallest deployment
work (one public bootstrap, everyone else behind NAT, so a NATed node has a single peer to ask):
a bootstrap peer's verdict decides alone while no other peer's verdict disputes it
(`Reachability.trusted`; see there for what a lying bootstrap can and cannot do).
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import multiaddr
from libp2p.host.autonat.autonat import (
    _MAX_AUTONAT_MSG_SIZE,
    AUTONAT_PROTOCOL_ID,
    AutoNATService,
    _is_relayed_stream,
)
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from murmur.node.net.relay import is_relayed

log = logging.getLogger("murmur.autonat")

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"
MAX_DIAL_BACK_ADDRS = 4  # ports tried per request (each at the observed IP only)
DIAL_BACK_TIMEOUT = 5.0
QUERY_TIMEOUT = 10.0
PER_PEER_INTERVAL = 10.0  # one source IP gets at most one dial-back per this many seconds
GLOBAL_BURST = 8  # and all peers together at most this many per `GLOBAL_WINDOW`
GLOBAL_WINDOW = 60.0


@dataclass
class Reachability:
    """Sans-IO: peers' dial-back verdicts in, "public" / "private" / "unknown" out (with why).

    A status needs `confirmations` distinct peers agreeing among verdicts younger than `max_age`;
    a tie goes to "public" (a dial-back that worked is the stronger evidence); too few
    agreeing verdicts keep the last decided status until its verdicts expire. The reason of
    "unknown" counts the fresh verdicts, so it says what is missing.

    `trusted` holds the peer IDs this node was told to join through (`--bootstrap`, whose IDs
    the Noise handshake authenticates). While every fresh verdict agrees and one of them is a
    trusted peer's, that is enough: behind NAT with a single public bootstrap there is no second
    peer that could answer. What one lying bootstrap can do with this, and no more:

    - call a private node "public": it reserves no relay, so other NATed peers cannot reach it.
      A bootstrap can already do that by not introducing it to anyone;
    - call a public node "private": it reserves on relays (see `murmur.node.net.autorelay`) and
      advertises their circuits, so its traffic detours through a relay, end-to-end encrypted
      and authenticated as always.

    Neither outlasts the other peers' answers: once another peer disagrees, the bootstrap no
    longer decides alone (what it decided stands as any decided status does, until `max_age`),
    and `confirmations` agreeing peers decide against it at once (a node found public releases
    the relays it found). A bootstrap's verdict never makes the node dial anyone, and the
    dial-back rules of `AutoNatServer` are unchanged. Peers not named as bootstraps gain nothing.
    """

    confirmations: int = 2
    max_age: float = 600.0
    trusted: frozenset[str] = frozenset()
    _verdicts: dict[str, tuple[bool, float]] = field(default_factory=dict)
    _decided: tuple[str, str, float] = (UNKNOWN, "no dial-back verdicts yet", 0.0)

    def record(self, server: str, reachable: bool, now: float) -> None:
        """Note `server`'s latest verdict: it dialed us back (`reachable`) or it tried and failed."""
        self._verdicts[server] = (reachable, now)

    def status(self, now: float) -> tuple[str, str]:
        """The current status and the reason for it."""
        fresh = {server: ok for server, (ok, t) in self._verdicts.items() if now - t <= self.max_age}
        yes = sum(fresh.values())
        no = len(fresh) - yes
        vouching = sorted(server for server in fresh if server in self.trusted)
        if yes >= self.confirmations and yes >= no:
            self._decided = (PUBLIC, f"{yes} of {len(fresh)} peers dialed us back", now)
        elif no >= self.confirmations and no > yes:
            self._decided = (PRIVATE, f"{no} of {len(fresh)} peers could not dial us back", now)
        elif vouching and (yes == 0 or no == 0):  # a bootstrap's answer, and no peer disputes it
            verdict = "dialed us back" if yes else "could not dial us back"
            others = "no other peer has answered" if len(fresh) == 1 else f"{len(fresh) - 1} other peers agree"
            self._decided = (PUBLIC if yes else PRIVATE, f"bootstrap peer {vouching[0][-8:]} {verdict}; {others}", now)
        elif self._decided[0] == UNKNOWN or now - self._decided[2] > self.max_age:
            counted = f"{yes} of {len(fresh)} peers dialed us back; {self.confirmations} must agree to decide"
            self._decided = (UNKNOWN, counted if fresh else "no dial-back verdicts yet", now)
        return self._decided[0], self._decided[1]


class RateLimit:
    """Sans-IO: allow one event per key per `per_key` seconds and `burst` per `window` overall."""

    def __init__(self, per_key: float, burst: int, window: float) -> None:
        self.per_key, self.burst, self.window = per_key, burst, window
        self._last: dict[str, float] = {}
        self._recent: list[float] = []

    def allow(self, key: str, now: float) -> str | None:
        """None if allowed (and counted), else why not."""
        self._recent = [t for t in self._recent if now - t < self.window]
        if now - self._last.get(key, -1e18) < self.per_key:
            return f"at most one dial-back per {self.per_key:g} s per peer"
        if len(self._recent) >= self.burst:
            return f"at most {self.burst} dial-backs per {self.window:g} s"
        if len(self._last) > 4096:  # bound memory under a flood of peer IDs
            self._last = {k: t for k, t in self._last.items() if now - t < self.per_key}
        self._last[key] = now
        self._recent.append(now)
        return None


def dial_back_candidates(raw_addrs: list[bytes], observed_ip: str | None) -> list[multiaddr.Multiaddr]:
    """Addresses a dial-back may try: the observed IP with each listed TCP port (at most `MAX_DIAL_BACK_ADDRS`).

    The IP always comes from the connection, never from the request, so a requester can only make
    us dial itself. Malformed addresses, and an unusable observed IP, give nothing.
    """
    if observed_ip is None:
        return []
    try:
        ip = ipaddress.ip_address(observed_ip)
    except ValueError:
        return []
    if ip.is_unspecified or ip.is_multicast:
        return []
    proto = "ip4" if ip.version == 4 else "ip6"
    out: list[multiaddr.Multiaddr] = []
    for raw in raw_addrs[:32]:
        try:
            port = int(multiaddr.Multiaddr(raw).value_for_protocol("tcp"))
        except Exception:
            continue
        candidate = multiaddr.Multiaddr(f"/{proto}/{ip}/tcp/{port}")
        if 0 < port < 65536 and candidate not in out:
            out.append(candidate)
        if len(out) == MAX_DIAL_BACK_ADDRS:
            break
    return out


class AutoNatServer(AutoNATService):
    """py-libp2p's AutoNAT handler with Murmur's rules: observed IP only, rate limits, fresh verified dials."""

    def __init__(self, host: BasicHost, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(host, serve=True)
        self.clock = clock
        self.limit = RateLimit(PER_PEER_INTERVAL, GLOBAL_BURST, GLOBAL_WINDOW)

    async def handle_stream(self, stream) -> None:  # noqa: ANN001 (py-libp2p's INetStream)
        """Answer one DIAL request (bounded by `QUERY_TIMEOUT`); bad input gets E_BAD_REQUEST, never a crash."""
        try:
            with anyio.fail_after(QUERY_TIMEOUT):
                request = Message()
                request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, _MAX_AUTONAT_MSG_SIZE))
                response = await self.answer(
                    request, stream.muxed_conn.peer_id, self._observed_ip(stream), _is_relayed_stream(stream))
                await stream.write(encode_varint_prefixed(response.SerializeToString()))
        except Exception as exc:  # malformed protobuf, a vanished peer, a timeout
            log.debug("AutoNAT request failed: %r", exc)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                try:
                    await stream.close()
                except Exception:
                    pass

    async def answer(self, request: Message, requester: ID, observed_ip: str | None, relayed: bool) -> Message:
        """The DIAL_RESPONSE to `request` from `requester`; dials back only when every rule allows it."""
        response = Message(type=Message.DIAL_RESPONSE)
        if request.type != Message.DIAL:
            refusal, status = "not a DIAL request", Message.E_BAD_REQUEST
        elif bytes(request.dial.peer.id) != requester.to_bytes():
            refusal, status = "dial-backs go only to the requesting peer", Message.E_DIAL_REFUSED
        elif relayed:
            refusal, status = "requests over relayed connections are refused", Message.E_DIAL_REFUSED
        else:
            refusal, status = self.limit.allow(str(observed_ip), self.clock()), Message.E_DIAL_REFUSED
        candidates = [] if refusal else dial_back_candidates(list(request.dial.peer.addrs), observed_ip)
        if not refusal and not candidates:
            refusal = "no TCP port to dial back at the observed IP"
        if refusal:
            response.dialResponse.status = status
            response.dialResponse.statusText = refusal
            return response
        dialed = await self._dial_back(requester, candidates)
        if dialed is None:
            response.dialResponse.status = Message.E_DIAL_ERROR
            response.dialResponse.statusText = "all dials failed"
        else:
            response.dialResponse.status = Message.OK
            response.dialResponse.addr = dialed.to_bytes()
        return response

    async def _dial_back(self, peer_id: ID, candidates: list[multiaddr.Multiaddr]) -> multiaddr.Multiaddr | None:
        """A fresh connection (not the one the request came on) that authenticates as `peer_id`, closed at once."""
        network = self.host.get_network()
        for addr in candidates:
            try:
                with anyio.fail_after(DIAL_BACK_TIMEOUT):
                    conn = await network.dial_addr(addr, peer_id)
            except Exception as exc:  # timeouts, refusals, a wrong peer ID: all "not reachable there"
                log.debug("dial-back to %s at %s failed: %r", peer_id, addr, exc)
                continue
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                try:
                    await conn.close()
                except Exception:
                    pass
            return addr
        return None


class AutoNatClient:
    """Asks directly connected peers to dial us back; keeps `reachability` up to date.

    `listen_addrs()` gives what to send (only the ports matter to a Murmur server). `trusted`:
    the bootstrap peers' IDs, whose verdict may decide alone (`Reachability`); they are asked
    first, since a NATed node may have no one else to ask.
    """

    def __init__(
        self, host: BasicHost, listen_addrs: Callable[[], list[str]], *,
        confirmations: int = 2, clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.host = host
        self.listen_addrs = listen_addrs
        self.clock = clock
        self.rng = rng or random.Random()
        self.reachability = Reachability(confirmations=confirmations, trusted=frozenset(trusted))
        self._query = AutoNATService(host, serve=False)
        self._logged = UNKNOWN

    def status(self) -> tuple[str, str]:
        return self.reachability.status(self.clock())

    def direct_peers(self) -> list[ID]:
        """Connected peers with at least one non-relayed connection (relayed requests are refused)."""
        peers = []
        for pid, conns in self.host.get_network().connections.items():
            if any(not is_relayed(c) for c in conns):
                peers.append(pid)
        return peers

    async def check_once(self, max_servers: int = 3) -> tuple[str, str]:
        """Ask up to `max_servers` directly connected peers (bootstrap peers among them), concurrently; return the new status."""
        servers = self.direct_peers()
        self.rng.shuffle(servers)
        servers.sort(key=lambda server: server.to_base58() not in self.reachability.trusted)  # bootstraps first
        addrs = [multiaddr.Multiaddr(a.split("/p2p/")[0]).to_bytes() for a in self.listen_addrs()]

        async def ask(server: ID) -> None:
            try:
                with anyio.fail_after(QUERY_TIMEOUT):
                    status, _ = await self._query.query_server(server, addrs, timeout=QUERY_TIMEOUT)
            except Exception as exc:
                log.debug("AutoNAT query to %s failed: %r", server, exc)
                return
            if status in (Message.OK, Message.E_DIAL_ERROR):  # refusals say nothing about us
                self.reachability.record(server.to_base58(), status == Message.OK, self.clock())

        async with anyio.create_task_group() as tg:
            for server in servers[:max_servers]:
                tg.start_soon(ask, server)
        status, reason = self.status()
        if status != self._logged:
            self._logged = status
            log.info("reachability: %s (%s)", status, reason)
        return status, reason

    async def run(self, first_every: float = 3.0, then_every: float = 120.0) -> None:
        """Check every `first_every` s until decided, then every `then_every` s; runs until cancelled."""
        while True:
            status, _ = await self.check_once()
            await anyio.sleep(first_every if status == UNKNOWN else then_every)


__all__ = ["AUTONAT_PROTOCOL_ID", "AutoNatClient", "AutoNatServer", "PRIVATE", "PUBLIC", "Reachability", "UNKNOWN"]
