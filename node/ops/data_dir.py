"""One node per data dir: an OS file lock on `<data dir>/murmur.lock`, held while the node runs.

Two nodes on one folder would share an identity and write each other's checkpoints. The lock
is `flock`'s: the kernel releases it when its holder exits, crashed or killed included, so a
lock file left behind never blocks the next node. The file holds the holder's PID, for the
message that names it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Self

LOCK_FILE = "murmur.lock"


class DataDirError(Exception):
    """The data dir cannot be used: the message names the folder and why, in one line."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


class DataDirLocked(DataDirError):
    """Another live node (process `pid`, None if it could not be read) holds the data dir."""

    def __init__(self, path: Path, pid: int | None) -> None:
        holder = f"PID {pid}" if pid is not None else "PID unknown"
        super().__init__(
            path, f"data dir {path} is in use by another Murmur node ({holder}); each node needs its own data dir"
        )
        self.pid = pid


class DataDirUnusable(DataDirError):
    """The data dir cannot be created or written (a read-only mount, missing permissions); `reason` is the OS's."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(path, f"cannot write to data dir {path}: {reason}")
        self.reason = reason


class DataDirLock:
    """The held lock on one data dir; `release` (or leaving the `with` block) gives it up."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        """Create `data_dir` if needed and lock it for this process, without waiting.

        Raises `DataDirLocked` if a live process holds it, `DataDirUnusable` if the folder or its
        lock file cannot be created or written.
        """
        path = Path(data_dir).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataDirUnusable(path, exc.strerror or str(exc)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise DataDirLocked(path, pid) from None
        except OSError as exc:  # a file system without locks
            os.close(fd)
            raise DataDirUnusable(path, f"cannot lock {LOCK_FILE}: {exc.strerror or exc}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:  # a full disk
            os.close(fd)
            raise DataDirUnusable(path, exc.strerror or str(exc)) from None
        return cls(path, fd)

    def release(self) -> None:
        """Give the lock up (idempotent); the lock file stays, empty of meaning once unlocked."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` at once (a temporary file renamed); raises `OSError` and leaves no temporary."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk gets the space back
        raise


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline to `path`; raises `OSError`."""
    with path.open("a") as f:
        f.write(line + "\n")
