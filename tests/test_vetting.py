"""Vetting: a partner's claim, distance and score decide a merge, each refusal with its reason."""

import random

import torch
import torch.nn.functional as F
from torch import nn

from murmur.node.learn.replica import Snapshot
from murmur.node.learn.rules import WorkRule
from murmur.node.learn.scoring import MergeScorer, Trust
from murmur.node.learn.screening import ClippedGossip, WorkClaimLimiter
from murmur.node.learn.vetting import Vetting
from murmur.protocol.codec import TensorSpec, WireState, quantize

TRUTH = torch.tensor([[1.0, -2.0, 0.5, 3.0]])


def wire(weight: torch.Tensor) -> WireState:
    state = {"weight": weight}
    return quantize(state, TensorSpec.of(state), "float32")


def scorer(tolerance: float = 0.01) -> MergeScorer:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(32, 4, generator=g) for _ in range(2)]
    loss = lambda model, batch: F.mse_loss(model(batch[0]), batch[1])
    return MergeScorer(nn.Linear(4, 1, bias=False), loss, [(x, x @ TRUTH.T) for x in xs], tolerance=tolerance)


def vet(vetting: Vetting, remote: torch.Tensor, claimed: float = 1000.0, local: torch.Tensor = TRUTH + 0.2):
    return vetting.vet("partner", WorkRule(), Snapshot(wire(local), 1000.0), wire(remote), claimed, None, 10.0, 0.0)


def test_without_a_scorer_vetting_is_claims_then_screening() -> None:
    verdict = vet(Vetting(rng=random.Random(0)), TRUTH - 0.2)
    assert verdict.decision is not None and verdict.decision.remote_share == 0.5
    assert verdict.reason == "accepted" and verdict.offences == () and verdict.score is None
    assert verdict.distance is not None and verdict.distance > 0


def test_an_inflated_claim_is_an_offence_and_a_huge_model_is_rejected_as_one() -> None:
    verdict = vet(Vetting(claims=WorkClaimLimiter(), screening=ClippedGossip()), TRUTH * 1000, claimed=1e9)
    assert verdict.decision is None
    assert verdict.offences[0].startswith("claimed work 1e+09 capped at")
    assert verdict.offences[1].startswith("rejected model: model is")


def test_a_scored_merge_that_helps_passes_and_says_so() -> None:
    verdict = vet(Vetting(scorer=scorer(), rng=random.Random(0)), TRUTH - 0.1)
    assert verdict.decision is not None and verdict.score is not None and verdict.score.passed
    assert verdict.reason.startswith("accepted; scored: held loss -")


def test_a_poisoned_model_inside_the_distance_bound_is_refused_by_its_score() -> None:
    vetting = Vetting(scorer=scorer(tolerance=0.01), strike_factor=1e9, rng=random.Random(0))
    verdict = vet(vetting, TRUTH + 0.6)  # within 3x our norm: screening alone would merge it
    assert verdict.decision is None and verdict.offences == ()
    assert verdict.reason.startswith("scored: merging the partner's model raises our held loss by")
    assert vetting.trust.failures == {"partner": 1}


def test_a_model_far_worse_than_the_tolerance_is_also_a_strike() -> None:
    verdict = vet(Vetting(scorer=scorer(tolerance=0.01), strike_factor=10.0, rng=random.Random(0)), -TRUTH)
    assert verdict.decision is None and verdict.offences == (verdict.reason,)


def test_a_trusted_peer_is_scored_only_sometimes() -> None:
    vetting = Vetting(scorer=scorer(), trust=Trust(ramp=1.0, min_rate=0.0), rng=random.Random(0))
    vetting.trust.passes["partner"] = 10**9
    verdict = vet(vetting, TRUTH - 0.1)
    assert verdict.decision is not None and verdict.score is None and verdict.reason == "accepted"


def test_after_a_failed_score_a_partner_is_refused_unscored_for_a_while() -> None:
    vetting = Vetting(scorer=scorer(tolerance=0.01), trust=Trust(probation=1), strike_factor=1e9, rng=random.Random(0))
    assert vet(vetting, TRUTH + 0.6).reason.startswith("scored: merging")
    verdict = vet(vetting, TRUTH - 0.1)  # even a good model: the partner is on probation
    assert verdict.decision is None and verdict.score is None
    assert verdict.reason == "on probation after a failed score (0 more merges refused)"
    assert vet(vetting, TRUTH - 0.1).decision is not None


def test_a_partner_whose_models_add_loss_on_average_is_refused_for_lack_of_evidence() -> None:
    vetting = Vetting(scorer=scorer(tolerance=0.5), trust=Trust(ramp=1e9, min_evidence=2, max_mean_change=0.0),
                      rng=random.Random(0))  # scores every merge
    first = vet(vetting, TRUTH + 0.25)  # slightly worse than ours, within the tolerance
    assert first.decision is not None and first.score is not None and first.score.change > 0
    second = vet(vetting, TRUTH + 0.25)
    assert second.decision is None and second.reason.startswith("no evidence of training: its last 2 scored models")
