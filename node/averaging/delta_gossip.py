"""Delta gossip over `/murmur/gossip` (`--compression`); the model side is `murmur.node.learn.deltas`.

An exchange is initiator → Digest (task, bits, the deltas its model holds), responder →
Digest | Busy | Refuse; then each side streams, full duplex, the deltas from its recent log
that the other lacks (a `Delta` and its `Chunk`s each) and commits. Once the digests are
swapped, each side publishes its fresh progress as a new delta, so it leaves at once (and a
busy partner says so before anyone computed anything). Each delta adds its
own transfer time at the link's measured speed to the exchange's deadline. A delta received is
decoded and validated off the event loop, screened, and added to the model as it arrives;
it is passed on to later partners as it came. One that fails a check ends the exchange
(a malformed one is a strike) and never touches the model.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio

from murmur.node.averaging.averager import LINK_OVERHEAD, Averager, _Attempt
from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.learn.deltas import Compression, Published, StaleDelta
from murmur.node.learn.screening import ClippedGossip
from murmur.node.net.conversation import Conversation
from murmur.node.net.transport import TransportError
from murmur.protocol.codec import CHUNK_BYTES
from murmur.protocol.errors import ProtocolError, ProtocolViolation
from murmur.protocol.exchange import GOSSIP, Exchange, Role
from murmur.protocol.messages import Busy, Chunk, Commit, Delta, Digest, Refuse
from murmur.protocol.sparse import SparseDecoder, encode_sparse, max_sparse_size

GOSSIP_PROTOCOL = "/murmur/gossip/1.0.0"
LOG_SHARE = 0.125  # the deltas kept to pass on take at most this share of the model's float32 bytes
MAX_DELTAS = 256  # a partner may send at most this many deltas in one exchange
DENSITY_SLACK = 4.0  # a partner's delta may be this many times denser than ours
log = logging.getLogger("murmur.averager")


@dataclass(frozen=True)
class EncodedDelta:
    """A delta as it travels: its `Delta` announcement's fields and its sparse bytes."""

    origin: str
    seq: int
    scale: float
    work: float
    data: bytes


