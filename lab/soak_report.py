"""The soak run's targets (issue 32), judged from its samples, and its plots.

Each rule is a pure function of samples, so it is tested on synthetic series
(tests/test_soak_report.py). A series is a list of (seconds since the process started, value).

- memory: after warm-up, a process's RSS never exceeds its first post-warm-up sample by more than 10 %;
- growth (open fds, threads, Trio tasks): over the last 2/3 of a process's post-warm-up life, the
  least-squares line rises by more than max(ABS, 15 % of the window's median) AND the last third's
  median exceeds the first third's by as much; both, so that one burst (a heal, a newcomer) is no leak;
- stall: a process in phase "training" whose sample count does not advance for more than 30 s
  (observed every 2 s, from status.json written by that process);
- checkpoint: every restart from a data dir logs "resumed from" (a readable checkpoint), and no
  process logs "checkpoint unusable";
- loss: the swarm's median held-out loss after warm-up, split into thirds by time: the last third's
  median is below the first third's and not above the middle third's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

Series = Sequence[tuple[float, float]]

MEMORY_TOLERANCE = 0.10
STALL_LIMIT_S = 30.0
GROWTH_RELATIVE = 0.15
GROWTH_ABSOLUTE = {"fds": 8.0, "threads": 3.0, "trio_tasks": 10.0}  # below these a count only jitters
MIN_WINDOW_SAMPLES = 3


@dataclass(frozen=True)
class Verdict:
    """One rule on one process (or on the swarm): whether it held, and why, in one line."""

    ok: bool
    reason: str
    margin: float = 0.0  # how close to failing, comparable within one rule (the summary shows the worst)


def after_warmup(series: Series, warmup_s: float) -> list[tuple[float, float]]:
    """The points at or after `warmup_s` of the process's life, with a value."""
    return [(t, v) for t, v in series if t >= warmup_s and v is not None]


def memory_verdict(rss: Series, warmup_s: float, tolerance: float = MEMORY_TOLERANCE) -> Verdict | None:
    """RSS after warm-up stays within `tolerance` of its first post-warm-up sample; None if fewer than 2 samples."""
    points = after_warmup(rss, warmup_s)
    if len(points) < 2:
        return None
    base, peak = points[0][1], max(v for _, v in points)
    rise = peak / base - 1 if base else 0.0
    return Verdict(
        rise <= tolerance, f"RSS {base / 2**20:.0f} MiB after warm-up, peak {peak / 2**20:.0f} MiB ({rise:+.1%})", rise
    )


