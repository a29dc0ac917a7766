"""The soak run's target rules (lab.soak_report) on synthetic samples: memory, growth, stalls, checkpoints, loss."""

import json

from lab.soak_report import (
    checkpoint_verdict,
    growth_verdict,
    judge,
    longest_stall,
    loss_verdict,
    memory_verdict,
    plot,
    slope,
    stall_verdict,
    summary_lines,
)

MIB = 2**20


def minutes(values: list[float], start: float = 0.0) -> list[tuple[float, float]]:
    """One sample a minute from `start` seconds."""
    return [(start + 60.0 * i, v) for i, v in enumerate(values)]


def test_memory_within_ten_percent_after_warmup_passes_and_a_leak_fails() -> None:
    warm = minutes(
        [100 * MIB, 300 * MIB, 400 * MIB, 410 * MIB, 405 * MIB, 430 * MIB]
    )  # the climb before warm-up is not judged
    verdict = memory_verdict(warm, warmup_s=120)
    assert verdict is not None and verdict.ok and "+7.5%" in verdict.reason
    leak = minutes([400 * MIB + i * 8 * MIB for i in range(10)])
    verdict = memory_verdict(leak, warmup_s=120)
    assert verdict is not None and not verdict.ok and "+13.5%" in verdict.reason


def test_memory_is_not_judged_without_two_samples_after_warmup() -> None:
    assert memory_verdict(minutes([100 * MIB, 200 * MIB, 300 * MIB]), warmup_s=120) is None


def test_slope_is_the_least_squares_line() -> None:
    assert slope([(0, 1), (1, 3), (2, 5)]) == 2.0
    assert slope([(5, 1)]) == 0.0 and slope([(1, 1), (1, 2)]) == 0.0


def test_a_steady_count_with_jitter_does_not_grow() -> None:
    fds = minutes([20, 22, 19, 21, 23, 20, 22, 21, 19, 22, 21, 20])
    verdict = growth_verdict(fds, warmup_s=60, absolute=8)
    assert verdict is not None and verdict.ok


def test_a_count_that_climbs_all_run_grows() -> None:
    tasks = minutes([50 + 3 * i for i in range(30)])  # a task leaked every 20 s
    verdict = growth_verdict(tasks, warmup_s=300, absolute=10)
    assert verdict is not None and not verdict.ok and "between thirds" in verdict.reason


def test_one_late_burst_is_not_growth_when_the_thirds_agree() -> None:
    # A heal reconnecting everyone at the very end lifts the trend line, not the thirds' medians.
    fds = minutes([20] * 14 + [60])
    verdict = growth_verdict(fds, warmup_s=0, absolute=8)
    assert verdict is not None and verdict.ok


def test_growth_before_warmup_or_in_the_first_third_is_not_judged() -> None:
    fds = minutes([5, 10, 15, 20, 40, 40, 41, 40, 40, 41, 40, 40])
    verdict = growth_verdict(fds, warmup_s=0, absolute=8)
    assert verdict is not None and verdict.ok
    assert growth_verdict(minutes([20, 21]), warmup_s=0, absolute=8) is None


def test_a_stall_is_the_longest_time_in_training_without_new_samples() -> None:
    obs = [(0, "joining", 0), (2, "training", 0), (4, "training", 32), (6, "training", 64)]
    obs += [(6 + 2 * i, "training", 64) for i in range(1, 18)]  # no progress from 6 s to 40 s
    obs += [(42, "training", 96)]
    assert longest_stall(obs) == 36.0
    assert not stall_verdict(longest_stall(obs)).ok
    assert stall_verdict(longest_stall(obs[:8])).ok


def test_time_outside_training_and_an_unfinished_interval_count_as_stated() -> None:
    waiting = [(0, "waiting", 0), (60, "waiting", 0), (62, "training", 0), (64, "training", 32)]
    assert longest_stall(waiting) == 2.0
    stuck_at_end = [(0, "training", 0), (2, "training", 32), (50, "training", 32)]
    assert longest_stall(stuck_at_end) == 48.0
    assert longest_stall([]) == 0.0


