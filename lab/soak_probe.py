"""What the soak run (`lab.soak`) reads of a running peer from outside it: /proc and its data dir.

Every reader returns what it could read and never raises for a process or file that vanished
while it looked (a peer may be stopped, or prune a checkpoint, at any moment).
"""

from __future__ import annotations

import os
from pathlib import Path

CHECKPOINT_DIR = "checkpoints"  # a node's, under its data dir (murmur.node.ops.checkpoints)


def process_stats(pid: int) -> dict[str, int]:
    """{"rss_bytes", "threads", "fds"} of a live process from /proc; {} for a process already gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        return {"rss_bytes": int(fields["VmRSS"].split()[0]) * 1024, "threads": int(fields["Threads"]),
                "fds": len(os.listdir(f"/proc/{pid}/fd"))}  # fmt: skip
    except (OSError, KeyError, ValueError):  # gone, or a zombie (no VmRSS)
        return {}


def checkpoints(data_dir: Path) -> list[Path]:
    """The data dir's finished checkpoints, oldest first."""
    return sorted((data_dir / CHECKPOINT_DIR).glob("checkpoint-*.pt"))


def checkpoint_stats(data_dir: Path) -> dict[str, int]:
    """{"checkpoint_bytes", "checkpoint_files"}: every file under the data dir's checkpoints, temporaries included."""
    total, count = 0, 0
    for path in (data_dir / CHECKPOINT_DIR).glob("*"):
        try:
            total += path.stat().st_size
            count += 1
        except OSError:  # removed since the listing
            continue
    return {"checkpoint_bytes": total, "checkpoint_files": count}


