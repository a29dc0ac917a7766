"""Delta gossip's model side: error feedback loses no mass, applied deltas leave residuals alone."""

from __future__ import annotations

import math

import pytest
import torch

from murmur.node.learn.deltas import (
    EXACT_BELOW,
    MAX_ORIGINS,
    STRONG,
    Compression,
    DeltaReference,
    Published,
    StaleDelta,
    compression_for,
    top_entries,
)


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g), "one": torch.randn(1, generator=g)}


def _residual(live: dict[str, torch.Tensor], ref: DeltaReference) -> dict[str, torch.Tensor]:
    return {n: live[n] - ref.reference[n] for n in live}


def _dense(delta, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {n: torch.zeros(t.numel()) for n, t in like.items()}
    for n, d in delta.items():
        out[n][d.indices] = d.values
    return {n: out[n].view_as(like[n]) for n in like}


def test_compression_counts_entries_and_refuses_what_it_cannot_send() -> None:
    assert Compression(0.01, 2).entries(1000) == 10
    assert Compression(0.01, 2).entries(5) == 1  # a tensor is never left out entirely
    assert Compression(1.0, 8).entries(7) == 7 and Compression(0.5, 4).entries(0) == 0
    for density, bits in ((0.0, 2), (1.5, 2), (0.1, 3)):
        with pytest.raises(ValueError):
            Compression(density, bits)


def test_compression_names_say_what_they_send() -> None:
    assert compression_for("none", 0.5, 8) is None
    assert compression_for("sparse", 0.02, 4) == Compression(0.02, 4)
    assert compression_for("strong", 0.5, 8) == STRONG  # its own density and bits, whatever is passed
    with pytest.raises(ValueError, match="unknown compression 'zip'"):
        compression_for("zip", 0.01, 2)


def _publish(ref: DeltaReference, live: dict, compression: Compression, scale: float, work: float) -> Published:
    return ref.publish(live, ref.select(live, compression), compression.bits, scale, work)


def test_top_entries_are_the_largest_in_ascending_order() -> None:
    assert top_entries(torch.tensor([0.1, 5.0, 0.2, 3.0, 0.3]), 2).tolist() == [1, 3]
    assert top_entries(torch.tensor([1.0, 2.0]), 5).tolist() == [0, 1]


def test_top_entries_of_a_large_tensor_are_near_the_top_and_never_too_many() -> None:
    magnitude = torch.rand(EXACT_BELOW * 2, generator=torch.Generator().manual_seed(0))
    magnitude[12345] = math.nan  # a diverged entry is always sent, so quantizing refuses it
    k = 2000
    exact = set(top_entries(magnitude, k).tolist())
    chosen = top_entries(magnitude, k, torch.Generator().manual_seed(1))
    assert chosen.numel() <= k and torch.equal(chosen, chosen.unique())  # ascending, no duplicates
    assert 12345 in chosen.tolist() and len(exact & set(chosen.tolist())) >= 0.9 * k


@pytest.mark.parametrize(("density", "bits"), [(0.1, 2), (0.5, 4), (1.0, 8)])
@pytest.mark.parametrize("scale", [0.25, 1.0])
def test_publishing_moves_exactly_the_sent_delta_out_of_the_residual(density: float, bits: int, scale: float) -> None:
    live = _model()
    ref = DeltaReference(live)
    trained = _model(1)
    for n in live:  # progress since the reference
        live[n].copy_(trained[n])
    before = {n: r.clone() for n, r in _residual(live, ref).items()}
    published = _publish(ref, live, Compression(density, bits), scale, work=10.0)
    sent = _dense(published.delta, live)
    after = _residual(live, ref)
    for n in live:  # residual after + what was sent = residual before
        torch.testing.assert_close(after[n] + sent[n], before[n], rtol=0, atol=1e-5)
    # The reference took s·u, so this peer keeps its share of what it sent.
    torch.testing.assert_close(ref.reference["w"] - DeltaReference(_model()).reference["w"], scale * sent["w"])


def test_repeated_publishing_drains_the_residual_at_the_compression_rate() -> None:
    live = _model()
    ref = DeltaReference(live)
    for n, t in _model(1).items():
        live[n].copy_(t)
    norms = [ref.residual_norm(live)]
    for _ in range(30):  # no new progress: error feedback sends what earlier deltas left out
        _publish(ref, live, Compression(0.1, 2), 1.0, work=0.0)
        norms.append(ref.residual_norm(live))
    assert norms[-1] < 0.05 * norms[0]


def test_an_applied_delta_moves_the_model_and_reference_alike() -> None:
    sender_live, receiver_live = _model(), _model()
    sender, receiver = DeltaReference(sender_live), DeltaReference(receiver_live)
    for n, t in _model(2).items():
        sender_live[n].copy_(t)
    receiver_live["w"] += 0.5  # the receiver's own progress
    own = {n: r.clone() for n, r in _residual(receiver_live, receiver).items()}
    before = {n: t.clone() for n, t in receiver_live.items()}
    published = _publish(sender, sender_live, Compression(0.2, 4), 0.5, work=3.0)
    receiver.apply(receiver_live, published)
    for n, change in _dense(published.delta, receiver_live).items():
        torch.testing.assert_close(receiver_live[n], before[n] + 0.5 * change)
        torch.testing.assert_close(_residual(receiver_live, receiver)[n], own[n])


def test_two_peers_that_applied_each_others_deltas_differ_by_their_residuals_only() -> None:
    start = _model()
    a_live, b_live = {n: t.clone() for n, t in start.items()}, {n: t.clone() for n, t in start.items()}
    a, b = DeltaReference(a_live), DeltaReference(b_live)
    for step in range(5):
        a_live["w"] += 0.1 * torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        b_live["b"] -= 0.2
        da, db = _publish(a, a_live, Compression(0.3, 8), 0.5, 1.0), _publish(b, b_live, Compression(0.3, 8), 0.5, 1.0)
        b.apply(b_live, da)
        a.apply(a_live, db)
    for n in start:  # x_a − x_b = residual_a − residual_b: the applied deltas agree
        torch.testing.assert_close(
            a_live[n] - b_live[n], _residual(a_live, a)[n] - _residual(b_live, b)[n], atol=1e-5, rtol=0
        )


def test_a_non_finite_residual_is_refused_before_anything_is_written() -> None:
    live = _model()
    ref = DeltaReference(live)
    live["b"][3] = float("nan")
    saved = {n: t.clone() for n, t in ref.reference.items()}
    with pytest.raises(ValueError):
        _publish(ref, live, Compression(1.0, 8), 1.0, 0.0)
    for n, kept in saved.items():
        assert torch.equal(ref.reference[n], kept)


def test_a_non_contiguous_tensor_is_updated_in_place() -> None:
    base = torch.randn(16, 8)
    live = {"t": base.t()}  # a transposed view: not contiguous
    ref = DeltaReference(live)
    live["t"] += 1.0
    published = _publish(ref, live, Compression(1.0, 8), 1.0, 0.0)
    assert torch.equal(base.t(), live["t"]) and published.delta["t"].indices.numel() == 128
    assert ref.residual_norm(live) < 0.1


def test_deltas_are_named_by_origin_and_sequence_and_never_applied_twice() -> None:
    a_live, b_live = _model(), _model()
    a, b = DeltaReference(a_live), DeltaReference(b_live)
    assert a.origin != b.origin
    a_live["w"] += 1.0
    first = _publish(a, a_live, Compression(0.1, 2), 0.5, 0.0)
    second = _publish(a, a_live, Compression(0.1, 2), 0.5, 0.0)
    assert (first.seq, second.seq) == (1, 2) and a.versions == {a.origin: 2}
    b.apply(b_live, second)  # a gap (first never arrived) is skipped: its mass is lost, never doubled
    before = {n: t.clone() for n, t in b_live.items()}
    for stale in (first, second):
        with pytest.raises(StaleDelta):
            b.apply(b_live, stale)
    assert all(torch.equal(b_live[n], before[n]) for n in before)


def test_versions_forget_the_least_recently_heard_origin_first() -> None:
    live = _model()
    ref = DeltaReference(live)
    ref.reset(live, {f"o{i}": 1 for i in range(MAX_ORIGINS)})
    for origin, seq in (("o0", 2), ("new", 1)):  # o0 heard again, so o1 is now the least recently heard
        ref.apply(live, Published(origin, seq, {}, 0.5, 0.0))
    assert len(ref.versions) == MAX_ORIGINS and "o1" not in ref.versions and ref.versions["o0"] == 2


def test_the_reference_and_versions_survive_a_checkpoint_exactly() -> None:
    live = _model()
    ref = DeltaReference(live)
    live["w"] += 1.0
    _publish(ref, live, Compression(0.1, 2), 0.5, 0.0)
    restored = DeltaReference(_model(5))
    restored.load_state_dict(ref.state_dict(), live)
    for n in live:
        assert torch.equal(restored.reference[n], ref.reference[n])
    assert restored.versions == {ref.origin: 1} and restored.origin != ref.origin  # a restart is a new origin
    with pytest.raises(ValueError, match="does not fit"):
        restored.load_state_dict({"reference": {"w": torch.zeros(2)}}, live)
