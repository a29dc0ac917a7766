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

    murmur bench --quick            # ~50 s: digits, headline mix, 1 seed
    murmur bench                    # default (see DEFAULT below), measured 14.4 min on 2 cores
    murmur bench --sweep-lr         # learning-rate sweep of sync-equal and murmur (separate run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import multiprocessing.forkserver
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from murmur.node.lab.progress import Progress
from murmur.node.lab.swarm import FORK_PRELOAD, ONE_THREAD, ForkedPeer, stop_processes
from murmur.node.lab.sync_baseline import RANK_MODULE, run_sync
from murmur.node.ops.node import METRICS_FILE
from murmur.node.ops.status import StatusUnavailable, load_status

MIXES = {
    "homogeneous": [1.0, 1.0, 1.0, 1.0],
    "mild": [1.0, 1.0, 1.0, 2.0],
    "headline": [1.0, 1.0, 2.0, 4.0],
    "extreme": [1.0, 1.0, 1.0, 10.0],
    "pair": [1.0, 2.0],  # the smallest swarm, for the harness test
}
# Fixed workloads; step_time pads every step to S x step_time ms per 32 samples. `lr_scale`: each
# method's learning-rate multiplier, from `--sweep-lr` (methods not listed train at 1); `local_steps`: diloco's H.
TASKS = {
    "digits": {"step_time": 20.0, "target": 0.95, "metric": "accuracy", "higher": True, "max_s": 120.0,
               "lr_scale": {}, "local_steps": 8},
    # A charlm step computes for ~24 ms on one core: at 80 ms the headline mix keeps ~0.8 of the 2 cores
    # busy training (at 40 ms it needed 1.65 and the emulated devices fell ~20 % behind their speeds).
    "charlm": {"step_time": 80.0, "target": 2.5, "metric": "loss", "higher": False, "max_s": 120.0,
               "lr_scale": {"sync-proportional": 2.0}, "local_steps": 8},
}
METHODS = ["sync-equal", "sync-proportional", "diloco", "murmur-uniform", "murmur-work", "murmur"]
# What each Murmur method tells `murmur run` beyond the workload; `murmur` keeps every default.
MURMUR_ARGS = {
    "murmur-uniform": ["--merge", "average", "--weighting", "uniform"],
    "murmur-work": ["--merge", "average", "--weighting", "work"],
    "murmur": [],
    # Ablations, for `--methods` (not in the default run): what each part of the default buys.
    "murmur-keep-state": ["--merge", "average", "--weighting", "work", "--optimizer-state", "keep"],
    "murmur-avg-state": ["--merge", "average", "--weighting", "work", "--optimizer-state", "average"],
    "murmur-outer": ["--merge", "outer", "--weighting", "work", "--optimizer-state", "average"],
}
SWEEP_METHODS = ["sync-equal", "murmur"]
SWEEP_SCALES = [0.25, 0.5, 1.0, 2.0]  # ×2 grid around each task's own learning rate
DEFAULT = {"tasks": ["digits", "charlm"], "mixes": {"digits": ["homogeneous", "mild", "headline", "extreme"], "charlm": ["headline"]}, "seeds": [0, 1, 2], "max_s": {"digits": 25.0, "charlm": 60.0}}
QUICK = {"tasks": ["digits"], "mixes": {"digits": ["headline"]}, "seeds": [0], "max_s": {"digits": 20.0}}
SWEEP = {"tasks": ["charlm", "digits"], "mixes": {"charlm": ["headline"], "digits": ["headline"]}, "seeds": [0, 1],
         "max_s": DEFAULT["max_s"], "sweep": True, "runs": [(m, s) for s in SWEEP_SCALES for m in SWEEP_METHODS]}
START_MARGIN_S = 0.3  # from the start file's writing to the start time it holds: every peer reads it in time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peer_id(data_dir: Path) -> str:
    """The peer ID `murmur run --data-dir data_dir` will have (its key is created now)."""
    from murmur.node.net.identity import load_or_create_identity, peer_id_of

    return peer_id_of(load_or_create_identity(data_dir))


