"""Synchronous data-parallel baseline that Murmur is compared against.

N ranks run as separate OS processes (forked from a torch-preloaded server) in one `torch.distributed` gloo group
on 127.0.0.1. Every step each rank computes the gradient of its own batch, then all
ranks all-reduce the gradients (which doubles as the per-step barrier) and take the
same optimizer step, so the model stays identical everywhere.

Modes:
  equal         every rank uses the task's `batch_size`; gradients are averaged.
  proportional  rank r uses round(B * n * speed_r / sum(speeds)) samples (>= 1),
                speed_r = 1 / slowdown_r; gradients are sample-weighted: each rank
                scales its mean-loss gradient by its batch, the sum is all-reduced
                and divided by the total number of samples in the step.

Heterogeneity is emulated as on a Murmur node: after the local compute of a step
(drawing the batch, forward, backward) a rank with slowdown S sleeps so that the
step takes S * step_time_ms * batch / 32 ms (minus what the compute really took),
or, without `step_time_ms`, sleeps (S - 1) times the measured compute. The sleep
comes before the all-reduce because it stands in for slower compute.

Clock: start-up (process start, group init, model build, the t=0 evaluation) is excluded;
every rank starts its clock when it leaves a barrier that all ranks reach once ready.
Rank 0 evaluates the held-out metric on a grid of `eval_every` seconds of training
time. Evaluation is not training, so it is taken out of the clock on every rank: rank
0 decides before a step's all-reduce that an evaluation is due and says so in two
control slots appended to the gradient buffer ([eval_due, stop]). After that step
every rank stops its clock, rank 0 evaluates, and a one-element broadcast from rank 0
(carrying "target reached") ends the pause for everyone; the paused interval is
subtracted from each rank's wall time. Rank 0 also sets `stop` once its training time
reaches `duration`, and the broadcast carries a stop when the target metric is
reached, so all ranks leave the loop after the same step.

Library use: `run_sync(...)` returns a JSON-serialisable dict. CLI:
  python scripts/sync_baseline.py --task digits --slowdowns 1,1,2,4 --mode equal \
      --step-time-ms 20 --duration 20 --out results/sync.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from node.learn.tasks import Task, load_task

MODES = ("equal", "proportional")
REFERENCE_BATCH = 32  # `step_time_ms` is quoted per 32 samples, as on the Murmur node
HOST = "127.0.0.1"
EVAL_SLOT, STOP_SLOT = 0, 1  # control slots after the gradients in the all-reduce buffer

Batch = tuple[torch.Tensor, torch.Tensor]


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; every rank process has been ended."""


# --------------------------------------------------------------------------- helpers


def batch_sizes(base: int, slowdowns: Sequence[float], mode: str) -> list[int]:
    """Return each rank's per-step batch for `mode`.

    equal: `base` everywhere. proportional: round-half-up of
    base * n * speed_r / sum(speeds), at least 1, with speed_r = 1 / slowdown_r,
    so the whole step holds about n * base samples split by speed.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    n = len(slowdowns)
    if mode == "equal":
        return [base] * n
    speeds = [1.0 / s for s in slowdowns]
    total = sum(speeds)
    return [max(1, math.floor(base * n * v / total + 0.5)) for v in speeds]


def emulated_sleep(slowdown: float, step_time_ms: float | None, batch: int, compute_s: float) -> float:
    """Return the seconds to sleep after a local compute of `compute_s` seconds.

    With `step_time_ms` M the step should take slowdown * M * batch / 32 ms in all;
    without it the rank should look `slowdown` times slower than it really is.
    Never negative: a rank cannot be made faster than the hardware.
    """
    if step_time_ms is None:
        return max(0.0, (slowdown - 1.0) * compute_s)
    return max(0.0, slowdown * step_time_ms / 1000.0 * batch / REFERENCE_BATCH - compute_s)


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


def _meets(value: float, target: float, higher_is_better: bool) -> bool:
    return value >= target if higher_is_better else value <= target


def _free_store(timeout: timedelta) -> dist.TCPStore:
    """Start the rendezvous store on a free port (port 0: the OS picks; no race)."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)


# ---------------------------------------------------------------------------- ranks


@dataclass(frozen=True)
class _Config:
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


