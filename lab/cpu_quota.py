"""An equal CPU quota for every emulated peer and rank: each process the lab starts in a run gets a cgroup of its own.

Sleep pacing makes a peer slow, not alone: four peers on two cores still share them, so one
peer's exchange (codec, crypto, merge) is paid by whichever process the scheduler picks, and a
result depends on the machine's headroom. Inside `quotas(cores)` every process the lab starts
(`adopt`, called where the lab forks peers and ranks) runs in its own group limited to `cores`
CPUs, so it pays for its own work, as on a machine of its own.

Two hierarchies, one interface: cgroup v1's cpu controller (`cpu.cfs_quota_us`) and cgroup v2
(`cpu.max`). Groups live under one parent per `CpuQuotas`; `close` removes every group, also
those of processes that were killed, moving any process still inside back to the root first.
Needs root; `unavailable_reason` says why not where it cannot work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

PERIOD_US = 100_000
V1_ROOT = Path("/sys/fs/cgroup/cpu")
V2_ROOT = Path("/sys/fs/cgroup")
REMOVE_WAIT_S = 2.0  # an exiting process leaves its group a moment after it is reaped


class QuotaUnavailable(RuntimeError):
    """This machine cannot give processes CPU quotas; the message says why."""


class Hierarchy(Protocol):
    """Where a cgroup version keeps its groups and how it limits one."""

    root: Path

    def limit(self, group: Path, cores: float) -> None: ...

    def throttled(self, group: Path) -> tuple[int, float]:
        """(periods throttled, seconds throttled) so far."""
        ...


class V1:
    """cgroup v1's cpu controller, mounted on its own."""

    root = V1_ROOT

    def limit(self, group: Path, cores: float) -> None:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(max(1000, round(cores * PERIOD_US))))

    def throttled(self, group: Path) -> tuple[int, float]:
        stat = _stat(group)
        return stat.get("nr_throttled", 0), stat.get("throttled_time", 0) / 1e9


class V2:
    """The unified hierarchy, with the cpu controller enabled for the groups below the root."""

    root = V2_ROOT

    def limit(self, group: Path, cores: float) -> None:
        (group / "cpu.max").write_text(f"{max(1000, round(cores * PERIOD_US))} {PERIOD_US}")

    def throttled(self, group: Path) -> tuple[int, float]:
        stat = _stat(group)
        return stat.get("nr_throttled", 0), stat.get("throttled_usec", 0) / 1e6


def _stat(group: Path) -> dict[str, int]:
    lines = (group / "cpu.stat").read_text().split("\n")
    return {key: int(value) for key, value in (line.split() for line in lines if line.strip())}


def hierarchy() -> Hierarchy | None:
    """The cgroup hierarchy that can limit CPU here, or None."""
    if (V1_ROOT / "cpu.cfs_quota_us").exists():
        return V1()
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return V2()
    return None


def unavailable_reason() -> str | None:
    """Why this machine cannot give processes CPU quotas (not root, no cpu controller), or None if it can."""
    if os.geteuid() != 0:
        return "CPU quotas need root (cgroups)"
    found = hierarchy()
    if found is None:
        return "no cgroup cpu controller here (neither v1's nor v2's)"
    if not os.access(found.root, os.W_OK):
        return f"{found.root} is not writable"
    if isinstance(found, V2) and "cpu" not in (found.root / "cgroup.subtree_control").read_text().split():
        return f"the cpu controller is not enabled below {found.root} (cgroup.subtree_control)"
    return None


class CpuQuotas:
    """One cgroup per adopted process, each limited to `cores` CPUs, under a parent of its own.

    Raises `QuotaUnavailable` if this machine cannot give quotas (`unavailable_reason`).
    """

    def __init__(self, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"a CPU quota must be positive, got {cores!r}")
        reason = unavailable_reason()
        found = hierarchy()
        if reason is not None or found is None:
            raise QuotaUnavailable(reason)
        self.cores = cores
        self._hierarchy = found
        self.parent = found.root / f"murmur-lab-{os.getpid()}-{time.monotonic_ns()}"
        self.parent.mkdir()
        if isinstance(found, V2):  # v2: the parent hands the cpu controller on to its children
            (self.parent / "cgroup.subtree_control").write_text("+cpu")
        self.groups: dict[int, Path] = {}

    def adopt(self, pid: int) -> Path:
        """Move process `pid` (and the children it starts from now on) into a new group of `cores` CPUs; its path."""
        group = self.parent / f"pid-{pid}"
        group.mkdir()
        self._hierarchy.limit(group, self.cores)
        (group / "cgroup.procs").write_text(str(pid))
        self.groups[pid] = group
        return group

    def throttled(self) -> dict[int, tuple[int, float]]:
        """Per adopted PID whose group is still there: (periods throttled, seconds throttled)."""
        return {pid: self._hierarchy.throttled(group) for pid, group in self.groups.items() if group.exists()}

    def close(self) -> None:
        """Remove every group and the parent; a process still inside one goes back to the root group first."""
        for group in [*self.groups.values(), self.parent]:
            _remove(group, self._hierarchy.root)
        self.groups.clear()


def _remove(group: Path, root: Path) -> None:
    deadline = time.monotonic() + REMOVE_WAIT_S
    while group.exists():
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass  # it exited meanwhile
        try:
            group.rmdir()
        except OSError:  # EBUSY while a process that just exited is still leaving
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


_active: CpuQuotas | None = None


@contextmanager
def quotas(cores: float | None) -> Iterator[CpuQuotas | None]:
    """While the context runs, `adopt` gives every process the lab starts `cores` CPUs of its own (None: no quotas).

    The groups are removed when it exits, however it exits. Raises `QuotaUnavailable` where quotas cannot work.
    """
    global _active
    if cores is None:
        yield None
        return
    if _active is not None:
        raise RuntimeError("CPU quotas are already in force: one run at a time")
    _active = CpuQuotas(cores)
    try:
        yield _active
    finally:
        active, _active = _active, None
        active.close()


def adopt(pid: int) -> None:
    """Give process `pid` its own quota if `quotas` is in force; otherwise nothing."""
    if _active is not None:
        _active.adopt(pid)
