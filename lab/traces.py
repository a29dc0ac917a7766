"""Speed traces: how fast each peer is over time, and when peers leave, crash or join.

One trace drives every method of a run alike (Murmur peers, sync and DiLoCo ranks), so a
scenario is a file a user can replay. The format (JSON):

    {"peers": [{"t": [0, 12.5, 30], "slowdown": [1, 2.2, null]},   # peer 0
               {"t": [0], "slowdown": [4]}],                        # peer 1
     "events": [{"t": 20, "peer": 1, "action": "leave"}]}

- `t`: seconds from the start of training, rising, the first 0. A slowdown holds from its
  time until the next: ×S is S times slower than the reference device, `null` asleep (the
  peer does nothing until it wakes).
- `events` (optional): `leave` (SIGTERM), `crash` (SIGKILL), `join` (a new peer starts).
  A peer with a `join` event is absent until then; every other peer is there from the start.

Named scenarios (`scenario`) build traces from a speed mix, a horizon and a seed:
`static`, `drift`, `throttle`, `sleep` and `churn` (see `SCENARIOS`).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from murmur.node.learn.step import REFERENCE_BATCH, Pacing

ACTIONS = ("leave", "crash", "join")
DRIFT_RANGE = (1.0, 4.0)  # drift's slowdowns stay within ×1..×4
DRIFT_EVERY_S = 10.0  # about how often a drifting peer's speed changes
DRIFT_STEP = 0.6  # standard deviation of one change of log-slowdown
SLEEP_S = 30.0  # how long `sleep`'s peer sleeps


class TraceError(ValueError):
    """A trace that cannot be used; the message says where and what is wrong."""


@dataclass(frozen=True)
class PeerTrace:
    """One peer's slowdown over time: `slowdowns[i]` holds from `times[i]` until `times[i + 1]` (None: asleep)."""

    times: tuple[float, ...]
    slowdowns: tuple[float | None, ...]

    def slowdown_at(self, t: float) -> float | None:
        """The slowdown at trace time `t` (the first one before 0); None while asleep."""
        return self.slowdowns[max(0, bisect.bisect_right(self.times, t) - 1)]

    def finish(self, start: float, work: float) -> float:
        """When a step of `work` seconds at ×1, begun at `start`, ends: the device runs at 1/slowdown, not at all
        asleep. `math.inf` if it never wakes to finish."""
        t, left = start, work
        i = max(0, bisect.bisect_right(self.times, t) - 1)
        while True:
            end = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            s = self.slowdowns[i]
            if s is not None:
                if t + left * s <= end:
                    return t + left * s
                left -= (end - t) / s
            if end == math.inf:
                return math.inf
            t, i = end, i + 1

    def work_done(self, t0: float, t1: float) -> float:
        """Seconds of ×1 device time this peer has between trace times `t0` and `t1`."""
        total = 0.0
        for i, s in enumerate(self.slowdowns):
            lo = max(t0, self.times[i])
            hi = min(t1, self.times[i + 1] if i + 1 < len(self.times) else math.inf)
            if s is not None and hi > lo:
                total += (hi - lo) / s
        return total

    def asleep(self) -> list[tuple[float, float]]:
        """The intervals (start, end) this peer sleeps through (end `math.inf`: it never wakes)."""
        out = []
        for i, s in enumerate(self.slowdowns):
            if s is None:
                out.append((self.times[i], self.times[i + 1] if i + 1 < len(self.times) else math.inf))
        return out


@dataclass(frozen=True)
class Event:
    """At trace time `t`, `peer` leaves (SIGTERM), crashes (SIGKILL) or joins."""

    t: float
    peer: int
    action: str


