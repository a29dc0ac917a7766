"""The `Task` interface: what a peer trains, on which data, and how it is judged.

A task is chosen by name (`--task digits`) or by `package.module:factory` for user
code. Every peer of one run must build an identical initial model, so `build_model`
seeds its own initialisation; each peer draws its own data stream from `shard`.
"""

from __future__ import annotations

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


def load_task(spec: str) -> Task:
    """Build the task named `spec`: a built-in name or `package.module:factory`.

    Raises `UnknownTask` naming the spec when it cannot be resolved.
    """
    from murmur.node.learn.tasks import BUILTIN_TASKS

    if spec in BUILTIN_TASKS:
        return BUILTIN_TASKS[spec]()
    if ":" not in spec:
        raise UnknownTask(f"unknown task {spec!r}; built-ins: {sorted(BUILTIN_TASKS)}")
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[], Task] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownTask(f"cannot load task {spec!r}: {exc}") from exc
    return factory()
