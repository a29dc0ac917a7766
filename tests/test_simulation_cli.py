"""The simulation runner: its plan, and one tiny end-to-end run that writes and re-plots its report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.simulation.cli import main, parse_args, plan


def test_quick_runs_are_small_and_write_under_the_root(tmp_path: Path) -> None:
    args = parse_args(["--quick"], tmp_path)
    assert args.sizes == [20, 50] and (args.max_time, args.eval_every, args.report_at) == (4.0, 0.5, 2.0)
    assert args.out == tmp_path / "results/sim-quick"
    assert parse_args([], tmp_path).out == tmp_path / "docs/sim"


def test_unknown_topologies_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--topologies", "gossip,star"], Path("."))
    assert "unknown topologies ['star']" in capsys.readouterr().err


def test_alone_runs_only_at_the_smallest_size_and_allreduce_gets_its_own_time_limit(tmp_path: Path) -> None:
    configs = plan(parse_args(["--peers", "20,50", "--max-time", "3", "--allreduce-max-time", "9"], tmp_path))
    assert [(c.peers, c.topology) for c in configs] == [
        (20, "gossip"), (20, "partial"), (20, "ring"), (20, "allreduce"), (20, "alone"),
        (50, "gossip"), (50, "partial"), (50, "ring"), (50, "allreduce"),
    ]  # fmt: skip
    assert {c.max_time for c in configs if c.topology == "allreduce"} == {9.0}
    assert {c.max_time for c in configs if c.topology != "allreduce"} == {3.0}


def test_a_tiny_run_writes_results_a_summary_and_plots_and_replots_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--peers", "4", "--topologies", "gossip,allreduce", "--max-time", "0.5", "--allreduce-max-time", "0.5",
            "--eval-every", "0.25", "--report-at", "0.5", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv, root=tmp_path) == 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["argv"] == argv and saved["meta"]["report_at"] == 0.5
    assert [r["config"]["topology"] for r in saved["runs"]] == ["gossip", "allreduce"]
    assert all(r["evaluated"] == 4 and r["times"][-1] == 0.5 for r in saved["runs"])
    assert {"accuracy-vs-time.png", "consensus-vs-time.png", "time-to-target.png"} <= {
        p.name for p in tmp_path.iterdir()
    }
    summary = (tmp_path / "summary.md").read_text()
    assert "| 4 | gossip, full view |" in summary and "| 4 | ideal all-reduce |" in summary
    assert "simulate: 2 runs: [4] peers x ['gossip', 'allreduce']" in capsys.readouterr().out
    (tmp_path / "summary.md").unlink()
    assert main(["--replot", "--out", str(tmp_path)], root=tmp_path) == 0
    assert (tmp_path / "summary.md").read_text() == summary
