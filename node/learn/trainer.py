"""The local trainer: a task's model, optimizer and data, stepped from a worker thread.

`Trainer` is synchronous and thread-safe: `step`, `snapshot`, `merge` and `adopt`
each hold one lock, so merges land between steps and never tear a step; `evaluate`
holds it only to copy the model, then scores the copy while training goes on.
The model and its batches live on the trainer's device; snapshots and checkpoints are
CPU copies, and merged or adopted tensors may come from any device and float dtype.
`train` is the async loop that runs steps on a worker thread at this peer's own pace
(emulated slowdowns sleep on the event loop), so the network never waits for torch.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import anyio
import torch

from murmur.node.learn.device import check_mixed_precision, cpu_copy, to_device
from murmur.node.learn.rules import MergeRule, WorkRule
from murmur.node.learn.runtime import Runtime
from murmur.node.learn.step import Pacing, train_step
from murmur.node.learn.tasks import Task
from murmur.node.learn.tensors import ExchangedTensors
from murmur.node.learn.weight_average import WeightAverage
from murmur.protocol.codec import TensorSpec, WireState, pieces, quantize


@dataclass(frozen=True)
class Snapshot:
    """A CPU copy of the model's exchanged tensors in a wire dtype, and the work weight they carry.

    `state[name]` reads a tensor as CPU float32 (see `WireState`). `fresh` is the part of
    `weight` this peer trained itself since its model last merged (or was adopted).
    """

    state: WireState
    weight: float
    fresh: float = 0.0


@dataclass(frozen=True)
class Evaluation:
    """Held-out metrics of the model as it was at Unix time `t`, with `samples` of this peer's own work in it."""

    t: float
    samples: int
    weight: float
    metrics: dict[str, float]


