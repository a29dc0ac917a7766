"""Drive a sans-IO `Exchange` over a `ByteStream`: typed messages in and out."""

from __future__ import annotations

from murmur.node.net.transport import ByteStream
from murmur.protocol.errors import PeerAborted, ProtocolViolation
from murmur.protocol.exchange import Exchange
from murmur.protocol.messages import Abort, Message


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
