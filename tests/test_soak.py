"""scripts/soak.py end to end, shortened: a swarm of OS processes churned by every action, sampled,
judged, plotted, and every process stopped by PID at the end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.netns import netns_unavailable_reason

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"
SAMPLE_KEYS = {
    "t",
    "process",
    "age_s",
    "rss_bytes",
    "threads",
    "fds",
    "checkpoint_bytes",
    "trio_tasks",
    "loss",
    "merges",
}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()  # a zombie has stopped
    except (ProcessLookupError, FileNotFoundError):
        return False


def test_a_short_soak_churns_samples_judges_and_stops_everything(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    argv = [sys.executable, str(SCRIPT), "--duration", "40", "--churn-every", "4", "--outage", "3", "--sample-every", "4",
            "--warmup", "10", "--peers", "5", "--checkpoint-every", "2", "--eval-every", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: a target failed, which 40 s may well show
    results = json.loads((out / "soak.json").read_text())

    kinds = [e["kind"] for e in results["events"]]
    partition = ["partition", "heal"] if netns_unavailable_reason() is None else ["partition-skipped"]
    for kind in ["sigterm", "sigkill", "leave", "newcomer", "relay-kill", "relay-restart", *partition]:
        assert kind in kinds, (kind, kinds, done.stdout)
    assert {r["restart_of"] for r in results["restarts"]} >= {"p0"}  # the relay came back from its data dir
    assert any(p["role"] == "relayed" for p in results["processes"])

    live_rows = [s for s in results["samples"] if "phase" in s]
    assert live_rows and all(SAMPLE_KEYS <= set(s) for s in live_rows)
    assert all(s["trio_tasks"] > 0 and s["fds"] > 0 and s["rss_bytes"] > 0 for s in live_rows)
    assert set(results["checks"]) == {"memory", "fds", "threads", "trio_tasks", "stall", "checkpoint", "loss"}
    assert results["checks"]["checkpoint"]["ok"], results["restarts"]  # churn hits training peers: each left a checkpoint
    assert "PASS" in done.stdout or "FAIL" in done.stdout
    assert (out / "soak.png").stat().st_size > 10_000

    pids = [p["pid"] for p in results["processes"]]
    assert results["leftover_pids"] == [] and not any(_alive(pid) for pid in pids)
