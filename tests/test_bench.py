"""The benchmark harness end to end on its smallest configuration (no timing asserts)."""

import json
from pathlib import Path

import pytest

from scripts.bench_heterogeneous import METHODS, run_bench


@pytest.mark.slow
def test_smallest_bench_runs_every_method_and_writes_its_outputs(tmp_path: Path) -> None:
    config = {"tasks": ["digits"], "mixes": {"digits": ["pair"]}, "seeds": [0], "max_s": {"digits": 4.0}}
    run_bench(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["method"] for r in results] == ["ideal", *METHODS]
    for r in results:
        assert r["samples_per_s"] > 0 and r["curve"], r["method"]
        assert len(r["peers"]) == 2
        assert all(0 <= p["idle_fraction"] <= 1 for p in r["peers"])
    murmur = [r for r in results if r["method"].startswith("murmur")]
    assert all(r["exit_codes"] == [0, 0] for r in murmur)
    assert all(sum(p["exchanges"].get("merged", 0) for p in r["peers"]) > 0 for r in murmur)
    assert all(r["consensus"] for r in murmur)
    table = (tmp_path / "summary.md").read_text()
    assert "| digits | pair | murmur-work |" in table
    assert (tmp_path / "digits-metric-vs-time.png").stat().st_size > 0
    assert (tmp_path / "digits-throughput-vs-ideal.png").stat().st_size > 0


def test_metric_at_equal_samples_interpolates_between_evaluations() -> None:
    from scripts.bench_heterogeneous import _at_samples

    run = {"curve": [{"samples": 0, "loss": 5.0}, {"samples": 1000, "loss": 3.0}, {"samples": 3000, "loss": 2.0}]}
    assert _at_samples(run, "loss", 500) == pytest.approx(4.0)
    assert _at_samples(run, "loss", 2000) == pytest.approx(2.5)
    assert _at_samples(run, "loss", 3000) == pytest.approx(2.0)
    assert _at_samples(run, "loss", 3001) is None  # beyond the run: never extrapolated
