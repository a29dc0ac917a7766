"""One Murmur swarm of the benchmark (`murmur bench`): peers forked from the preloaded server, started
together, following the run's speed trace, stopped at the target; and what it measured."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from lab.bench_config import MURMUR_ARGS, TASKS
from lab.netns import Netns
from lab.peer import PARAMS_FILE
from lab.swarm import LOG_FILE, Peer, free_port, peer_id, start_peer, stop_swarm
from lab.trace_driver import TraceDriver
from lab.traces import Trace
from lab.traces import static as static_trace
from murmur.node.learn.tasks.task import Metric
from murmur.node.ops.node_status import NodeStatus

TRACE_FILE = "trace.json"  # the run's speed trace, in its directory, for every peer to follow
START_MARGIN_S = 0.3  # from the start file's writing to the start time it holds: every peer reads it in time




def _metric(spec: dict) -> Metric:
    """The metric a bench task is judged by, from its `TASKS` entry."""
    return Metric(spec["metric"], spec["higher"])


def run_murmur(
    task: str, slowdowns: list[float], method: str, seed: int, max_s: float, root: Path, lr_scale: float = 1.0,
    links: list[Netns] | None = None, ema_decay: float = 0.0, min_samples: int = 0, trace: Trace | None = None,
    target: float | None = None, peer_flags: list[str] | None = None,
) -> dict[str, Any]:
    """Run one swarm of Murmur `method` (or, with `method` "ideal" or "solo", lone peers); return its results.

    The run ends at `max_s`, or once the median peer reached `target` (default: the task's) with
    `min_samples` trained; a solo run once the median of the peers' own times to target is known.

    Peers join first; once every peer is ready (status phase "waiting", knowing all the
    others) the start file tells them all one start time, t=0 of the run. With `links`
    (one namespace per peer) peer i runs in `links[i]`, listening on its address. With `trace`
    (`lab.traces`), peer i is the trace's peer i: it paces by its slowdowns, sleeps stopped, and
    leaves, crashes or joins when the trace says (`lab.trace_driver`); `slowdowns` are then its initial ones.
    `peer_flags`: more `murmur run` flags for every peer.
    """
    spec = TASKS[task]
    target = spec["target"] if target is None else target
    shutil.rmtree(root, ignore_errors=True)  # a peer would resume from an earlier run's checkpoint
    root.mkdir(parents=True)
    trace = trace or static_trace(slowdowns)
    (root / TRACE_FILE).write_text(json.dumps(trace.to_json()))
    count = len(trace.peers)
    ports = [free_port() for _ in range(count)]
    dirs = [root / f"peer-{i}" for i in range(count)]
    start_file = root / "start-at"
    hosts = [ns.address for ns in links] if links else ["127.0.0.1"] * count
    peers: dict[int, Peer] = {}
    alone = method in ("ideal", "solo")

    def start(i: int) -> Peer:
        extra = [
            "--task", task, "--step-time", str(spec["step_time"]), "--duration", str(max_s),
            "--start-file", str(start_file), "--shard", str(1000 * seed + i), "--record-params", "--log-level", "INFO",
            "--lr-scale", str(lr_scale), "--eval-every", str(spec.get("eval_every", 1.0)), "--ema-decay", str(ema_decay),
            "--trace", str(root / TRACE_FILE), "--trace-peer", str(i), *(peer_flags or []),
        ]
        if alone:
            extra += ["--average-every", "1e9"]  # no bootstrap, no exchanges
        else:
            extra += MURMUR_ARGS[method]
        present = [j for j, p in peers.items() if p.alive()] or list(peers)  # a joiner's bootstrap must still be there
        bootstrap = f"/ip4/{hosts[present[0]]}/tcp/{ports[present[0]]}/p2p/{peer_id(dirs[present[0]])}" if present else None
        peers[i] = start_peer(
            i, root, trace.peers[i].slowdown_at(0.0) or 1.0, extra, None if alone else bootstrap, fork=True,
            data_dir=dirs[i], listen=f"/ip4/{hosts[i]}/tcp/{ports[i]}", netns=links[i] if links else None,
        )  # fmt: skip
        return peers[i]

    for i in trace.initial():
        start(i)
    driver: TraceDriver | None = None
    try:
        joined = time.monotonic()
        # Peers in namespaces pull the model over their capped links.
        _wait_until_ready(list(peers.values()), others=0 if alone else len(peers) - 1, timeout=180.0 if links else 60.0)
        start_at = time.time() + START_MARGIN_S
        (root / "start-at.tmp").write_text(repr(start_at))
        (root / "start-at.tmp").replace(start_file)
        startup_s = time.monotonic() - joined + START_MARGIN_S
        driver = TraceDriver(trace, start_at, {i: p.process for i, p in peers.items()}, lambda i: start(i).process)
        deadline = start_at + max_s + 30
        next_check = 0.0
        while time.time() < deadline and any(p.alive() for p in peers.values()):
            time.sleep(0.1)
            driver.poll()
            if time.monotonic() < next_check:
                continue
            next_check = time.monotonic() + 0.5
            if method == "solo":
                if solo_median(own_times(list(peers.values()), spec, start_at, trace, target)) is not None:
                    time.sleep(1.0)
                    break
                continue
            grid = median_curve(list(peers.values()), spec["metric"], start_at, _grid_s(spec), trace)
            if method != "ideal" and grid and _metric(spec).reached(grid[-1]["value"], target) \
                    and grid[-1]["samples"] >= min_samples:
                time.sleep(1.0)  # one more grid point, then stop everyone
                break
    finally:
        if driver is not None:
            driver.wake_all()
        codes = stop_swarm(list(peers.values()), timeout=20)
    result = _murmur_result(task, trace, method, [peers[i] for i in sorted(peers)], start_at, codes, target)
    result["startup_s"] = startup_s
    if method == "solo":
        # Each peer's own time: the fastest one's is the best any member could do alone.
        result["solo_times"] = own = own_times([peers[i] for i in sorted(peers)], spec, start_at, trace, target)
        result["time_to_target"] = min((t for t in own if t is not None), default=None)
        result["median_solo_time"] = solo_median(own)
    result["trace_actions"] = [{"t": round(t, 2), "peer": a.peer, "action": a.kind} for a, t in driver.done]
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


def own_times(peers: list[Peer], spec: dict, t0: float, trace: Trace | None, target: float) -> list[float | None]:
    """Each peer's own time to `target` on the run's grid (None until it reached it), in `peers`' order."""
    times = []
    for p in peers:
        curve = median_curve([p], spec["metric"], t0, _grid_s(spec), trace)
        times.append(next((c["t"] for c in curve if _metric(spec).reached(c["value"], target)), None))
    return times


def solo_median(times: list[float | None]) -> float | None:
    """The median of the peers' own times to target, a peer that has not reached it counting as slower than all;
    None while that median is not known."""
    ordered = sorted(math.inf if t is None else t for t in times)
    median = statistics.median(ordered) if ordered else math.inf
    return None if math.isinf(median) else median


def _grid_s(spec: dict) -> float:
    """The curve's time step: the task's evaluation interval, at most 1 s (a slow evaluation still gets a 1 s grid)."""
    return min(1.0, spec.get("eval_every", 1.0))


def median_curve(peers: list[Peer], metric: str, t0: float, grid_s: float = 1.0, trace: Trace | None = None) -> list[dict]:
    """The median peer's metric and the swarm's total samples every `grid_s` seconds after `t0`.

    A peer counts toward the median while `trace` has it in the swarm (always, without a trace) and
    once it has evaluated; its samples count from then on, and for good once it has left. The curve
    ends with the earliest last evaluation of the peers that stay to the end; it is empty until each
    of them that was there from the start has evaluated.
    """
    records = {p.index: p.metrics() for p in peers}
    stay = [i for i in records if trace is None or math.isinf(trace.span(i)[1])]
    initial = set(trace.initial()) if trace else set(records)
    if not stay or any(not records[i] for i in stay if i in initial):
        return []
    ends = [records[i][-1]["t"] for i in stay if records[i]]
    if not ends:  # only joiners stay, and none has evaluated yet
        return []
    end = min(ends) - t0
    out = []
    for k in range(int(end / grid_s + 1e-9) + 1):
        t = round(k * grid_s, 6)
        latest = {i: x for i, r in records.items() if (x := next((x for x in reversed(r) if x["t"] - t0 <= t + grid_s / 2), None))}
        present = [x for i, x in latest.items() if trace is None or trace.span(i)[0] <= t < trace.span(i)[1]]
        if not present:
            continue
        out.append({"t": t, "value": statistics.median(x[metric] for x in present), "samples": sum(x["samples"] for x in latest.values())})
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


def _murmur_result(task: str, trace: Trace, method: str, peers: list[Peer], start_at: float, codes: list, target: float) -> dict:
    spec = TASKS[task]
    curve = median_curve(peers, spec["metric"], start_at, _grid_s(spec), trace)
    statuses = [p.status() for p in peers]
    ttt = next((c["t"] for c in curve if _metric(spec).reached(c["value"], target)), None)
    # With churn or sleep, a peer's own rate covers only its time in the swarm: the swarm's is samples over time.
    steady = not trace.events and not any(p.asleep() for p in trace.peers)
    rate = sum(s.samples_per_s for s in statuses if s) if steady or not curve or not curve[-1]["t"] else curve[-1]["samples"] / curve[-1]["t"]
    return {
        "method": method,
        "task": task, "slowdowns": [p.slowdown_at(0.0) for p in trace.peers], "exit_codes": codes, "target": target,
        "curve": [{"t": c["t"], "samples": c["samples"], spec["metric"]: c["value"]} for c in curve],
        "time_to_target": ttt,
        "samples_per_s": rate,
        "peers": [_peer_result(p.index, p.slowdown, s) for p, s in zip(peers, statuses)],
        "consensus": _consensus([p.data_dir for p in peers]) if not trace.events else [],
    }
