"""`lab.trace_driver`: a trace's sleeps and membership events played on real processes, by PID."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.trace_driver import Action, TraceDriver, schedule
from lab.traces import Event, PeerTrace, Trace, scenario


def _state(process: subprocess.Popen) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_schedule_puts_sleeps_and_events_in_time_order() -> None:
    assert schedule(scenario("sleep", [2, 1], 90, 0)) == [Action(30.0, 1, "sleep"), Action(60.0, 1, "wake")]
    assert [a.kind for a in schedule(scenario("churn", [1, 1, 2, 4], 90, 0))] == ["leave", "join", "crash"]


def test_the_driver_stops_continues_ends_and_starts_processes_when_due() -> None:
    trace = Trace((PeerTrace((0.0, 1.0, 2.0), (1.0, None, 1.0)), PeerTrace((0.0,), (1.0,)), PeerTrace((0.0,), (1.0,))),
                  (Event(3.0, 1, "leave"), Event(4.0, 2, "join"), Event(5.0, 0, "crash")))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    processes = {i: subprocess.Popen(sleeper) for i in trace.initial()}
    joined: list[int] = []

    def join(peer: int) -> subprocess.Popen:
        joined.append(peer)
        processes[peer] = subprocess.Popen(sleeper)
        return processes[peer]

    driver = TraceDriver(trace, origin=100.0, processes=dict(processes), join=join)
    try:
        assert driver.poll(now=100.5) == []
        assert driver.poll(now=101.0) == [Action(1.0, 0, "sleep")]
        _wait_for(lambda: _state(processes[0]) == "T")
        assert driver.poll(now=102.1) == [Action(2.0, 0, "wake")]
        _wait_for(lambda: _state(processes[0]) != "T")
        driver.poll(now=103.0)
        assert processes[1].wait(timeout=5) == -signal.SIGTERM
        driver.poll(now=104.0)
        assert joined == [2]
        driver.poll(now=106.0)
        assert processes[0].wait(timeout=5) == -signal.SIGKILL
        assert [(a.kind, round(t, 6)) for a, t in driver.done] == [("sleep", 1.0), ("wake", 2.1), ("leave", 3.0), ("join", 4.0), ("crash", 6.0)]
    finally:
        for p in processes.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)


def test_wake_all_continues_a_sleeping_process_so_that_it_can_be_stopped() -> None:
    trace = Trace((PeerTrace((0.0, 1.0, 50.0), (1.0, None, 1.0)),))
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        driver = TraceDriver(trace, origin=0.0, processes={0: process}, join=lambda peer: pytest.fail("no joins"))
        driver.poll(now=2.0)
        _wait_for(lambda: _state(process) == "T")
        driver.wake_all()
        _wait_for(lambda: _state(process) != "T")
        process.terminate()
        assert process.wait(timeout=5) == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
