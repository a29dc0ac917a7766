"""Tensor codec: a model round-trips in every wire dtype within its precision; bad input raises typed, named errors."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from murmur.protocol.codec import (
    WIRE_DTYPES,
    TensorSpec,
    WireDecoder,
    decode_state,
    encode_state,
    pieces,
    quantize,
    wire_chunks,
)
from murmur.protocol.errors import MalformedMessage, NonFiniteTensor, RemoteProtocolError, TensorMismatch
from murmur.protocol.messages import MAX_LAYOUT_ENTRIES


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _mixed_state() -> dict[str, torch.Tensor]:
    """The model's state with tensors in float32, float64 and bf16 (plus an int buffer)."""
    state = dict(_model().state_dict())
    state["0.weight"] = state["0.weight"].double() / 3  # not representable in float32
    state["2.weight"] = state["2.weight"].bfloat16()
    return state


def _spec_and_payload(dtype: str = "float32") -> tuple[TensorSpec, bytes]:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5, -1.5])}
    spec = TensorSpec.of(state)
    return spec, encode_state(state, spec, dtype)


# --- round trip --------------------------------------------------------------------


def test_spec_lists_only_floating_point_tensors_in_order() -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    names = [name for name, _ in spec.entries]
    assert names == [n for n, t in state.items() if t.is_floating_point()]
    assert "1.num_batches_tracked" not in names
    assert dict(spec.entries)["0.weight"] == (4, 3)


def test_round_trip_of_mixed_dtypes_reads_as_float32() -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec), spec)
    assert list(decoded) == [name for name, _ in spec.entries]
    for name, tensor in decoded.items():
        assert tensor.dtype == torch.float32
        assert tensor.device.type == "cpu"
        assert tensor.shape == state[name].shape
        assert torch.equal(tensor, state[name].to(torch.float32)), name


def test_round_trip_rounds_float64_and_keeps_bf16_exactly() -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec), spec)
    assert torch.allclose(decoded["0.weight"].double(), state["0.weight"], rtol=1e-7, atol=0)
    assert torch.equal(decoded["2.weight"].bfloat16(), state["2.weight"])


@pytest.mark.parametrize(("dtype", "relative_error"), [("float32", 0.0), ("bfloat16", 2**-8), ("float16", 2**-11)])
def test_float_wire_dtypes_round_within_their_precision(dtype: str, relative_error: float) -> None:
    torch.manual_seed(1)
    state = {"w": torch.randn(64, 32), "b": torch.randn(32) * 1e-3}
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec, dtype), spec, dtype)
    assert decoded.dtype == dtype and decoded.tensors["w"].dtype == WIRE_DTYPES[dtype]
    for name, tensor in state.items():
        # plus half of float16's smallest subnormal step, for values below its normal range
        assert ((decoded[name] - tensor).abs() <= relative_error * tensor.abs() + 3e-8).all(), name


def test_int8_rounds_within_half_a_step_of_each_tensors_scale() -> None:
    torch.manual_seed(2)
    state = {"w": torch.randn(64, 32), "b": torch.randn(32) * 1e-3}
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec, "int8"), spec, "int8")
    for name, tensor in state.items():
        step = tensor.abs().max() / 127
        assert decoded.scales[name] == pytest.approx(step.item())
        assert ((decoded[name] - tensor).abs() <= step / 2 * (1 + 1e-5)).all(), name


