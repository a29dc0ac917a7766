"""Synchronous data-parallel baseline that Murmur is compared against.

N ranks run as separate OS processes (forked from a torch-preloaded server) in one `torch.distributed` gloo group
on 127.0.0.1. Every step each rank computes the gradient of its own batch, then all
ranks all-reduce the gradients (which doubles as the per-step barrier) and take the
same optimizer step, so the model stays identical everywhere. The rank's side is
`lab.sync_rank`; this module starts the ranks, collects their results and
reports them.

Modes (`diloco`, `adaptive`, `diloco-proportional`: see `lab.sync_rank`):
  equal         every rank uses the task's `batch_size`; gradients are averaged.
  proportional  rank r uses round(B * n * speed_r / sum(speeds)) samples (>= 1),
                speed_r = 1 / slowdown_r; gradients are sample-weighted: each rank
                scales its mean-loss gradient by its batch, the sum is all-reduced
                and divided by the total number of samples in the step.
  adaptive      proportional, re-split every `rebalance_every` steps by measured speed.
  diloco-proportional  diloco whose slower ranks take fewer inner steps, re-split every round by
                measured speed, so that the ranks reach the all-reduce together.

Heterogeneity is emulated as on a Murmur node (`murmur.node.learn.step.Pacing`): after the
local compute of a step (drawing the batch, forward, backward) a rank with slowdown S
sleeps so that the step takes S * step_time_ms * batch / 32 ms (minus what the compute
really took), or, without `step_time_ms`, sleeps (S - 1) times the measured compute.
The sleep comes before the all-reduce because it stands in for slower compute. With a
`trace` (`lab.traces`) each rank's slowdown follows its trace peer over training time, and a
rank waits out the trace's sleeps in that padding, holding up the group as a sleeping machine would.

Clock: start-up (process start, group init, model build, the t=0 evaluation) is excluded;
every rank starts its clock when it leaves a barrier that all ranks reach once ready.
Rank 0 evaluates the held-out metric on a grid of `eval_every` seconds of training
time; evaluation pauses every rank's clock. Training ends on every rank after the same
step: once rank 0's training time reaches `duration`, or once the target metric is reached
(and `min_samples` trained).

Over slow links (`run_sync(..., links=...)`, from `murmur bench --link-mbit`) each rank runs in its own
network namespace (`lab.links`): forked from the preloaded server like the peers, it enters the
namespace itself and writes its result to a file; rank 0 hosts the rendezvous store on its namespace's
address and gloo binds to each namespace's capped veth (`GLOO_SOCKET_IFNAME`), so every all-reduce crosses
the capped links. Start-up stays excluded: the clock still starts at the ranks' first barrier.

Library use: `run_sync(...)` returns a JSON-serialisable dict. CLI:
  python -m lab.sync_baseline --task digits --slowdowns 1,1,2,4 --mode equal \
      --step-time-ms 20 --duration 20 --out results/sync.json
  python -m lab.sync_baseline --slowdowns 1,2 --mode diloco-proportional --outer-wire int8 \
      --step-time-ms 20 --trace my-trace.json
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from lab import cpu_quota
from lab.diloco import WIRES
from lab.links import LINK_DEVICE
from lab.netns import Netns
from lab.swarm import ForkedProcess, stop_processes
from lab.sync_config import HOST, MODES, Config
from lab.sync_rank import run_rank, worker
from lab.sync_report import PEER_KEYS, result_of, summary
from lab.traces import Trace, TraceError, load

RANK_MODULE = "lab.sync_rank"  # what the ranks' fork server preloads
STORE_PORT = 29500  # over links: rank 0's namespace is new and empty, so a fixed port is free there


class RankFailed(RuntimeError):
    """A rank raised, crashed or timed out; every rank process has been ended."""


def _free_store(timeout: timedelta) -> dist.TCPStore:
    """Start the rendezvous store on a free port (port 0: the OS picks; no race)."""
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timeout)


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
    lr_scale: float = 1.0,
    local_steps: int = 16,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    min_samples: int = 0,
    ema_decay: float = 0.0,
    links: Sequence[Netns] | None = None,
    work_dir: Path | None = None,
    trace: Trace | None = None,
    slots: Sequence[int] | None = None,
    rebalance_every: int = 10,
    outer_wire: str = "int8",
    broadcast_init: bool = True,
) -> dict[str, Any]:
    """Train `task_name` synchronously on len(slowdowns) ranks; return the results dict.

    Trains for `duration` seconds of training time (start-up and evaluation excluded)
    or until the held-out metric reaches `target` with at least `min_samples` trained.
    `seed` shifts every rank's data shard (its slot + 1000 * seed; without a trace the slot is the rank).
    Collectives time out after `pg_timeout_s`; the whole run is abandoned after `timeout_s` (default
    600 + 2 * duration). Any rank failure ends all ranks and raises `RankFailed` with the rank's traceback. `lr_scale`
    multiplies the task's learning rate; `local_steps`, `outer_lr` and `outer_momentum`
    configure mode `diloco` (see `lab.sync_rank`); `ema_decay` > 0 evaluates a moving average
    of the weights (`murmur.node.learn.weight_average`). With `links` (one namespace per rank, from
    `lab.links.peer_links`) rank r runs in `links[r]`, its log and result files under
    `work_dir` (required then). With `trace` (which needs `step_time_ms`) rank r is paced by trace peer
    `slots[r]` (default: the trace's initial peers in order), which also picks its data shard: `slowdowns` then only
    counts the ranks, each rank's slowdown is its peer's initial one, and collectives wait `pg_timeout_s` beyond the
    longest sleep. A trace with events (leave, crash, join) runs elastically, as torchrun would (`lab.elastic`):
    the ranks are then the trace's initial peers, and the result adds "restarts" and a row in "peers" for every
    peer that trained (`rank` is its peer number); such runs are loopback only (`links` raises
    `NotImplementedError`), their files under `work_dir` if given. `rebalance_every` sets mode `adaptive`'s steps
    between re-splits; `outer_wire` ("int8" or "float32") how the diloco modes send their pseudo-gradients.
    `broadcast_init` False: every rank starts from the task's seeded model instead of rank 0's broadcast one.

    Returns {"method", "task", "mode", "metric", "slowdowns", "step_time_ms", "target",
    "curve": [{"t", "samples", <metrics>...}], "time_to_target", "samples_per_s",
    "peers": [{"rank", "slowdown", "batch", "samples", "local_steps", "compute_s", "comm_s", "wall_s",
    "idle_fraction", "bytes_sent"}], "wall_s", "startup_s", "eval_s", "local_steps", "inner_steps" (each
    rank's last), "outer_lr", "outer_wire", "rebalance_every", "rebalances", "batches" (the last), ...}.
    Raises `ValueError` for a bad argument before starting any rank.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if not slowdowns or any(s <= 0 for s in slowdowns):
        raise ValueError(f"slowdowns must be a non-empty list of positive numbers, not {slowdowns!r}")
    if duration <= 0 or eval_every <= 0:
        raise ValueError("duration and eval_every must be positive")
    n = len(slowdowns)
    if links is not None and (len(links) != n or work_dir is None):
        raise ValueError(f"over links every rank needs a namespace ({len(links)} for {n} ranks) and a work_dir")
    if outer_wire not in WIRES or rebalance_every < 1:
        raise ValueError(f"outer_wire must be one of {WIRES}, rebalance_every >= 1: {outer_wire!r}, {rebalance_every}")
    elastic = trace is not None and bool(trace.events)
    if elastic and links is not None:
        raise NotImplementedError("an elastic run (a trace with events) over links is unsupported: run it on loopback")
    if trace is not None:
        slots = tuple(trace.initial()[:n] if slots is None else slots)
        if step_time_ms is None or len(slots) != n or not all(0 <= s < len(trace.peers) for s in slots):
            raise ValueError(f"a trace needs step_time_ms and a trace peer per rank: {slots}, {len(trace.peers)} peers")
        if elastic and slots != tuple(trace.initial()):
            raise ValueError(f"an elastic run's ranks are the trace's initial peers {trace.initial()}, not {slots}")
        slowdowns = [trace.peers[s].slowdown_at(0.0) or 1.0 for s in slots]
        sleeps = [b - a for p in trace.peers for a, b in p.asleep()]  # the last slowdown is never a sleep
        pg_timeout_s += max(sleeps, default=0.0)
    begin = time.monotonic()
    store = _free_store(timedelta(seconds=pg_timeout_s)) if links is None and not elastic else None
    cfg = Config(
        task_name, tuple(float(s) for s in slowdowns), mode, float(duration), step_time_ms, target,
        float(eval_every), int(seed), store.port if store else STORE_PORT, float(pg_timeout_s), float(lr_scale),
        int(local_steps), float(outer_lr), float(outer_momentum), int(min_samples), float(ema_decay),
        **({"store_host": links[0].address, "store_on_rank0": True} if links is not None else {}),
        trace=trace, slots=tuple(slots) if slots is not None else None, rebalance_every=int(rebalance_every),
        outer_wire=outer_wire, broadcast_init=broadcast_init,
    )  # fmt: skip
    deadline = begin + (timeout_s if timeout_s is not None else 600 + 2 * duration)
    if elastic:
        from lab.elastic import run_elastic  # here: lab.elastic imports this module

        return run_elastic(cfg, trace, begin, deadline, work_dir)
    if links is not None:
        outputs = _run_in_namespaces(cfg, links, work_dir, deadline)
    else:
        outputs = _run_forked(cfg, store, deadline)
    return result_of(cfg, outputs[0], [{k: outputs[r][k] for k in PEER_KEYS} for r in range(len(outputs))], begin)


def _run_forked(cfg: Config, store: dist.TCPStore, deadline: float) -> dict[int, dict[str, Any]]:
    """The ranks on loopback, forked from a preloaded server; their outputs by rank."""
    n = len(cfg.slowdowns)
    # Ranks fork from a server that has imported torch once: a fresh interpreter per rank
    # would spend seconds importing it again on every run (start-up is excluded from the
    # measurements either way, but it dominates a benchmark's wall time).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([RANK_MODULE])
    results = ctx.Queue()
    # daemon: if this process dies, multiprocessing's exit handler still ends the ranks
    procs = [ctx.Process(target=worker, args=(r, cfg, results), name=f"sync-rank{r}", daemon=True) for r in range(n)]
    try:
        for p in procs:
            p.start()
            cpu_quota.adopt(p.pid)  # type: ignore[arg-type]  # set by start()
        outputs = _collect(procs, results, deadline)
        for p in procs:
            p.join(timeout=30)
    finally:
        _end(procs)
        del store
    return outputs


def _run_in_namespaces(cfg: Config, links: Sequence[Netns], work_dir: Path, deadline: float) -> dict[int, dict[str, Any]]:
    """Rank r forked into namespace `links[r]` (`_rank_over_link`); their outputs by rank.

    Raises `RankFailed` (with the rank's traceback, or its log's tail) when a rank fails or at `deadline`;
    every rank is ended by PID either way.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    outs = [work_dir / f"rank{r}.json" for r in range(len(links))]
    procs: list[ForkedProcess] = []
    try:
        for r, ns in enumerate(links):
            for stale in (outs[r], Path(f"{outs[r]}.error")):
                stale.unlink(missing_ok=True)
            procs.append(ns.adopt(ForkedProcess(_rank_over_link, (r, cfg, str(outs[r])), work_dir / f"rank{r}.log",
                                                netns=ns.name, name=f"sync-rank{r}")))
        while any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
            if failed is not None:
                raise RankFailed(f"rank {failed} failed:\n{_failure(work_dir, outs[failed], failed)}")
            if time.monotonic() > deadline:
                raise RankFailed(f"timed out waiting for ranks {[r for r, p in enumerate(procs) if p.poll() is None]}")
            time.sleep(0.2)
        failed = next((r for r, p in enumerate(procs) if p.returncode != 0 or not outs[r].exists()), None)
        if failed is not None:
            raise RankFailed(f"rank {failed} failed:\n{_failure(work_dir, outs[failed], failed)}")
        return {r: json.loads(outs[r].read_text()) for r in range(len(procs))}
    finally:
        stop_processes(procs, timeout=5)


def _rank_over_link(rank: int, cfg: Config, out: str) -> None:
    """A rank inside its namespace: gloo binds to the capped veth, not to loopback."""
    os.environ["GLOO_SOCKET_IFNAME"] = LINK_DEVICE
    run_rank(rank, cfg, out)


def _failure(work_dir: Path, out: Path, rank: int) -> str:
    """A failed rank's traceback, or else the tail of its log."""
    error = Path(f"{out}.error")
    if error.exists():
        return error.read_text()
    log = work_dir / f"rank{rank}.log"
    return log.read_text()[-2000:] if log.exists() else "(no log)"


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
    parser.add_argument("--lr-scale", type=float, default=1.0, help="multiply the task's learning rate")
    parser.add_argument("--local-steps", type=int, default=16, help="diloco: inner steps between syncs")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="diloco: the outer Nesterov step's learning rate")
    parser.add_argument("--outer-wire", choices=WIRES, default="int8", help="diloco: how pseudo-gradients travel")
    parser.add_argument("--rebalance-every", type=int, default=10, help="adaptive: steps between re-splits")
    parser.add_argument("--trace", type=Path, default=None, help="speed trace JSON (lab.traces) pacing the ranks")
    parser.add_argument("--ema-decay", type=float, default=0.0, help="evaluate a moving average of the weights")
    parser.add_argument("--pg-timeout", type=float, default=60.0, help="collective timeout, seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = parser.parse_args(argv)
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s.strip()]
    try:
        trace = load(args.trace) if args.trace is not None else None
    except TraceError as e:
        parser.error(str(e))
    result = run_sync(
        args.task, slowdowns, args.mode, args.duration, args.step_time_ms, args.target, args.eval_every, args.seed,
        pg_timeout_s=args.pg_timeout, lr_scale=args.lr_scale, local_steps=args.local_steps, ema_decay=args.ema_decay,
        outer_lr=args.outer_lr, outer_wire=args.outer_wire, rebalance_every=args.rebalance_every,
        trace=trace,
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
