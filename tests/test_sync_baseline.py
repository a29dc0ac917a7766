"""Tests for lab/sync_baseline.py: the synchronous all-reduce baseline, end to end.

Each run forks real gloo ranks (2 processes, ~3 s of training each); the ranks' helpers
are tested in tests/test_sync_rank.py.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import time
from typing import Any, Iterator

import pytest

from lab import sync_baseline as sb
from murmur.node.learn.tasks import DigitsTask

SLOWDOWNS = [1.0, 2.0]
DURATION = 3.0
STEP_MS = 10.0


class FailingTask(DigitsTask):
    """Digits, except that shard 1 (rank 1) raises after a few batches."""

    def train_batches(self, shard: int) -> Iterator[Any]:
        for i, batch in enumerate(super().train_batches(shard)):
            if shard == 1 and i == 5:
                raise RuntimeError("boom from the failing task")
            yield batch


# ---------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def equal_run() -> dict[str, Any]:
    return sb.run_sync("digits", SLOWDOWNS, "equal", DURATION, STEP_MS, None)


@pytest.fixture(scope="module")
def proportional_run() -> dict[str, Any]:
    # a target reached within the budget: the ranks stop early, together
    return sb.run_sync("digits", SLOWDOWNS, "proportional", DURATION, STEP_MS, 0.8, seed=1)


@pytest.fixture(params=["equal", "proportional"])
def mode_and_run(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    return request.param, request.getfixturevalue(f"{request.param}_run")


def _grad_bytes() -> int:
    return sum(p.numel() * p.element_size() for p in DigitsTask().build_model().parameters())


def test_structure_and_accounting(mode_and_run: tuple[str, dict[str, Any]]) -> None:
    mode, r = mode_and_run
    json.dumps(r)  # JSON-serialisable
    assert r["method"] == f"sync-{mode}"
    assert r["task"] == "digits" and r["metric"] == "accuracy"
    assert r["slowdowns"] == SLOWDOWNS
    for key in ("curve", "time_to_target", "samples_per_s", "peers", "wall_s", "startup_s"):
        assert key in r
    assert r["startup_s"] > 0

    expected = {"equal": [32, 32], "proportional": [43, 21]}[mode]
    assert [p["batch"] for p in r["peers"]] == expected
    steps = r["steps"]
    assert steps > 0
    for p, batch in zip(r["peers"], expected):
        assert set(p) >= {"rank", "slowdown", "batch", "samples", "compute_s", "idle_fraction", "bytes_sent"}
        assert p["steps"] == steps  # synchronous: everyone takes every step
        assert p["samples"] == steps * batch
        assert 0.0 <= p["idle_fraction"] <= 1.0
        assert p["bytes_sent"] == int(steps * 2 * (2 - 1) / 2 * _grad_bytes())
    assert r["samples"] == steps * sum(expected)
    assert r["samples_per_s"] == pytest.approx(r["samples"] / r["wall_s"])

    curve = r["curve"]
    assert curve[0]["t"] == 0.0 and curve[0]["samples"] == 0
    assert [pt["t"] for pt in curve] == sorted(pt["t"] for pt in curve)
    assert curve[-1]["samples"] == r["samples"]  # the last point is taken at the end
    assert curve[-1]["t"] <= r["wall_s"] + 1e-6
    assert all(math.isfinite(pt["accuracy"]) and 0.0 <= pt["accuracy"] <= 1.0 for pt in curve)
    assert curve[-1]["accuracy"] > curve[0]["accuracy"]  # it learned


def test_equal_mode_runs_the_budget_and_the_fast_rank_waits(equal_run: dict[str, Any]) -> None:
    r = equal_run
    assert r["time_to_target"] is None
    assert DURATION <= r["wall_s"] < DURATION + 1.0
    fast, slow = r["peers"]
    assert fast["idle_fraction"] > slow["idle_fraction"]
    # the fast rank computes ~10 ms and waits ~10 ms for the slow one (20 ms) each step
    assert fast["idle_fraction"] > 0.3


def test_proportional_mode_stops_at_target(proportional_run: dict[str, Any], equal_run: dict[str, Any]) -> None:
    r = proportional_run
    assert r["time_to_target"] is not None
    assert r["curve"][-1]["accuracy"] >= 0.8
    assert r["time_to_target"] == r["curve"][-1]["t"]  # stopped at the first evaluation that met it
    assert r["wall_s"] < DURATION
    # batches proportional to speed even out the step (~13 ms each): the fast rank
    # does not wait half of every step as it does in equal mode
    assert max(p["idle_fraction"] for p in r["peers"]) < equal_run["peers"][0]["idle_fraction"]


def test_a_sample_budget_keeps_the_ranks_training_past_the_target() -> None:
    r = sb.run_sync("digits", SLOWDOWNS, "proportional", DURATION, STEP_MS, 0.3, eval_every=0.25, seed=1, min_samples=4_000)
    *before, last = r["curve"]
    assert last["accuracy"] >= 0.3 and last["samples"] >= 4_000
    assert r["time_to_target"] < last["t"] < DURATION  # it met the target earlier and went on, then stopped
    assert before[-1]["samples"] < 4_000  # at the first evaluation past the budget


def test_the_ranks_evaluate_their_weight_average(equal_run: dict[str, Any]) -> None:
    # An average that all but ignores each step scores (nearly) the initial model all run long.
    r = sb.run_sync("digits", SLOWDOWNS, "equal", 1.0, STEP_MS, None, eval_every=0.25, ema_decay=0.99999)
    first, *rest = (p["accuracy"] for p in r["curve"])
    assert len(rest) >= 2 and all(abs(a - first) < 0.02 for a in rest)
    assert equal_run["curve"][-1]["accuracy"] > first + 0.3  # while the live model learns


def test_rank_failure_ends_every_rank() -> None:
    start = time.monotonic()
    with pytest.raises(sb.RankFailed, match="boom from the failing task"):
        sb.run_sync(f"{__name__}:FailingTask", SLOWDOWNS, "equal", 60.0, STEP_MS, None, pg_timeout_s=120)
    # rank 0, blocked in an all-reduce, was ended at once: no wait for the collective
    # timeout or the 60 s budget (the slack is for start-up on a busy machine)
    assert time.monotonic() - start < 40
    assert multiprocessing.active_children() == []


def test_bad_arguments_start_no_rank() -> None:
    with pytest.raises(ValueError, match="mode"):
        sb.run_sync("digits", SLOWDOWNS, "bogus", DURATION, STEP_MS, None)
    with pytest.raises(ValueError, match="slowdowns"):
        sb.run_sync("digits", [1.0, 0.0], "equal", DURATION, STEP_MS, None)
    assert multiprocessing.active_children() == []


def test_over_links_every_rank_needs_a_namespace_and_a_work_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="namespace"):
        sb.run_sync("digits", SLOWDOWNS, "equal", DURATION, STEP_MS, None, links=[], work_dir=tmp_path)
    assert multiprocessing.active_children() == []
