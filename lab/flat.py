"""The synchronous baseline's flat all-reduce buffer: the parameters' gradients one after another."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack(params: Sequence[torch.nn.Parameter], flat: torch.Tensor, scale: float) -> None:
    """Copy `scale` * each parameter's gradient into the front of `flat` (zeros where a parameter has none)."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:  # unused in this step's loss: contributes nothing
            flat[offset : offset + n].zero_()
        else:
            flat[offset : offset + n].copy_(p.grad.reshape(-1)).mul_(scale)
        offset += n


def unpack(params: Sequence[torch.nn.Parameter], flat: torch.Tensor, divisor: float) -> None:
    """Set each parameter's gradient to its slice of `flat` / `divisor` (a new tensor where it had none)."""
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset : offset + n].view_as(p) / divisor
        if p.grad is None:
            p.grad = grad.to(p.dtype)
        else:
            p.grad.copy_(grad)
        offset += n
