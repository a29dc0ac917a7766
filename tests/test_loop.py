"""The built-in training loop: steps that count their work, evaluations alongside training, the pace."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from murmur.node.learn.device import DeviceError
from murmur.node.learn.loop import Evaluation, TrainingLoop, TrainStats, train
from murmur.node.learn.rules import UniformRule
from murmur.node.learn.step import Pacing
from murmur.node.learn.tasks import DigitsTask

pytestmark = pytest.mark.anyio


def test_a_step_trains_the_replica_on_the_next_batch_and_counts_its_samples() -> None:
    loop = TrainingLoop(DigitsTask(), shard=0, rule=UniformRule())
    before = loop.replica.snapshot().state
    assert loop.step() > 0
    after = loop.replica.snapshot().state
    assert (loop.replica.samples, loop.replica.work, loop.replica.name) == (32, 32.0, "digits")
    assert loop.replica.rule.name == "uniform" and any(not torch.equal(after[n], t) for n, t in before.items())


def test_an_evaluation_scores_the_model_and_says_how_much_work_it_holds() -> None:
    loop = TrainingLoop(DigitsTask(), shard=0)
    loop.step()
    evaluation = loop.evaluate()
    assert (evaluation.samples, evaluation.work) == (32, 32.0) and 0 <= evaluation.metrics["accuracy"] <= 1


def test_mixed_precision_where_it_is_refused_is_a_device_error() -> None:
    with pytest.raises(DeviceError):
        TrainingLoop(DigitsTask(), shard=0, device="cpu", mixed_precision=True)


async def test_train_loop_steps_and_evaluates() -> None:
    loop = TrainingLoop(DigitsTask(), shard=0)
    evals: list[Evaluation] = []
    stats = TrainStats()
    await train(loop, Pacing(slowdown=1, step_time_ms=5), stats, eval_every=0.01, on_eval=evals.append, max_steps=10)
    assert stats.steps == 10 and loop.replica.samples == 320
    assert len(evals) >= 2 and all("accuracy" in e.metrics for e in evals)
    assert evals[0].samples <= evals[-1].samples and evals[0].t <= evals[-1].t
    assert 0 < stats.busy_s


class _BlockingEvalTask(DigitsTask):
    """Digits whose held-out pass waits for `release` (a big evaluation set, as long as a test likes)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.scored: list[torch.nn.Module] = []

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        self.scored.append(model)
        assert self.release.wait(timeout=30), "never released"
        return super().evaluate(model)


async def test_evaluation_runs_alongside_training_and_scores_a_copy() -> None:
    task = _BlockingEvalTask()
    loop = TrainingLoop(task, shard=0)
    stats = TrainStats()
    evals: list[Evaluation] = []

    async def release_once_training_is_done() -> None:
        with anyio.fail_after(30):
            while stats.ended is None:
                await anyio.sleep(0.01)
        assert evals == [] and stats.steps == 20  # every step ran while the first evaluation was still going
        task.release.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_once_training_is_done)
        await train(loop, Pacing(slowdown=1, step_time_ms=1), stats, eval_every=10.0, on_eval=evals.append, max_steps=20)
    assert task.scored and all(model is not loop.replica.model for model in task.scored)
    assert evals and evals[0].samples < loop.replica.samples == 20 * 32  # scored as it was when copied, early on
