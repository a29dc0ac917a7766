"""One rank of the synchronous baseline (`lab.sync_baseline`): its process and training loop.

Every step the rank draws its batch and runs `train_step`; between backward and the
optimizer step (the `before_update` hook) it

1. pads the step to its emulated device's pace (`Pacing.padding`: a rank with slowdown S
   looks S times slower, or takes S * step_time_ms per 32 samples; with a trace, S follows the
   rank's trace peer over training time and a sleep is waited out). The padding comes
   before the all-reduce because it stands in for slower compute;
2. packs its gradient, scaled by its weight, into one flat buffer with control slots at the
   end ([eval_due, stop], set by rank 0, then in the rebalancing modes one per rank: its
   measured seconds per sample, `lab.rebalance`);
3. all-reduces the buffer (which doubles as the per-step barrier) and sets every
   gradient to its slice divided by the total weight, so every rank takes the same step.

Mode `diloco` (synchronous DiLoCo) instead steps every rank alone, with its own inner
optimizer, for `local_steps` steps; then the ranks all-reduce their pseudo-gradients
(anchor − parameters, the buffer again carrying the control slots) and every rank takes
the same outer Nesterov step from the shared anchor, as torchft's DiLoCo does by setting
`p.grad` and stepping `torch.optim.SGD(nesterov=True)` (`lab.diloco`, which also sends
the pseudo-gradients as int8 with `outer_wire` "int8"). Equal `local_steps` on every
rank: each sync waits for the slowest. Evaluations and the end fall on syncs.

Mode `adaptive` is `proportional` with the batches re-split every `rebalance_every` steps by
measured speed; `diloco-proportional` is `diloco` with each rank's inner steps re-split every round
by measured speed, the pseudo-gradients weighted by samples (`lab.rebalance`).

Clock: each rank starts it when it leaves a barrier that all ranks reach once ready
(start-up excluded). Compute time is the step minus the all-reduce; communication is
the all-reduce (waiting for the slowest rank included). Rank 0 owns the clock: before
a step's all-reduce it says whether an evaluation is due or training should stop.
After that step every rank stops its clock, rank 0 evaluates, and a one-element
broadcast from rank 0 (carrying "done": the target reached, with `min_samples` trained)
ends the pause for everyone; the paused interval is subtracted from each rank's wall time.

This module is what the ranks' fork server preloads: it imports torch, the tasks and
`train_step`, nothing of the network.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lab.diloco import Outer, all_reduce_int8, int8_bytes
from lab.flat import pack, unpack
from lab.rebalance import Balance, ResizedBatches, proportional_split, steps_split
from lab.sync_config import Config, batch_sizes, slot_of
from lab.traces import TracedPacing
from murmur.node.learn.step import Pacing, scale_learning_rate, train_step
from murmur.node.learn.tasks import Task, load_task
from murmur.node.learn.weight_average import WeightAverage

EVAL_SLOT, STOP_SLOT = 0, 1  # control slots after the gradients in the all-reduce buffer
CONTROL = 2  # ... then, when rebalancing, one slot per rank: its seconds per sample


@dataclass
class Rank:
    """One rank's setup: its share of the step, its model and optimizers, and the all-reduce buffer.

    `flat` holds the gradients (diloco: the pseudo-gradients) and, after them, the control
    slots; `outer` exists in the diloco modes only, `balance` in the rebalancing ones, which
    change `batches`, `inner` and the weights as they go.
    """

    rank: int
    cfg: Config
    task: Task
    batches: list[int]
    pacing: Pacing
    weight: float  # this rank's share of the mean gradient ...
    total_weight: float  # ... over all ranks' shares
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    average: WeightAverage
    evaluated: torch.nn.Module | None  # rank 0's copy of the model it scores
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    stream: ResizedBatches
    outer: Outer | None
    inner: list[int]  # each rank's steps per sync: 1, or its inner steps in the diloco modes
    balance: Balance | None

    @property
    def batch(self) -> int:
        return self.batches[self.rank]

    @property
    def diloco(self) -> bool:
        return self.cfg.mode.startswith("diloco")

    @property
    def numel(self) -> int:
        return len(self.flat) - CONTROL - (len(self.balance.speeds) if self.balance else 0)

    def slot(self, index: int) -> bool:
        """Whether rank 0 set control slot `index` in the last all-reduce."""
        return self.flat[self.numel + index].item() > 0


@dataclass
class Progress:
    """What changes as a rank trains: its clock, its counts and (rank 0) its curve."""

    next_eval: float
    clock_start: float = 0.0
    paused: float = 0.0  # evaluation pauses, excluded from training time
    steps: int = 0
    last_sync: int = 0  # `steps` at the last sync
    syncs: int = 0
    samples: int = 0  # this rank's, counted at syncs ...
    trained: int = 0  # ... and every rank's
    compute_s: float = 0.0
    comm_s: float = 0.0
    reduce_start: float = 0.0  # this step's all-reduce: its start and end
    reduce_end: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)

    def train_time(self) -> float:
        return time.monotonic() - self.clock_start - self.paused


def train(rank: int, cfg: Config) -> dict[str, Any]:
    """Run one rank's training loop and return its measurements (rank 0: also the curve)."""
    torch.set_num_threads(1)  # N ranks share the CPU; one thread each keeps them honest
    _join_group(rank, cfg)
    state = Progress(next_eval=cfg.eval_every)
    r = _setup(rank, cfg, state.train_time)
    if rank == 0:
        state.curve.append({"t": 0.0, "samples": 0, **r.task.evaluate(r.model)})
    dist.barrier()  # everyone is ready: start-up ends here
    state.clock_start = time.monotonic()
    loop(r, state)
    out = _measurements(r, state)
    dist.destroy_process_group()
    return out


