"""Drive a sans-IO `Exchange` over a `ByteStream`."""

from __future__ import annotations

from node.transport import ByteStream
from protocol.errors import PeerAborted
from protocol.exchange import Exchange
from protocol.messages import Abort, Message


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

    async def receive(self) -> Message:
        while True:
            event = self.exchange.next_event()
            if isinstance(event, Abort):
                raise PeerAborted(event.reason)
            if isinstance(event, Message):
                return event
            self.exchange.receive_data(await self.stream.receive_some())