@contextlib.contextmanager
def _flat(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A flat view of `tensor` to update in place (via a copy written back if it is not contiguous)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    yield flat
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


class Trainer:
    def __init__(
        self, task: Task, shard: int, device: str | torch.device = "cpu", mixed_precision: bool = False,
        *, rule: MergeRule | None = None, runtime: Runtime = Runtime(), ema_decay: float = 0.0,
    ) -> None:
        """Build `task`'s model on `device` (an explicit one: see `murmur.node.learn.device.resolve_device`).

        `mixed_precision` runs the forward pass and loss under bf16 autocast (parameters and
        optimizer state stay in their own dtype); raises `DeviceError` where that is refused.
        `rule` (default `work`) merges this model with partners'; the trainer owns it, so
        its state is checkpointed with the model. `runtime.wall` stamps evaluations.
        `ema_decay` > 0 evaluates (and checkpoints) an average of the parameters over the last
        ~1/(1 − decay) steps instead of the live model (`WeightAverage`); raises `ValueError` outside [0, 1).
        """
        self.task = task
        self.device = torch.device(device)
        if mixed_precision:
            check_mixed_precision(self.device)
        self.mixed_precision = mixed_precision
        self.model = task.build_model().to(self.device)
        self.optimizer = task.make_optimizer(self.model)
        self.average = WeightAverage(self.model, ema_decay)
        self.rule = rule if rule is not None else WorkRule()
        self.runtime = runtime
        self.exchanged = ExchangedTensors(self.model, self.optimizer, self.rule.optimizer_state)
        self.rule.reset(self.exchanged)  # a stateful rule starts from the initial model
        self.spec = TensorSpec.of(self.exchanged)
        self.architecture = " ".join(type(m).__name__ for m in self.model.modules())
        self._batches = task.train_batches(shard)
        self._lock = threading.Lock()
        self._eval_lock = threading.Lock()  # one evaluation at a time owns `_eval_model`
        self._eval_model: torch.nn.Module | None = None
        self.samples = 0  # samples this peer processed itself
        self.weight = 0.0  # work weight of the current model (shared through merges)
        self.fresh = 0.0  # samples trained since the model last merged: the merge rule's staleness measure
        self.last_loss = math.nan

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint(f"{self.task.name}|{self.architecture}")

    def step(self) -> float:
        """Run one training step; return its compute time in seconds (lock wait excluded)."""
        batch = to_device(next(self._batches), self.device)
        with self._lock:
            start = time.perf_counter()
            loss = train_step(self.task, self.model, self.optimizer, batch, mixed_precision=self.mixed_precision)
            self.average.update(self.model)
            n = len(batch[0])
            self.samples += n
            self.weight += n
            self.fresh += n
            self.last_loss = loss.item()  # also waits for the GPU, so the time below is the step's real compute
            return time.perf_counter() - start

    def snapshot(self, wire_dtype: str = "float32") -> Snapshot:
        """A CPU copy of the exchanged tensors in `wire_dtype`, the form they travel in.

        Partners' models arrive in the same wire dtype, so screening and merge deltas
        compare like with like whatever this model's device or dtype.
        """
        with self._lock:
            return Snapshot(quantize(self.exchanged, self.spec, wire_dtype), self.weight, self.fresh)

    def merge(self, snapshot: Snapshot, remote: Mapping[str, torch.Tensor], share: float, weight_after: float) -> None:
        """Apply a committed merge: add the rule's delta to the live tensors, piece by piece,
        and move the weight by the merge's change (steps taken since `snapshot` are kept, and stay fresh)."""
        with self._lock, torch.no_grad():
            delta = self.rule.delta(snapshot.state, remote, share)
            for name in delta:
                with _flat(self.exchanged[name]) as flat:
                    for elements, change in delta.pieces(name):
                        flat[elements].add_(change.to(flat.device, flat.dtype))
            self.weight += weight_after - snapshot.weight
            self.fresh -= snapshot.fresh

    def adopt(self, state: Mapping[str, torch.Tensor], weight: float) -> None:
        """Replace the exchanged tensors with `state` (state sync; any device, float dtype).

        Optimizer state that does not travel is kept; the merge rule starts over from the new model.
        """
        with self._lock, torch.no_grad():
            for name in state:
                with _flat(self.exchanged[name]) as flat:
                    for elements, piece in pieces(state, name):
                        flat[elements].copy_(piece.to(flat.device, flat.dtype))
            self.weight = weight
            self.fresh = 0.0
            self.rule.reset(self.exchanged)
            self.average.reset(self.model)  # the swarm's model replaced this one's past

    def checkpoint_state(self) -> dict:
        """Everything needed to resume: model, optimizer, work weight and counters, as CPU tensors.

        CPU copies keep a checkpoint loadable on any machine: a GPU node's resumes on a CPU one.
        """
        with self._lock:
            return {
                "fingerprint": self.fingerprint,
                "model": cpu_copy(self.model.state_dict()),
                "optimizer": cpu_copy(self.optimizer.state_dict()),
                "weight": self.weight,
                "samples": self.samples,
                "fresh": self.fresh,
                "merge_rule": {"name": self.rule.name, "state": self.rule.state_dict()},
                # the model to use: a complete state dict, loadable as is (absent when no average is kept)
                **({"weight_average": cpu_copy(self.average.averaged(self.model))} if self.average.decay else {}),
            }

    def restore(self, state: dict) -> None:
        """Resume from `checkpoint_state()` output; raises `ValueError` for another task's.

        Tensors are copied onto this model's device and dtype (the optimizer's state follows its parameters).
        The merge rule's state is restored when the checkpoint holds this rule's; after a change of
        rule (or from a checkpoint without one) the rule starts over from the restored model. So does the
        weight average, unless the checkpoint holds one that fits this model.
        """
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError("checkpoint belongs to another task or model (fingerprint differs)")
        rule = state.get("merge_rule")
        with self._lock:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.exchanged = ExchangedTensors(self.model, self.optimizer, self.rule.optimizer_state)
            if rule is not None and rule["name"] == self.rule.name:
                self.rule.load_state_dict(rule["state"])
                self.fresh = float(state.get("fresh", 0.0))  # older checkpoints: as if just merged
            else:
                self.rule.reset(self.exchanged)
                self.fresh = 0.0
            self.average.load_averaged(state.get("weight_average", {}), self.model)
            self.weight = float(state["weight"])
            self.samples = int(state["samples"])

    def evaluate(self) -> Evaluation:
        """The task's held-out metrics for the model as it is now (its weight average, if it keeps one).

        Only copying the model (into a second instance kept for this) holds the lock; the
        held-out pass runs on the copy, so it never pauses `step` or a merge.
        """
        with self._eval_lock:
            with self._lock:
                if self._eval_model is None:
                    self._eval_model = copy.deepcopy(self.model)
                self._eval_model.load_state_dict(self.average.averaged(self.model))
                copied = (self.runtime.wall(), self.samples, self.weight)
            return Evaluation(*copied, self.task.evaluate(self._eval_model))


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
    trainer: Trainer,
    pacing: Pacing,
    stats: TrainStats,
    *,
    eval_every: float,
    on_eval: Callable[[Evaluation], None],
    max_steps: int | None = None,
) -> None:
    """Train until cancelled (or `max_steps`), evaluating every `eval_every` seconds alongside.

    Never waits for another peer nor for its own evaluation: the only pauses are
    merges applied between steps. Clocks and worker threads come from `trainer.runtime`.
    """
    clock = trainer.runtime.monotonic
    stats.started = clock()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_evaluate_periodically, trainer, stats, eval_every, on_eval)
        try:
            await _step(trainer, pacing, stats, max_steps)
        finally:
            stats.ended = clock()  # not waiting for an evaluation in flight
        tg.cancel_scope.cancel()


async def _step(trainer: Trainer, pacing: Pacing, stats: TrainStats, max_steps: int | None) -> None:
    device_free = anyio.current_time()  # when the emulated device finishes the step it holds (the event loop's clock)
    while max_steps is None or stats.steps < max_steps:
        start = pacing.step_start(anyio.current_time(), device_free)
        compute = await trainer.runtime.run_sync(trainer.step)
        duration = pacing.step_duration(compute, anyio.current_time() - start, trainer.task.batch_size)
        device_free = start + duration
        await anyio.sleep_until(device_free)
        stats.steps += 1
        stats.busy_s += duration


async def _evaluate_periodically(
    trainer: Trainer, stats: TrainStats, eval_every: float, on_eval: Callable[[Evaluation], None]
) -> None:
    clock = trainer.runtime.monotonic
    next_eval = clock()
    while True:
        await anyio.sleep(max(0.0, next_eval - clock()))
        start = clock()
        on_eval(await trainer.runtime.run_sync(trainer.evaluate))
        stats.eval_s += clock() - start
        next_eval = max(next_eval + eval_every, clock())  # skip grid points we missed
