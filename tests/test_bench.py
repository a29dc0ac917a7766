"""The benchmark harness end to end on its smallest configuration (no timing asserts)."""

import json
import os
from pathlib import Path

import pytest

from lab import cpu_quota
from lab.bench import run_bench
from lab.bench_config import METHODS, REFERENCES, at_chosen_lr
from murmur.node.learn.weight_average import DEFAULT_DECAY


@pytest.mark.slow
def test_smallest_bench_runs_every_method_and_writes_its_outputs(tmp_path: Path) -> None:
    config = {"tasks": ["digits"], "mixes": {"digits": ["pair"]}, "seeds": [0], "max_s": {"digits": 3.0}, "runs": at_chosen_lr(METHODS)}
    run_bench(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert [r["method"] for r in results] == [*REFERENCES, *METHODS]
    for r in results:
        assert r["samples_per_s"] > 0 and r["curve"], r["method"]
        assert len(r["peers"]) == 2
        assert all(0 <= p["idle_fraction"] <= 1 for p in r["peers"])
    murmur = [r for r in results if r["method"].startswith("murmur")]
    assert all(r["exit_codes"] == [0, 0] for r in murmur)
    assert all(sum(p["exchanges"].get("merged", 0) for p in r["peers"]) > 0 for r in murmur)
    assert all(r["consensus"] for r in murmur)
    assert {r["ema_decay"] for r in results} == {DEFAULT_DECAY}  # every method evaluates alike, as `murmur run` does
    table = (tmp_path / "summary.md").read_text()
    reason = cpu_quota.unavailable_reason()
    assert table.startswith("Every peer and rank ran on a CPU quota of its own: 1 cores" if reason is None else f"No CPU quotas ({reason})")
    assert {r["cpu_quota"] for r in results} == ({1.0} if reason is None else {None})  # 2 cores, 2 peers
    if (found := cpu_quota.hierarchy()) is not None:
        assert not [g for g in found.root.iterdir() if g.name.startswith(f"murmur-lab-{os.getpid()}-")]  # all removed
    assert f"Every method evaluated a moving average of its weights, decay {DEFAULT_DECAY:g} (" in table
    assert "| digits | pair | murmur-work |" in table
    assert "| vs solo | vs median solo | ideal vs solo |" in table and "% of ideal throughput" in table
    assert "| digits | pair | solo |" in table and "Data-parallel headroom" in table
    solo = next(r for r in results if r["method"] == "solo")
    assert len(solo["solo_times"]) == 2 and all(r["ideal_vs_solo"] == pytest.approx(1.5) for r in results if r["method"] != "headroom")
    assert (tmp_path / "digits-metric-vs-time.png").stat().st_size > 0
    assert (tmp_path / "digits-throughput-vs-ideal.png").stat().st_size > 0


def test_metric_at_equal_samples_interpolates_between_evaluations() -> None:
    from lab.bench_report import metric_at_samples

    run = {"curve": [{"samples": 0, "loss": 5.0}, {"samples": 1000, "loss": 3.0}, {"samples": 3000, "loss": 2.0}]}
    assert metric_at_samples(run, "loss", 500) == pytest.approx(4.0)
    assert metric_at_samples(run, "loss", 2000) == pytest.approx(2.5)
    assert metric_at_samples(run, "loss", 3000) == pytest.approx(2.0)
    assert metric_at_samples(run, "loss", 3001) is None  # beyond the run: never extrapolated


def _run(task: str, method: str, samples_per_s: float, curve: list[tuple[int, float]]) -> dict:
    metric = {"digits": "accuracy", "charlm": "loss"}[task]
    return {"task": task, "mix": "headline", "seed": 0, "method": method, "samples_per_s": samples_per_s,
            "time_to_target": 2.0, "peers": [{"idle_fraction": 0.1}],
            "curve": [{"t": float(i), "samples": s, metric: m} for i, (s, m) in enumerate(curve)]}


def test_rescore_scores_stored_runs_again_and_redraws_the_table(tmp_path: Path) -> None:
    from lab.bench_report import rescore

    stored = {"config": {}, "wall_s": 60.0, "results": [
        _run("charlm", "ideal", 400.0, [(0, 5.0), (400, 4.0)]),
        _run("charlm", "sync-equal", 100.0, [(0, 5.0), (100, 3.0), (200, 2.4)]),
        _run("charlm", "murmur-work", 300.0, [(0, 5.0), (300, 2.0)]),
    ]}
    (tmp_path / "old.json").write_text(json.dumps(stored))
    rescore(tmp_path / "old.json", tmp_path / "new")
    results = {r["method"]: r for r in json.loads((tmp_path / "new" / "results.json").read_text())["results"]}
    assert results["murmur-work"]["pct_of_ideal"] == pytest.approx(0.75)
    # charlm has no fixed budget: every method is read where sync-equal stopped (200 samples)
    assert results["murmur-work"]["metric_at_equal_samples"] == pytest.approx(5.0 - 3.0 * 200 / 300)
    assert "| charlm | headline | murmur-work |" in (tmp_path / "new" / "summary.md").read_text()


def test_a_task_with_a_fixed_budget_reads_every_method_there_not_where_sync_equal_crossed() -> None:
    from lab.bench_config import TASKS
    from lab.bench_report import score

    budget = TASKS["digits"]["equal_samples"]
    group = score([
        _run("digits", "ideal", 400.0, [(0, 0.1), (400, 0.5)]),
        _run("digits", "sync-equal", 100.0, [(0, 0.1), (budget - 240, 0.96), (budget + 760, 0.94)]),
        _run("digits", "murmur", 300.0, [(0, 0.1), (2 * budget, 0.98)]),
        _run("digits", "diloco", 300.0, [(0, 0.1), (budget // 2, 0.9)]),  # stopped short of the budget
    ])
    at = {g["method"]: g["metric_at_equal_samples"] for g in group}
    assert at["sync-equal"] == pytest.approx(0.96 - 0.02 * 240 / 1000)
    assert at["murmur"] == pytest.approx(0.1 + 0.88 / 2)
    assert at["diloco"] is None and at["ideal"] is None


def test_vs_solo_divides_the_fastest_solo_peers_own_time_by_each_methods() -> None:
    from lab.bench_report import score, summarize

    solo = {**_run("charlm", "solo", 300.0, [(0, 5.0), (300, 2.4)]), "time_to_target": 30.0, "median_solo_time": 60.0,
            "solo_times": [30.0, 45.0, 75.0, None], "slowdowns": [1.0, 1.0, 2.0, 4.0]}
    group = score([
        _run("charlm", "ideal", 400.0, [(0, 5.0), (400, 4.0)]),
        solo,
        {**_run("charlm", "headroom", 300.0, [(0, 5.0), (300, 2.4)]), "time_to_target": 10.0, "slowdowns": [1.0] * 4,
         "peers": [{"idle_fraction": 0.0}] * 4},
        {**_run("charlm", "murmur", 300.0, [(0, 5.0), (300, 2.4)]), "time_to_target": 20.0},
        {**_run("charlm", "sync-equal", 300.0, [(0, 5.0), (300, 2.4)]), "time_to_target": None},
    ])
    by = {g["method"]: g for g in group}
    assert (by["murmur"]["vs_solo"], by["murmur"]["vs_median_solo"]) == (pytest.approx(1.5), pytest.approx(3.0))
    assert by["murmur"]["ideal_vs_solo"] == pytest.approx(2.75)  # the headline mix: 1 + 1 + 0.5 + 0.25
    assert by["solo"]["vs_solo"] == pytest.approx(1.0) and by["headroom"]["vs_solo"] == pytest.approx(3.0)
    assert by["headroom"]["ideal_vs_solo"] == pytest.approx(4.0)
    assert by["sync-equal"]["vs_solo"] is None and by["ideal"]["vs_solo"] is None  # not reached; not a time
    summary = summarize(group)
    assert "| charlm | headline | murmur | 20.00 | 1.50 | 3.00 | 2.75 |" in summary
    assert "- charlm headline: 3.00× sooner on 4 peers (seeds 0: 3.00×)" in summary


def test_the_median_solo_time_waits_for_the_median_peer() -> None:
    from lab.bench_murmur import solo_median

    assert solo_median([10.0, None, 30.0]) == 30.0
    assert solo_median([10.0, None, None]) is None  # the median peer has not reached the target yet
    assert solo_median([10.0, 20.0, 40.0, None]) == 30.0
    assert solo_median([10.0, 20.0, None, None]) is None


def test_swarm_peers_are_started_with_one_torch_thread_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Stand-in processes that record what `murmur run` would be told, and have already exited:
    # the run stops at once, and the lab's and murmur's own parsers read the recorded command lines.
    from lab import bench_murmur, swarm
    from lab.peer import build_lab_parser
    from murmur.node.ops.run import build_run_parser

    started: list[list[str]] = []

    class Exited:
        pid, returncode = 0, 1

        def __init__(self, argv: list[str], log_path: Path, **kwargs: object) -> None:
            started.append(argv)

        def poll(self) -> int:
            return 1

        def wait(self, timeout: float | None = None) -> int:
            return 1

        def send_signal(self, sig: int) -> None: ...

    monkeypatch.setattr(swarm, "ForkedPeer", Exited)
    with pytest.raises(RuntimeError, match="peer 0 exited"):
        bench_murmur.run_murmur("digits", [1.0, 2.0], "murmur-work", 3, 5.0, tmp_path / "run", ema_decay=0.5)
    assert [argv[0] for argv in started] == ["run", "run"]
    split = [build_lab_parser().parse_known_args(argv) for argv in started]  # what `python -m lab.peer` reads
    assert all(lab.record_params and lab.step_time == 20.0 and lab.start_file for lab, _ in split)
    args = [build_run_parser().parse_args(rest[1:]) for _, rest in split]
    assert [a.threads for a in args] == [1, 1]  # two peers share this machine: the node itself would not limit them
    assert [a.slowdown for a in args] == [1.0, 2.0] and [a.shard for a in args] == [3000, 3001]
    assert [a.ema_decay for a in args] == [0.5, 0.5]
    assert args[0].bootstrap == [] and len(args[1].bootstrap) == 1


def test_the_summary_says_which_weights_every_method_evaluated() -> None:
    from lab.bench_report import summarize

    def run(method: str, **ema: float) -> dict:
        return {"task": "digits", "mix": "pair", "seed": 0, "method": method, "samples_per_s": 10.0, "pct_of_ideal": 1.0,
                "time_to_target": 1.0, "peers": [{"idle_fraction": 0.0}], "curve": [], **ema}

    assert summarize([run("ideal", ema_decay=0.0), run("murmur", ema_decay=0.0)]).startswith(
        "Every method evaluated its live weights (`--ema-decay`).")
    assert summarize([run("ideal", ema_decay=0.9)]).startswith("Every method evaluated a moving average of its weights, decay 0.9 (")
    assert summarize([run("ideal"), run("murmur")]).startswith("| task |")  # runs recorded before the choice existed


def test_methods_argument_names_methods_and_optional_scales() -> None:
    from lab.bench_cli import parse_method

    assert parse_method("murmur") == ("murmur", None)
    assert parse_method("sync-equal@0.5") == ("sync-equal", 0.5)
    assert parse_method("murmur-avg-state@2") == ("murmur-avg-state", 2.0)
    with pytest.raises(ValueError, match="unknown method 'murmr'"):
        parse_method("murmr")
    with pytest.raises(ValueError, match="must be positive"):
        parse_method("murmur@0")


def test_every_configuration_names_its_runs_one_way() -> None:
    from lab.bench_config import DEFAULT, METHODS, MURMUR_ARGS, QUICK, SLOW_LINK, SLOW_LINK_UNEVEN, SWEEP

    for config in (DEFAULT, QUICK, SWEEP, SLOW_LINK, SLOW_LINK_UNEVEN):
        assert "methods" not in config
        assert config["runs"] and all((m in METHODS or m in MURMUR_ARGS or m == "solo") and (s is None or s > 0) for m, s in config["runs"])


def test_the_sweep_brackets_the_rate_each_method_trains_at_now() -> None:
    from lab.bench import task_runs
    from lab.bench_config import SWEEP, TASKS

    runs = task_runs("digits", SWEEP)
    assert runs[:2] == [("ideal", None, None), ("headroom", None, None)]  # the sweep tunes solo among its methods
    for method, _ in SWEEP["runs"]:
        chosen = TASKS["digits"]["lr_scale"].get(method, 1.0)
        assert sorted(s for m, s, _ in runs if m == method) == [chosen / 4, chosen / 2, chosen, chosen * 2, chosen * 4]
    named = {**SWEEP, "runs": [("murmur", 0.5)]}
    assert task_runs("digits", named) == [("ideal", None, None), ("solo", None, None), ("headroom", None, None),
                                          *((("murmur", 0.5 * f, None)) for f in SWEEP["lr_factors"])]


def test_an_h_sweep_runs_each_diloco_method_at_each_h_and_without_one_at_its_tuned_h() -> None:
    from lab.bench import task_runs
    from lab.bench_config import LONG_HORIZON

    config = {"runs": [("sync-equal", None), ("diloco", None), ("diloco-proportional", 0.5)], "local_steps": [8, 32]}
    refs = [("ideal", None, None), ("solo", None, None), ("headroom", None, None)]
    assert task_runs("charlm", config) == [*refs, ("sync-equal", None, None), ("diloco", None, 8),
                                           ("diloco", None, 32), ("diloco-proportional", 0.5, 8), ("diloco-proportional", 0.5, 32)]
    config = {**config, "local_steps": None, "tuned_local_steps": {"diloco-proportional": 128}}
    assert task_runs("charlm", config) == [*refs, ("sync-equal", None, None), ("diloco", None, None),
                                           ("diloco-proportional", 0.5, 128)]
    assert {h for m, _, h in task_runs("charlm-large", LONG_HORIZON) if m.startswith("diloco")} == {*LONG_HORIZON["tuned_local_steps"].values()}


def test_a_sweep_of_named_points_runs_exactly_those(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lab import bench, bench_cli

    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda config, out: seen.append(config))
    assert bench_cli.main(["--sweep-lr", "--tasks", "digits", "--methods", "murmur@2,sync-equal", "--out", str(tmp_path)]) == 0
    assert bench.task_runs("digits", seen[0]) == [("ideal", None, None), ("solo", None, None), ("headroom", None, None),
                                                  ("murmur", 2.0, None), ("sync-equal", None, None)]
    assert seen[0]["sweep"]


def test_a_sweep_picks_the_fastest_rate_and_says_when_it_lies_at_the_grids_edge(tmp_path: Path) -> None:
    from lab.bench_report import rescore

    def at(method: str, scale: float, ttt: float | None) -> dict:
        return {**_run("charlm", method, 100.0, [(0, 5.0), (100, 2.4)]), "lr_scale": scale, "lr": 1e-3 * scale,
                "time_to_target": ttt, "label": f"{method}@lr×{scale:g}"}

    stored = {"config": {"sweep": True}, "wall_s": 60.0, "results": [
        {**_run("charlm", "ideal", 400.0, [(0, 5.0), (400, 4.0)]), "lr_scale": 1.0},
        at("sync-equal", 0.5, 9.0), at("sync-equal", 1.0, 4.0), at("sync-equal", 2.0, 6.0),
        at("murmur", 1.0, None), at("murmur", 2.0, 5.0), at("murmur", 4.0, 3.0),
    ]}
    (tmp_path / "old.json").write_text(json.dumps(stored))
    run = rescore(tmp_path / "old.json", tmp_path / "new")
    assert run["chosen_lr_scale"] == {"charlm": {"sync-equal": 1.0, "murmur": 4.0}}
    summary = (tmp_path / "new" / "summary.md").read_text()
    assert "charlm sync-equal 0.001 (×1);" in summary
    assert "charlm murmur 0.004 (×4, at the grid's edge)." in summary


def test_without_a_fixed_budget_every_run_after_sync_equal_trains_as_far_as_it_needed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from lab import bench

    asked = []

    def fake(task, slowdowns, method, seed, max_s, root, scale, caps, decay, min_samples, trace, target, local_steps, same_init, cpu_cores):  # noqa: ANN001
        asked.append((method, min_samples))
        curve = [{"t": 0.0, "samples": 0, "loss": 5.0}, {"t": 9.0, "samples": 4096, "loss": 2.4}]
        return {"task": task, "method": method, "samples_per_s": 500.0, "time_to_target": 9.0 if method == "sync-equal" else 3.0,
                "peers": [{"idle_fraction": 0.0}], "curve": curve}

    monkeypatch.setattr(bench, "run_method", fake)
    config = {"tasks": ["charlm"], "seeds": [0], "mixes": {"charlm": ["pair"]}, "max_s": {"charlm": 5.0},
              "runs": [("sync-equal", None), ("murmur", None)]}
    bench.run_bench(config, tmp_path)
    assert asked == [("ideal", 0), ("solo", 0), ("headroom", 0), ("sync-equal", 0), ("murmur", 4096)]


def test_the_median_counts_peers_while_the_trace_has_them_and_their_samples_for_good() -> None:
    from types import SimpleNamespace

    from lab.bench_murmur import median_curve
    from lab.traces import Event, PeerTrace, Trace

    def peer(index: int, points: list[tuple[float, float, int]]) -> SimpleNamespace:
        records = [{"t": 1000 + t, "loss": loss, "samples": n} for t, loss, n in points]
        return SimpleNamespace(index=index, metrics=lambda: records)

    still = PeerTrace((0.0,), (1.0,))
    trace = Trace((still, still, still), (Event(1.5, 1, "crash"), Event(2.0, 2, "join")))
    peers = [peer(0, [(0, 5.0, 0), (1, 4.0, 10), (2, 3.0, 20), (3, 2.0, 30)]),
             peer(1, [(0, 9.0, 0), (1, 8.0, 50)]),  # crashed at 1.5: out of the median, its 50 samples stay
             peer(2, [(2, 1.0, 0), (3, 0.0, 7)])]  # fmt: skip
    curve = median_curve(peers, "loss", 1000.0, 1.0, trace)
    assert [(c["t"], c["value"], c["samples"]) for c in curve] == [(0.0, 7.0, 0), (1.0, 6.0, 60), (2.0, 2.0, 70), (3.0, 1.0, 87)]
    assert median_curve([peers[0], peer(1, [])], "loss", 1000.0, 1.0, Trace((still, still))) == []  # until all have evaluated


def test_the_arena_options_pick_their_configuration_and_refuse_bad_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from lab import bench, bench_cli
    from lab.bench_config import ARENA, LONG_HORIZON

    seen: list[dict] = []
    monkeypatch.setattr(bench, "run_bench", lambda config, out: seen.append(config))
    assert bench_cli.main(["--scenario", "drift,churn", "--out", str(tmp_path)]) == 0
    assert seen[-1]["scenarios"] == ["drift", "churn"] and seen[-1]["runs"] == [list(r) for r in ARENA["runs"]]
    trace = tmp_path / "mine.json"
    trace.write_text('{"peers": [{"t": [0, 5], "slowdown": [1, 3]}, {"t": [0], "slowdown": [2]}]}')
    assert bench_cli.main(["--trace", str(trace), "--out", str(tmp_path)]) == 0
    assert seen[-1]["trace_file"] == str(trace) and "scenarios" not in seen[-1] and seen[-1]["mixes"] == {"charlm": ["trace"]}
    assert bench_cli.main(["--long-horizon", "--local-steps", "8,32", "--out", str(tmp_path)]) == 0
    assert seen[-1]["local_steps"] == [8, 32] and seen[-1]["link_mbit"] == LONG_HORIZON["link_mbit"]
    assert bench_cli.main(["--long-horizon", "--seed", "1,2", "--out", str(tmp_path)]) == 0
    assert seen[-1]["seeds"] == [1, 2]
    assert bench_cli.main(["--tasks", "charlm-large", "--target", "2.8", "--out", str(tmp_path)]) == 0
    assert seen[-1]["target"] == {"charlm-large": 2.8}
    for argv, error in ((["--scenario", "storm"], "unknown scenario(s) ['storm']"), (["--local-steps", "8,x"], "whole numbers"),
                        (["--local-steps", "0"], "at least 1"), (["--seeds", "0"], "--seed I picks seed I"),
                        (["--seeds", "2", "--seed", "1"], "not both")):  # fmt: skip
        with pytest.raises(SystemExit):
            bench_cli.main([*argv, "--out", str(tmp_path)])
        assert error in capsys.readouterr().err
    trace.write_text('{"peers": [{"t": [0], "slowdown": ["fast"]}]}')
    with pytest.raises(SystemExit):
        bench_cli.main(["--trace", str(trace), "--out", str(tmp_path)])
    assert "mine.json: peers[0].slowdown: 'fast' is not a finite number" in capsys.readouterr().err


@pytest.mark.slow
def test_under_churn_murmur_and_the_elastic_baseline_run_end_to_end(tmp_path: Path) -> None:
    config = {"tasks": ["digits"], "mixes": {"digits": ["headline"]}, "seeds": [0], "max_s": {"digits": 8.0},
              "horizon_s": {"digits": 6.0}, "target": {"digits": 0.999}, "reference": "sync-adaptive",
              "scenarios": ["churn"], "runs": at_chosen_lr(["sync-adaptive", "murmur"]),
              "references": ["ideal"]}  # fmt: skip
    run_bench(config, tmp_path)
    results = {r["method"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    restarts = results["sync-adaptive"]["restarts"]  # the group re-formed at the leave, the join and the crash
    assert len(restarts) == 3 and all(x["downtime_s"] > 0 for x in restarts)
    assert [a["action"] for a in results["murmur"]["trace_actions"]] == ["leave", "join", "crash"]
    assert len(results["murmur"]["peers"]) == 5 and results["murmur"]["peers"][4]["samples_per_s"]  # the newcomer trained
    assert "| digits | headline | churn | sync-adaptive |" in (tmp_path / "summary.md").read_text()
