"""Tests for lab/rebalance.py: the split rules, the speed meter and the resizable batch stream; and mode
`adaptive` end to end (2 gloo ranks, ~2 s of training, paced by a trace)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from lab import rebalance as rb
from lab import sync_baseline as sb
from lab import sync_rank as sr
from lab.traces import PeerTrace, Trace


def test_proportional_split_rounds_half_up_with_a_floor_of_one() -> None:
    # 64 * 1 / 1.5 = 42.67 -> 43 ; 64 * 0.5 / 1.5 = 21.33 -> 21
    assert rb.proportional_split(64, [1.0, 0.5]) == [43, 21]
    assert rb.proportional_split(10, [1.0, 1.0]) == [5, 5]
    assert rb.proportional_split(3, [1.0, 0.5, 0.5]) == [2, 1, 1]  # 1.5 -> 2, 0.75 -> 1 (half up)
    assert rb.proportional_split(4, [1.0, 1e-9]) == [4, 1]  # never below 1
    for bad in ([], [1.0, 0.0], [1.0, float("inf")], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="speeds"):
            rb.proportional_split(64, bad)


@pytest.mark.parametrize("slowdowns", [[1, 2], [1, 1, 2, 4], [1, 3, 7], [1, 100]])
def test_proportional_split_is_the_proportional_modes_rule(slowdowns: list[float]) -> None:
    # speeds measured equal to the slowdowns' give the split proportional mode starts from
    speeds = [1.0 / s for s in slowdowns]
    assert rb.proportional_split(32 * len(slowdowns), speeds) == sr.batch_sizes(32, slowdowns, "proportional")
    assert sr.batch_sizes(32, slowdowns, "adaptive") == sr.batch_sizes(32, slowdowns, "proportional")


def test_steps_split_gives_the_fastest_rank_all_its_local_steps() -> None:
    assert rb.steps_split(16, [1.0, 0.5, 0.25]) == [16, 8, 4]
    assert rb.steps_split(16, [3.0, 1.0]) == [16, 5]  # 5.33 -> 5
    assert rb.steps_split(10, [2.0, 0.25]) == [10, 1]  # 1.25 -> 1
    assert rb.steps_split(4, [1.0, 0.01]) == [4, 1]  # never below 1
    assert rb.steps_split(8, [0.5, 1.0]) == [4, 8]  # the fastest need not be rank 0


def test_balance_shares_seconds_per_sample_through_summed_slots() -> None:
    ranks = [rb.Balance([1.0, 1.0]) for _ in range(2)]
    ranks[0].add(0.010, 32)
    ranks[0].add(0.010, 32)  # 10 ms per 32 samples
    ranks[1].add(0.040, 32)  # 4 times slower
    slots = torch.zeros(2)
    for rank, balance in enumerate(ranks):  # each writes its own slot into its buffer; the all-reduce sums them
        mine = torch.zeros(2)
        balance.write(mine, rank)
        slots += mine
    for balance in ranks:
        speeds = balance.update(slots)
        assert speeds == pytest.approx([3200.0, 800.0])
        assert balance.count == 1
    assert rb.proportional_split(64, speeds) == [51, 13]


def test_a_rank_that_measured_nothing_keeps_its_speed() -> None:
    balance = rb.Balance([2.0, 1.0])
    mine = torch.full((2,), 9.0)
    balance.write(mine, 1)
    assert mine.tolist() == [9.0, 0.0]  # nothing measured: 0; the other slot untouched
    assert balance.update(torch.tensor([0.5, 0.0])) == [2.0, 1.0]
    balance.add(1.0, 4)
    balance.update(torch.tensor([0.0, float("nan")]))
    assert balance.speeds == [2.0, 1.0]
    with pytest.raises(ValueError):
        rb.Balance([1.0, 0.0])


def _numbered(rows: int = 4) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    start = 0
    while True:
        yield torch.arange(start, start + rows).float().unsqueeze(1), torch.arange(start, start + rows)
        start += rows


def test_resized_batches_keeps_row_order() -> None:
    got = rb.ResizedBatches(_numbered(), 6)
    for k in range(3):
        x, y = next(got)
        assert x.shape == (6, 1)
        assert y.tolist() == list(range(6 * k, 6 * k + 6))


def test_resized_batches_change_size_without_skipping_or_repeating_a_row() -> None:
    got = rb.ResizedBatches(_numbered(), 3)
    seen: list[int] = []
    for size in (3, 10, 1, 1, 7, 2, 13, 5):
        got.size = size
        x, y = next(got)
        assert len(y) == size and x[:, 0].long().tolist() == y.tolist()
        seen += y.tolist()
    assert seen == list(range(len(seen)))


# ---------------------------------------------------------------------- end to end


def test_adaptive_mode_moves_samples_to_the_rank_that_stays_fast() -> None:
    # Both ranks start at x1 (so the first split is even); rank 1 drops to x4 after 0.5 s. Measured
    # speeds then give rank 0 about 4 / 5 of each step.
    trace = Trace((PeerTrace((0.0,), (1.0,)), PeerTrace((0.0, 0.5), (1.0, 4.0))))
    r = sb.run_sync("digits", [1.0, 1.0], "adaptive", 2.0, 10.0, None, rebalance_every=5, trace=trace)
    assert r["method"] == "sync-adaptive" and r["rebalance_every"] == 5
    assert [p["slowdown"] for p in r["peers"]] == [1.0, 1.0]  # the trace's initial slowdowns
    assert r["rebalances"] >= 5
    fast, slow = r["batches"]
    assert fast > 2.5 * slow
    assert [p["batch"] for p in r["peers"]] == r["batches"]
    # batches changed along the way: a rank's samples are no longer steps x batch, but every sample counts
    assert all(p["steps"] == r["steps"] for p in r["peers"])
    assert r["peers"][0]["samples"] != r["steps"] * fast
    assert r["curve"][-1]["samples"] == r["samples"] == sum(p["samples"] for p in r["peers"])
    assert r["curve"][-1]["accuracy"] > r["curve"][0]["accuracy"] + 0.3
