"""Per-process CPU quotas (`lab.cpu_quota`): a group per process, limited, and removed however the process ended."""

import os
import signal
import subprocess
import sys
import time

import pytest

from lab import cpu_quota

BUSY = [sys.executable, "-c", "while True: pass"]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (/proc/PID/stat)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def quotas_here() -> None:
    reason = cpu_quota.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_each_adopted_process_gets_a_limited_group_removed_afterwards_also_when_it_was_killed(quotas_here: None) -> None:
    busy = [subprocess.Popen(BUSY) for _ in range(2)]
    try:
        with cpu_quota.quotas(0.2) as quotas:
            assert quotas is not None
            for p in busy:
                cpu_quota.adopt(p.pid)
            groups = dict(quotas.groups)
            assert sorted(groups) == sorted(p.pid for p in busy) and len(set(groups.values())) == 2  # one group each
            assert all((g / "cgroup.procs").read_text().split() == [str(pid)] for pid, g in groups.items())
            before = [_cpu_s(p.pid) for p in busy]
            time.sleep(1.0)
            used = [_cpu_s(p.pid) - b for p, b in zip(busy, before)]
            assert all(u < 0.45 for u in used), used  # 0.2 of a core, not a whole one
            assert sorted(quotas.throttled()) == sorted(groups)  # how often each was held back (none on a busy machine)
            busy[0].send_signal(signal.SIGKILL)  # a peer killed mid-run
            busy[0].wait(timeout=10)
            parent = quotas.parent
        assert not parent.exists() and not any(g.exists() for g in groups.values())
        assert busy[1].poll() is None  # a process still running went back to the root group, alive
    finally:
        for p in busy:
            p.kill()
            p.wait(timeout=10)


def test_adopt_does_nothing_without_quotas_and_quotas_do_not_nest(quotas_here: None) -> None:
    cpu_quota.adopt(os.getpid())  # no quotas in force: nothing moves
    with cpu_quota.quotas(None) as none:
        assert none is None
    with cpu_quota.quotas(0.5), pytest.raises(RuntimeError, match="one run at a time"):
        with cpu_quota.quotas(0.5):
            pass
    with pytest.raises(ValueError, match="must be positive"):
        cpu_quota.CpuQuotas(0.0)


def test_without_root_there_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cpu_quota.unavailable_reason() == "CPU quotas need root (cgroups)"
    with pytest.raises(cpu_quota.QuotaUnavailable, match="need root"):
        cpu_quota.CpuQuotas(0.5)
