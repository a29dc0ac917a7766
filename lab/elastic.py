"""Elastic synchronous baseline: the sync ranks run as a torchrun --nnodes=MIN:MAX job would through a trace's churn.

A run is a sequence of generations. A generation is one gloo group with a rendezvous store of its own (a new
port) and one member process per trace peer present ("slot"), ranked in slot order and forked from the
preloaded server; its members are `lab.elastic_rank` ranks. This module is the agent, in the caller's process.
It applies the trace's events in training time, read from the progress file that each generation's rank 0 keeps
(the clock's origin and evaluation pauses; `time.monotonic` is one clock for every process on Linux), and only
once the generation has trained a step:

- leave: SIGTERM to the leaver. It saves at its next step boundary and exits; the others' next all-reduce
  fails, and they save and exit too.
- crash: SIGSTOP, then SIGKILL (crashes at one moment freeze together first). The survivors' all-reduce fails
  (a reset connection, at worst after `pg_timeout_s`), and they save and exit.
- join: SIGTERM to every member (torchrun's scale-up: the agents stop every worker); each saves at a step boundary.

Once every member has exited (or `pg_timeout_s` + `EXIT_GRACE_S` after the event; stragglers are killed), the
agent picks the state to go on from (`choose_state`: the most advanced a member saved, else rank 0's periodic
checkpoint, else the generation's own start) and starts the next generation with the new membership, whose split
(batches, diloco-proportional's inner steps, the rebalancing modes' speeds) starts again from its peers' trace
slowdowns then. Each restart is measured, not assumed (`Restart`). Training time runs on through restarts: the
downtime is in it, as it is for a real job; only the first start-up is excluded. A restart from a checkpoint loses
the steps after it: the curve keeps the evaluations made on them (the model did score that, then), so its samples
step back there. A member that raises, or dies without an event, ends the run (`RankFailed`).
"""

from __future__ import annotations

import json
import math
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from itertools import groupby
from pathlib import Path
from typing import Any

import torch

from lab.elastic_rank import Plan, member
from lab.swarm import ForkedProcess
from lab.sync_baseline import RankFailed, _free_store
from lab.sync_config import Config
from lab.sync_report import result_of
from lab.traces import Event, Trace

CHECKPOINT_EVERY_S = 10.0  # rank 0's checkpoint interval, in training time: the fallback's worst loss
EXIT_GRACE_S = 15.0  # after an event, on top of pg_timeout_s: for members to save and exit
POLL_S = 0.02  # how often the agent looks at the clock and the members
SOURCES = ("survivor", "checkpoint", "start")  # which state wins a tie, first first

Applied = tuple[Event, float, float]  # an event, the monotonic time the agent applied it, and origin + pauses then


@dataclass(frozen=True)
class Candidate:
    """A state the next generation could start from: who saved it, after how many group steps and samples, where."""

    source: str  # one of SOURCES
    step: int
    samples: int
    path: str | None  # None: the fresh start (nothing saved yet)
    rank: int | None = None  # the member that saved it
    kept: dict[str, list[int]] | None = None  # each rank's steps and rows in its generation (None: none)


def schedule(trace: Trace) -> tuple[Event, ...]:
    """The trace's membership events in time order; raises `ValueError` if they would ever leave no member
    (an elastic job's minimum here is one)."""
    events = tuple(sorted(trace.events, key=lambda e: e.t))
    members = trace.initial()
    for t, group in groupby(events, key=lambda e: e.t):
        members = membership(members, list(group))
        if not members:
            raise ValueError(f"the trace leaves no member at t={t:g}: an elastic job needs at least one")
    return events


def due(events: Sequence[Event], t: float) -> tuple[list[Event], list[Event]]:
    """Split `events` into those due by training time `t` and those still to come."""
    return [e for e in events if e.t <= t], [e for e in events if e.t > t]


