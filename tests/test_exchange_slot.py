"""The exchange slot: who may take it, when its holder fell behind, and what a metered stream counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio
import pytest
import trio.testing

from murmur.node.averaging.slot import RELEASE_WAIT_S, ExchangeSlot, MeteredStream, Progress
from murmur.node.net.transport import MemoryNetwork

pytestmark = pytest.mark.anyio
GRACE_S = 2.0
BYTES_PER_S = 1000.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


@dataclass
class Holder:
    peer_id: str
    progress: Progress = field(default_factory=lambda: Progress(anyio.current_time))
    reasons: list[str] = field(default_factory=list)
    preempted: anyio.Event = field(default_factory=anyio.Event)

    def preempt(self, reason: str) -> None:
        self.reasons.append(reason)
        self.preempted.set()


async def hold_until_preempted(slot: ExchangeSlot, holder: Holder, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    with slot.hold(holder):
        task_status.started()
        with holder.progress.waiting():  # waiting on a partner that sends nothing
            await holder.preempted.wait()


async def test_a_free_slot_is_free_for_anyone_and_a_held_one_cannot_be_held_twice() -> None:
    slot = ExchangeSlot(BYTES_PER_S, GRACE_S)
    assert await slot.free_for("stranger", has_record=False)
    with slot.hold(Holder("a")):
        assert slot.busy
        with pytest.raises(RuntimeError, match="taken"), slot.hold(Holder("b")):
            pass
    assert not slot.busy


async def test_a_holder_within_its_grace_keeps_the_slot_even_from_a_peer_with_a_record() -> None:
    slot = ExchangeSlot(BYTES_PER_S, GRACE_S)
    holder = Holder("slow")
    async with anyio.create_task_group() as tg:
        await tg.start(hold_until_preempted, slot, holder)
        await anyio.sleep(GRACE_S - 0.1)
        assert not await slot.free_for("known", has_record=True)
        assert holder.reasons == []
        tg.cancel_scope.cancel()


async def test_a_holder_behind_is_preempted_by_a_peer_with_a_record_and_never_by_a_stranger() -> None:
    slot = ExchangeSlot(BYTES_PER_S, GRACE_S)
    holder = Holder("trickler")
    async with anyio.create_task_group() as tg:
        await tg.start(hold_until_preempted, slot, holder)
        await anyio.sleep(GRACE_S + 0.5)
        assert not await slot.free_for("stranger", has_record=False)
        assert holder.reasons == []
        assert await slot.free_for("known", has_record=True)  # the holder unwound as it was preempted
        assert not slot.busy
    (reason,) = holder.reasons
    assert reason == "preempted by known: 0 bytes in 2.5s of waiting is 0.5s behind the slowest link served"


async def test_bytes_received_buy_waiting_at_the_slowest_link_served() -> None:
    slot = ExchangeSlot(BYTES_PER_S, GRACE_S)
    holder = Holder("honest")
    holder.progress.received = int(3 * BYTES_PER_S)  # 3 s of transfer at the slowest link
    async with anyio.create_task_group() as tg:
        await tg.start(hold_until_preempted, slot, holder)
        await anyio.sleep(GRACE_S + 2.9)
        assert slot.lag(holder) == pytest.approx(-0.1)
        assert not await slot.free_for("known", has_record=True)
        await anyio.sleep(0.2)
        assert await slot.free_for("known", has_record=True)


async def test_a_preempted_holder_that_does_not_unwind_keeps_the_slot_and_the_newcomer_is_busy() -> None:
    slot = ExchangeSlot(BYTES_PER_S, GRACE_S)
    stubborn = Holder("stubborn")
    with slot.hold(stubborn), stubborn.progress.waiting():
        await anyio.sleep(GRACE_S + 1)
        start = anyio.current_time()
        assert not await slot.free_for("known", has_record=True)
        assert anyio.current_time() - start == pytest.approx(RELEASE_WAIT_S)
        assert len(stubborn.reasons) == 1


async def test_a_metered_stream_counts_the_bytes_and_the_time_spent_waiting_for_them() -> None:
    net = MemoryNetwork()
    a, b = net.transport("a"), net.transport("b")
    received: list = []

    async def serve(stream) -> None:
        received.append(stream)
        await anyio.sleep(1.5)
        await stream.send_all(b"x" * 10)
        await anyio.sleep(0.5)
        await stream.send_all(b"y" * 5)

    b.set_handler("/p", serve)
    async with a.run([]), b.run([]):
        progress = Progress(anyio.current_time)
        stream = MeteredStream(await a.open_stream("b", b.addresses(), "/p"), progress)
        assert await stream.receive_some() == b"x" * 10
        assert (progress.received, progress.waited()) == (10, pytest.approx(1.5))
        assert await stream.receive_some() == b"y" * 5
        assert (progress.received, progress.waited()) == (15, pytest.approx(2.0))
        await stream.close()


def test_a_slot_needs_a_positive_link_speed_and_a_grace_of_at_least_zero() -> None:
    with pytest.raises(ValueError, match="positive link speed"):
        ExchangeSlot(0.0, GRACE_S)
    with pytest.raises(ValueError, match="positive link speed"):
        ExchangeSlot(BYTES_PER_S, -1.0)
