"""Speed traces (`lab.traces`): the file format and its errors, the named scenarios, and pacing that follows a trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.traces import SCENARIOS, Event, PeerTrace, Trace, TracedPacing, TraceError, load, scenario


def test_a_trace_file_round_trips(tmp_path: Path) -> None:
    trace = scenario("churn", [1, 1, 2, 4], 90, seed=0)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_json()))
    assert load(path) == trace


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], 'expected an object with a non-empty list "peers"'),
        ({"peers": []}, 'expected an object with a non-empty list "peers"'),
        ({"peers": [{"t": [0, 1], "slowdown": [1]}]}, "peers[0]: \"t\" and \"slowdown\" must be non-empty and of one length"),
        ({"peers": [{"t": [1], "slowdown": [1]}]}, "peers[0].t: the first time must be 0"),
        ({"peers": [{"t": [0, 5, 5], "slowdown": [1, 2, 3]}]}, "peers[0].t: times must rise"),
        ({"peers": [{"t": [0, "x"], "slowdown": [1, 2]}]}, "peers[0].t: 'x' is not a finite number"),
        ({"peers": [{"t": [0], "slowdown": [-2]}]}, "peers[0].slowdown: -2 must be positive"),
        ({"peers": [{"t": [0, 3], "slowdown": [1, None]}]}, "a peer must wake"),
        ({"peers": [{"t": [0], "slowdown": [1]}], "events": [{"t": 1, "peer": 2, "action": "leave"}]}, "events[0].peer: 2 is not a peer"),
        ({"peers": [{"t": [0], "slowdown": [1]}], "events": [{"t": 1, "peer": 0, "action": "explode"}]}, "events[0].action: 'explode'"),
        ({"peers": [{"t": [0], "slowdown": [1]}], "events": [{"t": 1, "peer": 0, "action": "join"}]}, "no peer is there from the start"),
        ({"peers": [{"t": [0], "slowdown": [1]}] * 2, "events": [{"t": 5, "peer": 1, "action": "join"},
                                                              {"t": 2, "peer": 1, "action": "crash"}]}, "peer 1 leaves before it joins"),
    ],
)
def test_a_bad_trace_is_a_trace_error_saying_where(data: object, message: str) -> None:
    with pytest.raises(TraceError, match="^trace: ") as caught:
        Trace.from_json(data)
    assert message in str(caught.value)


def test_an_unreadable_or_non_json_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TraceError, match="bad.json: not JSON"):
        load(tmp_path / "bad.json")


def test_a_step_runs_at_the_slowdowns_it_spans_and_waits_out_a_sleep() -> None:
    peer = PeerTrace((0.0, 10.0, 20.0, 30.0), (1.0, 4.0, None, 2.0))
    assert peer.finish(0.0, 1.0) == 1.0
    assert peer.finish(9.0, 2.0) == pytest.approx(14.0)  # 1 s at ×1, then 1 s of work at ×4
    assert peer.finish(19.0, 1.0) == pytest.approx(31.5)  # a quarter done by 20, asleep until 30, the rest at ×2
    assert peer.work_done(0.0, 40.0) == pytest.approx(10 + 2.5 + 0 + 5)
    assert peer.asleep() == [(20.0, 30.0)] and peer.slowdown_at(25.0) is None


def test_traced_pacing_pads_a_step_by_the_trace_at_its_clock() -> None:
    now = [9.99]
    pacing = TracedPacing(PeerTrace((0.0, 10.0), (1.0, 3.0)), step_time_ms=100, clock=lambda: now[0])
    # Began 9.95: 0.05 s of work at ×1, the other 0.05 s at ×3.
    assert pacing.step_duration(0.04, 0.04, 32) == pytest.approx(0.05 + 0.15)
    assert pacing.padding(0.01, 64) == pytest.approx(0.02 + 0.18 * 3 - 0.01)  # began 9.98: 0.2 s of work
    now[0] = 0.0
    assert pacing.step_duration(0.5, 0.5, 32) == 0.5  # a step slower than its pace is never cut


def test_scenarios_follow_their_definitions() -> None:
    mix = [1.0, 1.0, 2.0, 4.0]
    assert set(SCENARIOS) == {"static", "drift", "throttle", "sleep", "churn"}
    assert [p.slowdowns for p in scenario("static", mix, 90, 0).peers] == [(1.0,), (1.0,), (2.0,), (4.0,)]
    drift = scenario("drift", mix, 300, seed=1)
    assert drift == scenario("drift", mix, 300, seed=1) != scenario("drift", mix, 300, seed=2)
    for p in drift.peers:
        assert all(1.0 <= s <= 4.0 for s in p.slowdowns) and len(p.times) >= 15
        assert all(5.0 <= b - a <= 15.0 for a, b in zip(p.times, p.times[1:]))
    throttled = scenario("throttle", mix, 90, 0).peers[0]
    assert throttled == PeerTrace((0.0, 30.0, 60.0), (1.0, 4.0, 1.0))
    assert scenario("sleep", mix, 90, 0).peers[0].asleep() == [(30.0, 60.0)]
    churn = scenario("churn", mix, 90, 0)
    assert churn.events == (Event(30.0, 0, "leave"), Event(45.0, 4, "join"), Event(60.0, 2, "crash"))
    assert (churn.initial(), churn.present(50.0), churn.present(70.0)) == ([0, 1, 2, 3], [1, 2, 3, 4], [1, 3, 4])
    assert churn.ideal_work(90.0) == pytest.approx(30 + 90 + 30 + 90 / 4 + 45)
    with pytest.raises(TraceError, match="unknown scenario 'storm'"):
        scenario("storm", mix, 90, 0)
    assert math.isinf(churn.span(1)[1])
