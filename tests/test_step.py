"""The one training step and the emulated device's pace."""

import pytest
import torch

from murmur.node.learn.step import TIMER_SLACK_S, Pacing, train_step
from murmur.node.learn.tasks import DigitsTask


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


def test_padding_is_what_remains_of_the_emulated_step() -> None:
    assert Pacing(slowdown=2).padding(compute_s=0.01, batch_size=32) == pytest.approx(0.01)
    assert Pacing(slowdown=1).padding(compute_s=0.01, batch_size=32) == 0.0
    assert Pacing(slowdown=2, step_time_ms=20).padding(compute_s=0.005, batch_size=64) == pytest.approx(0.075)
    assert Pacing(slowdown=1, step_time_ms=1).padding(compute_s=0.5, batch_size=32) == 0.0  # already slower


def test_train_step_runs_the_hook_between_backward_and_update() -> None:
    task = DigitsTask()
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[bool] = []

    def hook() -> None:  # gradients exist, parameters not yet updated
        seen.append(all(p.grad is not None for p in model.parameters()))
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        for p in model.parameters():
            p.grad.zero_()  # a reduction may rewrite the gradients: the update must use them

    loss = train_step(task, model, optimizer, next(task.train_batches(0)), before_update=hook)
    assert seen == [True] and loss.item() > 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # SGD on zero gradients: no move
