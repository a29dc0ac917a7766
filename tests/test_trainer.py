"""The trainer: steps, merges that keep in-flight progress, its merge rule's state, checkpoints, the training loop."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from murmur.node.learn.checkpoint import read_checkpoint, save_checkpoint
from murmur.node.learn.rules import MergeDelta, UniformRule, WorkRule
from murmur.node.learn.step import Pacing
from murmur.node.learn.tasks import DigitsTask
from murmur.node.learn.trainer import Evaluation, Trainer, TrainStats, train

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


class CountingRule(WorkRule):
    """A test-only stateful rule: counts merges and keeps every share it applied."""

    name = "counting-test"

    def __init__(self) -> None:
        self.merges = 0
        self.shares = torch.zeros(0, dtype=torch.float64)
        self.reset_with: dict[str, torch.Tensor] | None = None

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> MergeDelta:
        self.merges += 1
        self.shares = torch.cat([self.shares, torch.tensor([share], dtype=torch.float64)])
        return super().delta(snapshot, remote, share)

    def state_dict(self) -> dict[str, Any]:
        return {"merges": self.merges, "shares": self.shares.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.keys() != {"merges", "shares"}:
            raise ValueError(f"not a {self.name} state: {sorted(state)}")
        self.merges, self.shares = int(state["merges"]), state["shares"].clone()

    def reset(self, model: Mapping[str, torch.Tensor]) -> None:
        self.merges, self.shares = 0, torch.zeros(0, dtype=torch.float64)
        self.reset_with = {name: tensor.detach().clone() for name, tensor in model.items()}


def _merge_with_zeros(trainer: Trainer, share: float) -> None:
    snapshot = trainer.snapshot()
    trainer.merge(snapshot, {n: torch.zeros_like(t) for n, t in snapshot.state.items()}, share, snapshot.weight)


def test_the_rules_state_is_checkpointed_and_restored_exactly(tmp_path: Path) -> None:
    trainer = Trainer(DigitsTask(), shard=0, rule=CountingRule())
    trainer.step()
    for share in (0.25, 1 / 3):
        _merge_with_zeros(trainer, share)
    resumed = Trainer(DigitsTask(), shard=0, rule=CountingRule())
    resumed.restore(read_checkpoint(save_checkpoint(tmp_path, trainer.checkpoint_state())))
    assert resumed.rule.merges == 2
    assert torch.equal(resumed.rule.shares, torch.tensor([0.25, 1 / 3], dtype=torch.float64))
    _merge_with_zeros(resumed, 0.5)  # and it goes on from there
    assert resumed.rule.merges == 3 and trainer.rule.merges == 2


def test_adopt_starts_the_rule_over_from_the_adopted_model() -> None:
    source = Trainer(DigitsTask(), shard=1)
    for _ in range(3):
        source.step()
    trainer = Trainer(DigitsTask(), shard=0, rule=CountingRule())
    trainer.step()
    _merge_with_zeros(trainer, 0.5)
    adopted = source.snapshot()
    trainer.adopt(adopted.state, adopted.weight)
    assert trainer.rule.merges == 0 and trainer.rule.reset_with is not None
    assert trainer.rule.reset_with.keys() == adopted.state.keys()
    for name, tensor in adopted.state.items():
        torch.testing.assert_close(trainer.rule.reset_with[name], tensor)
    assert trainer.weight == adopted.weight


def test_a_checkpoint_of_another_rule_keeps_the_model_and_starts_the_rule_over() -> None:
    # Switching --weighting or --merge between runs must not throw away a peer's work.
    written = Trainer(DigitsTask(), shard=0, rule=UniformRule())
    written.step()
    trainer = Trainer(DigitsTask(), shard=0, rule=CountingRule())
    trainer.restore(written.checkpoint_state())
    assert trainer.samples == 32 and trainer.rule.merges == 0 and trainer.rule.reset_with is not None
    model = written.snapshot().state
    assert all(torch.equal(t, model[n]) for n, t in trainer.snapshot().state.items())


def test_a_checkpoint_from_before_merge_rules_restores_with_a_fresh_rule() -> None:
    written = Trainer(DigitsTask(), shard=0)
    written.step()
    state = written.checkpoint_state()
    del state["merge_rule"]
    trainer = Trainer(DigitsTask(), shard=0, rule=CountingRule())
    trainer.step()
    _merge_with_zeros(trainer, 0.5)
    trainer.restore(state)
    assert trainer.samples == 32 and trainer.rule.merges == 0 and trainer.rule.reset_with is not None


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
        self.scored: list[torch.nn.Module] = []

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        self.scored.append(model)
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
    assert task.scored and all(model is not trainer.model for model in task.scored)
    assert evals and evals[0].samples < trainer.samples == 20 * 32  # scored as it was when copied, early on
