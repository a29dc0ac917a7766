"""Whole nodes (membership, averaging, training) over the in-memory transport."""

import json
import time
from pathlib import Path

import anyio
import pytest

from murmur.node.averaging.outcome import Result
from murmur.node.learn.loop import Evaluation
from murmur.node.learn.step import Pacing
from murmur.node.net.identity import load_or_create_identity
from murmur.node.net.transport import MemoryNetwork
from murmur.node.ops.assembly import build_node
from murmur.node.ops.node import METRICS_FILE, STATUS_FILE, Node, NodeConfig
from murmur.node.ops.node_status import NodeStatus

pytestmark = pytest.mark.anyio


async def stop_when(nodes: list[Node], done, poll: float = 0.05) -> None:
    """Poll until `done()`, then stop every node gracefully (the caller bounds the wait)."""
    while not done():
        await anyio.sleep(poll)
    for node in nodes:
        node.request_stop()


async def test_nodes_join_sync_and_average(tmp_path: Path) -> None:
    net = MemoryNetwork()

    def make(name: str, bootstrap: list[str]) -> Node:
        config = NodeConfig(data_dir=tmp_path / name, bootstrap=bootstrap, average_every=0.1, gossip_every=0.2)
        return Node(config, net.transport(name))

    first = make("first", [])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(first.run)
            second = make("second", [addrs[0]])
            third = make("third", [addrs[0]])
            await tg.start(second.run)
            await tg.start(third.run)
            nodes = [first, second, third]
            # Until every node merged once and evaluated once (instead of a fixed training time).
            tg.start_soon(stop_when, nodes, lambda: all(n.averager.outcomes[Result.MERGED] and n.last_eval for n in nodes))
    for node in (first, second, third):
        status = NodeStatus.from_json((node.config.data_dir / STATUS_FILE).read_text())
        assert status.exchanges.get(Result.MERGED, 0) >= 1
        assert status.samples > 0
        records = (node.config.data_dir / METRICS_FILE).read_text().splitlines()
        assert records and "accuracy" in json.loads(records[-1])


async def test_node_saves_on_exit_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    net = MemoryNetwork()
    config = NodeConfig(data_dir=tmp_path / "n")
    first = Node(config, net.transport("n"))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.run)
            tg.start_soon(stop_when, [first], lambda: first.replica.samples > 0)
    assert first.replica.samples > 0
    again = Node(config, net.transport("n"))
    assert again.resumed_from is not None
    assert (again.replica.samples, again.replica.work) == (first.replica.samples, first.replica.work)


async def test_node_waits_at_its_start_gate_then_trains(tmp_path: Path) -> None:
    node = Node(NodeConfig(data_dir=tmp_path / "n", duration=0.5), MemoryNetwork().transport("n"))
    opened = anyio.Event()
    node.start_gate = opened.wait
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(node.run)
            while node.phase != "waiting":
                await anyio.sleep(0.02)
            assert NodeStatus.from_json((node.config.data_dir / STATUS_FILE).read_text()).phase == "waiting"
            assert node.replica.samples == 0  # ready, but not told to start
            begin = time.time()
            opened.set()
    records = [json.loads(line) for line in (node.config.data_dir / METRICS_FILE).read_text().splitlines()]
    assert records[0]["t"] >= begin and node.replica.samples > 0
    assert NodeStatus.from_json((node.config.data_dir / STATUS_FILE).read_text()).phase == "training"


async def test_evaluations_reach_the_listener_after_their_metrics_line(tmp_path: Path) -> None:
    node = Node(NodeConfig(data_dir=tmp_path / "n", eval_every=0.05), MemoryNetwork().transport("n"))
    heard: list[tuple[Evaluation, int]] = []

    def listen(evaluation: Evaluation) -> None:
        heard.append((evaluation, len((node.config.data_dir / METRICS_FILE).read_text().splitlines())))

    node.on_evaluation = listen
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(node.run)
            tg.start_soon(stop_when, [node], lambda: len(heard) >= 2)
    records = [json.loads(line) for line in (node.config.data_dir / METRICS_FILE).read_text().splitlines()]
    assert [n for _, n in heard[:2]] == [1, 2]
    assert [(e.samples, e.work) for e, _ in heard[:2]] == [(r["samples"], r["work"]) for r in records[:2]]


async def test_the_pacing_given_paces_the_steps(tmp_path: Path) -> None:
    paced = Node(NodeConfig(data_dir=tmp_path / "n", duration=0.5), MemoryNetwork().transport("n"), pacing=Pacing(step_time_ms=100))
    with anyio.fail_after(30):
        await paced.run()
    assert 1 <= paced.stats.steps <= 6  # 100 ms a step, for half a second


