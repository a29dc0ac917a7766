"""`murmur bench`'s plots, per task: the metric against wall time and against samples, the
consensus distance of Murmur's peers, and throughput as a fraction of the ideal."""

from __future__ import annotations

import statistics
from pathlib import Path

from lab.bench_config import MIXES, TASKS


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
        labels = run_labels(results)[:-1]
        for x, xlabel in (("t", "wall time (s)"), ("samples", "samples, all peers")):
            fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes), 4), squeeze=False)
            for ax, mix in zip(axes[0], mixes):
                for j, label in enumerate(labels):
                    for i, r in enumerate(runs_of(results, task, mix, label)):
                        ax.plot([c[x] for c in r["curve"]], [c[metric] for c in r["curve"]], color=f"C{j % 10}",
                                ls="--" if r["method"].startswith(("sync", "diloco")) else "-", alpha=0.7,
                                label=label if i == 0 else None)
                ax.axhline(TASKS[task]["target"], color="grey", lw=0.5)
                ax.set_title(f"{task}, {mix} {MIXES[mix]}")
                ax.set_xlabel(xlabel)
                ax.set_ylabel(f"median peer held-out {metric}")
                ax.legend(fontsize=7)
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
