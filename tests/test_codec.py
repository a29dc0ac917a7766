"""Tensor codec: a model's float state round-trips as float32, and bad payloads raise typed, named errors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from protocol.codec import TensorSpec, decode_state, encode_state
from protocol.errors import MalformedMessage, NonFiniteTensor, RemoteProtocolError, TensorMismatch

HEADER_LEN = struct.Struct("!I")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _mixed_state() -> dict[str, torch.Tensor]:
    """The model's state with tensors in float32, float64 and bf16 (plus an int buffer)."""
    state = dict(_model().state_dict())
    state["0.weight"] = state["0.weight"].double() / 3  # not representable in float32
    state["2.weight"] = state["2.weight"].bfloat16()
    return state


def _spec_and_payload() -> tuple[TensorSpec, bytes]:
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5, -1.5])}
    spec = TensorSpec.of(state)
    return spec, encode_state(state, spec)


def _payload(header: bytes, data: bytes) -> bytes:
    return HEADER_LEN.pack(len(header)) + header + data


def _header(entries: list) -> bytes:
    return json.dumps(entries, separators=(",", ":")).encode()


# --- round trip --------------------------------------------------------------------


def test_spec_lists_only_floating_point_tensors_in_order() -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    names = [name for name, _ in spec.entries]
    assert names == [n for n, t in state.items() if t.is_floating_point()]
    assert "1.num_batches_tracked" not in names
    assert dict(spec.entries)["0.weight"] == (4, 3)


def test_round_trip_of_mixed_dtypes_arrives_as_float32() -> None:
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


def test_decoded_tensors_are_writable_and_independent_of_the_payload() -> None:
    spec, payload = _spec_and_payload()
    decoded = decode_state(payload, spec)
    decoded["w"].add_(1)
    assert torch.equal(decode_state(payload, spec)["w"], torch.arange(6.0).reshape(2, 3))


def test_encoded_size_equals_the_encoding_length() -> None:
    state = _mixed_state()
    spec = TensorSpec.of(state)
    assert spec.encoded_size == len(encode_state(state, spec))
    assert spec.numel == sum(t.numel() for t in state.values() if t.is_floating_point())


def test_encoding_is_little_endian_float32_after_the_header() -> None:
    spec, payload = _spec_and_payload()
    (header_len,) = HEADER_LEN.unpack_from(payload)
    assert payload[4 : 4 + header_len] == spec.header()
    assert payload[4 + header_len : 4 + header_len + 4] == struct.pack("<f", 0.0)
    assert payload[-4:] == struct.pack("<f", -1.5)


# --- rejections -----------------------------------------------------------------


def test_wrong_tensor_name_is_named() -> None:
    spec, _ = _spec_and_payload()
    other = {"v": torch.zeros(2, 3), "b": torch.zeros(2)}
    with pytest.raises(TensorMismatch, match="tensor 0 is named 'v', expected 'w'"):
        decode_state(encode_state(other, TensorSpec.of(other)), spec)


def test_wrong_shape_is_named() -> None:
    spec, _ = _spec_and_payload()
    other = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    with pytest.raises(TensorMismatch, match=r"tensor 'w' has shape \[3, 2\], expected \[2, 3\]"):
        decode_state(encode_state(other, TensorSpec.of(other)), spec)


def test_wrong_dtype_in_header_is_named() -> None:
    spec, _ = _spec_and_payload()
    header = _header([["w", "float16", [2, 3]], ["b", "float32", [2]]])
    with pytest.raises(TensorMismatch, match="tensor 'w' has dtype 'float16', expected 'float32'"):
        decode_state(_payload(header, bytes(32)), spec)


def test_missing_tensor_is_named() -> None:
    spec, _ = _spec_and_payload()
    other = {"w": torch.zeros(2, 3)}
    with pytest.raises(TensorMismatch, match="tensor 'b' is missing"):
        decode_state(encode_state(other, TensorSpec.of(other)), spec)


def test_extra_tensor_is_rejected() -> None:
    spec, _ = _spec_and_payload()
    other = {"w": torch.zeros(2, 3), "b": torch.zeros(2), "extra": torch.zeros(1)}
    with pytest.raises(TensorMismatch, match="header lists 3 tensors, the local model has 2"):
        decode_state(encode_state(other, TensorSpec.of(other)), spec)


