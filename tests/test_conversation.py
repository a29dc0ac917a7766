"""Typed messages over a byte stream: what arrives, what is refused, and how a peer's give-up surfaces."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from murmur.node.net.conversation import Conversation
from murmur.node.net.transport import ByteStream, MemoryNetwork
from murmur.protocol.errors import PeerAborted, ProtocolViolation, StreamClosed
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Abort, Accept, Busy, Offer, Params

pytestmark = pytest.mark.anyio
OFFER = Offer("run", "fingerprint", 32.0)


@asynccontextmanager
async def conversations() -> AsyncIterator[tuple[Conversation, Conversation]]:
    """An averaging conversation: (initiator, responder) over an in-memory stream."""
    net = MemoryNetwork()
    a, b = net.transport("a"), net.transport("b")
    send, receive = anyio.create_memory_object_stream[ByteStream](1)
    b.set_handler("/test", send.send)
    async with a.run(), b.run():
        with anyio.fail_after(5):
            stream = await a.open_stream("b", b.addresses(), "/test")
            yield (
                Conversation(stream, Exchange(Role.INITIATOR, AVERAGE, max_params_bytes=1024)),
                Conversation(await receive.receive(), Exchange(Role.RESPONDER, AVERAGE, max_params_bytes=1024)),
            )


async def test_messages_arrive_typed_and_in_order() -> None:
    async with conversations() as (initiator, responder):
        await initiator.send(OFFER)
        assert await responder.receive(Offer) == OFFER
        await responder.send(Accept(64.0))
        assert await initiator.receive(Accept, Busy) == Accept(64.0)
        assert responder.stream.remote_peer == "a" and initiator.stream.remote_peer == "b"


async def test_an_allowed_but_unexpected_message_is_a_protocol_violation_naming_both() -> None:
    async with conversations() as (initiator, responder):
        await initiator.send(OFFER)
        await responder.receive()
        await responder.send(Busy("in another exchange"))
        with pytest.raises(ProtocolViolation, match="expected Accept, got Busy"):
            await initiator.receive(Accept)


async def test_an_abort_is_raised_as_peer_aborted_with_its_reason() -> None:
    async with conversations() as (initiator, responder):
        await initiator.send(OFFER)
        await responder.receive(Offer)
        await responder.send(Accept(1.0))
        await initiator.receive(Accept)
        await responder.send(Abort("your model was rejected"))
        with pytest.raises(PeerAborted, match="your model was rejected"):
            await initiator.receive(Params)


async def test_a_peer_closing_mid_conversation_is_peer_closed() -> None:
    async with conversations() as (initiator, responder):
        await initiator.send(OFFER)
        await responder.stream.close()
        with pytest.raises(StreamClosed):
            await initiator.receive(Accept)