def _reached(value: float, target: float, higher: bool) -> bool:
    return value >= target if higher else value <= target


def run_murmur(
    task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float = 1.0
) -> dict[str, Any]:
    """Run one swarm of Murmur `method` (or, with `method="ideal"`, lone peers); return its results.

    Peers join first; once every peer is ready (status phase "waiting", knowing all the
    others) the start file tells them all one start time, t=0 of the run.
    """
    spec = TASKS[task]
    shutil.rmtree(root, ignore_errors=True)  # a peer would resume from an earlier run's checkpoint
    root.mkdir(parents=True)
    ports = [_free_port() for _ in slowdowns]
    dirs = [root / f"peer-{i}" for i in range(len(slowdowns))]
    start_file = root / "start-at"
    first = f"/ip4/127.0.0.1/tcp/{ports[0]}/p2p/{_peer_id(dirs[0])}"
    procs = []
    for i, (slowdown, data_dir) in enumerate(zip(slowdowns, dirs)):
        args = [
            "run", "--task", task, "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{ports[i]}",
            "--slowdown", str(slowdown), "--step-time", str(spec["step_time"]), "--duration", str(max_s),
            "--start-file", str(start_file), "--shard", str(1000 * seed + i), "--record-params", "--log-level", "WARNING",
            "--lr-scale", str(lr_scale), *ONE_THREAD,
        ]
        if method == "ideal":
            args += ["--average-every", "1e9"]  # alone: no bootstrap, no exchanges
        else:
            args += MURMUR_ARGS[method] + (["--bootstrap", first] if i else [])
        data_dir.mkdir(exist_ok=True)  # peer 0 has its key already
        procs.append(ForkedPeer(args, data_dir / "log.txt"))
    try:
        joined = time.monotonic()
        _wait_until_ready(procs, dirs, others=0 if method == "ideal" else len(slowdowns) - 1)
        start_at = time.time() + START_MARGIN_S
        (root / "start-at.tmp").write_text(repr(start_at))
        (root / "start-at.tmp").replace(start_file)
        startup_s = time.monotonic() - joined + START_MARGIN_S
        deadline = start_at + max_s + 30
        while time.time() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.5)
            grid = _median_curve(dirs, spec["metric"], start_at)
            if method != "ideal" and grid and _reached(grid[-1]["value"], spec["target"], spec["higher"]):
                time.sleep(1.0)  # one more grid point, then stop everyone
                break
    finally:
        codes = stop_processes(procs, timeout=20)
    result = _murmur_result(task, slowdowns, method, dirs, start_at, codes)
    result["startup_s"] = startup_s
    return result


def _wait_until_ready(procs: list[ForkedPeer], dirs: list[Path], others: int, timeout: float = 60.0) -> None:
    """Wait until every peer waits for its start time, knowing `others` peers; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if p.poll() is not None:
                raise RuntimeError(f"peer {i} exited with {p.returncode} before the start; see {dirs[i] / 'log.txt'}")
        statuses = [_status(d) for d in dirs]
        if all(s.get("phase") == "waiting" and s.get("known_peers", 0) >= others for s in statuses):
            return
        time.sleep(0.05)
    raise RuntimeError(f"peers not ready within {timeout:g}s: {[_status(d).get('phase') for d in dirs]}")


def _status(data_dir: Path) -> dict:
    """The peer's last status, or {} while it has written none."""
    try:
        return load_status(data_dir)
    except StatusUnavailable:
        return {}


