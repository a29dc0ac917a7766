"""The short chaos run: SIGKILL churn in a swarm of processes stalls and corrupts no one."""

from pathlib import Path

import pytest

from lab.chaos import run_chaos

pytestmark = pytest.mark.slow


def test_short_chaos_run(tmp_path: Path) -> None:
    # Four kills (at 3, 6, 9 and 12 s: none comes within 5 s of the end), and the first one's victim is
    # checked for being forgotten once the liveness timeout has passed.
    report = run_chaos(peers=4, duration=18.0, kill_every=3.0, out=tmp_path)
    assert report["churn"]["kills"] >= 3
    # 18 s of training judged on 360 held-out images (a point is 3.6 of them) is noisy: here
    # the churned swarm may trail by up to 3 points; the long run (lab/chaos.py) holds it to 1.
    assert [f for f in report["failures"] if not f.startswith("accuracy")] == [], report
    assert report["accuracy_gap"] is not None and report["accuracy_gap"] <= 0.03, report
    # Processes stopped by SIGTERM exit 0; the SIGKILLed ones report -9.
    assert set(report["churn"]["exit_codes"]) <= {0, -9}
    assert set(report["calm"]["exit_codes"]) == {0}
