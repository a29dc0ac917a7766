"""One member of the elastic synchronous baseline (`lab.elastic`): a `lab.sync_rank` rank that can stop, save
the group's state and start again from a saved one.

A member trains as `lab.sync_rank.train` does (the same setup, step, all-reduce, evaluation and clock) with
three differences:

- it starts from a saved state when its plan names one: model, optimizers, weight average (rank 0), step and
  sample counts, the clock's origin and pause total (so the run's time axis goes on across restarts) and the
  next evaluation; its data stream skips the rows its peer (slot) already trained on;
- it stops at a synced step boundary when asked (SIGTERM, from the agent) and when a collective fails because a
  member died or left; either way it writes the state after the last step every rank completed, then exits 0.
  Every rank takes the same step, so any member's state is the group's; the step in flight is lost (in mode
  `diloco`, the round since the last sync);
- rank 0 appends each evaluation to the run's curve file as it makes it (the curve outlives rank 0), keeps a
  progress file the agent reads (clock origin and pauses, when the group trained again) and writes a checkpoint
  every `checkpoint_every_s` of training time, the fallback when no member could save.

The outcome (`Plan.outcome(rank)`, JSON) says how the member ended: "done" (training is over), "stopped"
(asked to), "interrupted" (a collective failed) or "lost" (the group never formed: nothing to save); a
member that raised anything else writes its traceback next to it and exits 1.
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
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab import sync_rank as sr
from lab.sync_rank import Config, Progress, Rank
from murmur.node.learn.step import train_step
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


@dataclass
class Carried:
    """What a generation inherits from the ones before: group step and sample counts, and the run's clock."""

    step: int
    samples: int
    origin: float | None  # monotonic time of the run's first barrier; None before it
    paused: float
    next_eval: float


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective or rendezvous failing because another member died, left or timed out."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e).lower())


def write_json(path: Path, data: Any) -> None:
    """Write `data` to `path` whole or not at all: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


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
        write_json(out, _run(rank, cfg, plan))
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
    try:
        sr._join_group(rank, cfg)
        r = sr._setup(rank, cfg)
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        return {**head, "kind": "lost", "why": _first_line(e), "stopped_at": time.monotonic()}
    carried = _restore(r, plan) if plan.resume else Carried(0, 0, None, 0.0, cfg.eval_every)
    if plan.rows[rank]:
        r.stream = sr.resized_batches(skipped(r.stream, plan.rows[rank]), r.batch)
    state = Progress(next_eval=carried.next_eval, paused=carried.paused)
    if carried.origin is None and rank == 0:
        state.curve.append({"t": 0.0, "samples": 0, **r.task.evaluate(r.model)})
        _append_curve(plan, state.curve, 0)
    try:
        dist.barrier()  # everyone is ready: start-up (a first generation's) or restart ends here
    except RuntimeError as e:
        if not is_peer_failure(e):
            raise
        return {**head, "kind": "lost", "why": _first_line(e), "stopped_at": time.monotonic()}
    started = time.monotonic()
    state.clock_start = started if carried.origin is None else carried.origin
    return {**head, **_train(r, state, carried, plan, started)}


def _train(r: Rank, state: Progress, carried: Carried, plan: Plan, started: float) -> dict[str, Any]:
    """`lab.sync_rank.train`'s loop, which also stops and saves (see the module docstring)."""
    cfg, progress = r.cfg, {"origin": state.clock_start, "paused": state.paused, "started": started,
                            "first_step": None, "batches": r.batches, "step": carried.step}  # fmt: skip
    if r.rank == 0:
        write_json(plan.progress, progress)
    next_checkpoint = state.train_time() + plan.checkpoint_every_s
    kept = 0  # this generation's steps that every rank completed (diloco: up to the last sync)
    written = len(state.curve)  # curve points already in the curve file
    while True:
        try:
            began = time.monotonic()
            hook = partial(sr._pace, r, began) if r.diloco else partial(sr._reduce_gradients, r, state, began)
            train_step(r.task, r.model, r.optimizer, next(r.stream), before_update=hook)
            state.steps += 1
            synced = not r.diloco or state.steps % cfg.local_steps == 0
            if r.diloco:
                state.reduce_start = state.reduce_end = time.monotonic()
                if synced:
                    sr._outer_step(r, state)
            if synced:
                kept = state.steps
            r.average.update(r.model)
            eval_due, stop = synced and r.slot(sr.EVAL_SLOT), synced and r.slot(sr.STOP_SLOT)
            ended = time.monotonic()
            state.compute_s += (state.reduce_start - began) + (ended - state.reduce_end)
            state.comm_s += state.reduce_end - state.reduce_start
            if r.rank == 0 and progress["first_step"] is None:
                progress["first_step"] = ended
                write_json(plan.progress, progress)
            if eval_due:
                stop = sr._evaluate(r, state, ended) or stop
                written = _append_curve(plan, state.curve, written, carried.samples)
                if r.rank == 0:
                    progress.update(paused=state.paused, step=carried.step + kept)
                    write_json(plan.progress, progress)
        except RuntimeError as e:
            if not is_peer_failure(e):
                raise
            _append_curve(plan, state.curve, written, carried.samples)  # rank 0 may have scored before it failed
            return _stopped(r, state, carried, plan, kept, started, "interrupted", _first_line(e))
        if stop:
            break
        if synced and _STOP.is_set():
            return _stopped(r, state, carried, plan, kept, started, "stopped", "asked to stop (SIGTERM)")
        if r.rank == 0 and synced and state.train_time() >= next_checkpoint:
            _save(r, state, carried, kept, Path(plan.checkpoint))
            next_checkpoint = state.train_time() + plan.checkpoint_every_s
    metric = r.task.metric
    out = {"kind": "done", "stopped_at": time.monotonic(), "step": carried.step + kept,
           "reached": carried.step + state.steps, "train_time": state.train_time(),
           "measurements": _generation_measurements(r, state, kept, started),
           # what the run's result says of the task and clock, from whichever member outlives the end
           "head": {"task": r.task.name, "metric": metric.name, "higher_is_better": metric.higher_is_better,
                    "batch_size": r.task.batch_size, "clock_start": state.clock_start,
                    "eval_s": state.paused}}  # fmt: skip
    dist.destroy_process_group()
    return out


