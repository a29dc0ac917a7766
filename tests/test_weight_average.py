"""The weight average a peer evaluates: its arithmetic, tied weights, checkpoints, and the trainer around it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.tasks import DigitsTask
from murmur.node.learn.weight_average import WeightAverage


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight, as charlm's do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(()))


def _shift(model: nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


@pytest.mark.parametrize("decay", [-0.1, 1.0, 1.5])
def test_a_decay_outside_zero_to_one_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(nn.Linear(2, 2), decay)


def test_each_update_moves_the_average_one_minus_decay_of_the_way() -> None:
    model = nn.Linear(2, 2)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = WeightAverage(model, 0.75)
    _shift(model, 4.0)
    average.update(model)
    _shift(model, 4.0)
    average.update(model)
    averaged = average.averaged(model)
    for name, p in start.items():
        # 0.75 · (0.75 · p + 0.25 · (p + 4)) + 0.25 · (p + 8) = p + 0.75 + 2
        torch.testing.assert_close(averaged[name], p + 2.75)
        torch.testing.assert_close(model.state_dict()[name], p + 8.0)  # the live model is untouched


def test_decay_zero_keeps_nothing_and_evaluates_the_live_model() -> None:
    model = nn.Linear(2, 2)
    average = WeightAverage(model, 0.0)
    _shift(model, 1.0)
    average.update(model)
    for name, t in average.averaged(model).items():
        torch.testing.assert_close(t, model.state_dict()[name])


def test_a_tied_weight_reads_its_average_under_every_name_and_buffers_stay_live() -> None:
    model = Tied()
    start = model.embed.weight.detach().clone()
    average = WeightAverage(model, 0.5)
    _shift(model, 2.0)
    model.steps.fill_(7.0)
    average.update(model)
    averaged = average.averaged(model)
    torch.testing.assert_close(averaged["embed.weight"], start + 1.0)
    torch.testing.assert_close(averaged["out.weight"], start + 1.0)
    assert averaged["steps"].item() == 7.0
    copy = Tied()
    copy.load_state_dict(averaged)
    torch.testing.assert_close(copy.out.weight, start + 1.0)


def test_a_saved_average_resumes_exactly_and_one_that_does_not_fit_restarts_from_the_model() -> None:
    model = Tied()
    average = WeightAverage(model, 0.9)
    _shift(model, 1.0)
    average.update(model)
    saved = {k: t.clone() for k, t in average.averaged(model).items()}
    resumed = WeightAverage(model, 0.9)
    resumed.load_averaged(saved, model)
    for name, t in resumed.averaged(model).items():
        assert torch.equal(t, saved[name])
    for wrong in ({}, {**saved, "embed.weight": torch.zeros(5)}, {"other": torch.zeros(1)}):
        fresh = WeightAverage(model, 0.9)
        fresh.load_averaged(wrong, model)
        for name, t in fresh.averaged(model).items():
            torch.testing.assert_close(t, model.state_dict()[name])


def test_the_trainer_evaluates_its_average_and_trains_exactly_as_without_one() -> None:
    plain, averaged = TrainingLoop(DigitsTask(), shard=3), TrainingLoop(DigitsTask(), shard=3, ema_decay=0.9)
    for _ in range(30):
        plain.step()
        averaged.step()
    for name, t in plain.replica.model.state_dict().items():
        assert torch.equal(t, averaged.replica.model.state_dict()[name])  # the average never feeds back
    reference = DigitsTask().build_model()
    reference.load_state_dict(averaged.replica.average.averaged(averaged.replica.model))
    assert averaged.evaluate().metrics == DigitsTask().evaluate(reference)
    assert plain.evaluate().metrics == DigitsTask().evaluate(plain.replica.model)


def test_the_average_is_checkpointed_as_a_loadable_model_and_restarts_when_state_sync_replaces_the_model() -> None:
    trainer = TrainingLoop(DigitsTask(), shard=1, ema_decay=0.9)
    for _ in range(5):
        trainer.step()
    state = trainer.replica.checkpoint_state()
    resumed = TrainingLoop(DigitsTask(), shard=1, ema_decay=0.9)
    resumed.replica.restore(state)
    assert resumed.evaluate().metrics == trainer.evaluate().metrics
    for name, t in resumed.replica.average.averaged(resumed.replica.model).items():
        assert torch.equal(t, state["weight_average"][name])
    user = DigitsTask().build_model()  # what the README tells a user to do with a checkpoint
    user.load_state_dict(state.get("weight_average", state["model"]))
    assert DigitsTask().evaluate(user) == trainer.evaluate().metrics
    assert "weight_average" not in TrainingLoop(DigitsTask(), shard=1).replica.checkpoint_state()  # none kept: the model is the one

    swarm = TrainingLoop(DigitsTask(), shard=2)
    for _ in range(5):
        swarm.step()
    trainer.replica.adopt(swarm.replica.snapshot().state, 320.0)
    for name, t in trainer.replica.average.averaged(trainer.replica.model).items():
        torch.testing.assert_close(t, swarm.replica.model.state_dict()[name])
