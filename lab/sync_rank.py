"""One rank of the synchronous baseline (`lab.sync_baseline`): its process and training loop.

Every step the rank draws its batch and runs `train_step`; between backward and the
optimizer step (the `before_update` hook) it

1. pads the step to its emulated device's pace (`Pacing.padding`: a rank with slowdown S
   looks S times slower, or takes S * step_time_ms per 32 samples). The padding comes
   before the all-reduce because it stands in for slower compute;
2. packs its gradient, scaled by its weight, into one flat buffer with two control
   slots at the end ([eval_due, stop], set by rank 0);
3. all-reduces the buffer (which doubles as the per-step barrier) and sets every
   gradient to its slice divided by the total weight, so every rank takes the same step.

Mode `diloco` (synchronous DiLoCo) instead steps every rank alone, with its own inner
optimizer, for `local_steps` steps; then the ranks all-reduce their pseudo-gradients
(anchor − parameters, the buffer again carrying the control slots) and every rank takes
the same outer Nesterov step from the shared anchor, as torchft's DiLoCo does by setting
`p.grad` and stepping `torch.optim.SGD(nesterov=True)`. Equal `local_steps` on every
rank: each sync waits for the slowest. Evaluations and the end fall on syncs.

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
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from murmur.node.learn.step import Pacing, scale_learning_rate, train_step
from murmur.node.learn.tasks import Batch, Task, load_task
from murmur.node.learn.weight_average import WeightAverage

MODES = ("equal", "proportional", "diloco")
HOST = "127.0.0.1"
EVAL_SLOT, STOP_SLOT = 0, 1  # control slots after the gradients in the all-reduce buffer


@dataclass(frozen=True)
class Config:
    """Everything a rank needs; pickled to each rank's process."""

    task: str
    slowdowns: tuple[float, ...]
    mode: str
    duration: float
    step_time_ms: float | None
    target: float | None
    eval_every: float
    seed: int
    port: int
    pg_timeout_s: float
    lr_scale: float = 1.0  # multiplies the task's learning rate (the sweep's knob)
    local_steps: int = 16  # diloco: inner steps between syncs
    outer_lr: float = 0.7  # diloco's outer Nesterov step
    outer_momentum: float = 0.9
    min_samples: int = 0  # train past the target until this many samples (where the bench compares every method)
    ema_decay: float = 0.0  # evaluate a moving average of the weights, as `murmur run --ema-decay` does
    # Where the rendezvous store listens. On loopback the parent hosts it; over slow links each rank has its own
    # network namespace, which the parent is not in, so rank 0 hosts it on its namespace's address.
    store_host: str = HOST
    store_on_rank0: bool = False
    slots: tuple[int, ...] | None = None  # rank r is trace peer slots[r] (its data shard); None: rank r is peer r


def slot_of(cfg: Config, rank: int) -> int:
    """The trace peer that `rank` stands for: its data shard follows the peer, not the rank number."""
    return rank if cfg.slots is None else cfg.slots[rank]


def batch_sizes(base: int, slowdowns: Sequence[float], mode: str) -> list[int]:
    """Return each rank's per-step batch for `mode`; raises `ValueError` for an unknown mode.

    equal and diloco: `base` everywhere. proportional: round-half-up of
    base * n * speed_r / sum(speeds), at least 1, with speed_r = 1 / slowdown_r,
    so the whole step holds about n * base samples split by speed.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    n = len(slowdowns)
    if mode != "proportional":
        return [base] * n
    speeds = [1.0 / s for s in slowdowns]
    total = sum(speeds)
    return [max(1, math.floor(base * n * v / total + 0.5)) for v in speeds]


def resized_batches(stream: Iterator[Batch], size: int) -> Iterator[Batch]:
    """Yield batches of exactly `size` rows, taking rows from `stream` in order.

    Rows left over from one batch start the next, so no sample is skipped or repeated
    beyond what the stream itself does.
    """
    xs: list[torch.Tensor] = []
    ys: list[torch.Tensor] = []
    have = 0
    while True:
        while have < size:
            x, y = next(stream)
            xs.append(x)
            ys.append(y)
            have += len(y)
        x, y = (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))
        yield x[:size], y[:size]
        xs, ys, have = [x[size:]], [y[size:]], have - size


def pack(params: list[torch.nn.Parameter], flat: torch.Tensor, scale: float) -> None:
    """Copy `scale` * each parameter's gradient into the front of `flat` (zeros where a parameter has none)."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:  # unused in this step's loss: contributes nothing
            flat[offset : offset + n].zero_()
        else:
            flat[offset : offset + n].copy_(p.grad.reshape(-1)).mul_(scale)
        offset += n


