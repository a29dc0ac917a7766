"""`digits`: a small MLP on the UCI 8x8 handwritten digits, shipped with the package (`data/`).

The spec is fixed so results can be compared with measurements made elsewhere:
inputs are pixel values / 16 as float32; the split is
`numpy.random.RandomState(0).permutation(1797)` with the first 20% (360 samples)
held out, which is exactly `train_test_split(test_size=0.2, random_state=0)`;
the model is Linear(64, 128) -> ReLU -> Linear(128, 10); SGD lr 0.05 momentum 0.9;
batch size 32.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from murmur.node.learn.tasks.task import Batch, Metric

SPLIT_SEED = 0
EVAL_FRACTION = 0.2
INIT_SEED = 0


DATA = Path(__file__).resolve().parent / "data" / "digits.csv.gz"


def load_digits_data() -> tuple[np.ndarray, np.ndarray]:
    """The digits as (data 1797x64 float, target int): the rows of `sklearn.datasets.load_digits()`."""
    table = np.loadtxt(DATA, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


@lru_cache(maxsize=1)
def _split() -> tuple[Batch, Batch]:
    """Return ((x_train, y_train), (x_eval, y_eval)); cached so tasks share one copy."""
    data, target = load_digits_data()
    x = torch.from_numpy(data / 16.0).float()
    y = torch.from_numpy(target).long()
    n = len(y)
    order = torch.from_numpy(np.random.RandomState(SPLIT_SEED).permutation(n))
    n_eval = math.ceil(EVAL_FRACTION * n)  # ceil, as train_test_split rounds the test share
    held, train = order[:n_eval], order[n_eval:]
    return (x[train], y[train]), (x[held], y[held])


class DigitsTask:
    """The `digits` task: 1437 training images, 360 held out, 10 classes."""

    name = "digits"
    metric = Metric("accuracy", True)
    batch_size = 32

    def __init__(self) -> None:
        (self._x_train, self._y_train), (self._x_eval, self._y_eval) = _split()

    def build_model(self) -> nn.Module:
        """Return the 64-128-10 MLP, initialised identically on every call and process.

        The global torch RNG is forked so seeding here does not disturb the caller.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(INIT_SEED)
            return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """Return SGD with lr 0.05 and momentum 0.9 over `model`'s parameters."""
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def train_batches(self, shard: int) -> Iterator[Batch]:
        """Yield (x float32 [32, 64], y int64 [32]) batches forever.

        Each epoch is a fresh permutation of the training split drawn from a
        generator seeded by `shard`, so peers see different orders. The last
        partial batch of an epoch is dropped so every step sees `batch_size` samples.
        """
        gen = torch.Generator().manual_seed(shard)
        n = len(self._y_train)
        while True:
            order = torch.randperm(n, generator=gen)
            for start in range(0, n - self.batch_size + 1, self.batch_size):
                idx = order[start : start + self.batch_size]
                yield self._x_train[idx], self._y_train[idx]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Return the mean cross-entropy of `model` on `batch`."""
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Return {"accuracy", "loss"} on the 360 held-out images.

        Runs in eval mode without gradients and restores the model's previous mode.
        """
        was_training = model.training
        device = next(model.parameters()).device
        model.eval()
        try:
            with torch.no_grad():
                logits = model(self._x_eval.to(device))
                y = self._y_eval.to(device)
                loss = F.cross_entropy(logits, y).item()
                accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        finally:
            model.train(was_training)
        return {"accuracy": accuracy, "loss": loss}
