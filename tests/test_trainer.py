import threading

import anyio
import pytest
import torch

from node.merge import merge_delta
from node.tasks import DigitsTask
from node.trainer import TIMER_SLACK_S, Evaluation, Pacing, Trainer, TrainStats, train

pytestmark = pytest.mark.anyio


def test_step_time_pads_each_step_to_its_emulated_duration() -> None:
    pacing = Pacing(slowdown=4, step_time_ms=20)
    assert pacing.step_duration(compute_s=0.003, elapsed_s=0.004, batch_size=32) == pytest.approx(0.080)
    assert pacing.step_duration(compute_s=0.003, elapsed_s=0.004, batch_size=64) == pytest.approx(0.160)
    # A step slower than its target is never shortened.
    assert pacing.step_duration(compute_s=0.2, elapsed_s=0.2, batch_size=32) == pytest.approx(0.2)


def test_host_lateness_within_the_timer_slack_is_not_idle_time() -> None:
    # The device finished its step at t=1.0; the host wakes 1 ms late: the next step starts at 1.0.
    assert Pacing.step_start(now=1.001, device_free=1.0) == 1.0
    assert Pacing.step_start(now=1.0 + 0.9 * TIMER_SLACK_S, device_free=1.0) == 1.0
    # A longer gap (an evaluation, a merge holding the lock) is real idle time.
    assert Pacing.step_start(now=1.05, device_free=1.0) == 1.05


def test_slowdown_sleeps_s_minus_one_times_compute() -> None:
    assert Pacing(slowdown=3).step_duration(compute_s=0.01, elapsed_s=0.011, batch_size=32) == pytest.approx(0.031)
    assert Pacing().step_duration(compute_s=0.01, elapsed_s=0.011, batch_size=32) == pytest.approx(0.011)


def test_step_counts_work_and_merge_keeps_in_flight_progress() -> None:
    trainer = Trainer(DigitsTask(), shard=0)
    trainer.step()
    snapshot = trainer.snapshot()
    assert snapshot.weight == trainer.samples == 32
    trainer.step()  # progress made while an exchange is in flight
    progressed = trainer.snapshot().state
    remote = {n: torch.zeros_like(t) for n, t in snapshot.state.items()}
    trainer.apply_merge(merge_delta(snapshot.state, remote, 0.5), snapshot.weight, weight_after=40.0)
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