def unpack(params: list[torch.nn.Parameter], flat: torch.Tensor, divisor: float) -> None:
    """Set each parameter's gradient to its slice of `flat` / `divisor` (a new tensor where it had none)."""
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset : offset + n].view_as(p) / divisor
        if p.grad is None:
            p.grad = grad.to(p.dtype)
        else:
            p.grad.copy_(grad)
        offset += n


@dataclass
class Rank:
    """One rank's fixed setup: its share of the step, its model and optimizers, and the all-reduce buffer.

    `flat` holds the gradients (diloco: the pseudo-gradients) and, after them, the control
    slots; `anchor` and `outer` exist in mode diloco only.
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
    stream: Iterator[Batch]
    anchor: list[torch.Tensor]
    outer: torch.optim.Optimizer | None

    @property
    def batch(self) -> int:
        return self.batches[self.rank]

    @property
    def diloco(self) -> bool:
        return self.cfg.mode == "diloco"

    @property
    def numel(self) -> int:
        return len(self.flat) - 2

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
    r = _setup(rank, cfg)
    state = Progress(next_eval=cfg.eval_every)
    if rank == 0:
        state.curve.append({"t": 0.0, "samples": 0, **r.task.evaluate(r.model)})
    dist.barrier()  # everyone is ready: start-up ends here
    state.clock_start = time.monotonic()
    while True:
        began = time.monotonic()  # drawing the batch is part of the local compute
        hook = (lambda: _pace(r, began)) if r.diloco else (lambda: _reduce_gradients(r, state, began))
        train_step(r.task, r.model, r.optimizer, next(r.stream), before_update=hook)
        state.steps += 1
        synced = not r.diloco or state.steps % cfg.local_steps == 0
        if r.diloco:
            state.reduce_start = state.reduce_end = time.monotonic()
            if synced:
                _outer_step(r, state)
        r.average.update(r.model)
        eval_due, stop = synced and r.slot(EVAL_SLOT), synced and r.slot(STOP_SLOT)
        ended = time.monotonic()
        state.compute_s += (state.reduce_start - began) + (ended - state.reduce_end)
        state.comm_s += state.reduce_end - state.reduce_start
        if eval_due:
            stop = _evaluate(r, state, ended) or stop
        if stop:
            break
    out = _measurements(r, state)
    dist.destroy_process_group()
    return out


def _join_group(rank: int, cfg: Config) -> None:
    """Join the gloo group through the rendezvous store (hosted by the parent, or by rank 0 with `store_on_rank0`)."""
    n = len(cfg.slowdowns)
    timeout = timedelta(seconds=cfg.pg_timeout_s)
    master = cfg.store_on_rank0 and rank == 0
    store = dist.TCPStore(cfg.store_host, cfg.port, world_size=n, is_master=master, wait_for_workers=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)


def _setup(rank: int, cfg: Config) -> Rank:
    """Build the rank's model (rank 0's, broadcast), optimizers, data stream and buffer."""
    task: Task = load_task(cfg.task)
    batches = batch_sizes(task.batch_size, cfg.slowdowns, cfg.mode)
    # Equal: plain mean over ranks. Proportional: sample-weighted mean over all rows.
    n = len(cfg.slowdowns)
    weight, total_weight = (float(batches[rank]), float(sum(batches))) if cfg.mode == "proportional" else (1.0, float(n))
    model = task.build_model()
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
    flat = torch.zeros(sum(p.numel() for p in params) + 2, dtype=params[0].dtype)
    stream = resized_batches(iter(task.train_batches(shard=slot_of(cfg, rank) + 1000 * cfg.seed)), batches[rank])
    anchor: list[torch.Tensor] = []
    outer = None
    if cfg.mode == "diloco":  # the shared anchor is what the outer optimizer steps
        anchor = [p.detach().clone().requires_grad_(True) for p in params]
        outer = torch.optim.SGD(anchor, lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_momentum > 0)
    return Rank(
        rank, cfg, task, batches, Pacing(cfg.slowdowns[rank], cfg.step_time_ms), weight, total_weight,
        model, optimizer, average, evaluated, params, flat, stream, anchor, outer,
    )  # fmt: skip


def _pace(r: Rank, began: float) -> None:
    """The emulated device's extra time for this step's compute."""
    time.sleep(r.pacing.padding(time.monotonic() - began, r.batch))


def _all_reduce(r: Rank, state: Progress) -> None:
    """All-reduce `flat` with the control slots rank 0 sets: it owns the clock, evaluations and the end."""
    r.flat[r.numel :] = 0.0
    if r.rank == 0:
        now = state.train_time()
        stop = now >= r.cfg.duration
        r.flat[r.numel + EVAL_SLOT] = float(stop or now >= state.next_eval)  # always evaluate at the end
        r.flat[r.numel + STOP_SLOT] = float(stop)
    state.reduce_start = time.monotonic()
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
    """DiLoCo's sync: the mean pseudo-gradient (anchor − parameters) steps the anchor; every rank restarts from it."""
    assert r.outer is not None
    offset = 0
    for a, p in zip(r.anchor, r.params):
        r.flat[offset : offset + p.numel()].copy_(a.reshape(-1)).sub_(p.reshape(-1))
        offset += p.numel()
    _all_reduce(r, state)
    unpack(r.anchor, r.flat, float(len(r.cfg.slowdowns)))  # type: ignore[arg-type]
    r.outer.step()
    for a, p in zip(r.anchor, r.params):
        p.copy_(a)