def test_decoded_tensors_are_independent_of_the_payload() -> None:
    spec, payload = _spec_and_payload()
    decoded = decode_state(payload, spec)
    decoded["w"].add_(1)
    assert torch.equal(decode_state(payload, spec)["w"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_wire_size_equals_the_encoding_length(dtype: str) -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    assert spec.wire_size(dtype) == len(encode_state(state, spec, dtype))
    assert spec.numel == sum(t.numel() for t in state.values() if t.is_floating_point())


def test_float32_encoding_is_the_little_endian_values_in_spec_order() -> None:
    _, payload = _spec_and_payload()
    assert payload == struct.pack("<8f", 0, 1, 2, 3, 4, 5, 0.5, -1.5)


def test_int8_encoding_puts_the_scales_first() -> None:
    _, payload = _spec_and_payload("int8")
    assert payload[:8] == struct.pack("<2f", 5 / 127, 1.5 / 127)
    assert payload[8:] == struct.pack("<8b", 0, 25, 51, 76, 102, 127, 42, -127)


def test_chunks_are_bounded_and_feeding_them_in_any_split_gives_the_same_model() -> None:
    torch.manual_seed(3)
    state = {"a": torch.randn(1000), "b": torch.randn(10, 7)}
    spec = TensorSpec.of(state)
    wire = quantize(state, spec, "bfloat16")
    chunks = [bytes(c) for c in wire_chunks(wire, spec, chunk_bytes=256)]
    assert max(map(len, chunks)) <= 256 and b"".join(chunks) == encode_state(state, spec, "bfloat16")
    decoder = WireDecoder(spec, "bfloat16", spec.layout, spec.wire_size("bfloat16"))
    data = b"".join(chunks)
    for i in range(0, len(data), 7):  # odd-sized pieces straddle tensors
        decoder.feed(data[i : i + 7])
    assert all(torch.equal(decoder.finish()[n], wire[n]) for n in spec_names(spec))


def spec_names(spec: TensorSpec) -> list[str]:
    return [name for name, _ in spec.entries]


# --- rejections -----------------------------------------------------------------


def test_another_layout_is_refused_before_any_allocation() -> None:
    spec, _ = _spec_and_payload()
    other = TensorSpec((("w", (3, 2)), ("b", (2,))))
    with pytest.raises(TensorMismatch, match=f"parameter layout {other.layout[:12]} differs"):
        WireDecoder(spec, "float32", other.layout, 32)


def test_a_size_that_does_not_fit_the_model_is_refused_before_any_allocation() -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(TensorMismatch, match="1099511627776 bytes announced, the local model needs 32 in float32"):
        WireDecoder(spec, "float32", spec.layout, 1 << 40)
    with pytest.raises(TensorMismatch, match="32 bytes announced, the local model needs 16 in bfloat16"):
        WireDecoder(spec, "bfloat16", spec.layout, 32)


def test_unknown_wire_dtype_is_malformed() -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(MalformedMessage, match="unknown wire dtype 'float64'"):
        WireDecoder(spec, "float64", spec.layout, 64)


def test_bytes_beyond_the_announced_size_are_refused() -> None:
    spec, payload = _spec_and_payload()
    decoder = WireDecoder(spec, "float32", spec.layout, len(payload))
    decoder.feed(payload[:30])
    with pytest.raises(MalformedMessage, match="34 parameter bytes sent, 32 were announced"):
        decoder.feed(payload[:4])


def test_finishing_early_names_the_byte_counts() -> None:
    spec, payload = _spec_and_payload()
    decoder = WireDecoder(spec, "float32", spec.layout, len(payload))
    decoder.feed(payload[:31])
    with pytest.raises(MalformedMessage, match="only 31 of 32 announced parameter bytes arrived"):
        decoder.finish()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("value", "name"), [(float("nan"), "w"), (float("inf"), "b"), (float("-inf"), "w")])
def test_non_finite_values_are_named(dtype: str, value: float, name: str) -> None:
    spec, _ = _spec_and_payload()
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    state[name].view(-1)[1] = value
    with pytest.raises(NonFiniteTensor, match=f"tensor '{name}' holds NaN or Inf"):
        decode_state(encode_state(state, spec, dtype), spec, dtype)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_int8_scales_must_be_positive_and_finite(scale: float) -> None:
    spec, payload = _spec_and_payload("int8")
    with pytest.raises(NonFiniteTensor, match="tensor 'b' has int8 scale"):
        decode_state(payload[:4] + struct.pack("<f", scale) + payload[8:], spec, "int8")


# --- fuzz -----------------------------------------------------------------------


@settings(max_examples=300)
@given(st.data())
def test_mutated_payload_decodes_to_finite_tensors_or_raises_a_protocol_error(data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(sorted(WIRE_DTYPES)), label="dtype")
    spec, payload = _spec_and_payload(dtype)
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["set", "insert", "delete"]), label="kind")
        pos = data.draw(st.integers(0, len(mutated)), label="pos")
        if kind == "set" and pos < len(mutated):
            mutated[pos] = data.draw(st.integers(0, 255), label="byte")
        elif kind == "insert":
            mutated[pos:pos] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        else:
            del mutated[pos : pos + data.draw(st.integers(1, 4), label="length")]
    try:
        decoded = decode_state(bytes(mutated), spec, dtype)
    except RemoteProtocolError:
        return
    assert [(n, tuple(t.shape)) for n, t in decoded.items()] == list(spec.entries)
    assert all(bool(torch.isfinite(t).all()) for t in decoded.values())


@given(st.binary(max_size=120), st.sampled_from(sorted(WIRE_DTYPES)))
def test_arbitrary_bytes_decode_to_finite_tensors_or_raise_a_protocol_error(data: bytes, dtype: str) -> None:
    spec, _ = _spec_and_payload()
    try:
        decoded = decode_state(data, spec, dtype)
    except RemoteProtocolError:
        return
    assert len(data) == spec.wire_size(dtype)
    assert all(bool(torch.isfinite(t).all()) for t in decoded.values())


