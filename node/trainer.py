"""The local trainer: a task's model, optimizer and data, stepped from a worker thread.

`Trainer` is synchronous and thread-safe: `step`, `snapshot`, `apply_merge`, `adopt`
and `evaluate` each hold one lock, so merges land between steps and never tear a step.
`train` is the async loop that runs steps on a worker thread at this peer's own pace
(emulated slowdowns sleep on the event loop), so the network never waits for torch.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import torch

from node.tasks import Task
from protocol.codec import TensorSpec


@dataclass(frozen=True)
class Snapshot:
    """A copy of the model's exchanged tensors and the work weight they carry."""

    state: dict[str, torch.Tensor]
    weight: float


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
        return max(elapsed_s, self.slowdown * self.step_time_ms / 1000 * batch_size / 32)


class Trainer:
    def __init__(self, task: Task, shard: int, device: str = "cpu") -> None:
        self.task = task
        self.model = task.build_model().to(device)
        self.optimizer = task.make_optimizer(self.model)
        self.spec = TensorSpec.of(self.model.state_dict())
        self.architecture = " ".join(type(m).__name__ for m in self.model.modules())
        self._batches = task.train_batches(shard)
        self._lock = threading.Lock()
        self._live = {n: t for n, t in self.model.state_dict().items() if n in dict(self.spec.entries)}
        self.samples = 0  # samples this peer processed itself
        self.weight = 0.0  # work weight of the current model (shared through merges)
        self.last_loss = math.nan

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint(f"{self.task.name}|{self.architecture}")

    def step(self) -> float:
        """Run one training step; return its compute time in seconds (lock wait excluded)."""
        batch = next(self._batches)
        with self._lock:
            start = time.perf_counter()
            self.model.train()
            loss = self.task.loss(self.model, batch)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            n = len(batch[0])
            self.samples += n
            self.weight += n
            self.last_loss = loss.item()
            return time.perf_counter() - start

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot({n: t.detach().clone() for n, t in self._live.items()}, self.weight)

    def apply_merge(self, delta: Mapping[str, torch.Tensor], snapshot_weight: float, weight_after: float) -> None:
        """Add `delta` to the live model and move the weight by the merge's change."""
        with self._lock, torch.no_grad():
            for name, change in delta.items():
                self._live[name].add_(change.to(self._live[name].device, self._live[name].dtype))
            self.weight += weight_after - snapshot_weight

    def adopt(self, state: Mapping[str, torch.Tensor], weight: float) -> None:
        """Replace the model with `state` (state sync); the optimizer state is kept."""
        with self._lock, torch.no_grad():
            for name, tensor in state.items():
                self._live[name].copy_(tensor)
            self.weight = weight

    def checkpoint_state(self) -> dict:
        """Everything needed to resume: model, optimizer, work weight and counters."""
        with self._lock:
            return {
                "fingerprint": self.fingerprint,
                "model": {n: t.detach().clone() for n, t in self.model.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()),
                "weight": self.weight,
                "samples": self.samples,
            }

    def restore(self, state: dict) -> None:
        """Resume from `checkpoint_state()` output; raises `ValueError` for another task's."""
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("checkpoint belongs to another task or model (fingerprint differs)")
        with self._lock:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.weight = float(state["weight"])
            self.samples = int(state["samples"])

    def evaluate(self) -> dict[str, float]:
        with self._lock:
            return self.task.evaluate(self.model)


@dataclass
class TrainStats:
    """What the training loop did; `busy_s` includes emulated (padded) compute."""

    started: float | None = None
    ended: float | None = None
    steps: int = 0
    busy_s: float = 0.0
    eval_s: float = 0.0

    def elapsed(self, now: float) -> float:
        """Seconds of training so far (the loop's lifetime, not the process's)."""
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else now) - self.started

    def compute_fraction(self, now: float) -> float:
        elapsed = self.elapsed(now)
        return self.busy_s / elapsed if elapsed > 0 else 0.0


async def train(
    trainer: Trainer,
    pacing: Pacing,
    stats: TrainStats,
    *,
    eval_every: float,
    on_eval: Callable[[dict[str, float]], None],
    max_steps: int | None = None,
) -> None:
    """Train until cancelled (or `max_steps`), evaluating every `eval_every` seconds.

    Never waits for another peer: the only pauses are this peer's own evaluation
    and merges applied between steps.
    """
    stats.started = next_eval = time.monotonic()
    try:
        while max_steps is None or stats.steps < max_steps:
            if time.monotonic() >= next_eval:
                start = time.monotonic()
                on_eval(await anyio.to_thread.run_sync(trainer.evaluate))
                stats.eval_s += time.monotonic() - start
                next_eval = max(next_eval + eval_every, time.monotonic())  # skip grid points we missed
            start = anyio.current_time()  # the event loop's clock, which `sleep_until` uses
            compute = await anyio.to_thread.run_sync(trainer.step)
            duration = pacing.step_duration(compute, anyio.current_time() - start, trainer.task.batch_size)
            await anyio.sleep_until(start + duration)
            stats.steps += 1
            stats.busy_s += duration
    finally:
        stats.ended = time.monotonic()
