"""Chaos run: a swarm of `murmur run` processes under continuous SIGKILL churn.

Starts N peers; every K seconds kills a random one with SIGKILL and starts a
replacement, half fresh (new identity and data dir) and half restarting from the
killed peer's data dir (checkpoint resume). Then runs the same swarm without churn for
the same time and checks, for the churned run:

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
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab.swarm import ONE_THREAD, murmur_command, peer_environment
from murmur.node.learn.checkpoint import load_latest
from murmur.node.ops.node_status import NodeStatus, NotAStatus
from murmur.node.ops.status import STATUS_FILE

EXCHANGE_TIMEOUT = 5.0
LIVENESS_TIMEOUT = 8.0


@dataclass
class Proc:
    data_dir: Path
    port: int
    peer_id: str
    process: subprocess.Popen
    started: float
    killed_at: float | None = None

    @property
    def address(self) -> str:
        return f"/ip4/127.0.0.1/tcp/{self.port}/p2p/{self.peer_id}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def status(self) -> NodeStatus | None:
        """The peer's last status, or None before it writes one."""
        try:
            return NodeStatus.from_json((self.data_dir / STATUS_FILE).read_text())
        except (OSError, NotAStatus):
            return None


@dataclass
class Swarm:
    root: Path
    extra: list[str]
    procs: list[Proc] = field(default_factory=list)
    counter: int = 0

    def start(self, bootstrap: str | None, data_dir: Path | None = None) -> Proc:
        if data_dir is None:
            data_dir = self.root / f"peer-{self.counter}"
            self.counter += 1
        data_dir.mkdir(parents=True, exist_ok=True)
        peer_id = subprocess.run(murmur_command() + ["id", "--data-dir", str(data_dir)], check=True, capture_output=True, text=True).stdout.strip()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = murmur_command() + ["run", "--data-dir", str(data_dir), "--listen", f"/ip4/127.0.0.1/tcp/{port}", *ONE_THREAD, *self.extra]
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        log = (data_dir / "log.txt").open("a")
        proc = Proc(data_dir, port, peer_id, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=peer_environment()), time.time())
        self.procs.append(proc)
        return proc

    def live(self) -> list[Proc]:
        return [p for p in self.procs if p.alive()]

    def stop(self) -> None:
        for p in self.live():
            os.kill(p.process.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.process.kill()
                p.process.wait()


def _metrics(data_dir: Path) -> list[dict]:
    path = data_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_swarm(root: Path, peers: int, duration: float, kill_every: float | None, rng: random.Random, extra: list[str]) -> dict:
    """Run one swarm for `duration` seconds (with churn if `kill_every`); return observations."""
    swarm = Swarm(root, extra)
    first = swarm.start(None)
    time.sleep(1.0)
    for _ in range(peers - 1):
        swarm.start(first.address)
    kills: list[tuple[float, str, Path]] = []
    membership_violations: list[str] = []
    end = time.time() + duration
    next_kill = time.time() + (kill_every or math.inf)
    try:
        while time.time() < end:
            time.sleep(0.5)
            now = time.time()
            live = swarm.live()
            live_ids = {p.peer_id for p in live}
            last_kill = {peer_id: when for when, peer_id, _ in kills}  # a restarted peer may die twice
            for peer_id, when in last_kill.items():
                if now - when > LIVENESS_TIMEOUT + 4 and peer_id not in live_ids:
                    for p in live:
                        if (s := p.status()) and peer_id in s.peers and now - p.started > LIVENESS_TIMEOUT + 4:
                            membership_violations.append(f"{p.peer_id[-8:]} still lists {peer_id[-8:]} {now - when:.0f}s after its death")
            if now >= next_kill and len(live) > 1 and now + 5 < end:  # a replacement needs time to start
                victim = rng.choice(live)
                os.kill(victim.process.pid, signal.SIGKILL)
                victim.process.wait()
                victim.killed_at = now
                kills.append((now, victim.peer_id, victim.data_dir))
                bootstrap = rng.choice([p for p in live if p is not victim]).address
                swarm.start(bootstrap, victim.data_dir if rng.random() < 0.5 else None)
                next_kill = now + kill_every
    finally:
        swarm.stop()
    return observe(swarm, kills, membership_violations)


def observe(swarm: Swarm, kills: list, membership_violations: list[str]) -> dict:
    stalls, nonfinite = [], []
    finals = []
    for p in swarm.procs:
        records = _metrics(p.data_dir) if p.killed_at is None else []
        # metrics.jsonl is rewritten by each run of a data dir; judge only processes that ran to the end.
        times = [r["t"] for r in records]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps and max(gaps) > EXCHANGE_TIMEOUT:
            stalls.append(f"{p.peer_id[-8:]} paused {max(gaps):.1f}s")
        if any(not math.isfinite(r["loss"]) for r in records):
            nonfinite.append(f"{p.peer_id[-8:]} evaluated a non-finite loss")
        if records:
            finals.append(records[-1]["accuracy"])
    import torch

    for data_dir in {p.data_dir for p in swarm.procs}:
        found = load_latest(data_dir / "checkpoints")
        if found and not all(torch.isfinite(t).all() for t in found[0]["model"].values()):
            nonfinite.append(f"checkpoint {found[1]} holds NaN/Inf")
    leftovers = [p.process.pid for p in swarm.procs if p.process.poll() is None]
    return {
        "kills": len(kills), "processes": len(swarm.procs), "stalls": stalls, "nonfinite": nonfinite,
        "membership_violations": membership_violations[:20], "leftover_pids": leftovers,
        "median_final_accuracy": statistics.median(finals) if finals else None,
        "exit_codes": [p.process.returncode for p in swarm.procs],
    }


def run_chaos(peers: int, duration: float, kill_every: float, out: Path, seed: int = 0) -> dict:
    extra = ["--task", "digits", "--step-time", "20", "--exchange-timeout", str(EXCHANGE_TIMEOUT),
             "--liveness-timeout", str(LIVENESS_TIMEOUT), "--checkpoint-every", "5", "--log-level", "INFO"]
    churned = run_swarm(out / "churn", peers, duration, kill_every, random.Random(seed), extra)
    calm = run_swarm(out / "calm", peers, duration, None, random.Random(seed), extra)
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
