"""Whole nodes (membership, averaging, training) over the in-memory transport."""

import json
from pathlib import Path

import anyio
import pytest

from node.node import METRICS_FILE, STATUS_FILE, Node, NodeConfig
from node.transport import MemoryNetwork

pytestmark = pytest.mark.anyio


async def test_nodes_join_sync_and_average(tmp_path: Path) -> None:
    net = MemoryNetwork()

    def make(name: str, bootstrap: list[str]) -> Node:
        config = NodeConfig(data_dir=tmp_path / name, bootstrap=bootstrap, duration=3.0, average_every=0.1, gossip_every=0.2)
        return Node(config, net.transport(name))

    first = make("first", [])
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(first.run)
            second = make("second", [addrs[0]])
            third = make("third", [addrs[0]])
            await tg.start(second.run)
            await tg.start(third.run)
    for node in (first, second, third):
        status = json.loads((node.config.data_dir / STATUS_FILE).read_text())
        assert status["exchanges"].get("merged", 0) >= 1
        assert status["samples"] > 0
        records = (node.config.data_dir / METRICS_FILE).read_text().splitlines()
        assert records and "accuracy" in json.loads(records[-1])


async def test_node_saves_on_exit_and_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    net = MemoryNetwork()
    config = NodeConfig(data_dir=tmp_path / "n", duration=1.0)
    first = Node(config, net.transport("n"))
    with anyio.fail_after(30):
        await first.run()
    assert first.trainer.samples > 0
    again = Node(config, net.transport("n"))
    assert again.resumed_from is not None
    assert (again.trainer.samples, again.trainer.weight) == (first.trainer.samples, first.trainer.weight)