@dataclass(frozen=True)
class Trace:
    """Every peer's speed over time and the membership events; `peers[i]` is peer i."""

    peers: tuple[PeerTrace, ...]
    events: tuple[Event, ...] = field(default=())

    def joiners(self) -> set[int]:
        """The peers that are absent until a `join` event."""
        return {e.peer for e in self.events if e.action == "join"}

    def initial(self) -> list[int]:
        """The peers there from the start, in order."""
        joiners = self.joiners()
        return [i for i in range(len(self.peers)) if i not in joiners]

    def present(self, t: float) -> list[int]:
        """The peers there at trace time `t`: joined by then, not yet gone."""
        return [i for i in range(len(self.peers)) if self.span(i)[0] <= t < self.span(i)[1]]

    def span(self, peer: int) -> tuple[float, float]:
        """When `peer` is there: from its join (or 0) until it leaves or crashes (or `math.inf`)."""
        begin, end = 0.0, math.inf
        for e in self.events:
            if e.peer == peer:
                if e.action == "join":
                    begin = e.t
                else:
                    end = min(end, e.t)
        return begin, end

    def ideal_work(self, t_end: float) -> float:
        """Seconds of ×1 device time the whole swarm has from 0 to `t_end`, every peer alone while it is there."""
        return sum(p.work_done(self.span(i)[0], min(t_end, self.span(i)[1])) for i, p in enumerate(self.peers))

    def to_json(self) -> dict[str, Any]:
        """The file format (see the module docstring)."""
        out: dict[str, Any] = {"peers": [{"t": list(p.times), "slowdown": list(p.slowdowns)} for p in self.peers]}
        if self.events:
            out["events"] = [{"t": e.t, "peer": e.peer, "action": e.action} for e in self.events]
        return out

    @classmethod
    def from_json(cls, data: Any, source: str = "trace") -> Trace:
        """A trace from its JSON form; raises `TraceError` naming `source` and the first problem."""
        if not isinstance(data, dict) or not isinstance(data.get("peers"), list) or not data["peers"]:
            raise TraceError(f"{source}: expected an object with a non-empty list \"peers\"")
        peers = tuple(_peer_trace(p, f"{source}: peers[{i}]") for i, p in enumerate(data["peers"]))
        events = data.get("events", [])
        if not isinstance(events, list):
            raise TraceError(f"{source}: \"events\" must be a list")
        parsed = tuple(_event(e, len(peers), f"{source}: events[{i}]") for i, e in enumerate(events))
        trace = cls(peers, tuple(sorted(parsed, key=lambda e: e.t)))
        _check_membership(trace, source)
        return trace


def load(path: Path) -> Trace:
    """The trace in the JSON file `path`; raises `TraceError` for a file that is unreadable, not JSON, or not a trace."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: not JSON: {e}") from None
    return Trace.from_json(data, str(path))


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{where}: {value!r} is not a finite number")
    return float(value)


def _peer_trace(data: Any, where: str) -> PeerTrace:
    if not isinstance(data, dict) or not isinstance(data.get("t"), list) or not isinstance(data.get("slowdown"), list):
        raise TraceError(f"{where}: expected {{\"t\": [...], \"slowdown\": [...]}}")
    times = [_number(t, f"{where}.t") for t in data["t"]]
    if not times or len(times) != len(data["slowdown"]):
        raise TraceError(f"{where}: \"t\" and \"slowdown\" must be non-empty and of one length, got {len(times)} and {len(data['slowdown'])}")
    if times[0] != 0:
        raise TraceError(f"{where}.t: the first time must be 0, got {times[0]:g}")
    if any(b <= a for a, b in itertools.pairwise(times)):
        raise TraceError(f"{where}.t: times must rise")
    if data["slowdown"][-1] is None:
        raise TraceError(f"{where}.slowdown: a peer must wake: the last slowdown cannot be null")
    slowdowns: list[float | None] = []
    for s in data["slowdown"]:
        if s is not None and not _number(s, f"{where}.slowdown") > 0:
            raise TraceError(f"{where}.slowdown: {s!r} must be positive (or null: asleep)")
        slowdowns.append(None if s is None else float(s))
    return PeerTrace(tuple(times), tuple(slowdowns))


def _event(data: Any, peers: int, where: str) -> Event:
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected {{\"t\", \"peer\", \"action\"}}")
    t = _number(data.get("t"), f"{where}.t")
    peer = data.get("peer")
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < peers:
        raise TraceError(f"{where}.peer: {peer!r} is not a peer of this trace (0..{peers - 1})")
    if data.get("action") not in ACTIONS:
        raise TraceError(f"{where}.action: {data.get('action')!r} is not one of {list(ACTIONS)}")
    if t < 0:
        raise TraceError(f"{where}.t: {t:g} is before the start")
    return Event(t, peer, data["action"])


def _check_membership(trace: Trace, source: str) -> None:
    for i in range(len(trace.peers)):
        mine = [e for e in trace.events if e.peer == i]
        joins = [e for e in mine if e.action == "join"]
        exits = [e for e in mine if e.action != "join"]
        if len(joins) > 1 or len(exits) > 1:
            raise TraceError(f"{source}: peer {i} joins or leaves more than once")
        if joins and exits and exits[0].t <= joins[0].t:
            raise TraceError(f"{source}: peer {i} leaves before it joins")
    if not trace.initial():
        raise TraceError(f"{source}: no peer is there from the start")


# ------------------------------------------------------------------------------ scenarios


def static(slowdowns: Sequence[float]) -> Trace:
    """Every peer at its fixed slowdown."""
    return Trace(tuple(PeerTrace((0.0,), (float(s),)) for s in slowdowns))


def drift(slowdowns: Sequence[float], duration: float, seed: int) -> Trace:
    """Every peer walks at random in log-slowdown within ×1..×4 from its mix's slowdown, changing about every 10 s."""
    rng = random.Random(f"drift-{seed}")
    lo, hi = (math.log(x) for x in DRIFT_RANGE)
    peers = []
    for s in slowdowns:
        times, values = [0.0], [min(max(float(s), DRIFT_RANGE[0]), DRIFT_RANGE[1])]
        while (t := times[-1] + rng.uniform(0.5, 1.5) * DRIFT_EVERY_S) < duration:
            x = math.log(values[-1]) + rng.gauss(0.0, DRIFT_STEP)
            x = lo + abs(x - lo) if x < lo else hi - abs(x - hi) if x > hi else x  # reflect at the bounds
            times.append(round(t, 3))
            values.append(round(math.exp(min(max(x, lo), hi)), 3))
        peers.append(PeerTrace(tuple(times), tuple(values)))
    return Trace(tuple(peers))


