"""The synchronous baseline's results dict (`lab.sync_baseline.run_sync`, `lab.elastic`) and its summary."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lab.sync_config import Config
from murmur.node.learn.tasks.task import Metric

PEER_KEYS = (
    "rank", "slowdown", "batch", "steps", "samples", "local_steps", "compute_s", "comm_s", "wall_s", "idle_fraction",
    "bytes_sent",
)  # fmt: skip


def result_of(cfg: Config, head: dict[str, Any], peers: list[dict[str, Any]], begin: float) -> dict[str, Any]:
    """`run_sync`'s results dict: `head` says what rank 0 reports (task and metric, "batch_size", "steps", "curve",
    "wall_s", "clock_start", "eval_s", "inner_steps", "rebalances", "batches"), `peers` are the rows by rank and
    `begin` is when the run started (monotonic)."""
    curve, target = head["curve"], cfg.target
    metric = Metric(head["metric"], head["higher_is_better"])
    time_to_target = None
    if target is not None:
        time_to_target = next((pt["t"] for pt in curve if metric.reached(pt[metric.name], target)), None)
    total = sum(p["samples"] for p in peers)
    return {
        "method": cfg.mode if cfg.mode.startswith("diloco") else f"sync-{cfg.mode}",
        "task": head["task"],
        "mode": cfg.mode,
        "metric": head["metric"],
        "higher_is_better": head["higher_is_better"],
        "slowdowns": list(cfg.slowdowns),
        "step_time_ms": cfg.step_time_ms,
        "target": cfg.target,
        "eval_every": cfg.eval_every,
        "seed": cfg.seed,
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
        "local_steps": cfg.local_steps,
        "inner_steps": head["inner_steps"],
        "outer_lr": cfg.outer_lr,
        "outer_wire": cfg.outer_wire,
        "rebalance_every": cfg.rebalance_every,
        "rebalances": head["rebalances"],
        "batches": head["batches"],
        "config": {
            **{k: v for k, v in asdict(cfg).items() if k not in ("port", "trace")},
            "trace": cfg.trace.to_json() if cfg.trace is not None else None,
        },
    }


def summary(result: dict[str, Any]) -> str:
    """Return a short human-readable summary of a `run_sync` result."""
    metric = result["metric"]
    final = f"  final {metric} {result['curve'][-1][metric]:.4f}"
    if result["target"] is not None:
        ttt = result["time_to_target"]
        final += f"; time to {metric} {result['target']}: " + ("not reached" if ttt is None else f"{ttt:.2f} s")
    lines = [
        (f"{result['method']} on {result['task']}: {len(result['peers'])} ranks, slowdowns {result['slowdowns']}, "
         f"step_time_ms {result['step_time_ms']}"),
        (f"  train {result['wall_s']:.1f} s (excluded: startup {result['startup_s']:.1f} s, "
         f"eval {result['eval_s']:.2f} s), "
         f"{result['steps']} steps, {result['samples']} samples, {result['samples_per_s']:.0f} samples/s"),
        final,
        "  rank slowdown batch  samples compute_s  comm_s  idle  MB_sent",
    ]
    if result["mode"].startswith("diloco"):
        lines.insert(3, f"  inner steps {result['inner_steps']} (local_steps {result['local_steps']}), "
                        f"outer_lr {result['outer_lr']:g}, outer wire {result['outer_wire']}")
    elif result["mode"] == "adaptive":
        lines.insert(3, f"  {result['rebalances']} rebalances (every {result['rebalance_every']} steps), "
                        f"last batches {result['batches']}")
    for p in result["peers"]:
        lines.append(
            f"  {p['rank']:>4} {p['slowdown']:>8g} {p['batch']:>5} {p['samples']:>8} {p['compute_s']:>9.2f} "
            f"{p['comm_s']:>7.2f} {p['idle_fraction']:>5.2f} {p['bytes_sent'] / 1e6:>8.1f}"
        )
    for x in result.get("restarts", []):  # an elastic run's (`lab.elastic`)
        lines.append(f"  restart {x['generation']} ({x['event']} at t={x['t']:g}, world {x['world_before']} -> "
                     f"{x['world_after']}): downtime {x['downtime_s']:.2f} s, {x['steps_lost']} steps lost")
    return "\n".join(lines)


