"""DiLoCo's outer step and its int8 all-reduce, for the synchronous baseline's modes `diloco` and
`diloco-proportional` (`lab.sync_rank`).

Outer step (`Outer`): every rank keeps the shared anchor; after its inner steps a rank puts its
pseudo-gradient (anchor − parameters) times its weight into the all-reduce buffer; the sum divided by
the total weight is every rank's `anchor.grad`, and one `torch.optim.SGD(nesterov=True)` step moves the
anchor, as torchft's DiLoCo does. `diloco` weighs every rank 1; `diloco-proportional` weighs a rank by the
samples it trained this round (so a rank that did more inner steps counts more).

Int8 wire (`all_reduce_int8`), as INTELLECT-1 sends its outer gradients: the payload is cut into one
shard per rank and quantized to int8 with one float32 scale per `BLOCK` values (`quantize`). A rank
receives its shard from every rank (`all_to_all_single`, a reduce-scatter), dequantizes and sums them in
float32, requantizes its summed shard and all-gathers it; every rank dequantizes the same int8 result,
so the anchors stay identical everywhere. The control slots after the payload travel exactly, in a
small float32 all-reduce. Bytes one rank sends per outer all-reduce (`int8_bytes`), with n ranks, S the
shard length (`shard_length`: whole blocks, n shards covering the payload) and c control slots:

    2 (n − 1) (S + 4 S / BLOCK)  +  2 (n − 1) / n · 4 c

(the all-to-all sends n − 1 encoded shards, a ring all-gather n − 1 more, and the control all-reduce
is counted as a ring's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

BLOCK = 256  # values per int8 scale: the scales cost 4 / BLOCK bytes per value
WIRES = ("float32", "int8")


def quantize(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Int8 codes and float32 scales of the 1-D float tensor `x`, one scale per `block` values.

    A block's scale is its largest magnitude / 127 (0 for an all-zero block) and a code is
    round(value / scale), so `dequantize` returns every value within scale / 2 of it. Raises
    `ValueError` if len(x) is not a multiple of `block`. A non-finite value makes its block non-finite.
    """
    if x.dim() != 1 or len(x) % block:
        raise ValueError(
            f"quantize needs a 1-D tensor whose length is a multiple of {block}, got shape {tuple(x.shape)}"
        )
    blocks = x.detach().float().view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block codes to zeros
    codes = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values that `quantize` coded as `codes` with `scales`."""
    return (codes.view(len(scales), -1).float() * scales[:, None]).view(-1)


def _encode(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each row of `x` (parts × length) as one int8 row: its codes, then its scales' bytes."""
    codes, scales = quantize(x.reshape(-1), block)
    rows = len(x)
    return torch.cat([codes.view(rows, -1), scales.view(rows, -1).view(torch.int8)], dim=1)


def _decode(rows: torch.Tensor, length: int) -> torch.Tensor:
    """The float32 values (parts × length) of rows made by `_encode`."""
    codes = rows[:, :length].contiguous().view(-1)
    scales = rows[:, length:].contiguous().view(torch.float32).view(-1)
    return dequantize(codes, scales).view(len(rows), length)


def shard_length(numel: int, n: int, block: int = BLOCK) -> int:
    """Each rank's shard of a `numel`-value payload over `n` ranks: whole blocks, n shards covering it."""
    return max(1, math.ceil(numel / (n * block))) * block


def int8_bytes(numel: int, control: int, n: int, block: int = BLOCK) -> int:
    """Bytes one rank sends in one `all_reduce_int8` of `numel` values and `control` slots (module docstring)."""
    s = shard_length(numel, n, block)
    return int(2 * (n - 1) * (s + 4 * s // block) + 2 * (n - 1) / n * 4 * control)


def all_reduce_int8(flat: torch.Tensor, numel: int, block: int = BLOCK) -> None:
    """Sum `flat` over the default group in place: flat[:numel] over the int8 wire, flat[numel:] exactly.

    Collective: every rank must call it with the same `numel` and length. Each value of the result
    is within the quantization error of the true sum (the inputs' errors plus one requantization), and
    is the same on every rank. Raises what the collectives raise (e.g. a timeout).
    """
    n = dist.get_world_size()
    s = shard_length(numel, n, block)
    padded = torch.zeros(n * s)
    padded[:numel] = flat[:numel]
    send = _encode(padded.view(n, s), block)  # row j goes to rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received.view(-1), send.view(-1))  # row i: my shard from rank i
    mine = _decode(received, s).sum(dim=0)
    gathered = torch.empty_like(send)
    dist.all_gather(list(gathered.unbind(0)), _encode(mine.view(1, s), block)[0])
    flat[:numel] = _decode(gathered, s).view(-1)[:numel]
    control = flat[numel:].clone()
    dist.all_reduce(control)
    flat[numel:] = control


class Outer:
    """DiLoCo's shared anchor and its outer Nesterov optimizer (a plain SGD step when `momentum` is 0)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], lr: float, momentum: float) -> None:
        self.anchor = [p.detach().clone().requires_grad_(True) for p in params]
        self.optimizer = torch.optim.SGD(self.anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)

    @torch.no_grad()
    def pseudo_gradient(self, params: Sequence[torch.nn.Parameter], flat: torch.Tensor, weight: float) -> None:
        """Write `weight` × (anchor − parameters) into the front of `flat`."""
        offset = 0
        for a, p in zip(self.anchor, params):
            flat[offset : offset + p.numel()].copy_(a.reshape(-1)).sub_(p.reshape(-1)).mul_(weight)
            offset += p.numel()

    @torch.no_grad()
    def step(self, params: Sequence[torch.nn.Parameter], flat: torch.Tensor, total_weight: float) -> None:
        """Step the anchor by the reduced pseudo-gradients in `flat` / `total_weight`; restart `params` from it."""
        offset = 0
        for a in self.anchor:
            a.grad = (flat[offset : offset + a.numel()] / total_weight).view_as(a).to(a.dtype)
            offset += a.numel()
        self.optimizer.step()
        for a, p in zip(self.anchor, params):
            p.copy_(a)
