"""Training driven by the user's own loop (`murmur.Peer`): the user's thread owns the model.

`murmur run` steps the model itself; here the user's loop does, on a thread Murmur does
not control. Every other access to the model (a snapshot for an exchange, a merge, state
sync, a checkpoint) is handed to that thread through a `StepGate` and runs at its next
`peer.step()`, between two of the user's steps, so nothing reads or writes a half-updated
model. `UserLoopTrainer` is the ordinary `Trainer` with its model work routed that way
and its work counted by `record` instead of by its own steps.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from torch import nn

from murmur.node.learn.rules import MergeRule
from murmur.node.learn.tasks import Batch, Metric
from murmur.node.learn.trainer import Evaluation, Snapshot, Trainer

T = TypeVar("T")
log = logging.getLogger("murmur.peer")


class ModelMismatch(ValueError):
    """The user's model is not the run's: another architecture or parameter set (by fingerprint); the message says why."""


class ForeignOptimizer(ValueError):
    """The optimizer does not own the model's parameters (e.g. built for another copy of the model)."""


class StepGate:
    """Runs other threads' model work on the owner thread, at the owner's `serve()` calls.

    While parked (before the user's loop starts and after it ends) `call` runs the work at
    once on the calling thread, one call at a time. While open, `call` queues the work and
    blocks its (worker) thread until the owner's next `serve()` has run it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards `_parked` and `_queue`; taken before `_model`
        self._model = threading.Lock()  # held by a direct call while parked
        self._queue: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()
        self._parked = True

    def call(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` run where it is safe to touch the model; returns its result or raises its error."""
        with self._lock:
            if not self._parked:
                future: Future[T] = Future()
                self._queue.append((func, args, future))
            else:
                self._model.acquire()  # under `_lock`: `open` cannot slip in between
                future = None  # type: ignore[assignment]
        if future is not None:
            return future.result()  # no timeout: `park` runs whatever is still queued
        try:
            return func(*args)
        finally:
            self._model.release()

    def pending(self) -> int:
        """How many calls wait for the owner."""
        with self._lock:
            return len(self._queue)

    def serve(self) -> int:
        """Owner thread: run the work queued so far (not work queued meanwhile); returns how many ran."""
        with self._lock:
            batch = [self._queue.popleft() for _ in range(len(self._queue))]
        for func, args, future in batch:
            try:
                future.set_result(func(*args))
            except BaseException as exc:  # handed to the waiting thread, which raises it
                future.set_exception(exc)
        return len(batch)

    def open(self) -> None:
        """Owner thread: its loop starts; from now on work waits for `serve` (after direct calls in flight end)."""
        with self._lock, self._model:
            self._parked = False

    def park(self) -> None:
        """Owner thread: its loop has ended; run what is queued, and run later calls directly."""
        while True:
            self.serve()
            with self._lock:
                if not self._queue:
                    self._parked = True
                    return


class UserLoopTask:
    """The `Task` face of a user's model: its name labels the fingerprint; Murmur never trains or evaluates it."""

    metric = Metric("loss", higher_is_better=False)
    batch_size = 1  # unused: the user's loop picks its batches

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.name = name
        self._model = model
        self._optimizer = optimizer

    def build_model(self) -> nn.Module:
        return self._model

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self._optimizer

    def train_batches(self, shard: int) -> Iterator[Batch]:
        return iter(())

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError("the user's loop computes the loss")

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {}


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise `ForeignOptimizer` unless `optimizer` steps only `model`'s parameters, and at least one."""
    own = {id(p) for p in model.parameters()}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(id(p) not in own for p in stepped)
    if foreign:
        raise ForeignOptimizer(
            f"the optimizer steps {foreign} of {len(stepped)} parameters that are not this model's "
            "(was it built for another copy of the model?)"
        )
    if not stepped:
        raise ForeignOptimizer("the optimizer steps none of the model's parameters")


def model_device(model: nn.Module) -> torch.device:
    """The one device `model`'s tensors are on; raises `ValueError` if they are spread over several."""
    devices = {t.device for t in model.state_dict().values()}
    if len(devices) != 1:
        raise ValueError(f"the model's tensors are on {len(devices)} devices ({sorted(map(str, devices))}); Murmur needs one")
    return devices.pop()


class UserLoopTrainer(Trainer):
    """A `Trainer` whose steps are the user's: model work goes through `gate`, work is counted by `record`."""

    def __init__(self, task: UserLoopTask, *, rule: MergeRule, gate: StepGate, mixed_precision: bool = False) -> None:
        self.gate = gate
        super().__init__(task, shard=0, device=model_device(task.build_model()), mixed_precision=mixed_precision, rule=rule)

    def step(self) -> float:
        raise RuntimeError("a user-loop trainer is stepped by the user's loop; call `record` after each step")

    def record(self, work: int, loss: float | None = None) -> None:
        """Count `work` samples (or tokens) of the user's step that just ended; owner thread."""
        with self._lock:
            self.samples += work
            self.weight += work
            self.fresh += work
            if loss is not None:
                self.last_loss = loss

    def snapshot(self, wire_dtype: str = "float32") -> Snapshot:
        return self.gate.call(super().snapshot, wire_dtype)

    def merge(self, snapshot: Snapshot, remote: Any, share: float, weight_after: float) -> None:
        self.gate.call(super().merge, snapshot, remote, share, weight_after)

    def adopt(self, state: Any, weight: float) -> None:
        self.gate.call(super().adopt, state, weight)

    def checkpoint_state(self) -> dict:
        return self.gate.call(super().checkpoint_state)

    def restore(self, state: dict) -> None:
        self.gate.call(super().restore, state)

    def evaluate(self) -> Evaluation:
        raise RuntimeError("a user-loop trainer is evaluated by the user's loop")