def throttle(slowdowns: Sequence[float], duration: float) -> Trace:
    """The fastest peer drops to a quarter of its speed for the middle third of the run."""
    fast = min(range(len(slowdowns)), key=lambda i: slowdowns[i])
    third = duration / 3
    peers = list(static(slowdowns).peers)
    s = float(slowdowns[fast])
    peers[fast] = PeerTrace((0.0, third, 2 * third), (s, 4 * s, s))
    return Trace(tuple(peers))


def sleep(slowdowns: Sequence[float], duration: float) -> Trace:
    """The fastest peer sleeps for 30 s from a third of the run, then resumes."""
    fast = min(range(len(slowdowns)), key=lambda i: slowdowns[i])
    peers = list(static(slowdowns).peers)
    s = float(slowdowns[fast])
    peers[fast] = PeerTrace((0.0, duration / 3, duration / 3 + SLEEP_S), (s, None, s))
    return Trace(tuple(peers))


def churn(slowdowns: Sequence[float], duration: float) -> Trace:
    """A fast peer leaves (SIGTERM) at a third of the run, a new fast one joins at half, and the second-slowest
    crashes (SIGKILL) at two thirds. Needs three peers or more."""
    if len(slowdowns) < 3:
        raise TraceError(f"churn needs at least 3 peers, got {len(slowdowns)}")
    order = sorted(range(len(slowdowns)), key=lambda i: slowdowns[i])
    joiner = len(slowdowns)
    peers = (*static(slowdowns).peers, PeerTrace((0.0,), (float(slowdowns[order[0]]),)))
    events = (Event(duration / 3, order[0], "leave"), Event(duration / 2, joiner, "join"), Event(2 * duration / 3, order[-2], "crash"))
    return Trace(peers, events)


SCENARIOS: dict[str, Callable[[Sequence[float], float, int], Trace]] = {
    "static": lambda mix, duration, seed: static(mix),
    "drift": drift,
    "throttle": lambda mix, duration, seed: throttle(mix, duration),
    "sleep": lambda mix, duration, seed: sleep(mix, duration),
    "churn": lambda mix, duration, seed: churn(mix, duration),
}


def scenario(name: str, slowdowns: Sequence[float], duration: float, seed: int) -> Trace:
    """The named scenario's trace for a speed mix over `duration` seconds; raises `TraceError` for an unknown name."""
    if name not in SCENARIOS:
        raise TraceError(f"unknown scenario {name!r}: choose from {list(SCENARIOS)}")
    return SCENARIOS[name](slowdowns, duration, seed)


# ------------------------------------------------------------------------------ pacing


class TracedPacing(Pacing):
    """`Pacing` whose slowdown follows a `PeerTrace`: a step of B samples is S(t) x step_time per 32 samples of
    device time, integrated over the step, and waits out any sleep it runs into.

    `clock` gives trace time (seconds since training started), read when a step's duration is asked for.
    """

    def __init__(self, trace: PeerTrace, step_time_ms: float, clock: Callable[[], float]) -> None:
        super().__init__(trace.slowdown_at(0.0) or 1.0, step_time_ms)
        object.__setattr__(self, "trace", trace)
        object.__setattr__(self, "clock", clock)

    def step_duration(self, compute_s: float, elapsed_s: float, batch_size: int) -> float:
        start = max(0.0, self.clock() - elapsed_s)
        work = self.step_time_ms / 1000 * batch_size / REFERENCE_BATCH
        return max(elapsed_s, self.trace.finish(start, work) - start)
