"""One training step, and the pace of an emulated device.

`train_step` is the only forward/backward/step in Murmur: the node's training loop, the
synchronous baselines and the per-sample lab (`lab/replicas.py`) all call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from murmur.node.learn.device import autocast
from murmur.node.learn.tasks import Batch, Task

# The event loop's timers wake up to ~1-2 ms late (epoll timeouts are whole milliseconds);
# a real device would already hold the next step by then, so such lateness is not idle time.
TIMER_SLACK_S = 0.002
REFERENCE_BATCH = 32  # `Pacing.step_time_ms` is per this many samples


def train_step(
    task: Task,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    *,
    mixed_precision: bool = False,
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Forward, backward and one optimizer step on `batch`; returns the loss (a tensor).

    `mixed_precision` runs forward and loss under bf16 autocast on the model's device.
    `before_update` runs between backward and the optimizer step: a synchronous
    baseline all-reduces the gradients there. Reading the loss (`.item()`) waits for
    the device, so callers that time the step read it before stopping the clock.
    """
    model.train()
    device = next(model.parameters()).device
    with autocast(device, mixed_precision):
        loss = task.loss(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if before_update is not None:
        before_update()
    optimizer.step()
    return loss


def scale_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every parameter group's learning rate by `factor` (a replica learning-rate rule, a sweep point)."""
    if not factor > 0:
        raise ValueError(f"a learning-rate scale must be positive, got {factor}")
    for group in optimizer.param_groups:
        group["lr"] *= factor


@dataclass(frozen=True)
class Pacing:
    """Emulated hardware speed.

    `slowdown` S: after each step, sleep (S − 1) × its measured compute time.
    With `step_time_ms` M, instead pad each step to S × M ms of wall time per 32
    samples (the step's own overheads are absorbed by the padding).
    """

    slowdown: float = 1.0
    step_time_ms: float | None = None

    def step_duration(self, compute_s: float, elapsed_s: float, batch_size: int) -> float:
        """How long this step should occupy the emulated device, in seconds."""
        if self.step_time_ms is None:
            return elapsed_s + (self.slowdown - 1) * compute_s
        return max(elapsed_s, self.slowdown * self.step_time_ms / 1000 * batch_size / REFERENCE_BATCH)

    def padding(self, compute_s: float, batch_size: int) -> float:
        """Seconds to wait after a step that computed for `compute_s` (never negative)."""
        return max(0.0, self.step_duration(compute_s, compute_s, batch_size) - compute_s)

    @staticmethod
    def step_start(now: float, device_free: float) -> float:
        """When the step the host launches at `now` starts on the device, busy until `device_free`.

        A host late by at most `TIMER_SLACK_S` continues the device's schedule; a longer
        gap (an evaluation, a lock held by a merge) is idle time.
        """
        return device_free if now - device_free <= TIMER_SLACK_S else now
