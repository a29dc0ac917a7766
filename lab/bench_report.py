"""Scoring and reporting for `murmur bench`: vs solo, % of ideal throughput, metric at equal samples, the
data-parallel headroom, the summary table, the learning-rate choice of a sweep, plots; `rescore` redoes them
from a stored results.json."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

from lab.bench_config import METHODS, MIXES, MURMUR_ARGS, TASKS
from lab.bench_plots import plot, run_labels, runs_of
from lab.traces import SCENARIOS, Trace


def metric_at_samples(result: dict, metric: str, samples: float) -> float | None:
    """The metric when the run had processed `samples` in all (linear between evaluations), or None beyond its end."""
    curve = result["curve"]
    for before, after in itertools.pairwise(curve):
        if before["samples"] <= samples <= after["samples"]:
            span = after["samples"] - before["samples"]
            share = (samples - before["samples"]) / span if span else 1.0
            return before[metric] + share * (after[metric] - before[metric])
    return None


def equal_samples(task: str, group: list[dict], reference: str = "sync-equal") -> int | None:
    """Where one task, seed, mix and scenario's runs are compared: the task's fixed `equal_samples`; else as many
    samples as the `reference` method needed to reach its target (in a sweep, its best-tuned run's). None while
    no reference ran.

    The bench passes it to each run as it goes (the reference runs first), so that a faster method trains on to it.
    """
    budget = TASKS[task].get("equal_samples")
    if budget is None:
        syncs = [g for g in group if g["method"] == reference and g["curve"]]
        best = min(syncs, key=lambda g: g.get("time_to_target") or float("inf"), default=None)
        budget = best["curve"][-1]["samples"] if best else None
    return budget


def score(group: list[dict], reference: str = "sync-equal") -> list[dict]:
    """Add vs solo, % of ideal and the metric at equal samples to one task, seed, mix and scenario's runs (ideal first).

    `vs_solo` is the fastest solo peer's own time to target over the run's, `vs_median_solo` the median solo
    peer's over it (None without a solo run, or where either did not reach the target), `ideal_vs_solo` the
    run's Σ speeds over its fastest peer's: the most `vs_solo` a perfect swarm of those peers could reach.
    The ideal runs every peer alone at its initial speed; under a changing trace a run's ideal is that
    measured rate times the trace's ideal work over the run (`Trace.ideal_work`) per its initial rate.
    """
    metric = TASKS[group[0]["task"]]["metric"]
    ideal = next(g["samples_per_s"] for g in group if g["method"] == "ideal")
    solo = next((g for g in group if g["method"] == "solo"), {})
    budget = equal_samples(group[0]["task"], group, reference)  # a method that stopped before it has no reading
    for g in group:
        g.setdefault("label", g["method"])
        rate = ideal * _trace_factor(g) if ideal else None
        g["pct_of_ideal"] = g["samples_per_s"] / rate if rate else None
        g["metric_at_equal_samples"] = metric_at_samples(g, metric, budget) if budget and g["method"] != "ideal" else None
        ttt = g.get("time_to_target") if g["method"] != "ideal" else None
        g["vs_solo"] = solo["time_to_target"] / ttt if ttt and solo.get("time_to_target") else None
        g["vs_median_solo"] = solo["median_solo_time"] / ttt if ttt and solo.get("median_solo_time") else None
        speeds = [1 / s for s in g.get("slowdowns") or MIXES.get(g["mix"], []) if s]
        g["ideal_vs_solo"] = sum(speeds) / max(speeds) if speeds else None
    return group


def _trace_factor(result: dict) -> float:
    """A run's ideal rate over its trace, per the ideal rate at the trace's start (1 without a trace)."""
    if not result.get("trace") or not result["curve"] or result["method"] == "ideal":
        return 1.0
    trace = Trace.from_json(result["trace"])
    end = result["curve"][-1]["t"]
    at_start = sum(1 / (trace.peers[i].slowdown_at(0.0) or math.inf) for i in trace.initial())
    return trace.ideal_work(end) / end / at_start if end > 0 and at_start > 0 else 1.0


def report(run: dict, out: Path) -> dict:
    """Write `run`'s results.json, summary.md and plots under `out`, print the summary, return `run`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(run, indent=1))
    summary = summarize(run["results"]) + f"\nBenchmark wall time: {run['wall_s'] / 60:.1f} min ({len(run['results'])} runs).\n"
    if run["config"].get("sweep"):  # its verdict is what the default run should use
        run["chosen_lr_scale"] = chosen = choose_lr(run["results"])
        summary += "\nBest learning rate (median time to target, then metric at equal samples): " + "; ".join(
            f"{task} {method} {run_lr(next(r for r in run['results'] if (r['task'], r['method'], r['lr_scale']) == (task, method, scale))):.3g} "
            f"(×{scale:g}{_edge(run['results'], task, method, scale)})" for task, picks in chosen.items() for method, scale in picks.items()
        ) + ".\n"
        (out / "results.json").write_text(json.dumps(run, indent=1))
    (out / "summary.md").write_text(summary)
    plot(run["results"], out)
    print(summary)
    return run


def _edge(results: list[dict], task: str, method: str, scale: float) -> str:
    """", at the grid's edge" when no swept rate of the method lies beyond `scale` on one side: sweep on that way."""
    swept = {r["lr_scale"] for r in results if (r["task"], r["method"]) == (task, method)}
    return ", at the grid's edge" if len(swept) > 1 and scale in (min(swept), max(swept)) else ""


def rescore(results_file: Path, out: Path) -> dict:
    """Score an earlier run's results again (after a change to the scoring) and report them under `out`."""
    run = json.loads(results_file.read_text())
    groups: dict[tuple, list[dict]] = {}
    for r in run["results"]:
        groups.setdefault((r["task"], r["seed"], r["mix"], r.get("scenario")), []).append(r)
    for group in groups.values():
        score(group, run["config"].get("reference", "sync-equal"))
    return report(run, out)


def _med(values: list[float], digits: int = 2) -> str:
    """Median and (min–max) of the seeds' values."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    f = f".{digits}f"
    return format(statistics.median(values), f) + (f" ({min(values):{f}}–{max(values):{f}})" if len(values) > 1 else "")


def base_lr(task: str) -> float:
    """The learning rate the task's own optimizer starts with (its first parameter group's)."""
    from murmur.node.learn.tasks import load_task

    spec = load_task(task)
    return spec.make_optimizer(spec.build_model()).param_groups[0]["lr"]


def run_lr(result: dict) -> float:
    """The learning rate a run trained with: recorded since runs store it, else the task's current one × its scale."""
    return result["lr"] if "lr" in result else base_lr(result["task"]) * result["lr_scale"]