def membership(members: Sequence[int], events: Sequence[Event]) -> list[int]:
    """The slots after `events`: leavers and crashers out, joiners in, in slot order (the new rank order)."""
    gone = {e.peer for e in events if e.action != "join"}
    joined = {e.peer for e in events if e.action == "join"}
    return sorted((set(members) - gone) | joined)


def choose_state(candidates: Sequence[Candidate]) -> tuple[Candidate, str]:
    """The candidate to restart from, and why: the most advanced; on a tie a survivor's, then a checkpoint, then the
    start state, then the lowest rank's (rank 0 also saved its weight average). Raises `ValueError` if none."""
    if not candidates:
        raise ValueError("no state to restart from")
    best = max(candidates, key=lambda c: (c.step, -SOURCES.index(c.source), -(c.rank or 0)))
    saved = sum(c.source == "survivor" for c in candidates)
    if best.source == "survivor":
        return best, f"rank {best.rank}'s state at step {best.step}, the most advanced of {saved} saved by members"
    if saved:
        return best, f"the {best.source} at step {best.step}, ahead of every member's state"
    return best, f"the {best.source} at step {best.step}: no member saved its state"


@dataclass
class Restart:
    """One re-formation of the group, as measured. Times are training time (seconds since the run's first barrier,
    evaluation pauses excluded): the event's in the trace (`t`), when the agent applied it, when the first member
    that goes on stopped training (`detected_t`), when the new group passed its barrier (`resumed_t`) and trained
    its first step (`first_step_t`); `downtime_s` runs from applied to that first step (or, if the new group never
    trained, to its end). `steps_lost`: group steps some member completed that the restored state lacks (the step in
    flight is lost on top; the diloco modes count a round as `local_steps` and lose the inner steps since a sync)."""

    generation: int  # the generation it started
    event: str  # the actions applied together, "+"-joined: "crash", "leave", "crash+join"...
    events: list[dict[str, Any]]
    t: float
    applied_t: float  # the times below are on the clock of this moment (origin + pauses then)
    detected_t: float
    source: str  # where the state came from: one of SOURCES
    source_rank: int | None
    reason: str
    step: int  # the group step restored
    steps_lost: int
    world_before: int
    world_after: int
    members_before: list[int]
    members_after: list[int]
    resumed_t: float | None = None  # None: the next generation never got that far
    first_step_t: float | None = None
    downtime_s: float | None = None
    clock: float = field(default=0.0, repr=False)  # origin + pauses: monotonic time minus training time

    def resumed(self, progress: dict[str, Any], ended: float) -> None:
        """Fill in from the next generation's progress file when it formed and trained its first step; a group that
        never trained was down until that generation `ended` (monotonic)."""
        if progress:
            self.resumed_t = progress["started"] - self.clock
            if progress.get("first_step") is not None:
                self.first_step_t = progress["first_step"] - self.clock
        self.downtime_s = (self.first_step_t if self.first_step_t is not None else ended - self.clock) - self.applied_t

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "clock"}


@dataclass
class Totals:
    """One slot's totals over every generation it trained in (a `run_sync` peer row)."""

    slot: int
    slowdown: float = 0.0
    batch: int = 0
    local_steps: int = 1
    steps: int = 0
    samples: int = 0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wall_s: float = 0.0
    bytes_sent: int = 0
    generations: int = 0
    partial: bool = False  # killed: its times are those of the generations before (its samples are all counted)

    def row(self) -> dict[str, Any]:
        idle = 1.0 - self.compute_s / self.wall_s if self.wall_s > 0 else 0.0
        return {"rank": self.slot, **asdict(self), "idle_fraction": idle}