def _pack(params: list[torch.nn.Parameter], flat: torch.Tensor, scale: float) -> None:
    """Copy `scale` * each parameter's gradient into the front of `flat`."""
    offset = 0
    for p in params:
        n = p.numel()
        if p.grad is None:  # unused in this step's loss: contributes nothing
            flat[offset : offset + n].zero_()
        else:
            flat[offset : offset + n].copy_(p.grad.reshape(-1)).mul_(scale)
        offset += n


def _unpack(params: list[torch.nn.Parameter], flat: torch.Tensor, divisor: float) -> None:
    """Set each parameter's gradient to its slice of `flat` / `divisor`."""
    offset = 0
    for p in params:
        n = p.numel()
        grad = flat[offset : offset + n].view_as(p) / divisor
        if p.grad is None:
            p.grad = grad.to(p.dtype)
        else:
            p.grad.copy_(grad)
        offset += n


def _train(rank: int, cfg: _Config) -> dict[str, Any]:
    """Run one rank's training loop and return its measurements (rank 0: also the curve)."""
    torch.set_num_threads(1)  # N ranks share the CPU; one thread each keeps them honest
    n = len(cfg.slowdowns)
    timeout = timedelta(seconds=cfg.pg_timeout_s)
    store = dist.TCPStore(HOST, cfg.port, world_size=n, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n, timeout=timeout)

    task: Task = load_task(cfg.task)
    batches = batch_sizes(task.batch_size, cfg.slowdowns, cfg.mode)
    batch, slowdown = batches[rank], cfg.slowdowns[rank]
    # Equal: plain mean over ranks. Proportional: sample-weighted mean over all rows.
    weight, total_weight = (float(batch), float(sum(batches))) if cfg.mode == "proportional" else (1.0, float(n))
    step_samples = sum(batches)

    model = task.build_model()
    model.train()
    with torch.no_grad():  # start identical even if a task's init were not seeded (as DDP does)
        for t in itertools.chain(model.parameters(), model.buffers()):
            dist.broadcast(t, src=0)
    optimizer = task.make_optimizer(model)
    torch.manual_seed(1000 * cfg.seed + rank)  # per-rank randomness (dropout etc.)
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    flat = torch.zeros(numel + 2, dtype=params[0].dtype)
    stream = resized_batches(iter(task.train_batches(shard=rank + 1000 * cfg.seed)), batch)
    metric = task.metric

    curve: list[dict[str, float]] = []
    if rank == 0:
        curve.append({"t": 0.0, "samples": 0, **task.evaluate(model)})
        model.train()

    dist.barrier()  # everyone is ready: start-up ends here
    clock_start = time.monotonic()
    paused = 0.0  # evaluation pauses, excluded from training time

    def train_time() -> float:
        return time.monotonic() - clock_start - paused

    next_eval = cfg.eval_every
    steps, compute_s, comm_s = 0, 0.0, 0.0
    while True:
        # local compute, then the emulated extra time of a slower device
        t0 = time.monotonic()
        loss = task.loss(model, next(stream))
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        time.sleep(emulated_sleep(slowdown, cfg.step_time_ms, batch, time.monotonic() - t0))
        _pack(params, flat, weight)
        flat[numel:] = 0.0
        if rank == 0:  # rank 0 owns the clock: it decides evaluations and the end
            now = train_time()
            stop = now >= cfg.duration
            flat[numel + EVAL_SLOT] = float(stop or now >= next_eval)  # always evaluate at the end
            flat[numel + STOP_SLOT] = float(stop)

        # the synchronous step: all-reduce (and wait for the slowest rank)
        t1 = time.monotonic()
        dist.all_reduce(flat)
        t2 = time.monotonic()
        _unpack(params, flat, total_weight)
        optimizer.step()
        steps += 1
        eval_due, stop = flat[numel + EVAL_SLOT].item() > 0, flat[numel + STOP_SLOT].item() > 0
        t3 = time.monotonic()
        compute_s += (t1 - t0) + (t3 - t2)
        comm_s += t2 - t1

        if eval_due:  # every rank pauses its clock; rank 0 evaluates
            reached = torch.zeros(1)
            if rank == 0:
                t_eval = t3 - clock_start - paused  # the clock stopped at t3
                point = {"t": t_eval, "samples": steps * step_samples, **task.evaluate(model)}
                curve.append(point)
                model.train()
                if cfg.target is not None and _meets(point[metric.name], cfg.target, metric.higher_is_better):
                    reached[0] = 1.0
                while next_eval <= t_eval:  # next point of the grid
                    next_eval += cfg.eval_every
            dist.broadcast(reached, src=0)  # also the end of the pause for the other ranks
            paused += time.monotonic() - t3
            stop = stop or reached.item() > 0
        if stop:
            break

    wall = train_time()
    out: dict[str, Any] = {
        "rank": rank,
        "slowdown": slowdown,
        "batch": batch,
        "steps": steps,
        "samples": steps * batch,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "wall_s": wall,
        "idle_fraction": 1.0 - compute_s / wall if wall > 0 else 0.0,
        # ring all-reduce: each rank sends 2 (n-1)/n of the gradient per step
        "bytes_sent": int(steps * 2 * (n - 1) / n * grad_bytes),
    }
    if rank == 0:
        out.update(
            curve=curve,
            clock_start=clock_start,
            eval_s=paused,
            task=task.name,
            metric=metric.name,
            higher_is_better=metric.higher_is_better,
            batch_size=task.batch_size,
            batches=batches,
        )
    dist.destroy_process_group()
    return out


