"""Sparse codec: the top-k entries of each tensor of a model delta, quantized to 2, 4 or 8 bits.

A sparse delta covers every tensor of a `TensorSpec`, in spec order, at a bit width `bits`
that both sides agreed on beforehand. Each tensor travels as (all little-endian):

    count    u32                          entries sent, at most the tensor's element count
    scale    f32                          in (0, max scale] if count > 0; +0.0 if count == 0
    indices  count × u32                  into the flattened tensor, strictly ascending
    codes    ceil(count × bits / 8) bytes `bits` bits each, LSB first in a byte, zero-padded

A code q means scale × (q − L) with L = (2**bits − 1) / 2: symmetric levels, no zero level.
Both sides compute those values with one float32 formula (`SparseTensor.values`), so the
changes they apply are bit-identical. A receiver caps the announced size by `max_sparse_size`
before allocating, then checks the whole structure, vectorised, in `SparseDecoder.finish`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from murmur.protocol.codec import CHUNK_BYTES, AnnouncedBytes, TensorSpec
from murmur.protocol.errors import FrameTooLarge, MalformedMessage, NonFiniteTensor
from murmur.protocol.messages import SPARSE_BITS

_HEADER = struct.Struct("<If")  # count, scale
_INDEX_BYTES = 4
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_MIN_SCALE = float(torch.finfo(torch.float32).smallest_normal)


def _half_range(bits: int) -> float:
    return (2**bits - 1) / 2


# The largest scales whose extreme levels, ±scale × L, are finite float32 values: exactly
# float32 max / L, a float32 itself since 2**bits − 1 divides float32 max's significand 2**24 − 1.
MAX_SCALES = {bits: _FLOAT32_MAX / _half_range(bits) for bits in SPARSE_BITS}
assert all(float(np.float32(s)) * _half_range(b) == _FLOAT32_MAX for b, s in MAX_SCALES.items())


def _check_bits(bits: int, error: type[Exception] = ValueError) -> None:
    if type(bits) is not int or bits not in SPARSE_BITS:  # not bool, not 4.0
        raise error(f"unknown sparse bit width {bits!r}; choose from {list(SPARSE_BITS)}")


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """Some entries of one flattened tensor, quantized.

    `indices` (int64, strictly ascending) say where; `values` (float32) are what a receiver
    decodes, scale × (code − L); `codes` (uint8, each < 2**bits) and `scale` (a float32
    value, 0.0 when there are no entries) are what travels.
    """

    indices: torch.Tensor
    values: torch.Tensor
    codes: torch.Tensor
    scale: float
    bits: int


SparseState = dict[str, SparseTensor]  # every tensor of a spec, by name; unsent ones have no entries


def _dequantize(codes: torch.Tensor, scale: float, bits: int) -> torch.Tensor:
    """scale × (code − L) in float32: the one formula both sides use, so they agree bit for bit."""
    return (codes.to(torch.float32) - _half_range(bits)) * torch.tensor(scale, dtype=torch.float32)


def _empty(bits: int) -> SparseTensor:
    none = torch.empty(0, dtype=torch.uint8)
    return SparseTensor(torch.empty(0, dtype=torch.int64), _dequantize(none, 0.0, bits), none, 0.0, bits)


def quantize_sparse(indices: torch.Tensor, values: torch.Tensor, bits: int) -> SparseTensor:
    """`values` at `indices` quantized to `bits` bits; `.values` are what a receiver will decode.

    `indices` must be 1-D int64, non-negative and strictly ascending, and `values` 1-D, floating
    point, finite (as float32) and as long; anything else is a local bug: `ValueError`. The scale
    is max|v| / L as float32, never below the smallest normal float32 so it cannot underflow to 0;
    every value lands within scale / 2 of its level.
    """
    _check_bits(bits)
    if indices.dtype != torch.int64 or indices.dim() != 1 or not values.is_floating_point():
        raise ValueError(f"need 1-D int64 indices and floating-point values, got {indices.dtype} and {values.dtype}")
    if values.shape != indices.shape:
        raise ValueError(f"{values.numel()} values for {indices.numel()} indices; need one value per index")
    indices = indices.detach().to("cpu")
    values = values.detach().to("cpu", torch.float32)
    if indices.numel() and (indices[0] < 0 or not bool((indices[1:] > indices[:-1]).all())):
        raise ValueError("indices must be non-negative and strictly ascending")
    if not bool(torch.isfinite(values).all()):
        raise ValueError("values must be finite as float32")
    if not indices.numel():
        return _empty(bits)
    half = _half_range(bits)
    # At most MAX_SCALES[bits], as |v| ≤ float32 max; as float32, the form it travels in.
    scale = torch.tensor(max(values.abs().max().item() / half, _MIN_SCALE), dtype=torch.float32).item()
    codes = torch.round(values / scale + half).clamp_(0, 2**bits - 1).to(torch.uint8)
    return SparseTensor(indices, _dequantize(codes, scale, bits), codes, scale, bits)


def _entry_bytes(count: int, bits: int) -> int:
    return _HEADER.size + _INDEX_BYTES * count + (count * bits + 7) // 8


def sparse_size(state: Mapping[str, SparseTensor], bits: int) -> int:
    """The exact byte size of `state` encoded at `bits` bits."""
    _check_bits(bits)
    return sum(_entry_bytes(t.indices.numel(), bits) for t in state.values())


def max_sparse_size(spec: TensorSpec, bits: int, entries: Callable[[int], int] | None = None) -> int:
    """The size of a delta of `spec` that sends `entries(numel)` entries of each tensor (default:
    every entry, the largest legal size): a receiver's cap."""
    _check_bits(bits)
    return sum(_entry_bytes(entries(n) if entries else n, bits) for n in (math.prod(shape) for _, shape in spec.entries))


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """`codes` at `bits` bits each, LSB first within a byte, zero-padded to a whole byte."""
    per = 8 // bits
    padded = np.zeros(-(-codes.size // per) * per, dtype=np.uint8)
    padded[: codes.size] = codes
    return np.bitwise_or.reduce(padded.reshape(-1, per) << np.arange(0, 8, bits, dtype=np.uint8), axis=1)


def _unpack(packed: np.ndarray, count: int, bits: int) -> tuple[np.ndarray, bool]:
    """The first `count` codes in `packed`, and whether every padding bit after them is zero."""
    codes = ((packed[:, None] >> np.arange(0, 8, bits, dtype=np.uint8)) & (2**bits - 1)).reshape(-1)
    return codes[:count], not codes[count:].any()


def _tensor_parts(tensor: SparseTensor, name: str, numel: int, bits: int) -> list[bytes | memoryview]:
    """Tensor `name`'s header, indices and packed codes; `ValueError` if they cannot travel as they are."""
    count = tensor.indices.numel()
    if tensor.bits != bits:
        raise ValueError(f"tensor {name!r} was quantized at {tensor.bits} bits, not {bits}")
    if count and not (tensor.indices[-1].item() < min(numel, 2**32) and tensor.codes.max().item() < 2**bits):
        raise ValueError(f"tensor {name!r}: an index ≥ {numel} elements or a code ≥ {2**bits}")
    header, indices = _HEADER.pack(count, tensor.scale), tensor.indices.numpy().astype("<u4")
    return [header, memoryview(indices).cast("B"), memoryview(_pack(tensor.codes.numpy(), bits))]


def _rechunk(parts: Iterable[bytes | memoryview], chunk_bytes: int) -> Iterator[bytes | memoryview]:
    """`parts` cut and joined into pieces of exactly `chunk_bytes` (the last may be shorter)."""
    pending = bytearray()  # small parts are joined so that each piece fills a frame
    for part in parts:
        view = memoryview(part)
        if pending:
            take = chunk_bytes - len(pending)
            pending += view[:take]
            view = view[take:]
            if len(pending) < chunk_bytes:
                continue
            yield bytes(pending)
            pending = bytearray()
        whole = len(view) - len(view) % chunk_bytes
        for start in range(0, whole, chunk_bytes):
            yield view[start : start + chunk_bytes]  # large parts go out as views, not copies
        pending += view[whole:]
    if pending:
        yield bytes(pending)


def encode_sparse(
    state: Mapping[str, SparseTensor], spec: TensorSpec, bits: int, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[bytes | memoryview]:
    """`state`'s bytes in spec order, as pieces of at most `chunk_bytes`, without a full copy.

    A generator: raises, as it runs, `ValueError` (a local bug) for an unknown `bits`, a tensor
    quantized at other bits or an index outside its tensor, and `KeyError` for a missing tensor.
    """
    _check_bits(bits)
    parts = (p for name, shape in spec.entries for p in _tensor_parts(state[name], name, math.prod(shape), bits))
    yield from _rechunk(parts, chunk_bytes)


def _need(buffer: np.ndarray, offset: int, n: int, name: str, what: str) -> None:
    if offset + n > buffer.size:
        raise MalformedMessage(
            f"tensor {name!r}: {what} need {n} bytes at offset {offset}, past the {buffer.size} announced"
        )


def _check_indices(indices: np.ndarray, name: str, numel: int) -> None:
    """Raises `MalformedMessage` unless `indices` (at least one) strictly ascend and stay below `numel`."""
    rising = indices[1:] > indices[:-1]
    if not rising.all():
        i = int(np.argmin(rising)) + 1
        raise MalformedMessage(
            f"tensor {name!r}: entry {i} has index {indices[i]} after {indices[i - 1]}; indices must strictly ascend"
        )
    if indices[-1] >= numel:  # the largest, as they ascend
        raise MalformedMessage(f"tensor {name!r}: index {indices[-1]} ≥ {numel} elements")


def _parse_tensor(buffer: np.ndarray, offset: int, name: str, numel: int, bits: int) -> tuple[SparseTensor, int]:
    """Tensor `name`'s entries at `offset` of `buffer`, validated, and the offset after them."""
    _need(buffer, offset, _HEADER.size, name, "count and scale")
    count, scale = _HEADER.unpack_from(buffer, offset)
    offset += _HEADER.size
    if count > numel:
        raise MalformedMessage(f"tensor {name!r}: {count} entries sent for {numel} elements")
    bound = f"in (0, {MAX_SCALES[bits]:.6g}]" if count else "0.0"
    if not math.isfinite(scale) or (count and not 0 < scale <= MAX_SCALES[bits]):  # -0.0 is not > 0
        raise NonFiniteTensor(f"tensor {name!r}: scale {scale!r} with {count} entries; it must be {bound}")
    if count == 0:
        if scale != 0.0 or math.copysign(1.0, scale) < 0:  # one encoding of "nothing sent": +0.0
            raise MalformedMessage(f"tensor {name!r}: scale {scale!r} with 0 entries; it must be {bound}")
        return _empty(bits), offset
    packed_bytes = (count * bits + 7) // 8
    end = offset + _INDEX_BYTES * count
    _need(buffer, offset, end - offset + packed_bytes, name, f"{count} entries")
    indices = buffer[offset:end].view("<u4")
    _check_indices(indices, name, numel)
    codes, clean = _unpack(buffer[end : end + packed_bytes], count, bits)
    if not clean:
        raise MalformedMessage(f"tensor {name!r}: nonzero padding bits after its {count} codes")
    codes, indices = torch.from_numpy(codes), torch.from_numpy(indices.astype(np.int64))
    return SparseTensor(indices, _dequantize(codes, scale, bits), codes, scale, bits), end + packed_bytes


class SparseDecoder(AnnouncedBytes):
    """Receives one sparse delta of `spec` at `bits` bits into a buffer of the announced size.

    Before allocating, the constructor refuses an unknown `bits` or a size under 8 bytes a tensor
    (`MalformedMessage`) and a size above `max_sparse_size(spec, bits)` (`FrameTooLarge`); `feed`
    refuses bytes past the size (`MalformedMessage`). `finish` raises, naming the tensor,
    `MalformedMessage` for a broken structure (bytes missing or left over, more entries than
    elements, an index out of range or order, nonzero padding, a nonzero scale with no entries)
    and `NonFiniteTensor` for a scale that is not finite, or not in (0, `MAX_SCALES[bits]`] with entries.
    """

    WHAT = "sparse"

    def __init__(self, spec: TensorSpec, bits: int, size: int) -> None:
        _check_bits(bits, MalformedMessage)
        least, most = _HEADER.size * len(spec.entries), max_sparse_size(spec, bits)
        if size > most:
            raise FrameTooLarge(f"{size} sparse bytes announced, at most {most} fit the local model at {bits} bits")
        if size < least:
            raise MalformedMessage(f"{size} sparse bytes announced, {len(spec.entries)} tensors need at least {least}")
        super().__init__(size)
        self.spec = spec
        self.bits = bits

    @property
    def data(self) -> bytes:
        """The whole delta as it came, to pass on; raises `MalformedMessage` before every byte arrived."""
        return self.whole().tobytes()

    def finish(self) -> SparseState:
        """The received delta, validated (see the class docstring)."""
        buffer = self.whole()
        state: SparseState = {}
        offset = 0
        for name, shape in self.spec.entries:
            state[name], offset = _parse_tensor(buffer, offset, name, math.prod(shape), self.bits)
        if offset != self.size:
            last = self.spec.entries[-1][0]
            raise MalformedMessage(f"{self.size - offset} bytes follow the last tensor {last!r}; the size must match")
        return state


def decode_sparse(data: bytes | memoryview, spec: TensorSpec, bits: int) -> SparseState:
    """Decode a whole sparse delta at once (tests, tools); raises as `SparseDecoder` does."""
    decoder = SparseDecoder(spec, bits, len(data))
    decoder.feed(data)
    return decoder.finish()
