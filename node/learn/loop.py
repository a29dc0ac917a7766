"""The built-in training loop: a task's batches stepped into its replica from a worker thread.

`TrainingLoop` owns a task and the replica of its model: `step` takes one batch through
`train_step` under the replica's lock, `evaluate` scores a copy of the model while training
goes on. `train` is the async loop that runs steps on a worker thread at this peer's own
pace (`Pacing`: emulated slowdowns sleep on the event loop), so the network never waits for torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import torch
from torch import nn

from murmur.node.learn.deltas import Compression
from murmur.node.learn.device import check_mixed_precision, to_device
from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import MergeRule
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.step import Pacing, train_step
from murmur.node.learn.tasks import Task


@dataclass(frozen=True)
class Evaluation:
    """Held-out metrics of the model as it was at Unix time `t`, with `samples` of this peer's own work in it."""

    t: float
    samples: int
    work: float
    metrics: dict[str, float]


class TrainingLoop:
    """A task's batches stepped into its replica, and evaluations of that replica's model."""

    def __init__(
        self, task: Task, shard: int, device: str | torch.device = "cpu", mixed_precision: bool = False,
        *, rule: MergeRule | None = None, runtime: Runtime = Runtime(), ema_decay: float = 0.0,
        compression: Compression | None = None,
    ) -> None:
        """Build `task`'s model on `device` (an explicit one: see `murmur.node.learn.device.resolve_device`)
        and its replica (`rule`, `ema_decay`, `compression`: see `Replica`), to train on data shard `shard`.

        `mixed_precision` runs the forward pass and loss under bf16 autocast (parameters and
        optimizer state stay in their own dtype); raises `DeviceError` where that is refused.
        `runtime` gives the loop's clocks and worker threads; its wall clock stamps evaluations.
        """
        device = torch.device(device)
        if mixed_precision:
            check_mixed_precision(device)
        self.task = task
        self.mixed_precision = mixed_precision
        self.runtime = runtime
        model = task.build_model().to(device)
        self.replica = Replica(task.name, model, task.make_optimizer(model), rule=rule, ema_decay=ema_decay,
                               compression=compression)
        self._batches = task.train_batches(shard)
        self._eval_lock = threading.Lock()  # one evaluation at a time owns `_eval_model`
        self._eval_model: nn.Module | None = None

    def step(self) -> float:
        """Run one training step on the next batch; return its compute time in seconds (lock wait excluded)."""
        batch = to_device(next(self._batches), self.replica.device)
        task, mixed = self.task, self.mixed_precision
        return self.replica.step(lambda model, optimizer: train_step(task, model, optimizer, batch, mixed_precision=mixed), len(batch[0]))

    def evaluate(self) -> Evaluation:
        """The task's held-out metrics for the model as it is now (its weight average, if it keeps one).

        Scores a copy kept for this (see `Replica.copy_model`), so it never pauses `step` or a
        merge. Stamped when the model was copied: on a busy machine the score may come much later.
        """
        with self._eval_lock:
            copied = self.replica.copy_model(self._eval_model)
            t = self.runtime.wall()  # just copied: not after waiting for the lock, nor after scoring
            self._eval_model = copied.model
            return Evaluation(t, copied.samples, copied.work, self.task.evaluate(copied.model))


@dataclass
class TrainStats:
    """What the training loop did; `busy_s` includes emulated (padded) compute."""

    started: float | None = None
    ended: float | None = None
    steps: int = 0
    busy_s: float = 0.0
    eval_s: float = 0.0  # spent evaluating, alongside training

    def elapsed(self, now: float) -> float:
        """Seconds of training so far (the loop's lifetime, not the process's)."""
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else now) - self.started

    def compute_fraction(self, now: float) -> float:
        elapsed = self.elapsed(now)
        return self.busy_s / elapsed if elapsed > 0 else 0.0


async def train(
    loop: TrainingLoop,
    pacing: Pacing,
    stats: TrainStats,
    *,
    eval_every: float,
    on_eval: Callable[[Evaluation], None],
    max_steps: int | None = None,
) -> None:
    """Train until cancelled (or `max_steps`), evaluating every `eval_every` seconds alongside.

    Never waits for another peer nor for its own evaluation: the only pauses are
    merges applied between steps. Clocks and worker threads come from `loop.runtime`.
    """
    clock = loop.runtime.monotonic
    stats.started = clock()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_evaluate_periodically, loop, stats, eval_every, on_eval)
        try:
            await _step(loop, pacing, stats, max_steps)
        finally:
            stats.ended = clock()  # not waiting for an evaluation in flight
        tg.cancel_scope.cancel()


async def _step(loop: TrainingLoop, pacing: Pacing, stats: TrainStats, max_steps: int | None) -> None:
    device_free = anyio.current_time()  # when the emulated device finishes the step it holds (the event loop's clock)
    while max_steps is None or stats.steps < max_steps:
        start = pacing.step_start(anyio.current_time(), device_free)
        compute = await loop.runtime.run_sync(loop.step)
        duration = pacing.step_duration(compute, anyio.current_time() - start, loop.task.batch_size)
        device_free = start + duration
        await anyio.sleep_until(device_free)
        stats.steps += 1
        stats.busy_s += duration


async def _evaluate_periodically(
    loop: TrainingLoop, stats: TrainStats, eval_every: float, on_eval: Callable[[Evaluation], None]
) -> None:
    clock = loop.runtime.monotonic
    next_eval = clock()
    while True:
        await anyio.sleep(max(0.0, next_eval - clock()))
        start = clock()
        on_eval(await loop.runtime.run_sync(loop.evaluate))
        stats.eval_s += clock() - start
        next_eval = max(next_eval + eval_every, clock())  # skip grid points we missed
