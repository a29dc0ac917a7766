"""The `outer` rule: Nesterov outer steps on the pair's pseudo-gradient, with state that checkpoints exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.node.learn.rules import MergeDelta, make_rule
from murmur.node.learn.rules.outer import OuterRule
from murmur.node.learn.tasks import DigitsTask
from murmur.node.learn.trainer import Trainer

SHAPES = {"w": (3, 2), "b": (4,)}
seeds = st.integers(0, 2**32 - 1)
shares = st.floats(0.0, 1.0)


def _state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


@given(seeds, seeds, seeds, shares)
@settings(max_examples=50, deadline=None)
def test_outer_lr_one_without_momentum_is_plain_averaging(seed_a: int, seed_l: int, seed_r: int, share: float) -> None:
    rule = OuterRule(lr=1.0, momentum=0.0)
    rule.reset(_state(seed_a))  # wherever the anchor is, the step lands on the pair's mean
    local, remote = _state(seed_l), _state(seed_r)
    delta, plain = rule.delta(local, remote, share), MergeDelta(local, remote, share)
    for name in local:
        torch.testing.assert_close(delta[name], plain[name], rtol=1e-5, atol=1e-5)


def test_outer_step_follows_nesterov_from_the_anchor() -> None:
    rule = OuterRule(lr=0.5, momentum=0.9)
    anchor = {"w": torch.zeros(2)}
    rule.reset(anchor)
    local, remote = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 2.0])}
    delta = rule.delta(local, remote, 0.5)
    g = anchor["w"] - torch.tensor([2.0, 2.0])  # pseudo-gradient: anchor minus the pair's mean
    moved = anchor["w"] - 0.5 * (g + 0.9 * g)  # first step: velocity = g
    torch.testing.assert_close(delta["w"], moved - local["w"])
    torch.testing.assert_close(rule.anchor["w"], moved)  # the new model is the next anchor
    torch.testing.assert_close(rule.velocity["w"], g)


def test_decision_is_work_weighted_and_conserves_total_weight() -> None:
    rule = make_rule("work", "outer")
    a, b = rule.decide(3.0, 1.0), rule.decide(1.0, 3.0)
    assert a.remote_share == pytest.approx(0.25) and a.remote_share + b.remote_share == pytest.approx(1.0)
    assert a.weight_after + b.weight_after == pytest.approx(4.0)
    assert a.reason == "outer step toward the work: partner holds 25% of the pair's work"
    assert rule.decide(0.0, 5.0).remote_share == 1.0  # a newcomer still adopts


def test_checkpoint_and_restore_are_exact() -> None:
    original = Trainer(DigitsTask(), shard=0, rule=OuterRule(lr=0.7, momentum=0.9))
    for _ in range(3):
        original.step()
    snapshot = original.snapshot()
    remote = {n: t + 0.01 for n, t in snapshot.state.items()}
    original.merge(snapshot, remote, 0.5, snapshot.weight)
    restored = Trainer(DigitsTask(), shard=0, rule=OuterRule())
    restored.restore(original.checkpoint_state())
    assert (restored.rule.lr, restored.rule.momentum) == (0.7, 0.9)
    for name in original.rule.anchor:
        assert torch.equal(restored.rule.anchor[name], original.rule.anchor[name])
        assert torch.equal(restored.rule.velocity[name], original.rule.velocity[name])
    # The next merge moves both the same way.
    a, b = original.snapshot(), restored.snapshot()
    da, db = original.rule.delta(a.state, remote, 0.5), restored.rule.delta(b.state, remote, 0.5)
    assert all(torch.equal(da[n], db[n]) for n in da)


def test_state_sync_restarts_from_the_adopted_model() -> None:
    trainer = Trainer(DigitsTask(), shard=0, rule=OuterRule())
    adopted = {n: torch.full_like(t, 0.5) for n, t in trainer.snapshot().state.items()}
    trainer.rule.velocity = {n: torch.ones_like(t) for n, t in adopted.items()}
    trainer.adopt(adopted, 100.0)
    assert all(torch.equal(trainer.rule.anchor[n], adopted[n]) for n in adopted)
    assert all(not trainer.rule.velocity[n].any() for n in adopted)


def test_foreign_state_and_bad_hyperparameters_are_refused() -> None:
    with pytest.raises(ValueError, match="not an outer rule's state"):
        OuterRule().load_state_dict({"anchor": {}})
    with pytest.raises(ValueError, match="outer lr"):
        OuterRule(lr=0.0)


def test_make_rule_builds_outer_steps_on_any_weighting() -> None:
    rule = make_rule("uniform", "outer", outer_lr=0.5, outer_momentum=0.0)
    assert isinstance(rule, OuterRule) and (rule.lr, rule.momentum) == (0.5, 0.0)
    assert rule.decide(3.0, 1.0).remote_share == 0.5
    with pytest.raises(ValueError, match=r"unknown merge 'inner'; choose from \['average', 'outer'\]"):
        make_rule("work", "inner")


def test_a_changed_rule_keeps_the_checkpointed_model_and_starts_over() -> None:
    averaging = Trainer(DigitsTask(), shard=0)
    averaging.step()
    outer = Trainer(DigitsTask(), shard=0, rule=OuterRule())
    outer.restore(averaging.checkpoint_state())
    assert outer.samples == 32
    model = outer.snapshot().state
    assert all(torch.equal(outer.rule.anchor[n], model[n]) for n in model)
