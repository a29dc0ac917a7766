"""A 3-peer loopback swarm of `murmur run` processes, its dashboard loaded in headless Chromium.

Set MURMUR_DASHBOARD_SCREENSHOT=docs/dashboard.png to keep the screenshot (the README shows it).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from headless_chromium import chart_points, dump_dom, parse_dom, peer_rows, screenshot

from lab.swarm import Peer, start_swarm, stop_swarm

WAIT_S = 90.0  # bound on each wait below: start-up and torch imports on 2 busy cores


def _wait_for(what: str, probe: Callable[[], Any], timeout: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last seen: {last!r}"[:2000])


def _swarm(url: str) -> dict:
    with urllib.request.urlopen(url + "api/swarm", timeout=5) as response:
        return json.loads(response.read())


def _dashboard_url(peer: Peer) -> str | None:
    status = peer.status()
    return status.dashboard_url if status is not None else None


def _ready(url: str, ids: set[str]) -> dict | None:
    """The swarm once this node lists `ids`, has merged and has a line (two points) for every peer."""
    swarm = _swarm(url)
    listed = {p["peer_id"] for p in swarm.get("peers", [])}
    merged = [e for e in swarm.get("exchanges", []) if e["result"] == "merged"]
    lines = all(len([p for p in swarm["history"].get(i, []) if p["loss"] is not None]) >= 2 for i in ids)
    return swarm if listed == ids and merged and lines and swarm["edges"] else None


@pytest.mark.slow
def test_dashboard_of_a_live_swarm_in_headless_chromium(tmp_path: Path) -> None:
    # Steps padded to 20 ms (sleeping): a realistic pace that leaves the shared cores to the browser.
    extra = ["--task", "digits", "--metrics-port", "0", "--duration", "120", "--step-time", "20",
             "--average-every", "0.3", "--eval-every", "0.5", "--log-level", "WARNING"]  # fmt: skip
    peers = start_swarm(tmp_path, [1, 1, 2], extra, fork=True)  # ready in a second, not several
    try:
        url = _wait_for("peer 0's dashboard URL", lambda: _dashboard_url(peers[0]))
        assert url.startswith("http://127.0.0.1:")
        ids = set(_wait_for("every peer's ID", lambda: [s.peer_id for s in statuses]
                            if all(statuses := [p.status() for p in peers]) else None))  # fmt: skip
        _wait_for("three peers, a merge and two points per peer", lambda: _ready(url, ids))

        root, by_id = parse_dom(dump_dom(url))
        rows = peer_rows(by_id)
        assert set(rows) == ids  # all three peers, by their full IDs
        for chart in ("chart-loss", "chart-metric", "chart-throughput", "chart-idle"):
            points = chart_points(by_id, chart)
            assert set(points) == ids and min(points.values()) >= 2, (chart, points)
        assert chart_points(by_id, "chart-traffic")  # this node's bytes in and out
        exchanges = by_id["exchanges"].find_all("tr")[1:]  # below the header row
        assert exchanges and any("merged" in tr.all_text() for tr in exchanges)
        assert by_id["graph"].find_all("line") and len(by_id["graph"].find_all("circle")) == 3
        shot = Path(os.environ.get("MURMUR_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
        screenshot(url, shot)

        leaver = peers[2]
        leaver_id = leaver.status().peer_id
        os.kill(leaver.process.pid, signal.SIGTERM)  # a graceful leave: it says goodbye to its members
        leaver.process.wait(timeout=30)
        _wait_for("the leaver to drop out", lambda: leaver_id not in {p["peer_id"] for p in _swarm(url)["peers"]})
        root, by_id = parse_dom(dump_dom(url))
        assert set(peer_rows(by_id)) == ids - {leaver_id}
        assert leaver_id not in chart_points(by_id, "chart-loss")
        assert not [c for c in by_id["graph"].find_all("circle") if c.attrs.get("data-peer") == leaver_id]
    finally:
        stop_swarm(peers)