def test_a_restart_that_did_not_resume_is_a_lost_checkpoint() -> None:
    assert checkpoint_verdict([{"process": "p4.1", "resumed": True, "unusable": False}]).ok
    lost = checkpoint_verdict([{"process": "p4.1", "resumed": True, "unusable": False},
                               {"process": "p5.1", "resumed": False, "unusable": False}])  # fmt: skip
    assert not lost.ok and "p5.1" in lost.reason and "1 of 2" in lost.reason
    assert not checkpoint_verdict([{"process": "p6.1", "resumed": True, "unusable": True}]).ok


def test_loss_must_keep_falling_by_thirds() -> None:
    falling = minutes([3.0, 2.5, 2.2, 2.1, 2.0, 1.95, 1.9, 1.88, 1.85])
    verdict = loss_verdict(falling, warmup_s=0)
    assert verdict is not None and verdict.ok
    rising_again = minutes([3.0, 2.5, 2.2, 2.0, 1.9, 1.9, 2.0, 2.1, 2.2])
    verdict = loss_verdict(rising_again, warmup_s=0)
    assert verdict is not None and not verdict.ok
    assert loss_verdict(minutes([3.0, 2.0]), warmup_s=0) is None


def synthetic_run(leak: bool) -> dict:
    """A soak document as lab.soak writes it: two processes sampled for 20 minutes, one restart."""
    samples = []
    for name in ("p1", "p2"):
        for i in range(20):
            samples.append({"t": 60.0 * i, "process": name, "age_s": 60.0 * i, "rss_bytes": 400 * MIB,
                            "fds": 20 + (2 * i if leak and name == "p2" else 0), "threads": 3, "trio_tasks": 60,
                            "checkpoint_bytes": 4 * MIB, "loss": 3.0 - 0.05 * i})  # fmt: skip
    return {
        "config": {"duration": 1200.0},
        "processes": [{"name": "p1", "longest_stall_s": 2.0}, {"name": "p2", "longest_stall_s": 4.0}],
        "restarts": [{"process": "p2", "restart_of": "p2", "resumed": True, "unusable": False}],
        "events": [{"t": 300.0, "kind": "sigkill", "process": "p2", "detail": ""}],
        "samples": samples,
        "swarm": [{"t": 60.0 * i, "median_loss": 3.0 - 0.05 * i, "merges": 10 * i, "live": 2} for i in range(20)],
    }


def test_judge_passes_a_clean_run_and_names_the_leaking_process(tmp_path) -> None:
    clean = judge(synthetic_run(leak=False), warmup_s=120)
    assert all(v["ok"] for v in clean.values()), clean
    leaky = judge(synthetic_run(leak=True), warmup_s=120)
    assert not leaky["fds"]["ok"] and leaky["fds"]["reasons"][0].startswith("p2:")
    assert leaky["memory"]["ok"] and leaky["stall"]["ok"]
    lines = summary_lines(synthetic_run(leak=True), leaky)
    assert lines[0].startswith("soak: 1200 s, 2 processes, events sigkill 1")
    assert any(line.startswith("  FAIL fds: p2:") for line in lines)
    plot(synthetic_run(leak=True), tmp_path / "soak.png")
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    json.dumps(leaky)  # the verdicts go into soak.json as they are


def test_a_run_that_judged_nothing_passes_nothing() -> None:
    run = synthetic_run(leak=False)
    run["samples"] = [s for s in run["samples"] if s["age_s"] < 120]
    run["swarm"] = run["swarm"][:2]
    checks = judge(run, warmup_s=120)
    assert not checks["memory"]["ok"] and checks["memory"]["reasons"] == ["nothing judged"]
    assert not checks["loss"]["ok"]