class Generation:
    """One gloo group: its store (a new port), its members' processes, their files; `close` ends it."""

    def __init__(self, cfg: Config, members: list[int], slowdowns: list[float], plan: Plan) -> None:
        self.members, self.plan = members, plan
        Path(plan.gen_dir).mkdir(parents=True)
        self._store = _free_store(timedelta(seconds=cfg.pg_timeout_s))
        self.cfg = replace(cfg, slowdowns=tuple(slowdowns), slots=tuple(members), port=self._store.port)
        self.killed: dict[int, float] = {}  # rank -> when the agent SIGKILLed it
        self.ended = math.inf  # when the agent saw the last member exit
        self.procs: list[ForkedProcess] = []
        try:
            for r in range(len(members)):
                log = Path(plan.gen_dir) / f"rank{r}.log"
                name = f"elastic-g{plan.generation}-rank{r}"
                self.procs.append(ForkedProcess(member, (r, self.cfg, plan), log, name=name))
        except BaseException:
            self.close()
            raise

    def progress(self) -> dict[str, Any] | None:
        """Rank 0's progress file (see `lab.elastic_rank`), or None before it writes one."""
        try:
            return json.loads(self.plan.progress.read_text())
        except (OSError, ValueError):
            return None

    def apply(self, events: Sequence[Event]) -> None:
        """Signal the members as `events` say (by PID): SIGSTOP then SIGKILL the crashers, SIGTERM a leaver, SIGTERM all on a join."""
        crashing = []
        for e in events:
            if e.action != "join" and e.peer in self.members:
                r = self.members.index(e.peer)
                if self.procs[r].poll() is None:
                    if e.action == "crash":
                        crashing.append(r)
                    else:
                        self.procs[r].send_signal(signal.SIGTERM)
        # Crashes at one moment happen at one moment: frozen first, their connections still open, so no member sees
        # one crash (and saves) before the agent gets to the next.
        for r in crashing:
            self.procs[r].send_signal(signal.SIGSTOP)
        for r in crashing:
            self.killed[r] = time.monotonic()
            self.procs[r].send_signal(signal.SIGKILL)
        if any(e.action == "join" for e in events):
            for p in self.procs:
                p.send_signal(signal.SIGTERM)

    def failure(self) -> str | None:
        """What went wrong if a member raised or died unbidden; None while none has."""
        for r, p in enumerate(self.procs):
            if p.poll() not in (None, 0) and r not in self.killed:
                error = Path(f"{self.plan.outcome(r)}.error")
                log = Path(self.plan.gen_dir) / f"rank{r}.log"
                detail = error.read_text() if error.exists() else log.read_text()[-2000:] if log.exists() else ""
                who = f"generation {self.plan.generation} rank {r} (slot {self.members[r]})"
                return f"{who} exited with {p.poll()}:\n{detail}"
        return None

    def outcomes(self) -> dict[int, dict[str, Any] | None]:
        """Each member's outcome (None: it was killed before writing one)."""
        out: dict[int, dict[str, Any] | None] = {}
        for r in range(len(self.procs)):
            path = self.plan.outcome(r)
            out[r] = json.loads(path.read_text()) if path.exists() else None
        return out

    def close(self) -> None:
        """SIGKILL any member still running, by PID, and reap it; then drop the store."""
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                self.killed[r] = time.monotonic()
                p.kill()
        for p in self.procs:
            p.wait(timeout=10)
        del self._store


