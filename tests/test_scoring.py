"""Scored merges: the held loss a partner's model adds or removes decides, and trust decides which merges are scored."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from murmur.node.learn.scoring import MergeScorer, Score, Trust, held_batches


def regression(seed: int = 0) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """A linear model, held batches of y = x·w, and the true weights as a state."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(1, 4, generator=g)
    xs = [torch.randn(16, 4, generator=g) for _ in range(2)]
    model = nn.Linear(4, 1, bias=False)
    return model, [(x, x @ w.T) for x in xs], {"weight": w}


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


def test_a_merge_that_lowers_the_held_loss_passes_and_says_by_how_much() -> None:
    model, batches, truth = regression()
    scorer = MergeScorer(model, mse, batches, tolerance=0.01)
    local = {"weight": truth["weight"] + 0.5}
    score = scorer.score(local, truth, 0.5)
    assert score.passed and score.merged_loss < score.local_loss and score.change < 0
    assert score.reason.startswith("scored: held loss -")


def test_a_merge_that_raises_the_held_loss_fails_with_the_rise_as_its_reason() -> None:
    model, batches, truth = regression()
    scorer = MergeScorer(model, mse, batches, tolerance=0.01)
    local = {"weight": truth["weight"] + 0.1}
    poisoned = {"weight": -truth["weight"]}
    score = scorer.score(local, poisoned, 0.5)
    assert not score.passed and score.change > 0.01
    assert score.reason == f"scored: merging the partner's model raises our held loss by {score.change:.1%}"


def test_the_held_loss_of_a_state_ignores_names_outside_the_model_and_leaves_the_model_alone() -> None:
    model, batches, truth = regression()
    before = model.weight.detach().clone()
    scorer = MergeScorer(model, mse, batches)
    assert scorer.held_loss({**truth, "optimizer.weight.exp_avg": torch.ones(1, 4)}) == pytest.approx(0.0, abs=1e-10)
    assert torch.equal(model.weight, before)  # scoring loads a scratch copy, never the model itself


def test_bad_scorer_settings_are_refused() -> None:
    model, batches, _ = regression()
    with pytest.raises(ValueError, match="at least one held batch"):
        MergeScorer(model, mse, [])
    with pytest.raises(ValueError, match="tolerance"):
        MergeScorer(model, mse, batches, tolerance=-0.1)


PASS = Score(1.0, 0.99, True, "scored: held loss -1.0%")
FAIL = Score(1.0, 1.05, False, "scored: merging the partner's model raises our held loss by 5.0%")


def test_trust_scores_a_new_peer_always_and_a_proven_one_less_but_never_never() -> None:
    trust = Trust(ramp=4.0, min_rate=0.2)
    assert trust.rate("p") == 1.0
    for _ in range(4):
        trust.record("p", PASS)
    assert trust.rate("p") == 0.5
    for _ in range(100):
        trust.record("p", PASS)
    assert trust.rate("p") == 0.2
    assert sum(trust.should_score("p", random.Random(i)) for i in range(1000)) in range(150, 250)


def test_a_pass_that_raises_the_held_loss_earns_no_trust() -> None:
    trust = Trust(ramp=1.0, min_rate=0.1)
    worse = Score(1.0, 1.005, True, "scored: held loss +0.5%")  # within the tolerance: merged, but no evidence of help
    for _ in range(10):
        trust.record("p", worse)
    assert trust.rate("p") == 1.0 and trust.failures == {}
    trust.record("p", PASS)
    assert trust.rate("p") == 0.5


def test_one_failure_wipes_a_peers_record_and_refuses_its_next_merges_unscored() -> None:
    trust = Trust(ramp=4.0, min_rate=0.2, probation=2)
    for _ in range(50):
        trust.record("p", PASS)
    assert trust.on_probation("p") is None
    trust.record("p", FAIL)
    assert trust.rate("p") == 1.0 and trust.failures == {"p": 1}
    assert trust.on_probation("p") == "on probation after a failed score (1 more merges refused)"
    assert trust.on_probation("p") == "on probation after a failed score (0 more merges refused)"
    assert trust.on_probation("p") is None


def test_a_peer_whose_models_add_loss_on_average_shows_no_evidence_of_training() -> None:
    trust = Trust(window=4, min_evidence=3, max_mean_change=0.002)
    stale = Score(1.0, 1.006, True, "scored: held loss +0.6%")  # each within the tolerance
    trust.record("echo", stale)
    trust.record("echo", stale)
    assert trust.lacks_evidence("echo") is None  # too few scores to judge
    trust.record("echo", stale)
    assert trust.lacks_evidence("echo") == "no evidence of training: its last 3 scored models raised our held loss by 0.60% on average"
    for _ in range(4):
        trust.record("worker", PASS)
    assert trust.lacks_evidence("worker") is None


def test_held_batches_take_the_first_windows_of_a_stream_across_its_batches() -> None:
    def stream():
        for k in range(10):
            yield torch.full((4, 2), float(k)), torch.zeros(4)

    held = held_batches(stream(), 6)
    assert [len(x) for x, _ in held] == [4, 2] and held[1][0][0, 0] == 1.0
    with pytest.raises(ValueError, match="at least one held window"):
        held_batches(stream(), 0)
