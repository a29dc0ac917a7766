"""`murmur demo`: a local swarm it starts and stops by PID, even on Ctrl-C."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _pids_with_argument(text: str) -> list[int]:
    """PIDs of live processes whose command line contains `text` (to check, never to kill by)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_and_every_peer_it_started(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "murmur.node.cli", "demo", "--duration", "60", "--peers", "2", "--no-sync", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Started as a shell starts a background job (`murmur demo &`): with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    peers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(out.glob("peer-*/status.json"))) < 2:
            assert demo.poll() is None, demo.stdout.read()
            time.sleep(0.5)
        peers = _pids_with_argument(f"--data-dir {out}/peer-")
        assert len(peers) == 2  # two peers show it as well as four, in fewer seconds
        demo.send_signal(signal.SIGINT)
        output, _ = demo.communicate(timeout=30)
        leftover = _pids_with_argument(f"--data-dir {out}/peer-")
    finally:
        if demo.poll() is None:
            demo.kill()
        for pid in _pids_with_argument(f"--data-dir {out}/peer-"):
            os.kill(pid, signal.SIGKILL)
    assert demo.returncode == 130, output
    assert "interrupted" in output
    assert "Traceback" not in output
    assert leftover == []
    for log in out.glob("peer-*/log.txt"):
        assert "Traceback" not in log.read_text()


def test_the_live_table_fits_80_columns_without_wrapping_a_label(tmp_path: Path) -> None:
    import io

    from rich.console import Console
    from status_example import example_status

    from lab.demo import peer_table
    from lab.swarm import Peer
    from murmur.node.averaging.outcome import Result

    class Exited:
        def poll(self) -> int:
            return 0

    # The widest values a demo shows: five-digit rates and counts, a dozen peers, exited ones.
    (tmp_path / "status.json").write_text(example_status(
        samples_per_s=12345.6, loss=12.3456, eval={"accuracy": 0.9876}, exchanges={Result.MERGED: 12345},
        known_peers=12, compute_fraction=0.123,
    ).to_json())  # fmt: skip
    peers = [Peer(i, 4.0, tmp_path, Exited()) for i in range(12)]  # type: ignore[arg-type]
    out = io.StringIO()
    Console(file=out, width=80).print(peer_table(peers, "accuracy"))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "samples/s" in line)
    for label in ("peer", "slow", "samples/s", "loss", "accuracy", "merges", "peers", "idle"):
        assert f" {label} " in header, label
    assert "…" not in out.getvalue()
    assert any("11 done" in line and "12346" in line and "87.7%" in line for line in lines)
