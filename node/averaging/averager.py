"""Pairwise averaging over the `/murmur/average` protocol (state sync: `state_sync.py`).

An exchange is initiator → Offer (with the wire dtype), responder → Accept | Busy |
Refuse, then both stream their models at once (Params + Chunks each way), then each
checks the other's and commits, responder first; both then add the same merge delta
to their live models. A peer already in an exchange answers Busy at once, so two
peers that pick each other both move on (unless that exchange fell behind: `slot.py`).
Any error, timeout or vanished partner before the merge leaves the local model
untouched; every failure returns its reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio

from murmur.node.averaging import params
from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.averaging.slot import ExchangeSlot, MeteredStream, Progress
from murmur.node.averaging.state_sync import StateSync
from murmur.node.learn.replica import MergeRefused, Replica, Snapshot
from murmur.node.learn.rules import MixDecision
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.scoring import MergeScorer
from murmur.node.learn.screening import ClippedGossip, WorkClaimLimiter
from murmur.node.learn.vetting import Vetting
from murmur.node.net.conversation import Conversation
from murmur.node.net.membership import TaskIdentity
from murmur.node.net.peers import PeerTable
from murmur.node.net.security import BanList
from murmur.node.net.transport import ByteStream, Transport, TransportError
from murmur.protocol.codec import WIRE_DTYPES, WireState, check_wire_dtype
from murmur.protocol.errors import OFFENCES, ProtocolError
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Abort, Accept, Busy, Commit, Offer, Refuse

AVERAGE_PROTOCOL = "/murmur/average/2.0.0"
LINK_OVERHEAD = 1.25  # a transfer's time over its payload's at the link's rated speed, at most
PREEMPT_GRACE = 0.2  # the share of --exchange-timeout a partner may keep this node waiting for nothing, and keep its slot
# What `--exchange-share` limits: the CPU time exchanges spend, or their whole duration.
SHARE_OF = ("cpu", "wall")
log = logging.getLogger("murmur.averager")
T = TypeVar("T")


@dataclass(frozen=True)
class _Claimed:
    """What the partner stated: its work and, if both sides use it, its work since its anchor."""

    work: float
    fresh: float | None


@dataclass
class _Attempt:
    """One exchange in flight: the partner, when it started, its stream, the bytes sent so far, the event
    loop thread's CPU time when it started and the CPU time its work on worker threads took so far."""

    peer_id: str
    start: float
    cpu_start: float
    progress: Progress  # what the partner sent, and how long it kept us waiting
    stream: MeteredStream | None = None
    sent: int = 0
    worker_cpu_s: float = 0.0
    allowed_s: float = 0.0  # the time the exchange may take, so far
    scope: anyio.CancelScope | None = None  # its deadline
    preempted: str | None = None  # why another partner took this exchange's place

    def attach(self, stream: ByteStream) -> None:
        self.stream = MeteredStream(stream, self.progress)

    def preempt(self, reason: str) -> None:
        """End the exchange now (not once its partner committed: the merge is shielded), with `reason`."""
        self.preempted = reason
        if self.scope is not None:
            self.scope.cancel()

    def extend(self, seconds: float) -> None:
        """Give the exchange `seconds` more (a transfer announced after it started); too late once it timed out."""
        if self.scope is not None and self.scope.cancel_called:
            return  # a deadline moved past now would no longer count the cancellation as a timeout
        self.allowed_s += seconds
        if self.scope is not None:
            self.scope.deadline += seconds

    def outcome(self, result: Result, reason: str, runtime: Runtime, remote_share: float = 0.0) -> Outcome:
        cpu_s = self.worker_cpu_s + runtime.cpu_time() - self.cpu_start
        return Outcome(result, self.peer_id, reason, runtime.monotonic() - self.start, remote_share, self.sent, cpu_s)


