"""The swarm simulator: real averagers over simulated links learn, mix, churn, and every topology runs."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import anyio
import pytest
import trio.testing

from node.lab.simulation import TOPOLOGIES, LinkTransport, NetworkModel, SimConfig, simulate, simulated_io
from node.net.transport import MemoryNetwork

QUIET = NetworkModel(churn=0.0)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    # Simulated time: the clock jumps to the next deadline whenever every task waits.
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


def _config(topology: str, peers: int = 12, **changes: Any) -> SimConfig:
    base = SimConfig(
        peers=peers,
        topology=topology,
        max_time=4.0,
        linger=0.0,
        eval_every=0.5,
        network=QUIET,
        view_size=6,
        shuffle_length=3,
    )
    return replace(base, **changes)


# --- the network model ----------------------------------------------------------------------


def test_profiles_are_heavy_tailed_bounded_and_reproducible() -> None:
    model = NetworkModel()
    draws = [model.draw(random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    slowdowns = [model.draw(rng).slowdown for rng in [random.Random(0)] for _ in range(5000)]
    assert min(slowdowns) >= 1.0 and max(slowdowns) == model.max_slowdown  # the cap is reached
    assert sorted(slowdowns)[len(slowdowns) // 2] == pytest.approx(2 ** (1 / model.pareto_alpha), rel=0.1)


def test_link_latency_grows_with_distance_and_bandwidth_is_the_slower_end() -> None:
    model = NetworkModel(latency_ms=5.0, latency_span_ms=50.0)
    a, b = model.draw(random.Random(1)), model.draw(random.Random(2))
    latency, bandwidth = model.link(a, b)
    assert latency == pytest.approx((5.0 + 50.0 * math.dist(a.position, b.position) / math.sqrt(2)) / 1000)
    assert bandwidth == min(a.bandwidth, b.bandwidth)
    assert model.link(a, a)[0] == pytest.approx(0.005)


@pytest.mark.anyio
async def test_link_streams_deliver_after_latency_plus_serialization_in_simulated_time() -> None:
    network = MemoryNetwork()
    latency, bandwidth = 0.05, 1000.0  # 50 ms, 1 kB/s
    a = LinkTransport(network, "a", lambda x, y: (latency, bandwidth))
    b = LinkTransport(network, "b", lambda x, y: (latency, bandwidth))
    arrivals: list[tuple[float, bytes]] = []
    done = anyio.Event()

    async def handler(stream) -> None:  # type: ignore[no-untyped-def]
        while data := await stream.receive_some():
            arrivals.append((anyio.current_time(), data))
        done.set()

    b.set_handler("/p", handler)
    async with a.run(), b.run():
        start = anyio.current_time()
        stream = await a.open_stream("b", [], "/p")
        opened = anyio.current_time() - start
        await stream.send_all(b"x" * 100)  # 0.1 s on the wire
        await stream.send_all(b"y" * 100)  # queued behind the first: pipelined, not a second latency
        sent = anyio.current_time() - start
        await stream.close()
        await done.wait()
    assert opened == pytest.approx(2 * latency)
    assert sent == pytest.approx(2 * latency + 0.2)
    assert [round(t - start, 6) for t, _ in arrivals] == [
        round(2 * latency + 0.1 + latency, 6),
        round(2 * latency + 0.2 + latency, 6),
    ]


# --- whole simulations -------------------------------------------------------------------------


def test_gossip_peers_learn_and_their_models_converge() -> None:
    result = simulate(_config("gossip", peers=16, max_time=5.0))
    assert result.accuracy_median[0] < 0.2
    assert result.accuracy_median[-1] > 0.85
    assert result.consensus[0] == pytest.approx(0.0, abs=1e-9)  # every peer starts from the same seeded model
    peak = max(result.consensus)
    assert peak > 0 and result.consensus[-1] < peak / 2  # averaging pulls the drifting models together
    assert result.exchanges.get("merged", 0) > 16
    assert result.steps > 0 and result.samples == 32 * result.steps
    assert result.evaluated == 16 and result.live == [16] * len(result.times)


def test_every_topology_runs_and_reports_curves() -> None:
    results = {t: simulate(_config(t, max_time=2.0)) for t in TOPOLOGIES}
    for topology, result in results.items():
        assert len(result.times) == len(result.accuracy_median) == len(result.consensus) == len(result.accuracy_p10)
        assert result.accuracy_median[-1] > result.accuracy_median[0], topology
    assert results["allreduce"].consensus == [0.0] * len(results["allreduce"].times)  # one model
    assert results["alone"].exchanges == {}
    for topology in ("gossip", "partial", "ring"):
        assert results[topology].exchanges.get("merged", 0) > 0, topology
    # Without averaging the peers drift apart; any averaging topology keeps them closer.
    for topology in ("gossip", "partial", "ring"):
        assert results[topology].consensus[-1] < results["alone"].consensus[-1], topology


def test_partial_views_stay_bounded_and_connected_under_churn() -> None:
    config = _config("partial", peers=20, max_time=3.0, view_size=5, shuffle_length=3, network=NetworkModel(churn=0.1))
    result = simulate(config)
    assert result.joins == result.leaves > 0
    assert result.live == [20] * len(result.times)  # every crash is followed by a newcomer
    assert result.view is not None
    assert result.view["size_max"] <= 5 and result.view["size_min"] >= 1
    assert result.view["connected"] == 1.0
    assert result.accuracy_median[-1] > 0.6


def test_newcomers_sync_the_swarms_model_and_the_run_stops_after_the_target() -> None:
    config = _config("gossip", peers=12, max_time=10.0, target=0.8, linger=0.5, network=NetworkModel(churn=0.1))
    result = simulate(config)
    assert result.joins > 0
    assert result.time_to_target is not None and result.time_to_target_p10 is not None
    assert result.time_to_target <= result.time_to_target_p10
    assert result.times[-1] == pytest.approx(result.time_to_target_p10 + 0.5)  # linger, then stop
    assert not result.truncated


def test_the_same_config_gives_the_same_run() -> None:
    config = _config("partial", peers=10, max_time=1.5, network=NetworkModel(churn=0.2))
    first, second = simulate(config), simulate(config)
    assert first.joins > 0
    assert (first.accuracy_median, first.consensus, first.exchanges) == (
        second.accuracy_median,
        second.consensus,
        second.exchanges,
    )


def test_simulated_io_restores_threads_and_the_averagers_clock() -> None:
    import time

    import anyio.to_thread

    import node.averaging.averager

    before = anyio.to_thread.run_sync
    with simulated_io():
        assert anyio.to_thread.run_sync is not before
        assert node.averaging.averager.time is not time
    assert anyio.to_thread.run_sync is before and node.averaging.averager.time is time


def test_unknown_topologies_are_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        SimConfig(topology="star")
