"""Play a speed trace's sleeps and membership events on real processes, as time passes.

A peer that sleeps is stopped (SIGSTOP) and continued (SIGCONT) when it wakes: like a laptop's
lid, it freezes its network as well as its compute. `leave` is SIGTERM (a goodbye), `crash`
SIGKILL, `join` starts a new peer through a callback. Processes are addressed by PID only.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lab.traces import Trace

SIGNALS = {"sleep": signal.SIGSTOP, "wake": signal.SIGCONT, "leave": signal.SIGTERM, "crash": signal.SIGKILL}


class Process(Protocol):
    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


@dataclass(frozen=True)
class Action:
    """At trace time `t`, do `kind` (sleep, wake, leave, crash or join) to trace peer `peer`."""

    t: float
    peer: int
    kind: str


def schedule(trace: Trace) -> list[Action]:
    """Every action `trace` asks for, in time order: each sleep as a sleep and a wake, then the events."""
    actions = [Action(e.t, e.peer, e.action) for e in trace.events]
    for i, peer in enumerate(trace.peers):
        for begin, end in peer.asleep():
            actions += [Action(begin, i, "sleep"), Action(end, i, "wake")]
    return sorted((a for a in actions if math.isfinite(a.t)), key=lambda a: (a.t, a.kind != "wake"))


class TraceDriver:
    """Applies `trace`'s actions to `processes` (by trace peer) at `origin` + t (Unix time), each once.

    `join(peer)` starts a joining peer and returns its process. Actions for a peer that is not
    running (never started, or already gone) are skipped: a crashed peer cannot also sleep.
    """

    def __init__(self, trace: Trace, origin: float, processes: dict[int, Process], join: Callable[[int], Process]) -> None:
        self.pending = schedule(trace)
        self.origin = origin
        self.processes = processes
        self.join = join
        self.done: list[tuple[Action, float]] = []  # (action, trace time it was applied)
        self.stopped: set[int] = set()

    def poll(self, now: float | None = None) -> list[Action]:
        """Apply every action due by `now` (default: the time now); return them."""
        t = (time.time() if now is None else now) - self.origin
        due = [a for a in self.pending if a.t <= t]
        self.pending = self.pending[len(due):]
        for action in due:
            self._apply(action)
            self.done.append((action, t))
        return due

    def _apply(self, action: Action) -> None:
        if action.kind == "join":
            self.processes[action.peer] = self.join(action.peer)
            return
        process = self.processes.get(action.peer)
        if process is None or process.poll() is not None:
            return
        if action.kind in ("leave", "crash") and action.peer in self.stopped:
            process.send_signal(signal.SIGCONT)  # a stopped process would hold a SIGTERM until woken
        process.send_signal(SIGNALS[action.kind])
        if action.kind == "sleep":
            self.stopped.add(action.peer)
        else:
            self.stopped.discard(action.peer)

    def wake_all(self) -> None:
        """Continue every process this driver stopped (before stopping them all at the end of a run)."""
        for peer in sorted(self.stopped):
            process = self.processes[peer]
            process.send_signal(signal.SIGCONT)
        self.stopped.clear()
