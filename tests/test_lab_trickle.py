"""`python -m lab.trickle`: trickling partners against a real `murmur run` victim, and the summary of what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.trickle import main, summarize


def _sample(t: float, rss: float, holding: int, merged: int) -> dict:
    return {"t": t, "victim_rss_mb": rss, "slots_held_by_tricklers": holding,
            "victim_exchanges": {"merged": merged}, "honest_exchanges": {}}  # fmt: skip


def test_the_summary_splits_the_run_into_before_attack_and_after() -> None:
    samples = [
        _sample(0, 100, 0, 0),
        _sample(5, 102, 0, 4),  # before: 4 merges
        _sample(10, 130, 1, 4),
        _sample(15, 140, 0, 5),
        _sample(19, 120, 1, 5),  # attack: 1 merge
        _sample(24, 101, 0, 5),
        _sample(29, 100, 0, 9),
    ]  # after (from attack end + bound): 4 merges
    holds = [
        {"trickler": 0, "accepted_s": 10, "held_s": 2.0, "cut_by_victim": True},
        {"trickler": 1, "accepted_s": 13, "held_s": 3.0, "cut_by_victim": True},
        {"trickler": 1, "accepted_s": 18, "held_s": 2.0, "cut_by_victim": False},
    ]  # ended by the attack's end
    outcomes = [{"result": "failed", "reason": "timed out after 3s", "duration_s": 3.01}]
    result = {"samples": samples, "holds": holds, "answers": {"busy": 7}, "victim_outcomes": outcomes}
    summary = summarize(result, calm=10, attack_s=10, bound_s=3)  # fmt: skip
    assert summary["holds_cut_by_victim"] == 2 and summary["held_s_max"] == 3.0
    assert summary["slot_held_share_during_attack"] == pytest.approx(2 / 3)
    assert (summary["victim_rss_mb_before_median"], summary["victim_rss_mb_attack_max"]) == (101, 140)
    assert summary["victim_rss_mb_after_median"] == 100.5
    assert (summary["victim_merges_before"], summary["victim_merges_attack"], summary["victim_merges_after"]) == (
        4,
        1,
        4,
    )
    assert summary["victim_ended_trickles"] == {"failed: timed out after 3s": 1}


@pytest.mark.slow
def test_a_short_attack_is_cut_off_by_the_victim(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = [
        "--task",
        "digits",
        "--tricklers",
        "2",
        "--calm",
        "3",
        "--attack",
        "8",
        "--exchange-timeout",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    run = json.loads((tmp_path / "trickle.json").read_text())
    ended = run["summary"]["victim_ended_trickles"]
    assert run["summary"]["holds_cut_by_victim"] >= 1, run["holds"]
    # At the timeout, or sooner once the honest peer, which merged with the victim before, asks.
    assert any(reason.startswith(("failed: timed out after 1", "failed: preempted by ")) for reason in ended), ended
    assert "slot_held_share_during_attack:" in capsys.readouterr().out
