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
from dataclasses import dataclass

import anyio

from murmur.node.net.conversation import Conversation
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import ByteStream, Transport, TransportError
from murmur.protocol.errors import OFFENCES, ProtocolError
from murmur.protocol.exchange import PEER_EXCHANGE, Exchange, Role
from murmur.protocol.messages import Hello, PeerSummary, Refuse

PEERS_PROTOCOL = "/murmur/peers/1.0.0"
log = logging.getLogger("murmur.membership")


@dataclass(frozen=True)
class TaskIdentity:
    """What two peers must share to merge models: the run and the model's fingerprint."""

    run_id: str
    fingerprint: str

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
                    await conv.send(Refuse(refusal))
                else:
                    await conv.send(self._hello())
                await stream.close()
                return
        except (TimeoutError, ProtocolError, TransportError) as exc:
            log.debug("hello from %s failed: %r", stream.remote_peer[-8:], exc)
            if isinstance(exc, OFFENCES):
                self.bans.strike(stream.remote_peer, f"{type(exc).__name__}: {exc}")
        await stream.reset()

    async def greet(self, peer_id: str, addrs: Sequence[str]) -> str:
        """Greet one peer and apply its answer; return the outcome in words."""
        try:
            with anyio.fail_after(self.hello_timeout):
                stream = await self.transport.open_stream(peer_id, addrs, PEERS_PROTOCOL)
                conv = Conversation(stream, Exchange(Role.INITIATOR, PEER_EXCHANGE))
                try:
                    await conv.send(self._hello())
                    answer = await conv.receive(Hello, Refuse)
                finally:
                    await stream.close()
        except (TimeoutError, ProtocolError, TransportError) as exc:
            self.table.dial_failed(peer_id, self.clock())
            return f"unreachable: {type(exc).__name__}: {exc}"
        if isinstance(answer, Refuse):
            log.warning("peer %s refused us: %s", peer_id[-8:], answer.reason)
            self.table.forget(peer_id)
            self.table.dial_failed(peer_id, self.clock(), base_delay=30.0)
            await self.transport.hang_up(peer_id)
            return f"refused: {answer.reason}"
        assert isinstance(answer, Hello)
        refusal = self._admit(peer_id, answer)
        if refusal:
            log.warning("refused peer %s: %s", peer_id[-8:], refusal)
            self.table.dial_failed(peer_id, self.clock(), base_delay=30.0)
            await self.transport.hang_up(peer_id)
            return f"refused: {refusal}"
        return "ok"

    async def join(self, bootstrap: Sequence[str]) -> int:
        """Greet every bootstrap peer concurrently; return how many answered (`join_results`: each one's outcome)."""
        answered = 0

        async def one(addr: str) -> None:
            nonlocal answered
            peer_id, addrs = parse_bootstrap(addr)
            result = self.join_results[addr] = await self.greet(peer_id, addrs)
            if result == "ok":
                answered += 1
            else:
                log.warning("bootstrap %s: %s", addr, result)

        async with anyio.create_task_group() as tg:
            for addr in bootstrap:
                tg.start_soon(one, addr)
        return answered

    async def run(self, bootstrap: Sequence[str], interval: float, fanout: int = 3) -> None:
        """Gossip forever: each round expire the dead and greet up to `fanout` peers."""
        while True:
            await anyio.sleep(interval * self.rng.uniform(0.8, 1.2))
            for peer_id in self.table.expire(self.clock()):
                log.info("peer %s timed out (%d known)", peer_id[-8:], len(self.table.members))
            targets = self.table.to_contact(self.clock(), fanout)
            if not self.table.members and not targets:
                # Alone: retry the bootstrap peers (their backoff keeps this gentle).
                targets = [parse_bootstrap(a) for a in bootstrap if self.table.may_dial(parse_bootstrap(a)[0], self.clock())]
            async with anyio.create_task_group() as tg:
                for peer_id, addrs in targets:
                    tg.start_soon(self.greet, peer_id, addrs)

    async def announce_leaving(self) -> None:
        """Tell every member we are leaving (best effort, bounded by the hello timeout)."""
        self.leaving = True
        async with anyio.create_task_group() as tg:
            for entry in list(self.table.members.values()):
                tg.start_soon(self.greet, entry.peer_id, entry.addrs)
