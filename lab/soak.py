"""Soak run: a swarm of `murmur run` peers under churn for an hour, sampled every minute (issue 32).

    python scripts/soak.py --duration 3600 --churn-every 180 --out results/soak

Starts `--peers` charlm peers (`lab.swarm`, forked: ready in a second). Peer p0 is the bootstrap and
runs `--relay-service`; p1 and p2 reserve a slot on it (`--relay`) and advertise only their circuit
address, so others reach them through p0. p1-p3 are never churned: they carry the long-run checks.
Every `--churn-every` seconds, once the first peers all train, the next action of `ACTIONS` hits a
random churnable peer (p4 and up, and the newcomers, once training), waiting until there is one:
SIGTERM then a restart from its data dir; SIGKILL then a restart; SIGTERM and a newcomer in its place (fresh identity and data dir); a relay
kill (p0 SIGKILLed, restarted from its data dir on the same port after `--outage`); a partition (for
`--outage` seconds).

With root and iproute2 (the default `--network netns`), every peer runs in a network namespace of
its own (`lab.netns`) on one of two bridges, even peers on side 0 and odd on side 1; the partition
sets the one link between the bridges down, then up: no packet crosses while it is down.
`--network loopback` runs every peer on 127.0.0.1 instead, with no partition (logged as skipped).

Every `--sample-every` seconds each live process's RSS, open fds and threads (from /proc), its Trio
tasks, loss and merges (status.json) and its data dir's checkpoint bytes are recorded; every 2 s its
phase and sample count, for stalls. The targets (`lab.soak_report`) are judged at the end; results
go to OUT/soak.json, the plot to OUT/soak.png, the peers' data dirs and logs to OUT/peers.
Exit status: 0 when every target held, 1 otherwise, 130 on Ctrl-C (peers stopped, results written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab import soak_report
from lab.extras import plotting_unavailable_reason
from lab.netns import Netns, Network, netns_unavailable_reason
from lab.soak_probe import checkpoint_stats, checkpoints, process_stats
from lab.swarm import LOG_FILE, Peer, free_port, kill_peer, start_peer, stop_processes, stop_swarm, wait_for_address

ACTIONS = ("sigterm", "sigkill", "newcomer", "relay-kill", "partition")
POLL_S = 2.0
PORT = 4001  # each namespace has its own, so every peer listens on it there
STOP_TIMEOUT_S = 20.0
RESUMED = "resumed from"
UNUSABLE = "checkpoint unusable"
LONG_LIVED = 4  # p0 (the relay, churned only by relay kills) and p1-p3 (never churned)
RELAYED = (1, 2)


@dataclass
class Life:
    """One process: a run of one data dir, from its start to its end."""

    name: str
    index: int
    side: int
    peer: Peer
    started: float  # run time (s)
    log_offset: int  # where this run's lines start in the appended log
    restart_of: str | None = None
    ended: float | None = None
    how_ended: str | None = None
    resumed: bool | None = None
    unusable: bool = False
    observations: list[tuple[float, str, int]] = field(default_factory=list)  # (run time, phase, samples)

    def new_log(self) -> str:
        try:
            with (self.peer.data_dir / LOG_FILE).open("rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Soak:
    """The swarm, its churn and its samples; `run()` drives it, `results()` is the JSON document."""

    def __init__(self, args: argparse.Namespace, network: Network | None) -> None:
        self.args = args
        self.network = network
        self.root = args.out / "peers"
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.lives: list[Life] = []
        self.events: list[dict] = []
        self.samples: list[dict] = []
        self.swarm: list[dict] = []
        self.hosts: dict[int, Netns] = {}
        self.relay_port = PORT if network else free_port()  # fixed: a killed relay comes back on it
        self.next_index = 0
        self.merges: dict[
            str, int
        ] = {}  # each process's merge count when last sampled: the swarm's total survives restarts

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- peers ------------------------------------------------------------------------------------------

    def _listen(self, index: int) -> str:
        if self.network is None:
            return f"/ip4/127.0.0.1/tcp/{self.relay_port if index == 0 else 0}"
        return f"/ip4/{self.hosts[index].address}/tcp/{PORT}"

    def address(self, life: Life) -> str:
        """A dialable address of the peer (its own, not a circuit: namespaces are routable among themselves)."""
        if self.network is None and life.index != 0:
            return wait_for_address(life.peer)
        return f"{self._listen(life.index)}/p2p/{life.peer.peer_id}"

    def _extra(self, index: int, bootstraps: list[str]) -> list[str]:
        extra = ["--task", self.args.task, "--eval-every", str(self.args.eval_every), "--checkpoint-every",
                 str(self.args.checkpoint_every), "--log-level", "INFO"]  # fmt: skip
        if index == 0:
            extra.append("--relay-service")
        if index in RELAYED:
            extra += ["--relay", self.address(self.lives[0])]
        for b in bootstraps[1:]:
            extra += ["--bootstrap", b]
        return extra

    def start(self, index: int, *, restart_of: Life | None = None) -> Life:
        """Start peer `index` (its namespace made on first start), or run `restart_of`'s data dir again."""
        if self.network is not None and index not in self.hosts:
            self.hosts[index] = self.network.host(f"p{index}", side=index % 2)
        bootstraps = [self.address(life) for life in self._bootstrap_candidates(index)]
        data_dir = self.root / f"p{index}"
        log = data_dir / LOG_FILE
        offset = log.stat().st_size if log.exists() else 0
        peer = start_peer(
            index, self.root, self.args.slowdown, self._extra(index, bootstraps), bootstraps[0] if bootstraps else None,
            fork=True, data_dir=data_dir, listen=self._listen(index), netns=self.hosts.get(index),
            append_log=restart_of is not None,
        )  # fmt: skip
        runs = sum(1 for life in self.lives if life.index == index)
        life = Life(f"p{index}" + (f".{runs}" if runs else ""), index, index % 2, peer, self.now(), offset,
                    restart_of.name if restart_of else None)  # fmt: skip
        self.lives.append(life)
        return life

    def _bootstrap_candidates(self, index: int) -> list[Life]:
        """p0 if alive, then a live long-lived peer: two, so a newcomer joins while the relay is down."""
        if index == 0 and not any(life.index == 0 for life in self.lives):
            return []
        live = [life for life in self.live() if life.index != index and life.index not in RELAYED]
        first = [life for life in live if life.index == 0]
        others = [life for life in live if life.index != 0 and life.index < LONG_LIVED] or [
            life for life in live if life.index != 0
        ]
        return first + self.rng.sample(others, min(1, len(others)))

    def live(self) -> list[Life]:
        return [life for life in self.lives if life.ended is None]

    def end(self, life: Life, how: str) -> None:
        """Stop a process by PID: "sigterm" (its goodbye and exit checkpoint) or "sigkill" (a crash)."""
        if how == "sigkill":
            kill_peer(life.peer, timeout=STOP_TIMEOUT_S)
        else:
            stop_processes([life.peer.process], timeout=STOP_TIMEOUT_S)
        life.ended, life.how_ended = self.now(), how

    # -- churn ------------------------------------------------------------------------------------------

    def event(self, kind: str, process: str, detail: str = "") -> None:
        self.events.append({"t": round(self.now(), 1), "kind": kind, "process": process, "detail": detail})
        print(f"[{self.now():6.0f} s] {kind} {process} {detail}".rstrip(), flush=True)

    def churnable(self, action: str) -> list[Life]:
        """Live peers `action` may hit: training ones, not long-lived; for a SIGKILL, only those with a
        checkpoint to resume from (a SIGTERM writes one on exit)."""
        live = [
            life
            for life in self.live()
            if life.index >= LONG_LIVED and life.observations and life.observations[-1][1] == "training"
        ]
        return [life for life in live if checkpoints(life.peer.data_dir)] if action == "sigkill" else live

    def swarm_up(self) -> bool:
        """Whether every live peer has trained."""
        return all(any(phase == "training" for _, phase, _ in life.observations) for life in self.live())

    def can_churn(self, action: str) -> bool:
        """Whether `action` has something to hit now; an action waits until it has (a restarted peer trains again first)."""
        if action == "relay-kill":
            return any(life.index == 0 for life in self.live())
        return action == "partition" or bool(self.churnable(action))

    def churn(self, action: str) -> float | None:
        """Do `action` (`can_churn` said it can); return the run time at which to undo it (relay restart, heal), or None."""
        if action == "relay-kill":
            relay = next((life for life in self.live() if life.index == 0), None)
            if relay is not None:
                self.end(relay, "sigkill")
                self.event("relay-kill", relay.name, "SIGKILL")
                return self.now() + self.args.outage
            return None
        if action == "partition":
            if self.network is None:
                self.event("partition-skipped", "", "--network loopback cannot cut links")
                return None
            self.network.join_sides(False)
            self.event("partition", "", "link between the sides down")
            return self.now() + self.args.outage
        victim = self.rng.choice(self.churnable(action))
        self.end(victim, "sigkill" if action == "sigkill" else "sigterm")
        if action == "newcomer":
            self.event("leave", victim.name, "SIGTERM, retired")
            fresh = self.start(self.next_index)
            self.next_index += 1
            self.event("newcomer", fresh.name, "fresh identity and data dir")
        else:
            kept = [p.name for p in checkpoints(victim.peer.data_dir)]
            again = self.start(victim.index, restart_of=victim)
            self.event(action, victim.name, f"restarted as {again.name}; checkpoints {', '.join(kept[-2:])}")
        return None

    def undo(self, action: str) -> None:
        if action == "relay-kill":
            relay = [life for life in self.lives if life.index == 0][-1]
            again = self.start(0, restart_of=relay)
            self.event("relay-restart", again.name, "same identity and port")
        elif action == "partition" and self.network is not None:
            self.network.join_sides(True)
            self.event("heal", "", "link between the sides up")

    # -- observing --------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Phase and samples of every live process (stalls); whether each restart resumed (its new log lines)."""
        for life in self.live():
            if not life.peer.alive():
                life.ended, life.how_ended = self.now(), f"exited {life.peer.process.returncode}"
                self.event("exited", life.name, f"code {life.peer.process.returncode}")
                continue
            status = life.peer.status()
            if status is not None and status.pid == life.peer.process.pid:  # not the last run's file
                life.observations.append((self.now(), status.phase, status.samples))
            if life.restart_of is not None and life.resumed is None:
                lines = life.new_log()
                life.unusable = UNUSABLE in lines
                if RESUMED in lines:
                    life.resumed = True

    def sample(self) -> None:
        """One row per live process, and the swarm's median loss and merges."""
        losses = []
        for life in self.live():
            row = {"t": round(self.now(), 1), "process": life.name, "age_s": round(self.now() - life.started, 1),
                   **process_stats(life.peer.process.pid), **checkpoint_stats(life.peer.data_dir)}  # fmt: skip
            status = life.peer.status()
            if status is not None and status.pid == life.peer.process.pid:
                loss = status.eval.get("loss")
                row.update(phase=status.phase, samples=status.samples, trio_tasks=status.trio_tasks,
                           trio_task_names=status.trio_task_names, loss=loss,
                           merges=status.exchanges.get("merged", 0), known_peers=status.known_peers)  # fmt: skip
                if loss is not None and status.phase == "training":
                    losses.append(loss)
                self.merges[life.name] = row["merges"]
            self.samples.append(row)
        median = statistics.median(losses) if losses else None
        merges = sum(self.merges.values())
        self.swarm.append(
            {"t": round(self.now(), 1), "median_loss": median, "merges": merges, "live": len(self.live())}
        )
        shown = median if median is not None else float("nan")
        print(f"[{self.now():6.0f} s] {len(self.live())} live, median loss {shown:.3f}, {merges} merges", flush=True)

    # -- the run ----------------------------------------------------------------------------------------

    def run(self) -> None:
        """Start the swarm, churn and sample until `duration`; the caller stops the processes (`stop_all`)."""
        first = self.start(0)
        wait_for_address(first.peer)
        for index in range(1, self.args.peers):
            self.start(index)
        self.next_index = self.args.peers
        end = self.t0 + self.args.duration
        next_sample, next_churn, undo_at, undo_action = self.t0, self.t0 + self.args.churn_every, None, ""
        waiting = False  # the due action has nothing to hit yet
        started = False  # churn waits for the swarm: on a loaded machine its peers may take a while to start
        turn = 0
        for _ in range(int(self.args.duration / POLL_S) + 10):  # bounded: one pass per poll
            now = time.monotonic()
            if now >= end:
                break
            self.poll()
            if now >= next_sample:
                self.sample()
                next_sample += self.args.sample_every
            if undo_at is not None and self.now() >= undo_at:
                self.undo(undo_action)
                undo_at = None
            started = started or self.swarm_up()
            action = ACTIONS[turn % len(ACTIONS)]
            if started and now >= next_churn and undo_at is None and now + self.args.outage + 2 * POLL_S < end:
                waiting = not self.can_churn(action)
                if not waiting:
                    undo_action = action
                    undo_at = self.churn(action)
                    turn += 1
                    next_churn = now + self.args.churn_every
            time.sleep(max(0.0, min(POLL_S - (time.monotonic() - now), end - time.monotonic())))
        if undo_at is not None:
            self.undo(undo_action)
        elif waiting:
            self.event(f"{ACTIONS[turn % len(ACTIONS)]}-skipped", "", "nothing to hit before the end")
        self.sample()

    def stop_all(self) -> None:
        """Every process still running: SIGTERM by PID, SIGKILL after the timeout."""
        live = self.live()
        stop_swarm([life.peer for life in live], timeout=STOP_TIMEOUT_S)
        for life in live:
            life.ended, life.how_ended = self.now(), "end"

    def results(self, interrupted: bool) -> dict:
        restarts = [{"process": life.name, "restart_of": life.restart_of, "resumed": bool(life.resumed),
                     "unusable": life.unusable} for life in self.lives if life.restart_of is not None]  # fmt: skip
        processes = [{
            "name": life.name, "index": life.index, "side": life.side, "pid": life.peer.process.pid,
            "peer_id": life.peer.peer_id, "data_dir": str(life.peer.data_dir), "started": round(life.started, 1),
            "ended": life.ended and round(life.ended, 1), "how_ended": life.how_ended, "restart_of": life.restart_of,
            "exit_code": life.peer.process.returncode, "longest_stall_s": soak_report.longest_stall(life.observations),
            "role": "relay" if life.index == 0 else "relayed" if life.index in RELAYED else
                    "long-lived" if life.index < LONG_LIVED else "churned",
        } for life in self.lives]  # fmt: skip
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()}
        return {"config": config, "interrupted": interrupted, "elapsed_s": round(self.now(), 1),
                "processes": processes, "restarts": restarts, "events": self.events, "samples": self.samples, "swarm": self.swarm,
                "leftover_pids": [life.peer.process.pid for life in self.lives if life.peer.alive()]}  # fmt: skip


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # a SIGTERM to the soak stops its peers as Ctrl-C does


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See docs/soak.md.")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds (default 3600)")
    parser.add_argument("--churn-every", type=float, default=180.0, help="seconds between churn actions (default 180)")
    parser.add_argument("--out", type=Path, default=Path("results/soak"))
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--task", default="charlm")
    parser.add_argument(
        "--slowdown",
        type=float,
        default=8.0,
        help="each peer sleeps (S-1) x its compute after each step, so 8 peers share 2 cores (default 8)",
    )
    parser.add_argument(
        "--sample-every", type=float, default=60.0, help="seconds between resource samples (default 60)"
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=300.0,
        help="seconds of a process's life before its memory and counts are judged",
    )
    parser.add_argument(
        "--outage", type=float, default=45.0, help="seconds a relay stays dead and a partition lasts (default 45)"
    )
    parser.add_argument("--eval-every", type=float, default=10.0)
    parser.add_argument("--checkpoint-every", type=float, default=30.0)
    parser.add_argument(
        "--network",
        choices=("netns", "loopback"),
        default=None,
        help="netns (needs root and iproute2; the default where available) or loopback (no partition)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if (missing := plotting_unavailable_reason()) is not None:
        parser.error(missing)
    if args.peers < LONG_LIVED + 1:
        parser.error(f"--peers must be at least {LONG_LIVED + 1}: p0-p3 are the relay and the long-lived peers")
    if min(args.duration, args.churn_every, args.sample_every, args.outage) <= 0:
        parser.error("--duration, --churn-every, --sample-every and --outage must be positive")
    reason = netns_unavailable_reason()
    if args.network is None:
        args.network = "loopback" if reason else "netns"
    elif args.network == "netns" and reason:
        parser.error(f"--network netns: {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    interrupted = False
    with contextlib.ExitStack() as stack:
        network = stack.enter_context(Network(prefix="soak")) if args.network == "netns" else None
        soak = Soak(args, network)
        try:
            soak.run()
        except KeyboardInterrupt:
            interrupted = True
            print("interrupted: stopping every peer", flush=True)
        finally:
            soak.stop_all()  # then the namespaces go, with anything left in them
    results = soak.results(interrupted)
    results["checks"] = soak_report.judge(results, args.warmup)
    (args.out / "soak.json").write_text(json.dumps(results, indent=1))
    soak_report.plot(results, args.out / "soak.png")
    for line in soak_report.summary_lines(results, results["checks"]):
        print(line)
    print(f"results: {args.out / 'soak.json'}, plot: {args.out / 'soak.png'}")
    if interrupted:
        return 130
    return 0 if all(c["ok"] for c in results["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
