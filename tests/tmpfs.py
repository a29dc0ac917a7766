"""A small tmpfs for full-disk tests: mounted for the block, unmounted after (needs root, else the test is skipped)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of `size_kib` KiB mounted at `path` (made if missing) for the block: a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    # A unique source name, so `umount` below can only ever meet this mount.
    source = f"murmur-test-{uuid.uuid4().hex[:8]}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", source, str(path)],
                             capture_output=True, text=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)
