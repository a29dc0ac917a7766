"""Tests for lab/elastic.py and lab/elastic_rank.py: the sync baselines as an elastic job under churn.

The pure pieces (the event schedule, the membership, the choice of state, the stream skip) run in-process; the
runs (slow) fork real gloo members of `digits` on loopback for a few seconds of training each.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import time
from dataclasses import replace
from datetime import timedelta
from itertools import pairwise
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lab import elastic as el
from lab import sync_baseline as sb
from lab import sync_rank as sr
from lab.elastic_rank import Member, Plan, _restore, is_peer_failure, skipped
from lab.sync_rank import Config, Progress
from lab.traces import Event, PeerTrace, Trace

STEP_MS = 10.0


def _trace(slowdowns: list[float | None], events: list[Event]) -> Trace:
    return Trace(tuple(PeerTrace((0.0,), (s,)) for s in slowdowns), tuple(events))  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the schedule


def test_schedule_orders_the_events_and_keeps_a_member() -> None:
    leave, join = Event(2.0, 0, "leave"), Event(1.0, 2, "join")
    assert el.schedule(_trace([1, 1, 1], [leave, join])) == (join, leave)
    with pytest.raises(ValueError, match="no member at t=1"):
        el.schedule(_trace([1, 1], [Event(1.0, 0, "leave"), Event(1.0, 1, "crash")]))
    # a leave and a join at one time: the group never empties
    assert len(el.schedule(_trace([1, 1], [Event(1.0, 0, "leave"), Event(1.0, 1, "join")]))) == 2


def test_due_splits_by_training_time() -> None:
    a, b = Event(1.0, 0, "leave"), Event(2.0, 1, "crash")
    assert el.due([a, b], 0.5) == ([], [a, b])
    assert el.due([a, b], 1.0) == ([a], [b])
    assert el.due([a, b], 9.0) == ([a, b], [])


def test_membership_renumbers_the_ranks_in_slot_order() -> None:
    assert el.membership([0, 1, 2], [Event(1, 0, "leave")]) == [1, 2]
    assert el.membership([1, 2], [Event(1, 3, "join")]) == [1, 2, 3]
    assert el.membership([1, 2, 3], [Event(1, 2, "crash"), Event(1, 0, "join")]) == [0, 1, 3]


def test_a_sleeping_peer_joins_at_the_speed_it_wakes_to() -> None:
    trace = Trace((PeerTrace((0.0, 5.0, 8.0), (2.0, None, 3.0)),))
    assert [el._slowdown(trace, 0, t) for t in (0.0, 6.0, 9.0)] == [2.0, 3.0, 3.0]


# ---------------------------------------------------------------------- the state to restart from


def test_the_most_advanced_survivor_wins() -> None:
    saved = [el.Candidate("survivor", 40, 1280, "a", rank=1), el.Candidate("survivor", 41, 1312, "b", rank=2)]
    others = [el.Candidate("checkpoint", 30, 960, "c"), el.Candidate("start", 10, 320, "d")]
    chosen, why = el.choose_state([*saved, *others])
    assert chosen.path == "b" and why == "rank 2's state at step 41, the most advanced of 2 saved by members"


def test_a_tie_goes_to_a_survivor_then_the_lowest_rank() -> None:
    chosen, _ = el.choose_state([el.Candidate("checkpoint", 40, 0, "c"), el.Candidate("survivor", 40, 0, "r2", rank=2),
                                 el.Candidate("survivor", 40, 0, "r0", rank=0)])  # fmt: skip
    assert chosen.path == "r0"  # rank 0 also saved its weight average


def test_without_a_survivor_the_checkpoint_or_else_the_start() -> None:
    checkpoint, start = el.Candidate("checkpoint", 30, 960, "c"), el.Candidate("start", 20, 640, "s")
    chosen, why = el.choose_state([checkpoint, start])
    assert chosen is checkpoint and why == "the checkpoint at step 30: no member saved its state"
    older = el.Candidate("checkpoint", 10, 320, "old")  # written by an earlier generation
    assert el.choose_state([older, start]) == (start, "the start at step 20: no member saved its state")
    with pytest.raises(ValueError, match="no state"):
        el.choose_state([])


# ---------------------------------------------------------------------- the members' pieces


def test_a_resumed_stream_skips_the_rows_already_trained_on() -> None:
    def stream():
        start = 0
        while True:
            yield torch.arange(start, start + 4).unsqueeze(1), torch.arange(start, start + 4)
            start += 4

    rows = [int(v) for _, (_x, y) in zip(range(3), skipped(stream(), 6)) for v in y]
    assert rows == list(range(6, 16))  # the rest of the batch the skip cut, then whole ones
    assert [int(v) for v in next(skipped(stream(), 0))[1]] == [0, 1, 2, 3]


def test_a_diloco_state_round_trips_the_anchor_and_the_outer_momentum(tmp_path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # a group of one, in this process
    try:
        cfg = Config("digits", (1.0,), "diloco-proportional", 1.0, STEP_MS, None, 1.0, 0, 0, 10.0, local_steps=2)
        plan = Plan(0, str(tmp_path), None, (0,), str(tmp_path / "curve.jsonl"), str(tmp_path / "ck.pt"), 10.0)
        state = Progress(next_eval=1.0)
        r = sr._setup(0, cfg, state.train_time)
        with torch.no_grad():  # a round of "inner steps", then the outer step: the anchor moves, momentum builds up
            for p in r.params:
                p.add_(0.01)
            r.outer.pseudo_gradient(r.params, r.flat, 1.0)
            r.outer.step(r.params, r.flat, 1.0)
            for p in r.params:  # inner steps since the sync are no part of the group's state
                p.add_(0.5)
        state.trained = 640
        Member(r, state, plan, 40, time.monotonic()).save(tmp_path / "state.pt")
        again = Progress(next_eval=1.0)
        fresh = sr._setup(0, cfg, again.train_time)
        assert _restore(fresh, again, replace(plan, resume=str(tmp_path / "state.pt")))[0] == 40
        assert again.trained == 640
        assert all(torch.equal(a, b) and torch.equal(p, b) for a, p, b in zip(fresh.outer.anchor, fresh.params,
                                                                              r.outer.anchor))  # fmt: skip
        momentum = [fresh.outer.optimizer.state[a]["momentum_buffer"] for a in fresh.outer.anchor]
        assert all(torch.equal(m, r.outer.optimizer.state[a]["momentum_buffer"])
                   for m, a in zip(momentum, r.outer.anchor))  # fmt: skip
        assert any(m.abs().sum() > 0 for m in momentum)
    finally:
        dist.destroy_process_group()


def test_peer_failures_are_told_from_other_errors() -> None:
    assert is_peer_failure(RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert is_peer_failure(torch.distributed.DistBackendError("anything"))
    assert not is_peer_failure(RuntimeError("boom from the failing task"))
    assert not is_peer_failure(ValueError("gloo"))


def test_a_curve_line_left_unfinished_is_skipped(tmp_path) -> None:
    path = tmp_path / "curve.jsonl"
    path.write_text('{"t": 1.0, "samples": 32}\n{"t": 0.0, "samples": 0}\n{"t": 2.0, "sam')
    assert el._curve(path) == [{"t": 0.0, "samples": 0}, {"t": 1.0, "samples": 32}]
    assert el._curve(tmp_path / "none.jsonl") == []


def test_elastic_runs_need_loopback_and_the_initial_peers_slowdowns(tmp_path) -> None:
    trace = _trace([1, 1, 1], [Event(1.0, 0, "crash")])
    with pytest.raises(NotImplementedError, match="loopback"):
        sb.run_sync("digits", [1, 1, 1], "equal", 3.0, STEP_MS, None, trace=trace, links=[None] * 3, work_dir=tmp_path)
    with pytest.raises(ValueError, match="ranks are the trace.s initial peers"):
        sb.run_sync("digits", [1, 1], "equal", 3.0, STEP_MS, None, trace=trace)
    with pytest.raises(ValueError, match="no member"):
        el.run_elastic(None, _trace([1], [Event(1.0, 0, "leave")]), 0.0, math.inf)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


# ---------------------------------------------------------------------- runs


def _check_run(r: dict[str, Any]) -> None:
    """What every elastic result keeps: the run_sync keys, a curve on one rising time axis, samples that add up."""
    json.dumps(r)
    for key in ("curve", "time_to_target", "samples", "samples_per_s", "peers", "wall_s", "startup_s", "restarts"):
        assert key in r
    times = [pt["t"] for pt in r["curve"]]
    samples = [pt["samples"] for pt in r["curve"]]
    assert times[0] == 0.0 and all(b > a for a, b in pairwise(times))
    assert all(b >= a for a, b in pairwise(samples))
    assert samples[-1] == r["samples"] == sum(p["samples"] for p in r["peers"])
    assert r["curve"][-1]["accuracy"] > r["curve"][0]["accuracy"] + 0.3  # it learned, through the restarts
    for restart in r["restarts"]:
        order = ("t", "applied_t", "detected_t", "resumed_t", "first_step_t")
        assert all(restart[a] < restart[b] for a, b in pairwise(order[1:])) and restart["t"] <= restart["applied_t"]
        assert restart["downtime_s"] == pytest.approx(restart["first_step_t"] - restart["applied_t"], abs=1e-6)
        assert 0 < restart["downtime_s"] < 20  # measured, bounded: no collective timed out
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_a_crash_reforms_the_group_from_a_survivor(tmp_path) -> None:
    trace = _trace([1, 1, 1], [Event(1.5, 1, "crash")])
    r = sb.run_sync("digits", [1, 1, 1], "equal", 4.0, STEP_MS, None, eval_every=0.5, pg_timeout_s=20, trace=trace,
                    work_dir=tmp_path)  # fmt: skip
    _check_run(r)
    (restart,) = r["restarts"]
    assert restart["event"] == "crash" and restart["source"] == "survivor" and restart["steps_lost"] == 0
    assert (restart["world_before"], restart["world_after"]) == (3, 2) and restart["members_after"] == [0, 2]
    assert restart["detected_t"] - restart["applied_t"] < 5  # through a gloo error, not the collective's timeout
    crashed = r["peers"][1]
    assert crashed["partial"] and crashed["steps"] == restart["step"]
    # training went on, with two members, past the restart
    assert r["steps"] > restart["step"] and all(p["steps"] == r["steps"] for p in (r["peers"][0], r["peers"][2]))
    assert r["curve"][-1]["t"] > restart["first_step_t"] and r["curve"][-1]["samples"] > restart["step"] * 96
    assert r["wall_s"] >= 4.0


@pytest.mark.slow
def test_a_leave_and_a_join_reform_the_group(tmp_path) -> None:
    trace = _trace([1, 2, 1], [Event(1.0, 0, "leave"), Event(2.0, 2, "join")])
    r = sb.run_sync("digits", [1, 2], "proportional", 3.5, STEP_MS, None, eval_every=0.5, pg_timeout_s=20,
                    trace=trace, work_dir=tmp_path)  # fmt: skip
    _check_run(r)
    leave, join = r["restarts"]
    assert (leave["event"], leave["world_before"], leave["world_after"]) == ("leave", 2, 1)
    assert (join["event"], join["world_before"], join["world_after"]) == ("join", 1, 2)
    assert leave["source"] == join["source"] == "survivor" and join["steps_lost"] == 0
    left, stayed, joined = r["peers"]
    assert left["steps"] == leave["step"] and stayed["steps"] == r["steps"]
    assert joined["steps"] == r["steps"] - join["step"] > 0
    # proportional batches follow the membership: alone, then with a peer twice as fast
    assert (stayed["batch"], joined["batch"]) == (21, 43) and left["batch"] == 43


@pytest.mark.slow
def test_with_no_survivor_the_group_restarts_from_rank_0s_checkpoint(tmp_path) -> None:
    # both members crash as a third joins: nobody saved, so the checkpoint (at ~1.5 s, evaluated past) is all there is
    trace = _trace([1, 1, 1], [Event(2.0, 0, "crash"), Event(2.0, 1, "crash"), Event(2.0, 2, "join")])
    cfg = Config("digits", (1.0, 1.0), "equal", 3.5, STEP_MS, None, 0.25, 0, 0, 20.0)
    r = el.run_elastic(cfg, trace, time.monotonic(), time.monotonic() + 120, tmp_path, checkpoint_every_s=1.5)
    (restart,) = r["restarts"]
    assert restart["event"] == "crash+crash+join" and restart["source"] == "checkpoint"
    assert restart["reason"].startswith("the checkpoint at step") and restart["steps_lost"] > 0
    assert (restart["world_before"], restart["world_after"], restart["members_after"]) == (2, 1, [2])
    times = [pt["t"] for pt in r["curve"]]
    assert all(b > a for a, b in pairwise(times)) and times[-1] >= 3.5  # the clock came back from the checkpoint
    assert r["peers"][2]["steps"] == r["steps"] - restart["step"] > 0
    assert multiprocessing.active_children() == []


@pytest.mark.slow
def test_adaptive_runs_elastically_on_the_runs_trace_clock(tmp_path) -> None:
    # peer 1 sleeps from 2.5 s to 3.5 s of the run's training time, in the generation that peer 2's join starts
    slow = PeerTrace((0.0, 2.5, 3.5), (2.0, None, 1.0))
    trace = Trace((PeerTrace((0.0,), (1.0,)), slow, PeerTrace((0.0,), (1.0,))),
                  (Event(1.0, 0, "leave"), Event(2.0, 2, "join")))  # fmt: skip
    r = sb.run_sync("digits", [1, 2], "adaptive", 4.5, STEP_MS, None, eval_every=0.25, pg_timeout_s=20, trace=trace,
                    rebalance_every=5, work_dir=tmp_path)  # fmt: skip
    _check_run(r)
    assert [x["event"] for x in r["restarts"]] == ["leave", "join"] and r["rebalances"] > 0
    # the group waits out the sleep where the run's clock puts it, not 2.5 s into the new generation
    assert not [pt["t"] for pt in r["curve"] if 2.8 < pt["t"] < 3.4]
    assert r["peers"][0]["batch"] > 32  # it left the faster of two (slot 1 started at x2)


@pytest.mark.slow
def test_diloco_proportional_restarts_from_the_anchor_after_a_crash(tmp_path) -> None:
    trace = _trace([1, 2, 1], [Event(1.5, 1, "crash")])
    r = sb.run_sync("digits", [1, 2, 1], "diloco-proportional", 4.0, STEP_MS, None, eval_every=0.5, pg_timeout_s=20,
                    trace=trace, local_steps=4, work_dir=tmp_path)  # fmt: skip
    _check_run(r)
    (restart,) = r["restarts"]
    assert restart["source"] == "survivor" and restart["step"] % 4 == 0  # group steps count whole rounds
    crashed = r["peers"][1]
    assert crashed["partial"] and crashed["steps"] < restart["step"]  # the slow slot took fewer inner steps a round
    assert r["method"] == "diloco-proportional" and r["inner_steps"] == [4, 4]


def test_a_member_that_raises_ends_the_run_instead_of_a_restart() -> None:
    trace = _trace([1, 1], [Event(30.0, 0, "leave")])
    with pytest.raises(sb.RankFailed, match="boom from the failing task"):
        sb.run_sync("test_sync_baseline:FailingTask", [1, 1], "equal", 60.0, STEP_MS, None, pg_timeout_s=20, trace=trace)
    assert multiprocessing.active_children() == []
