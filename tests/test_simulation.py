"""`simulate`: every topology runs through the one entry point and reports comparable curves."""

from __future__ import annotations

from dataclasses import replace

from lab.simulation import TOPOLOGIES, NetworkModel, SimConfig, simulate


def test_every_topology_runs_and_reports_curves() -> None:
    base = SimConfig(peers=12, max_time=2.0, linger=0.0, eval_every=0.5, network=NetworkModel(churn=0.0), view_size=6)
    results = {t: simulate(replace(base, topology=t, shuffle_length=3)) for t in TOPOLOGIES}
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
