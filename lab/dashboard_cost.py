"""What serving the dashboard costs a training peer: samples/s with the dashboard open, closed and off.

One `murmur run` peer (digits, one torch thread, full speed) per run, three ways, interleaved:
  off     no HTTP port at all
  closed  dashboard served (`--metrics-port 0`), nobody looking
  open    served, and a client polls /api/swarm as the page does (every 1 s, `--every`)
Also prints the page's weight (the three static files) and the size of one /api/swarm answer.

    python -m lab.dashboard_cost --repeats 3 --duration 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import urllib.request
from importlib import resources
from pathlib import Path

from lab.swarm import start_peer, stop_swarm
from murmur.node.ops.dashboard import STATIC_FILES

MODES = ("off", "closed", "open")


def _poll(url: str, every: float, stop: threading.Event, fetched: list[int]) -> None:
    while not stop.wait(every):
        try:
            with urllib.request.urlopen(url + "api/swarm", timeout=5) as response:
                fetched.append(len(response.read()))
        except OSError:
            pass  # the peer is starting or stopping


def one_run(root: Path, mode: str, duration: float, every: float) -> tuple[float, list[int]]:
    """Samples/s of one peer trained for `duration` seconds in `mode`, and the sizes of the answers polled."""
    extra = ["--task", "digits", "--duration", str(duration), "--log-level", "WARNING"]
    if mode != "off":
        extra += ["--metrics-port", "0"]
    peer = start_peer(0, root, 1.0, extra, None)
    stop, fetched = threading.Event(), []
    poller = None
    try:
        deadline = time.monotonic() + duration + 60
        while mode == "open" and poller is None and time.monotonic() < deadline:
            url = status.dashboard_url if (status := peer.status()) else None
            if url:
                poller = threading.Thread(target=_poll, args=(url, every, stop, fetched))
                poller.start()
            time.sleep(0.1)
        peer.process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop.set()
        if poller:
            poller.join(timeout=10)
        stop_swarm([peer])
    return status.samples_per_s if (status := peer.status()) else 0.0, fetched


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of training per run")
    p.add_argument("--every", type=float, default=1.0, help="seconds between polls of the open dashboard")
    args = p.parse_args()
    web = resources.files("murmur.node.ops").joinpath("web")
    weights = {name: len(web.joinpath(name).read_bytes()) for name, _ in STATIC_FILES.values()}
    print(f"page weight: {sum(weights.values())} bytes ({', '.join(f'{k} {v}' for k, v in weights.items())})")
    results: dict[str, list[float]] = {m: [] for m in MODES}
    sizes: list[int] = []
    with tempfile.TemporaryDirectory(prefix="murmur-dashcost-") as tmp:
        for r in range(args.repeats):
            for mode in MODES[r % 3:] + MODES[: r % 3]:  # rotate the order: no mode always runs first
                rate, fetched = one_run(Path(tmp) / f"{mode}-{r}", mode, args.duration, args.every)
                results[mode].append(rate)
                sizes += fetched
                print(f"  repeat {r} {mode:6s} {rate:8.0f} samples/s" + (f"  ({len(fetched)} polls)" if fetched else ""),
                      flush=True)  # fmt: skip
    for mode in MODES:
        print(f"{mode:6s} median {statistics.median(results[mode]):.0f} samples/s  runs {[round(x) for x in results[mode]]}")
    if sizes:
        print(f"/api/swarm answer (one peer): {statistics.median(sizes):.0f} bytes median")


if __name__ == "__main__":
    main()
