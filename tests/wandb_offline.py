"""Read back what an offline W&B run wrote (`WANDB_MODE=offline`): its run record and its history rows.

An offline run keeps everything in `<WANDB_DIR>/wandb/offline-run-*/run-<id>.wandb`: a 7-byte
header (":W&B", a 2-byte magic, a version byte), then LevelDB's log format (32 KiB blocks of
chunks, each a 4-byte CRC, a 2-byte length and a 1-byte type: 1 full, 2 first, 3 middle,
4 last) whose records are wandb's own `Record` protobufs. wandb ships no reader of it.
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    project: str
    name: str
    group: str
    config: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)  # one dict per `run.log`, with `_step`


def records(path: Path) -> list[bytes]:
    """The records of a .wandb file, each reassembled from its chunks; raises ValueError for a file that is not one."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file (header {data[:7]!r})")
    out, parts, pos = [], b"", HEADER
    while pos + CHUNK_HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + length]
        if len(chunk) != length or kind not in (FULL, FIRST, MIDDLE, LAST):
            raise ValueError(f"{path}: a broken chunk at byte {pos} (type {kind}, length {length})")
        pos += CHUNK_HEADER + length
        parts += chunk
        if kind in (FULL, LAST):
            out.append(parts)
            parts = b""
    return out


def read_offline_run(wandb_dir: Path, timeout: float = 30.0) -> OfflineRun:
    """The one offline run under `wandb_dir` (what `WANDB_DIR` was), once its file is complete.

    `run.finish()` can return before W&B's service process has written the run's last records, so
    this reads the file again until it ends with the run's exit record, for up to `timeout` seconds.
    Raises AssertionError unless there is exactly one run, or if its file is not complete in time.
    """
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        files = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
        assert len(files) <= 1, f"expected one offline run under {wandb_dir}, found {files}"
        try:
            found = [wandb_internal_pb2.Record.FromString(data) for data in records(files[0])] if files else []
        except ValueError:  # a chunk still being written
            found = []
        if found and found[-1].WhichOneof("record_type") == "exit":
            break
        assert time.monotonic() < deadline, f"no complete offline run under {wandb_dir} within {timeout} s: {files}"
        time.sleep(0.1)
    run: OfflineRun | None = None
    for record in found:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            run = OfflineRun(record.run.project, record.run.display_name, record.run.run_group, config)
        elif kind == "history" and run is not None:
            run.history.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    assert run is not None, f"{files[0]} holds no run record"
    return run
