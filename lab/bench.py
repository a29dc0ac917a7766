"""Heterogeneous-swarm benchmark: Murmur gossip vs synchronous all-reduce, in one run.

For each task, seed and speed mix the methods run back to back (interleaved, so
machine drift hits all alike) on the same emulated hardware (sleep-based slowdowns,
one torch thread per peer):

  sync-equal         real torch.distributed (gloo) all-reduce, equal batches
  sync-proportional  the same, batches proportional to speed, sample-weighted
  sync-adaptive      sync-proportional re-measuring speeds and re-splitting the batch every 10 steps
  diloco             synchronous DiLoCo: H local steps per rank, then an int8 gloo all-reduce of the
                     pseudo-gradients and an outer Nesterov step (equal H everywhere)
  diloco-proportional  DiLoCo with each rank's H in proportion to its measured speed
  murmur-uniform     `murmur run` processes over libp2p (forked from a preloaded server), plain
                     pairwise averaging (`--merge average`), uniform merge weights
  murmur-work        the same with work weighting
  murmur             `murmur run` as it comes: its default configuration
  ideal              every peer alone at once (no exchanges), for a few seconds: Σ standalone speeds
  solo               every peer alone to the target, same pacing: `vs solo` divides the fastest peer's
                     own time to target by each method's (the median peer's is beside it)
  headroom           sync-equal on as many peers as fast as the fastest: the data-parallel headroom,
                     how much sooner the task lets that many peers reach the target than one alone

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
    murmur bench --scenario drift,churn     # the arena (ARENA): speeds that change, peers that come and go
    murmur bench --trace FILE               # the arena under a speed trace file (`lab.traces`)
    murmur bench --long-horizon             # the slow-link arena (LONG_HORIZON, root): 10 min a run

Under a trace (`--scenario`, `--trace`) every peer and rank follows it; sleeps, leaves, crashes and joins
are played on the processes (`lab.trace_driver`), and the synchronous baselines run as elastic jobs
under churn (`lab.elastic`). See docs/arena.md.

Slow links (`--link-mbit`, `lab.links`): every Murmur peer and every sync or diloco rank runs in its
own network namespace on a veth pair capped with `tc tbf`; the peers listen on their namespace's address and
bootstrap to peer 0's, the ranks' gloo binds to the capped veth. Each run builds its namespaces and removes
them (with every process in them) when it ends, fails or is interrupted. Peers and ranks fork from the
preloaded server, as on loopback, and enter their namespace themselves; start-up stays excluded.

CPU quotas (`lab.cpu_quota`, as root): every peer and rank of a run gets its own cgroup with an equal share of the
machine's cores (2 cores, 4 peers: half a core each), so that a peer pays for its own exchanges, as on a machine of
its own. Without root (or with `--no-cpu-quotas`) they share the cores, and the summary says so.

The command line is `bench_cli`.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import os
import time
from contextlib import nullcontext
from pathlib import Path

from lab import cpu_quota
from lab.bench_config import MIXES, MURMUR_ARGS, REFERENCES, TASKS
from lab.bench_murmur import run_murmur
from lab.bench_report import base_lr, equal_samples, report, score
from lab.links import LinkSpecError, LinksUnavailable, caps_for, links_unavailable_reason, peer_links
from lab.progress import Progress
from lab.swarm import FORK_PRELOAD
from lab.sync_baseline import RANK_MODULE, run_sync
from lab.traces import Trace, scenario
from lab.traces import load as load_trace
from lab.traces import static as static_trace
from murmur.node.learn.weight_average import DEFAULT_DECAY

LINK_PG_TIMEOUT_S = 900.0  # over capped links one all-reduce of the whole model can take minutes


def run_method(
    task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float | None = None,
    link_mbit: list[float] | None = None, ema_decay: float = 0.0, min_samples: int = 0, trace: Trace | None = None,
    target: float | None = None, local_steps: int | None = None, same_init: bool = False, cpu_cores: float | None = None,
) -> dict:
    """Run one method (or a reference: ideal, solo, headroom) on the task's workload at `lr_scale` (default: the
    task's chosen scale; headroom's is sync-equal's).

    A run that reaches `target` (default: the task's) trains on until `min_samples` (where methods are
    compared), within `max_s`. Every method evaluates a moving average of its weights with `ema_decay`
    (0: the live model). With `trace` (`lab.traces`) every peer or rank follows it; `slowdowns` are then
    its initial ones. DiLoCo methods sync every `local_steps` steps (default: the task's). With `same_init`
    every peer and rank starts from the task's seeded model instead of receiving it over the links.

    With `link_mbit` (one cap per peer) the run gets its own capped namespaces (`lab.links.peer_links`),
    removed when it ends; the result records the caps under "link_mbit" (None on loopback). With `cpu_cores`
    every peer and rank runs on a CPU quota of that many cores of its own (`lab.cpu_quota`), recorded as "cpu_quota".
    """
    spec = TASKS[task]
    scale = spec["lr_scale"].get("sync-equal" if method == "headroom" else method, 1.0) if lr_scale is None else lr_scale
    target = spec["target"] if target is None else target
    # Peers that never exchange, and the headroom (a property of the task), run on loopback.
    link_mbit = None if method in ("solo", "headroom") else link_mbit
    with cpu_quota.quotas(cpu_cores), peer_links(link_mbit) if link_mbit else nullcontext() as links:
        if method == "headroom":
            result = run_sync(task, [min(slowdowns)] * len(slowdowns), "equal", max_s, spec["step_time"], target,
                              spec.get("eval_every", 1.0), seed=seed, lr_scale=scale, ema_decay=ema_decay, work_dir=root)
            result["method"] = "headroom"
        elif method == "solo":
            result = run_murmur(task, slowdowns, method, seed, max_s, root, scale, ema_decay=ema_decay, trace=trace,
                                target=target)
        elif method == "ideal":
            result = run_murmur(task, slowdowns, method, seed, max(6.0, 2 * spec.get("eval_every", 1.0)), root, links=links,
                                ema_decay=ema_decay, trace=trace and static_trace([trace.peers[i].slowdown_at(0.0) or 1.0 for i in trace.initial()]))
        elif method in MURMUR_ARGS:
            # An exchange over the slowest link is given the time it needs; a peer that starts from the task's
            # seeded model (`same_init`) pulls none.
            flags = [*(["--min-link-mbit", f"{min(link_mbit):g}"] if link_mbit else []), *(["--no-state-sync"] if same_init else [])]
            result = run_murmur(task, slowdowns, method, seed, max_s, root, scale, links=links, ema_decay=ema_decay,
                                min_samples=min_samples, trace=trace, target=target, peer_flags=flags)
        else:  # the synchronous baselines: their ranks run one thread each, like the peers
            result = run_sync(task, slowdowns, method.removeprefix("sync-"), max_s, spec["step_time"], target,
                              spec.get("eval_every", 1.0), seed=seed, lr_scale=scale,
                              local_steps=local_steps or spec["local_steps"], min_samples=min_samples, ema_decay=ema_decay,
                              links=links, work_dir=root, trace=trace, broadcast_init=not same_init,
                              pg_timeout_s=LINK_PG_TIMEOUT_S if link_mbit else 60.0)
    result["lr_scale"] = scale
    result["ema_decay"] = ema_decay
    result["lr"] = base_lr(task) * scale  # as trained: a later change to the task's rate leaves the record right
    result["link_mbit"] = link_mbit
    result["cpu_quota"] = cpu_cores
    if trace is not None:
        result["trace"] = trace.to_json()
    return result


def run_bench(config: dict, out: Path) -> dict:
    """Run `config` (DEFAULT, QUICK, SWEEP, SLOW_LINK or alike) and report it under `out`; return the report.

    A config with "link_mbit" runs over capped links; raises `LinksUnavailable` (before running anything)
    when this machine cannot build them, `LinkSpecError` when the caps do not fit a mix.
    """
    quota_off = "turned off (--no-cpu-quotas)" if config.get("cpu_quotas") is False else cpu_quota.unavailable_reason()
    if config.get("link_mbit"):
        for task in config["tasks"]:  # a wrong spec is an error with or without namespaces
            for mix in (m for m in config["mixes"][task] if m in MIXES):  # a trace file's peers are checked as it runs
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
    total = sum(len(config["seeds"]) * len(config["mixes"][t]) * len(task_runs(t, config)) * len(config.get("scenarios") or [None])
                for t in config["tasks"])  # fmt: skip
    with Progress(total=total, label="murmur bench") as progress:
        for task in config["tasks"]:
            _bench_task(task, config, task_runs(task, config), out, progress, results, quota_off)
    return report({"config": config, "results": results, "wall_s": time.monotonic() - bench_began}, out)


def task_runs(task: str, config: dict) -> list[tuple[str, float | None, int | None]]:
    """The (method, learning-rate scale, DiLoCo H) runs `config` has on `task`, the references first (None: the
    task's choice): its "references" (default all of `REFERENCES`), solo unless `config` names its own solo runs.

    A config with "lr_factors" (the sweep) runs each of its runs at each factor times its scale; one with
    "local_steps" runs each DiLoCo method at each of those H, else at its "tuned_local_steps" if given.
    """
    runs = [(m, s) for m, s in config["runs"]]
    if factors := config.get("lr_factors"):
        chosen = TASKS[task]["lr_scale"]
        runs = [(m, (chosen.get(m, 1.0) if s is None else s) * f) for f in factors for m, s in runs]
    grid, tuned = config.get("local_steps"), config.get("tuned_local_steps", {})  # tuned None: the task's H
    named = {m for m, _ in runs}
    return [*((m, None, None) for m in config.get("references", REFERENCES) if m not in named),
            *((m, s, h) for m, s in runs for h in ((grid or [tuned.get(m)]) if m.startswith("diloco") else [None]))]


def scenarios(task: str, mix: str, seed: int, config: dict) -> list[tuple[str | None, Trace | None]]:
    """The (scenario name, trace) pairs `config` runs for one task, mix and seed: its named scenarios over the
    task's horizon (seeded by `seed`), or its trace file (named by its stem); without either, the plain mix (None, None)."""
    if path := config.get("trace_file"):
        return [(Path(path).stem, load_trace(Path(path)))]
    horizon = config.get("horizon_s", {}).get(task, config["max_s"][task])
    return [(name, scenario(name, MIXES[mix], horizon, seed)) for name in config.get("scenarios", [])] or [(None, None)]


def _label(method: str, scale: float | None, local_steps: int | None) -> str:
    return method + ("" if scale is None else f"@lr×{scale:g}") + ("" if local_steps is None else f" H={local_steps}")


def _bench_task(
    task: str, config: dict, runs: list, out: Path, progress: Progress, results: list[dict], quota_off: str | None,
) -> None:
    """Run every seed, mix and scenario of `task`, method by method (interleaved), appending to `results` and saving them.

    Every peer and rank gets an equal share of the machine's cores unless `quota_off` says why it cannot.
    """
    target = config.get("target", {}).get(task, TASKS[task]["target"])
    for seed in config["seeds"]:
        for mix in config["mixes"][task]:
            for name, trace in scenarios(task, mix, seed, config):
                slowdowns = [p.slowdown_at(0.0) or 1.0 for p in trace.peers] if trace else MIXES[mix]
                max_s = config["max_s"][task]
                count = len(trace.peers) if trace else len(slowdowns)
                caps = caps_for(config["link_mbit"], count) if config.get("link_mbit") else None
                cores = None if quota_off else (os.cpu_count() or 1) / count
                group: list[dict] = []
                # The ideal is calibrated for every seed, next to the runs it is compared with.
                for method, scale, h in runs:
                    label = _label(method, scale, h)
                    print(f"[bench] {task} seed {seed} {mix}{f' {name}' if name else ''} {slowdowns}{f' links {caps} Mbit/s' if caps else ''}: {label}", flush=True)
                    progress.start(f"{task} {mix}{f' {name}' if name else ''} seed {seed}: {label}")
                    began = time.monotonic()
                    r = run_method(task, slowdowns[: len(trace.initial())] if trace else slowdowns, method, seed, max_s,
                                   out / "runs" / f"{task}-{mix}{f'-{name}' if name else ''}-s{seed}-{label.replace(' ', '-')}", scale, caps,
                                   config.get("ema_decay", DEFAULT_DECAY), trace=trace, target=target, local_steps=h,
                                   same_init=config.get("same_init", False), cpu_cores=cores,
                                   min_samples=equal_samples(task, group, config.get("reference", "sync-equal")) or 0)
                    r.update(mix=mix, scenario=name, seed=seed, label=label, run_wall_s=time.monotonic() - began,  # start-up and teardown included
                             cpu_quota_off=quota_off)
                    group.append(r)
                    progress.advance()
                for g in score(group, config.get("reference", "sync-equal")):
                    vs_solo = f"{g['vs_solo']:.2f}x" if g.get("vs_solo") else "-"
                    print(f"  {g['label']:18s} ttt={g.get('time_to_target') if g['method'] != 'ideal' else '-'} vs solo={vs_solo} "
                          f"(ideal {g['ideal_vs_solo']:.2f}x) samples/s={g['samples_per_s']:.0f} ({(g['pct_of_ideal'] or 0):.0%} of ideal throughput) "
                          f"max idle={max(p['idle_fraction'] for p in g['peers']):.1%} {TASKS[task]['metric']} at equal samples={g['metric_at_equal_samples']}", flush=True)
                results += group
                (out / "results.json").write_text(json.dumps({"config": config, "results": results}, indent=1))
