"""The built-in tasks keep the promises of the `Task` protocol, and `load_task` finds them."""

from __future__ import annotations

import math
import re
from itertools import islice
from typing import Iterator

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from murmur.node.learn.tasks import CharLMTask, DigitsTask, Task, UnknownTask, load_task


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Run on one thread, which the tasks are sized for; more threads on shared cores make timing erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["digits", "charlm"])
def task(request: pytest.FixtureRequest) -> Task:
    return load_task(request.param)


def _train(task: Task, model: torch.nn.Module, steps: int) -> list[float]:
    opt = task.make_optimizer(model)
    losses = []
    for batch in islice(task.train_batches(0), steps):
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_build_model_is_identical_and_leaves_global_rng_alone(task: Task) -> None:
    before = torch.get_rng_state()
    a, b = task.build_model().state_dict(), task.build_model().state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_train_batches_shapes_and_shards(task: Task) -> None:
    (x0, y0), (x0_again, _) = next(task.train_batches(0)), next(task.train_batches(0))
    x1, _ = next(task.train_batches(1))
    assert x0.shape[0] == y0.shape[0] == task.batch_size
    assert torch.equal(x0, x0_again), "a shard's stream is reproducible"
    assert not torch.equal(x0, x1), "different shards draw different batches"


def test_evaluate_reports_finite_metric_and_restores_mode(task: Task) -> None:
    model = task.build_model()
    for training in (True, False):
        model.train(training)
        metrics = task.evaluate(model)
        assert model.training is training
        assert task.metric.name in metrics
        assert all(math.isfinite(v) for v in metrics.values())


class _HeldOutOracle(torch.nn.Module):
    """Answers exactly the images it was given the labels of, and refuses any other."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # evaluate() looks for the model's device
        self.labels = {tuple(row): int(label) for row, label in zip(images.tolist(), labels.tolist(), strict=True)}
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += len(x)
        labels = [self.labels[tuple((row * 16).round().tolist())] for row in x]  # KeyError: not a held-out image
        return torch.nn.functional.one_hot(torch.tensor(labels), 10).float()


def test_digits_batches_and_split() -> None:
    task = DigitsTask()
    x, y = next(task.train_batches(0))
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((32, 64), torch.float32, (32,), torch.int64)
    assert 0.0 <= x.min() and x.max() <= 1.0
    # The held-out split is the one outside measurements use: train_test_split's, at 20 % and seed 0.
    digits = load_digits()
    train_idx, eval_idx = train_test_split(np.arange(1797), test_size=0.2, random_state=0)
    oracle = _HeldOutOracle(digits.data[eval_idx], digits.target[eval_idx])
    assert task.evaluate(oracle)["accuracy"] == 1.0 and oracle.seen == 360
    training = {tuple(row) for row in digits.data[train_idx].tolist()}
    batches = task.train_batches(1)
    epoch = [next(batches) for _ in range(1437 // 32)]
    assert all(tuple((row * 16).round().tolist()) in training for x, _ in epoch for row in x)


def test_digits_learns() -> None:
    task = DigitsTask()
    model = task.build_model()
    assert task.evaluate(model)["accuracy"] < 0.3
    _train(task, model, steps=100)
    assert task.evaluate(model)["accuracy"] > 0.8


def test_charlm_batches() -> None:
    x, y = next(CharLMTask().train_batches(3))
    assert (x.shape, x.dtype, y.shape, y.dtype) == ((32, 32), torch.int64, (32, 32), torch.int64)
    assert torch.equal(x[:, 1:], y[:, :-1]), "y is x shifted by one byte"
    assert 0 <= x.min() and x.max() < 256


def test_charlm_model_size_and_learns() -> None:
    task = CharLMTask()
    model = task.build_model()
    assert 1.0e5 < sum(p.numel() for p in model.parameters()) < 1.5e5  # 2 layers, d=64
    losses = _train(task, model, steps=50)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0
    after = task.evaluate(model)
    # An untrained model scores about ln(256), a uniform guess over bytes.
    assert after["loss"] < math.log(256) - 1.0
    assert after["bits_per_byte"] == pytest.approx(after["loss"] / math.log(2))


def test_load_task_by_name_and_path() -> None:
    assert isinstance(load_task("digits"), DigitsTask)
    assert isinstance(load_task("charlm"), CharLMTask)
    assert isinstance(load_task("murmur.node.learn.tasks.digits:DigitsTask"), DigitsTask)


@pytest.mark.parametrize("spec", ["nope", "murmur.node.learn.tasks.digits:Nope", "no_such_module:Task"])
def test_load_task_unknown_names_the_spec(spec: str) -> None:
    with pytest.raises(UnknownTask, match=re.escape(repr(spec))):
        load_task(spec)


def test_digits_are_read_exactly_as_scikit_learn_loads_them() -> None:
    from sklearn.datasets import load_digits

    from murmur.node.learn.tasks.digits import load_digits_data

    data, target = load_digits_data()
    reference = load_digits()
    assert np.array_equal(data, reference.data) and np.array_equal(target, reference.target)


def test_a_metric_is_reached_at_its_target_or_beyond_in_its_own_order() -> None:
    from murmur.node.learn.tasks.task import Metric

    accuracy, loss = Metric("accuracy", higher_is_better=True), Metric("loss", higher_is_better=False)
    assert accuracy.reached(0.95, 0.95) and accuracy.reached(0.96, 0.95) and not accuracy.reached(0.94, 0.95)
    assert loss.reached(2.5, 2.5) and loss.reached(2.4, 2.5) and not loss.reached(2.6, 2.5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("digit", ("unknown task 'digit': did you mean 'digits'? tasks: digits, charlm, charlm-large, "
                   "or package.module:factory for your own")),
        ("os:getcwd", ("'os:getcwd' is not a task factory: os.getcwd() returned a str, which lacks name, metric, batch_size, "
                       "build_model, make_optimizer, train_batches, loss, evaluate (see murmur.node.learn.tasks.Task)")),
        ("os:sep", "'os:sep' is not a task factory: os.sep is a str, not callable"),
    ],
)  # fmt: skip
def test_load_task_says_what_is_wrong_with_a_spec(spec: str, message: str) -> None:
    with pytest.raises(UnknownTask) as refused:
        load_task(spec)
    assert str(refused.value) == message
