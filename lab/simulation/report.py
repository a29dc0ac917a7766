"""The simulator's report: markdown tables, plots and the setup paragraph, from `SimResult.to_json()` records.

A record is one run's `SimResult.to_json()` plus `evaluated`; `write_report` turns a
list of them into `summary.md` and PNG plots in a folder (plots need matplotlib).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.simulation.config import TOPOLOGIES
from murmur.node.averaging.outcome import Result

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


def _at(record: dict[str, Any], key: str, t: float) -> float | None:
    """The value of curve `key` at simulated time `t` (the last grid point ≤ t), if the run got there."""
    points = [v for time_, v in zip(record["times"], record[key]) if time_ <= t + 1e-9]
    return points[-1] if points and record["times"][-1] >= t - 1e-9 else None


def _merges_per_peer_s(record: dict[str, Any]) -> float:
    duration = record["times"][-1] or 1.0
    return record["exchanges"].get(Result.MERGED, 0) / (record["config"]["peers"] * duration)


def fmt(value: float | None, spec: str = ".2f", missing: str = "—") -> str:
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
            f"| {cfg['peers']} | {LABELS[cfg['topology']]} | {fmt(r['time_to_target'], '.2f', not_reached)} "
            f"| {fmt(r['time_to_target_p10'], '.2f', not_reached)} | {fmt(accuracy, '.3f')} / {fmt(p10, '.3f')} "
            f"| {fmt(consensus, '.3f')} | {r['accuracy_median'][-1]:.3f} | {r['samples'] / ran:,.0f} "
            f"| {_merges_per_peer_s(r):.2f} | {fmt(r.get('exchange_s'), '.3f')} "
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
    for topology in TOPOLOGIES:
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


def write_report(records: list[dict[str, Any]], out: Path, target: float, report_at: float) -> None:
    """Write `summary.md` and the plots to `out` and print the tables."""
    table = summary_table(records, report_at)
    views = view_table(records)
    text = setup_text(records) + "\n" + table + ("\nPartial views at the end of each run:\n\n" + views if views else "")
    (out / "summary.md").write_text(text)
    paths = plot(records, out, target)
    print()
    print(table + ("\n" + views if views else ""))
    print(f"simulate: wrote {out / 'results.json'}, {out / 'summary.md'}, " + ", ".join(p.name for p in paths))
