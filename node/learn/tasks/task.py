"""The `Task` interface: what a peer trains, on which data, and how it is judged.

A task is chosen by name (`--task digits`) or by `package.module:factory` for user
code. Every peer of one run must build an identical initial model, so `build_model`
seeds its own initialisation; each peer draws its own data stream from `shard`.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Metric:
    """The held-out metric a task reports; `higher_is_better` orders it."""

    name: str
    higher_is_better: bool

    def reached(self, value: float, target: float) -> bool:
        """Whether `value` is at `target` or beyond it, in this metric's order."""
        return value >= target if self.higher_is_better else value <= target


class Task(Protocol):
    name: str
    metric: Metric
    batch_size: int

    def build_model(self) -> nn.Module:
        """Return the initial model; identical on every peer (seeded inside)."""

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Return the optimizer every peer of this task uses."""

    def train_batches(self, shard: int) -> Iterator[Batch]:
        """Yield training batches forever; `shard` seeds this peer's own order."""

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Return the scalar training loss of `model` on `batch`."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Return held-out metrics, including `metric.name`, on a fixed split."""


class UnknownTask(ValueError):
    """The task name or `module:factory` path names nothing loadable."""


# What `load_task` checks a user's factory returned: enough to tell a task from some other object.
_TASK_ATTRIBUTES = ("name", "metric", "batch_size", "build_model", "make_optimizer", "train_batches", "loss", "evaluate")


def check_task_name(spec: str) -> str:
    """`spec` if it can name a task (a built-in name, or any `package.module:factory`, loaded later);
    else raises `UnknownTask` with the closest built-in name and the list of them."""
    from murmur.node.learn.tasks import BUILTIN_TASKS

    if spec in BUILTIN_TASKS or ":" in spec:
        return spec
    close = difflib.get_close_matches(spec, BUILTIN_TASKS, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise UnknownTask(f"unknown task {spec!r}: {hint}tasks: {', '.join(BUILTIN_TASKS)}, or package.module:factory for your own")


def load_task(spec: str) -> Task:
    """Build the task named `spec`: a built-in name or `package.module:factory`.

    Raises `UnknownTask`, naming the spec, when it names no built-in task (suggesting the closest),
    no importable factory, or a factory whose result is not a task. The factory's own errors propagate.
    """
    from murmur.node.learn.tasks import BUILTIN_TASKS

    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]()
    check_task_name(spec)
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[], Task] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownTask(f"cannot load task {spec!r}: {exc}") from exc
    if not callable(factory):
        raise UnknownTask(f"{spec!r} is not a task factory: {module_name}.{attr} is a {type(factory).__name__}, not callable")
    task = factory()
    missing = [name for name in _TASK_ATTRIBUTES if not hasattr(task, name)]
    if missing:
        raise UnknownTask(f"{spec!r} is not a task factory: {module_name}.{attr}() returned a {type(task).__name__}, "
                          f"which lacks {', '.join(missing)} (see murmur.node.learn.tasks.Task)")  # fmt: skip
    return task
