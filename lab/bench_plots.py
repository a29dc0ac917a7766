"""`murmur bench`'s plots, per task: the metric against wall time and against samples, the
consensus distance of Murmur's peers, and throughput as a fraction of the ideal."""

from __future__ import annotations

import statistics
from pathlib import Path

from lab.bench_config import MIXES, TASKS
from lab.traces import SCENARIOS, Trace


def run_labels(results: list[dict]) -> list[str]:
    """The runs' labels (methods, or sweep points), in the order they ran, ideal last."""
    labels = list(dict.fromkeys(r.get("label", r["method"]) for r in results if r["method"] != "ideal"))
    return labels + ["ideal"]


def runs_of(results: list[dict], task: str, mix: str, label: str) -> list[dict]:
    """The runs (one per seed) of `label` on `task` and `mix`."""
    return [r for r in results if (r["task"], r["mix"], r.get("label", r["method"])) == (task, mix, label)]


def plot(results: list[dict], out: Path) -> None:
    """Write TASK-metric-vs-time.png, TASK-metric-vs-samples.png, TASK-consensus.png and
    TASK-throughput-vs-ideal.png under `out`: every seed's curve, one colour per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for task in sorted({r["task"] for r in results}):
        metric = TASKS[task]["metric"]
        mixes = [m for m in MIXES if any(r["task"] == task and r["mix"] == m for r in results)]
        columns = sorted({(r["mix"], r.get("scenario")) for r in results if r["task"] == task},
                         key=lambda c: (list(MIXES).index(c[0]) if c[0] in MIXES else len(MIXES),
                                        list(SCENARIOS).index(c[1]) if c[1] in SCENARIOS else len(SCENARIOS), c[1] or ""))  # fmt: skip
        traced = any(r.get("trace") for r in results if r["task"] == task)
        labels = run_labels(results)[:-1]
        for x, xlabel in (("t", "wall time (s)"), ("samples", "samples, all peers")):
            rows = 2 if traced and x == "t" else 1
            fig, axes = plt.subplots(rows, len(columns), figsize=(5 * len(columns), 4 + 2 * (rows - 1)), squeeze=False,
                                     sharex="col", gridspec_kw={"height_ratios": [3, 1][:rows]})  # fmt: skip
            for k, (mix, scenario) in enumerate(columns):
                ax = axes[0][k]
                for j, label in enumerate(labels):
                    for i, r in enumerate(r for r in runs_of(results, task, mix, label) if r.get("scenario") == scenario):
                        ax.plot([c[x] for c in r["curve"]], [c[metric] for c in r["curve"]], color=f"C{j % 10}",
                                ls="--" if r["method"].startswith(("sync", "diloco")) else "-", alpha=0.7,
                                label=label if i == 0 else None)
                targets = {r.get("target", TASKS[task]["target"]) for r in results if r["task"] == task and r["method"] != "ideal"}
                for target in targets:
                    ax.axhline(target, color="grey", lw=0.5)
                if scenario and metric == "loss":  # the arena's runs end near a low target: show that end, not the start
                    ax.set_ylim(min(targets) - 0.15, min(targets) + 1.5)
                ax.set_title(f"{task}, {mix} {MIXES.get(mix, '')}" + (f", {scenario}" if scenario else ""))
                ax.set_ylabel(f"median peer held-out {metric}")
                ax.legend(fontsize=7)
                if rows == 2:
                    end = max((r["curve"][-1]["t"] for r in results if r["task"] == task and r["curve"]), default=1.0)
                    _draw_trace(axes[1][k], end, next((r["trace"] for r in results if r["task"] == task and r["mix"] == mix
                                                  and r.get("scenario") == scenario and r.get("trace")), None))
                axes[rows - 1][k].set_xlabel(xlabel)
            fig.tight_layout()
            fig.savefig(out / f"{task}-metric-vs-{'time' if x == 't' else 'samples'}.png", dpi=100)
            plt.close(fig)
        fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
        for ax, mix in zip(axes[0], mixes):
            for j, label in enumerate(labels):
                for i, r in enumerate(r for r in runs_of(results, task, mix, label) if r.get("consensus")):
                    ax.plot([c["t"] for c in r["consensus"]], [c["distance"] for c in r["consensus"]], color=f"C{j % 10}",
                            alpha=0.7, label=label if i == 0 else None)
            ax.set_yscale("log")
            ax.set_title(f"{task}, {mix}: consensus distance")
            ax.set_xlabel("wall time (s)")
            ax.set_ylabel("mean squared distance from the peers' mean")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{task}-consensus.png", dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 4))
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            ys = [statistics.median([r["pct_of_ideal"] for r in runs_of(results, task, m, label)] or [0]) for m in mixes]
            ax.bar([i + width * j for i in range(len(mixes))], ys, width=width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(mixes))], mixes)
        ax.set_ylabel("throughput, fraction of ideal")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{task}-throughput-vs-ideal.png", dpi=100)
        plt.close(fig)


def _draw_trace(ax, end: float, trace: dict | None) -> None:
    """Each peer's slowdown over time (the first seed's trace), a gap while it sleeps, a mark where it leaves or joins."""
    if trace is None:
        ax.set_visible(False)
        return
    spans = Trace.from_json(trace)
    for i, peer in enumerate(trace["peers"]):
        begin, leave = spans.span(i)
        times = [*peer["t"], max(end, peer["t"][-1])]
        for t0, t1, s in zip(times, times[1:], peer["slowdown"]):
            t0, t1 = max(t0, begin), min(t1, leave)
            if s is not None and t1 > t0:  # offset a little, so that peers at one speed stay apart
                ax.hlines(s * (1 + 0.03 * i), t0, t1, color=f"C{i % 10}", lw=1.5, label=f"peer {i}" if t0 == begin else None)
    for e in trace.get("events", []):
        ax.axvline(e["t"], color="k", ls=":", lw=0.8)
        ax.annotate(f"{e['action']} {e['peer']}", (e["t"], 1), fontsize=6, rotation=90, va="bottom")
    ax.set_ylabel("slowdown ×")
    ax.legend(fontsize=6, ncol=3)