def loop(r: Rank, state: Progress, after_step: Callable[[bool, bool], bool] | None = None) -> bool:
    """Train from `state` until rank 0 says training is over (True) or `after_step` asks to leave (False).

    `after_step(synced, evaluated)` runs on every rank after each step (and its evaluation); a rank that leaves
    must do so at a synced step, where every rank's state is the group's (`lab.elastic_rank`)."""
    while True:
        began = time.monotonic()  # drawing the batch is part of the local compute
        hook = partial(_pace, r, began) if r.diloco else partial(_reduce_gradients, r, state, began)
        train_step(r.task, r.model, r.optimizer, next(r.stream), before_update=hook)
        state.steps += 1
        synced = state.steps - state.last_sync == r.inner[r.rank]
        if r.diloco:
            state.reduce_start = state.reduce_end = time.monotonic()
            if synced:
                _outer_step(r, state)
        if synced:
            _count_sync(r, state)
        r.average.update(r.model)
        eval_due, stop = synced and r.slot(EVAL_SLOT), synced and r.slot(STOP_SLOT)
        ended = time.monotonic()
        state.compute_s += (state.reduce_start - began) + (ended - state.reduce_end)
        state.comm_s += state.reduce_end - state.reduce_start
        if eval_due:
            stop = _evaluate(r, state, ended) or stop
        leave = after_step is not None and after_step(synced, eval_due)
        if stop or leave:
            return stop


def _join_group(rank: int, cfg: Config) -> None:
    """Join the gloo group through the rendezvous store (hosted by the parent, or by rank 0 with `store_on_rank0`)."""
    n = len(cfg.slowdowns)
    timeout = timedelta(seconds=cfg.pg_timeout_s)
    master = cfg.store_on_rank0 and rank == 0
    store = dist.TCPStore(cfg.store_host, cfg.port, world_size=n, is_master=master, wait_for_workers=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)


