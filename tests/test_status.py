"""`murmur status`: health decisions, unreadable status files, and a real `murmur run` process observed
through its status file, `status`, `status --json`, `status --health` and its metrics endpoint."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from status_example import example_status

from murmur.node.averaging.outcome import Result
from murmur.node.ops.node_status import NodeStatus
from murmur.node.ops.status import STATUS_FILE, StatusUnavailable, load_status, main, unhealthy_reason

ROOT = Path(__file__).resolve().parent.parent


def _status(t: float, interval: float = 1.0, pid: int = 4242) -> NodeStatus:
    return example_status(t=t, status_interval=interval, pid=pid)


def test_health_needs_a_fresh_status_and_a_live_process() -> None:
    now = 1_000_000.0
    assert unhealthy_reason(_status(now - 2.9), now, alive=True) is None
    assert unhealthy_reason(_status(now - 3.5), now, alive=True) == "status is stale: last written 3.5s ago (limit 3s)"
    # A slow writer gets 3 intervals, but never more than 30 s.
    assert unhealthy_reason(_status(now - 25, interval=10), now, alive=True) is None
    assert "limit 30s" in unhealthy_reason(_status(now - 31, interval=20), now, alive=True)
    assert (
        unhealthy_reason(_status(now - 1), now, alive=False)
        == "node process 4242 is not running (status last written 1s ago)"
    )


def test_the_pid_check_sees_this_process_and_not_a_finished_one() -> None:
    now = time.time()
    assert unhealthy_reason(_status(now, pid=os.getpid()), now) is None
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(timeout=30)
    assert "is not running" in unhealthy_reason(_status(now, pid=finished.pid), now)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no status file at"),
        ("{not json", "is not valid JSON"),
        ('["a list"]', "is not a Murmur status file"),
        ('{"peer_id": "x"}', "is not a Murmur status file"),
    ],
)
def test_missing_or_unreadable_status_is_one_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str | None, message: str
) -> None:
    if content is not None:
        (tmp_path / STATUS_FILE).write_text(content)
    with pytest.raises(StatusUnavailable, match=message):
        load_status(tmp_path)
    for flags in (["--health"], ["--json"], []):
        assert main(["--data-dir", str(tmp_path), *flags]) == 1
        captured = capsys.readouterr()
        output = captured.out + captured.err
        assert message in output and output.count("\n") == 1 and "Traceback" not in output


def _murmur(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "murmur.node.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )


def test_a_running_node_is_observable_and_a_stopped_one_unhealthy(tmp_path: Path) -> None:
    data = tmp_path / "node"
    config = tmp_path / "murmur.toml"
    config.write_text(f'data-dir = "{data}"\nlisten = ["/ip4/127.0.0.1/tcp/0"]\nlog-format = "json"\n')
    # Configured as a container would be: a TOML file plus MURMUR_* variables.
    env = {**os.environ, "MURMUR_CONFIG": str(config), "MURMUR_METRICS_PORT": "0", "MURMUR_CHECKPOINT_EVERY": "3600"}
    node = subprocess.Popen([sys.executable, "-m", "murmur.node.cli", "run"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        status: dict = {}
        while time.monotonic() < deadline and status.get("samples", 0) == 0:
            assert node.poll() is None, node.communicate()
            time.sleep(0.1)
            try:
                status = json.loads((data / STATUS_FILE).read_text())
            except (OSError, ValueError):
                continue
        assert status.get("samples", 0) > 0, "the node never reported training"

        health = _murmur("status", "--data-dir", str(data), "--health")
        assert (health.returncode, health.stdout) == (0, "healthy\n"), health
        shown = json.loads(_murmur("status", "--data-dir", str(data), "--json").stdout)
        assert shown["pid"] == node.pid and shown["addrs"][0].startswith("/ip4/127.0.0.1/tcp/")
        table = _murmur("status", "--data-dir", str(data), env={**os.environ, "COLUMNS": "200"})
        assert table.returncode == 0
        for text in (
            shown["peer_id"],
            "running",
            "samples/s",
            "work weight",
            "known peers",
            "exchanges",
            shown["metrics_url"],
        ):
            assert text in table.stdout, text
        with urllib.request.urlopen(shown["metrics_url"], timeout=5) as response:
            assert "murmur_samples_total" in response.read().decode()
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            out, err = node.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            node.kill()
            raise
    assert node.returncode == 0, err
    assert f"murmur: metrics at {shown['metrics_url']}" in out
    logs = [json.loads(line) for line in err.splitlines()]  # every log line is one JSON object
    assert logs and all(set(entry) >= {"time", "level", "logger", "message", "peer"} for entry in logs)
    assert any(entry["message"].startswith("received SIGTERM") for entry in logs)
    assert {entry["peer"] for entry in logs} == {shown["peer_id"]}
    health = _murmur("status", "--data-dir", str(data), "--health")
    assert health.returncode == 1
    assert health.stdout.startswith(f"unhealthy: node process {node.pid} is not running"), health.stdout



def test_status_shows_a_written_status_and_prints_it_back_as_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the table's width: no cell folded
    written = example_status(t=time.time(), pid=os.getpid(), loss=float("nan"))  # NaN: before the first step
    (tmp_path / STATUS_FILE).write_text(written.to_json())
    assert load_status(tmp_path).peer_id == written.peer_id
    assert main(["--data-dir", str(tmp_path), "--health"]) == 0
    assert capsys.readouterr().out == "healthy\n"
    assert main(["--data-dir", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["loss"] is None and shown["weight"] == shown["work"] == written.work
    assert shown["recent_exchanges"][0]["result"] == Result.MERGED
    assert main(["--data-dir", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    for text in ("running", "private · connections: 1 direct, 1 relayed", "busy 1, merged 1", "peerA", "already in an exchange"):
        assert text in table, text


def test_the_summary_at_80_columns_keeps_addresses_whole_and_lines_unpadded() -> None:
    import io

    from rich.console import Console

    from murmur.node.ops.status import render

    peer = "12D3KooWQ57mDHMx8Fe1Y3EQYjqgZN21jyNffSU9MCgosyzQdFi8"
    addrs = (f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}", f"/ip4/203.0.113.7/tcp/4001/p2p/{peer}/p2p-circuit/p2p/{peer}")
    out = io.StringIO()
    render(example_status(peer_id=peer, addrs=addrs), 100.5, Console(file=out, width=80, force_terminal=False))
    lines = out.getvalue().splitlines()
    for addr in addrs:  # each on a line of its own, whole, to be copied (a terminal may wrap it, not cut it)
        assert f"  {addr}" in lines
    assert "…" not in "\n".join(line for line in lines if "/ip4/" in line)
    assert [line for line in lines if line != line.rstrip()] == []


def test_status_shows_an_alone_node_and_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    status = example_status(t=time.time(), pid=os.getpid(), known_peers=0, peers=(), joined=False,
                            alone_reason="127.0.0.1:1: unreachable: connection refused")
    (tmp_path / STATUS_FILE).write_text(status.to_json())
    assert main(["--data-dir", str(tmp_path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "known peers 0 · alone: 127.0.0.1:1: unreachable: connection refused" in shown
