"""Heterogeneous-swarm benchmark: Murmur gossip vs synchronous all-reduce, in one run.

For each task, seed and speed mix the methods run back to back (interleaved, so
machine drift hits all alike) on the same emulated hardware (sleep-based slowdowns,
one torch thread per peer):

  sync-equal         real torch.distributed (gloo) all-reduce, equal batches
  sync-proportional  the same, batches proportional to speed, sample-weighted
  diloco             synchronous DiLoCo: H local steps per rank, then a gloo all-reduce of the
                     pseudo-gradients and an outer Nesterov step (equal H everywhere)
  murmur-uniform     `murmur run` processes over libp2p (forked from a preloaded server), plain
                     pairwise averaging (`--merge average`), uniform merge weights
  murmur-work        the same with work weighting
  murmur             `murmur run` as it comes: its default configuration
  ideal              every peer alone at once (no exchanges): Σ standalone speeds

Every method trains with its task's learning rate times its scale in `TASKS[task]["lr_scale"]`,
chosen by `murmur bench --sweep-lr` (best time to target over a ×2 grid; see docs/bench.md).

Metrics: wall time until the median peer's held-out metric reaches the target (1 s
evaluation grid, start-up excluded: Murmur peers join first and start together once all
are ready, through `--start-file`), samples/s and % of ideal, per-peer idle fraction and
bytes sent, metric at equal total samples, consensus distance over time. Writes JSON, PNG plots and a
markdown table to `--out`.

    murmur bench --quick            # digits, headline mix, 1 seed
    murmur bench                    # default (see DEFAULT below; run times in docs/bench.md)
    murmur bench --sweep-lr         # learning-rate sweep of the sync baselines and murmur (separate run)
    murmur bench --link-mbit 20     # slow links (SLOW_LINK): charlm-large, every peer capped at 20 Mbit/s (root)
    murmur bench --link-mbit 100,50,20,10   # the same with one cap per peer, in peer order (SLOW_LINK_UNEVEN)

Slow links (`--link-mbit`, `lab.links`): every Murmur peer and every sync or diloco rank runs in its
own network namespace on a veth pair capped with `tc tbf`; the peers listen on their namespace's address and
bootstrap to peer 0's, the ranks' gloo binds to the capped veth. Each run builds its namespaces and removes
them (with every process in them) when it ends, fails or is interrupted. Peers and ranks fork from the
preloaded server, as on loopback, and enter their namespace themselves; start-up stays excluded.

The command line is `bench_cli`.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import shutil
import socket
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from lab.bench_config import MIXES, MURMUR_ARGS, TASKS
from lab.bench_report import base_lr, equal_samples, report, score
from lab.links import (
    LinkSpecError,
    LinksUnavailable,
    caps_for,
    links_unavailable_reason,
    peer_links,
)
from lab.netns import Netns
from lab.peer import PARAMS_FILE
from lab.progress import Progress
from lab.swarm import FORK_PRELOAD, LOG_FILE, Peer, peer_id, start_peer, stop_swarm
from lab.sync_baseline import RANK_MODULE, run_sync
from murmur.node.learn.tasks.task import Metric
from murmur.node.learn.weight_average import DEFAULT_DECAY
from murmur.node.ops.node_status import NodeStatus

START_MARGIN_S = 0.3  # from the start file's writing to the start time it holds: every peer reads it in time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(spec: dict) -> Metric:
    """The metric a bench task is judged by, from its `TASKS` entry."""
    return Metric(spec["metric"], spec["higher"])


def run_murmur(
    task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float = 1.0,
    links: list[Netns] | None = None, ema_decay: float = 0.0, min_samples: int = 0,
) -> dict[str, Any]:
    """Run one swarm of Murmur `method` (or, with `method="ideal"`, lone peers); return its results.

    The run ends at `max_s`, or once the median peer reached the target with `min_samples` trained.

    Peers join first; once every peer is ready (status phase "waiting", knowing all the
    others) the start file tells them all one start time, t=0 of the run. With `links`
    (one namespace per peer) peer i runs in `links[i]`, listening on its address.
    """
    spec = TASKS[task]
    shutil.rmtree(root, ignore_errors=True)  # a peer would resume from an earlier run's checkpoint
    root.mkdir(parents=True)
    ports = [_free_port() for _ in slowdowns]
    dirs = [root / f"peer-{i}" for i in range(len(slowdowns))]
    start_file = root / "start-at"
    hosts = [ns.address for ns in links] if links else ["127.0.0.1"] * len(slowdowns)
    first = f"/ip4/{hosts[0]}/tcp/{ports[0]}/p2p/{peer_id(dirs[0])}"
    peers: list[Peer] = []
    for i, (slowdown, data_dir) in enumerate(zip(slowdowns, dirs)):
        extra = [
            "--task", task, "--step-time", str(spec["step_time"]), "--duration", str(max_s),
            "--start-file", str(start_file), "--shard", str(1000 * seed + i), "--record-params", "--log-level", "INFO",
            "--lr-scale", str(lr_scale), "--eval-every", str(spec.get("eval_every", 1.0)), "--ema-decay", str(ema_decay),
        ]
        if method == "ideal":
            extra += ["--average-every", "1e9"]  # alone: no bootstrap, no exchanges
        else:
            extra += MURMUR_ARGS[method]
        peer = start_peer(
            i, root, slowdown, extra, first if i and method != "ideal" else None, fork=True, data_dir=data_dir,
            listen=f"/ip4/{hosts[i]}/tcp/{ports[i]}", netns=links[i] if links else None,
        )  # fmt: skip
        peers.append(peer)
    try:
        joined = time.monotonic()
        # Peers in namespaces pull the model over their capped links.
        _wait_until_ready(peers, others=0 if method == "ideal" else len(slowdowns) - 1, timeout=180.0 if links else 60.0)
        start_at = time.time() + START_MARGIN_S
        (root / "start-at.tmp").write_text(repr(start_at))
        (root / "start-at.tmp").replace(start_file)
        startup_s = time.monotonic() - joined + START_MARGIN_S
        deadline = start_at + max_s + 30
        while time.time() < deadline and any(p.alive() for p in peers):
            time.sleep(0.5)
            grid = _median_curve(peers, spec["metric"], start_at, _grid_s(spec))
            if method != "ideal" and grid and _metric(spec).reached(grid[-1]["value"], spec["target"]) \
                    and grid[-1]["samples"] >= min_samples:
                time.sleep(1.0)  # one more grid point, then stop everyone
                break
    finally:
        codes = stop_swarm(peers, timeout=20)
    result = _murmur_result(task, slowdowns, method, peers, start_at, codes)
    result["startup_s"] = startup_s
    return result


def _wait_until_ready(peers: list[Peer], others: int, timeout: float = 60.0) -> None:
    """Wait until every peer waits for its start time, knowing `others` peers; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, p in enumerate(peers):
            if not p.alive():
                raise RuntimeError(f"peer {i} exited with {p.process.returncode} before the start; see {p.data_dir / LOG_FILE}")
        statuses = [p.status() for p in peers]
        if all(s is not None and s.phase == "waiting" and s.known_peers >= others for s in statuses):
            return
        time.sleep(0.05)
    raise RuntimeError(f"peers not ready within {timeout:g}s: {[s.phase if (s := p.status()) else None for p in peers]}")


