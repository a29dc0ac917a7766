"""`python -m lab.peer`: the lab's hooks (pace, start gate, recorded parameters, lr scale) around a `murmur run` node."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import torch

from lab.peer import PARAMS_FILE, ParamsRecorder, build_lab_parser, hooks, main, wait_to_start
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.tasks import DigitsTask
from murmur.node.net.identity import load_or_create_identity, peer_id_of
from murmur.node.net.transport import MemoryNetwork
from murmur.node.ops.node import Node, NodeConfig

pytestmark = pytest.mark.anyio


def test_lab_flags_may_come_before_or_after_run() -> None:
    args, rest = build_lab_parser().parse_known_args(["--step-time", "20", "run", "--task", "digits", "--start-file", "f"])
    assert (args.step_time, args.start_file, rest) == (20.0, Path("f"), ["run", "--task", "digits"])


def test_id_prints_the_peer_id_and_anything_but_run_or_id_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["id", "--data-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == peer_id_of(load_or_create_identity(tmp_path))
    assert main(["status"]) == 2


def test_recorded_parameters_are_bounded() -> None:
    loop = TrainingLoop(DigitsTask(), shard=0)
    recorder = ParamsRecorder(loop.replica, limit=3)
    for _ in range(5):
        loop.step()
        recorder(loop.evaluate())
    numel = sum(t.numel() for t in loop.replica.snapshot().state.values())
    assert len(recorder.history) == 3 and all(flat.shape == (numel,) for _, flat in recorder.history)
    with pytest.raises(ValueError, match="at least one"):
        ParamsRecorder(loop.replica, limit=0)


async def test_the_start_waits_for_the_time_the_start_file_holds(tmp_path: Path) -> None:
    start_file = tmp_path / "start"
    started: list[float] = []

    async def start() -> None:
        await wait_to_start(None, start_file)
        started.append(time.time())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await anyio.sleep(0.1)
            assert not started
            begin = time.time() + 0.2
            start_file.with_name("start.tmp").write_text(repr(begin))
            start_file.with_name("start.tmp").replace(start_file)
    assert started[0] >= begin


async def test_the_hooks_pace_gate_scale_and_record_around_a_node(tmp_path: Path) -> None:
    args = build_lab_parser().parse_args(["--step-time", "50", "--start-at", str(time.time()), "--record-params",
                                          "--params-kept", "2", "--lr-scale", "4"])  # fmt: skip
    node = Node(NodeConfig(data_dir=tmp_path / "n", duration=1.0, eval_every=0.1), MemoryNetwork().transport("n"))
    assert node.loop is not None
    lr = node.loop.replica.optimizer.param_groups[0]["lr"]
    with anyio.fail_after(30):
        async with hooks(args)(node):
            assert (node.pacing.step_time_ms, node.start_gate is not None) == (50.0, True)
            assert node.loop.replica.optimizer.param_groups[0]["lr"] == pytest.approx(4 * lr)
            await node.run()
    assert node.stats.steps <= 21  # 50 ms a step, for a second
    history = torch.load(node.config.data_dir / PARAMS_FILE)
    assert len(history) == 2 and history[0][0] <= history[1][0]


async def test_a_trace_paces_the_node_from_the_start_time(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text('{"peers": [{"t": [0], "slowdown": [1]}, {"t": [0, 0.5], "slowdown": [2, 8]}]}')
    start = time.time() + 0.2
    args = build_lab_parser().parse_args(["--step-time", "10", "--start-at", str(start), "--trace", str(trace), "--trace-peer", "1"])
    node = Node(NodeConfig(data_dir=tmp_path / "n", duration=0.1), MemoryNetwork().transport("n"))
    async with hooks(args)(node):
        assert node.start_gate is not None
        await node.start_gate()
        assert node.pacing.clock() == pytest.approx(time.time() - start, abs=0.05)
        assert node.pacing.step_duration(0.001, 0.001, 32) == pytest.approx(0.02)  # ×2 until 0.5 s in


def test_a_bad_trace_or_trace_peer_is_refused_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text('{"peers": [{"t": [0], "slowdown": [0]}]}')
    with pytest.raises(SystemExit):
        main(["--step-time", "10", "--trace", str(trace), "run"])
    assert "peers[0].slowdown: 0 must be positive" in capsys.readouterr().err
    trace.write_text('{"peers": [{"t": [0], "slowdown": [1]}]}')
    with pytest.raises(SystemExit):
        main(["--step-time", "10", "--trace", str(trace), "--trace-peer", "1", "run"])
    assert "--trace-peer 1: the trace has peers 0..0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "run"])
    assert "--trace needs --step-time" in capsys.readouterr().err
