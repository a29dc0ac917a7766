"""Durable checkpoints: atomic, checksummed, with fallback to the previous one.

A checkpoint file is `payload | TRAILER_MAGIC | sha256(payload)`, where the payload is a
`torch.save` of plain tensors and numbers: `torch.load(path, weights_only=True)` reads the
file as it is (it ignores the trailer), and Murmur checks the digest first. Files that
earlier versions wrote, `MAGIC | sha256(payload) | payload`, still load. Writes go
to a temporary file that is fsynced and renamed, so a crash mid-write leaves at worst
a stray temporary file, never a damaged checkpoint under a real name (`remove_unfinished`
clears it at the next start); a write that fails, a full disk say, removes its temporary
and raises `CheckpointWriteFailed`. The newest `KEEP` checkpoints are kept; loading walks
from the newest to the oldest and reports each unusable one in a single line.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

MAGIC = b"MURMURCK1"  # the header of checkpoints written before the trailer
TRAILER_MAGIC = b"MURMURCK2"
TRAILER = len(TRAILER_MAGIC) + 32
HASH_CHUNK = 1 << 20
KEEP = 2
_NAME = re.compile(r"^checkpoint-(\d{8})\.pt$")
_UNFINISHED = re.compile(r"^\.checkpoint-(\d{8})\.pt\.tmp$")
log = logging.getLogger("murmur.checkpoint")


class CorruptCheckpoint(Exception):
    """A checkpoint file is truncated, altered or not a checkpoint; the message says which."""


class CheckpointWriteFailed(Exception):
    """A checkpoint could not be written (a full disk, a read-only folder); the message names the file and why.

    `errno` is the operating system's error number. The checkpoints written before are untouched.
    """

    def __init__(self, message: str, errno: int | None) -> None:
        super().__init__(message)
        self.errno = errno


def _numbered(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


class _Hashing:
    """A write-only file that hashes what passes through it (what `torch.save` needs of a file)."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write `state` as the newest checkpoint in `directory`; prune older ones. Returns its path.

    Raises `CheckpointWriteFailed` if the file system refuses the write (no space left, no
    permission), having removed the temporary file: the older checkpoints stay as they were.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _write_failed(directory, exc) from exc
    existing = _numbered(directory)
    number = existing[-1][0] + 1 if existing else 1
    path = directory / f"checkpoint-{number:08d}.pt"
    tmp = directory / f".{path.name}.tmp"
    try:
        _write_synced(tmp, state)
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # a full disk gets its space back at once
        cause = _os_error(exc) if isinstance(exc, Exception) else None
        if cause is None:
            raise
        raise _write_failed(path, cause) from exc
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    for _, old in (existing + [(number, path)])[:-KEEP]:
        old.unlink(missing_ok=True)
    return path


def _write_synced(tmp: Path, state: dict[str, Any]) -> None:
    with open(tmp, "wb") as f:
        # Streamed to the file and hashed on the way, so a checkpoint never holds its payload in memory.
        payload = _Hashing(f)
        torch.save(state, payload)
        f.write(TRAILER_MAGIC + payload.sha256.digest())
        f.flush()
        os.fsync(f.fileno())


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: torch.save reports a failed write as a RuntimeError whose context is the OSError."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _write_failed(path: Path, error: OSError) -> CheckpointWriteFailed:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointWriteFailed(f"no space left on device writing checkpoint {path}", error.errno)
    return CheckpointWriteFailed(f"cannot write checkpoint {path}: {error.strerror or error}", error.errno)


def remove_unfinished(directory: Path) -> list[str]:
    """Delete the temporary files of checkpoint writes that never finished (the process was killed mid-write).

    Call it only while no write is in progress, i.e. before this data dir's node starts. Returns the
    names removed. Loading never reads these files, so they only take space.
    """
    if not directory.is_dir():
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        if _UNFINISHED.match(name):
            (directory / name).unlink(missing_ok=True)
            removed.append(name)
    return removed


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Read and verify one checkpoint; raises `CorruptCheckpoint` naming the problem.

    The digest is checked a chunk at a time before anything is unpickled, so reading holds the
    loaded state, not the file's bytes too.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if f.read(len(MAGIC)) == MAGIC:
            return _read_headed(path, f.read())
        if size < TRAILER:
            raise CorruptCheckpoint(f"{path.name}: not a Murmur checkpoint or truncated ({size} bytes)")
        f.seek(size - TRAILER)
        trailer = f.read(TRAILER)
        if not trailer.startswith(TRAILER_MAGIC):
            raise CorruptCheckpoint(f"{path.name}: no checksum trailer (truncated, or not a Murmur checkpoint)")
        f.seek(0)
        sha256, left = hashlib.sha256(), size - TRAILER
        while left > 0 and (chunk := f.read(min(HASH_CHUNK, left))):
            sha256.update(chunk)
            left -= len(chunk)
        if sha256.digest() != trailer[len(TRAILER_MAGIC) :]:
            raise CorruptCheckpoint(f"{path.name}: checksum mismatch (altered, {size - TRAILER} payload bytes)")
        f.seek(0)
        return _loaded(path, f)


def _read_headed(path: Path, rest: bytes) -> dict[str, Any]:
    """A checkpoint in the earlier layout, `MAGIC | digest | payload`; `rest` is what follows MAGIC."""
    digest, payload = rest[:32], rest[32:]
    if len(digest) < 32 or hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{path.name}: checksum mismatch (truncated or altered, {len(payload)} payload bytes)")
    return _loaded(path, io.BytesIO(payload))


def _loaded(path: Path, payload: Any) -> dict[str, Any]:
    try:
        # map_location: a checkpoint written next to a GPU still loads on a CPU-only machine.
        state = torch.load(payload, weights_only=True, map_location="cpu")
    except Exception as exc:  # checksum matched, so this is a format/version problem
        raise CorruptCheckpoint(f"{path.name}: unreadable payload ({exc})") from None
    if not isinstance(state, dict):
        raise CorruptCheckpoint(f"{path.name}: payload is not a checkpoint dictionary")
    return state


def newest_first(directory: Path) -> list[Path]:
    """The checkpoint files in `directory`, newest first (none if it does not exist)."""
    return [path for _, path in reversed(_numbered(directory))]


def load_latest(directory: Path) -> tuple[dict[str, Any], Path] | None:
    """The newest valid checkpoint in `directory` and its path, or None if there is none.

    Each unusable checkpoint is logged in one line and skipped in favour of an older one.
    """
    for path in newest_first(directory):
        try:
            return read_checkpoint(path), path
        except (CorruptCheckpoint, OSError) as exc:
            log.warning("checkpoint unusable: %s; trying an older one", exc)
            # Set it aside so pruning after the next save cannot delete the good ones.
            path.replace(path.with_name(path.name + ".corrupt"))
    return None
