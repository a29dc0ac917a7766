"""One member of the elastic synchronous baseline (`lab.elastic`): a `lab.sync_rank` rank that can stop, save
the group's state and start again from a saved one.

A member trains in `lab.sync_rank.loop` (the same setup, step, all-reduce, evaluation and clock as a sync rank;
`Member.after_step` is its hook) with three differences:

- it starts from a saved state when its plan names one: model, optimizers (the diloco modes: the anchor and outer
  optimizer too), weight average (rank 0), group step and sample counts, the clock's origin and pause total (so the
  run's time axis, which a trace's pacing follows, goes on across restarts) and the next evaluation; its data
  stream skips the rows its peer (slot) already trained on. The split (batches, inner steps, a rebalancing mode's
  speeds) starts again from the new membership's slowdowns;
- it stops at a synced step boundary when asked (SIGTERM, from the agent) and when a collective fails because a
  member died or left; either way it writes the state after the last sync every rank completed, then exits 0.
  Every rank takes the same step, so any member's state is the group's; the step in flight is lost (in the diloco
  modes, the round since the last sync);
- rank 0 appends each evaluation to the run's curve file as it makes it (the curve outlives rank 0), keeps a
  progress file the agent reads (clock origin and pauses, when the group trained again) and writes a checkpoint
  every `checkpoint_every_s` of training time, the fallback when no member could save.

The outcome (`Plan.outcome(rank)`, JSON) says how the member ended: "done" (training is over), "stopped"
(asked to), "interrupted" (a collective failed) or "lost" (the group never formed: nothing to save); a
member that raised anything else writes its traceback next to it and exits 1. Its "kept" and a saved state's are
each rank's steps and rows in this generation up to the state's sync, which the agent adds to each slot's totals.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab import sync_rank as sr
from lab.sync_rank import Config, Progress, Rank
from murmur.node.learn.tasks import Batch

_STOP = threading.Event()  # set by SIGTERM: save at the next synced step and exit


@dataclass(frozen=True)
class Plan:
    """What a generation's members need besides their `Config`; paths are strings (pickled to the fork server)."""

    generation: int
    gen_dir: str  # outcomes, saved states, logs and rank 0's progress file of this generation
    resume: str | None  # the state to start from; None: a fresh start from rank 0's initial model
    rows: tuple[int, ...]  # per rank: rows its slot has trained on so far (its stream skips them)
    curve: str  # the run's curve, one JSON point a line, appended to by each generation's rank 0
    checkpoint: str  # rank 0's periodic checkpoint
    checkpoint_every_s: float

    def outcome(self, rank: int) -> Path:
        return Path(self.gen_dir) / f"rank{rank}.json"

    def state(self, rank: int) -> Path:
        return Path(self.gen_dir) / f"rank{rank}.pt"

    @property
    def progress(self) -> Path:
        return Path(self.gen_dir) / "progress.json"


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective or rendezvous failing because another member died, left or timed out."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e).lower())


def skipped(stream: Iterator[Batch], rows: int) -> Iterator[Batch]:
    """`stream` without its first `rows` rows (the rest of a batch cut by the skip comes first)."""
    while rows > 0:
        x, y = next(stream)
        if len(y) > rows:
            yield x[rows:], y[rows:]
        rows -= len(y)
    yield from stream