class DeltaLog:
    """The recent deltas this peer passes on, newest last, within `budget` bytes (the oldest go first)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: deque[EncodedDelta] = deque()
        self.size = 0

    def add(self, entry: EncodedDelta) -> None:
        self.entries.append(entry)
        self.size += len(entry.data)
        while self.size > self.budget and len(self.entries) > 1:
            self.size -= len(self.entries.popleft().data)

    def missing(self, versions: Mapping[str, int]) -> list[EncodedDelta]:
        """The deltas a model holding `versions` lacks, oldest first."""
        return [e for e in self.entries if e.seq > versions.get(e.origin, 0)]


class DeltaGossiper(Averager):
    """This node's side of delta gossip and state sync: an `Averager` whose exchanges swap deltas.

    Takes `Averager`'s arguments; the replica must keep a delta reference (built with
    `compression`), else `ValueError`. Deltas are screened by `delta_screening`, a clipped
    radius of their norms learned apart from the averaging screen's.
    """

    protocol = GOSSIP_PROTOCOL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.replica.compression is None:
            raise ValueError("delta gossip needs a replica built with compression")
        self.compression: Compression = self.replica.compression
        spec, bits = self.replica.spec, self.compression.bits
        self.log = DeltaLog(int(LOG_SHARE * spec.wire_size("float32")))
        self.delta_screening = ClippedGossip()
        slack = Compression(min(1.0, DENSITY_SLACK * self.compression.density), bits)
        self._max_delta = max_sparse_size(spec, bits, slack.entries)
        # Digests and commits; each delta then extends the deadline by its own transfer time (`_transfer_time`).
        self.timeout_s = self._exchange_timeout

    async def _initiate(self, attempt: _Attempt, addrs: list[str]) -> Outcome:
        attempt.attach(await self.transport.open_stream(attempt.peer_id, addrs, self.protocol))
        conv = Conversation(attempt.stream, Exchange(Role.INITIATOR, GOSSIP, max_params_bytes=self._max_delta))
        ours = await self._digest(attempt)
        await conv.send(ours)
        answer = await conv.receive(Digest, Busy, Refuse)
        if isinstance(answer, (Busy, Refuse)):
            return await self._declined(attempt, answer)
        assert isinstance(answer, Digest)
        return await self._swap_deltas(conv, attempt, ours, answer)

    async def _respond(self, attempt: _Attempt) -> Outcome | None:
        assert attempt.stream is not None
        conv = Conversation(attempt.stream, Exchange(Role.RESPONDER, GOSSIP, max_params_bytes=self._max_delta))
        theirs = await conv.receive(Digest)
        assert isinstance(theirs, Digest)
        mismatch = self.identity.mismatch(theirs.run_id, theirs.fingerprint)
        if not mismatch and theirs.bits != self.compression.bits:
            mismatch = f"deltas travel in {self.compression.bits} bits here, {theirs.bits} there"

        async def answer() -> Outcome:
            ours = await self._digest(attempt)
            await conv.send(ours)
            return await self._swap_deltas(conv, attempt, ours, theirs)

        return await self._serve_if_free(conv, attempt, mismatch, answer)

    async def _digest(self, attempt: _Attempt) -> Digest:
        """What this peer's model holds (its own newest delta aside: no partner can have that yet)."""
        versions = await self._compute(attempt, self.replica.delta_versions)
        return Digest(self.identity.run_id, self.identity.fingerprint, self.compression.bits, versions)

    async def _publish_fresh(self, attempt: _Attempt) -> None:
        """Publish this peer's fresh progress, if any, into the log."""
        if self.replica.fresh <= 0:
            return
        scale = 1.0 / (len(self.table.members) + 1)  # the swarm's mean progress
        try:
            self.log.add(await self._compute(attempt, self._publish, scale))
        except ValueError as exc:  # a model gone NaN has nothing to share; exchanges still bring it deltas
            log.warning("not publishing: %s", exc)

    def _transfer_time(self, peer_id: str, nbytes: int) -> float:
        """The time `nbytes` may take over the link to `peer_id`: at half the speed earlier exchanges with it
        measured (a link may slow down), else at `--min-link-mbit`."""
        entry = self.table.members.get(peer_id)
        rate = entry.exchange_rate / 2 if entry is not None and entry.exchange_rate else self._min_link_mbit * 1e6 / 8
        return LINK_OVERHEAD * nbytes / rate

    def _publish(self, scale: float) -> EncodedDelta:
        published = self.replica.publish(scale)
        data = b"".join(encode_sparse(published.delta, self.replica.spec, self.compression.bits))
        return EncodedDelta(published.origin, published.seq, published.scale, published.work, data)

    async def _swap_deltas(self, conv: Conversation, attempt: _Attempt, ours: Digest, theirs: Digest) -> Outcome:
        """Publish, then send the deltas the partner lacks while receiving the ones we lack, and commit."""
        await self._publish_fresh(attempt)
        outgoing = self.log.missing(theirs.versions)
        send_errors: list[Exception] = []

        async def send() -> None:
            try:
                for entry in outgoing:
                    attempt.extend(self._transfer_time(attempt.peer_id, len(entry.data)))
                    await conv.send(Delta(entry.origin, entry.seq, entry.scale, entry.work, len(entry.data)))
                    for start in range(0, len(entry.data), CHUNK_BYTES):
                        await conv.send(Chunk(entry.data[start : start + CHUNK_BYTES]))
                    attempt.sent += len(entry.data)
                await conv.send(Commit())
            except (ProtocolError, TransportError) as exc:
                send_errors.append(exc)

        received = 0
        error: Exception | None = None
        with self.table.swapping_with(attempt.peer_id):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                try:
                    received = await self._receive_deltas(conv, attempt, ours)
                except (ProtocolError, TransportError) as exc:
                    error = exc
                    tg.cancel_scope.cancel()
        if error or send_errors:
            raise error or send_errors[0]
        await conv.stream.close()
        self.table.record_exchange(
            attempt.peer_id, attempt.sent, self.runtime.monotonic() - attempt.start, self.runtime.monotonic()
        )
        return attempt.outcome(Result.MERGED, f"received {received} deltas, sent {len(outgoing)}", self.runtime)

    async def _receive_deltas(self, conv: Conversation, attempt: _Attempt, ours: Digest) -> int:
        """Take the partner's deltas until its commit; return how many were added to the model."""
        count = 0
        model_norm: float | None = None  # the screening's yardstick, measured once an exchange brings a delta
        while True:
            message = await conv.receive(Delta, Commit)
            if isinstance(message, Commit):
                return count
            assert isinstance(message, Delta)
            count += 1
            if count > MAX_DELTAS:
                raise ProtocolViolation(f"gossip: more than {MAX_DELTAS} deltas in one exchange")
            attempt.extend(self._transfer_time(attempt.peer_id, message.size))  # bounded: the size is capped
            if message.seq <= ours.versions.get(message.origin, 0):
                raise ProtocolViolation(
                    f"gossip: delta {message.seq} of {message.origin}, which our digest said we hold"
                )
            decoder = SparseDecoder(self.replica.spec, self.compression.bits, message.size)
            while not decoder.complete:
                chunk = await conv.receive(Chunk)
                assert isinstance(chunk, Chunk)
                decoder.feed(chunk.payload)
            delta = await self._compute(attempt, decoder.finish)
            if model_norm is None:
                model_norm = await self._compute(attempt, self.replica.model_norm)
            published = Published(message.origin, message.seq, delta, message.scale, message.work)
            entry = EncodedDelta(message.origin, message.seq, message.scale, message.work, decoder.data)
            await self._absorb(attempt, published, entry, model_norm)

    async def _absorb(self, attempt: _Attempt, published: Published, entry: EncodedDelta, model_norm: float) -> None:
        """Screen a received delta, credit its work, add it to the model and keep it (`entry`, as it came) to pass on.

        Raises `ProtocolViolation` for a delta screening rejects (a strike, as for a model).
        """
        norm = published.scale * sum(float(t.values.square().sum()) for t in published.delta.values()) ** 0.5
        screening = self.delta_screening.judge(norm, model_norm)
        if screening.pull is None:  # an offence, as the exchange's failure
            raise ProtocolViolation(f"gossip: rejected delta {published.seq} of {published.origin}: {screening.reason}")
        claim = self.claims.credit(
            attempt.peer_id, published.work, self.replica.work, self.local_rate(), self.runtime.wall()
        )
        if claim.offence:
            await self._offence(attempt.peer_id, claim.reason)
        applied = Published(
            published.origin, published.seq, published.delta, published.scale * screening.pull, claim.work
        )
        try:
            await self._compute(attempt, self.replica.absorb, applied)
        except StaleDelta:  # state sync replaced the model meanwhile: it holds this one already
            return
        self.log.add(entry)