def _grid_s(spec: dict) -> float:
    """The curve's time step: the task's evaluation interval, at most 1 s (a slow evaluation still gets a 1 s grid)."""
    return min(1.0, spec.get("eval_every", 1.0))


def _median_curve(peers: list[Peer], metric: str, t0: float, grid_s: float = 1.0) -> list[dict]:
    """The median peer's metric and the swarm's total samples every `grid_s` seconds after `t0`."""
    records = [p.metrics() for p in peers]
    if not all(records):
        return []
    end = min(r[-1]["t"] for r in records) - t0
    out = []
    for k in range(0, int(end / grid_s + 1e-9) + 1):
        t = round(k * grid_s, 6)
        latest = [next((x for x in reversed(r) if x["t"] - t0 <= t + grid_s / 2), r[0]) for r in records]
        out.append({"t": t, "value": statistics.median(x[metric] for x in latest), "samples": sum(x["samples"] for x in latest)})
    return out


def _consensus(dirs: list[Path]) -> list[dict]:
    """Mean squared distance of the peers' parameters from their average, per evaluation."""
    import torch

    histories = []
    for d in dirs:
        if not (d / PARAMS_FILE).exists():
            return []
        histories.append(torch.load(d / PARAMS_FILE))
    t0 = min(h[0][0] for h in histories if h)
    out = []
    for k in range(min(len(h) for h in histories)):
        stack = torch.stack([h[k][1] for h in histories])
        distance = ((stack - stack.mean(0)) ** 2).sum(1).mean().item()
        out.append({"t": round(histories[0][k][0] - t0, 2), "distance": distance})
    return out