def _setup(rank: int, cfg: Config, clock: Callable[[], float]) -> Rank:
    """Build the rank's model (rank 0's, broadcast), optimizers, data stream, buffer and pacing (on `clock`)."""
    task: Task = load_task(cfg.task)
    batches = batch_sizes(task.batch_size, cfg.slowdowns, cfg.mode)
    n, speeds = len(cfg.slowdowns), [1.0 / s for s in cfg.slowdowns]
    inner = [cfg.local_steps] * n if cfg.mode == "diloco" else [1] * n
    if cfg.mode == "diloco-proportional":
        inner = steps_split(cfg.local_steps, speeds)
    balance = Balance(speeds) if cfg.mode in ("adaptive", "diloco-proportional") else None
    model = task.build_model()
    if cfg.broadcast_init:
        with torch.no_grad():  # start identical even if a task's init were not seeded (as DDP does)
            for t in itertools.chain(model.parameters(), model.buffers()):
                dist.broadcast(t, src=0)
    optimizer = task.make_optimizer(model)
    scale_learning_rate(optimizer, cfg.lr_scale)
    # Only rank 0 evaluates, so only it keeps the average and the copy it scores.
    average = WeightAverage(model, cfg.ema_decay if rank == 0 else 0.0)
    evaluated = copy.deepcopy(model) if rank == 0 else None
    torch.manual_seed(1000 * cfg.seed + rank)  # per-rank randomness (dropout etc.)
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.zeros(sum(p.numel() for p in params) + CONTROL + (n if balance else 0), dtype=params[0].dtype)
    stream = ResizedBatches(iter(task.train_batches(shard=slot_of(cfg, rank) + 1000 * cfg.seed)), batches[rank])
    outer = Outer(params, cfg.outer_lr, cfg.outer_momentum) if cfg.mode.startswith("diloco") else None
    pacing = Pacing(cfg.slowdowns[rank], cfg.step_time_ms)
    if cfg.trace is not None:  # `run_sync` checks that a traced run has step_time_ms
        peer = cfg.trace.peers[slot_of(cfg, rank)]
        pacing = TracedPacing(peer, cfg.step_time_ms, clock=clock)  # type: ignore[arg-type]
    return Rank(
        rank, cfg, task, batches, pacing, *_weights(cfg.mode, rank, inner, batches),
        model, optimizer, average, evaluated, params, flat, stream, outer, inner, balance,
    )  # fmt: skip


def _weights(mode: str, rank: int, inner: list[int], batches: list[int]) -> tuple[float, float]:
    """This rank's weight in the all-reduce and the total: equal and diloco take the plain mean over
    ranks, the other modes the sample-weighted one (a rank's samples per sync over everyone's)."""
    if mode in ("equal", "diloco"):
        return 1.0, float(len(batches))
    return float(inner[rank] * batches[rank]), float(sum(h * b for h, b in zip(inner, batches)))


def _count_sync(r: Rank, state: Progress) -> None:
    """Count a sync's samples; in the rebalancing modes, re-split by the speeds just shared when one is due."""
    state.syncs += 1
    state.last_sync = state.steps
    state.samples += r.inner[r.rank] * r.batch
    state.trained += sum(h * b for h, b in zip(r.inner, r.batches))
    if r.balance is None or (not r.diloco and state.syncs % r.cfg.rebalance_every):
        return
    speeds = r.balance.update(r.flat[r.numel + CONTROL :])
    if r.diloco:
        r.inner = steps_split(r.cfg.local_steps, speeds)
    else:  # the stream's next batch has the new size
        r.batches = proportional_split(r.task.batch_size * len(r.batches), speeds)
        r.stream.size = r.batch
    r.weight, r.total_weight = _weights(r.cfg.mode, r.rank, r.inner, r.batches)


def _pace(r: Rank, began: float) -> None:
    """The emulated device's extra time for this step's compute (timed, padding included, when rebalancing)."""
    time.sleep(r.pacing.padding(time.monotonic() - began, r.batch))
    if r.balance is not None:
        r.balance.add(time.monotonic() - began, r.batch)


def _all_reduce(r: Rank, state: Progress) -> None:
    """All-reduce `flat` with the control slots rank 0 sets: it owns the clock, evaluations and the end."""
    r.flat[r.numel :] = 0.0
    if r.rank == 0:
        now = state.train_time()
        stop = now >= r.cfg.duration
        r.flat[r.numel + EVAL_SLOT] = float(stop or now >= state.next_eval)  # always evaluate at the end
        r.flat[r.numel + STOP_SLOT] = float(stop)
    if r.balance is not None:
        r.balance.write(r.flat[r.numel + CONTROL :], r.rank)
    state.reduce_start = time.monotonic()
    if r.diloco and r.cfg.outer_wire == "int8":
        all_reduce_int8(r.flat, r.numel)
    else:
        dist.all_reduce(r.flat)  # waits for the slowest rank
    state.reduce_end = time.monotonic()


