"""Tensor codec: a model's floating-point tensors as they travel, in chunks, validated on arrival.

A model travels as a `WireState`: every tensor of its `TensorSpec`, in spec order, in
one wire dtype — `float32`, `bfloat16`, `float16`, or `int8` with one float32 scale per
tensor. The byte stream is the scales (int8 only) then each tensor's little-endian
bytes, cut into chunks; nothing else. What the bytes mean is settled before they flow:
the sender announces the wire dtype, the layout digest of its spec and the exact byte
size (`murmur.protocol.messages.Params`), and a receiver accepts them only if all three match
its own model, so it allocates exactly one buffer of the right size, up front.

The wire format is independent of device and of the model's dtype. Both sides of an
exchange quantize their own model to the same wire dtype and move by their share of
the difference of the two quantized models: models that agree do not move at all, and
a lossy dtype's error stays within its resolution of the exact merge.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from murmur.protocol.errors import MalformedMessage, NonFiniteTensor, TensorMismatch
from murmur.protocol.messages import MAX_CHUNK_BYTES, MAX_LAYOUT_ENTRIES, WIRE_DTYPE_NAMES

WIRE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
}  # fmt: skip
assert tuple(WIRE_DTYPES) == WIRE_DTYPE_NAMES
CHUNK_BYTES = MAX_CHUNK_BYTES
_SCALE_BYTES = 4
_MAX_SCALE = torch.finfo(torch.float32).max / 127  # larger scales overflow float32 when dequantized
_MIN_SCALE = torch.finfo(torch.float32).smallest_normal
assert sys.byteorder == "little", "the wire format is little-endian and is written from memory as is"


DESCRIBED_BYTES = 48 * 1024  # a described layout fits a control frame (64 KiB) with room to spare


@dataclass(frozen=True)
class TensorSpec:
    """The ordered names and shapes of the tensors a model exchanges."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> TensorSpec:
        """The spec of the floating-point tensors in `state`, in its order."""
        return cls(tuple((name, tuple(t.shape)) for name, t in state.items() if t.is_floating_point()))

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, shape in self.entries)

    def header(self) -> bytes:
        return json.dumps([[n, "float32", list(s)] for n, s in self.entries], separators=(",", ":")).encode()

    @property
    def layout(self) -> str:
        """A hex digest of every name and shape, in order: what `Params` announces."""
        return self.fingerprint()

    def fingerprint(self, architecture: str = "") -> str:
        """A hex digest of the architecture description plus every name and shape."""
        return hashlib.sha256(architecture.encode() + self.header()).hexdigest()

    def described(self, max_bytes: int = DESCRIBED_BYTES) -> list[list]:
        """The first names and shapes as `[[name, [dims]], ...]`, within `max_bytes` of JSON (for `Refuse.layout`)."""
        out: list[list] = []
        size = 2
        for name, shape in self.entries[:MAX_LAYOUT_ENTRIES]:
            size += len(json.dumps([name, list(shape)])) + 1
            if size > max_bytes:
                break
            out.append([name, list(shape)])
        return out

    def difference(self, theirs: Sequence[Sequence[Any]], *, complete: bool = False, here: str = "here", there: str = "there") -> str:
        """The first difference between this spec and `theirs` (`described()`'s form), in words.

        "differs in <name>: shape 10×64 here, 10×32 there", another tensor at a position, a
        tensor on one side only, or, when every tensor matches, that the task name or the
        architecture differs. `theirs` may be cut short (`described`) unless `complete`.
        """
        ours = [(n, tuple(s)) for n, s in self.entries]
        others = [(str(n), tuple(s)) for n, s in theirs]
        for i, ((name, shape), (their_name, their_shape)) in enumerate(zip(ours, others)):
            if name == their_name and shape != their_shape:
                return f"differs in {name}: shape {_dims(shape)} {here}, {_dims(their_shape)} {there}"
            if name != their_name:
                return f"differs at tensor {i}: {name} {_dims(shape)} {here}, {their_name} {_dims(their_shape)} {there}"
        if len(others) < len(ours):
            cut = len(others) == MAX_LAYOUT_ENTRIES or len(json.dumps([list(e) for e in others])) > DESCRIBED_BYTES - 1024
            if not complete and cut:  # the sender described only its first tensors
                return f"the first {len(others)} tensors match; the task name, architecture or a later tensor differs"
            return f"differs in {ours[len(others)][0]}: {here} only"
        if len(others) > len(ours):
            return f"differs in {others[len(ours)][0]}: {there} only"
        return "same tensor names and shapes: the task name or the architecture differs"

    def wire_size(self, dtype: str) -> int:
        """The exact byte size of a model with this spec in wire dtype `dtype`."""
        scales = _SCALE_BYTES * len(self.entries) if dtype == "int8" else 0
        return scales + WIRE_DTYPES[dtype].itemsize * self.numel