def _peer_result(rank: int, slowdown: float, status: NodeStatus | None) -> dict:
    """One peer's row of a result, from its last status (empty values if it wrote none)."""
    if status is None:
        return {"rank": rank, "slowdown": slowdown, "samples_per_s": None, "idle_fraction": 1.0, "bytes_sent": 0, "exchanges": {},
                "mean_exchange_s": None}  # fmt: skip
    return {"rank": rank, "slowdown": slowdown, "samples_per_s": status.samples_per_s, "idle_fraction": 1 - status.compute_fraction,
            "bytes_sent": status.bytes_sent, "exchanges": dict(status.exchanges), "mean_exchange_s": status.mean_exchange_s}  # fmt: skip


def _murmur_result(task: str, slowdowns: list[float], method: str, peers: list[Peer], start_at: float, codes: list) -> dict:
    spec = TASKS[task]
    curve = _median_curve(peers, spec["metric"], start_at, _grid_s(spec))
    statuses = [p.status() for p in peers]
    ttt = next((c["t"] for c in curve if _metric(spec).reached(c["value"], spec["target"])), None)
    return {
        "method": method,
        "task": task, "slowdowns": slowdowns, "exit_codes": codes,
        "curve": [{"t": c["t"], "samples": c["samples"], spec["metric"]: c["value"]} for c in curve],
        "time_to_target": ttt,
        "samples_per_s": sum(s.samples_per_s for s in statuses if s),
        "peers": [_peer_result(i, slowdowns[i], s) for i, s in enumerate(statuses)],
        "consensus": _consensus([p.data_dir for p in peers]),
    }


def run_method(
    task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float | None = None,
    link_mbit: list[float] | None = None, ema_decay: float = 0.0, min_samples: int = 0,
) -> dict:
    """Run one method (or the ideal) on the task's workload at `lr_scale` (default: the task's chosen scale).

    A run that reaches its target trains on until `min_samples` (where methods are compared), within `max_s`.

    Every method evaluates a moving average of its weights with `ema_decay` (0: the live model).

    With `link_mbit` (one cap per peer) the run gets its own capped namespaces (`lab.links.peer_links`),
    removed when it ends; the result records the caps under "link_mbit" (None on loopback).
    """
    spec = TASKS[task]
    scale = spec["lr_scale"].get(method, 1.0) if lr_scale is None else lr_scale
    with peer_links(link_mbit) if link_mbit else nullcontext() as links:
        if method == "ideal":
            result = run_murmur(task, slowdowns, method, seed, max(6.0, 2 * spec.get("eval_every", 1.0)), root, links=links,
                                ema_decay=ema_decay)
        elif method in MURMUR_ARGS:
            result = run_murmur(task, slowdowns, method, seed, max_s, root, scale, links=links, ema_decay=ema_decay,
                                min_samples=min_samples)
        else:  # the synchronous baselines: their ranks run one thread each, like the peers
            mode = "diloco" if method == "diloco" else method.removeprefix("sync-")
            result = run_sync(task, slowdowns, mode, max_s, spec["step_time"], spec["target"], spec.get("eval_every", 1.0),
                              seed=seed, lr_scale=scale, local_steps=spec["local_steps"], min_samples=min_samples,
                              ema_decay=ema_decay, links=links, work_dir=root)
    result["lr_scale"] = scale
    result["ema_decay"] = ema_decay
    result["lr"] = base_lr(task) * scale  # as trained: a later change to the task's rate leaves the record right
    result["link_mbit"] = link_mbit
    return result