def _reduce_gradients(r: Rank, state: Progress, began: float) -> None:
    """`train_step`'s hook in the synchronous modes: pace, then average the gradients."""
    _pace(r, began)
    pack(r.params, r.flat, r.weight)
    _all_reduce(r, state)
    unpack(r.params, r.flat, r.total_weight)


@torch.no_grad()
def _outer_step(r: Rank, state: Progress) -> None:
    """DiLoCo's sync: the weighted mean pseudo-gradient (anchor − parameters) steps the anchor; all restart from it."""
    assert r.outer is not None
    r.outer.pseudo_gradient(r.params, r.flat, r.weight)
    _all_reduce(r, state)
    r.outer.step(r.params, r.flat, r.total_weight)


def _evaluate(r: Rank, state: Progress, stopped: float) -> bool:
    """Every rank pauses its clock (stopped at `stopped`) while rank 0 evaluates; return whether rank 0
    says training is done (the target reached with `min_samples` trained). The broadcast ends the pause."""
    done = torch.zeros(1)
    if r.rank == 0:
        assert r.evaluated is not None
        t_eval = stopped - state.clock_start - state.paused
        r.evaluated.load_state_dict(r.average.averaged(r.model))
        point = {"t": t_eval, "samples": state.trained, **r.task.evaluate(r.evaluated)}
        state.curve.append(point)
        metric, target = r.task.metric, r.cfg.target
        if target is not None and metric.reached(point[metric.name], target) and point["samples"] >= r.cfg.min_samples:
            done[0] = 1.0
        while state.next_eval <= t_eval:  # next point of the grid
            state.next_eval += r.cfg.eval_every
    dist.broadcast(done, src=0)
    state.paused += time.monotonic() - stopped
    return done.item() > 0


def _measurements(r: Rank, state: Progress) -> dict[str, Any]:
    """The rank's results: its counts and times; rank 0 adds the curve and what it was measured on."""
    n, steps, wall = len(r.cfg.slowdowns), state.steps, state.train_time()
    grad_bytes = sum(p.numel() * p.element_size() for p in r.params)
    out: dict[str, Any] = {
        "rank": r.rank,
        "slowdown": r.pacing.slowdown,
        "batch": r.batch,
        "steps": steps,
        "samples": state.samples,
        "local_steps": r.inner[r.rank],  # the last round's (1 outside the diloco modes)
        "compute_s": state.compute_s,
        "comm_s": state.comm_s,
        "wall_s": wall,
        "idle_fraction": 1.0 - state.compute_s / wall if wall > 0 else 0.0,
        # ring all-reduce: each rank sends 2 (n-1)/n of the gradient per sync; int8: see lab.diloco
        "bytes_sent": state.syncs * int8_bytes(r.numel, len(r.flat) - r.numel, n)
        if r.diloco and r.cfg.outer_wire == "int8" else int(state.syncs * 2 * (n - 1) / n * grad_bytes),
    }
    if r.rank == 0:
        metric = r.task.metric
        out.update(
            curve=state.curve, clock_start=state.clock_start, eval_s=state.paused, task=r.task.name, metric=metric.name,
            higher_is_better=metric.higher_is_better, batch_size=r.task.batch_size, batches=r.batches,
            inner_steps=r.inner, rebalances=r.balance.count if r.balance else 0,
        )  # fmt: skip
    return out


def write_json(path: Path, data: Any) -> None:
    """Write `data` to `path` whole or not at all: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def run_rank(rank: int, cfg: Config, out: str) -> None:
    """Process entry point for a rank in its own network namespace: train, write its result as JSON
    to `out` (or its traceback to `out` + ".error"), then exit 0 (or 1)."""
    try:
        write_json(Path(out), train(rank, cfg))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure
        with open(out + ".error", "w") as f:
            f.write(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as `worker`: skip torch's slow interpreter teardown


def worker(rank: int, cfg: Config, results: Any) -> None:
    """Process entry point: report ("result", rank, dict) or ("error", rank, traceback), then exit."""
    try:
        results.put(("result", rank, train(rank, cfg)))
        code = 0
    except BaseException:  # noqa: BLE001 - the parent must hear about every failure
        results.put(("error", rank, traceback.format_exc()))
        code = 1
    # Flush the report, then skip interpreter teardown: with torch loaded it takes
    # seconds, and there is nothing left to clean up (the group is destroyed or broken).
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
