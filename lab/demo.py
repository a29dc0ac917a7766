"""`murmur demo`: a local swarm of emulated heterogeneous peers versus synchronous training.

Starts one `murmur run` process per slowdown, shows a live per-peer table, then
runs the synchronous all-reduce baseline (real gloo) on the same emulated hardware
for the same time, and ends with a summary and a plot of held-out metric vs wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from lab.extras import plotting_missing
from lab.swarm import Peer, start_swarm, stop_swarm
from murmur.node.averaging.outcome import Result
from murmur.node.learn.tasks import load_task

STARTUP_S = 10.0


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def peer_table(peers: list[Peer], metric: str) -> Table:
    """The live per-peer table; short headers so that it fits a terminal 80 columns wide."""
    table = Table(title="Murmur swarm", caption="slow: emulated slowdown · merges: exchanges merged · idle: not computing")
    for col in ("peer", "slow", "samples/s", "loss", metric[:10], "merges", "peers", "idle"):
        table.add_column(col, justify="right", no_wrap=True)
    for peer in peers:
        s = peer.status()
        alive = peer.process.poll() is None
        cells = ("-", "-", "-", "0", "0", "-") if s is None else (
            _fmt(s.samples_per_s, ".0f"), _fmt(s.loss, ".3f"), _fmt(s.eval.get(metric), ".3f"),
            str(s.exchanges.get(Result.MERGED, 0)), str(s.known_peers), _fmt(1 - s.compute_fraction, ".1%"),
        )  # fmt: skip
        table.add_row(f"{peer.index}{'' if alive else ' done'}", f"{peer.slowdown:g}x", *cells)
    return table


def wait_for_dashboard(peer: Peer, timeout: float = 10.0) -> str | None:
    """The dashboard URL `peer` reports in its status once it serves one, or None after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and peer.process.poll() is None:
        status = peer.status()
        if status is not None and status.dashboard_url:
            return status.dashboard_url
        time.sleep(0.2)
    return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _uninterruptible() -> Iterator[None]:
    """Hold off Ctrl-C while stopping peers (itself bounded), so none is left running."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; Ctrl-C or SIGTERM at any point stops every peer it started (exit 130)."""
    if plotting_missing("murmur demo"):
        return 2
    # Set explicitly: a shell starts background jobs with SIGINT ignored, and Python keeps that.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    console = Console()
    task = load_task(args.task)
    metric = task.metric.name
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    slowdowns = [slowdowns[i % len(slowdowns)] for i in range(args.peers)]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    # All peers join first, then start training together, so the plot compares like with like.
    start_at = time.time() + STARTUP_S
    extra = ["--task", args.task, "--weighting", args.weighting, "--step-time", str(args.step_time),
             "--duration", str(args.duration), "--start-at", str(start_at), "--log-level", "WARNING",
             "--metrics-port", "0"]  # each peer serves its dashboard on a free loopback port
    console.print(f"murmur demo: {args.peers} peers, slowdowns {slowdowns}, {args.duration:g}s of training, task {args.task}")
    interrupted = False
    try:
        peers = start_swarm(out, slowdowns, extra)
    except KeyboardInterrupt:  # start_swarm has stopped the peers it started
        console.print("interrupted")
        return 130
    try:
        url = wait_for_dashboard(peers[0])
        # Any peer's dashboard shows the whole swarm: peer 0's is as good as any.
        console.print(f"murmur demo: swarm dashboard at {url}" if url else "murmur demo: no dashboard (peer 0 serves none)")
        deadline = time.monotonic() + args.duration + 90  # start-up, bounded
        with Live(peer_table(peers, metric), console=console, refresh_per_second=2) as live:
            while any(p.process.poll() is None for p in peers) and time.monotonic() < deadline:
                time.sleep(1)
                live.update(peer_table(peers, metric))
    except KeyboardInterrupt:
        interrupted = True
        console.print("interrupted: stopping peers")
    finally:
        with _uninterruptible():
            codes = stop_swarm(peers)
    console.print(peer_table(peers, metric))
    if interrupted:
        return 130
    sync = None
    if not args.no_sync:
        from lab.sync_baseline import run_sync

        console.print(f"synchronous all-reduce baseline (gloo, equal batches) on the same slowdowns for {args.duration:g}s…")
        try:
            sync = run_sync(args.task, slowdowns, "equal", args.duration, args.step_time, None)
        except KeyboardInterrupt:
            console.print("interrupted")
            return 130
    summary = summarize(peers, metric, sync, codes)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(peers, metric, sync, out / "demo.png", task.metric.higher_is_better)
    console.print(f"summary: {out / 'summary.json'}   plot: {out / 'demo.png'}")
    for p in summary["peers"]:
        console.print(
            f"  peer {p['peer']} ({p['slowdown']:g}x): {p['samples_per_s']:.0f} samples/s, {p['exchanges']} exchanges "
            f"(mean {_fmt(p['mean_exchange_s'], '.3f')}s), final {metric} {_fmt(p['final'], '.3f')}, not computing {p['idle_fraction']:.1%}"
        )
    console.print(f"  swarm: {summary['swarm_samples_per_s']:.0f} samples/s, median final {metric} {_fmt(summary['median_final'], '.4f')}")
    if sync:
        console.print(f"  sync all-reduce: {sync['samples_per_s']:.0f} samples/s, final {metric} {_fmt(summary['sync_final'], '.4f')}")
    return 0


def summarize(peers: list[Peer], metric: str, sync: dict | None, codes: list[int | None]) -> dict:
    rows = []
    for peer in peers:
        s = peer.status()
        m = peer.metrics()
        rows.append({
            "peer": peer.index, "slowdown": peer.slowdown, "exit_code": codes[peer.index],
            "samples_per_s": s.samples_per_s if s else 0.0, "exchanges": s.exchanges.get(Result.MERGED, 0) if s else 0,
            "mean_exchange_s": s.mean_exchange_s if s else None, "final": m[-1][metric] if m else None,
            "idle_fraction": 1 - s.compute_fraction if s else 1.0, "bytes_sent": s.bytes_sent if s else 0,
        })  # fmt: skip
    finals = [r["final"] for r in rows if r["final"] is not None]
    sync_final = sync["curve"][-1].get(metric) if sync and sync.get("curve") else None
    return {
        "peers": rows, "swarm_samples_per_s": sum(r["samples_per_s"] for r in rows),
        "median_final": statistics.median(finals) if finals else None,
        "sync_samples_per_s": sync["samples_per_s"] if sync else None, "sync_final": sync_final,
    }


def plot(peers: list[Peer], metric: str, sync: dict | None, path: Path, higher_is_better: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [p.metrics() for p in peers]
    t0 = min((r[0]["t"] for r in records if r), default=0.0)  # the common start
    fig, ax = plt.subplots(figsize=(8, 5))
    for peer, rec in zip(peers, records):
        ax.plot([r["t"] - t0 for r in rec], [r[metric] for r in rec], label=f"Murmur peer {peer.index} ({'full speed' if peer.slowdown == 1 else f'{peer.slowdown:g}x slower'})", alpha=0.8)
    if sync and sync.get("curve"):
        ax.plot([c["t"] for c in sync["curve"]], [c[metric] for c in sync["curve"]], "k--", lw=2, label="synchronous all-reduce (same hardware)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"held-out {metric}")
    ax.set_title("Murmur gossip vs synchronous training on heterogeneous peers")
    if higher_is_better:
        ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