async def test_node_prints_listen_then_announced_addresses(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = NodeConfig(
        data_dir=tmp_path / "n", listen=["/ip4/127.0.0.1/tcp/0"], announce=["/dns4/node.example.org/tcp/4001"],
        addr_file=tmp_path / "addrs.txt", duration=0.2,
    )
    node = build_node(config, load_or_create_identity(config.data_dir))
    with anyio.fail_after(30):
        await node.run()
    lines = capsys.readouterr().out.splitlines()
    listening = [line for line in lines if line.startswith("murmur: listening on /ip4/127.0.0.1/tcp/")]
    assert len(listening) == 1
    assert f"murmur: announcing /dns4/node.example.org/tcp/4001/p2p/{node.peer_id}" in lines
    written = (tmp_path / "addrs.txt").read_text().split()
    assert written == [listening[0].split()[-1], f"/dns4/node.example.org/tcp/4001/p2p/{node.peer_id}"]


async def test_a_peer_that_stops_hands_its_unmerged_work_to_a_partner_first(tmp_path: Path) -> None:
    net = MemoryNetwork()

    def make(name: str, bootstrap: list[str]) -> Node:  # no periodic merges: only the parting one
        return Node(NodeConfig(data_dir=tmp_path / name, bootstrap=bootstrap, average_every=1e9, gossip_every=0.1), net.transport(name))

    stays = make("stays", [])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(stays.run)
            leaves = make("leaves", [addrs[0]])
            async with anyio.create_task_group() as leaving:
                leaving.start_soon(leaves.run)
                leaving.start_soon(stop_when, [leaves], lambda: leaves.replica.samples > 0 and bool(leaves.table.members))
            # The partner finishes its own side of the exchange (its merge, its record) after `leaves` has gone.
            while stays.averager.outcomes[Result.MERGED] == 0:
                await anyio.sleep(0.01)
            merged = stays.averager.outcomes[Result.MERGED]  # before `stays` stops
            stays.request_stop()
    assert leaves.averager.outcomes[Result.MERGED] == 1 == merged
    assert leaves.replica.fresh == 0  # its work went into the partner's model


async def test_a_node_whose_bootstrap_never_answers_says_it_is_alone_and_why(tmp_path: Path) -> None:
    from murmur.node.ops.run import EXIT_NEVER_JOINED, never_joined_exit

    net = MemoryNetwork()
    config = NodeConfig(data_dir=tmp_path / "n", bootstrap=["/memory/gone/p2p/gone"], duration=0.5, gossip_every=0.2)
    node = Node(config, net.transport("n"))
    with anyio.fail_after(60):
        await node.run()
    status = NodeStatus.from_json((node.config.data_dir / STATUS_FILE).read_text())
    assert not status.joined
    assert status.alone_reason == "/memory/gone: unreachable: cannot open /murmur/peers/1.0.0 to gone: unreachable"
    assert status.bootstrap == {"/memory/gone/p2p/gone": "unreachable: cannot open /murmur/peers/1.0.0 to gone: unreachable"}
    assert node.duration_ended and node.never_joined() == status.alone_reason
    assert never_joined_exit(node) == EXIT_NEVER_JOINED
    first = Node(NodeConfig(data_dir=tmp_path / "first", duration=0.5), net.transport("first"))
    with anyio.fail_after(60):
        await first.run()
    # A swarm's first node is alone by design: its status says so, and it exits 0.
    assert first.status().alone_reason == "no bootstrap peers given: waiting for peers to join this one"
    assert first.never_joined() is None and never_joined_exit(first) == 0


async def test_a_node_logs_progress_periodically_and_a_summary_at_exit_but_exchanges_only_at_debug(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="murmur")
    net = MemoryNetwork()
    first = Node(NodeConfig(data_dir=tmp_path / "a", average_every=0.1, progress_every=0.3), net.transport("a"))
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(first.run)
            second = Node(NodeConfig(data_dir=tmp_path / "b", bootstrap=addrs, average_every=0.1, progress_every=0.3), net.transport("b"))
            await tg.start(second.run)
            done = lambda: second.averager.outcomes[Result.MERGED] >= 2 and len(progress(caplog)) >= 2  # noqa: E731
            tg.start_soon(stop_when, [first, second], done)
    exchanges = [r for r in caplog.records if r.getMessage().startswith("exchange with")]
    assert exchanges and {r.levelno for r in exchanges} == {logging.DEBUG}
    assert any(m.endswith("1 peer") for m in progress(caplog))
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done after")]
    assert len(summaries) == 2 and all(r.levelno == logging.INFO for r in caplog.records if r.getMessage() in summaries)


def progress(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "murmur.node" and " samples/s, loss " in r.getMessage()
            and not r.getMessage().startswith("done")]  # fmt: skip