def _records(data_dir: Path) -> list[dict]:
    """The peer's evaluation records so far ([] before its first)."""
    path = data_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _median_curve(dirs: list[Path], metric: str, t0: float) -> list[dict]:
    """The median peer's metric and the swarm's total samples on a 1 s grid after `t0`."""
    records = [_records(d) for d in dirs]
    if not all(records):
        return []
    end = min(r[-1]["t"] for r in records) - t0
    out = []
    for t in range(0, int(end) + 1):
        latest = [next((x for x in reversed(r) if x["t"] - t0 <= t + 0.5), r[0]) for r in records]
        out.append({"t": float(t), "value": statistics.median(x[metric] for x in latest), "samples": sum(x["samples"] for x in latest)})
    return out


def _consensus(dirs: list[Path]) -> list[dict]:
    """Mean squared distance of the peers' parameters from their average, per evaluation."""
    import torch

    histories = []
    for d in dirs:
        if not (d / "params.pt").exists():
            return []
        histories.append(torch.load(d / "params.pt"))
    t0 = min(h[0][0] for h in histories if h)
    out = []
    for k in range(min(len(h) for h in histories)):
        stack = torch.stack([h[k][1] for h in histories])
        distance = ((stack - stack.mean(0)) ** 2).sum(1).mean().item()
        out.append({"t": round(histories[0][k][0] - t0, 2), "distance": distance})
    return out


def _murmur_result(task: str, slowdowns: list[float], method: str, dirs: list[Path], start_at: float, codes: list) -> dict:
    spec = TASKS[task]
    curve = _median_curve(dirs, spec["metric"], start_at)
    statuses = [_status(d) for d in dirs]
    ttt = next((c["t"] for c in curve if _reached(c["value"], spec["target"], spec["higher"])), None)
    return {
        "method": method,
        "task": task, "slowdowns": slowdowns, "exit_codes": codes,
        "curve": [{"t": c["t"], "samples": c["samples"], spec["metric"]: c["value"]} for c in curve],
        "time_to_target": ttt,
        "samples_per_s": sum(s.get("samples_per_s", 0.0) for s in statuses),
        "peers": [{"rank": i, "slowdown": slowdowns[i], "samples_per_s": s.get("samples_per_s"), "idle_fraction": 1 - s.get("compute_fraction", 0.0),
                   "bytes_sent": s.get("bytes_sent", 0), "exchanges": s.get("exchanges", {}), "mean_exchange_s": s.get("mean_exchange_s")}
                  for i, s in enumerate(statuses)],
        "consensus": _consensus(dirs),
    }


def run_method(task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float | None = None) -> dict:
    """Run one method (or the ideal) on the task's workload at `lr_scale` (default: the task's chosen scale)."""
    spec = TASKS[task]
    scale = spec["lr_scale"].get(method, 1.0) if lr_scale is None else lr_scale
    if method == "ideal":
        result = run_murmur(task, slowdowns, method, seed, 6.0, root)
    elif method in MURMUR_ARGS:
        result = run_murmur(task, slowdowns, method, seed, max_s, root, scale)
    else:  # the synchronous baselines: their ranks run one thread each, like the peers
        mode = "diloco" if method == "diloco" else method.removeprefix("sync-")
        result = run_sync(task, slowdowns, mode, max_s, spec["step_time"], spec["target"], seed=seed, lr_scale=scale,
                          local_steps=spec["local_steps"])
    result["lr_scale"] = scale
    return result


def _at_samples(result: dict, metric: str, samples: float) -> float | None:
    """The metric when the run had processed `samples` in all (linear between evaluations), or None beyond its end."""
    curve = result["curve"]
    for before, after in itertools.pairwise(curve):
        if before["samples"] <= samples <= after["samples"]:
            span = after["samples"] - before["samples"]
            share = (samples - before["samples"]) / span if span else 1.0
            return before[metric] + share * (after[metric] - before[metric])
    return None


