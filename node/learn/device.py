"""Where a peer computes: `--device auto|cpu|cuda|cuda:N|mps` and `--mixed-precision`.

Only the model and its batches live on the device. Snapshots, merges, checkpoints and
the wire stay CPU float32 (see `protocol/codec.py`), so CPU, CUDA and MPS peers, and
peers whose models use other float dtypes, share one swarm.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N|mps"
_SYNTAX = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


class DeviceError(ValueError):
    """The requested device (or mixed precision on it) is unusable here; the message says why in one line."""


def check_device_syntax(spec: str) -> str:
    """Return `spec` if it names a device form Murmur knows; raises `DeviceError` otherwise.

    Only the form is checked (usable as an argparse `type`); availability is `resolve_device`'s job.
    """
    if not _SYNTAX.match(spec):
        raise DeviceError(f"unknown device {spec!r}; choose {DEVICE_CHOICES}")
    return spec


def _mps_available() -> bool:
    return torch.backends.mps.is_available()


def resolve_device(spec: str) -> torch.device:
    """The `torch.device` that `spec` names on this machine, with an explicit CUDA index.

    `auto` picks CUDA if available, else MPS if available, else the CPU. Raises
    `DeviceError` for an unknown form or a device this machine (or this torch build) lacks.
    """
    check_device_syntax(spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not _mps_available():
            raise DeviceError("device 'mps' is not available (needs Apple silicon and a torch build with MPS)")
        return torch.device("mps")
    if not torch.cuda.is_available():
        build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU or driver found"
        raise DeviceError(
            f"device {spec!r} is not available: {build} (torch {torch.__version__}); use --device cpu or auto"
        )
    index = int(spec.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(
            f"device {spec!r} is not available: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def check_mixed_precision(device: torch.device) -> None:
    """Raise `DeviceError` unless bf16 autocast is worthwhile on `device` (a CUDA GPU with bf16 support).

    On the CPU and MPS it is refused: bf16 autocast there is usually slower than float32.
    """
    if device.type != "cuda":
        raise DeviceError(f"--mixed-precision needs a CUDA device (bf16 autocast); this node runs on {device}")
    if not torch.cuda.is_bf16_supported():
        raise DeviceError(f"--mixed-precision: {torch.cuda.get_device_name(device)} does not support bfloat16")


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device` when `enabled` (checked with `check_mixed_precision`), else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (nested tuples, lists, dicts) moved to `device`; other values unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def cpu_copy(obj: Any, _copies: dict | None = None) -> Any:
    """A copy of `obj` with every tensor in it (nested dicts, lists, tuples) on the CPU; for checkpoints.

    Tensors that are one tensor under several names (tied weights: the same storage, offset,
    shape and stride) stay one tensor in the copy, so a checkpoint stores it once.
    """
    copies = {} if _copies is None else _copies
    if isinstance(obj, torch.Tensor):
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), tuple(obj.shape), tuple(obj.stride()), obj.dtype)
        if not obj.numel():  # empty tensors share no data, whatever their pointer
            return obj.detach().to("cpu", copy=True)
        if key not in copies:
            copies[key] = obj.detach().to("cpu", copy=True)
        return copies[key]
    if isinstance(obj, dict):
        return {k: cpu_copy(v, copies) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(v, copies) for v in obj)
    return obj


def describe(device: torch.device) -> str:
    """A short human description, e.g. `cuda:0 (NVIDIA H100 80GB HBM3)` or `cpu`."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
