"""Tests for the synchronous baseline paced by a speed trace (`run_sync(..., trace=...)`): 2 gloo ranks, ~2 s."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from lab import sync_baseline as sb
from lab.traces import PeerTrace, Trace

STEP_MS = 10.0


def test_a_sleeping_trace_peer_holds_up_the_whole_group() -> None:
    # Rank 0 is trace peer 0 (x1 all along); rank 1 is peer 2 (x2), asleep from 0.5 s to 1.5 s of training.
    trace = Trace((PeerTrace((0.0,), (1.0,)), PeerTrace((0.0,), (3.0,)), PeerTrace((0.0, 0.5, 1.5), (2.0, None, 2.0))))
    r = sb.run_sync("digits", [1.0, 1.0], "proportional", 2.0, STEP_MS, None, trace=trace, slots=[0, 2])
    json.dumps(r)
    awake, sleeper = r["peers"]
    assert [awake["slowdown"], sleeper["slowdown"]] == [1.0, 2.0]  # the trace's, not the slowdowns given
    assert r["slowdowns"] == [1.0, 2.0] and r["batches"] == [43, 21]  # split by the traced speeds
    assert list(r["config"]["slots"]) == [0, 2] and r["config"]["trace"] == trace.to_json()
    assert awake["comm_s"] > 0.9  # rank 0 waited out rank 1's sleep in the all-reduce ...
    assert sleeper["compute_s"] > 0.9 + awake["compute_s"] / 2  # ... which rank 1 spent in its padding
    # awake, a step takes about 43 / 32 x 10 ms on either rank: 1 s of sleep out of 2 s leaves about 75 steps
    step_s = 43 / 32 * STEP_MS / 1000
    assert r["steps"] < 0.7 * 2.0 / step_s


def test_a_trace_needs_step_time_and_a_peer_per_rank() -> None:
    trace = Trace((PeerTrace((0.0,), (1.0,)), PeerTrace((0.0,), (2.0,))))
    with pytest.raises(ValueError, match="step_time_ms"):
        sb.run_sync("digits", [1.0, 1.0], "equal", 1.0, None, None, trace=trace)
    with pytest.raises(ValueError, match="trace peer"):
        sb.run_sync("digits", [1.0, 1.0], "equal", 1.0, STEP_MS, None, trace=trace, slots=[0, 2])
    with pytest.raises(ValueError, match="trace peer"):
        sb.run_sync("digits", [1.0, 1.0, 1.0], "equal", 1.0, STEP_MS, None, trace=trace)
    assert multiprocessing.active_children() == []


def test_the_cli_names_what_is_wrong_with_a_trace_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "trace.json"
    bad.write_text('{"peers": []}')
    with pytest.raises(SystemExit) as exit_:
        sb.main(["--slowdowns", "1,1", "--step-time-ms", "10", "--trace", str(bad)])
    assert exit_.value.code == 2 and f"{bad}: expected an object" in capsys.readouterr().err
