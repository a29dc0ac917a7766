"""Tests for lab/sync_rank.py: a synchronous rank's batches and gradient buffer, in-process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab import sync_rank as sr
from murmur.node.learn.step import train_step


class Regression:
    """The smallest task `train_step` needs: mean squared error of a linear model."""

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)


def test_batch_sizes() -> None:
    assert sr.batch_sizes(32, [1, 2], "equal") == [32, 32]
    # 32 * 2 * (1 / 1.5) = 42.67 -> 43 ; 32 * 2 * (0.5 / 1.5) = 21.33 -> 21
    assert sr.batch_sizes(32, [1, 2], "proportional") == [43, 21]
    # speeds 1, 1, 0.5, 0.25 (sum 2.75): 128 * speed / 2.75
    assert sr.batch_sizes(32, [1, 1, 2, 4], "proportional") == [47, 47, 23, 12]
    assert sr.batch_sizes(1, [1, 100], "proportional") == [2, 1]  # never below 1
    with pytest.raises(ValueError):
        sr.batch_sizes(32, [1], "bogus")


def test_sample_weighted_all_reduce_in_train_step_equals_one_step_on_all_samples() -> None:
    # Two ranks with batches of 3 and 5 (proportional mode): each packs its mean-loss
    # gradient times its batch, the buffers are summed (the all-reduce) and unpacked
    # divided by 8 inside `train_step`'s hook. The step is the one on all 8 samples.
    torch.manual_seed(0)
    task, base = Regression(), nn.Linear(3, 2)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    parts = [(x[:3], y[:3]), (x[3:], y[3:])]
    numel = sum(p.numel() for p in base.parameters())
    reduced = torch.zeros(numel + 2)
    for part in parts:
        model = copy.deepcopy(base)
        task.loss(model, part).backward()
        flat = torch.full((numel + 2,), float("nan"))  # pack must overwrite every gradient slot
        sr.pack(list(model.parameters()), flat, scale=float(len(part[1])))
        reduced[:numel] += flat[:numel]

    model = copy.deepcopy(base)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    train_step(task, model, optimizer, parts[0], before_update=lambda: sr.unpack(params, reduced, 8.0))

    reference = copy.deepcopy(base)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    train_step(task, reference, reference_optimizer, (x, y))
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_a_parameter_without_gradient_contributes_zeros_and_receives_the_others() -> None:
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    used.grad = torch.tensor([1.0, 2.0])
    flat = torch.full((5,), 7.0)
    sr.pack([used, unused], flat, scale=2.0)
    assert flat.tolist() == [2.0, 4.0, 0.0, 0.0, 0.0]

    sr.unpack([used, unused], torch.tensor([4.0, 6.0, 2.0, 2.0, 2.0]), divisor=2.0)
    assert used.grad.tolist() == [2.0, 3.0]
    assert unused.grad is not None and unused.grad.tolist() == [1.0, 1.0, 1.0]
