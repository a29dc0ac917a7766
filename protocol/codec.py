"""Tensor codec: a model's floating-point state as bytes, validated on the way in.

Layout: `header_len:u32be | header (UTF-8 JSON) | raw data`. The header lists
`[name, dtype, shape]` per tensor, in order; the data is each tensor's little-endian
bytes, concatenated. The wire format is independent of device and of the model's
dtype: tensors travel as float32.

A receiver decodes only against its own `TensorSpec`: every name, dtype, shape and
byte size must match and every value must be finite, or a typed error names the
first field at fault. Nothing is allocated for data before the sizes check out.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protocol.errors import MalformedMessage, NonFiniteTensor, TensorMismatch

WIRE_DTYPE = torch.float32
_WIRE_DTYPE_NAME = "float32"
_HEADER_LEN = struct.Struct("!I")


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
        return json.dumps([[n, _WIRE_DTYPE_NAME, list(s)] for n, s in self.entries], separators=(",", ":")).encode()

    @property
    def encoded_size(self) -> int:
        """The exact byte size of an encoding of a state with this spec."""
        return _HEADER_LEN.size + len(self.header()) + 4 * self.numel

    def fingerprint(self, architecture: str = "") -> str:
        """A hex digest of the architecture description plus every name and shape."""
        return hashlib.sha256(architecture.encode() + self.header()).hexdigest()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def encode_state(state: Mapping[str, torch.Tensor], spec: TensorSpec) -> bytes:
    """Encode the tensors named by `spec` from `state` (any device or float dtype)."""
    parts = [_HEADER_LEN.pack(len(spec.header())), spec.header()]
    for name, _ in spec.entries:
        tensor = state[name].detach().to(device="cpu", dtype=WIRE_DTYPE).contiguous()
        parts.append(tensor.numpy().astype("<f4", copy=False).tobytes())
    return b"".join(parts)


def decode_state(data: bytes, spec: TensorSpec) -> dict[str, torch.Tensor]:
    """Decode `data` into float32 CPU tensors, checked against the local `spec`.

    Raises `MalformedMessage` for a truncated or unparsable header, `TensorMismatch`
    naming the first tensor whose name, dtype, shape or byte size differs, and
    `NonFiniteTensor` naming a tensor that holds NaN or Inf.
    """
    if len(data) < _HEADER_LEN.size:
        raise MalformedMessage(f"tensor payload of {len(data)} bytes is shorter than its header length field")
    (header_len,) = _HEADER_LEN.unpack_from(data)
    if header_len > len(data) - _HEADER_LEN.size:
        raise MalformedMessage(f"tensor header of {header_len} bytes overruns a {len(data)}-byte payload")
    header_bytes = data[_HEADER_LEN.size : _HEADER_LEN.size + header_len]
    if header_bytes != spec.header():
        _explain_header_mismatch(header_bytes, spec)
    offset = _HEADER_LEN.size + header_len
    if len(data) != offset + 4 * spec.numel:
        raise TensorMismatch(f"payload holds {len(data) - offset} data bytes, the local model needs {4 * spec.numel}")
    view = memoryview(data)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in spec.entries:
        size = 4 * _numel(shape)
        chunk = bytearray(view[offset : offset + size])
        flat = torch.frombuffer(chunk, dtype=torch.float32) if size else torch.empty(0)
        offset += size
        tensor = flat.reshape(shape)
        if not torch.isfinite(tensor).all():
            raise NonFiniteTensor(f"tensor {name!r} holds NaN or Inf")
        tensors[name] = tensor
    return tensors


def _explain_header_mismatch(header_bytes: bytes, spec: TensorSpec) -> None:
    try:
        entries = json.loads(header_bytes.decode("utf-8"))
        if not isinstance(entries, list):
            raise ValueError("not a list")
    except (ValueError, RecursionError) as exc:
        raise MalformedMessage(f"tensor header is not a JSON list ({exc})") from None
    for i, (name, shape) in enumerate(spec.entries):
        if i >= len(entries):
            raise TensorMismatch(f"tensor {name!r} is missing")
        entry = entries[i]
        if not (isinstance(entry, list) and len(entry) == 3):
            raise MalformedMessage(f"tensor header entry {i} is not [name, dtype, shape]")
        got_name, got_dtype, got_shape = entry
        if got_name != name:
            raise TensorMismatch(f"tensor {i} is named {got_name!r}, expected {name!r}")
        if got_dtype != _WIRE_DTYPE_NAME:
            raise TensorMismatch(f"tensor {name!r} has dtype {got_dtype!r}, expected {_WIRE_DTYPE_NAME!r}")
        if got_shape != list(shape):
            raise TensorMismatch(f"tensor {name!r} has shape {got_shape}, expected {list(shape)}")
    if len(entries) != len(spec.entries):
        raise TensorMismatch(f"header lists {len(entries)} tensors, the local model has {len(spec.entries)}")
    raise MalformedMessage("tensor header is not in canonical form")