def member(rank: int, cfg: Config, plan: Plan) -> None:
    """Process entry point: train, write the outcome to `plan.outcome(rank)` (or a traceback to its ".error"
    twin), then exit 0 (or 1) without the interpreter's slow teardown."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _STOP.set())  # first: the agent may ask at once
    out = plan.outcome(rank)
    try:
        sr.write_json(out, _run(rank, cfg, plan))
        code = 0
    except BaseException:  # noqa: BLE001 - the agent must hear about every failure
        Path(f"{out}.error").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(rank: int, cfg: Config, plan: Plan) -> dict[str, Any]:
    """Form the group, restore, train until done, asked to stop or interrupted; return the outcome."""
    torch.set_num_threads(1)  # members share the CPU, as sync ranks do
    head = {"rank": rank, "slot": sr.slot_of(cfg, rank), "generation": plan.generation}
    state = Progress(next_eval=cfg.eval_every)
    try:
        sr._join_group(rank, cfg)
        r = sr._setup(rank, cfg, state.train_time)  # the trace's time is the run's training time, restarts and all
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        return {**head, "kind": "lost", "why": _first_line(e), "stopped_at": time.monotonic()}
    step, origin = _restore(r, state, plan) if plan.resume else (0, None)
    r.stream.stream = skipped(r.stream.stream, plan.rows[rank])
    if origin is None and rank == 0:
        state.curve.append({"t": 0.0, "samples": 0, **r.task.evaluate(r.model)})
    try:
        dist.barrier()  # everyone is ready: start-up (a first generation's) or restart ends here
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        return {**head, "kind": "lost", "why": _first_line(e), "stopped_at": time.monotonic()}
    started = time.monotonic()
    state.clock_start = started if origin is None else origin
    me = Member(r, state, plan, step, started)
    try:
        if not sr.loop(r, state, me.after_step):
            return {**head, **me.stopped("stopped", "asked to stop (SIGTERM)")}
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        me.write_curve()  # rank 0 may have scored before it failed
        return {**head, **me.stopped("interrupted", _first_line(e))}
    me.write_curve()
    out = {**head, **me.outcome("done"), "train_time": state.train_time()}
    dist.destroy_process_group()
    return out


class Member:
    """A member's side of `lab.sync_rank.loop`: counts what the group kept, keeps rank 0's files, saves.

    Group steps are counted in syncs (times `local_steps` in the diloco modes, the fastest rank's inner steps);
    `kept` holds each rank's steps and rows up to the last sync, as every rank counts them alike."""

    def __init__(self, r: Rank, state: Progress, plan: Plan, step: int, started: float) -> None:
        self.r, self.state, self.plan, self.step = r, state, plan, step  # `step`: group steps before this generation
        self.started, self.paused = started, state.paused  # this generation's wall excludes its evaluations
        self.split = (list(r.inner), list(r.batches))  # the split the next sync counts
        self.kept = {"steps": [0] * len(r.batches), "rows": [0] * len(r.batches)}
        self.tallied = 0  # syncs in `kept`
        self.written = 0  # curve points already in the curve file
        self.next_checkpoint = state.train_time() + plan.checkpoint_every_s
        self.progress = {"origin": state.clock_start, "paused": state.paused, "started": self.started,
                         "first_step": None, "batches": r.batches, "step": step}  # fmt: skip
        if r.rank == 0:
            sr.write_json(plan.progress, self.progress)

    def group_step(self) -> int:
        return self.step + self.state.syncs * (self.r.cfg.local_steps if self.r.diloco else 1)

    def after_step(self, synced: bool, evaluated: bool) -> bool:
        """`loop`'s hook: tally a sync, record the first step and evaluations, checkpoint; leave when asked to."""
        r, state = self.r, self.state
        if r.rank == 0 and self.progress["first_step"] is None:
            self.progress["first_step"] = state.reduce_end  # the group trained: the step's all-reduce is over
            sr.write_json(self.plan.progress, self.progress)
        self.tally()
        if evaluated:
            self.write_curve()
            if r.rank == 0:
                self.progress.update(paused=state.paused, step=self.group_step())
                sr.write_json(self.plan.progress, self.progress)
        if not synced:
            return False
        if _STOP.is_set():
            return True
        if r.rank == 0 and state.train_time() >= self.next_checkpoint:
            self.save(Path(self.plan.checkpoint))
            self.next_checkpoint = state.train_time() + self.plan.checkpoint_every_s
        return False

    def tally(self) -> None:
        """Add a sync `loop` counted since the last tally (at most one: an evaluation that failed can come between)
        to `kept`, as `state.trained` has it."""
        if self.tallied < self.state.syncs:
            for i, (h, b) in enumerate(zip(*self.split)):
                self.kept["steps"][i] += h
                self.kept["rows"][i] += h * b
            self.split = (list(self.r.inner), list(self.r.batches))  # a rebalance at this sync sets the next one's
            self.tallied = self.state.syncs

    def write_curve(self) -> None:
        """Append the points past those written to the run's curve file (rank 0's; their samples are the run's)."""
        if self.written < len(self.state.curve):
            with open(self.plan.curve, "a") as f:
                f.writelines(json.dumps(point) + "\n" for point in self.state.curve[self.written :])
            self.written = len(self.state.curve)

    def outcome(self, kind: str) -> dict[str, Any]:
        """What the agent reads of a member that ended as `kind`: the group's counts and this member's times."""
        r, state = self.r, self.state
        self.tally()
        measured = sr._measurements(r, state)
        wall = time.monotonic() - self.started - (state.paused - self.paused)  # since the group formed
        idle = 1.0 - state.compute_s / wall if wall > 0 else 0.0
        measured.update(steps=state.last_sync, wall_s=wall, idle_fraction=idle)
        measured.pop("curve", None)
        metric = r.task.metric
        return {"kind": kind, "stopped_at": time.monotonic(), "step": self.group_step(), "samples": state.trained,
                "reached": self.group_step() + state.steps - state.last_sync, "kept": self.kept,
                "measurements": measured, "rebalances": r.balance.count if r.balance else 0,
                # what the run's result says of the task and clock, from whichever member outlives the end
                "head": {"task": r.task.name, "metric": metric.name, "higher_is_better": metric.higher_is_better,
                         "batch_size": r.task.batch_size, "clock_start": state.clock_start, "eval_s": state.paused,
                         "inner_steps": r.inner, "batches": r.batches}}  # fmt: skip

    def stopped(self, kind: str, why: str) -> dict[str, Any]:
        """Save the state after the last step every rank completed; the outcome of a member that stopped early."""
        path = self.plan.state(self.r.rank)
        self.save(path)
        return {**self.outcome(kind), "why": why, "state": str(path)}

    @torch.no_grad()
    def save(self, path: Path) -> None:
        """Write the group's state at the last sync to `path` (whole or not at all).

        The diloco modes save the anchor (the model of the last sync) as the parameters, and the outer optimizer;
        the inner optimizer's state is this member's, and every member of the next generation starts from it.
        """
        r, state = self.r, self.state
        self.tally()
        model = r.model.state_dict()
        if r.outer is not None:
            names = [name for name, p in r.model.named_parameters() if p.requires_grad]
            model = {**model, **{name: a.detach() for name, a in zip(names, r.outer.anchor)}}
        saved = {
            "generation": self.plan.generation, "step": self.group_step(), "samples": state.trained, "kept": self.kept,
            "origin": state.clock_start, "paused": state.paused, "next_eval": state.next_eval, "model": model,
            "optimizer": r.optimizer.state_dict(), "outer": r.outer.optimizer.state_dict() if r.outer else None,
            "average": r.average.averaged(r.model) if r.average.decay else None,
        }  # fmt: skip
        tmp = path.with_name(path.name + ".tmp")
        torch.save(saved, tmp)
        os.replace(tmp, path)


@torch.no_grad()
def _restore(r: Rank, state: Progress, plan: Plan) -> tuple[int, float]:
    """Load the plan's saved state into the rank and its clock and counts into `state`; return the group step and
    the clock's origin."""
    assert plan.resume is not None
    saved = torch.load(plan.resume, weights_only=True)
    r.model.load_state_dict(saved["model"])
    r.optimizer.load_state_dict(saved["optimizer"])
    if r.outer is not None:  # the anchor is the model saved
        for a, p in zip(r.outer.anchor, r.params):
            a.copy_(p)
        r.outer.optimizer.load_state_dict(saved["outer"])
    r.average.load_averaged(saved["average"] or {}, r.model)  # none saved: the average starts again from the model
    state.paused, state.next_eval, state.trained = saved["paused"], saved["next_eval"], saved["samples"]
    return saved["step"], saved["origin"]


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
