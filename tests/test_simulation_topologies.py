"""Topologies pick partners only where they should, and stay consistent as peers join and leave."""

from __future__ import annotations

import random

import pytest

from lab.simulation.topologies import (
    Alone,
    FullView,
    Partial,
    Ring,
    TopologyTable,
    connected,
    make_topology,
)


def _joined(topology, n: int, seed: int = 0):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    for i in range(n):
        topology.join(f"p{i}", rng)
    return topology


def test_full_view_picks_any_other_live_peer_outside_the_exclusions() -> None:
    topology = _joined(FullView(), 6)
    rng = random.Random(1)
    picks = {topology.pick("p0", rng, {"p1"})[0] for _ in range(300)}
    assert picks == {"p2", "p3", "p4", "p5"}
    assert topology.pick("p0", rng, {"p1", "p2", "p3", "p4", "p5"}) == (None, "no other live peer")


def test_leaving_keeps_the_live_list_and_its_index_consistent() -> None:
    topology = _joined(FullView(), 5)
    topology.leave("p1")
    topology.leave("p4")  # the last one
    assert sorted(topology.live) == ["p0", "p2", "p3"]
    topology.leave("p0")
    assert sorted(topology.live) == ["p2", "p3"]
    assert {topology.pick("p2", random.Random(i), set())[0] for i in range(20)} == {"p3"}


def test_a_ring_peer_picks_only_its_two_neighbours_even_after_one_leaves() -> None:
    ring = _joined(Ring(), 8)
    order = [peer for _, peer in ring.order]
    me = order[3]
    assert {ring.pick(me, random.Random(i), set())[0] for i in range(50)} == {order[2], order[4]}
    assert ring.pick(me, random.Random(0), {order[2], order[4]}) == (None, "both ring neighbours were tried")
    ring.leave(order[4])
    assert {ring.pick(me, random.Random(i), set())[0] for i in range(50)} == {order[2], order[5]}
    assert ring.pick("stranger", random.Random(0), set()) == (None, "not on the ring")


def test_alone_never_picks() -> None:
    assert _joined(Alone(), 3).pick("p0", random.Random(0), set()) == (None, "no averaging in this run")


def test_partial_newcomers_bootstrap_from_a_live_peer_and_views_stay_bounded() -> None:
    partial = _joined(Partial(size=3, shuffle_length=2), 10)
    assert all(1 <= len(view) <= 3 for view in partial.views.values())
    partial.random_start(random.Random(2))
    assert all(len(view) == 3 for view in partial.views.values())  # full views, as after a while of shuffling
    assert all(peer_id not in view for peer_id, view in partial.views.items())
    for i in range(50):
        peer, _ = partial.pick("p0", random.Random(i), set())
        assert peer in partial.views["p0"]
    stats = partial.stats()
    assert stats["size_max"] == 3 and stats["dead_fraction"] == 0.0 and stats["connected"] == 1.0
    partial.leave("p1")
    assert "p1" not in partial.views
    assert partial.stats()["dead_fraction"] > 0  # others still hold p1 until they shuffle


def test_connected_sees_an_overlay_split_in_two() -> None:
    assert connected(["a", "b", "c"], {"a": ["b"], "c": ["b"]})  # direction does not matter
    assert not connected(["a", "b", "c", "d"], {"a": ["b"], "c": ["d"]})


def test_make_topology_builds_each_kind_and_refuses_allreduce() -> None:
    assert isinstance(make_topology("partial", 4, 2), Partial)
    assert [type(make_topology(name, 4, 2)) for name in ("gossip", "ring", "alone")] == [FullView, Ring, Alone]
    with pytest.raises(ValueError, match="no partner-picking topology 'allreduce'"):
        make_topology("allreduce", 4, 2)


def test_the_averagers_table_takes_its_partners_from_the_topology() -> None:
    topology = _joined(FullView(), 2)
    entry, reason = TopologyTable("p0", topology).select_partner(random.Random(0), set())
    assert entry is not None and entry.peer_id == "p1" and "full view" in reason
    entry, _ = TopologyTable("p0", topology).select_partner(random.Random(0), {"p1"})
    assert entry is None
