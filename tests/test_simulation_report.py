"""The simulator's tables read the right points off each run's curves."""

from __future__ import annotations

from typing import Any

from lab.simulation.config import SimConfig, SimResult
from lab.simulation.report import setup_text, summary_table, view_table


def _record(topology: str, accuracy: list[float], **fields: Any) -> dict[str, Any]:
    result = SimResult(SimConfig(peers=10, topology=topology, target=0.9, eval_every=0.5, linger=0.0))
    for i, a in enumerate(accuracy):
        result.record(i * 0.5, [a], 0.1 * (len(accuracy) - i), 10)
    record = result.to_json() | fields
    record["evaluated"] = result.evaluated
    return record


def test_summary_rows_read_the_report_time_and_mark_targets_not_reached() -> None:
    gossip = _record(
        "gossip", [0.1, 0.5, 0.92, 0.95], samples=3000, exchanges={"merged": 30, "busy": 4}, exchange_s=0.12
    )
    alone = _record("alone", [0.1, 0.3, 0.5, 0.6], samples=3000, wall_s=7.4, truncated=True)
    lines = summary_table([gossip, alone], report_at=1.0).splitlines()
    assert lines[0].startswith("| peers | topology |") and "accuracy at 1 s (median / p10)" in lines[0]
    assert len(lines) == 4
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # target reached at 1.0 s; at 1.0 s accuracy 0.92, consensus 0.2; 3,000 samples in 1.5 s; 30 merges / (10 × 1.5 s)
    assert cells == ["10", "gossip, full view", "1.00", "1.00", "0.920 / 0.920", "0.200", "0.950", "2,000", "2.00",
                     "0.120", "4", "1.5", "0"]  # fmt: skip
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[1:4] == ["no averaging", "> 1.5", "> 1.5"] and cells[9] == "—" and cells[-1] == "7 (truncated)"


def test_the_view_table_lists_only_runs_with_partial_views() -> None:
    assert view_table([_record("gossip", [0.5])]) == ""
    view = {"size_min": 3, "size_mean": 4.5, "size_max": 5, "indegree_mean": 4.5, "indegree_max": 9,
            "dead_fraction": 0.02, "connected": 1.0}  # fmt: skip
    table = view_table([_record("gossip", [0.5]), _record("partial", [0.5], view=view)])
    assert table.splitlines()[2] == "| 10 | 3 / 4.5 / 5 | 4.5 / 9 | 2.0% | yes |"


def test_the_setup_paragraph_states_the_first_runs_model() -> None:
    text = setup_text([_record("gossip", [0.5])])
    assert "target held-out accuracy 0.9" in text and "Pareto(α=1.5) capped at 30" in text and "Seed 0" in text