@dataclass
class Agent:
    """The run's state between generations (see the module docstring); `run` drives it."""

    cfg: Config
    trace: Trace
    root: Path
    checkpoint_every_s: float
    totals: dict[int, Totals] = field(default_factory=dict)
    restarts: list[Restart] = field(default_factory=list)
    rebalances: int = 0  # the rebalancing modes' re-splits, over every generation

    def run(self, begin: float, deadline: float) -> dict[str, Any]:
        """Train through every generation; the `run_sync` result. Raises `RankFailed` as `run_sync` does."""
        pending = list(schedule(self.trace))
        members, start = self.trace.initial(), Candidate("start", 0, 0, None)
        curve = self.root / "curve.jsonl"
        for number in range(len(pending) + 1):
            plan = Plan(number, str(self.root / f"gen{number}"), start.path,
                        tuple(self.totals.get(s, Totals(s)).samples for s in members), str(curve),
                        str(self.root / "checkpoint.pt"), self.checkpoint_every_s)  # fmt: skip
            t_start = self.restarts[-1].applied_t if self.restarts else 0.0
            gen = Generation(self.cfg, members, [_slowdown(self.trace, s, t_start) for s in members], plan)
            try:
                applied, pending = self._supervise(gen, pending, deadline)
            finally:
                gen.close()
            outcomes, progress = gen.outcomes(), gen.progress() or {}
            if self.restarts:
                self.restarts[-1].resumed(progress, gen.ended)
            done = [o for o in outcomes.values() if o is not None and o["kind"] == "done"]
            if done:  # training is over, whatever was applied as it ended
                self._account(gen, outcomes, done[0]["kept"])
                return self._result(done[0], _curve(curve), begin)
            if not applied:
                raise RankFailed(f"generation {number} ended with no event applied: {outcomes}")
            chosen, why = self._choose(outcomes, start, number)
            self._account(gen, outcomes, chosen.kept)
            after = membership(members, [e for e, _, _ in applied])
            self._restart(applied, outcomes, progress, chosen, why, members, after, gen.ended)
            members, start = after, chosen
        raise RankFailed("more generations than events: a generation restarted without an event")

    def _supervise(self, gen: Generation, pending: list[Event], deadline: float) -> tuple[list[Applied], list[Event]]:
        """Apply events as they fall due until every member has exited; the events applied (with when) and the rest."""
        applied: list[Applied] = []
        give_up = math.inf
        while any(p.poll() is None for p in gen.procs):
            now = time.monotonic()
            if (failure := gen.failure()) is not None:
                raise RankFailed(failure)
            if now > deadline:
                raise RankFailed(f"timed out in generation {gen.plan.generation}")
            if now > give_up:
                break  # stragglers are killed by `close`: their state is lost
            progress = gen.progress()
            if pending and progress is not None and progress["first_step"] is not None:
                clock = progress["origin"] + progress["paused"]
                now_due, pending = due(pending, now - clock)
                if now_due:
                    gen.apply(now_due)
                    applied += [(e, now, clock) for e in now_due]
                    give_up = now + gen.cfg.pg_timeout_s + EXIT_GRACE_S
            time.sleep(POLL_S)
        if (failure := gen.failure()) is not None:
            raise RankFailed(failure)
        gen.ended = time.monotonic()
        return applied, pending

    def _choose(self, outcomes: dict[int, dict[str, Any] | None], start: Candidate,
                generation: int) -> tuple[Candidate, str]:  # fmt: skip
        candidates = [Candidate("survivor", o["step"], o["samples"], o["state"], r, o["kept"])
                      for r, o in outcomes.items() if o is not None and o.get("state")]  # fmt: skip
        checkpoint = self.root / "checkpoint.pt"
        if checkpoint.exists():  # an earlier generation's is no newer than this one's start
            saved = torch.load(checkpoint, weights_only=True)
            if saved["generation"] == generation:
                candidates.append(Candidate("checkpoint", saved["step"], saved["samples"], str(checkpoint),
                                            kept=saved["kept"]))  # fmt: skip
        chosen, why = choose_state([*candidates, replace(start, source="start", rank=None, kept=None)])
        if chosen.path is None:
            raise RankFailed(f"no state to restart from: {why}")
        return chosen, why

    def _account(self, gen: Generation, outcomes: dict[int, dict[str, Any] | None],
                 kept: dict[str, list[int]] | None) -> None:  # fmt: skip
        """Add the generation to each slot's totals: the steps and rows `kept` in the state the run goes on from (every
        member counted every rank's alike), and each member's measured times."""
        self.rebalances += max((o.get("rebalances", 0) for o in outcomes.values() if o), default=0)
        for r, slot in enumerate(gen.members):
            t = self.totals.setdefault(slot, Totals(slot))
            t.slowdown, t.generations = gen.cfg.slowdowns[r], t.generations + 1
            if kept is not None and kept["steps"][r]:
                t.steps += kept["steps"][r]
                t.samples += kept["rows"][r]
                t.batch = round(kept["rows"][r] / kept["steps"][r])  # a killed member's (the mean, when rebalanced)
            m = (outcomes.get(r) or {}).get("measurements")
            if m is None:  # killed: its samples count, its times in this generation are unknown
                t.partial = True
                continue
            t.batch, t.local_steps = m["batch"], m["local_steps"]
            t.compute_s += m["compute_s"]
            t.comm_s += m["comm_s"]
            t.wall_s += m["wall_s"]
            t.bytes_sent += m["bytes_sent"]

    def _restart(self, applied: list[Applied], outcomes: dict[int, dict[str, Any] | None],
                 progress: dict[str, Any], chosen: Candidate, why: str, before: list[int], after: list[int],
                 ended: float) -> None:  # fmt: skip
        """Record a restart (`Restart.resumed` completes it). Detection is when the first member that goes on stopped
        training (none goes on: when the agent saw the last exit). Its times are on the clock of the moment the event
        was applied: an evaluation that rank 0 finishes after it does not shift them."""
        clock = applied[0][2]
        events = [e for e, _, _ in applied]
        staying = [o for r, o in outcomes.items() if o is not None and before[r] in after]
        detected = min((o["stopped_at"] for o in staying), default=ended)
        # steps some member completed; with none left to say, rank 0's count at its last evaluation (a lower bound)
        reached = max([progress.get("step", 0), *(o.get("reached", 0) for o in outcomes.values() if o)])
        self.restarts.append(Restart(
            len(self.restarts) + 1, "+".join(e.action for e in events),
            [{"t": e.t, "peer": e.peer, "action": e.action} for e in events], events[0].t, applied[0][1] - clock,
            detected - clock, chosen.source, chosen.rank, why, chosen.step, max(0, reached - chosen.step),
            len(before), len(after), before, after, clock=clock,
        ))  # fmt: skip

    def _result(self, done: dict[str, Any], curve: list[dict[str, Any]], begin: float) -> dict[str, Any]:
        """`run_sync`'s result over the whole run, plus "restarts" and each peer's "slot"."""
        peers = [self.totals[s].row() for s in sorted(self.totals)]
        head = {**done["head"], "steps": done["step"], "curve": curve, "wall_s": done["train_time"],
                "rebalances": self.rebalances}  # fmt: skip
        return {**result_of(self.cfg, head, peers, begin), "restarts": [x.to_json() for x in self.restarts]}


