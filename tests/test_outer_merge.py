"""The lab's `outer` merge: Nesterov outer steps on the pair's pseudo-gradient, with state that checkpoints exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.outer_merge import OuterRule
from lab.plugins import register
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.rules import MergeDelta, make_rule
from murmur.node.learn.tasks import DigitsTask

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
    rule = OuterRule()
    a, b = rule.decide(3.0, 1.0), rule.decide(1.0, 3.0)
    assert a.remote_share == pytest.approx(0.25) and a.remote_share + b.remote_share == pytest.approx(1.0)
    assert a.work_after + b.work_after == pytest.approx(4.0)
    assert a.reason == "outer step toward the work: partner holds 25% of the pair's work"
    assert rule.decide(0.0, 5.0).remote_share == 1.0  # a newcomer still adopts


def test_checkpoint_and_restore_are_exact() -> None:
    original = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule(lr=0.7, momentum=0.9))
    for _ in range(3):
        original.step()
    snapshot = original.replica.snapshot()
    remote = {n: t + 0.01 for n, t in snapshot.state.items()}
    original.replica.merge(snapshot, remote, 0.5, snapshot.work)
    restored = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule())
    restored.replica.restore(original.replica.checkpoint_state())
    assert (restored.replica.rule.lr, restored.replica.rule.momentum) == (0.7, 0.9)
    for name in original.replica.rule.anchor:
        assert torch.equal(restored.replica.rule.anchor[name], original.replica.rule.anchor[name])
        assert torch.equal(restored.replica.rule.velocity[name], original.replica.rule.velocity[name])
    # The next merge moves both the same way.
    a, b = original.replica.snapshot(), restored.replica.snapshot()
    da, db = original.replica.rule.delta(a.state, remote, 0.5), restored.replica.rule.delta(b.state, remote, 0.5)
    assert all(torch.equal(da[n], db[n]) for n in da)


def test_state_sync_restarts_from_the_adopted_model() -> None:
    loop = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule())
    adopted = {n: torch.full_like(t, 0.5) for n, t in loop.replica.snapshot().state.items()}
    loop.replica.rule.velocity = {n: torch.ones_like(t) for n, t in adopted.items()}
    loop.replica.adopt(adopted, 100.0)
    assert all(torch.equal(loop.replica.rule.anchor[n], adopted[n]) for n in adopted)
    assert all(not loop.replica.rule.velocity[n].any() for n in adopted)


def test_foreign_state_and_bad_hyperparameters_are_refused() -> None:
    with pytest.raises(ValueError, match="not an outer rule's state"):
        OuterRule().load_state_dict({"anchor": {}})
    with pytest.raises(ValueError, match="outer lr"):
        OuterRule(lr=0.0)


def test_the_registered_merge_takes_outer_steps_on_any_weighting() -> None:
    register(outer_lr=0.5, outer_momentum=0.0)
    rule = make_rule("uniform", "outer")
    assert isinstance(rule, OuterRule) and (rule.lr, rule.momentum) == (0.5, 0.0)
    assert rule.decide(3.0, 1.0).remote_share == 0.5
    with pytest.raises(ValueError, match=r"unknown merge 'inner'; choose from \['average', 'outer'\]"):
        make_rule("work", "inner")
    with pytest.raises(ValueError, match="outer lr"):
        register(outer_lr=3.0)


def test_a_changed_rule_keeps_the_checkpointed_model_and_starts_over() -> None:
    averaging = TrainingLoop(DigitsTask(), shard=0)
    averaging.step()
    outer = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule())
    outer.replica.restore(averaging.replica.checkpoint_state())
    assert outer.replica.samples == 32
    model = outer.replica.snapshot().state
    assert all(torch.equal(outer.replica.rule.anchor[n], model[n]) for n in model)


# --- staleness: the share follows the work since each side's anchor -------------------------------

works = st.integers(1, 10**6).map(float)
fractions = st.floats(0.0, 1.0)
discounts = st.floats(0.0, 1.0)


def _sides(w_l: float, w_r: float, f_l: float, f_r: float, discount: float):
    rule = OuterRule(lr=1.0, momentum=0.0, discount=discount)
    return rule.decide(w_l, w_r, (f_l, f_r)), rule.decide(w_r, w_l, (f_r, f_l))


@given(works, works, fractions, fractions, discounts)
@settings(max_examples=200, deadline=None)
def test_the_share_is_the_stated_blend_of_cumulative_and_fresh_work(
    w_l: float, w_r: float, x_l: float, x_r: float, discount: float
) -> None:
    f_l, f_r = x_l * w_l, x_r * w_r  # fresh work is part of each side's weight
    local, remote = _sides(w_l, w_r, f_l, f_r, discount)
    p = w_r / (w_l + w_r)
    q = f_r / (f_l + f_r) if f_l + f_r > 0 else p
    assert local.remote_share == pytest.approx((1 - discount) * p + discount * q, rel=1e-12, abs=1e-12)
    assert local.remote_share + remote.remote_share == pytest.approx(1.0, rel=1e-12)  # both reach one target
    assert local.work_after + remote.work_after == pytest.approx(w_l + w_r, rel=1e-12)  # Σ work conserved


@given(works, fractions, fractions, st.floats(0.01, 1.0))
@settings(max_examples=200, deadline=None)
def test_the_side_with_less_fresh_work_is_discounted(w: float, x_stale: float, x_fresh: float, discount: float) -> None:
    """Equal cumulative weights (as merges leave them): the staler partner gets less than half, by κ·(½ − q)."""
    f_stale, f_fresh = sorted((x_stale * w, x_fresh * w))
    decision, _ = _sides(w, w, f_fresh, f_stale, discount)
    q = f_stale / (f_stale + f_fresh) if f_stale + f_fresh > 0 else 0.5
    assert decision.remote_share == pytest.approx(0.5 - discount * (0.5 - q), rel=1e-12, abs=1e-12)
    if f_stale < f_fresh:
        assert decision.remote_share < 0.5
    # A staler partner still: its share only falls.
    staler, _ = _sides(w, w, f_fresh, f_stale / 2, discount)
    assert staler.remote_share <= decision.remote_share


@given(works, works, st.floats(1e-3, 1.0), discounts, seeds, seeds, seeds)
@settings(max_examples=50, deadline=None)
def test_lr_one_without_momentum_is_todays_work_averaging_when_fresh_work_is_proportional(
    w_l: float, w_r: float, x: float, discount: float, seed_a: int, seed_l: int, seed_r: int
) -> None:
    """The stated reduction: f_r/(f_l+f_r) = w_r/(w_l+w_r) (e.g. a first merge, where f = w) gives `work`'s share,
    whatever κ; so does κ = 0, or a partner that stated no fresh work."""
    work = make_rule("work").decide(w_l, w_r)
    rule = OuterRule(lr=1.0, momentum=0.0, discount=discount)
    for decision in (rule.decide(w_l, w_r, (x * w_l, x * w_r)), rule.decide(w_l, w_r), OuterRule(1.0, 0.0, discount=0.0).decide(w_l, w_r, (w_l, 0.0))):
        assert decision.remote_share == pytest.approx(work.remote_share, rel=1e-9)
        assert decision.work_after == work.work_after
    rule.reset(_state(seed_a))
    local, remote = _state(seed_l), _state(seed_r)
    delta, plain = rule.delta(local, remote, work.remote_share), MergeDelta(local, remote, work.remote_share)
    for name in local:
        torch.testing.assert_close(delta[name], plain[name], rtol=1e-5, atol=1e-5)


def test_a_fresh_partner_counts_more_than_its_cumulative_weight_says() -> None:
    rule = OuterRule(discount=0.5)
    decision = rule.decide(1000.0, 1000.0, (32.0, 96.0))  # partner trained 3x as much since its anchor
    assert decision.remote_share == pytest.approx(0.5 * 0.5 + 0.5 * 0.75)
    assert decision.reason == (
        "outer step toward the work: partner holds 50% of the pair's work; partner did 75% of the fresh work: share 62%"
    )
    assert rule.decide(1000.0, 1000.0, (0.0, 0.0)).remote_share == 0.5  # no fresh work anywhere: weights alone


def test_trainers_count_fresh_work_since_the_last_merge_and_conserve_total_work() -> None:
    a = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule(lr=1.0, momentum=0.0))
    b = TrainingLoop(DigitsTask(), shard=1, rule=OuterRule(lr=1.0, momentum=0.0))
    b.replica.model.load_state_dict(a.replica.model.state_dict())
    for _ in range(3):
        a.step()
    b.step()
    sa, sb = a.replica.snapshot(), b.replica.snapshot()
    assert (sa.fresh, sb.fresh) == (3 * 32, 32)
    a.step()  # in flight: this step stays fresh after the merge
    total = sa.work + sb.work
    for loop, local, remote in ((a, sa, sb), (b, sb, sa)):
        decision = loop.replica.rule.decide(local.work, remote.work, (local.fresh, remote.fresh))
        loop.replica.merge(local, remote.state, decision.remote_share, decision.work_after)
    assert (a.replica.fresh, b.replica.fresh) == (32, 0)
    assert a.replica.work - 32 + b.replica.work == total  # Σ work conserved; the in-flight step is a's own
    a.replica.adopt(b.replica.snapshot().state, b.replica.work)
    assert a.replica.fresh == 0


def test_checkpoint_and_restore_keep_the_fresh_work_and_the_discount() -> None:
    original = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule(discount=0.25))
    original.step()
    original.step()
    restored = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule(discount=1.0))
    restored.replica.restore(original.replica.checkpoint_state())
    assert (restored.replica.fresh, restored.replica.rule.discount) == (64, 0.25)
    older = original.replica.checkpoint_state()
    del older["fresh"], older["merge_rule"]["state"]["discount"]  # written before the staleness rule
    restored = TrainingLoop(DigitsTask(), shard=0, rule=OuterRule(discount=1.0))
    restored.replica.restore(older)
    assert (restored.replica.fresh, restored.replica.rule.discount) == (0.0, 1.0)
    averaging = TrainingLoop(DigitsTask(), shard=0)
    averaging.replica.restore(original.replica.checkpoint_state())  # another rule: it starts over from the model, nothing fresh
    assert averaging.replica.fresh == 0.0


def test_a_discount_outside_zero_to_one_is_refused() -> None:
    with pytest.raises(ValueError, match="staleness discount must be in \\[0, 1\\], got 1.5"):
        OuterRule(discount=1.5)
    with pytest.raises(ValueError, match="staleness discount"):
        OuterRule(discount=-0.1)


@given(seeds, seeds, seeds, shares, st.floats(0.1, 2.0), st.floats(0.0, 0.99))
@settings(max_examples=50, deadline=None)
def test_travelling_optimizer_state_is_averaged_not_stepped(
    seed_a: int, seed_l: int, seed_r: int, share: float, lr: float, momentum: float
) -> None:
    """Adam's second moment stays a convex mix of non-negative values (an outer step could overshoot below 0)."""
    name = "optimizer.w.exp_avg_sq"
    anchor, local, remote = ({name: _state(seed)["w"].abs()} for seed in (seed_a, seed_l, seed_r))
    rule = OuterRule(lr=lr, momentum=momentum)
    rule.reset(anchor)
    for _ in range(2):  # the second merge would carry momentum, if any were kept
        delta = rule.delta(local, remote, share)
        merged = local[name] + delta[name]
        torch.testing.assert_close(merged, local[name] + share * (remote[name] - local[name]))
        assert (merged >= 0).all()
        torch.testing.assert_close(rule.anchor[name], merged)
        local = {name: merged}
