"""The `murmur` command's process behaviour: stop signals end it cleanly, never with a signal."""

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


def test_a_stop_request_after_the_command_finished_does_not_kill_it(tmp_path: Path) -> None:
    # A supervisor that sends SIGTERM just as a command ends must still see exit status 0.
    script = (
        "import os, signal, sys\n"
        "from node.cli import main\n"
        f"code = main(['id', '--data-dir', {str(tmp_path)!r}])\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('still here', flush=True)\n"
        "sys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_and_every_peer_it_started(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "node.cli", "demo", "--duration", "60", "--no-sync", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # Started as a shell starts a background job (`murmur demo &`): with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    peers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(out.glob("peer-*/status.json"))) < 4:
            assert demo.poll() is None, demo.stdout.read()
            time.sleep(0.5)
        peers = _pids_with_argument(f"--data-dir {out}/peer-")
        assert len(peers) == 4
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


def test_local_swarm_peers_do_not_inherit_murmur_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from node.lab.swarm import peer_environment

    monkeypatch.setenv("MURMUR_METRICS_PORT", "9100")  # every peer after the first could not bind it
    monkeypatch.setenv("PATH_FOR_TEST", "kept")
    env = peer_environment()
    assert "MURMUR_METRICS_PORT" not in env and env["PATH_FOR_TEST"] == "kept"
