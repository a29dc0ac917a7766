"""What a `murmur run` process leaves on disk when it is killed mid-checkpoint or its disk fills up.

Real processes over loopback (`lab.swarm`); the checkpoint file format itself is `test_checkpoint.py`'s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tmpfs import small_disk

from lab.swarm import (
    LOOPBACK,
    Peer,
    peer_environment,
    restart_peer,
    start_peer,
    stop_processes,
    stop_swarm,
    wait_for_address,
)
from murmur.node.learn.checkpoint import load_latest, newest_first, read_checkpoint
from murmur.node.ops.checkpoints import CHECKPOINT_DIR

pytestmark = pytest.mark.slow


def _wait_for(condition, what: str, peer: Peer, timeout: float = 90.0):
    """Poll `condition()` until it returns something true; fail naming `what` if the peer exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        assert peer.alive(), f"peer exited ({peer.process.returncode}) waiting for {what}:\n{peer.log()[-3000:]}"
        time.sleep(0.05)
    pytest.fail(f"no {what} within {timeout:g}s:\n{peer.log()[-3000:]}")


def _kill_mid_write(peer: Peer, directory: Path, timeout: float = 120.0) -> str:
    """SIGKILL `peer` while it writes a checkpoint that has a predecessor; return the unfinished temporary's name.

    The peer is frozen (SIGSTOP) as soon as a temporary appears; only if the temporary is still
    there once it is frozen is it killed, else it runs on until its next write.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert peer.alive(), peer.log()[-3000:]
        names = os.listdir(directory) if directory.is_dir() else []
        unfinished = [n for n in names if n.endswith(".pt.tmp")]
        if unfinished and any(n.startswith("checkpoint-") for n in names):
            os.kill(peer.process.pid, signal.SIGSTOP)
            if (directory / unfinished[0]).exists():
                os.kill(peer.process.pid, signal.SIGKILL)
                assert peer.process.wait(timeout=10) == -signal.SIGKILL
                return unfinished[0]
            os.kill(peer.process.pid, signal.SIGCONT)  # the write finished meanwhile: catch the next one
        time.sleep(0.002)
    pytest.fail("never caught a checkpoint write in progress")


def test_a_peer_killed_mid_checkpoint_resumes_from_the_previous_one(tmp_path: Path) -> None:
    # charlm-large: a checkpoint of ~26 MB takes a good fraction of a second to write and fsync.
    extra = ["--task", "charlm-large", "--checkpoint-every", "1", "--eval-every", "600"]
    peer = start_peer(0, tmp_path, 1.0, extra, None, fork=True)
    peers = [peer]
    directory = peer.data_dir / CHECKPOINT_DIR
    try:
        wait_for_address(peer)
        unfinished = _kill_mid_write(peer, directory)
        assert (directory / unfinished).exists()  # the stray temporary of the killed write
        previous = newest_first(directory)[0]
        assert int(re.findall(r"\d{8}", unfinished)[0]) == int(re.findall(r"\d{8}", previous.name)[0]) + 1
        kept = read_checkpoint(previous)  # verified: the kill damaged nothing under a real name
        assert kept["samples"] > 0

        peers.append(again := restart_peer(peer, extra, None, fork=True))
        resumed = f"resumed from {previous.name} (work {kept['work']:.0f}, {kept['samples']} samples)"
        _wait_for(lambda: resumed in again.log(), "resume line", again)
        assert f"removed {unfinished}: an unfinished checkpoint write" in again.log()
        # Its status counts on from the kept checkpoint, and its next checkpoint is a good one.
        status = _wait_for(lambda: (s := again.status()) and s.samples > kept["samples"] and s, "training", again)
        assert status.work >= kept["work"]
        _wait_for(lambda: any(p.name > previous.name for p in newest_first(directory)), "next checkpoint", again)
    finally:
        codes = stop_swarm(peers)
    assert codes == [-signal.SIGKILL, 0]
    assert load_latest(directory)[0]["samples"] > kept["samples"]
    assert not [n for n in os.listdir(directory) if n.endswith(".tmp")]
    assert "Traceback" not in again.log()


def test_a_full_disk_keeps_the_previous_checkpoint_and_the_peer_training(tmp_path: Path) -> None:
    # The checkpoints folder is a disk with room for one digits checkpoint (~80 kB) but not two.
    data_dir = tmp_path / "peer-0"
    with small_disk(data_dir / CHECKPOINT_DIR, 128) as directory:
        extra = ["--task", "digits", "--checkpoint-every", "0.5", "--step-time", "20"]
        peer = start_peer(0, tmp_path, 1.0, extra, None, fork=True)
        try:
            wait_for_address(peer)
            failed = (f"checkpoint failed: no space left on device writing checkpoint {directory / 'checkpoint-00000002.pt'}; "
                      "training goes on, checkpoint-00000001.pt is kept")  # fmt: skip
            _wait_for(lambda: failed in peer.log(), "checkpoint failure line", peer)
            before = peer.status().samples
            _wait_for(lambda: peer.status().samples > before, "training after the failure", peer)
            time.sleep(1.5)  # three more periods: each fails again, and says so only once
            assert peer.log().count("checkpoint failed") == 1
            kept = read_checkpoint(directory / "checkpoint-00000001.pt")
            os.kill(peer.process.pid, signal.SIGTERM)
            code = peer.process.wait(timeout=60)  # the checkpoint on exit fails too
        finally:
            stop_swarm([peer])
        assert os.listdir(directory) == ["checkpoint-00000001.pt"]  # no temporary left behind
        assert load_latest(directory)[0]["samples"] == kept["samples"]
    log = peer.log()
    assert code == 1, log[-3000:]
    assert log.splitlines()[-1] == ("murmur run: error: no space left on device writing checkpoint "
                                    f"{directory / 'checkpoint-00000002.pt'}")  # fmt: skip
    assert "Traceback" not in log


def _fill(disk: Path) -> Path:
    """Fill `disk` to the last page with one file; return it."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        for block in (1 << 16, 1 << 12):  # big blocks, then pages: no page is left for another file
            try:
                for _ in range((4 << 20) // block):  # bounded: the disks here are far smaller
                    f.write(b"\0" * block)
            except OSError:
                pass
    return filler


def test_a_full_data_dir_is_survived_and_every_write_resumes_once_space_is_freed(tmp_path: Path) -> None:
    # The user's `murmur run` (its log on stderr, not in the data dir), its whole data dir on a small disk.
    log_path = tmp_path / "log.txt"
    with small_disk(tmp_path / "data", 1024) as data_dir:
        argv = [sys.executable, "-m", "murmur.node.cli", "run", "--data-dir", str(data_dir), "--listen", LOOPBACK,
                "--task", "digits", "--threads", "1", "--checkpoint-every", "0.5", "--progress-every", "0.5"]  # fmt: skip
        with log_path.open("w") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=peer_environment()
            )
        peer = Peer(0, 1.0, data_dir, process)
        peer.log = log_path.read_text  # type: ignore[method-assign]
        try:
            _wait_for(
                lambda: (data_dir / CHECKPOINT_DIR / "checkpoint-00000001.pt").exists() and peer.status(),
                "checkpoint",
                peer,
            )
            filler = _fill(data_dir)
            _wait_for(lambda: "cannot write status.json: No space left on device; the node runs on without it" in peer.log(),
                      "status failure line", peer)  # fmt: skip
            _wait_for(
                lambda: "checkpoint failed: no space left on device" in peer.log(), "checkpoint failure line", peer
            )
            progress = peer.log().count("samples/s")
            _wait_for(lambda: peer.log().count("samples/s") >= progress + 2, "progress while the disk is full", peer)
            stale = peer.status().samples
            filler.unlink()
            _wait_for(lambda: "status.json is written again" in peer.log(), "status resumed line", peer)
            _wait_for(lambda: "checkpoints are written again" in peer.log(), "checkpoint resumed line", peer)
            assert peer.status().samples > stale
            os.kill(process.pid, signal.SIGTERM)
            code = process.wait(timeout=60)
        finally:
            stop_processes([process])
        names = sorted(os.listdir(data_dir / CHECKPOINT_DIR))
        assert len(names) == 2 and all(n.startswith("checkpoint-") and n.endswith(".pt") for n in names), names
        assert not [n for n in os.listdir(data_dir) if n.endswith(".tmp")]
    log = log_path.read_text()
    assert code == 0, log[-3000:]
    assert (
        log.count("cannot write status.json") == 1 and log.count("checkpoint failed") == 1
    )  # once each, not every second
    assert "Traceback" not in log
