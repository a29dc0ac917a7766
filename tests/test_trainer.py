import threading

import anyio
import pytest
import torch

from node.learn.step import Pacing
from node.learn.tasks import DigitsTask
from node.learn.trainer import Evaluation, Trainer, TrainStats, train

pytestmark = pytest.mark.anyio


def test_step_counts_work_and_merge_keeps_in_flight_progress() -> None:
    trainer = Trainer(DigitsTask(), shard=0)
    trainer.step()
    snapshot = trainer.snapshot()
    assert snapshot.weight == trainer.samples == 32
    trainer.step()  # progress made while an exchange is in flight
    progressed = trainer.snapshot().state
    remote = {n: torch.zeros_like(t) for n, t in snapshot.state.items()}
    trainer.merge(snapshot, remote, 0.5, weight_after=40.0)
    after = trainer.snapshot()
    for name, tensor in after.state.items():
        expected = progressed[name] + 0.5 * (remote[name] - snapshot.state[name])
        torch.testing.assert_close(tensor, expected)
    assert after.weight == 40.0 + 32  # the merge's weight plus the step taken meanwhile


async def test_train_loop_steps_and_evaluates() -> None:
    trainer = Trainer(DigitsTask(), shard=0)
    evals: list[Evaluation] = []
    stats = TrainStats()
    await train(trainer, Pacing(slowdown=1, step_time_ms=5), stats, eval_every=0.01, on_eval=evals.append, max_steps=10)
    assert stats.steps == 10 and trainer.samples == 320
    assert len(evals) >= 2 and all("accuracy" in e.metrics for e in evals)
    assert evals[0].samples <= evals[-1].samples and evals[0].t <= evals[-1].t
    assert 0 < stats.busy_s


class _BlockingEvalTask(DigitsTask):
    """Digits whose held-out pass waits for `release` (a big evaluation set, as long as a test likes)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        assert self.release.wait(timeout=30), "never released"
        return super().evaluate(model)


async def test_evaluation_runs_alongside_training_and_scores_a_copy() -> None:
    task = _BlockingEvalTask()
    trainer = Trainer(task, shard=0)
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
        await train(trainer, Pacing(slowdown=1, step_time_ms=1), stats, eval_every=10.0, on_eval=evals.append, max_steps=20)
    assert trainer._eval_model is not trainer.model