def slope(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of value over time (0 for fewer than 2 distinct times)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var if var else 0.0


def growth_verdict(
    series: Series, warmup_s: float, absolute: float, relative: float = GROWTH_RELATIVE
) -> Verdict | None:
    """No growth over the last 2/3 of the post-warm-up life (the module's rule); None if the window is too short."""
    points = after_warmup(series, warmup_s)
    if len(points) < MIN_WINDOW_SAMPLES:
        return None
    start = points[0][0] + (points[-1][0] - points[0][0]) / 3
    window = [p for p in points if p[0] >= start]
    if len(window) < MIN_WINDOW_SAMPLES:
        return None
    span = window[-1][0] - window[0][0]
    rise = slope(window) * span
    third = max(1, len(window) // 3)
    shift = statistics.median(v for _, v in window[-third:]) - statistics.median(v for _, v in window[:third])
    tolerance = max(absolute, relative * statistics.median(v for _, v in window))
    grows = rise > tolerance and shift > tolerance
    reason = (
        f"{rise:+.1f} over {span / 60:.1f} min by its trend, {shift:+.1f} between thirds (tolerance {tolerance:.1f})"
    )
    return Verdict(not grows, reason, min(rise, shift) / tolerance)


def longest_stall(observations: Sequence[tuple[float, str, int]]) -> float:
    """The longest time (s) a process spent in phase "training" between two advances of its sample count.

    `observations`: (time, phase, samples) in time order, taken every few seconds, so a stall reads
    up to one interval long (a bound from above). The clock starts on entering "training" and
    restarts at each advance; the last open interval counts up to the last observation.
    """
    longest, since, last = 0.0, None, None
    for t, phase, samples in observations:
        if phase != "training":
            since, last = None, None
            continue
        if since is None or last is None:
            since, last = t, samples
            continue
        longest = max(longest, t - since)
        if samples > last:
            since, last = t, samples
    return longest


def stall_verdict(longest_s: float, limit: float = STALL_LIMIT_S) -> Verdict:
    return Verdict(longest_s <= limit, f"longest stall {longest_s:.1f} s (limit {limit:g} s)", longest_s)


def checkpoint_verdict(restarts: Sequence[dict]) -> Verdict:
    """Every restart resumed (`resumed` true) and none found an unusable checkpoint (`unusable` false)."""
    lost = [r["process"] for r in restarts if not r.get("resumed") or r.get("unusable")]
    if lost:
        return Verdict(
            False,
            f"{len(lost)} of {len(restarts)} restarts did not resume from a readable checkpoint: {', '.join(lost)}",
        )
    return Verdict(True, f"{len(restarts)} of {len(restarts)} restarts resumed from a readable checkpoint")


def loss_verdict(swarm_loss: Series, warmup_s: float) -> Verdict | None:
    """The swarm's median loss keeps falling (the module's rule); None with fewer than 3 points after warm-up."""
    points = after_warmup(swarm_loss, warmup_s)
    if len(points) < 3:
        return None
    t0, t1 = points[0][0], points[-1][0]
    cut1, cut2 = t0 + (t1 - t0) / 3, t0 + 2 * (t1 - t0) / 3
    thirds = [
        [v for t, v in points if t < cut1],
        [v for t, v in points if cut1 <= t < cut2],
        [v for t, v in points if t >= cut2],
    ]
    if not all(thirds):
        return None
    first, middle, last = (statistics.median(values) for values in thirds)
    ok = last < first and last <= middle
    return Verdict(ok, f"median loss by thirds after warm-up: {first:.3f}, {middle:.3f}, {last:.3f}")


def judge(results: dict, warmup_s: float) -> dict[str, dict]:
    """Every target over a finished run's results (`lab.soak`'s document): {target: {ok, reasons}}.

    A target with nothing to judge (no process lived past warm-up) is not ok: a soak that measured
    nothing passed nothing.
    """
    per_process: dict[str, list[tuple[str, Verdict]]] = {
        "memory": [],
        "fds": [],
        "threads": [],
        "trio_tasks": [],
        "stall": [],
    }
    for proc in results["processes"]:
        samples = [s for s in results["samples"] if s["process"] == proc["name"]]
        age = {
            key: [(s["age_s"], s[key]) for s in samples if s.get(key) is not None]
            for key in ("rss_bytes", *GROWTH_ABSOLUTE)
        }
        if (v := memory_verdict(age["rss_bytes"], warmup_s)) is not None:
            per_process["memory"].append((proc["name"], v))
        for key in ("fds", "threads", "trio_tasks"):
            if (v := growth_verdict(age[key], warmup_s, GROWTH_ABSOLUTE[key])) is not None:
                per_process[key].append((proc["name"], v))
        per_process["stall"].append((proc["name"], stall_verdict(proc["longest_stall_s"])))
    out = {}
    for target, verdicts in per_process.items():
        failed = [f"{name}: {v.reason}" for name, v in verdicts if not v.ok]
        judged = len(verdicts)
        out[target] = {
            "ok": judged > 0 and not failed,
            "reasons": failed
            or ([f"{judged} processes judged; worst {_worst(verdicts)}"] if judged else ["nothing judged"]),
        }
    checkpoint = checkpoint_verdict(results["restarts"])
    out["checkpoint"] = {"ok": checkpoint.ok, "reasons": [checkpoint.reason]}
    loss = loss_verdict([(p["t"], p["median_loss"]) for p in results["swarm"]], warmup_s)
    out["loss"] = {
        "ok": bool(loss and loss.ok),
        "reasons": [loss.reason if loss else "too few loss points after warm-up"],
    }
    return out


def _worst(verdicts: list[tuple[str, Verdict]]) -> str:
    name, verdict = max(verdicts, key=lambda nv: nv[1].margin)
    return f"{name}: {verdict.reason}"


def summary_lines(results: dict, checks: dict[str, dict]) -> list[str]:
    """The printed summary: the run in one line, then one line per target (PASS/FAIL and why)."""
    events: dict[str, int] = {}
    for e in results["events"]:
        events[e["kind"]] = events.get(e["kind"], 0) + 1
    head = (f"soak: {results.get('elapsed_s', results['config']['duration']):g} s, {len(results['processes'])} processes, "
            f"events {', '.join(f'{k} {n}' for k, n in sorted(events.items())) or 'none'}")  # fmt: skip
    swarm = results["swarm"]
    if swarm:
        losses = [p["median_loss"] for p in swarm if p["median_loss"] is not None] or [float("nan")]
        head += f"; median loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        head += f", {swarm[-1]['merges']} merges (every process's count, as last sampled)"
    lines = [head]
    for target, verdict in checks.items():
        lines.append(f"  {'PASS' if verdict['ok'] else 'FAIL'} {target}: {'; '.join(verdict['reasons'][:4])}")
    return lines


def plot(results: dict, path: Path) -> None:
    """Per-process RSS, fds, threads, Trio tasks and checkpoint size, and the swarm's loss and merges,
    over run time, with the churn events as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("rss_bytes", "RSS (MiB)", 2**20), ("fds", "open fds", 1), ("threads", "threads", 1),
              ("trio_tasks", "Trio tasks", 1), ("checkpoint_bytes", "checkpoints (MiB)", 2**20)]  # fmt: skip
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, panels):
        for proc in results["processes"]:
            points = [
                (s["t"] / 60, s[key] / scale)
                for s in results["samples"]
                if s["process"] == proc["name"] and s.get(key) is not None
            ]
            if points:
                ax.plot(*zip(*points), marker=".", linewidth=1, label=proc["name"])
        ax.set_ylabel(label)
    ax = axes.flat[5]
    swarm = [(p["t"] / 60, p["median_loss"]) for p in results["swarm"] if p["median_loss"] is not None]
    if swarm:
        ax.plot(*zip(*swarm), color="black", label="median held-out loss")
    ax.set_ylabel("median held-out loss")
    merges = ax.twinx()
    merges.plot(
        [p["t"] / 60 for p in results["swarm"]],
        [p["merges"] for p in results["swarm"]],
        color="tab:green",
        linestyle="--",
    )
    merges.set_ylabel("merges (all processes)", color="tab:green")
    for ax in axes.flat:
        for e in results["events"]:
            ax.axvline(e["t"] / 60, color="grey", alpha=0.3, linewidth=0.8)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle("Murmur soak: per-process resources, swarm loss; grey lines are churn events")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