class Averager:
    """Runs this node's side of averaging exchanges and state sync.

    The merge itself is the replica's rule's; the partner's work claim goes through
    `claims`, its model through `screening` and, if given, `scorer` (`Vetting`). Clocks and worker
    threads come from `runtime`. Exchanges run over `protocol`.
    """

    protocol = AVERAGE_PROTOCOL

    def __init__(
        self,
        transport: Transport,
        replica: Replica,
        table: PeerTable,
        identity: TaskIdentity,
        *,
        screening: ClippedGossip,
        claims: WorkClaimLimiter,
        bans: BanList,
        scorer: MergeScorer | None = None,
        exchange_timeout: float,
        rng: random.Random,
        min_link_mbit: float = 5.0,
        wire_dtype: str = "float32",
        runtime: Runtime = Runtime(),
    ) -> None:
        self.transport = transport
        self.replica = replica
        self.table = table
        self.identity = identity
        self.screening = screening
        self.claims = claims
        self.vetting = Vetting(claims, screening, scorer, rng=rng)  # draws only to choose merges to score
        self.bans = bans
        self.rng = rng
        self.wire_dtype = check_wire_dtype(wire_dtype)  # what this node proposes when it initiates
        self.runtime = runtime
        self.slot = ExchangeSlot(min_link_mbit * 1e6 / 8 / LINK_OVERHEAD, PREEMPT_GRACE * exchange_timeout)
        self.outcomes: Counter[Result] = Counter()
        self.recent: deque[Outcome] = deque(maxlen=32)
        self.bytes_sent = 0
        self.typical_exchange_s = 0.0  # moving averages of this node's completed exchanges: their duration,
        self.typical_exchange_cpu_s = 0.0  # and the CPU time they took
        self.last_partner_distance: float | None = None  # L2 to the last partner's model we accepted (metrics)
        self._max_params = max(replica.spec.wire_size(dtype) for dtype in WIRE_DTYPES)
        self._exchange_timeout, self._min_link_mbit = exchange_timeout, min_link_mbit
        # A big model over a slow link needs more than a fixed timeout: give the transfer time at the slowest link
        # served, with room for what TCP, Noise and yamux add and for a link's goodput below its rated speed.
        self.timeout_s = exchange_timeout + LINK_OVERHEAD * self._max_params * 8 / (min_link_mbit * 1e6)
        self._created = runtime.monotonic()
        self.state_sync = StateSync(transport, replica, table, identity, rng=rng, timeout_s=self.timeout_s,
                                    max_params=self._max_params, runtime=runtime)

    @property
    def in_exchange(self) -> bool:
        return self.slot.busy

    def local_rate(self) -> float:
        """This peer's own samples/s since start: the yardstick for partners' claims."""
        return self.replica.samples / max(1.0, self.runtime.monotonic() - self._created)

    async def run(self, period: float, max_attempts: int = 3, max_share: float = 0.1, share_of: str = "cpu") -> None:
        """Every `period` seconds (jittered), try up to `max_attempts` partners until one merges.

        The period stretches so that exchanges take at most `max_share` of this peer's time.
        With `share_of="cpu"` that is the CPU time they spend (Noise encryption, codec,
        screening, merging), which would otherwise be taken from training, while waiting
        on a slow link costs nothing; with "wall" it is their whole duration. A peer with
        no work since its last merge has nothing new to offer and does not initiate (it
        still answers partners). Raises `ValueError` for a `share_of` not in `SHARE_OF`.
        """
        if share_of not in SHARE_OF:
            raise ValueError(f"unknown exchange share {share_of!r}; choose from {list(SHARE_OF)}")
        while True:
            typical = self.typical_exchange_cpu_s if share_of == "cpu" else self.typical_exchange_s
            wait = max(period, typical / max_share)
            await anyio.sleep(wait * self.rng.uniform(0.5, 1.5))
            if not self.replica.fresh:
                continue
            outcome = await self.average_once(max_attempts)
            if outcome.result == Result.MERGED:
                self.typical_exchange_s += 0.2 * (outcome.duration_s - self.typical_exchange_s)
                self.typical_exchange_cpu_s += 0.2 * (outcome.cpu_s - self.typical_exchange_cpu_s)

    async def average_once(self, max_attempts: int = 3) -> Outcome:
        """Try random live partners until one exchange completes or none is left."""
        tried: set[str] = set()
        outcome = Outcome(Result.NO_PARTNER, "", "no attempt made")
        for _ in range(max_attempts):
            entry, reason = self.table.select_partner(self.rng, tried)
            if entry is None:
                return Outcome(Result.NO_PARTNER, "", reason)
            tried.add(entry.peer_id)
            outcome = await self.exchange_with(entry.peer_id, entry.addrs)
            if outcome.result == Result.MERGED:
                break
        return outcome

    async def exchange_with(self, peer_id: str, addrs: list[str]) -> Outcome:
        """Run one exchange as initiator; return how it ended (never raises, but cancels)."""
        if self.in_exchange:
            return Outcome(Result.BUSY, peer_id, "this node is already in an exchange")
        attempt = self._begin(peer_id)
        with self.slot.hold(attempt):
            return await self._attempt(attempt, self._initiate, addrs)

    async def serve_exchange(self, stream: ByteStream) -> None:
        """Answer one inbound exchange (the `/murmur/average` stream handler)."""
        await self._attempt(self._begin(stream.remote_peer, stream), self._respond)

    async def _initiate(self, attempt: _Attempt, addrs: list[str]) -> Outcome:
        attempt.attach(await self.transport.open_stream(attempt.peer_id, addrs, self.protocol))
        conv = Conversation(attempt.stream, Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=self._max_params))
        snapshot = await self._compute(attempt, self.replica.snapshot, self.wire_dtype)
        fresh = self._stated_fresh(snapshot)
        await conv.send(Offer(self.identity.run_id, self.identity.fingerprint, snapshot.work, self.wire_dtype, fresh))
        answer = await conv.receive(Accept, Busy, Refuse)
        if isinstance(answer, (Busy, Refuse)):
            return await self._declined(attempt, answer)
        assert isinstance(answer, Accept)  # for the type checker: `receive` checked it
        claimed = _Claimed(answer.work, answer.fresh if fresh is not None else None)
        return await self._merge(conv, attempt, snapshot, claimed, initiator=True)

    async def _respond(self, attempt: _Attempt) -> Outcome | None:
        assert attempt.stream is not None
        conv = Conversation(attempt.stream, Exchange(Role.RESPONDER, AVERAGE, max_params_bytes=self._max_params))
        offer = await conv.receive(Offer)
        assert isinstance(offer, Offer)

        async def accept() -> Outcome:
            # The initiator picks the wire dtype: both sides must quantize alike for an exact merge.
            snapshot = await self._compute(attempt, self.replica.snapshot, offer.wire_dtype)
            # Fresh work is stated back only to an initiator that stated its own: peers from before the
            # field would refuse it, and a rule may only use it when both sides know both values.
            fresh = self._stated_fresh(snapshot) if offer.fresh is not None else None
            await conv.send(Accept(snapshot.work, fresh))
            claimed = _Claimed(offer.work, offer.fresh if fresh is not None else None)
            return await self._merge(conv, attempt, snapshot, claimed, initiator=False)

        return await self._serve_if_free(conv, attempt, self.identity.mismatch(offer.run_id, offer.fingerprint), accept)

    async def _declined(self, attempt: _Attempt, answer: Busy | Refuse) -> Outcome:
        """The partner answered Busy or Refuse: hang up, and say which and why."""
        assert attempt.stream is not None
        await attempt.stream.close()
        return attempt.outcome(Result.BUSY if isinstance(answer, Busy) else Result.REFUSED, answer.reason, self.runtime)

    async def _serve_if_free(
        self, conv: Conversation, attempt: _Attempt, mismatch: str | None, body: Callable[[], Awaitable[Outcome]]
    ) -> Outcome | None:
        """Refuse a partner of another run or model (`mismatch`), answer Busy while this node is in an
        exchange that may go on (None: the initiator records it and tries someone else), else run `body`
        as this node's one exchange."""
        if mismatch:
            await conv.send(Refuse(mismatch))
            await conv.stream.close()
            return attempt.outcome(Result.REFUSED, mismatch, self.runtime)
        if not await self.slot.free_for(attempt.peer_id, self.table.has_record(attempt.peer_id)):
            await conv.send(Busy("already in an exchange"))
            await conv.stream.close()
            return None
        with self.slot.hold(attempt):
            return await body()

    def _stated_fresh(self, snapshot: Snapshot) -> float | None:
        """The fresh work this side states in its Offer or Accept: only for a rule that uses it."""
        if not self.replica.rule.uses_fresh_work:
            return None
        return min(snapshot.fresh, snapshot.work)  # never above the stated work, even by rounding

    async def _merge(self, conv: Conversation, attempt: _Attempt, snapshot: Snapshot, claimed: _Claimed, *, initiator: bool) -> Outcome:
        """Swap models, vet the partner's, commit (responder first) and apply the rule's merge."""
        with self.table.swapping_with(attempt.peer_id):
            try:
                remote = await self._swap(conv, attempt, snapshot.state)
            except ProtocolError as exc:
                with contextlib.suppress(ProtocolError, TransportError):  # best effort: the error below is what counts
                    await conv.send(Abort(f"{type(exc).__name__}: {exc}"))
                raise
        attempt.sent = self.replica.spec.wire_size(snapshot.state.dtype)
        decision, verdict = await self._vet(attempt, snapshot, remote, claimed)
        if decision is None:
            await conv.send(Abort(f"your model was rejected: {verdict}"))
            await conv.stream.close()
            return attempt.outcome(Result.REJECTED, verdict, self.runtime)
        if initiator:
            await conv.receive(Commit)  # the responder accepted our model
            await conv.send(Commit())
        else:
            await conv.send(Commit())
            await conv.receive(Commit)  # the initiator accepted our model too
        await conv.stream.close()
        # Shielded: once both sides committed, a cancellation must not leave half a merge.
        with anyio.CancelScope(shield=True):
            try:
                await self._compute(attempt, self.replica.merge, snapshot, remote, decision.remote_share, decision.work_after)
            except MergeRefused as exc:  # the local model stays; the transfer still measured the link
                outcome = attempt.outcome(Result.REJECTED, f"{type(exc).__name__}: {exc}", self.runtime)
            else:
                outcome = attempt.outcome(Result.MERGED, decision.reason, self.runtime, decision.remote_share)
        self.table.record_exchange(attempt.peer_id, outcome.bytes_sent, outcome.duration_s, self.runtime.monotonic())
        return outcome

    async def _attempt(self, attempt: _Attempt, body: Callable[..., Awaitable[Outcome | None]], *args: Any) -> Outcome:
        """Run one exchange's `body` under the exchange timeout and record how it ended.

        Every failure becomes a `failed` outcome with its reason (a hostile peer's also a
        strike) and resets the stream; cancellation resets it too, then propagates.
        """
        attempt.allowed_s = self.timeout_s
        try:
            with anyio.fail_after(self.timeout_s) as attempt.scope:
                outcome = await body(attempt, *args)
                return self._record(outcome) if outcome else Outcome(Result.BUSY, attempt.peer_id, "answered busy")
            assert attempt.preempted is not None  # only a preemption cancels the scope before its deadline
            reason = attempt.preempted
        except TimeoutError:
            reason = f"timed out after {attempt.allowed_s:.3g}s"
        except ProtocolError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OFFENCES):
                await self._offence(attempt.peer_id, reason)
        except TransportError as exc:
            reason = str(exc)
        except anyio.get_cancelled_exc_class():
            if attempt.stream is not None:  # shutting down: tell the partner now rather than at its timeout
                await attempt.stream.reset()
            raise
        if attempt.stream is not None:
            await attempt.stream.reset()
        return self._record(attempt.outcome(Result.FAILED, reason, self.runtime))

    async def _offence(self, peer_id: str, reason: str) -> None:
        """Strike `peer_id`; once banned, forget it and hang up."""
        if self.bans.strike(peer_id, reason):  # Unix time: bans are saved and checked by the connection guard
            self.table.forget(peer_id)
            await self.transport.hang_up(peer_id)

    async def _vet(self, attempt: _Attempt, snapshot: Snapshot, remote: WireState, claimed: _Claimed) -> tuple[MixDecision | None, str]:
        """Vet the partner's claim and model (`Vetting.vet`, off the event loop) and strike its offences.

        Returns the decision (its share clipped by screening), or None to reject, and the verdict.
        """
        # A partner states fresh work only back to a side that stated its own (`_stated_fresh`, not None).
        fresh = None if claimed.fresh is None else (self._stated_fresh(snapshot), claimed.fresh)
        verdict = await self._compute(
            attempt, self.vetting.vet, attempt.peer_id, self.replica.rule, snapshot, remote, claimed.work, fresh,
            self.local_rate(), self.runtime.wall(),
        )
        for offence in verdict.offences:
            await self._offence(attempt.peer_id, offence)
        if verdict.decision is not None and verdict.distance is not None:
            self.last_partner_distance = verdict.distance
        return verdict.decision, verdict.reason

    async def _swap(self, conv: Conversation, attempt: _Attempt, local: WireState) -> WireState:
        """Stream our model and receive the partner's at the same time (full duplex)."""
        spec = self.replica.spec
        send_errors: list[Exception] = []

        async def send() -> None:
            try:
                await params.send_params(conv, local, spec)
            except (ProtocolError, TransportError) as exc:
                send_errors.append(exc)

        # Errors are caught inside the group and re-raised outside it, as themselves.
        received: WireState | None = None
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            try:
                received = await params.receive_params(conv, spec, local.dtype, functools.partial(self._compute, attempt))
            except (ProtocolError, TransportError) as exc:
                error = exc
                tg.cancel_scope.cancel()
        if error or send_errors:
            raise error or send_errors[0]
        assert received is not None
        return received

    def _begin(self, peer_id: str, stream: ByteStream | None = None) -> _Attempt:
        attempt = _Attempt(peer_id, self.runtime.monotonic(), self.runtime.cpu_time(), Progress(self.runtime.monotonic))
        if stream is not None:
            attempt.attach(stream)
        return attempt

    async def _compute(self, attempt: _Attempt, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` off the event loop (`Runtime.run_sync`), its CPU time counted as `attempt`'s."""

        def timed() -> T:
            start = self.runtime.cpu_time()
            try:
                return func(*args)
            finally:
                attempt.worker_cpu_s += self.runtime.cpu_time() - start

        return await self.runtime.run_sync(timed)

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes[outcome.result] += 1
        self.recent.append(outcome)
        self.bytes_sent += outcome.bytes_sent
        # Merges are routine (several a second): the node's periodic progress line counts them.
        level = logging.INFO if outcome.result in (Result.REFUSED, Result.REJECTED) else logging.DEBUG
        log.log(level, "exchange with %s: %s (%s) in %.3fs", outcome.partner[-8:], outcome.result, outcome.reason, outcome.duration_s)
        return outcome
