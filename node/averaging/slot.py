"""The one exchange a node runs at a time, and when a partner may take its place.

A partner that offers while the slot is taken is answered Busy, unless the exchange
holding it fell behind: the time spent waiting for its partner's bytes exceeds a grace
plus what the bytes received so far justify at the slowest link served. Then a partner
with a record here (an exchange completed before) preempts it: the old exchange ends
with the reason, and the new one runs. Strangers never preempt, so partners with
fresh identities, which cost nothing, cannot keep the slot from the peers a node has
merged with by trickling their bytes in turns (`docs/history/2026-12-07-trickling-partners.md`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import anyio

from murmur.node.net.transport import READ_CHUNK, ByteStream, ForwardingStream

RELEASE_WAIT_S = 1.0  # how long a preempting partner waits for the old exchange to unwind before it is answered Busy


@dataclass
class Progress:
    """What a partner delivered in one exchange: the bytes, and the time spent waiting for them."""

    clock: Callable[[], float]
    received: int = 0
    waited_s: float = 0.0  # in reads that ended
    _waiting_since: float | None = None

    def waited(self) -> float:
        """Seconds spent waiting on the partner so far, the read in progress included."""
        current = 0.0 if self._waiting_since is None else self.clock() - self._waiting_since
        return self.waited_s + current

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._waiting_since = self.clock()
        try:
            yield
        finally:
            self.waited_s += self.clock() - self._waiting_since
            self._waiting_since = None


class MeteredStream(ForwardingStream):
    """A stream whose reads count into `progress`."""

    def __init__(self, inner: ByteStream, progress: Progress) -> None:
        super().__init__(inner)
        self.progress = progress

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        with self.progress.waiting():
            data = await self.inner.receive_some(max_bytes)
        self.progress.received += len(data)
        return data


class Holder(Protocol):
    """An exchange in the slot: its partner, its partner's progress, and how to end it early."""

    peer_id: str
    progress: Progress

    def preempt(self, reason: str) -> None: ...


class ExchangeSlot:
    """One exchange at a time; a partner that fell behind gives way to one with a record.

    `bytes_per_s` is the slowest link served (each byte received buys 1/`bytes_per_s` s of
    waiting) and `grace_s` the waiting any exchange may do beyond that (the partner computing).
    """

    def __init__(self, bytes_per_s: float, grace_s: float) -> None:
        if bytes_per_s <= 0 or grace_s < 0:
            raise ValueError(f"need a positive link speed and a grace of at least 0, not {bytes_per_s}, {grace_s}")
        self.bytes_per_s, self.grace_s = bytes_per_s, grace_s
        self.holder: Holder | None = None
        self._released: anyio.Event | None = None  # set as the holder leaves (an Event needs the event loop)

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def lag(self, holder: Holder) -> float:
        """Seconds `holder`'s partner is behind: waiting beyond the grace and what its bytes justify (≤ 0: on pace)."""
        progress = holder.progress
        return progress.waited() - self.grace_s - progress.received / self.bytes_per_s

    @contextlib.contextmanager
    def hold(self, holder: Holder) -> Iterator[None]:
        """Run `holder`'s exchange in the slot; raises `RuntimeError` if it is taken (check `free_for` first)."""
        if self.holder is not None:
            raise RuntimeError("the exchange slot is taken")
        self.holder, released = holder, anyio.Event()
        self._released = released
        try:
            yield
        finally:
            self.holder = None
            released.set()

    async def free_for(self, peer_id: str, has_record: bool) -> bool:
        """Whether `peer_id`'s exchange may `hold` the slot now: it is free, or its holder fell behind and
        `peer_id` has a record, so the holder is preempted and given up to `RELEASE_WAIT_S` to unwind."""
        holder = self.holder
        if holder is None:
            return True
        lag = self.lag(holder)
        if not has_record or lag <= 0:
            return False
        progress = holder.progress
        holder.preempt(
            f"preempted by {peer_id[-8:]}: {progress.received} bytes in {progress.waited():.3g}s of waiting "
            f"is {lag:.3g}s behind the slowest link served"
        )
        assert self._released is not None  # set by `hold`
        with anyio.move_on_after(RELEASE_WAIT_S):
            await self._released.wait()
        return self.holder is None
