"""Models over a `Conversation`: a `Params` announcement, then the tensors in `Chunk`s."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread

from murmur.node.net.conversation import Conversation
from murmur.protocol.codec import TensorSpec, WireDecoder, WireState, wire_chunks
from murmur.protocol.errors import TensorMismatch
from murmur.protocol.messages import Chunk, Params


async def send_params(conv: Conversation, wire: WireState, spec: TensorSpec) -> int:
    """Announce `wire` and stream it in chunks; return the parameter bytes sent."""
    size = spec.wire_size(wire.dtype)
    await conv.send(Params(wire.dtype, spec.layout, size))
    for chunk in wire_chunks(wire, spec):
        await conv.send(Chunk(bytes(chunk)))
    return size


async def receive_params(
    conv: Conversation, spec: TensorSpec, dtype: str,
    run_sync: Callable[..., Awaitable[Any]] = anyio.to_thread.run_sync,
) -> WireState:
    """Receive one model announced by `Params` in wire dtype `dtype`, validated against `spec`.

    The last check (every value finite) runs through `run_sync`, off the event loop.

    Raises `TensorMismatch` for another dtype, layout or size (before allocating),
    `NonFiniteTensor` for NaN/Inf, and whatever `Conversation.receive` raises.
    """
    params = await conv.receive(Params)
    assert isinstance(params, Params)  # for the type checker: `receive` checked it
    if params.dtype != dtype:
        raise TensorMismatch(f"parameters arrive as {params.dtype!r}, {dtype!r} was agreed")
    decoder = WireDecoder(spec, params.dtype, params.layout, params.size)
    while not decoder.complete:
        chunk = await conv.receive(Chunk)
        assert isinstance(chunk, Chunk)
        decoder.feed(chunk.payload)
    return await run_sync(decoder.finish)