def _worker(rank: int, cfg: _Config, results: Any) -> None:
    """Process entry point: report ("result", rank, dict) or ("error", rank, traceback)."""
    try:
        results.put(("result", rank, _train(rank, cfg)))
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


# --------------------------------------------------------------------------- parent


def _end(procs: list[Any]) -> None:
    """Join every child; terminate, then kill, any that is still running (by PID)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.terminate()
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _collect(procs: list[Any], results: Any, deadline: float) -> dict[int, dict[str, Any]]:
    """Wait for every rank's result; raise `RankFailed` on the first failure or at `deadline`."""
    outputs: dict[int, dict[str, Any]] = {}
    while len(outputs) < len(procs):
        try:
            kind, rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                try:  # its error report may still be in the pipe
                    kind, rank, payload = results.get(timeout=1.0)
                except queue.Empty:
                    p = dead[0]
                    raise RankFailed(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}") from None
            elif time.monotonic() > deadline:
                raise RankFailed(f"timed out waiting for ranks {sorted(set(range(len(procs))) - set(outputs))}") from None
            else:
                continue
        if kind == "error":
            raise RankFailed(f"rank {rank} failed:\n{payload}")
        outputs[rank] = payload
    return outputs


def run_sync(
    task_name: str,
    slowdowns: list[float],
    mode: str,
    duration: float,
    step_time_ms: float | None,
    target: float | None,
    eval_every: float = 1.0,
    seed: int = 0,
    *,
    pg_timeout_s: float = 60.0,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Train `task_name` synchronously on len(slowdowns) ranks; return the results dict.

    Trains for `duration` seconds of training time (start-up and evaluation excluded)
    or until the held-out metric reaches `target`. `seed` shifts every rank's data
    shard (rank + 1000 * seed). Collectives time out after `pg_timeout_s`; the whole
    run is abandoned after `timeout_s` (default 600 + 2 * duration). Any rank failure
    ends all ranks and raises `RankFailed` with the rank's traceback.

    Returns {"method", "task", "mode", "metric", "slowdowns", "step_time_ms", "target",
    "curve": [{"t", "samples", <metrics>...}], "time_to_target", "samples_per_s",
    "peers": [{"rank", "slowdown", "batch", "samples", "compute_s", "comm_s", "wall_s",
    "idle_fraction", "bytes_sent"}], "wall_s", "startup_s", "eval_s", ...}.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not slowdowns or any(s <= 0 for s in slowdowns):
        raise ValueError(f"slowdowns must be a non-empty list of positive numbers, not {slowdowns!r}")
    if duration <= 0 or eval_every <= 0:
        raise ValueError("duration and eval_every must be positive")
    n = len(slowdowns)
    begin = time.monotonic()
    store = _free_store(timedelta(seconds=pg_timeout_s))
    cfg = _Config(
        task_name, tuple(float(s) for s in slowdowns), mode, float(duration), step_time_ms, target,
        float(eval_every), int(seed), store.port, float(pg_timeout_s),
    )  # fmt: skip
    # Ranks fork from a server that has imported torch once: a fresh interpreter per rank
    # would spend seconds importing it again on every run (start-up is excluded from the
    # measurements either way, but it dominates a benchmark's wall time).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__ if __name__ != "__main__" else "node.lab.sync_baseline"])
    results = ctx.Queue()
    # daemon: if this process dies, multiprocessing's exit handler still ends the ranks
    procs = [ctx.Process(target=_worker, args=(r, cfg, results), name=f"sync-rank{r}", daemon=True) for r in range(n)]
    try:
        for p in procs:
            p.start()
        outputs = _collect(procs, results, begin + (timeout_s if timeout_s is not None else 600 + 2 * duration))
        for p in procs:
            p.join(timeout=30)
    finally:
        _end(procs)
        del store

    head = outputs[0]
    curve = head["curve"]
    time_to_target = None
    if target is not None:
        time_to_target = next(
            (pt["t"] for pt in curve if _meets(pt[head["metric"]], target, head["higher_is_better"])), None
        )
    peer_keys = (
        "rank", "slowdown", "batch", "steps", "samples", "compute_s", "comm_s", "wall_s", "idle_fraction", "bytes_sent",
    )  # fmt: skip
    peers = [{k: outputs[r][k] for k in peer_keys} for r in range(n)]
    total = sum(p["samples"] for p in peers)
    return {
        "method": f"sync-{mode}",
        "task": head["task"],
        "mode": mode,
        "metric": head["metric"],
        "higher_is_better": head["higher_is_better"],
        "slowdowns": list(cfg.slowdowns),
        "step_time_ms": step_time_ms,
        "target": target,
        "eval_every": eval_every,
        "seed": seed,
        "batch_size": head["batch_size"],
        "steps": head["steps"],
        "curve": curve,
        "time_to_target": time_to_target,
        "samples": total,
        "samples_per_s": total / head["wall_s"] if head["wall_s"] > 0 else 0.0,
        "peers": peers,
        "wall_s": head["wall_s"],
        # time.monotonic is one system-wide clock on Linux, so parent and rank readings compare
        "startup_s": head["clock_start"] - begin,
        "eval_s": head["eval_s"],
        "config": {k: v for k, v in asdict(cfg).items() if k != "port"},
    }


# ------------------------------------------------------------------------------ CLI


def summary(result: dict[str, Any]) -> str:
    """Return a short human-readable summary of a `run_sync` result."""
    metric = result["metric"]
    final = f"  final {metric} {result['curve'][-1][metric]:.4f}"
    if result["target"] is not None:
        ttt = result["time_to_target"]
        final += f"; time to {metric} {result['target']}: " + ("not reached" if ttt is None else f"{ttt:.2f} s")
    lines = [
        f"{result['method']} on {result['task']}: {len(result['peers'])} ranks, slowdowns {result['slowdowns']}, "
        f"step_time_ms {result['step_time_ms']}",
        f"  train {result['wall_s']:.1f} s (excluded: startup {result['startup_s']:.1f} s, "
        f"eval {result['eval_s']:.2f} s), "
        f"{result['steps']} steps, {result['samples']} samples, {result['samples_per_s']:.0f} samples/s",
        final,
        "  rank slowdown batch  samples compute_s  comm_s  idle  MB_sent",
    ]
    for p in result["peers"]:
        lines.append(
            f"  {p['rank']:>4} {p['slowdown']:>8g} {p['batch']:>5} {p['samples']:>8} {p['compute_s']:>9.2f} "
            f"{p['comm_s']:>7.2f} {p['idle_fraction']:>5.2f} {p['bytes_sent'] / 1e6:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Synchronous data-parallel (gloo all-reduce) baseline for Murmur.")
    parser.add_argument("--task", default="digits", help="built-in task name or package.module:factory")
    parser.add_argument("--slowdowns", required=True, help="comma-separated per-rank slowdowns, e.g. 1,1,2,4")
    parser.add_argument("--mode", choices=MODES, default="equal")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of training time")
    parser.add_argument("--step-time-ms", type=float, default=None, help="ms per 32 samples at slowdown 1")
    parser.add_argument("--target", type=float, default=None, help="stop when the task metric reaches this")
    parser.add_argument("--eval-every", type=float, default=1.0, help="seconds of training time between evaluations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout, seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s.strip()]
    result = run_sync(
        args.task, slowdowns, args.mode, args.duration, args.step_time_ms, args.target, args.eval_every, args.seed,
        pg_timeout_s=args.pg_timeout,
    )  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    if args.out is not None:
        print(f"  wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
