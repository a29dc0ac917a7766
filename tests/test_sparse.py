"""Sparse codec: top-k deltas round-trip bit-exactly at 2, 4 and 8 bits; hostile frames raise typed, named errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from murmur.protocol.codec import TensorSpec
from murmur.protocol.errors import FrameTooLarge, MalformedMessage, NonFiniteTensor
from murmur.protocol.sparse import (
    MAX_SCALES,
    SPARSE_BITS,
    SparseDecoder,
    decode_sparse,
    encode_sparse,
    max_sparse_size,
    quantize_sparse,
    sparse_size,
)

SPEC = TensorSpec((("a", (3, 4)), ("b", (5,)), ("empty_sent", (2, 2))))
NAN, INF, FLOAT32_MAX, TINY = float("nan"), float("inf"), torch.finfo(torch.float32).max, 2.0**-126


def _delta(bits: int, k: dict[str, int], seed: int = 0) -> tuple[dict, dict]:
    """The top `k[name]` entries by magnitude of a random delta of `SPEC`: (quantized state, original values)."""
    torch.manual_seed(seed)
    state, originals = {}, {}
    for name, shape in SPEC.entries:
        flat = torch.randn(shape).reshape(-1)
        indices = flat.abs().topk(k[name]).indices.sort().values
        originals[name] = flat[indices]
        state[name] = quantize_sparse(indices, originals[name], bits)
    return state, originals


def _encode(state: dict, bits: int, spec: TensorSpec = SPEC, **kwargs) -> bytes:
    return b"".join(encode_sparse(state, spec, bits, **kwargs))


# --- round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", SPARSE_BITS)
def test_round_trip_is_bit_exact_and_within_half_a_step(bits: int) -> None:
    state, originals = _delta(bits, {"a": 5, "b": 5, "empty_sent": 0})
    decoded = decode_sparse(_encode(state, bits), SPEC, bits)
    assert list(decoded) == ["a", "b", "empty_sent"]
    for name, sent in state.items():
        got = decoded[name]
        assert got.indices.dtype == torch.int64 and got.values.dtype == torch.float32
        assert torch.equal(got.indices, sent.indices) and torch.equal(got.codes, sent.codes), name
        assert torch.equal(got.values.view(torch.int32), sent.values.view(torch.int32)), name  # bit for bit
        assert got.scale == sent.scale
        assert ((sent.values - originals[name]).abs() <= sent.scale / 2 * (1 + 1e-6)).all(), name
    assert decoded["empty_sent"].indices.numel() == 0 and decoded["empty_sent"].scale == 0.0


@pytest.mark.parametrize("bits", SPARSE_BITS)
@pytest.mark.parametrize("values", [[FLOAT32_MAX, -FLOAT32_MAX], [0.0, 0.0], [1e-45, -3e-39]])
def test_extreme_values_keep_a_legal_scale_and_finite_levels(bits: int, values: list[float]) -> None:
    spec = TensorSpec((("w", (2,)),))
    sent = quantize_sparse(torch.tensor([0, 1]), torch.tensor(values), bits)
    absmax = torch.tensor(values).abs().max().item()
    assert sent.scale == pytest.approx(max(absmax / ((2**bits - 1) / 2), TINY), rel=1e-6)
    assert sent.scale <= MAX_SCALES[bits]
    got = decode_sparse(_encode({"w": sent}, bits, spec), spec, bits)["w"]
    assert torch.isfinite(got.values).all() and torch.equal(got.values, sent.values)


@pytest.mark.parametrize("bits", SPARSE_BITS)
def test_the_largest_scale_gives_finite_levels_and_the_next_float32_is_refused(bits: int) -> None:
    spec = TensorSpec((("w", (1,)),))
    top = MAX_SCALES[bits]
    frame = lambda scale: struct.pack("<IfI", 1, scale, 0) + bytes([2**bits - 1])
    assert decode_sparse(frame(top), spec, bits)["w"].values.tolist() == [FLOAT32_MAX]
    with pytest.raises(NonFiniteTensor, match="tensor 'w': scale"):
        decode_sparse(frame(float(np.nextafter(np.float32(top), np.float32(INF)))), spec, bits)


@pytest.mark.parametrize("bits", SPARSE_BITS)
def test_sizes_are_exact_and_the_cap_is_every_entry_sent(bits: int) -> None:
    partial, _ = _delta(bits, {"a": 7, "b": 2, "empty_sent": 0})
    full, _ = _delta(bits, {name: shape[0] * (shape[1] if len(shape) > 1 else 1) for name, shape in SPEC.entries})
    assert sparse_size(partial, bits) == len(_encode(partial, bits)) < max_sparse_size(SPEC, bits)
    assert sparse_size(full, bits) == len(_encode(full, bits)) == max_sparse_size(SPEC, bits)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64])
def test_chunks_are_full_and_any_split_of_the_feed_decodes_alike(chunk_bytes: int) -> None:
    state, _ = _delta(4, {"a": 9, "b": 3, "empty_sent": 0})
    data = _encode(state, 4)
    chunks = [bytes(c) for c in encode_sparse(state, SPEC, 4, chunk_bytes=chunk_bytes)]
    assert b"".join(chunks) == data and all(len(c) == chunk_bytes for c in chunks[:-1])
    assert 0 < len(chunks[-1]) <= chunk_bytes
    decoder = SparseDecoder(SPEC, 4, len(data))
    for i in range(len(data)):
        assert not decoder.complete
        decoder.feed(data[i : i + 1])
    whole = decode_sparse(data, SPEC, 4)
    for name, got in decoder.finish().items():
        assert torch.equal(got.indices, whole[name].indices) and torch.equal(got.values, whole[name].values)


# --- the format, byte for byte ---------------------------------------------------------

GOLDEN_SPEC = TensorSpec((("w", (2, 4)), ("b", (3,))))


def _golden() -> bytes:
    # w: 5 entries, max |v| = 3 so scale = 3 / 1.5 = 2 and the levels are -3, -1, 1, 3 (codes 0..3).
    w = quantize_sparse(torch.tensor([0, 2, 3, 5, 7]), torch.tensor([3.0, -1.0, 1.0, -3.0, 2.9]), 2)
    b = quantize_sparse(torch.empty(0, dtype=torch.int64), torch.empty(0), 2)
    return _encode({"w": w, "b": b}, 2, GOLDEN_SPEC)


def test_golden_bytes_of_two_bit_codes_with_padding() -> None:
    expected = (
        struct.pack("<If", 5, 2.0)  # w: count, scale
        + struct.pack("<5I", 0, 2, 3, 5, 7)  # w: indices
        + bytes([0b00_10_01_11, 0b000000_11])  # w: codes 3, 1, 2, 0 | 3 and six zero padding bits
        + struct.pack("<If", 0, 0.0)  # b: nothing sent
    )
    assert _golden() == expected
    decoded = decode_sparse(expected, GOLDEN_SPEC, 2)
    assert decoded["w"].values.tolist() == [3.0, -1.0, 1.0, -3.0, 3.0]
    assert decoded["b"].indices.numel() == 0


# --- hostile frames ------------------------------------------------------------------


def _patched(offset: int, fmt: str, value: float) -> bytes:
    data = bytearray(_golden())
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "error", "match"),
    [
        (24, "<I", 8, MalformedMessage, r"tensor 'w': index 8 ≥ 8 elements"),
        (16, "<I", 2, MalformedMessage, r"tensor 'w': entry 2 has index 2 after 2; indices must strictly ascend"),
        (12, "<I", 4, MalformedMessage, r"tensor 'w': entry 2 has index 3 after 4"),
        (0, "<I", 9, MalformedMessage, r"tensor 'w': 9 entries sent for 8 elements"),
        (30, "<I", 4, MalformedMessage, r"tensor 'b': 4 entries sent for 3 elements"),
        (4, "<f", NAN, NonFiniteTensor, r"tensor 'w': scale nan with 5 entries; it must be in \(0, "),
        (4, "<f", INF, NonFiniteTensor, r"tensor 'w': scale inf"),
        (4, "<f", -2.0, NonFiniteTensor, r"tensor 'w': scale -2.0"),
        (4, "<f", 0.0, NonFiniteTensor, r"tensor 'w': scale 0.0 with 5 entries"),
        (4, "<f", FLOAT32_MAX, NonFiniteTensor, r"tensor 'w': scale 3.40"),
        (34, "<f", 1.0, MalformedMessage, r"tensor 'b': scale 1.0 with 0 entries; it must be 0.0"),
        (34, "<f", -0.0, MalformedMessage, r"tensor 'b': scale -0.0 with 0 entries"),
        (34, "<f", INF, NonFiniteTensor, r"tensor 'b': scale inf with 0 entries"),
        (29, "<B", 0b01_00_00_11, MalformedMessage, r"tensor 'w': nonzero padding bits after its 5 codes"),
    ],
)
def test_hostile_fields_raise_typed_errors_naming_the_tensor(offset, fmt, value, error, match) -> None:
    with pytest.raises(error, match=match):
        decode_sparse(_patched(offset, fmt, value), GOLDEN_SPEC, 2)


def test_a_cut_or_padded_structure_is_malformed() -> None:
    data = _golden()
    with pytest.raises(MalformedMessage, match=r"tensor 'b': count and scale need 8 bytes at offset 30, past the 37"):
        decode_sparse(data[:37], GOLDEN_SPEC, 2)
    with pytest.raises(MalformedMessage, match=r"tensor 'b': 1 entries need 5 bytes at offset 38, past the 38"):
        decode_sparse(data[:30] + struct.pack("<If", 1, 1.0), GOLDEN_SPEC, 2)  # b announces an entry it lacks
    with pytest.raises(MalformedMessage, match=r"1 bytes follow the last tensor 'b'; the size must match"):
        decode_sparse(data + b"\0", GOLDEN_SPEC, 2)


def test_finishing_early_and_overrunning_are_malformed() -> None:
    data = _golden()
    decoder = SparseDecoder(GOLDEN_SPEC, 2, len(data))
    decoder.feed(data[:30])
    with pytest.raises(MalformedMessage, match="only 30 of 38 announced sparse bytes arrived"):
        decoder.finish()
    with pytest.raises(MalformedMessage, match="39 sparse bytes sent, 38 were announced"):
        decoder.feed(data[:9])


def test_announced_sizes_and_bits_are_checked_before_allocating() -> None:
    assert max_sparse_size(GOLDEN_SPEC, 2) == (8 + 32 + 2) + (8 + 12 + 1)
    with pytest.raises(FrameTooLarge, match="1152921504606846976 sparse bytes announced, at most 63 fit"):
        SparseDecoder(GOLDEN_SPEC, 2, 1 << 60)
    with pytest.raises(MalformedMessage, match="15 sparse bytes announced, 2 tensors need at least 16"):
        SparseDecoder(GOLDEN_SPEC, 2, 15)
    for bits in (3, 16, 4.0, True):
        with pytest.raises(MalformedMessage, match=f"unknown sparse bit width {bits!r}"):
            SparseDecoder(GOLDEN_SPEC, bits, 38)


@pytest.mark.parametrize(
    ("indices", "values", "match"),
    [
        ([2, 1], [1.0, 2.0], "strictly ascending"),
        ([1, 1], [1.0, 2.0], "strictly ascending"),
        ([-1, 1], [1.0, 2.0], "non-negative"),
        ([0, 1], [NAN, 2.0], "finite"),
        ([0, 1], [1.0, INF], "finite"),
        ([0, 1], [1.0], "1 values for 2 indices"),
    ],
)
def test_quantizing_bad_local_input_is_a_value_error(indices: list[int], values: list[float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_sparse(torch.tensor(indices), torch.tensor(values), 4)