def _dims(shape: tuple[int, ...]) -> str:
    return "×".join(map(str, shape)) or "scalar"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_wire_dtype(dtype: str) -> str:
    """Return `dtype` if it is a wire dtype; raises `ValueError` listing the choices."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {dtype!r}; choose from {sorted(WIRE_DTYPES)}")
    return dtype


class WireState(Mapping[str, torch.Tensor]):
    """A model's tensors in a wire dtype; reading one (`state[name]`) gives it as CPU float32.

    Holds `tensors` (CPU, wire dtype, spec order) and, for int8, one scale per tensor
    (value = q × scale). Reading dequantizes one tensor at a time, so code that walks
    the model tensor by tensor never holds a second full-precision copy.
    """

    def __init__(self, dtype: str, tensors: dict[str, torch.Tensor], scales: dict[str, float] | None = None) -> None:
        self.dtype = check_wire_dtype(dtype)
        self.tensors = tensors
        self.scales = scales or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.tensors[name]
        if self.dtype == "int8":
            return tensor.to(torch.float32) * self.scales[name]
        return tensor.to(torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def piece(self, name: str, elements: slice) -> torch.Tensor:
        """Elements `elements` of tensor `name`, flattened, as CPU float32."""
        piece = self.tensors[name].reshape(-1)[elements].to(torch.float32)
        return piece * self.scales[name] if self.dtype == "int8" else piece


PIECE = 1 << 20  # elements per piece: bounds the temporaries of whole-model arithmetic


def pieces(state: Mapping[str, torch.Tensor], name: str, size: int = PIECE) -> Iterator[tuple[slice, torch.Tensor]]:
    """Tensor `name` of `state` as (elements, flat CPU float32 piece) of at most `size` elements.

    Walking a model piece by piece keeps temporaries at a few MB however big its
    tensors are; a `WireState` dequantizes only the piece asked for.
    """
    flat = (state.tensors[name] if isinstance(state, WireState) else state[name]).reshape(-1)
    for start in range(0, flat.numel(), size):
        elements = slice(start, min(start + size, flat.numel()))
        if isinstance(state, WireState):
            yield elements, state.piece(name, elements)
        else:
            yield elements, flat[elements].to("cpu", torch.float32)


def quantize(state: Mapping[str, torch.Tensor], spec: TensorSpec, dtype: str) -> WireState:
    """The tensors named by `spec` from `state` (any device, float dtype) as a CPU `WireState`."""
    check_wire_dtype(dtype)
    tensors: dict[str, torch.Tensor] = {}
    scales: dict[str, float] = {}
    for name, _ in spec.entries:
        t = state[name].detach()
        if dtype == "int8":
            absmax = t.abs().max().item() if t.numel() else 0.0  # (a tensor-sized temporary; the rest goes by pieces)
            # As float32, the form it travels in, so both sides dequantize alike; never below
            # the smallest normal float32, so it cannot underflow to 0.
            scales[name] = torch.tensor(max(absmax / 127, _MIN_SCALE) if absmax > 0 else 1.0, dtype=torch.float32).item()
            q = torch.empty(t.shape, dtype=torch.int8)
            for elements, piece in pieces(state, name):
                q.view(-1)[elements] = torch.div(piece, scales[name]).round_().clamp_(-127, 127).to(torch.int8)
            tensors[name] = q
        else:
            tensors[name] = t.to("cpu", WIRE_DTYPES[dtype], copy=True).contiguous()
    return WireState(dtype, tensors, scales)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.contiguous().reshape(-1)
    # numpy has no bfloat16: reinterpret the bits as int16 (same bytes, same order).
    return memoryview(flat.view(torch.int16).numpy() if flat.dtype == torch.bfloat16 else flat.numpy()).cast("B")


def wire_chunks(wire: WireState, spec: TensorSpec, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """The bytes of `wire` in spec order, as views of at most `chunk_bytes` (no full copy)."""
    if wire.dtype == "int8":
        scales = torch.tensor([wire.scales[name] for name, _ in spec.entries], dtype=torch.float32)
        yield _raw_bytes(scales)
    for name, _ in spec.entries:
        data = _raw_bytes(wire.tensors[name])
        for start in range(0, len(data), chunk_bytes):
            yield data[start : start + chunk_bytes]


def encode_state(state: Mapping[str, torch.Tensor], spec: TensorSpec, dtype: str = "float32") -> bytes:
    """All of `state`'s wire bytes at once (tests, tools; exchanges stream `wire_chunks`)."""
    return b"".join(wire_chunks(quantize(state, spec, dtype), spec))


