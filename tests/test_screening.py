"""Screening partners: work claims capped at what is plausible, models clipped or rejected by distance."""

import torch

from murmur.node.learn.screening import ClippedGossip, WorkClaimLimiter


def model(scale: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20, 5, generator=g) * scale, "b": torch.randn(5, generator=g) * scale}


def nudge(m: dict[str, torch.Tensor], size: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + size * torch.randn(t.shape, generator=g) for n, t in m.items()}


def test_plausible_claims_pass_and_inflated_ones_are_capped_and_flagged() -> None:
    limiter = WorkClaimLimiter(ratio=4.0, speed_factor=10.0)
    assert limiter.credit("p", 900.0, local_work=1000.0, local_rate=10.0, now=0.0).reason == "claim plausible"
    capped = limiter.credit("q", 5000.0, local_work=1000.0, local_rate=10.0, now=0.0)
    assert (capped.work, capped.offence) == (4000.0, False)
    assert capped.reason == "claimed work 5e+03 capped at 4e+03 (ours 1e+03)"
    inflated = limiter.credit("r", 1000.0 * 1000, local_work=1000.0, local_rate=10.0, now=0.0)
    assert inflated.work == 4000.0 and inflated.offence


def test_claims_may_grow_by_what_a_much_faster_peer_could_compute_meanwhile() -> None:
    limiter = WorkClaimLimiter(ratio=4.0, speed_factor=10.0)
    limiter.credit("p", 100.0, local_work=100.0, local_rate=10.0, now=0.0)
    # 10 s at 10x our 10 samples/s: up to 1000 more than 4x our work.
    assert limiter.credit("p", 1400.0, local_work=100.0, local_rate=10.0, now=10.0).work == 1400.0
    assert limiter.credit("p", 1e9, local_work=100.0, local_rate=10.0, now=10.0).work == 400.0


def test_ceiling_caps_every_claim() -> None:
    assert WorkClaimLimiter(ceiling=50.0).credit("p", 1e6, local_work=1e6, local_rate=1.0, now=0.0).work == 50.0


def test_scaled_and_noise_models_are_rejected_as_offences() -> None:
    screen = ClippedGossip()
    local = model()
    scaled = screen.screen(local, {n: t * 1000 for n, t in local.items()})
    assert scaled.pull is None and scaled.offence
    noise = screen.screen(local, model(scale=30.0, seed=1))
    assert noise.pull is None and noise.offence and "more than 3x our norm" in noise.reason
    accepted = screen.screen(local, nudge(local, 0.01, 2))
    assert accepted.reason == "accepted" and accepted.pull == 1.0


def test_far_models_are_clipped_to_the_learned_radius_not_rejected() -> None:
    screen = ClippedGossip(clip_factor=3.0, min_history=4)
    local = model()
    for seed in range(4):
        assert screen.screen(local, nudge(local, 0.01, seed)).reason == "accepted"
    far = nudge(local, 0.2, 9)  # ~20x the usual distance: a stale but honest model
    result = screen.screen(local, far)
    assert result.reason.startswith("clipped from") and not result.offence
    assert result.pull is not None and 0 < result.pull < 0.5  # pulled less than half the way


def test_the_radius_widens_again_after_honest_drift() -> None:
    screen = ClippedGossip(clip_factor=3.0, min_history=4)
    local = model()
    for seed in range(4):
        screen.screen(local, nudge(local, 0.01, seed))
    drifted = nudge(local, 0.5, 7)
    results = [screen.screen(local, drifted) for _ in range(64)]
    assert results[0].reason.startswith("clipped") and results[-1].reason == "accepted"


def test_identical_models_teach_no_radius() -> None:
    # Peers that just merged (or have not trained yet) exchange identical models: a zero
    # distance in the history would make the radius zero and clip every later merge to nothing.
    screen = ClippedGossip(min_history=4)
    local = model()
    for _ in range(10):
        assert screen.screen(local, dict(local)) == screen.screen(local, dict(local))
    assert not screen.history
    assert screen.screen(local, nudge(local, 0.01, 1)).pull == 1.0
