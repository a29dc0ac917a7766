"""lab.soak_probe: a peer's /proc figures and checkpoint bytes, read from outside, never raising for what vanished."""

import os
import subprocess
import sys
from pathlib import Path

from lab.soak_probe import checkpoint_stats, checkpoints, process_stats


def test_process_stats_reads_a_live_process_and_nothing_of_a_gone_one() -> None:
    stats = process_stats(os.getpid())
    assert stats["rss_bytes"] > 1_000_000 and stats["threads"] >= 1 and stats["fds"] >= 3
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_stats(child.pid) == {}


def test_an_open_file_shows_in_the_fd_count() -> None:
    before = process_stats(os.getpid())["fds"]
    with open(__file__):
        assert process_stats(os.getpid())["fds"] == before + 1


def test_checkpoint_stats_count_every_file_and_checkpoints_only_finished_ones(tmp_path: Path) -> None:
    assert checkpoint_stats(tmp_path) == {"checkpoint_bytes": 0, "checkpoint_files": 0}
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "checkpoint-00000002.pt").write_bytes(b"x" * 100)
    (folder / "checkpoint-00000001.pt").write_bytes(b"x" * 50)
    (folder / ".checkpoint-00000003.pt.tmp").write_bytes(b"x" * 7)
    assert checkpoint_stats(tmp_path) == {"checkpoint_bytes": 157, "checkpoint_files": 3}
    assert [p.name for p in checkpoints(tmp_path)] == ["checkpoint-00000001.pt", "checkpoint-00000002.pt"]
