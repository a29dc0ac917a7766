"""A partner that offers an exchange and then trickles its bytes holds the victim's exchange slot and
buffers no longer than the exchange timeout; the victim then exchanges with an honest peer at once.
A peer the victim merged with before takes the slot as soon as the trickler falls behind.

Simulated time and peers as in `test_averager.py` (`averager_harness`), for both exchange protocols
(whole models and compressed deltas); `lab/trickle.py` measures a real victim's memory under attack.
"""

from __future__ import annotations

import gc
import weakref

import anyio
import pytest
import trio.testing
from averager_harness import TIMEOUT, Peer, make_peer, running, settled

from murmur.node.averaging.averager import AVERAGE_PROTOCOL, PREEMPT_GRACE
from murmur.node.averaging.delta_gossip import GOSSIP_PROTOCOL
from murmur.node.averaging.outcome import Result
from murmur.node.learn.deltas import Compression
from murmur.node.net.transport import MemoryNetwork, TransportError
from murmur.protocol.codec import CHUNK_BYTES, AnnouncedBytes
from murmur.protocol.exchange import AVERAGE, GOSSIP, Exchange, Role
from murmur.protocol.messages import Accept, Chunk, Delta, Digest, Message, Offer, Params, encode_frame

pytestmark = pytest.mark.anyio
TRICKLE_BYTES = 4  # a few bytes ...
TRICKLE_EVERY = 0.05  # ... this often (simulated seconds): 80 bytes/s


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


def _opening(victim: Peer, protocol: str) -> tuple[Exchange, Message, type[Message], list[Message]]:
    """What a trickler sends to start `protocol` with `victim` honestly: its exchange, its opening, the answer
    it waits for, and the announcement after which the bytes trickle (a whole model, or the largest delta)."""
    spec = victim.replica.spec
    if protocol == AVERAGE_PROTOCOL:
        ex = Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=spec.wire_size("float32"))
        offer = Offer("digits", victim.replica.fingerprint, 32.0, "float32")
        return ex, offer, Accept, [Params("float32", spec.layout, spec.wire_size("float32"))]
    bits = victim.replica.compression.bits
    size = victim.averager._max_delta  # the largest delta the victim accepts
    ex = Exchange(Role.INITIATOR, GOSSIP, max_params_bytes=size)
    digest = Digest("digits", victim.replica.fingerprint, bits, {})
    return ex, digest, Digest, [Delta("0123456789abcdef", 1, 0.5, 1.0, size)]


async def _trickle(victim: Peer, trickler, protocol: str, accepted: anyio.Event) -> None:
    """Open an exchange with `victim` as an honest initiator would, then send its bytes a few at a time until the victim hangs up."""
    stream = await trickler.open_stream(victim.id, victim.transport.addresses(), protocol)
    ex, opening, answer, announcement = _opening(victim, protocol)
    await stream.send_all(ex.send(opening))
    while not isinstance(ex.next_event(), answer):
        ex.receive_data(await stream.receive_some())
    for message in announcement:
        await stream.send_all(ex.send(message))
    accepted.set()
    frame = encode_frame(Chunk(b"\0" * CHUNK_BYTES))
    try:
        for start in range(0, len(frame), TRICKLE_BYTES):  # bounded: far more than the timeout allows
            await stream.send_all(frame[start : start + TRICKLE_BYTES])
            await anyio.sleep(TRICKLE_EVERY)
        pytest.fail("the victim let a trickler send a whole chunk at 80 bytes/s")
    except TransportError:
        pass  # the victim reset the stream: what this test waits for


def _buffers(excluding: list) -> list[AnnouncedBytes]:
    """The receive buffers (decoders of announced bytes) alive now, other than those in `excluding`."""
    return [o for o in gc.get_objects() if issubclass(type(o), AnnouncedBytes) and not any(o is e for e in excluding)]


@pytest.mark.parametrize("protocol", [AVERAGE_PROTOCOL, GOSSIP_PROTOCOL], ids=["models", "deltas"])
async def test_a_trickling_partner_loses_the_slot_and_its_buffers_at_the_timeout(protocol: str) -> None:
    net = MemoryNetwork()
    compression = Compression(1.0, 8) if protocol == GOSSIP_PROTOCOL else None
    victim = make_peer(net, "victim", 0, compression=compression)
    honest = make_peer(net, "honest", 1, compression=compression)
    trickler = net.transport("trickler")
    gc.collect()
    earlier = [o for o in gc.get_objects() if issubclass(type(o), AnnouncedBytes)]  # another test's, if any: not ours
    async with running(victim, honest), trickler.run():
        victim.steps(1)
        honest.steps(1)
        accepted = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_trickle, victim, trickler, protocol, accepted)
            await accepted.wait()
            with anyio.fail_after(1):  # simulated: the victim allocates as the announcement arrives
                while not (buffers := _buffers(excluding=earlier)):
                    await anyio.sleep(0.001)
            held = [weakref.ref(b) for b in buffers] + [weakref.ref(b._buffer) for b in buffers]
            assert victim.averager.in_exchange
            busy = await honest.averager.exchange_with(victim.id, victim.transport.addresses())
            assert (busy.result, busy.reason) == (Result.BUSY, "already in an exchange")  # the slot the trickler holds
            await settled(victim)
        failed = victim.averager.recent[-1]
        assert (failed.result, failed.partner, failed.reason) == (
            Result.FAILED,
            trickler.peer_id,
            f"timed out after {TIMEOUT:g}s",
        )
        # Simulated time: bytes arriving never extended the deadline, and the slot was freed with the outcome.
        assert failed.duration_s == pytest.approx(TIMEOUT)
        del buffers
        assert [r for r in held if r() is not None] == []  # freed as the exchange ended, with no collection needed
        merged = await honest.averager.exchange_with(victim.id, victim.transport.addresses())
        assert merged.result == Result.MERGED, merged.reason


@pytest.mark.parametrize("protocol", [AVERAGE_PROTOCOL, GOSSIP_PROTOCOL], ids=["models", "deltas"])
async def test_a_peer_with_a_record_takes_the_slot_from_a_trickler_that_fell_behind(protocol: str) -> None:
    net = MemoryNetwork()
    compression = Compression(1.0, 8) if protocol == GOSSIP_PROTOCOL else None
    names = ("victim", "honest", "stranger")
    victim, honest, stranger = (make_peer(net, name, i, compression=compression) for i, name in enumerate(names))
    victim.know(honest, stranger)
    trickler = net.transport("trickler")
    async with running(victim, honest, stranger), trickler.run():
        for peer in (victim, honest, stranger):
            peer.steps(1)
        first = await honest.averager.exchange_with(victim.id, victim.transport.addresses())
        assert first.result == Result.MERGED, first.reason  # now honest has a record with the victim
        await settled(victim)
        honest.steps(1)
        accepted = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_trickle, victim, trickler, protocol, accepted)
            await accepted.wait()
            await anyio.sleep(PREEMPT_GRACE * TIMEOUT + 0.1)  # the trickler is behind, well before its timeout
            busy = await stranger.averager.exchange_with(victim.id, victim.transport.addresses())
            assert (busy.result, busy.reason) == (Result.BUSY, "already in an exchange")  # strangers never preempt
            merged = await honest.averager.exchange_with(victim.id, victim.transport.addresses())
            assert merged.result == Result.MERGED, merged.reason
        preempted = next(o for o in victim.averager.recent if o.partner == trickler.peer_id)
        assert preempted.result == Result.FAILED and preempted.reason.startswith("preempted by honest: ")
        assert preempted.duration_s < TIMEOUT / 2
