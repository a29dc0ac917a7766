"""Simulate Murmur at 100, 300 and 1,000 peers: gossip vs partial views vs a ring vs ideal all-reduce.

Every gossip peer runs the real averager (merge policy, screening, exchange state
machine, tensor codec, state sync) over simulated links in simulated time; see
`node/simulation.py` for the network model. For each swarm size and topology this
runs one simulation on the digits task and records held-out accuracy (of a sample of
peers) and consensus distance (of all peers) on a simulated-time grid. `alone` (no
averaging: the reference) runs at the smallest size only, since its peers never
interact. Writes `results.json`, PNG plots and `summary.md` to `--out`.

    .venv/bin/python scripts/simulate.py                  # 100, 300, 1000 peers (~15-20 min on 2 cores)
    .venv/bin/python scripts/simulate.py --quick          # 20 and 50 peers, ~1 min
    .venv/bin/python scripts/simulate.py --peers 1000 --topologies gossip,partial
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]

from node.lab.simulation import TOPOLOGIES, NetworkModel, SimConfig, simulate

DEFAULT_TOPOLOGIES = ["gossip", "partial", "ring", "allreduce", "alone"]
COLORS = {
    "gossip": "tab:blue",
    "partial": "tab:green",
    "ring": "tab:orange",
    "allreduce": "tab:red",
    "alone": "tab:gray",
}
LABELS = {
    "gossip": "gossip, full view", "partial": "gossip, partial view", "ring": "fixed ring",
    "allreduce": "ideal all-reduce", "alone": "no averaging",
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default=None, help="comma-separated swarm sizes (default 100,300,1000; --quick: 20,50)")
    p.add_argument(
        "--topologies", default=",".join(DEFAULT_TOPOLOGIES), help=f"comma-separated, from {','.join(TOPOLOGIES)}"
    )
    p.add_argument(
        "--quick", action="store_true", help="small swarms and short runs: a smoke test of the whole pipeline"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output folder (default docs/sim; --quick: results/sim-quick)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.95, help="held-out accuracy target")
    p.add_argument("--max-time", type=float, default=10.0, help="simulated seconds at most per gossip-type run")
    p.add_argument("--allreduce-max-time", type=float, default=150.0, help="simulated seconds at most for all-reduce")
    p.add_argument(
        "--linger", type=float, default=1.0, help="keep simulating this long after 90%% of peers reach the target"
    )
    p.add_argument("--eval-sample", type=int, default=32, help="peers evaluated per grid point")
    p.add_argument("--eval-every", type=float, default=0.25, help="simulated seconds between evaluations")
    p.add_argument("--churn", type=float, default=0.01, help="fraction of the swarm replaced per simulated second")
    p.add_argument("--view-size", type=int, default=32, help="partial view size")
    p.add_argument(
        "--report-at", type=float, default=4.0, help="simulated time at which the table compares accuracy and consensus"
    )
    p.add_argument(
        "--jobs", type=int, default=1, help="simulations to run at once (one process each; 2 uses both cores)"
    )
    p.add_argument(
        "--max-wall", type=float, default=900.0, help="real seconds at most per simulation (then marked truncated)"
    )
    p.add_argument("--replot", action="store_true", help="only rebuild the tables and plots from --out/results.json")
    args = p.parse_args(argv)
    sizes = args.peers or ("20,50" if args.quick else "100,300,1000")
    args.sizes = [int(n) for n in sizes.split(",")]
    args.topology_list = [t.strip() for t in args.topologies.split(",") if t.strip()]
    unknown = set(args.topology_list) - set(TOPOLOGIES)
    if unknown:
        p.error(f"unknown topologies {sorted(unknown)}; choose from {list(TOPOLOGIES)}")
    if args.quick:
        args.max_time, args.allreduce_max_time, args.eval_every, args.report_at = 4.0, 30.0, 0.5, 2.0
    args.out = args.out or (ROOT / ("results/sim-quick" if args.quick else "docs/sim"))
    return args


def plan(args: argparse.Namespace) -> list[SimConfig]:
    """One config per (size, topology); `alone` only at the smallest size."""
    base = SimConfig(
        target=args.target, linger=args.linger, eval_every=args.eval_every, eval_sample=args.eval_sample,
        view_size=args.view_size, network=NetworkModel(churn=args.churn), seed=args.seed, max_wall_s=args.max_wall,
    )  # fmt: skip
    configs = []
    for n in args.sizes:
        for topology in args.topology_list:
            if topology == "alone" and n != min(args.sizes):
                continue
            max_time = args.allreduce_max_time if topology == "allreduce" else args.max_time
            configs.append(replace(base, peers=n, topology=topology, max_time=max_time))
    return configs


def _run(config: SimConfig) -> dict[str, Any]:
    result = simulate(config)
    record = result.to_json()
    record["evaluated"] = result.evaluated
    return record


def _at(record: dict[str, Any], key: str, t: float) -> float | None:
    """The value of curve `key` at simulated time `t` (the last grid point ≤ t), if the run got there."""
    points = [v for time_, v in zip(record["times"], record[key]) if time_ <= t + 1e-9]
    return points[-1] if points and record["times"][-1] >= t - 1e-9 else None


def _merges_per_peer_s(record: dict[str, Any]) -> float:
    duration = record["times"][-1] or 1.0
    return record["exchanges"].get("merged", 0) / (record["config"]["peers"] * duration)


def _fmt(value: float | None, spec: str = ".2f", missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def summary_table(records: list[dict[str, Any]], report_at: float) -> str:
    """A markdown table: one row per run."""
    header = (
        f"| peers | topology | time to target, median peer (s) | time to target, 90 % of peers (s) "
        f"| accuracy at {report_at:g} s (median / p10) | consensus distance at {report_at:g} s | final accuracy (median) "
        f"| samples per s | merges per peer per s | exchange s | busy answers | simulated s | wall s |"
    )
    lines = [header, "|" + " --- |" * 13]
    for r in records:
        cfg = r["config"]
        ran = r["times"][-1]
        not_reached = f"> {ran:g}"
        accuracy = _at(r, "accuracy_median", report_at)
        p10 = _at(r, "accuracy_p10", report_at)
        consensus = _at(r, "consensus", report_at)
        lines.append(
            f"| {cfg['peers']} | {LABELS[cfg['topology']]} | {_fmt(r['time_to_target'], '.2f', not_reached)} "
            f"| {_fmt(r['time_to_target_p10'], '.2f', not_reached)} | {_fmt(accuracy, '.3f')} / {_fmt(p10, '.3f')} "
            f"| {_fmt(consensus, '.3f')} | {r['accuracy_median'][-1]:.3f} | {r['samples'] / ran:,.0f} "
            f"| {_merges_per_peer_s(r):.2f} | {_fmt(r.get('exchange_s'), '.3f')} "
            f"| {r['exchanges'].get('busy', 0)} | {ran:g} | {r['wall_s']:.0f}{' (truncated)' if r['truncated'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def view_table(records: list[dict[str, Any]]) -> str:
    rows = [r for r in records if r.get("view")]
    if not rows:
        return ""
    lines = [
        "| peers | view size min / mean / max | in-degree mean / max | dead descriptors | overlay connected |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        v = r["view"]
        lines.append(
            f"| {r['config']['peers']} | {v['size_min']:.0f} / {v['size_mean']:.1f} / {v['size_max']:.0f} "
            f"| {v['indegree_mean']:.1f} / {v['indegree_max']:.0f} | {v['dead_fraction']:.1%} | {'yes' if v['connected'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], out: Path, target: float) -> list[Path]:
    """Accuracy and consensus distance vs simulated time per size, and time to target vs size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sizes = sorted({r["config"]["peers"] for r in records})
    gossip_end = max((r["times"][-1] for r in records if r["config"]["topology"] != "allreduce"), default=10.0)
    paths = []
    for key, ylabel, name, log in [
        (
            "accuracy_median",
            "held-out accuracy: median peer (solid), 10th percentile (dashed)",
            "accuracy-vs-time.png",
            False,
        ),
        ("consensus", "consensus distance (mean ‖θᵢ − θ̄‖²)", "consensus-vs-time.png", True),
    ]:
        fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.6), sharey=True, squeeze=False)
        handles: dict[str, Any] = {}
        for ax, n in zip(axes[0], sizes):
            for r in (r for r in records if r["config"]["peers"] == n):
                topology = r["config"]["topology"]
                if log and topology == "allreduce":
                    continue  # one model: no consensus distance to show
                label = LABELS[topology]
                # The log scale cannot show t = 0, where every peer holds the same initial model.
                points = [(t, v) for t, v in zip(r["times"], r[key]) if not log or v > 1e-6]
                (line,) = ax.plot(*zip(*points), color=COLORS[topology], label=label)
                handles.setdefault(label, line)
                if key == "accuracy_median" and topology != "allreduce":
                    ax.plot(r["times"], r["accuracy_p10"], color=COLORS[topology], linestyle="--", linewidth=0.8)
            if key == "accuracy_median":
                ax.axhline(target, color="black", linewidth=0.5, linestyle=":")
                ax.set_ylim(0.5, 1.0)
                slow = [r for r in records if r["config"]["peers"] == n and r["config"]["topology"] == "allreduce"]
                if slow and slow[0]["time_to_target"] is not None:  # usually far right of the gossip runs
                    ax.text(0.98, 0.03, f"all-reduce reaches {target:g} at {slow[0]['time_to_target']:.0f} s",
                            transform=ax.transAxes, ha="right", fontsize=8, color=COLORS["allreduce"])  # fmt: skip
            if log:
                ax.set_yscale("log")
            ax.set_xlim(0, gossip_end)
            ax.set_title(f"{n} peers")
            ax.set_xlabel("simulated time (s)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel, fontsize=8)
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles), fontsize=8)
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for topology in DEFAULT_TOPOLOGIES:
        rows = sorted((r for r in records if r["config"]["topology"] == topology), key=lambda r: r["config"]["peers"])
        for key, style, suffix in [
            ("time_to_target", "-", "median peer"),
            ("time_to_target_p10", "--", "90 % of peers"),
        ]:
            points = [(r["config"]["peers"], r[key]) for r in rows if r[key] is not None]
            if points and not (topology == "allreduce" and key == "time_to_target_p10"):  # one model: the same curve
                ax.plot(
                    *zip(*points),
                    marker="o",
                    linestyle=style,
                    color=COLORS[topology],
                    label=f"{LABELS[topology]}, {suffix}",
                )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_yticks([2, 5, 10, 20, 50, 100])
    ax.set_xlabel("peers")
    ax.set_ylabel(f"simulated s until held-out accuracy {target:g}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # outside: the curves fill the axes
    fig.tight_layout()
    fig.savefig(out / "time-to-target.png", dpi=110)
    plt.close(fig)
    paths.append(out / "time-to-target.png")
    return paths


def setup_text(records: list[dict[str, Any]]) -> str:
    """One paragraph stating what was simulated, from the first run's config."""
    cfg = records[0]["config"]
    net = cfg["network"]
    return (
        f"Digits task, target held-out accuracy {cfg['target']:g}. Held-out accuracy is measured on a sample of "
        f"{cfg['eval_sample']} peers every {cfg['eval_every']:g} simulated s (a dead one is replaced by a random live "
        f"peer); consensus distance on every live peer. Compute: {net['step_ms']:g} ms per 32-sample step × slowdown, "
        f"slowdown ~ Pareto(α={net['pareto_alpha']:g}) capped at {net['max_slowdown']:g}. One-way latency "
        f"{net['latency_ms']:g}–{net['latency_ms'] + net['latency_span_ms']:g} ms by distance; uplinks lognormal, median "
        f"{net['bandwidth_mbps']:g} Mbit/s. Churn: {net['churn']:.0%} of the swarm crashes per simulated second, each "
        f"replaced by a newcomer (all-reduce: no churn, free communication). Averaging every {cfg['average_every']:g} s "
        f"as the node does (stretched so exchanges take ≤ 10 % of the time), `{cfg['weighting']}` weighting; partial "
        f"views of {cfg['view_size']} with Cyclon shuffles of {cfg['shuffle_length']} every {cfg['shuffle_every']:g} s. "
        f"Seed {cfg['seed']}; a run stops {cfg['linger']:g} s after 90 % of the evaluated peers reach the target.\n"
    )


def report(records: list[dict[str, Any]], out: Path, target: float, report_at: float) -> None:
    """Write `summary.md` and the plots to `out` and print the tables."""
    table = summary_table(records, report_at)
    views = view_table(records)
    text = setup_text(records) + "\n" + table + ("\nPartial views at the end of each run:\n\n" + views if views else "")
    (out / "summary.md").write_text(text)
    paths = plot(records, out, target)
    print()
    print(table + ("\n" + views if views else ""))
    print(f"simulate: wrote {out / 'results.json'}, {out / 'summary.md'}, " + ", ".join(p.name for p in paths))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "results.json").read_text())
        report(saved["runs"], args.out, saved["runs"][0]["config"]["target"], saved["meta"]["report_at"])
        return 0
    configs = plan(args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"simulate: {len(configs)} runs: {args.sizes} peers x {args.topology_list}; digits task, target accuracy {args.target:g};"
    )
    print(f"simulate: held-out accuracy is evaluated on a sample of {args.eval_sample} peers per grid point "
          f"(consensus distance on all peers)", flush=True)  # fmt: skip
    start = time.perf_counter()
    records: list[dict[str, Any]] = []
    spawn = multiprocessing.get_context("spawn")  # never fork a process that holds torch's thread pools
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) if args.jobs > 1 else _Inline() as pool:
        for config, record in zip(configs, pool.map(_run, configs)):
            records.append(record)
            print(
                f"  {config.peers:5d} peers  {config.topology:9s}  target(median) {_fmt(record['time_to_target'])} s"
                f"  target(90%) {_fmt(record['time_to_target_p10'])} s  final acc {record['accuracy_median'][-1]:.3f}"
                f"  consensus {record['consensus'][-1]:.3f}  wall {record['wall_s']:.0f} s",
                flush=True,
            )
    total = time.perf_counter() - start
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "wall_s": total,
        "cpus": os.cpu_count(),
        "report_at": args.report_at,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": records}, indent=1))
    report(records, args.out, args.target, args.report_at)
    print(f"simulate: {total:.0f} s in all")
    return 0


class _Inline:
    """`map` in this process (the default: the runs share one core politely)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def map(self, fn: Any, items: list[SimConfig]) -> Any:
        return map(fn, items)


if __name__ == "__main__":
    sys.exit(main())