def run_elastic(cfg: Config, trace: Trace, begin: float, deadline: float, work_dir: Path | None = None,
                checkpoint_every_s: float = CHECKPOINT_EVERY_S) -> dict[str, Any]:  # fmt: skip
    """Run `cfg` elastically through `trace`'s events; `run_sync`'s result with "restarts" (see `Agent`).

    Generations' files (states, outcomes, logs, the curve) go under `work_dir`, else a temporary folder removed
    at the end. Raises `RankFailed` when a member raises or dies unbidden, when no state is left to restart
    from, or at `deadline`; every member process is ended by PID either way.
    """
    schedule(trace)  # fail before starting anything
    with tempfile.TemporaryDirectory(prefix="murmur-elastic-") as tmp:
        root = Path(work_dir) if work_dir is not None else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        return Agent(cfg, trace, root, checkpoint_every_s).run(begin, deadline)


def _slowdown(trace: Trace, slot: int, t: float) -> float:
    """The slot's slowdown at training time `t`; asleep then, the one it wakes to (a trace's last is never None)."""
    peer = trace.peers[slot]
    now = peer.slowdown_at(t)
    return now if now is not None else next(s for at, s in zip(peer.times, peer.slowdowns) if at > t and s is not None)


def _curve(path: Path) -> list[dict[str, Any]]:
    """The run's curve from its file, in time order; a line a killed rank 0 left unfinished is skipped."""
    points = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            points.append(json.loads(line))
        except ValueError:
            continue
    return sorted(points, key=lambda pt: pt["t"])