def _links_line(results: list[dict]) -> list[str]:
    """The line naming the link caps of runs over slow links (none on loopback)."""
    caps = list(dict.fromkeys(tuple(r["link_mbit"]) for r in results if r.get("link_mbit")))
    if not caps:
        return []
    named = "; ".join(", ".join(f"{c:g}" for c in cap) for cap in caps)
    return [f"Links capped at {named} Mbit/s (per peer, in peer order; tc tbf, one network namespace per peer and rank).", ""]


def _quota_line(results: list[dict]) -> list[str]:
    """The line saying whether every peer and rank had a CPU quota of its own (none for runs recorded before quotas)."""
    if not any("cpu_quota" in r for r in results):
        return []
    cores = sorted({r["cpu_quota"] for r in results if r.get("cpu_quota")})
    if cores:
        said = ", ".join(f"{c:.3g}" for c in cores)
        return [f"Every peer and rank ran on a CPU quota of its own: {said} cores (cgroups, `lab.cpu_quota`).", ""]
    reasons = sorted({r.get("cpu_quota_off") or "off" for r in results})
    return [f"No CPU quotas ({'; '.join(reasons)}): the peers and ranks shared the machine's cores, so one's exchanges "
            "could slow another.", ""]


def _evaluated_line(results: list[dict]) -> list[str]:
    """The line saying which weights the methods evaluated (none for runs recorded before the choice existed)."""
    decays = sorted({r["ema_decay"] for r in results if "ema_decay" in r})
    if not decays:
        return []
    said = "; ".join("its live weights" if d == 0 else f"a moving average of its weights, decay {d:g}" for d in decays)
    return [f"Every method evaluated {said} (`--ema-decay`).", ""]


BASELINES = ("sync-", "diloco")  # the prefixes of the synchronous methods' names