def run_bench(config: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    # One fork server, started now with everything both kinds of run import: Murmur peers
    # and sync ranks then start in about a second (start-up is excluded from the measurements).
    multiprocessing.get_context("forkserver").set_forkserver_preload([RANK_MODULE, *FORK_PRELOAD])
    multiprocessing.forkserver.ensure_running()
    bench_began = time.monotonic()
    results: list[dict] = []
    runs = [("ideal", None), *config.get("runs", [(m, None) for m in METHODS])]
    total = sum(len(config["seeds"]) * len(config["mixes"][t]) * len(runs) for t in config["tasks"])
    with Progress(total=total, label="murmur bench") as progress:
        for task in config["tasks"]:
            _bench_task(task, config, runs, out, progress, results)
    return report({"config": config, "results": results, "wall_s": time.monotonic() - bench_began}, out)


def _bench_task(task: str, config: dict, runs: list, out: Path, progress: Progress, results: list[dict]) -> None:
    """Run every seed and mix of `task`, method by method (interleaved), appending to `results` and saving them."""
    for seed in config["seeds"]:
        for mix in config["mixes"][task]:
            slowdowns = MIXES[mix]
            max_s = config["max_s"][task]
            group = []
            # The ideal is calibrated for every seed, next to the runs it is compared with.
            for method, scale in runs:
                label = method if scale is None else f"{method}@lr×{scale:g}"
                print(f"[bench] {task} seed {seed} {mix} {slowdowns}: {label}", flush=True)
                progress.start(f"{task} {mix} seed {seed}: {label}")
                began = time.monotonic()
                r = run_method(task, slowdowns, method, seed, max_s, out / "runs" / f"{task}-{mix}-s{seed}-{label}", scale)
                r.update(mix=mix, seed=seed, label=label, run_wall_s=time.monotonic() - began)  # start-up and teardown included
                group.append(r)
                progress.advance()
            for g in score(group):
                print(f"  {g['label']:18s} ttt={g.get('time_to_target') if g['method'] != 'ideal' else '-'} samples/s={g['samples_per_s']:.0f} ({(g['pct_of_ideal'] or 0):.0%} of ideal) "
                      f"max idle={max(p['idle_fraction'] for p in g['peers']):.1%} {TASKS[task]['metric']} at equal samples={g['metric_at_equal_samples']}", flush=True)
            results += group
            (out / "results.json").write_text(json.dumps({"config": config, "results": results}, indent=1))


def score(group: list[dict]) -> list[dict]:
    """Add % of ideal and the metric at equal samples to one task, seed and mix's runs (ideal first)."""
    metric = TASKS[group[0]["task"]]["metric"]
    ideal = next(g["samples_per_s"] for g in group if g["method"] == "ideal")
    # Equal samples: as many as sync-equal needed to reach its target (a method that stopped before has none);
    # in a sweep, the best-tuned sync-equal's.
    syncs = [g for g in group if g["method"] == "sync-equal" and g["curve"]]
    best = min(syncs, key=lambda g: g.get("time_to_target") or float("inf"), default=None)
    budget = best["curve"][-1]["samples"] if best else None
    for g in group:
        g.setdefault("label", g["method"])
        g["pct_of_ideal"] = g["samples_per_s"] / ideal if ideal else None
        g["metric_at_equal_samples"] = _at_samples(g, metric, budget) if budget and g["method"] != "ideal" else None
    return group


def report(run: dict, out: Path) -> dict:
    """Write `run`'s results.json, summary.md and plots under `out`, print the summary, return `run`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(run, indent=1))
    summary = summarize(run["results"]) + f"\nBenchmark wall time: {run['wall_s'] / 60:.1f} min ({len(run['results'])} runs).\n"
    if run["config"].get("sweep"):  # its verdict is what the default run should use
        run["chosen_lr_scale"] = chosen = choose_lr(run["results"])
        summary += "\nBest learning rate (median time to target, then metric at equal samples): " + "; ".join(
            f"{task} {method} {base_lr(task) * scale:.3g} (×{scale:g})" for task, picks in chosen.items() for method, scale in picks.items()
        ) + ".\n"
        (out / "results.json").write_text(json.dumps(run, indent=1))
    (out / "summary.md").write_text(summary)
    plot(run["results"], out)
    print(summary)
    return run


def rescore(results_file: Path, out: Path) -> dict:
    """Score an earlier run's results again (after a change to the scoring) and report them under `out`."""
    run = json.loads(results_file.read_text())
    groups: dict[tuple, list[dict]] = {}
    for r in run["results"]:
        groups.setdefault((r["task"], r["seed"], r["mix"]), []).append(r)
    for group in groups.values():
        score(group)
    return report(run, out)


def _med(values: list[float], digits: int = 2) -> str:
    """Median and (min–max) of the seeds' values."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    f = f".{digits}f"
    return format(statistics.median(values), f) + (f" ({min(values):{f}}–{max(values):{f}})" if len(values) > 1 else "")


def _labels(results: list[dict]) -> list[str]:
    """The runs' labels (methods, or sweep points), in the order they ran, ideal last."""
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in results if r["method"] != "ideal"))
    return labels + ["ideal"]


