"""Chaos run: a swarm of `murmur run` processes under continuous SIGKILL churn.

Starts N peers; every K seconds kills a random one with SIGKILL and starts a
replacement, half fresh (new identity and data dir) and half restarting from the
killed peer's data dir (checkpoint resume). Beside it, at the same time (so that both meet the
same machine), runs the same swarm without churn, and checks, for the churned run:

- no peer's training stalled longer than the exchange timeout (evaluation gaps);
- no NaN/Inf in any evaluation or checkpoint;
- a killed peer left every survivor's membership table within the liveness timeout;
- every process was reaped (none left running);
- the median peer's final held-out accuracy is within 1 point of the churn-free run's.

    python -m lab.chaos --peers 8 --duration 300 --kill-every 20 --out results/chaos
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab.swarm import Peer, kill_peer, restart_peer, start_peer, stop_swarm, wait_for_address
from murmur.node.learn.checkpoint import load_latest

EXCHANGE_TIMEOUT = 5.0
LIVENESS_TIMEOUT = 8.0
GRACE_S = 4.0  # beyond the liveness timeout, before a dead peer still listed counts as a violation
TICK_S = 0.5


def run_swarm(root: Path, peers: int, duration: float, kill_every: float | None, rng: random.Random, extra: list[str]) -> dict:
    """Run one swarm for `duration` seconds (with churn if `kill_every`); return observations."""
    # Forked from the preloaded server: a replacement joins in about a second, not after a fresh torch import.
    procs: list[Peer] = [start_peer(0, root, 1.0, extra, None, fork=True)]
    kills: list[tuple[float, str]] = []
    violations: list[str] = []
    try:
        first = wait_for_address(procs[0])
        procs += [start_peer(i, root, 1.0, extra, first, fork=True) for i in range(1, peers)]
        end = time.monotonic() + duration
        next_kill = time.monotonic() + (kill_every or math.inf)
        while time.monotonic() < end:
            time.sleep(TICK_S)
            now = time.monotonic()
            live = [p for p in procs if p.alive()]
            violations += _membership_violations(live, kills, now)
            if now >= next_kill and len(live) > 1 and now + 5 < end:  # a replacement needs time to start
                victim = rng.choice(live)
                kill_peer(victim)
                kills.append((now, victim.peer_id))
                bootstrap = rng.choice([a for p in live if p is not victim and (a := p.address())] or [first])
                fresh = rng.random() >= 0.5  # else restart from the killed peer's data dir (checkpoint resume)
                procs.append(start_peer(len(procs), root, 1.0, extra, bootstrap, fork=True) if fresh
                             else restart_peer(victim, extra, bootstrap, fork=True))  # fmt: skip
                next_kill = now + (kill_every or math.inf)
    finally:
        stop_swarm(procs, timeout=20)
    return observe(procs, kills, violations)


def _membership_violations(live: list[Peer], kills: list[tuple[float, str]], now: float) -> list[str]:
    """Live peers (up long enough to have heard) that still list a peer killed more than the liveness timeout ago."""
    live_ids = {p.peer_id for p in live}
    last_kill = {peer_id: when for when, peer_id in kills}  # a restarted peer may die twice
    out = []
    for peer_id, when in last_kill.items():
        if now - when > LIVENESS_TIMEOUT + GRACE_S and peer_id not in live_ids:
            for p in live:
                if (s := p.status()) and peer_id in s.peers and now - p.started > LIVENESS_TIMEOUT + GRACE_S:
                    out.append(f"{p.peer_id[-8:]} still lists {peer_id[-8:]} {now - when:.0f}s after its death")
    return out


def observe(procs: list[Peer], kills: list, membership_violations: list[str]) -> dict:
    """Judge a finished run from its processes' metrics and checkpoints."""
    stalls, nonfinite = [], []
    finals = []
    for p in procs:
        # A data dir's metrics file is rewritten by each run of it: judge only processes that ran to the end.
        records = p.metrics() if p.process.returncode != -9 else []
        times = [r["t"] for r in records]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps and max(gaps) > EXCHANGE_TIMEOUT:
            stalls.append(f"{p.peer_id[-8:]} paused {max(gaps):.1f}s")
        if any(not math.isfinite(r["loss"]) for r in records):
            nonfinite.append(f"{p.peer_id[-8:]} evaluated a non-finite loss")
        if records:
            finals.append(records[-1]["accuracy"])
    import torch

    for data_dir in {p.data_dir for p in procs}:
        found = load_latest(data_dir / "checkpoints")
        if found and not all(torch.isfinite(t).all() for t in found[0]["model"].values()):
            nonfinite.append(f"checkpoint {found[1]} holds NaN/Inf")
    leftovers = [p.process.pid for p in procs if p.alive()]
    return {
        "kills": len(kills), "processes": len(procs), "stalls": stalls, "nonfinite": nonfinite,
        "membership_violations": membership_violations[:20], "leftover_pids": leftovers,
        "median_final_accuracy": statistics.median(finals) if finals else None,
        "exit_codes": [p.process.returncode for p in procs],
    }


def run_chaos(peers: int, duration: float, kill_every: float, out: Path, seed: int = 0) -> dict:
    extra = ["--task", "digits", "--step-time", "20", "--exchange-timeout", str(EXCHANGE_TIMEOUT),
             "--liveness-timeout", str(LIVENESS_TIMEOUT), "--checkpoint-every", "5", "--log-level", "INFO"]
    with ThreadPoolExecutor(2) as pool:
        churning = pool.submit(run_swarm, out / "churn", peers, duration, kill_every, random.Random(seed), extra)
        calm = run_swarm(out / "calm", peers, duration, None, random.Random(seed), extra)
        churned = churning.result()
    gap = None
    if churned["median_final_accuracy"] is not None and calm["median_final_accuracy"] is not None:
        gap = calm["median_final_accuracy"] - churned["median_final_accuracy"]
    report = {"peers": peers, "duration": duration, "kill_every": kill_every, "churn": churned, "calm": calm, "accuracy_gap": gap}
    report["failures"] = (
        churned["stalls"] + churned["nonfinite"] + churned["membership_violations"]
        + [f"leftover pid {pid}" for pid in churned["leftover_pids"] + calm["leftover_pids"]]
        + ([f"accuracy {gap * 100:.1f} points below the churn-free run"] if gap is None or gap > 0.01 else [])
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "chaos.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/chaos"))
    args = parser.parse_args(argv)
    report = run_chaos(args.peers, args.duration, args.kill_every, args.out, args.seed)
    c = report["churn"]
    print(f"chaos: {args.peers} peers, {args.duration:g}s, {c['kills']} kills, {c['processes']} processes started")
    print(f"  median final accuracy: churn {c['median_final_accuracy']}, calm {report['calm']['median_final_accuracy']}")
    print(f"  stalls {len(c['stalls'])}, non-finite {len(c['nonfinite'])}, membership violations {len(c['membership_violations'])}, leftovers {len(c['leftover_pids'])}")
    for failure in report["failures"]:
        print(f"  FAIL: {failure}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