def summarize(results: list[dict]) -> str:
    """The markdown table: one row per task, mix, scenario (runs under traces only) and method, medians over seeds
    with their range. Under traces it adds the ratio to the best baseline of each seed, bytes sent and restarts."""
    arena = any(r.get("scenario") for r in results)
    head = ["task", "mix", *(["scenario"] if arena else []), "method", "time to target s", "vs solo", "vs median solo",
            "ideal vs solo", "vs sync-equal", *(["vs best baseline", "samples to target k"] if arena else []), "samples/s",
            "% of ideal throughput", "max peer idle", "metric at equal samples",
            *(["MB sent", "restarts (downtime s)"] if arena else []), "lr"]  # fmt: skip
    lines = _links_line(results) + _quota_line(results) + _evaluated_line(results) + [
        "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = sorted({(r["task"], r["mix"], r.get("scenario")) for r in results},
                  key=lambda k: (k[0], list(MIXES).index(k[1]) if k[1] in MIXES else len(MIXES),
                                 list(SCENARIOS).index(k[2]) if k[2] in SCENARIOS else len(SCENARIOS), k[2] or ""))  # fmt: skip
    for task, mix, scenario in keys:
        for label in run_labels(results):
            rs = [r for r in runs_of(results, task, mix, label) if r.get("scenario") == scenario]
            if not rs:
                continue
            same = [r for r in results if (r["task"], r["mix"], r.get("scenario")) == (task, mix, scenario)]
            scale = rs[0].get("lr_scale")
            cells = [task, mix, *([scenario] if arena else []), label,
                     _med([r.get("time_to_target") for r in rs]) if label != "ideal" else "—",
                     _med([r.get("vs_solo") for r in rs]), _med([r.get("vs_median_solo") for r in rs]),
                     _med([r.get("ideal_vs_solo") for r in rs]),
                     _med(_ratios(rs, same, lambda b: b["method"] == "sync-equal"))]  # fmt: skip
            if arena:
                cells += [_med(_ratios(rs, same, lambda b: b["method"].startswith(BASELINES))),
                          _med([_samples_to_target(r) for r in rs], 1)]
            cells += [_med([r["samples_per_s"] for r in rs]), _med([r["pct_of_ideal"] for r in rs]),
                      _med([max(p["idle_fraction"] for p in r["peers"]) for r in rs]),
                      _med([r.get("metric_at_equal_samples") for r in rs], 3)]  # fmt: skip
            if arena:
                cells += [_med([sum(p.get("bytes_sent") or 0 for p in r["peers"]) / 1e6 for r in rs], 1), _restarts(rs)]
            cells.append(f"{run_lr(rs[0]):.3g} (×{scale:g})" if scale and label != "ideal" else "—")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + _headroom_lines(results)


def _headroom_lines(results: list[dict]) -> str:
    """The data-parallel headroom of each task and mix: how much sooner sync all-reduce on as many peers as fast as
    the fastest reached the target than that peer alone (the headroom run's `vs_solo`), against the peer count."""
    lines = []
    for task, mix in sorted({(r["task"], r["mix"]) for r in results if r["method"] == "headroom"}):
        runs = [r for r in results if (r["task"], r["mix"], r["method"]) == (task, mix, "headroom")]
        lines.append(f"- {task} {mix}: {_med([r.get('vs_solo') for r in runs])}× sooner on {len(runs[0]['peers'])} peers "
                     f"(seeds {', '.join(_times(r) for r in runs)})")
    if not lines:
        return ""
    return ("\nData-parallel headroom (sync all-reduce on N peers as fast as the fastest, against that peer alone; "
            "at most N×):\n" + "\n".join(lines) + "\n")


def _times(run: dict) -> str:
    """A headroom run's seed and its ratio, or what it lacked."""
    return f"{run['seed']}: {run['vs_solo']:.2f}×" if run.get("vs_solo") else f"{run['seed']}: not reached"


def _ratios(runs: list[dict], same: list[dict], is_base) -> list[float]:
    """Each run's time to target over the best time of the baselines `is_base` picks in its seed (none: no ratio)."""
    out = []
    for r in runs:
        base = min((b["time_to_target"] for b in same if b["seed"] == r["seed"] and is_base(b) and b.get("time_to_target")), default=None)
        if r["method"] != "ideal" and base and r.get("time_to_target"):
            out.append(r["time_to_target"] / base)
    return out


def _samples_to_target(run: dict) -> float | None:
    """Thousands of samples all peers had trained when the run reached its target (None if it did not)."""
    ttt = run.get("time_to_target")
    if ttt is None:
        return None
    return next((c["samples"] / 1000 for c in run["curve"] if c["t"] >= ttt), None)


def _restarts(runs: list[dict]) -> str:
    """The median number of restarts and their median total downtime over seeds ("—" for a method that never restarts)."""
    if not any("restarts" in r for r in runs):
        return "—"
    counts = [len(r.get("restarts", [])) for r in runs]
    downtime = [sum(x["downtime_s"] for x in r.get("restarts", [])) for r in runs]
    return f"{statistics.median(counts):g} ({statistics.median(downtime):.1f})"


def choose_lr(results: list[dict]) -> dict[str, dict[str, float]]:
    """Per task and swept method, the scale with the best median time to target (then metric at equal samples)."""
    chosen: dict[str, dict[str, float]] = {}
    for task in sorted({r["task"] for r in results}):
        higher = TASKS[task]["higher"]
        swept = {r["method"] for r in results if r["task"] == task and r["method"] != "ideal"}
        for method in [m for m in ["solo", *METHODS, *MURMUR_ARGS] if m in swept]:
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