def _stopped(r: Rank, state: Progress, carried: Carried, plan: Plan, kept: int, started: float, kind: str,
             why: str) -> dict[str, Any]:  # fmt: skip
    """Save the state after the last step every rank completed; the outcome of a member that stopped early."""
    stopped_at = time.monotonic()
    path = plan.state(r.rank)
    _save(r, state, carried, kept, path)
    return {"kind": kind, "why": why, "stopped_at": stopped_at, "state": str(path), "step": carried.step + kept,
            "samples": carried.samples + kept * sum(r.batches), "reached": carried.step + state.steps,
            "measurements": _generation_measurements(r, state, kept, started)}  # fmt: skip


@torch.no_grad()
def _save(r: Rank, state: Progress, carried: Carried, kept: int, path: Path) -> None:
    """Write the group's state after `kept` of this generation's steps to `path` (whole or not at all).

    Mode diloco: the parameters saved are the anchor, the model of the last sync; the inner optimizer's state is
    this member's, and every member of the next generation starts from it.
    """
    model = r.model.state_dict()
    if r.diloco:
        names = [name for name, p in r.model.named_parameters() if p.requires_grad]
        model = {**model, **{name: a.detach() for name, a in zip(names, r.anchor)}}
    saved = {
        "step": carried.step + kept,
        "samples": carried.samples + kept * sum(r.batches),
        "origin": state.clock_start,
        "paused": state.paused,
        "next_eval": state.next_eval,
        "model": model,
        "optimizer": r.optimizer.state_dict(),
        "outer": r.outer.state_dict() if r.outer is not None else None,
        "average": r.average.averaged(r.model) if r.average.decay else None,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(saved, tmp)
    os.replace(tmp, path)


@torch.no_grad()
def _restore(r: Rank, plan: Plan) -> Carried:
    """Load the plan's saved state into the rank; what the generation carries on from."""
    assert plan.resume is not None
    saved = torch.load(plan.resume, weights_only=True)
    r.model.load_state_dict(saved["model"])
    r.optimizer.load_state_dict(saved["optimizer"])
    if r.outer is not None:
        for a, p in zip(r.anchor, r.params):
            a.copy_(p)
        r.outer.load_state_dict(saved["outer"])
    r.average.load_averaged(saved["average"] or {}, r.model)  # none saved: the average starts again from the model
    return Carried(saved["step"], saved["samples"], saved["origin"], saved["paused"], saved["next_eval"])


def _append_curve(plan: Plan, curve: list[dict[str, float]], written: int, samples_before: int = 0) -> int:
    """Append the points past `written` to the run's curve file, their samples counted over the whole run;
    return how many points are written now."""
    if written >= len(curve):
        return written
    with open(plan.curve, "a") as f:
        for point in curve[written:]:
            point["samples"] += samples_before
            f.write(json.dumps(point) + "\n")
    return len(curve)


def _generation_measurements(r: Rank, state: Progress, kept: int, started: float) -> dict[str, Any]:
    """`_measurements` for this generation alone: steps and samples kept, time since the group formed."""
    out = sr._measurements(r, state)
    wall = time.monotonic() - started
    out.update(steps=kept, samples=kept * r.batch, wall_s=wall,
               idle_fraction=1.0 - state.compute_s / wall if wall > 0 else 0.0)  # fmt: skip
    return out


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