def test_every_truncation_raises_a_protocol_error() -> None:
    spec, payload = _spec_and_payload()
    for n in range(len(payload)):
        with pytest.raises(RemoteProtocolError):
            decode_state(payload[:n], spec)


def test_truncated_data_names_the_byte_counts() -> None:
    spec, payload = _spec_and_payload()
    with pytest.raises(TensorMismatch, match="payload holds 31 data bytes, the local model needs 32"):
        decode_state(payload[:-1], spec)


def test_short_length_field_is_malformed() -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(MalformedMessage, match="shorter than its header length field"):
        decode_state(b"\x00\x00", spec)


def test_extra_trailing_bytes_are_rejected() -> None:
    spec, payload = _spec_and_payload()
    with pytest.raises(TensorMismatch, match="payload holds 36 data bytes, the local model needs 32"):
        decode_state(payload + b"\x00" * 4, spec)


def test_header_length_overrunning_the_payload_is_malformed() -> None:
    spec, payload = _spec_and_payload()
    bad = HEADER_LEN.pack(len(payload)) + payload[4:]
    with pytest.raises(MalformedMessage, match=f"tensor header of {len(payload)} bytes overruns a {len(payload)}-byte"):
        decode_state(bad, spec)
    with pytest.raises(MalformedMessage, match="overruns"):
        decode_state(b"\xff\xff\xff\xff" + payload[4:], spec)


@pytest.mark.parametrize(("value", "name"), [(float("nan"), "w"), (float("inf"), "b"), (float("-inf"), "w")])
def test_non_finite_values_are_named(value: float, name: str) -> None:
    spec, _ = _spec_and_payload()
    state = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    state[name].view(-1)[1] = value
    with pytest.raises(NonFiniteTensor, match=f"tensor '{name}' holds NaN or Inf"):
        decode_state(encode_state(state, spec), spec)


@pytest.mark.parametrize("header", [b"\xff" * 10, b"not json!", b"{}", b'"text"', b"12345"])
def test_non_json_header_is_malformed(header: bytes) -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(MalformedMessage, match="tensor header is not a JSON list"):
        decode_state(_payload(header, bytes(32)), spec)


def test_non_list_header_entry_is_malformed() -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(MalformedMessage, match="tensor header entry 1 is not \\[name, dtype, shape\\]"):
        decode_state(_payload(_header([["w", "float32", [2, 3]], "b"]), bytes(32)), spec)


def test_non_canonical_header_is_malformed() -> None:
    spec, _ = _spec_and_payload()
    header = json.dumps([["w", "float32", [2, 3]], ["b", "float32", [2]]]).encode()  # with spaces
    with pytest.raises(MalformedMessage, match="not in canonical form"):
        decode_state(_payload(header, bytes(32)), spec)


# --- fuzz -----------------------------------------------------------------------


@settings(max_examples=300)
@given(st.data())
def test_mutated_payload_decodes_to_finite_tensors_or_raises_a_protocol_error(data: st.DataObject) -> None:
    spec, payload = _spec_and_payload()
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
        decoded = decode_state(bytes(mutated), spec)
    except RemoteProtocolError:
        return
    assert [(n, tuple(t.shape)) for n, t in decoded.items()] == list(spec.entries)
    assert all(bool(torch.isfinite(t).all()) for t in decoded.values())


@given(st.binary(max_size=120))
def test_arbitrary_bytes_raise_a_protocol_error(data: bytes) -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(RemoteProtocolError):
        decode_state(data, spec)


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


def test_deeply_nested_header_is_malformed() -> None:
    spec, _ = _spec_and_payload()
    with pytest.raises(MalformedMessage):
        decode_state(_payload(b"[" * 50_000, b""), spec)


def test_zero_element_tensor_round_trips() -> None:
    state = {"empty": torch.zeros(0, 3), "w": torch.ones(2)}
    spec = TensorSpec.of(state)
    decoded = decode_state(encode_state(state, spec), spec)
    assert decoded["empty"].shape == (0, 3)
