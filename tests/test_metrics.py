"""Prometheus metrics: the update rules, and two real libp2p nodes on loopback scraped over HTTP."""

import dataclasses
import json
import urllib.request
from pathlib import Path

import anyio
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from status_example import example_status

from murmur.node.averaging.averager import AVERAGE_PROTOCOL
from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.net.identity import load_or_create_identity
from murmur.node.net.membership import PEERS_PROTOCOL
from murmur.node.ops.assembly import build_node
from murmur.node.ops.metrics import NodeMetrics, Traffic
from murmur.node.ops.node import Node, NodeConfig
from murmur.node.ops.node_status import NetworkStatus, NodeStatus

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape as {(name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return _samples(response.read().decode())


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _shows_trained_peer(swarm: dict) -> bool:
    """Whether the swarm view lists a second peer whose summary says it has trained."""
    return len(swarm.get("peers", [])) == 2 and swarm["peers"][1]["samples_per_s"] > 0


def _status(samples: int, exchanges: dict[Result, int], distance: float | None = None) -> NodeStatus:
    return example_status(samples=samples, samples_per_s=10.0, eval={"accuracy": 0.9}, exchanges=exchanges, work=float(samples),
                          partner_distance=distance, network=NetworkStatus())  # fmt: skip


def test_counters_follow_the_node_totals_and_durations_are_observed_once() -> None:
    metrics = NodeMetrics("peer-a", "digits")
    traffic = Traffic()
    traffic.received["/murmur/average/1.0.0"] = 100
    first = [Outcome(Result.MERGED, "b", "ok", 0.02), Outcome(Result.BUSY, "c", "busy", 0.001)]
    metrics.update(_status(64, {Result.MERGED: 1, Result.BUSY: 1}), first, traffic)
    traffic.received["/murmur/average/1.0.0"] = 250
    second = [*first, Outcome(Result.FAILED, "c", "timed out", 12.0)]
    counts = {Result.MERGED: 1, Result.BUSY: 1, Result.FAILED: 1}
    metrics.update(_status(128, counts, distance=1.5), second, traffic)
    metrics.update(_status(128, counts, distance=1.5), second, traffic)  # nothing new

    got = _samples(generate_latest(metrics.registry).decode())
    assert got[("murmur_samples_total", ())] == 128
    assert got[("murmur_exchanges_total", (("outcome", "merged"),))] == 1
    assert got[("murmur_exchanges_total", (("outcome", "failed"),))] == 1
    assert got[("murmur_exchange_duration_seconds_count", (("outcome", "merged"),))] == 1
    assert got[("murmur_exchange_duration_seconds_count", (("outcome", "failed"),))] == 1
    assert got[("murmur_exchange_duration_seconds_bucket", (("le", "10.0"), ("outcome", "failed")))] == 0
    assert got[("murmur_exchange_duration_seconds_bucket", (("le", "30.0"), ("outcome", "failed")))] == 1
    assert got[("murmur_received_bytes_total", (("protocol", "/murmur/average/1.0.0"),))] == 250
    assert got[("murmur_partner_distance", ())] == 1.5
    assert got[("murmur_eval", (("metric", "accuracy"),))] == 0.9
    assert got[("murmur_node_info", (("peer_id", "peer-a"), ("task", "digits")))] == 1


@pytest.mark.anyio
async def test_two_libp2p_nodes_serve_metrics_that_move_and_stop_with_the_node(tmp_path: Path) -> None:
    def make(name: str, bootstrap: list[str]) -> Node:
        config = NodeConfig(data_dir=tmp_path / name, listen=[LOOPBACK], bootstrap=bootstrap, average_every=0.1,
                            gossip_every=0.2, metrics_port=0, checkpoint_every=3600)  # fmt: skip
        return build_node(config, load_or_create_identity(config.data_dir))

    first = make("first", [])
    with anyio.fail_after(90):
        async with anyio.create_task_group() as tg:
            addrs = await tg.start(first.run)
            second = make("second", [addrs[0]])
            await tg.start(second.run)
            assert first.metrics_url and second.metrics_url and first.metrics_url != second.metrics_url
            assert first.metrics_url.startswith("http://127.0.0.1:")
            before = await anyio.to_thread.run_sync(_scrape, first.metrics_url)
            while second.averager.outcomes[Result.MERGED] < 2 or first.averager.outcomes[Result.MERGED] < 2:
                await anyio.sleep(0.2)
            merged = ("murmur_exchanges_total", (("outcome", "merged"),))
            # The metrics follow at the node's next status write: poll for it rather than sleep a fixed time.
            while (after := await anyio.to_thread.run_sync(_scrape, first.metrics_url)).get(merged, 0) < 2:
                await anyio.sleep(0.1)
            other = await anyio.to_thread.run_sync(_scrape, second.metrics_url)
            # The same port serves the dashboard's JSON: the swarm, with the other node's gossiped summary.
            while not _shows_trained_peer(swarm := await anyio.to_thread.run_sync(_json, first.dashboard_url + "api/swarm")):
                await anyio.sleep(0.1)
            status = await anyio.to_thread.run_sync(_json, first.dashboard_url + "api/status")
            url = first.metrics_url
            first.request_stop()
            second.request_stop()
    # Each node has its own registry: its own identity, nothing of the other's.
    assert ("murmur_node_info", (("peer_id", first.peer_id), ("task", "digits"))) in after
    assert ("murmur_node_info", (("peer_id", second.peer_id), ("task", "digits"))) in other
    assert ("murmur_node_info", (("peer_id", second.peer_id), ("task", "digits"))) not in after
    for name in ("murmur_samples_per_second", "murmur_loss", "murmur_known_peers", "murmur_work_weight",
                 "murmur_partner_distance", "murmur_samples_total"):  # fmt: skip
        assert (name, ()) in after, name
    assert after[("murmur_samples_total", ())] > before.get(("murmur_samples_total", ()), 0)
    assert after[("murmur_work_weight", ())] > 0
    assert after[("murmur_known_peers", ())] == 1
    assert after[merged] >= 2
    assert after[("murmur_exchange_duration_seconds_count", (("outcome", "merged"),))] >= 2
    assert after[("murmur_partner_distance", ())] > 0
    for direction in ("received", "sent"):
        assert after[(f"murmur_{direction}_bytes_total", (("protocol", AVERAGE_PROTOCOL),))] > 0
        assert after[(f"murmur_{direction}_bytes_total", (("protocol", PEERS_PROTOCOL),))] > 0
    assert first.metrics_url == first.dashboard_url + "metrics"
    assert status["peer_id"] == first.peer_id and status["dashboard_url"] == first.dashboard_url
    assert [(p["peer_id"], p["self"]) for p in swarm["peers"]] == [(first.peer_id, True), (second.peer_id, False)]
    assert swarm["peers"][1]["task"] == "digits" and swarm["peers"][1]["phase"] == "training"
    with pytest.raises(OSError):  # the endpoint stopped with the node
        await anyio.to_thread.run_sync(_scrape, url)


def test_reachability_connections_and_relayed_bytes() -> None:
    metrics = NodeMetrics("peer-a", "digits")
    network = NetworkStatus("private", connections={"b": "direct", "c": "relayed", "d": "direct"}, relayed_bytes=1000)
    metrics.update(dataclasses.replace(_status(1, {}), network=network), [], Traffic())
    metrics.update(dataclasses.replace(_status(1, {}), network=dataclasses.replace(network, relayed_bytes=1500)), [], Traffic())
    got = _samples(generate_latest(metrics.registry).decode())
    assert [got[("murmur_reachability", (("state", s),))] for s in ("public", "private", "unknown")] == [0, 1, 0]
    assert got[("murmur_connections", (("kind", "direct"),))] == 2
    assert got[("murmur_connections", (("kind", "relayed"),))] == 1
    assert got[("murmur_relayed_bytes_total", ())] == 1500
