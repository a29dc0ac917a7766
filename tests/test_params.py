"""A model over a conversation: `Params`, then its chunks; checked against the local spec on arrival."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from murmur.node.averaging.params import receive_params, send_params
from murmur.node.learn.runtime import run_inline
from murmur.node.net.conversation import Conversation
from murmur.node.net.transport import ByteStream, MemoryNetwork
from murmur.protocol.codec import TensorSpec, quantize
from murmur.protocol.errors import NonFiniteTensor, TensorMismatch
from murmur.protocol.exchange import STATE_SYNC, Exchange, Role
from murmur.protocol.messages import Chunk, StateReply, StateRequest

pytestmark = pytest.mark.anyio
STATE = {"w": torch.linspace(-1, 1, 300_000).reshape(600, 500), "b": torch.arange(5.0)}  # several chunks
SPEC = TensorSpec.of(STATE)


@asynccontextmanager
async def state_sync() -> AsyncIterator[tuple[Conversation, Conversation]]:
    """(requester, responder) of a state sync, past StateRequest/StateReply: the responder sends Params next."""
    net = MemoryNetwork()
    a, b = net.transport("a"), net.transport("b")
    send, receive = anyio.create_memory_object_stream[ByteStream](1)
    b.set_handler("/test", send.send)
    async with a.run(), b.run():
        with anyio.fail_after(20):
            stream = await a.open_stream("b", b.addresses(), "/test")
            limit = SPEC.wire_size("float32")
            requester = Conversation(stream, Exchange(Role.INITIATOR, STATE_SYNC, max_params_bytes=limit))
            responder = Conversation(await receive.receive(), Exchange(Role.RESPONDER, STATE_SYNC))
            await requester.send(StateRequest("run", "fingerprint"))
            await responder.receive(StateRequest)
            await responder.send(StateReply(1.0))
            await requester.receive(StateReply)
            yield requester, responder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
async def test_a_model_round_trips_in_each_wire_dtype(dtype: str) -> None:
    calls: list[str] = []

    async def recording(func: Callable[..., Any], *args: Any) -> Any:
        calls.append(func.__name__)
        return func(*args)

    async with state_sync() as (requester, responder):
        wire = quantize(STATE, SPEC, dtype)
        async with anyio.create_task_group() as tg:
            tg.start_soon(send_params, responder, wire, SPEC)
            received = await receive_params(requester, SPEC, dtype, recording)
    assert received.dtype == dtype and received.keys() == STATE.keys()
    for name in STATE:
        assert torch.equal(received[name], wire[name])
    assert calls == ["finish"]  # the last check ran through the given runner


async def test_send_params_returns_the_bytes_it_announced() -> None:
    async with state_sync() as (requester, responder):
        sent = await send_params(responder, quantize(STATE, SPEC, "bfloat16"), SPEC)
        assert sent == SPEC.wire_size("bfloat16") == 2 * SPEC.numel


async def test_another_dtype_than_agreed_is_refused_before_any_chunk_is_read() -> None:
    async with state_sync() as (requester, responder):
        await send_params(responder, quantize(STATE, SPEC, "bfloat16"), SPEC)
        with pytest.raises(TensorMismatch, match="parameters arrive as 'bfloat16', 'float32' was agreed"):
            await receive_params(requester, SPEC, "float32", run_inline)
        assert isinstance(await requester.receive(), Chunk)  # the chunks are still unread


async def test_another_models_layout_is_a_tensor_mismatch() -> None:
    other = TensorSpec.of({"w": torch.zeros(500, 600), "b": torch.zeros(5)})
    async with state_sync() as (requester, responder):
        await send_params(responder, quantize(STATE, SPEC, "float32"), SPEC)
        with pytest.raises(TensorMismatch, match="layout"):
            await receive_params(requester, other, "float32", run_inline)


async def test_non_finite_values_are_refused_naming_the_tensor() -> None:
    poisoned = {**STATE, "b": torch.tensor([0.0, 1.0, math.inf, 3.0, 4.0])}
    async with state_sync() as (requester, responder):
        async with anyio.create_task_group() as tg:
            tg.start_soon(send_params, responder, quantize(poisoned, SPEC, "float32"), SPEC)
            with pytest.raises(NonFiniteTensor, match="tensor 'b' holds NaN or Inf"):
                await receive_params(requester, SPEC, "float32", run_inline)