@given(
    st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=50),
    st.sampled_from(sorted(WIRE_DTYPES)),
)
def test_any_finite_model_round_trips_in_every_wire_dtype(values: list[float], dtype: str) -> None:
    state = {"v": torch.tensor(values)}
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec, dtype), spec, dtype)
    bound = {"float32": 0.0, "bfloat16": 2**-8, "float16": 2**-10, "int8": 0.0}[dtype]
    err = (decoded["v"] - state["v"]).abs()
    if dtype == "int8":
        assert (err <= state["v"].abs().max() / 254 * (1 + 1e-5) + 1e-30).all()
    else:
        assert (err <= bound * state["v"].abs() + 6e-8).all()  # fp16 subnormals: absolute floor


# --- fingerprint ------------------------------------------------------------------


def test_fingerprint_is_stable_for_the_same_spec_and_architecture() -> None:
    spec = TensorSpec.of(_model().state_dict())
    assert spec.fingerprint("mlp") == TensorSpec.of(_model().state_dict()).fingerprint("mlp")
    assert len(spec.fingerprint()) == 64


def test_fingerprint_differs_with_architecture() -> None:
    spec = TensorSpec.of(_model().state_dict())
    assert spec.fingerprint("mlp-relu") != spec.fingerprint("mlp-gelu")
    assert spec.fingerprint("") != spec.fingerprint("x")


def test_fingerprint_differs_with_a_shape_or_name() -> None:
    base = TensorSpec((("w", (2, 3)), ("b", (2,))))
    assert base.fingerprint("a") != TensorSpec((("w", (3, 2)), ("b", (2,)))).fingerprint("a")
    assert base.fingerprint("a") != TensorSpec((("w", (2, 3)), ("b", (3,)))).fingerprint("a")
    assert base.fingerprint("a") != TensorSpec((("v", (2, 3)), ("b", (2,)))).fingerprint("a")
    assert base.fingerprint("a") != TensorSpec((("b", (2,)), ("w", (2, 3)))).fingerprint("a")


# --- hostile input ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_zero_element_tensor_round_trips(dtype: str) -> None:
    state = {"empty": torch.zeros(0, 3), "w": torch.ones(2)}
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec, dtype), spec, dtype)
    assert decoded["empty"].shape == (0, 3)
    assert torch.equal(decoded["w"], torch.ones(2))


def test_layout_is_the_architecture_free_fingerprint() -> None:
    spec = TensorSpec.of(_model().state_dict())
    assert spec.layout == spec.fingerprint() != spec.fingerprint("mlp")


@pytest.mark.parametrize("dtype", sorted(WIRE_DTYPES))
def test_pieces_cover_a_tensor_in_bounded_float32_pieces_for_dicts_and_wire_states(dtype: str) -> None:
    torch.manual_seed(4)
    state = {"w": torch.randn(10, 7).t()}  # not contiguous
    wire = quantize(state, TensorSpec.of(state), dtype)
    for source, expected in ((state, state["w"]), (wire, wire["w"])):
        got = list(pieces(source, "w", size=16))
        assert all(p.dtype == torch.float32 and p.numel() <= 16 for _, p in got)
        assert torch.equal(torch.cat([p for _, p in got]), expected.reshape(-1))
        assert [e.start for e, _ in got] == list(range(0, 70, 16))


def test_a_spec_names_the_first_tensor_that_differs_from_another() -> None:
    ours = TensorSpec((("fc.weight", (10, 64)), ("fc.bias", (10,))))
    assert ours.difference([["fc.weight", [10, 32]], ["fc.bias", [10]]]) == "differs in fc.weight: shape 10×64 here, 10×32 there"
    assert ours.difference([["head.weight", [10, 64]]]) == "differs at tensor 0: fc.weight 10×64 here, head.weight 10×64 there"
    assert ours.difference([["fc.weight", [10, 64]]]) == "differs in fc.bias: here only"
    assert ours.difference([*ours.described(), ["extra", []]]) == "differs in extra: there only"
    assert ours.difference(ours.described()) == "same tensor names and shapes: the task name or the architecture differs"
    big = TensorSpec(tuple((f"layer{i}.weight", (64, 64)) for i in range(5000)))
    described = big.described()
    assert 0 < len(described) < 5000  # cut to fit a control frame
    assert big.difference(described).startswith(f"the first {len(described)} tensors match")
    many = TensorSpec(tuple(("", ()) for _ in range(6000)))  # tiny entries: the count caps first
    assert len(many.described()) == MAX_LAYOUT_ENTRIES
    assert many.difference(many.described()).startswith(f"the first {MAX_LAYOUT_ENTRIES} tensors match")
