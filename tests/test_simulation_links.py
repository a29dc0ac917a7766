"""Simulated links: a round trip to open, then serialization on the sender and one latency to arrive."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from lab.simulation.links import LinkTransport
from murmur.node.net.transport import ByteStream, MemoryNetwork, TransportError

LATENCY, BANDWIDTH = 0.05, 1000.0  # 50 ms, 1 kB/s


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    # Simulated time: the clock jumps to the next deadline whenever every task waits.
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


def _pair(network: MemoryNetwork) -> tuple[LinkTransport, LinkTransport]:
    def links(a: str, b: str) -> tuple[float, float]:
        return LATENCY, BANDWIDTH

    return LinkTransport(network, "a", links), LinkTransport(network, "b", links)


@pytest.mark.anyio
async def test_link_streams_deliver_after_latency_plus_serialization_in_simulated_time() -> None:
    a, b = _pair(MemoryNetwork())
    arrivals: list[tuple[float, bytes]] = []
    done = anyio.Event()

    async def handler(stream: ByteStream) -> None:
        while data := await stream.receive_some():
            arrivals.append((anyio.current_time(), data))
        done.set()

    b.set_handler("/p", handler)
    async with a.run(), b.run():
        start = anyio.current_time()
        stream = await a.open_stream("b", [], "/p")
        opened = anyio.current_time() - start
        await stream.send_all(b"x" * 100)  # 0.1 s on the wire
        await stream.send_all(b"y" * 100)  # queued behind the first: pipelined, not a second latency
        sent = anyio.current_time() - start
        await stream.close()
        await done.wait()
    assert opened == pytest.approx(2 * LATENCY)
    assert sent == pytest.approx(2 * LATENCY + 0.2)
    assert [round(t - start, 6) for t, _ in arrivals] == [
        round(2 * LATENCY + 0.1 + LATENCY, 6),
        round(2 * LATENCY + 0.2 + LATENCY, 6),
    ]
    assert b"".join(data for _, data in arrivals) == b"x" * 100 + b"y" * 100


@pytest.mark.anyio
async def test_opening_to_a_missing_peer_or_protocol_fails_after_the_round_trip() -> None:
    a, b = _pair(MemoryNetwork())
    async with a.run(), b.run():
        start = anyio.current_time()
        with pytest.raises(TransportError, match="unreachable"):
            await a.open_stream("nobody", [], "/p")
        assert anyio.current_time() - start == pytest.approx(2 * LATENCY)
        with pytest.raises(TransportError, match="protocol not supported"):
            await a.open_stream("b", [], "/p")


@pytest.mark.anyio
async def test_after_a_reset_the_other_side_cannot_write_and_reads_the_end() -> None:
    a, b = _pair(MemoryNetwork())
    served: list[ByteStream] = []
    ready = anyio.Event()

    async def handler(stream: ByteStream) -> None:
        served.append(stream)
        ready.set()
        await anyio.sleep_forever()

    b.set_handler("/p", handler)
    async with a.run(), b.run():
        stream = await a.open_stream("b", [], "/p")
        await ready.wait()
        await served[0].reset()
        with pytest.raises(TransportError, match="write to b failed"):
            await stream.send_all(b"z")
        assert await stream.receive_some() == b""
