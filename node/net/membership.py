"""Peer exchange over `/murmur/peers`: join through bootstrap peers, learn the swarm, notice deaths.

Each round a node greets rumoured candidates and its stalest members with a `Hello`
(its task, addresses and a sample of the peers it knows); the answer refreshes the
member's liveness and rumours further peers. A peer on another task is refused with a
reason that both sides log. Members not heard from within the liveness timeout are dropped.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from murmur.node.net.conversation import Conversation
from murmur.node.net.dial_failure import dial_failure, short
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import ByteStream, Transport, TransportError
from murmur.protocol.errors import OFFENCES, ProtocolError
from murmur.protocol.exchange import PEER_EXCHANGE, Exchange, Role
from murmur.protocol.messages import Hello, PeerSummary, Refuse


class ModelLayout(Protocol):
    """What a refusal needs of a model's tensor names and shapes (`murmur.protocol.codec.TensorSpec`,
    which this layer does not import: it needs torch)."""

    def described(self) -> list[list]: ...

    def difference(self, theirs: Sequence[Sequence[Any]]) -> str: ...


PEERS_PROTOCOL = "/murmur/peers/1.0.0"
log = logging.getLogger("murmur.membership")


@dataclass(frozen=True)
class TaskIdentity:
    """What two peers must share to merge models: the run and the model's fingerprint.

    `spec`, the model's tensor names and shapes, lets a refusal name what differs.
    """

    run_id: str
    fingerprint: str
    spec: ModelLayout | None = field(default=None, compare=False)

    def mismatch(self, run_id: str, fingerprint: str) -> str | None:
        """Why a peer with this run and fingerprint cannot pair with us, or None."""
        if run_id != self.run_id:
            return f"task mismatch: run id {run_id!r} != {self.run_id!r}"
        if fingerprint != self.fingerprint:
            return f"task mismatch: model fingerprint {fingerprint[:12]} != {self.fingerprint[:12]}"
        return None



def parse_bootstrap(addr: str) -> tuple[str, list[str]]:
    """Split `/ip4/…/tcp/…/p2p/<id>` into (peer id, [addr]); raises `ValueError`."""
    if "/p2p/" not in addr:
        raise ValueError(f"bootstrap address {addr!r} must end in /p2p/<peer id>")
    peer_id = addr.rsplit("/p2p/", 1)[1]
    if not peer_id or "/" in peer_id:
        raise ValueError(f"bootstrap address {addr!r} has no peer id after /p2p/")
    return peer_id, [addr]


def short_address(addr: str) -> str:
    """`/ip4/1.2.3.4/tcp/4001/p2p/<id>` as `1.2.3.4:4001`, for log lines; other addresses without their `/p2p/` part."""
    parts = addr.split("/p2p/", 1)[0].split("/")
    if len(parts) == 5 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6") and parts[3] in ("tcp", "udp"):
        host = f"[{parts[2]}]" if parts[1] == "ip6" else parts[2]
        return f"{host}:{parts[4]}"
    return addr.split("/p2p/", 1)[0] or addr


class Membership:
    """Keeps `table` current by greeting peers; answers greetings from others."""

    def __init__(
        self,
        transport: Transport,
        table: PeerTable,
        identity: TaskIdentity,
        *,
        rng: random.Random,
        hello_timeout: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        bans: BanList | None = None,
        summary: Callable[[], PeerSummary | None] = lambda: None,
    ) -> None:
        """`summary` says what this node shares about itself in each hello (for dashboards)."""
        self.transport = transport
        self.table = table
        self.identity = identity
        self.rng = rng
        self.hello_timeout = hello_timeout
        self.clock = clock
        self.leaving = False
        self.join_results: dict[str, str] = {}  # bootstrap address -> how its greeting ended ("ok", "refused: …")
        self.bans = bans or BanList()
        self.summary = summary
        self._summaries: dict[str, tuple[PeerSummary, float]] = {}

    def summaries(self) -> dict[str, tuple[PeerSummary, float]]:
        """The latest summary of each live member and when it arrived (this node's clock).

        Only members are kept: a peer that leaves or times out drops out here too, so the
        map is bounded by the peer table.
        """
        self._prune_summaries()
        return dict(self._summaries)

    def _prune_summaries(self) -> None:
        members = self.table.members
        for peer_id in [p for p in self._summaries if p not in members]:
            del self._summaries[peer_id]

    def _hello(self) -> Hello:
        return Hello(self.identity.run_id, self.identity.fingerprint, self.transport.addresses(), self.table.records(self.rng), self.leaving,
                     None if self.leaving else self.summary())

    def _admit(self, peer_id: str, hello: Hello) -> str | None:
        """Apply a peer's hello to the table; return why it was refused, if it was."""
        mismatch = self.identity.mismatch(hello.run_id, hello.fingerprint)
        if mismatch:
            return mismatch
        if hello.leaving:
            self.table.forget(peer_id)
            log.info("peer %s is leaving", peer_id[-8:])
            return None
        if self.table.observe(peer_id, hello.addrs, self.clock()):
            log.info("new peer %s (%d known)", peer_id[-8:], len(self.table.members))
        if hello.summary is not None and peer_id in self.table.members:
            self._summaries[peer_id] = (hello.summary, self.clock())
            if len(self._summaries) > 2 * len(self.table.members):  # members churned away: bound the map
                self._prune_summaries()
        self.table.rumour(hello.peers)
        return None

    def _layout_for(self, hello: Hello) -> list | None:
        """Our model's layout for a refusal, when the fingerprint (not the run) is what differs."""
        same_run = hello.run_id == self.identity.run_id
        return self.identity.spec.described() if same_run and self.identity.spec is not None else None

    async def serve(self, stream: ByteStream) -> None:
        """Answer one inbound hello (the `/murmur/peers` stream handler)."""
        conv = Conversation(stream, Exchange(Role.RESPONDER, PEER_EXCHANGE))
        try:
            with anyio.fail_after(self.hello_timeout):
                hello = await conv.receive(Hello)
                assert isinstance(hello, Hello)
                refusal = self._admit(stream.remote_peer, hello)
                if refusal:
                    log.warning("refused peer %s: %s", stream.remote_peer[-8:], refusal)
                    await conv.send(Refuse(refusal, layout=self._layout_for(hello)))
                else:
                    await conv.send(self._hello())
                await stream.close()
                return
        except (TimeoutError, ProtocolError, TransportError) as exc:
            log.debug("hello from %s failed: %r", stream.remote_peer[-8:], exc)
            if isinstance(exc, OFFENCES):
                self.bans.strike(stream.remote_peer, f"{type(exc).__name__}: {exc}")
        await stream.reset()

    async def greet(self, peer_id: str, addrs: Sequence[str], *, quiet: bool = False) -> str:
        """Greet one peer and apply its answer; return the outcome in words.

        A refusal is logged at WARNING unless `quiet` (the caller logs the outcome itself).
        """
        try:
            with anyio.fail_after(self.hello_timeout):
                stream = await self.transport.open_stream(peer_id, addrs, PEERS_PROTOCOL)
                conv = Conversation(stream, Exchange(Role.INITIATOR, PEER_EXCHANGE))
                try:
                    await conv.send(self._hello())
                    answer = await conv.receive(Hello, Refuse)
                finally:
                    await stream.close()
        except TimeoutError:
            self.table.dial_failed(peer_id, self.clock())
            return f"unreachable: no answer within {self.hello_timeout:g} s"
        except ProtocolError as exc:
            self.table.dial_failed(peer_id, self.clock())
            return f"bad answer: {short(str(exc))}"
        except TransportError as exc:
            self.table.dial_failed(peer_id, self.clock())
            return dial_failure(exc)
        if isinstance(answer, Refuse):
            reason = answer.reason
            if answer.layout is not None and self.identity.spec is not None:
                reason = f"task mismatch: model fingerprint {self.identity.spec.difference(answer.layout)}"
            log.log(logging.DEBUG if quiet else logging.WARNING, "peer %s refused us: %s", peer_id[-8:], reason)
            self.table.forget(peer_id)
            self.table.dial_failed(peer_id, self.clock(), base_delay=30.0)
            await self.transport.hang_up(peer_id)
            return f"refused: {reason}"
        assert isinstance(answer, Hello)
        refusal = self._admit(peer_id, answer)
        if refusal:
            log.log(logging.DEBUG if quiet else logging.WARNING, "refused peer %s: %s", peer_id[-8:], refusal)
            self.table.dial_failed(peer_id, self.clock(), base_delay=30.0)
            await self.transport.hang_up(peer_id)
            return f"refused: {refusal}"
        return "ok"

    async def greet_bootstrap(self, addr: str) -> str:
        """Greet one bootstrap peer, record the outcome in `join_results` and log it when it changed.

        A failure is logged at WARNING once per distinct reason (retries repeat it every backoff
        period); a first success at INFO. Returns the outcome in words, as `greet` does.
        """
        peer_id, addrs = parse_bootstrap(addr)
        result = await self.greet(peer_id, addrs, quiet=True)
        previous = self.join_results.get(addr)
        self.join_results[addr] = result
        if result != previous:
            if result == "ok":
                log.info("bootstrap %s: joined", short_address(addr))
            else:
                log.warning("bootstrap %s: %s", short_address(addr), result)
        return result

    async def join(self, bootstrap: Sequence[str]) -> int:
        """Greet every bootstrap peer concurrently; return how many answered (`join_results`: each one's outcome)."""
        answered = 0

        async def one(addr: str) -> None:
            nonlocal answered
            if await self.greet_bootstrap(addr) == "ok":
                answered += 1

        async with anyio.create_task_group() as tg:
            for addr in bootstrap:
                tg.start_soon(one, addr)
        return answered

    def alone_reason(self, bootstrap: Sequence[str]) -> str | None:
        """Why this node knows no peer now, in one line, or None when it knows one.

        Without bootstrap peers a node is the swarm's first and waits for others to join it.
        """
        if self.table.members:
            return None
        if not bootstrap:
            return "no bootstrap peers given: waiting for peers to join this one"
        failed = [a for a in bootstrap if self.join_results.get(a, "ok") != "ok"]
        reasons = [f"{short_address(a)}: {self.join_results[a]}" for a in failed]
        return "; ".join(reasons) if reasons else "every bootstrap peer has left"

    async def run(self, bootstrap: Sequence[str], interval: float, fanout: int = 3) -> None:
        """Gossip forever: each round expire the dead and greet up to `fanout` peers.

        While it knows no member, each round also retries every bootstrap peer whose backoff
        has passed (doubling from 1 s up to 60 s per peer, `PeerTable.dial_failed`); once it
        knows a member it stops: peer exchange finds the rest.
        """
        while True:
            await anyio.sleep(interval * self.rng.uniform(0.8, 1.2))
            for peer_id in self.table.expire(self.clock()):
                log.info("peer %s timed out (%d known)", peer_id[-8:], len(self.table.members))
            targets = self.table.to_contact(self.clock(), fanout)
            retry = []
            if not self.table.members:
                busy = {peer_id for peer_id, _ in targets}
                due = [a for a in bootstrap if self.table.may_dial(parse_bootstrap(a)[0], self.clock())]
                retry = [a for a in due if parse_bootstrap(a)[0] not in busy]
            async with anyio.create_task_group() as tg:
                for peer_id, addrs in targets:
                    tg.start_soon(self.greet, peer_id, addrs)
                for addr in retry:
                    tg.start_soon(self.greet_bootstrap, addr)

    async def announce_leaving(self) -> None:
        """Tell every member we are leaving (best effort, bounded by the hello timeout)."""
        self.leaving = True
        async with anyio.create_task_group() as tg:
            for entry in list(self.table.members.values()):
                tg.start_soon(self.greet, entry.peer_id, entry.addrs)
