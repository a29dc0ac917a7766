"""A swarm of `murmur run` OS processes on loopback, each bootstrapped from the first only."""

import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import pytest

from lab.swarm import free_port, start_peer, start_swarm, stop_swarm
from murmur.node.averaging.outcome import Result
from murmur.node.ops.run import build_run_parser


def test_local_peers_run_one_torch_thread_each_unless_told_otherwise(tmp_path: Path) -> None:
    # The peer's "command" records its command line; murmur run's own parser reads it.
    record = tmp_path / "argv.json"
    recorder = [sys.executable, "-c", f"import json, sys; open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))"]
    for extra, threads in (["--task", "digits"], 1), (["--threads", "4"], 4):
        peer = start_peer(0, tmp_path, 2.0, extra, None, command=recorder)
        assert peer.process.wait(timeout=30) == 0
        argv = json.loads(record.read_text())
        assert argv[0] == "run"
        args = build_run_parser().parse_args(argv[1:])
        assert (args.threads, args.slowdown, args.data_dir) == (threads, 2.0, tmp_path / "peer-0")


def _wait_until_learned(peers: list, merged_at_least: int, known: int | None = None, timeout: float = 90) -> tuple[list[int], list[float]]:
    """Poll the peers' status until each merged `merged_at_least` times, knows `known` others and the
    median accuracy passes 0.9; fail if a peer exits or time runs out. Returns each peer's known count and accuracy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        statuses = [p.status() for p in peers]
        merged = [s.exchanges.get(Result.MERGED, 0) if s else 0 for s in statuses]
        accuracy = [s.eval.get("accuracy", 0.0) if s else 0.0 for s in statuses]
        knows = [s.known_peers if s else 0 for s in statuses]
        if min(merged) >= merged_at_least and known in (None, min(knows)) and statistics.median(accuracy) > 0.9:
            return knows, accuracy
        assert all(p.process.poll() is None for p in peers), "a peer exited early"
        time.sleep(1)
    pytest.fail(f"swarm did not converge: merged={merged} known={knows} accuracy={accuracy}")


@pytest.mark.slow
def test_swarm_of_processes_learns_and_its_peers_leave_gracefully(tmp_path: Path) -> None:
    # One swarm shows it all: it learns through peer exchange; a peer stopped by SIGTERM
    # checkpoints and says goodbye, so its neighbours drop it at once (the liveness timeout is long: they can
    # only be this fast because it said so); SIGINT stops a peer gracefully too, with Ctrl-C's status 130; the rest stop cleanly.
    extra = ["--task", "digits", "--step-time", "20", "--duration", "120", "--liveness-timeout", "120"]
    peers = start_swarm(tmp_path, [1, 1, 2, 4], extra, fork=True)  # ready in a second, not several
    try:
        known, accuracy = _wait_until_learned(peers, merged_at_least=1, known=3)
        leaver = peers[3]
        leaver_id = leaver.status().peer_id
        os.kill(leaver.process.pid, signal.SIGTERM)
        assert leaver.process.wait(timeout=30) == 0
        assert list((leaver.data_dir / "checkpoints").glob("checkpoint-*.pt"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(leaver_id in p.status().peers for p in peers[:3]):
            time.sleep(0.5)
        assert all(leaver_id not in p.status().peers for p in peers[:3])
        os.kill(peers[2].process.pid, signal.SIGINT)
        assert peers[2].process.wait(timeout=30) == 130
    finally:
        codes = stop_swarm(peers)
    assert codes == [0, 0, 130, 0]
    for peer in peers:
        log = (peer.data_dir / "log.txt").read_text()
        assert "Traceback" not in log, log
        assert "murmur: listening on /ip4/127.0.0.1/tcp/" in log
    # Peers 1-3 were told only about peer 0, yet learned each other (peer exchange).
    assert known == [3, 3, 3, 3]
    assert statistics.median(accuracy) > 0.9  # chance is 0.1


@pytest.mark.slow
def test_forked_peer_runs_murmur_in_its_own_session_and_stops_by_pid(tmp_path: Path) -> None:
    from lab.swarm import ForkedPeer, stop_processes

    start_file = tmp_path / "start"
    peer = ForkedPeer(["run", "--task", "digits", "--data-dir", str(tmp_path / "p"), "--listen", "/ip4/127.0.0.1/tcp/0",
                       "--start-file", str(start_file), "--addr-file", str(tmp_path / "addrs")], tmp_path / "log.txt")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "addrs").exists() and time.monotonic() < deadline:
            assert peer.poll() is None, (tmp_path / "log.txt").read_text()
            time.sleep(0.1)
        assert os.getsid(peer.pid) == peer.pid  # a session of its own: a Ctrl-C meant for us does not reach it
        start_file.write_text(repr(time.time()))
        metrics = tmp_path / "p" / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            assert peer.poll() is None, (tmp_path / "log.txt").read_text()
            time.sleep(0.1)
    finally:
        assert stop_processes([peer]) == [0]
    log = (tmp_path / "log.txt").read_text()
    assert "murmur: listening on /ip4/127.0.0.1/tcp/" in log and "Traceback" not in log
    assert (tmp_path / "p" / "metrics.jsonl").read_text().strip()  # it trained once told to start


@pytest.mark.slow
def test_a_killed_peer_restarts_from_its_data_dir_with_its_identity_and_its_log(tmp_path: Path) -> None:
    from lab.swarm import kill_peer, restart_peer, wait_for_address

    extra = ["--task", "digits", "--step-time", "20", "--duration", "60"]
    peer = start_peer(0, tmp_path, 1.0, extra, None, fork=True)
    peers = [peer]
    try:
        assert peer.peer_id and wait_for_address(peer).endswith(f"/p2p/{peer.peer_id}")  # its ID is known before it listens
        assert kill_peer(peer) == -9 and not peer.alive()
        peers.append(again := restart_peer(peer, extra, None, fork=True))
        assert (again.data_dir, again.peer_id) == (peer.data_dir, peer.peer_id)
        assert wait_for_address(again).endswith(f"/p2p/{peer.peer_id}")
    finally:
        codes = stop_swarm(peers)
    assert codes == [-9, 0]
    assert again.log().count("murmur: listening on") == 2  # the first run's log is kept


def test_local_swarm_peers_do_not_inherit_murmur_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from lab.swarm import peer_environment

    monkeypatch.setenv("MURMUR_METRICS_PORT", "9100")  # every peer after the first could not bind it
    monkeypatch.setenv("PATH_FOR_TEST", "kept")
    env = peer_environment()
    assert "MURMUR_METRICS_PORT" not in env and env["PATH_FOR_TEST"] == "kept"


def test_only_a_python_module_peer_can_be_forked(tmp_path: Path) -> None:
    from lab.swarm import start_peer

    with pytest.raises(ValueError, match="a forked peer runs a module"):
        start_peer(0, tmp_path, 1.0, [], None, command=["adversary"], fork=True)


@pytest.mark.slow
def test_swarm_with_the_outer_rule_and_merged_optimizer_state_learns_over_libp2p(tmp_path: Path) -> None:
    # The lab's best outer setting (README, "Learning per sample"), SGD's momentum merged with the model.
    extra = ["--task", "digits", "--step-time", "20", "--duration", "120", "--merge", "outer", "--outer-lr", "0.8",
             "--outer-momentum", "0.3", "--optimizer-state", "average", "--checkpoint-every", "2"]
    peers = start_swarm(tmp_path, [1, 1, 2], extra, fork=True)
    try:
        _wait_until_learned(peers, merged_at_least=3)
    finally:
        codes = stop_swarm(peers)
    assert codes == [0, 0, 0]
    import torch

    from murmur.node.learn.checkpoint import load_latest
    from murmur.node.ops.checkpoints import CHECKPOINT_DIR

    for peer in peers:
        assert "Traceback" not in (peer.data_dir / "log.txt").read_text()
        found = load_latest(peer.data_dir / CHECKPOINT_DIR)
        assert found is not None
        state, _ = found
        rule = state["merge_rule"]
        assert rule["name"] == "outer" and rule["state"]["lr"] == 0.8  # the anchor and momentum survive a restart
        anchor = rule["state"]["anchor"]
        assert any(name.startswith("optimizer.") for name in anchor)  # the momentum travelled with the model
        assert all(torch.isfinite(t).all() for t in anchor.values())


@pytest.mark.slow
def test_a_swarm_gossiping_strongly_compressed_deltas_learns_over_libp2p(tmp_path: Path) -> None:
    extra = ["--task", "digits", "--step-time", "20", "--duration", "120", "--compression", "strong", "--checkpoint-every", "2"]
    peers = start_swarm(tmp_path, [1, 1, 2], extra, fork=True)
    try:
        _wait_until_learned(peers, merged_at_least=3)
        statuses = [p.status() for p in peers]
    finally:
        codes = stop_swarm(peers)
    assert codes == [0, 0, 0]
    from murmur.node.learn.checkpoint import load_latest
    from murmur.node.ops.checkpoints import CHECKPOINT_DIR

    for peer, status in zip(peers, statuses, strict=True):
        assert "Traceback" not in (peer.data_dir / "log.txt").read_text()
        # An exchange carries a few deltas (the peer's own and those it passes on); uncompressed, one int8 model is 1/4.
        assert status.bytes_per_merge is not None and 0 < status.bytes_per_merge <= status.model_bytes / 20
        found = load_latest(peer.data_dir / CHECKPOINT_DIR)
        assert found is not None
        saved = found[0]["delta_reference"]  # the reference travels with the model, and what it holds
        assert set(saved["reference"]) == set(found[0]["model"]) and len(saved["versions"]) >= 3


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
