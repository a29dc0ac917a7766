"""What every merge rule promises: both sides reach the same model and weight, newcomers adopt, in-flight progress is kept."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.node.learn.rules import OPTIMIZER_STATE, RULES, MergeDelta, MixDecision, UniformRule, WorkRule, make_rule
from murmur.protocol.messages import MAX_WORK

POLICY_NAMES = sorted(RULES)
SHAPES = {"w": (3, 2), "b": (4,)}

# Work is a sample count: whole numbers, or fractions no smaller than 1e-9 (avoids subnormal underflow in the oracle).
weights = st.one_of(st.just(0.0), st.integers(0, 10**6).map(float), st.floats(1e-9, MAX_WORK))
positive_weights = weights.filter(lambda w: w > 0)
seeds = st.integers(0, 2**32 - 1)


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen, dtype=torch.float64) * scale for name, shape in SHAPES.items()}


def _merged(snapshot: dict[str, torch.Tensor], remote: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    delta = MergeDelta(snapshot, remote, share)
    return {name: snapshot[name] + delta[name] for name in snapshot}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float = 1e-9, atol: float = 1e-9) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[n], b[n], rtol=rtol, atol=atol) for n in a)


def _both_sides(policy_name: str, w_l: float, w_r: float, seed_l: int, seed_r: int):
    policy = make_rule(policy_name)
    theta_l, theta_r = _state(seed_l), _state(seed_r)
    mix_l, mix_r = policy.decide(w_l, w_r), policy.decide(w_r, w_l)
    return theta_l, theta_r, mix_l, mix_r, _merged(theta_l, theta_r, mix_l.remote_share), _merged(theta_r, theta_l, mix_r.remote_share)


# --- policy choice ----------------------------------------------------------------


def test_make_rule_returns_each_policy_by_name() -> None:
    assert isinstance(make_rule("uniform"), UniformRule)
    assert isinstance(make_rule("work"), WorkRule)
    assert [make_rule(n).name for n in POLICY_NAMES] == POLICY_NAMES


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_stateless_rules_checkpoint_nothing_and_refuse_foreign_state(policy_name: str) -> None:
    rule = make_rule(policy_name)
    assert rule.state_dict() == {} and rule.optimizer_state == ()
    rule.load_state_dict({})
    with pytest.raises(ValueError, match=f"merge rule '{policy_name}' keeps no state, got keys \\['ema'\\]"):
        rule.load_state_dict({"ema": torch.zeros(1)})


def test_make_rule_rejects_unknown_names_listing_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown merge rule 'nope'; choose from \['uniform', 'work'\]"):
        make_rule("nope")


# --- the rules -------------------------------------------------------------------


@given(positive_weights, positive_weights, seeds, seeds)
@settings(deadline=None)
def test_work_merge_is_the_work_weighted_mean(w_l: float, w_r: float, seed_l: int, seed_r: int) -> None:
    theta_l, theta_r, mix_l, _, merged_l, _ = _both_sides("work", w_l, w_r, seed_l, seed_r)
    assert mix_l.remote_share == pytest.approx(w_r / (w_l + w_r))
    expected = {n: (w_l * theta_l[n] + w_r * theta_r[n]) / (w_l + w_r) for n in theta_l}
    assert _close(merged_l, expected)
    assert mix_l.work_after == pytest.approx((w_l + w_r) / 2)


@given(positive_weights, positive_weights, seeds, seeds)
@settings(deadline=None)
def test_uniform_merge_takes_equal_shares(w_l: float, w_r: float, seed_l: int, seed_r: int) -> None:
    theta_l, theta_r, mix_l, _, merged_l, _ = _both_sides("uniform", w_l, w_r, seed_l, seed_r)
    assert mix_l == MixDecision(0.5, (w_l + w_r) / 2, "uniform: equal shares")
    assert _close(merged_l, {n: (theta_l[n] + theta_r[n]) / 2 for n in theta_l})


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(w_l=weights, w_r=weights, seed_l=seeds, seed_r=seeds)
@settings(deadline=None)
def test_both_sides_reach_the_same_model_and_weight(policy_name: str, w_l: float, w_r: float, seed_l: int, seed_r: int) -> None:
    _, _, mix_l, mix_r, merged_l, merged_r = _both_sides(policy_name, w_l, w_r, seed_l, seed_r)
    assert mix_l.remote_share + mix_r.remote_share == pytest.approx(1.0)
    assert mix_l.work_after == mix_r.work_after
    assert _close(merged_l, merged_r)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(w_l=weights, w_r=weights)
def test_total_weight_is_conserved(policy_name: str, w_l: float, w_r: float) -> None:
    policy = make_rule(policy_name)
    after = policy.decide(w_l, w_r).work_after + policy.decide(w_r, w_l).work_after
    assert after == pytest.approx(w_l + w_r)


@given(weights, weights, seeds, seeds)
@settings(deadline=None)  # torch on a shared 2-core machine: a slow example is not a failure
def test_work_merge_conserves_weighted_parameters(w_l: float, w_r: float, seed_l: int, seed_r: int) -> None:
    theta_l, theta_r, mix_l, mix_r, merged_l, merged_r = _both_sides("work", w_l, w_r, seed_l, seed_r)
    scale = max(w_l + w_r, 1.0)
    for n in theta_l:
        before = w_l * theta_l[n] + w_r * theta_r[n]
        after = mix_l.work_after * merged_l[n] + mix_r.work_after * merged_r[n]
        assert torch.allclose(after / scale, before / scale, rtol=1e-9, atol=1e-9), n


def test_work_reason_states_the_partners_share() -> None:
    decision = make_rule("work").decide(3.0, 1.0)
    assert decision == MixDecision(0.25, 2.0, "work: partner holds 25% of the pair's work")


@pytest.mark.parametrize(
    ("policy_name", "reason"), [("uniform", "uniform: equal shares"), ("work", "work: neither side has work, equal shares")]
)
def test_two_peers_without_work_take_equal_shares(policy_name: str, reason: str) -> None:
    assert make_rule(policy_name).decide(0.0, 0.0) == MixDecision(0.5, 0.0, reason, screen=False)


# --- newcomers ----------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(w=positive_weights, seed_l=seeds, seed_r=seeds)
@settings(deadline=None)
def test_peer_without_work_adopts_its_partners_model(policy_name: str, w: float, seed_l: int, seed_r: int) -> None:
    theta_new, theta_old, mix_new, mix_old, merged_new, merged_old = _both_sides(policy_name, 0.0, w, seed_l, seed_r)
    assert mix_new == MixDecision(1.0, w / 2, "local model has no work yet: adopt the partner's", screen=False)
    assert mix_old == MixDecision(0.0, w / 2, "partner has no work yet: keep the local model")
    assert all(torch.equal(merged_old[n], theta_old[n]) for n in theta_old)  # share 0: bit-exact
    # share 1: snapshot + (remote - snapshot) is exact up to one rounding of the larger magnitude
    assert _close(merged_new, theta_old, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_peer_without_work_adopts_exactly_representable_parameters_bit_for_bit(policy_name: str) -> None:
    snapshot = {"w": torch.tensor([0.0, 1.0, -3.0, 8.0])}
    remote = {"w": torch.tensor([2.5, -1.0, 5.0, 0.25])}
    decision = make_rule(policy_name).decide(0.0, 4.0)
    assert torch.equal(_merged(snapshot, remote, decision.remote_share)["w"], remote["w"])


# --- in-flight progress ------------------------------------------------------------


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(w_l=weights, w_r=weights, seed_l=seeds, seed_r=seeds, seed_d=seeds)
@settings(deadline=None)
def test_delta_applied_to_a_moved_live_model_keeps_its_progress(
    policy_name: str, w_l: float, w_r: float, seed_l: int, seed_r: int, seed_d: int
) -> None:
    snapshot, remote = _state(seed_l), _state(seed_r)
    progress = _state(seed_d, scale=0.01)
    live = {n: snapshot[n] + progress[n] for n in snapshot}  # the loop kept stepping during the exchange
    share = make_rule(policy_name).decide(w_l, w_r).remote_share
    delta = MergeDelta(snapshot, remote, share)
    merged = _merged(snapshot, remote, share)
    assert _close({n: live[n] + delta[n] for n in live}, {n: merged[n] + progress[n] for n in merged})


def test_merge_delta_covers_the_snapshots_tensors_only() -> None:
    snapshot = {"w": torch.zeros(2)}
    remote = {"w": torch.ones(2), "extra": torch.ones(1)}
    delta = MergeDelta(snapshot, remote, 0.25)
    assert list(delta) == ["w"]
    assert torch.equal(delta["w"], torch.full((2,), 0.25))
    assert torch.equal(snapshot["w"], torch.zeros(2))  # inputs are not modified


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
@given(w=weights)
def test_a_peer_without_work_never_screens_its_partner(policy_name: str, w: float) -> None:
    # Nothing of its own to defend; and screening identical initial models would learn a zero radius.
    assert make_rule(policy_name).decide(0.0, w).screen is False
    assert make_rule(policy_name).decide(1.0 + w, w).screen is True


def test_optimizer_state_handling_is_a_registry_that_make_rule_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_rule("work").optimizer_state == () and list(OPTIMIZER_STATE) == ["keep"]
    monkeypatch.setitem(OPTIMIZER_STATE, "momentum-test", ("momentum_buffer",))
    assert make_rule("uniform", optimizer_state="momentum-test").optimizer_state == ("momentum_buffer",)
    with pytest.raises(ValueError, match=r"unknown optimizer state handling 'average'; choose from \['keep', 'momentum-test'\]"):
        make_rule("work", optimizer_state="average")
