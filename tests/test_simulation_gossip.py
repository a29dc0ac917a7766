"""Whole gossip simulations: real averagers over simulated links learn, mix, churn and repeat exactly."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from lab.simulation.config import SimConfig
from lab.simulation.gossip import GossipSimulation
from lab.simulation.network import NetworkModel

QUIET = NetworkModel(churn=0.0)


def _config(topology: str, peers: int = 12, **changes: Any) -> SimConfig:
    base = SimConfig(
        peers=peers, topology=topology, max_time=4.0, linger=0.0, eval_every=0.5, network=QUIET,
        view_size=6, shuffle_length=3,
    )  # fmt: skip
    return replace(base, **changes)


def test_gossip_peers_learn_and_their_models_converge() -> None:
    result = GossipSimulation(_config("gossip", peers=16, max_time=5.0)).run()
    assert result.accuracy_median[0] < 0.2
    assert result.accuracy_median[-1] > 0.85
    assert result.consensus[0] == pytest.approx(0.0, abs=1e-9)  # every peer starts from the same seeded model
    peak = max(result.consensus)
    assert peak > 0 and result.consensus[-1] < peak / 2  # averaging pulls the drifting models together
    assert result.exchanges.get("merged", 0) > 16
    assert result.exchange_s is not None and 0 < result.exchange_s < 1.0
    assert result.steps > 0 and result.samples == 32 * result.steps
    assert result.evaluated == 16 and result.live == [16] * len(result.times)


def test_partial_views_stay_bounded_and_connected_under_churn() -> None:
    config = _config("partial", peers=20, max_time=3.0, view_size=5, shuffle_length=3, network=NetworkModel(churn=0.1))
    result = GossipSimulation(config).run()
    assert result.joins == result.leaves > 0
    assert result.live == [20] * len(result.times)  # every crash is followed by a newcomer
    assert result.view is not None
    assert result.view["size_max"] <= 5 and result.view["size_min"] >= 1
    assert result.view["connected"] == 1.0
    assert result.accuracy_median[-1] > 0.6


def test_newcomers_sync_the_swarms_model_and_the_run_stops_after_the_target() -> None:
    config = _config("gossip", peers=12, max_time=10.0, target=0.8, linger=0.5, network=NetworkModel(churn=0.1))
    result = GossipSimulation(config).run()
    assert result.joins > 0
    assert result.time_to_target is not None and result.time_to_target_p10 is not None
    assert result.time_to_target <= result.time_to_target_p10
    assert result.times[-1] == pytest.approx(result.time_to_target_p10 + 0.5)  # linger, then stop
    assert not result.truncated


def test_the_same_config_gives_the_same_run() -> None:
    # Churn, shuffles and exchanges all draw random numbers: every curve and count must repeat exactly.
    config = _config("partial", peers=10, max_time=1.5, network=NetworkModel(churn=0.2))
    first, second = GossipSimulation(config).run().to_json(), GossipSimulation(config).run().to_json()
    assert first["joins"] > 0 and first["exchanges"].get("merged", 0) > 0
    del first["wall_s"], second["wall_s"]
    assert first == second


def test_allreduce_is_not_a_gossip_topology() -> None:
    with pytest.raises(ValueError, match="simulate_allreduce"):
        GossipSimulation(_config("allreduce"))
