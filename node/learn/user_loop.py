"""Training driven by the user's own loop (`murmur.Peer`): the user's thread owns the replica.

`murmur run` steps the model itself (`murmur.node.learn.loop`); here the user's loop does,
on a thread Murmur does not control. Every other access to the model (a snapshot for an
exchange, a merge, state sync, a checkpoint) is handed to that thread through a `StepGate`,
the replica's `access`, and runs at its next `peer.step()`, between two of the user's steps,
so nothing reads or writes a half-updated model. The user's steps count their work with
`Replica.record`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch
from torch import nn

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

