"""`murmur bench --link-mbit`: parsing the caps, and the slow-link bench end to end in real namespaces."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab import bench, bench_cli, bench_murmur, swarm
from lab.bench_config import REFERENCES, SLOW_LINK, SLOW_LINK_UNEVEN, at_chosen_lr
from lab.bench_report import summarize
from lab.links import LinkSpecError, caps_for, links_unavailable_reason, parse_link_mbit


def test_one_cap_is_every_peers_cap() -> None:
    assert parse_link_mbit("20") == [20.0]
    assert caps_for([20.0], 4) == [20.0, 20.0, 20.0, 20.0]


def test_a_list_gives_each_peer_its_cap_in_peer_order() -> None:
    assert parse_link_mbit("100, 50,20,10") == [100.0, 50.0, 20.0, 10.0]
    assert caps_for([100.0, 50.0, 20.0, 10.0], 4) == [100.0, 50.0, 20.0, 10.0]
    assert caps_for([0.5, 2.5], 2) == [0.5, 2.5]


@pytest.mark.parametrize("text, why", [
    ("0", "positive"), ("-5", "positive"), ("inf", "positive"), ("nan", "positive"),
    ("fast", "not a number"), ("20,", "not a number"), ("", "not a number"),
])  # fmt: skip
def test_bad_caps_are_refused_naming_the_value(text: str, why: str) -> None:
    with pytest.raises(LinkSpecError, match=why):
        parse_link_mbit(text)


def test_a_list_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(LinkSpecError, match="3 caps for 4 peers"):
        caps_for([100.0, 50.0, 20.0], 4)


@pytest.mark.parametrize("argv, message", [
    (["--link-mbit", "0"], "argument --link-mbit: caps must be positive"),
    (["--link-mbit", "x,1"], "argument --link-mbit: 'x' is not a number"),
    (["--link-mbit", "100,50,20"], "--link-mbit has 3 caps for 4 peers"),  # SLOW_LINK's headline mix has 4 peers
    (["--link-mbit", "20,20,20,20", "--mixes", "pair"], "4 caps for 2 peers"),
    (["--link-mbit", "20", "--tasks", "nope"], "unknown task"),
    (["--ema-decay", "1"], "--ema-decay must be in [0, 1), got 1.0"),
])  # fmt: skip
def test_the_command_line_refuses_bad_caps_with_one_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_cli.main([*argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_without_namespaces_it_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(bench, "links_unavailable_reason", lambda: "network namespaces need root")
    assert bench_cli.main(["--link-mbit", "20", "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == "murmur bench: skipped, slow links need network namespaces: network namespaces need root\n"
    assert not (tmp_path / "out").exists()


def test_the_slow_link_configs_run_the_large_lm_with_the_baselines_over_the_same_links() -> None:
    assert SLOW_LINK["tasks"] == ["charlm-large"] and SLOW_LINK["mixes"]["charlm-large"] == ["headline"]
    assert len(SLOW_LINK["seeds"]) == 3 and SLOW_LINK["link_mbit"] == [20.0]
    assert SLOW_LINK["ema_decay"] == SLOW_LINK_UNEVEN["ema_decay"] == 0.0  # live weights, as measured
    assert {m for m, _ in SLOW_LINK["runs"]} == {"sync-equal", "sync-proportional", "diloco", "murmur-work", "murmur"}
    assert SLOW_LINK_UNEVEN["link_mbit"] == [100.0, 50.0, 20.0, 10.0]


def test_the_summary_names_the_link_caps() -> None:
    def run(method: str, caps: list[float] | None) -> dict:
        return {"task": "digits", "mix": "pair", "seed": 0, "method": method, "samples_per_s": 10.0, "pct_of_ideal": 1.0,
                "time_to_target": 1.0, "peers": [{"idle_fraction": 0.0}], "curve": [], "link_mbit": caps}

    table = summarize([run("ideal", [20.0, 10.0]), run("murmur", [20.0, 10.0])])
    assert table.splitlines()[0].startswith("Links capped at 20, 10 Mbit/s")
    assert "Links" not in summarize([run("ideal", None), run("murmur", None)])  # loopback: the table as before


def _in_other_namespaces() -> list[str]:
    """PIDs of processes in a network namespace other than this one's: every peer and rank of a run is, until
    its teardown (they fork from a server outside the run, so their command lines do not name it)."""
    ours = os.readlink("/proc/self/ns/net")
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "ns" / "net") != ours:
                    found.append(entry.name)
            except OSError:
                pass
    return found

# One of each code path over links: a synchronous rank, a DiLoCo rank, a Murmur peer (equal and work
# weighting differ from these only in numbers).
LINK_TEST_METHODS = ["sync-proportional", "diloco", "murmur"]


@pytest.mark.slow
def test_smallest_slow_link_bench_runs_every_method_over_capped_links_and_leaves_nothing(tmp_path: Path) -> None:
    reason = links_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    config = {"tasks": ["digits"], "mixes": {"digits": ["pair"]}, "seeds": [0], "max_s": {"digits": 2.5},
              "runs": at_chosen_lr(LINK_TEST_METHODS), "link_mbit": [20.0]}
    bench.run_bench(config, tmp_path)

    run = json.loads((tmp_path / "results.json").read_text())
    assert run["config"]["link_mbit"] == [20.0]
    results = run["results"]
    assert [r["method"] for r in results] == [*REFERENCES, *LINK_TEST_METHODS]
    for r in results:
        # Lone peers exchange nothing, and the headroom is the task's: those run on loopback.
        assert r["link_mbit"] == (None if r["method"] in ("solo", "headroom") else [20.0, 20.0]), r["method"]
        assert r["samples_per_s"] > 0 and r["curve"] and len(r["peers"]) == 2, r["method"]
    assert all(r["exit_codes"] == [0, 0] for r in results if r["method"].startswith("murmur"))
    # Peers found each other on their namespace addresses (not loopback) and merged across the capped links.
    assert all(sum(p["exchanges"].get("merged", 0) for p in r["peers"]) > 0 for r in results if r["method"].startswith("murmur"))
    assert all(p["bytes_sent"] > 0 for r in results if r["method"] not in ("ideal", "solo") for p in r["peers"])
    assert "/ip4/10." in (tmp_path / "runs" / "digits-pair-s0-murmur" / "peer-1" / "log.txt").read_text()
    assert (tmp_path / "summary.md").read_text().startswith("Links capped at 20, 20 Mbit/s")

    # Every veth end lives inside a namespace of the run (none in the root namespace): gone with them.
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"mb{os.getpid()}-" not in namespaces
    assert _in_other_namespaces() == []


class _Exited:
    """A stand-in forked process that has already failed: the run stops at once, after recording how it was started."""

    pid, returncode = 0, 1

    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs

    def poll(self) -> int:
        return 1

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


class _Namespace:
    """A stand-in `Netns` that records the processes that entered it."""

    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address
        self.adopted: list[_Exited] = []

    def adopt(self, proc: _Exited) -> _Exited:
        self.adopted.append(proc)
        return proc


def test_over_links_peers_listen_on_their_namespace_address_and_bootstrap_to_peer_zeros(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab.peer import build_lab_parser
    from murmur.node.ops.run import build_run_parser

    monkeypatch.setattr(swarm, "ForkedPeer", _Exited)
    links = [_Namespace("mb1-p0", "10.9.0.1"), _Namespace("mb1-p1", "10.9.0.2")]
    with pytest.raises(RuntimeError, match="peer 0 exited"):
        bench_murmur.run_murmur("charlm-large", [1.0, 2.0], "murmur", 0, 5.0, tmp_path / "run", links=links)
    peers = [ns.adopted[0] for ns in links]
    assert [p.kwargs["netns"] for p in peers] == ["mb1-p0", "mb1-p1"]  # each peer forks into its own namespace
    argvs = [p.args[0] for p in peers]
    assert all(argv[0] == "run" for argv in argvs)
    split = [build_lab_parser().parse_known_args(argv) for argv in argvs]  # what `python -m lab.peer` reads
    args = [build_run_parser().parse_args(rest[1:]) for _, rest in split]
    assert [a.listen[0].split("/tcp/")[0] for a in args] == ["/ip4/10.9.0.1", "/ip4/10.9.0.2"]
    assert args[0].bootstrap == [] and args[1].bootstrap[0].startswith(f"{args[0].listen[0]}/p2p/")
    assert [a.eval_every for a in args] == [6.0, 6.0] and [a.threads for a in args] == [1, 1]
    # `murmur` keeps Murmur's own exchange cadence: the bench passes nothing about it
    assert all("--average-every" not in argv and "--merge" not in argv for argv in argvs)


def test_over_links_ranks_rendezvous_at_rank_zeros_address_and_bind_gloo_to_the_capped_veth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lab import sync_baseline
    from lab.sync_baseline import RankFailed, run_sync

    monkeypatch.setattr(sync_baseline, "ForkedProcess", _Exited)
    links = [_Namespace("mb1-p0", "10.9.0.1"), _Namespace("mb1-p1", "10.9.0.2")]
    with pytest.raises(RankFailed, match="rank 0 failed"):
        run_sync("digits", [1.0, 2.0], "diloco", 3.0, 10.0, None, links=links, work_dir=tmp_path)
    for rank, ns in enumerate(links):
        (proc,) = ns.adopted
        target, (rank_arg, cfg, out) = proc.args[:2]
        assert (rank_arg, proc.kwargs["netns"], out) == (rank, ns.name, str(tmp_path / f"rank{rank}.json"))
        assert target is sync_baseline._rank_over_link  # which binds gloo to LINK_DEVICE, the capped veth
        assert (cfg.store_host, cfg.store_on_rank0, cfg.mode) == ("10.9.0.1", True, "diloco")
