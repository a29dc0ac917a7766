"""Drive a sans-IO `Exchange` over a `ByteStream`, and stream models through it."""

from __future__ import annotations

import anyio

from node.transport import ByteStream
from protocol.codec import TensorSpec, WireDecoder, WireState, wire_chunks
from protocol.errors import PeerAborted, ProtocolViolation, TensorMismatch
from protocol.exchange import Exchange
from protocol.messages import Abort, Chunk, Message, Params


class Conversation:
    """One protocol conversation on one stream: typed messages in and out.

    `receive` raises the exchange's `RemoteProtocolError`s (`PeerAborted` for an
    `Abort`) and the stream's `TransportError`; the caller sets timeouts and resets
    the stream on error.
    """

    def __init__(self, stream: ByteStream, exchange: Exchange) -> None:
        self.stream = stream
        self.exchange = exchange

    async def send(self, message: Message) -> None:
        await self.stream.send_all(self.exchange.send(message))

    async def receive(self, *expected: type[Message]) -> Message:
        """The peer's next message; `ProtocolViolation` if it is none of the `expected` types (if given)."""
        while True:
            event = self.exchange.next_event()
            if isinstance(event, Abort):
                raise PeerAborted(event.reason)
            if isinstance(event, Message):
                if expected and not isinstance(event, expected):
                    wanted = " or ".join(t.__name__ for t in expected)
                    raise ProtocolViolation(f"{self.exchange.flow.name}: expected {wanted}, got {type(event).__name__}")
                return event
            self.exchange.receive_data(await self.stream.receive_some())

    async def send_params(self, wire: WireState, spec: TensorSpec) -> int:
        """Announce `wire` and stream it in chunks; return the parameter bytes sent."""
        size = spec.wire_size(wire.dtype)
        await self.send(Params(wire.dtype, spec.layout, size))
        for chunk in wire_chunks(wire, spec):
            await self.send(Chunk(bytes(chunk)))
        return size

    async def receive_params(self, spec: TensorSpec, dtype: str) -> WireState:
        """Receive one model announced by `Params` in wire dtype `dtype`, validated against `spec`.

        Raises `TensorMismatch` for another dtype, layout or size (before allocating),
        `NonFiniteTensor` for NaN/Inf, and whatever `receive` raises.
        """
        params = await self.receive(Params)
        assert isinstance(params, Params)  # for the type checker: `receive` checked it
        if params.dtype != dtype:
            raise TensorMismatch(f"parameters arrive as {params.dtype!r}, {dtype!r} was agreed")
        decoder = WireDecoder(spec, params.dtype, params.layout, params.size)
        while not decoder.complete:
            chunk = await self.receive(Chunk)
            assert isinstance(chunk, Chunk)
            decoder.feed(chunk.payload)
        return await anyio.to_thread.run_sync(decoder.finish)