def _evaluate(r: Rank, state: Progress, stopped: float) -> bool:
    """Every rank pauses its clock (stopped at `stopped`) while rank 0 evaluates; return whether rank 0
    says training is done (the target reached with `min_samples` trained). The broadcast ends the pause."""
    done = torch.zeros(1)
    if r.rank == 0:
        assert r.evaluated is not None
        t_eval = stopped - state.clock_start - state.paused
        r.evaluated.load_state_dict(r.average.averaged(r.model))
        point = {"t": t_eval, "samples": state.steps * sum(r.batches), **r.task.evaluate(r.evaluated)}
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
        "samples": steps * r.batch,
        "compute_s": state.compute_s,
        "comm_s": state.comm_s,
        "wall_s": wall,
        "idle_fraction": 1.0 - state.compute_s / wall if wall > 0 else 0.0,
        # ring all-reduce: each rank sends 2 (n-1)/n of the gradient per step (diloco: per sync)
        "bytes_sent": int((steps // r.cfg.local_steps if r.diloco else steps) * 2 * (n - 1) / n * grad_bytes),
    }
    if r.rank == 0:
        metric = r.task.metric
        out.update(
            curve=state.curve, clock_start=state.clock_start, eval_s=state.paused, task=r.task.name, metric=metric.name,
            higher_is_better=metric.higher_is_better, batch_size=r.task.batch_size, batches=r.batches,
        )  # fmt: skip
    return out


def run_rank(rank: int, cfg: Config, out: str) -> None:
    """Process entry point for a rank in its own network namespace: train, write its result as JSON
    to `out` (or its traceback to `out` + ".error"), then exit 0 (or 1)."""
    try:
        result = train(rank, cfg)
        with open(out + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(out + ".tmp", out)  # whole or absent: the parent never reads half a result
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