def base_lr(task: str) -> float:
    """The learning rate the task's own optimizer starts with (its first parameter group's)."""
    from murmur.node.learn.tasks import load_task

    spec = load_task(task)
    return spec.make_optimizer(spec.build_model()).param_groups[0]["lr"]


def summarize(results: list[dict]) -> str:
    lines = ["| task | mix | method | time to target s | vs sync-equal | samples/s | % of ideal | max peer idle | metric at equal samples | lr |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["task"], r["mix"]) for r in results}, key=lambda k: (k[0], list(MIXES).index(k[1])))
    for task, mix in keys:
        lr = base_lr(task)
        for label in _labels(results):
            rs = [r for r in results if (r["task"], r["mix"], r.get("label", r["method"])) == (task, mix, label)]
            if not rs:
                continue
            ratios = []
            for r in rs:
                syncs = [b for b in results if (b["task"], b["mix"], b["seed"], b["method"]) == (task, mix, r["seed"], "sync-equal")]
                base = min((b["time_to_target"] for b in syncs if b.get("time_to_target")), default=None)  # the best-tuned
                if label != "ideal" and base and r.get("time_to_target"):
                    ratios.append(r["time_to_target"] / base)
            scale = rs[0].get("lr_scale")
            lines.append(
                f"| {task} | {mix} | {label} | {_med([r.get('time_to_target') for r in rs]) if label != 'ideal' else '—'} | {_med(ratios)} | "
                f"{_med([r['samples_per_s'] for r in rs])} | {_med([r['pct_of_ideal'] for r in rs])} | "
                f"{_med([max(p['idle_fraction'] for p in r['peers']) for r in rs])} | {_med([r.get('metric_at_equal_samples') for r in rs], 3)} | "
                f"{f'{lr * scale:.3g} (×{scale:g})' if scale and label != 'ideal' else '—'} |"
            )
    return "\n".join(lines) + "\n"


def choose_lr(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per task and swept method, the scale with the best median time to target (then metric at equal samples)."""
    chosen: dict[str, dict[str, float]] = {}
    for task in sorted({r["task"] for r in results}):
        higher = TASKS[task]["higher"]
        swept = {r["method"] for r in results if r["task"] == task and r["method"] != "ideal"}
        for method in [m for m in [*METHODS, *MURMUR_ARGS] if m in swept]:
            scores = []
            for scale in sorted({r["lr_scale"] for r in results if (r["task"], r["method"]) == (task, method)}):
                rs = [r for r in results if (r["task"], r["method"], r["lr_scale"]) == (task, method, scale)]
                ttt = statistics.median(r.get("time_to_target") or float("inf") for r in rs)
                at_equal = [r["metric_at_equal_samples"] for r in rs if r.get("metric_at_equal_samples") is not None]
                quality = statistics.median(at_equal) if at_equal else float("nan")
                scores.append((ttt, -quality if higher else quality, scale))
            if scores:
                chosen.setdefault(task, {})[method] = min(scores, key=lambda s: (s[0], s[1] if s[1] == s[1] else float("inf")))[2]
    return chosen


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for task in sorted({r["task"] for r in results}):
        metric = TASKS[task]["metric"]
        mixes = [m for m in MIXES if any(r["task"] == task and r["mix"] == m for r in results)]
        fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for j, label in enumerate(_labels(results)[:-1]):
                for i, r in enumerate(r for r in results if (r["task"], r["mix"], r.get("label", r["method"])) == (task, mix, label)):
                    ax.plot([c["t"] for c in r["curve"]], [c[metric] for c in r["curve"]], color=f"C{j}",
                            ls="--" if r["method"].startswith(("sync", "diloco")) else "-", alpha=0.7, label=label if i == 0 else None)
            ax.axhline(TASKS[task]["target"], color="grey", lw=0.5)
            ax.set_title(f"{task}, {mix} {MIXES[mix]}")
            ax.set_xlabel("wall time (s)")
            ax.set_ylabel(f"median peer held-out {metric}")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{task}-metric-vs-time.png", dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        labels = _labels(results)[:-1]
        width = 0.8 / len(labels)
        for j, label in enumerate(labels):
            ys = [statistics.median([r["pct_of_ideal"] for r in results if (r["task"], r["mix"], r.get("label", r["method"])) == (task, m, label)] or [0]) for m in mixes]
            ax.bar([i + width * j for i in range(len(mixes))], ys, width=width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mixes))], mixes)
        ax.set_ylabel("throughput, fraction of ideal")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{task}-throughput-vs-ideal.png", dpi=100)
        plt.close(fig)


def _method_arg(text: str) -> tuple[str, float | None]:
    """`method` or `method@scale` -> (method, scale or None); raises ValueError naming what is wrong."""
    method, _, scale = text.partition("@")
    if method not in METHODS and method not in MURMUR_ARGS:
        raise ValueError(f"unknown method {method!r}: choose from {[*METHODS, *MURMUR_ARGS]}")
    if not scale:
        return method, None
    if not float(scale) > 0:
        raise ValueError(f"learning-rate scale must be positive, got {scale!r}")
    return method, float(scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="murmur bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="digits, headline mix, one seed (~1 min)")
    parser.add_argument("--tasks", default=None, help="comma-separated tasks (default: digits,charlm)")
    parser.add_argument("--mixes", default=None, help=f"comma-separated mixes from {list(MIXES)}")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds")
    parser.add_argument("--out", type=Path, default=Path("results/bench"))
    parser.add_argument("--sweep-lr", action="store_true",
                        help=f"run {SWEEP_METHODS} at learning-rate scales {SWEEP_SCALES} instead and print the best of each "
                             "(default: charlm and digits, headline mix, 2 seeds)")
    parser.add_argument("--methods", default=None, metavar="M[@SCALE],…",
                        help=f"run these methods instead (from {[*METHODS, *(m for m in MURMUR_ARGS if m not in METHODS)]}), "
                             "each optionally at a learning-rate scale, e.g. sync-equal@0.5,murmur@0.7")
    parser.add_argument("--rescore", type=Path, default=None, metavar="RESULTS_JSON",
                        help="run nothing: score an earlier run's results.json again and write the table and plots to --out")
    args = parser.parse_args(argv)
    if args.rescore:
        rescore(args.rescore, args.out)
        return 0
    config = json.loads(json.dumps(QUICK if args.quick else SWEEP if args.sweep_lr else DEFAULT))
    if args.tasks:
        config["tasks"] = args.tasks.split(",")
        for t in config["tasks"]:
            config["mixes"].setdefault(t, ["headline"])
            config["max_s"].setdefault(t, DEFAULT["max_s"][t])
    if args.mixes:
        config["mixes"] = {t: args.mixes.split(",") for t in config["tasks"]}
    if args.methods:
        config["runs"] = [_method_arg(m) for m in args.methods.split(",")]
    if args.seeds:
        config["seeds"] = list(range(args.seeds))
    run_bench(config, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