def run_bench(config: dict, out: Path) -> dict:
    """Run `config` (DEFAULT, QUICK, SWEEP, SLOW_LINK or alike) and report it under `out`; return the report.

    A config with "link_mbit" runs over capped links; raises `LinksUnavailable` (before running anything)
    when this machine cannot build them, `LinkSpecError` when the caps do not fit a mix.
    """
    if config.get("link_mbit"):
        for task in config["tasks"]:  # a wrong spec is an error with or without namespaces
            for mix in config["mixes"][task]:
                try:
                    caps_for(config["link_mbit"], len(MIXES[mix]))
                except LinkSpecError as e:
                    raise LinkSpecError(f"{e} (mix {mix!r})") from None
        reason = links_unavailable_reason()
        if reason is not None:
            raise LinksUnavailable(reason)
    out.mkdir(parents=True, exist_ok=True)
    # One fork server, started now with everything both kinds of run import: Murmur peers and sync
    # ranks (over links too, entering their namespaces) then start in about a second (start-up is
    # excluded from the measurements).
    multiprocessing.get_context("forkserver").set_forkserver_preload([RANK_MODULE, *FORK_PRELOAD])
    multiprocessing.forkserver.ensure_running()
    bench_began = time.monotonic()
    results: list[dict] = []
    total = sum(len(config["seeds"]) * len(config["mixes"][t]) * len(task_runs(t, config)) for t in config["tasks"])
    with Progress(total=total, label="murmur bench") as progress:
        for task in config["tasks"]:
            _bench_task(task, config, task_runs(task, config), out, progress, results)
    return report({"config": config, "results": results, "wall_s": time.monotonic() - bench_began}, out)


def task_runs(task: str, config: dict) -> list[tuple[str, float | None]]:
    """The (method, learning-rate scale) pairs `config` runs on `task`, the ideal first (None: the task's chosen scale).

    A config with "lr_factors" (the sweep) runs each of its runs at each factor times its scale.
    """
    runs = [(m, s) for m, s in config["runs"]]
    if factors := config.get("lr_factors"):
        chosen = TASKS[task]["lr_scale"]
        runs = [(m, (chosen.get(m, 1.0) if s is None else s) * f) for f in factors for m, s in runs]
    return [("ideal", None), *runs]


def _bench_task(task: str, config: dict, runs: list, out: Path, progress: Progress, results: list[dict]) -> None:
    """Run every seed and mix of `task`, method by method (interleaved), appending to `results` and saving them."""
    for seed in config["seeds"]:
        for mix in config["mixes"][task]:
            slowdowns = MIXES[mix]
            max_s = config["max_s"][task]
            caps = caps_for(config["link_mbit"], len(slowdowns)) if config.get("link_mbit") else None
            group = []
            # The ideal is calibrated for every seed, next to the runs it is compared with.
            for method, scale in runs:
                label = method if scale is None else f"{method}@lr×{scale:g}"
                print(f"[bench] {task} seed {seed} {mix} {slowdowns}{f' links {caps} Mbit/s' if caps else ''}: {label}", flush=True)
                progress.start(f"{task} {mix} seed {seed}: {label}")
                began = time.monotonic()
                r = run_method(task, slowdowns, method, seed, max_s, out / "runs" / f"{task}-{mix}-s{seed}-{label}", scale, caps,
                               config.get("ema_decay", DEFAULT_DECAY), min_samples=equal_samples(task, group) or 0)
                r.update(mix=mix, seed=seed, label=label, run_wall_s=time.monotonic() - began)  # start-up and teardown included
                group.append(r)
                progress.advance()
            for g in score(group):
                print(f"  {g['label']:18s} ttt={g.get('time_to_target') if g['method'] != 'ideal' else '-'} samples/s={g['samples_per_s']:.0f} ({(g['pct_of_ideal'] or 0):.0%} of ideal) "
                      f"max idle={max(p['idle_fraction'] for p in g['peers']):.1%} {TASKS[task]['metric']} at equal samples={g['metric_at_equal_samples']}", flush=True)
            results += group
            (out / "results.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
