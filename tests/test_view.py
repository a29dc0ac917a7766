"""Partial views: bounded, never self, oldest out first; Cyclon shuffles randomize the overlay and drop the dead."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from murmur.node.net.peers import PeerTable
from murmur.node.net.view import Descriptor, PartialView

SELF = "self"


def _view(size: int = 4, shuffle_length: int = 2) -> PartialView:
    return PartialView(SELF, size, shuffle_length, self_addrs=["/memory/self"])


# --- admit / remove / sample --------------------------------------------------------------


def test_admit_fills_the_view_then_replaces_the_oldest_first_in_first_out() -> None:
    view = _view(size=3)
    reasons = [view.admit(p, [f"/memory/{p}"]).reason for p in "abc"]
    assert reasons == ["room in the view (1/3)", "room in the view (2/3)", "room in the view (3/3)"]
    admission = view.admit("d")
    assert (admission.admitted, admission.evicted) == (True, "a")
    assert admission.reason == "view full (3): replaced the oldest descriptor, a"
    assert view.ids() == ["b", "c", "d"]


def test_admitting_a_known_peer_refreshes_it_in_place() -> None:
    view = _view(size=2)
    view.admit("a", ["/old"])
    view.admit("b")
    view.entries["a"].age = 5
    admission = view.admit("a", ["/new"])
    assert (admission.evicted, admission.reason) == (None, "already in the view: refreshed")
    assert view.entries["a"] == Descriptor("a", ["/new"], 0)
    assert view.ids() == ["a", "b"]


def test_a_peer_never_admits_itself() -> None:
    view = _view()
    admission = view.admit(SELF)
    assert (admission.admitted, admission.reason) == (False, "that is this peer itself")
    assert SELF not in view


def test_remove_reports_whether_the_peer_was_there() -> None:
    view = _view()
    view.admit("a")
    assert view.remove("a") is True
    assert view.remove("a") is False
    assert len(view) == 0


def test_sample_picks_outside_exclude_and_says_why_when_it_cannot() -> None:
    view = _view()
    assert view.sample(random.Random(0)) == (None, "the view is empty")
    view.admit("a")
    view.admit("b")
    descriptor, reason = view.sample(random.Random(0), exclude={"a"})
    assert descriptor is not None and descriptor.peer_id == "b"
    assert reason == "random pick among 1 neighbours in the view"
    assert view.sample(random.Random(0), exclude={"a", "b"}) == (None, "every neighbour in the view is excluded")


def test_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="shuffle_length=5"):
        PartialView(SELF, 4, 5)
    with pytest.raises(ValueError, match="size=0"):
        PartialView(SELF, 0, 1)


# --- one shuffle -----------------------------------------------------------------------------


def test_start_shuffle_ages_everyone_drops_the_oldest_and_offers_a_fresh_self() -> None:
    view = _view(size=4, shuffle_length=2)
    for peer_id in "abc":
        view.admit(peer_id)
    view.entries["b"].age = 3
    offer = view.start_shuffle(random.Random(0))
    assert offer.target is not None and offer.target.peer_id == "b" and offer.target.age == 4
    assert offer.reason == "oldest neighbour (age 4) of 3"
    assert "b" not in view  # a dead target needs no clean-up: it is already gone
    assert offer.entries[0] == Descriptor(SELF, ["/memory/self"], 0)
    assert len(offer.entries) == 2 and offer.entries[1].peer_id in {"a", "c"}
    assert all(d.age == 1 for d in view.entries.values())


def test_shuffling_an_empty_view_has_no_target() -> None:
    offer = _view().start_shuffle(random.Random(0))
    assert (offer.target, offer.entries, offer.reason) == (None, [], "the view is empty: nobody to shuffle with")


def test_a_shuffle_swaps_descriptors_without_growing_either_view() -> None:
    rng = random.Random(1)
    p, q = PartialView("p", 3, 2), PartialView("q", 3, 2)
    for peer_id in ("q", "a", "b"):
        p.admit(peer_id)
    for peer_id in ("c", "d", "e"):
        q.admit(peer_id)
    p.entries["q"].age = 9  # q is p's oldest: the target
    offer = p.start_shuffle(rng)
    assert offer.target is not None and offer.target.peer_id == "q"
    reply = q.answer_shuffle(offer.entries, rng)
    assert len(reply) == 2
    assert "p" in q  # the initiator's fresh descriptor replaced one q gave away
    assert len(q) == 3 and len(p) == 2
    added = p.finish_shuffle(reply, offer.entries)
    assert added == 2 and len(p) == 3
    assert {d.peer_id for d in reply} <= set(p.ids())
    assert "p" not in p and "q" not in q


def test_integration_skips_self_and_known_peers_and_replaces_only_what_was_sent() -> None:
    view = PartialView("p", 3, 3)
    for peer_id in ("a", "b", "c"):
        view.admit(peer_id)
    received = [Descriptor("p"), Descriptor("a"), Descriptor("x"), Descriptor("y")]
    added = view.finish_shuffle(received, sent=[Descriptor("b")])
    assert added == 1  # only one slot was given away, so "y" finds no room
    assert view.ids() == ["a", "c", "x"]


# --- many shuffles: the properties peer sampling needs ------------------------------------


def _lattice(n: int, size: int, shuffle_length: int) -> dict[str, PartialView]:
    ids = [f"n{i:03d}" for i in range(n)]
    views = {p: PartialView(p, size, shuffle_length) for p in ids}
    for i, p in enumerate(ids):
        for j in range(1, size + 1):
            views[p].admit(ids[(i + j) % n])
    return views


def _round(views: dict[str, PartialView], alive: set[str], rng: random.Random) -> None:
    for peer_id in sorted(alive):
        offer = views[peer_id].start_shuffle(rng)
        if offer.target is None or offer.target.peer_id not in alive:
            continue  # a dead target does not answer
        reply = views[offer.target.peer_id].answer_shuffle(offer.entries, rng)
        views[peer_id].finish_shuffle(reply, offer.entries)


def _connected(views: dict[str, PartialView], alive: set[str]) -> bool:
    neighbours: dict[str, set[str]] = {p: set() for p in alive}
    for p in alive:
        for q in views[p].entries:
            if q in alive:
                neighbours[p].add(q)
                neighbours[q].add(p)
    start = min(alive)
    seen, frontier = {start}, [start]
    while frontier:
        for q in neighbours[frontier.pop()] - seen:
            seen.add(q)
            frontier.append(q)
    return seen == alive


def test_shuffles_turn_a_lattice_into_a_random_like_overlay_that_stays_bounded_and_connected() -> None:
    rng = random.Random(0)
    views = _lattice(200, size=8, shuffle_length=4)
    lattice_edges = {(p, q) for p, v in views.items() for q in v.entries}
    alive = set(views)
    for _ in range(30):
        _round(views, alive, rng)
    edges = {(p, q) for p, v in views.items() for q in v.entries}
    assert all(len(v) == 8 and p not in v for p, v in views.items())
    assert len(edges & lattice_edges) / len(edges) < 0.1  # the initial structure is gone
    indegree = Counter(q for _, q in edges)
    assert max(indegree.values()) <= 3 * 8 and min(indegree.get(p, 0) for p in views) >= 1
    assert _connected(views, alive)


def test_dead_peers_leave_every_view_within_a_few_view_lengths_of_rounds() -> None:
    rng = random.Random(1)
    views = _lattice(200, size=8, shuffle_length=4)
    for _ in range(10):
        _round(views, set(views), rng)
    dead = set(rng.sample(sorted(views), 40))
    alive = set(views) - dead
    for _ in range(3 * 8):
        _round(views, alive, rng)
    assert sum(q in dead for p in alive for q in views[p].entries) == 0
    assert min(len(views[p]) for p in alive) >= 6  # refilled by later shuffles
    assert _connected(views, alive)


# --- the node's membership table with a bounded view ------------------------------------


def _addr(peer_id: str) -> list[str]:
    return [f"/dns/{peer_id}/tcp/4001"]


def test_a_bounded_table_keeps_at_most_view_size_members_dropping_the_first_admitted() -> None:
    table = PeerTable(SELF, liveness_timeout=30.0, view_size=3)
    new = [table.observe(p, _addr(p), now=float(i)) for i, p in enumerate("abcd")]
    assert new == [True, True, True, True]
    assert sorted(table.members) == ["b", "c", "d"]
    assert table.view is not None and sorted(table.view.ids()) == sorted(table.members)


def test_a_bounded_table_forgets_and_expires_from_the_view_too() -> None:
    table = PeerTable(SELF, liveness_timeout=10.0, view_size=3)
    for i, p in enumerate("abc"):
        table.observe(p, _addr(p), now=float(i))
    table.forget("a")
    assert table.expire(now=11.5) == ["b"]
    assert table.view is not None and table.view.ids() == ["c"] == sorted(table.members)
    assert table.observe("d", _addr("d"), now=12.0) and table.observe("e", _addr("e"), now=12.0)
    assert sorted(table.members) == ["c", "d", "e"]


def test_an_unbounded_table_has_no_view() -> None:
    table = PeerTable(SELF, liveness_timeout=30.0)
    for i in range(100):
        table.observe(f"p{i}", _addr(f"p{i}"), now=0.0)
    assert table.view is None and len(table.members) == 100


@given(st.lists(st.tuples(st.sampled_from(["observe", "forget", "expire"]), st.integers(0, 12)), max_size=80))
def test_a_bounded_tables_members_always_equal_its_view(ops: list[tuple[str, int]]) -> None:
    table = PeerTable(SELF, liveness_timeout=5.0, view_size=4)
    for now, (op, n) in enumerate(ops):
        peer_id = f"p{n}"
        if op == "observe":
            table.observe(peer_id, _addr(peer_id), now=float(now))
        elif op == "forget":
            table.forget(peer_id)
        else:
            table.expire(now=float(now))
        assert table.view is not None
        assert sorted(table.members) == sorted(table.view.ids())
        assert len(table.members) <= 4
