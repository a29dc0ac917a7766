"""Pairwise averaging and state sync over the `/murmur/average` and `/murmur/state` protocols.

An exchange is initiator → Offer (with the wire dtype), responder → Accept | Busy |
Refuse, then both stream their models at once (Params + Chunks each way), then each
checks the other's and commits, responder first; both then add the same merge delta
to their live models. A peer already in an exchange answers Busy at once, so two
peers that pick each other both move on. Any error, timeout or vanished partner
before the merge leaves the local model untouched; every failure returns its reason.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass

import anyio

from node.defense import ClippedGossip, WorkClaimLimiter
from node.merge import WeightingPolicy, merge_delta
from node.peers import PeerTable
from node.security import BanList
from node.trainer import Snapshot, Trainer
from node.transport import ByteStream, Transport, TransportError
from node.wire import Conversation
from protocol.codec import WIRE_DTYPES, WireState, check_wire_dtype
from protocol.errors import (
    FrameTooLarge,
    MalformedMessage,
    NonFiniteTensor,
    ProtocolError,
    ProtocolViolation,
    TensorMismatch,
)
from protocol.exchange import AVERAGE, STATE_SYNC, Exchange, Role
from protocol.messages import Abort, Accept, Busy, Commit, Offer, Refuse, StateReply, StateRequest

AVERAGE_PROTOCOL = "/murmur/average/2.0.0"
STATE_PROTOCOL = "/murmur/state/2.0.0"
log = logging.getLogger("murmur.averager")
# Errors only a faulty or hostile peer causes; each is a strike (timeouts and resets are not).
OFFENCES = (FrameTooLarge, MalformedMessage, ProtocolViolation, TensorMismatch, NonFiniteTensor)


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


@dataclass(frozen=True)
class Outcome:
    """How one exchange ended: merged, busy, refused, failed (with the reason)."""

    result: str
    partner: str
    reason: str
    duration_s: float = 0.0
    remote_share: float = 0.0
    bytes_sent: int = 0


class Averager:
    """Runs this node's side of averaging exchanges and state sync."""

    def __init__(
        self,
        transport: Transport,
        trainer: Trainer,
        table: PeerTable,
        policy: WeightingPolicy,
        identity: TaskIdentity,
        *,
        exchange_timeout: float,
        rng: random.Random,
        bans: BanList | None = None,
        wire_dtype: str = "float32",
    ) -> None:
        self.transport = transport
        self.trainer = trainer
        self.table = table
        self.policy = policy
        self.identity = identity
        self.exchange_timeout = exchange_timeout
        self.rng = rng
        self.in_exchange = False
        self.outcomes: Counter[str] = Counter()
        self.recent: deque[Outcome] = deque(maxlen=32)
        self.bytes_sent = 0
        self.typical_exchange_s = 0.0  # moving average of this node's completed exchanges
        self.wire_dtype = check_wire_dtype(wire_dtype)  # what this node proposes when it initiates
        self._max_params = max(trainer.spec.wire_size(dtype) for dtype in WIRE_DTYPES)
        self.bans = bans or BanList()
        self.claims = WorkClaimLimiter()
        self.screening = ClippedGossip()
        self.last_partner_distance: float | None = None  # L2 to the last partner's model we accepted (metrics)
        self._created = time.monotonic()

    def local_rate(self) -> float:
        """This peer's own samples/s since start: the yardstick for partners' claims."""
        return self.trainer.samples / max(1.0, time.monotonic() - self._created)

    async def _offence(self, peer_id: str, reason: str) -> None:
        """Strike `peer_id`; once banned, forget it and hang up."""
        if self.bans.strike(peer_id, reason):
            self.table.forget(peer_id)
            await self.transport.hang_up(peer_id)

    async def _vet(self, peer_id: str, snapshot: Snapshot, remote: WireState, claimed: float) -> tuple[float | None, float, str]:
        """Screen a partner's model and work claim: (pull to apply or None to reject, credited weight, reason)."""
        claim = self.claims.credit(peer_id, claimed, snapshot.weight, self.local_rate(), time.time())
        if claim.offence:
            await self._offence(peer_id, claim.reason)
        if snapshot.weight == 0:  # a newcomer adopts; it has no model of its own to defend
            return 1.0, claim.weight, claim.reason
        screening = await anyio.to_thread.run_sync(self.screening.screen, snapshot.state, remote)
        if screening.pull is not None:
            self.last_partner_distance = screening.distance
        if screening.offence:
            await self._offence(peer_id, f"rejected model: {screening.reason}")
        return screening.pull, claim.weight, screening.reason

    async def _swap(self, conv: Conversation, local: WireState) -> WireState:
        """Stream our model and receive the partner's at the same time (full duplex)."""
        spec = self.trainer.spec
        send_errors: list[Exception] = []

        async def send() -> None:
            try:
                await conv.send_params(local, spec)
            except (ProtocolError, TransportError) as exc:
                send_errors.append(exc)

        # Errors are caught inside the group and re-raised outside it, as themselves.
        received: WireState | None = None
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            try:
                received = await conv.receive_params(spec, local.dtype)
            except (ProtocolError, TransportError) as exc:
                error = exc
                tg.cancel_scope.cancel()
        if error or send_errors:
            raise error or send_errors[0]
        assert received is not None
        return received

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes[outcome.result] += 1
        self.recent.append(outcome)
        self.bytes_sent += outcome.bytes_sent
        level = logging.INFO if outcome.result in ("merged", "refused", "rejected") else logging.DEBUG
        log.log(level, "exchange with %s: %s (%s) in %.3fs", outcome.partner[-8:], outcome.result, outcome.reason, outcome.duration_s)
        return outcome

    async def run(self, period: float, max_attempts: int = 3, max_share: float = 0.1) -> None:
        """Every `period` seconds (jittered), try up to `max_attempts` partners until one merges.

        The period stretches so that exchanges take at most `max_share` of wall time:
        a big model's exchange costs real CPU (Noise encryption, codec), which would
        otherwise be taken from training.
        """
        while True:
            wait = max(period, self.typical_exchange_s / max_share)
            await anyio.sleep(wait * self.rng.uniform(0.5, 1.5))
            outcome = await self.average_once(max_attempts)
            if outcome.result == "merged":
                self.typical_exchange_s += 0.2 * (outcome.duration_s - self.typical_exchange_s)

    async def average_once(self, max_attempts: int = 3) -> Outcome:
        """Try random live partners until one exchange completes or none is left."""
        tried: set[str] = set()
        outcome = Outcome("no-partner", "", "no attempt made")
        for _ in range(max_attempts):
            entry, reason = self.table.select_partner(self.rng, tried)
            if entry is None:
                return Outcome("no-partner", "", reason)
            tried.add(entry.peer_id)
            outcome = await self.exchange_with(entry.peer_id, entry.addrs)
            if outcome.result == "merged":
                entry.exchanges += 1
                self.table.refresh(entry.peer_id, time.monotonic())
                break
        return outcome

    async def exchange_with(self, peer_id: str, addrs: list[str]) -> Outcome:
        """Run one exchange as initiator; return how it ended (never raises, but cancels)."""
        if self.in_exchange:
            return Outcome("busy", peer_id, "this node is already in an exchange")
        self.in_exchange = True
        start = time.perf_counter()
        stream: ByteStream | None = None
        sent = 0
        try:
            with anyio.fail_after(self.exchange_timeout):
                stream = await self.transport.open_stream(peer_id, addrs, AVERAGE_PROTOCOL)
                conv = Conversation(stream, Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=self._max_params))
                snapshot = await anyio.to_thread.run_sync(self.trainer.snapshot, self.wire_dtype)
                await conv.send(Offer(self.identity.run_id, self.identity.fingerprint, snapshot.weight, self.wire_dtype))
                answer = await conv.receive(Accept, Busy, Refuse)
                if isinstance(answer, (Busy, Refuse)):
                    result = "busy" if isinstance(answer, Busy) else "refused"
                    await stream.close()
                    return self._record(Outcome(result, peer_id, answer.reason, time.perf_counter() - start))
                assert isinstance(answer, Accept)  # for the type checker: `receive` checked it
                remote = await self._swap(conv, snapshot.state)
                sent = self.trainer.spec.wire_size(self.wire_dtype)
                pull, credited, verdict = await self._vet(peer_id, snapshot, remote, answer.work)
                if pull is None:
                    await conv.send(Abort(f"your model was rejected: {verdict}"))
                    await stream.close()
                    return self._record(Outcome("rejected", peer_id, verdict, time.perf_counter() - start, bytes_sent=sent))
                await conv.receive(Commit)  # the responder accepted our model
                await conv.send(Commit())
                await stream.close()
                decision = self.policy.mix(snapshot.weight, credited)
                await self._apply(snapshot, remote, decision.remote_share * pull, decision.weight_after)
                return self._record(Outcome("merged", peer_id, decision.reason, time.perf_counter() - start, decision.remote_share, sent))
        except TimeoutError:
            reason = f"timed out after {self.exchange_timeout:g}s"
        except ProtocolError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OFFENCES):
                await self._offence(peer_id, reason)
        except TransportError as exc:
            reason = str(exc)
        except anyio.get_cancelled_exc_class():
            if stream is not None:  # shutting down: tell the partner now rather than at its timeout
                await stream.reset()
            raise
        finally:
            self.in_exchange = False
        if stream is not None:
            await stream.reset()
        return self._record(Outcome("failed", peer_id, reason, time.perf_counter() - start, bytes_sent=sent))

    async def serve_exchange(self, stream: ByteStream) -> None:
        """Answer one inbound exchange (the `/murmur/average` stream handler)."""
        peer_id = stream.remote_peer
        start = time.perf_counter()
        conv = Conversation(stream, Exchange(Role.RESPONDER, AVERAGE, max_params_bytes=self._max_params))
        claimed = False
        sent = 0
        try:
            with anyio.fail_after(self.exchange_timeout):
                offer = await conv.receive(Offer)
                assert isinstance(offer, Offer)
                mismatch = self.identity.mismatch(offer.run_id, offer.fingerprint)
                if mismatch:
                    await conv.send(Refuse(mismatch))
                    self._record(Outcome("refused", peer_id, mismatch))
                    await stream.close()
                    return
                if self.in_exchange:
                    await conv.send(Busy("already in an exchange"))
                    await stream.close()
                    return
                self.in_exchange = claimed = True
                # The initiator picks the wire dtype: both sides must quantize alike for an exact merge.
                snapshot = await anyio.to_thread.run_sync(self.trainer.snapshot, offer.wire_dtype)
                await conv.send(Accept(snapshot.weight))
                try:
                    remote = await self._swap(conv, snapshot.state)
                except ProtocolError as exc:
                    await conv.send(Abort(f"{type(exc).__name__}: {exc}"))
                    raise
                sent = self.trainer.spec.wire_size(offer.wire_dtype)
                pull, credited, verdict = await self._vet(peer_id, snapshot, remote, offer.work)
                if pull is None:
                    await conv.send(Abort(f"your model was rejected: {verdict}"))
                    await stream.close()
                    self._record(Outcome("rejected", peer_id, verdict, time.perf_counter() - start, bytes_sent=sent))
                    return
                await conv.send(Commit())
                await conv.receive(Commit)  # the initiator accepted our model too
                decision = self.policy.mix(snapshot.weight, credited)
                await self._apply(snapshot, remote, decision.remote_share * pull, decision.weight_after)
                self.table.refresh(peer_id, time.monotonic())
                self._record(Outcome("merged", peer_id, decision.reason, time.perf_counter() - start, decision.remote_share, sent))
                await stream.close()
                return
        except TimeoutError:
            reason = f"timed out after {self.exchange_timeout:g}s"
        except ProtocolError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OFFENCES):
                await self._offence(peer_id, reason)
        except TransportError as exc:
            reason = str(exc)
        except anyio.get_cancelled_exc_class():
            await stream.reset()
            raise
        finally:
            if claimed:
                self.in_exchange = False
        self._record(Outcome("failed", peer_id, reason, time.perf_counter() - start, bytes_sent=sent))
        await stream.reset()

    async def _apply(self, snapshot: Snapshot, remote: WireState, remote_share: float, weight_after: float) -> None:
        delta = merge_delta(snapshot.state, remote, remote_share)
        # Shielded: once both sides committed, a cancellation must not leave half a merge.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.trainer.apply_merge, delta, snapshot.weight, weight_after)

    async def serve_state(self, stream: ByteStream) -> None:
        """Answer one state-sync request (the `/murmur/state` stream handler)."""
        conv = Conversation(stream, Exchange(Role.RESPONDER, STATE_SYNC))
        try:
            with anyio.fail_after(self.exchange_timeout):
                request = await conv.receive(StateRequest)
                assert isinstance(request, StateRequest)
                mismatch = self.identity.mismatch(request.run_id, request.fingerprint)
                if mismatch:
                    await conv.send(Refuse(mismatch))
                    log.warning("refused state sync from %s: %s", stream.remote_peer[-8:], mismatch)
                else:
                    snapshot = await anyio.to_thread.run_sync(self.trainer.snapshot, request.wire_dtype)
                    await conv.send(StateReply(snapshot.weight))
                    await conv.send_params(snapshot.state, self.trainer.spec)
                await stream.close()
                return
        except (TimeoutError, ProtocolError, TransportError) as exc:
            log.info("state sync for %s failed: %s", stream.remote_peer[-8:], exc or type(exc).__name__)
        await stream.reset()

    async def fetch_state(self, peer_id: str, addrs: list[str]) -> tuple[WireState, float]:
        """Download a peer's current model and weight, validated against ours.

        Raises `TransportError`, `ProtocolError` (including `Refuse` as
        `StateSyncRefused`) or `TimeoutError`; the local model is not touched.
        """
        stream = await self.transport.open_stream(peer_id, addrs, STATE_PROTOCOL)
        conv = Conversation(stream, Exchange(Role.INITIATOR, STATE_SYNC, max_params_bytes=self._max_params))
        try:
            with anyio.fail_after(self.exchange_timeout):
                await conv.send(StateRequest(self.identity.run_id, self.identity.fingerprint, self.wire_dtype))
                reply = await conv.receive(StateReply, Refuse)
                if isinstance(reply, Refuse):
                    raise StateSyncRefused(reply.reason)
                assert isinstance(reply, StateReply)
                state = await conv.receive_params(self.trainer.spec, self.wire_dtype)
                await stream.close()
                return state, reply.work
        except BaseException:
            await stream.reset()
            raise

    async def sync_from_swarm(self, attempts: int = 3, behind_ratio: float = 0.0) -> Outcome:
        """Before the first step: adopt a live peer's model and weight, if any answers.

        A node resuming from a checkpoint passes `behind_ratio`: it adopts the peer's
        model only if that carries at least `behind_ratio` times its own work weight, so
        a stale peer catches up instead of dragging its neighbours back.
        """
        tried: set[str] = set()
        outcome = Outcome("no-partner", "", "no known peers")
        for _ in range(attempts):
            entry, reason = self.table.select_partner(self.rng, tried)
            if entry is None:
                return outcome if tried else Outcome("no-partner", "", reason)
            tried.add(entry.peer_id)
            start = time.perf_counter()
            try:
                state, weight = await self.fetch_state(entry.peer_id, entry.addrs)
            except (TimeoutError, ProtocolError, TransportError) as exc:
                outcome = Outcome("failed", entry.peer_id, f"{type(exc).__name__}: {exc}")
                continue
            if weight < behind_ratio * self.trainer.weight:
                return Outcome("kept", entry.peer_id, f"peer's weight {weight:.0f} is not {behind_ratio:g}x ours ({self.trainer.weight:.0f})")
            await anyio.to_thread.run_sync(self.trainer.adopt, state, weight)
            outcome = Outcome("synced", entry.peer_id, f"adopted a model of weight {weight:.0f}", time.perf_counter() - start)
            log.info("state sync from %s: %s in %.3fs", entry.peer_id[-8:], outcome.reason, outcome.duration_s)
            return outcome
        return outcome


class StateSyncRefused(ProtocolError):
    """The peer refused to share its model (it trains another task)."""