class AnnouncedBytes:
    """Exactly the `size` bytes a frame announced, received into one buffer allocated up front.

    `feed` refuses bytes past `size`, and `whole` any fewer (`MalformedMessage`, naming `WHAT`).
    """

    WHAT = "announced"

    def __init__(self, size: int) -> None:
        self.size = size
        self._buffer = np.empty(size, dtype=np.uint8)
        self._received = 0

    @property
    def complete(self) -> bool:
        return self._received == self.size

    def feed(self, data: bytes | memoryview) -> None:
        """Append `data`; raises `MalformedMessage` if it overruns the announced size."""
        n = len(data)
        if n > self.size - self._received:
            raise MalformedMessage(f"{self._received + n} {self.WHAT} bytes sent, {self.size} were announced")
        # numpy views `data` without a copy; the assignment is the one copy
        self._buffer[self._received : self._received + n] = np.frombuffer(data, dtype=np.uint8)
        self._received += n

    def whole(self) -> np.ndarray:
        """The received bytes; raises `MalformedMessage` unless every announced byte arrived."""
        if not self.complete:
            raise MalformedMessage(f"only {self._received} of {self.size} announced {self.WHAT} bytes arrived")
        return self._buffer


class WireDecoder(AnnouncedBytes):
    """Receives one model's wire bytes into a buffer sized from the local spec.

    The constructor checks the announced dtype, layout and size against `spec` before
    allocating anything (`MalformedMessage` for an unknown dtype, `TensorMismatch`
    otherwise); `feed` refuses bytes beyond the announced size; `finish` checks that
    every byte arrived, every scale is positive and finite and every value is finite
    (`NonFiniteTensor` naming the tensor), and returns the `WireState`.
    """

    WHAT = "parameter"

    def __init__(self, spec: TensorSpec, dtype: str, layout: str, size: int) -> None:
        if dtype not in WIRE_DTYPES:
            raise MalformedMessage(f"unknown wire dtype {dtype!r}")
        if layout != spec.layout:
            raise TensorMismatch(f"parameter layout {layout[:12]} differs from the local model's {spec.layout[:12]}")
        if size != spec.wire_size(dtype):
            raise TensorMismatch(f"{size} bytes announced, the local model needs {spec.wire_size(dtype)} in {dtype}")
        super().__init__(size)
        self.spec = spec
        self.dtype = dtype

    def finish(self) -> WireState:
        """The received model, validated (see the class docstring)."""
        buffer = torch.from_numpy(self.whole())
        offset = 0
        scales: dict[str, float] = {}
        if self.dtype == "int8":
            n = _SCALE_BYTES * len(self.spec.entries)
            values = buffer[:n].view(torch.float32).tolist()
            for (name, _), scale in zip(self.spec.entries, values, strict=True):
                if not 0 < scale <= _MAX_SCALE:  # also false for NaN
                    raise NonFiniteTensor(f"tensor {name!r} has int8 scale {scale!r}; it must be in (0, {_MAX_SCALE:.3g}]")
                scales[name] = scale
            offset = n
        tensors: dict[str, torch.Tensor] = {}
        wire_dtype = WIRE_DTYPES[self.dtype]
        for name, shape in self.spec.entries:
            size = wire_dtype.itemsize * _numel(shape)
            flat = buffer[offset : offset + size].view(wire_dtype)
            offset += size
            if flat.is_floating_point() and not all(torch.isfinite(flat[i : i + PIECE]).all() for i in range(0, flat.numel(), PIECE)):
                raise NonFiniteTensor(f"tensor {name!r} holds NaN or Inf")
            tensors[name] = flat.reshape(shape)
        return WireState(self.dtype, tensors, scales)


def decode_state(data: bytes, spec: TensorSpec, dtype: str = "float32") -> WireState:
    """Decode all of a model's wire bytes at once; raises as `WireDecoder` does."""
    decoder = WireDecoder(spec, dtype, spec.layout, len(data))
    decoder.feed(data)
    return decoder.finish()
