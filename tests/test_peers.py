"""The membership table: members only by direct contact, rumours as candidates, expiry and dial backoff."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from murmur.node.net.peers import MAX_CANDIDATES, PeerTable
from murmur.protocol.messages import MAX_ADDRS, MAX_PEERS_PER_HELLO, PeerRecord

SELF = "self"
TIMEOUT = 30.0


def _table() -> PeerTable:
    return PeerTable(SELF, liveness_timeout=TIMEOUT)


def _addr(peer_id: str) -> list[str]:
    return [f"/dns/{peer_id}/tcp/4001"]


# --- observe / rumour -----------------------------------------------------------


def test_observe_adds_a_new_member() -> None:
    table = _table()
    assert table.observe("a", _addr("a"), now=1.0) is True
    entry = table.members["a"]
    assert (entry.peer_id, entry.addrs, entry.last_seen, entry.exchanges) == ("a", _addr("a"), 1.0, 0)


def test_observing_a_known_member_refreshes_it_without_reporting_it_new() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=1.0)
    assert table.observe("a", ["/ip4/9.9.9.9/tcp/1"], now=5.0) is False
    assert table.members["a"].last_seen == 5.0
    assert table.members["a"].addrs == ["/ip4/9.9.9.9/tcp/1"]


def test_observing_without_addresses_keeps_the_known_ones() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=1.0)
    table.observe("a", [], now=2.0)
    assert table.members["a"].addrs == _addr("a")


def test_observe_copies_the_address_list() -> None:
    table = _table()
    addrs = _addr("a")
    table.observe("a", addrs, now=1.0)
    addrs.append("/mutated")
    assert table.members["a"].addrs == _addr("a")


def test_self_is_never_added() -> None:
    table = _table()
    assert table.observe(SELF, _addr(SELF), now=1.0) is False
    table.rumour([PeerRecord(SELF, _addr(SELF))])
    assert SELF not in table.members and SELF not in table.candidates


def test_rumoured_peers_are_candidates_not_members() -> None:
    table = _table()
    table.rumour([PeerRecord("b", _addr("b")), PeerRecord("c", _addr("c"))])
    assert table.members == {}
    assert table.candidates == {"b": _addr("b"), "c": _addr("c")}
    entry, reason = table.select_partner(random.Random(0), set())
    assert entry is None and reason == "no known peers"


def test_rumoured_peer_becomes_a_member_once_observed() -> None:
    table = _table()
    table.rumour([PeerRecord("b", _addr("b"))])
    assert table.observe("b", _addr("b"), now=3.0) is True
    assert "b" in table.members and "b" not in table.candidates


def test_rumours_of_members_and_of_peers_without_addresses_are_ignored() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=1.0)
    table.rumour([PeerRecord("a", ["/elsewhere"]), PeerRecord("d", [])])
    assert table.candidates == {}
    assert table.members["a"].addrs == _addr("a")


def test_candidates_are_capped() -> None:
    table = _table()
    table.rumour([PeerRecord(f"p{i}", _addr(f"p{i}")) for i in range(MAX_CANDIDATES + 10)])
    assert len(table.candidates) == MAX_CANDIDATES


def test_forget_drops_member_and_candidate() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=1.0)
    table.rumour([PeerRecord("b", _addr("b"))])
    table.forget("a")
    table.forget("b")
    table.forget("unknown")
    assert table.members == {} and table.candidates == {}


# --- expiry ---------------------------------------------------------------------


def test_expire_drops_silent_members_and_returns_their_ids() -> None:
    table = _table()
    table.observe("old", _addr("old"), now=0.0)
    table.observe("older", _addr("older"), now=-5.0)
    table.observe("fresh", _addr("fresh"), now=20.0)
    assert sorted(table.expire(now=TIMEOUT + 1.0)) == ["old", "older"]
    assert list(table.members) == ["fresh"]
    assert table.expire(now=TIMEOUT + 1.0) == []


def test_member_exactly_at_the_timeout_is_kept() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    assert table.expire(now=TIMEOUT) == []
    assert "a" in table.members


def test_a_member_in_an_exchange_stays_alive_however_long_its_transfer_takes() -> None:
    table = _table()
    for peer_id in ("sending", "silent"):
        table.observe(peer_id, _addr(peer_id), now=0.0)
    table.exchanging["sending"] += 1  # its model is arriving over a slow link; its hellos queue behind it
    assert table.expire(now=10 * TIMEOUT) == ["silent"]
    table.exchanging["sending"] -= 1  # the exchange failed: nothing has been heard from it since
    assert table.expire(now=10 * TIMEOUT) == ["sending"]


def test_a_completed_exchange_keeps_a_member_alive_and_measures_its_link_but_never_admits() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    table.record_exchange("a", 4_000_000, 2.0, now=25.0)
    table.record_exchange("a", 4_000_000, 1.0, now=26.0)
    assert table.expire(now=50.0) == []
    entry = table.members["a"]
    assert entry.exchanges == 2 and entry.exchange_rate == pytest.approx(3e6)  # moving average of 2 and 4 MB/s
    table.record_exchange("b", 1, 1.0, now=26.0)
    assert "b" not in table.members


def test_refreshed_member_survives_expiry() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    table.observe("a", [], now=25.0)
    assert table.expire(now=50.0) == []


# --- dial backoff ---------------------------------------------------------------


def test_unknown_peer_may_be_dialled() -> None:
    assert _table().may_dial("x", now=0.0)


def test_dial_failure_removes_the_candidate_and_backs_off() -> None:
    table = _table()
    table.rumour([PeerRecord("b", _addr("b"))])
    table.dial_failed("b", now=10.0, base_delay=1.0)
    assert "b" not in table.candidates
    assert not table.may_dial("b", now=10.5)
    assert table.may_dial("b", now=11.0)


def _waits(table: PeerTable, peer_id: str, since: float, delay: float) -> bool:
    """Whether `peer_id` may be dialed again exactly `delay` after `since`, and not a moment sooner."""
    return not table.may_dial(peer_id, since + delay * (1 - 1e-9)) and table.may_dial(peer_id, since + delay)


def test_consecutive_dial_failures_double_the_delay_up_to_the_cap() -> None:
    table = _table()
    now = 0.0
    for delay in [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0, 10.0]:
        table.dial_failed("b", now=now, base_delay=1.0, max_delay=10.0)
        assert _waits(table, "b", now, delay)
        now += delay


@given(st.floats(0.01, 5.0), st.floats(5.0, 100.0), st.integers(1, 20))
def test_backoff_delay_never_exceeds_the_cap(base: float, cap: float, failures: int) -> None:
    table = _table()
    for i in range(failures):
        table.dial_failed("b", now=float(i), base_delay=base, max_delay=cap)
    assert _waits(table, "b", float(failures - 1), min(cap, base * 2 ** (failures - 1)))


def test_contact_resets_the_backoff() -> None:
    table = _table()
    table.dial_failed("b", now=0.0)
    table.dial_failed("b", now=0.0)
    table.observe("b", _addr("b"), now=0.5)
    assert table.may_dial("b", now=0.5)
    table.forget("b")
    table.dial_failed("b", now=1.0, base_delay=1.0)
    assert _waits(table, "b", 1.0, 1.0)  # starts again from the base delay


def test_failed_greets_of_a_member_leave_it_to_the_liveness_timeout() -> None:
    """A partition fails every greet of a member; backoff starts only once it goes dormant."""
    table = _table()
    table.observe("b", _addr("b"), now=0.0)
    for i in range(10):
        table.dial_failed("b", now=float(i))
        assert table.may_dial("b", now=float(i))
    assert table.expire(now=TIMEOUT + 1.0) == ["b"]
    assert _waits(table, "b", TIMEOUT + 1.0, 1.0)
    assert table.dormant == {"b": _addr("b")}


# --- partner selection ------------------------------------------------------------


def test_select_partner_without_members_says_no_known_peers() -> None:
    assert _table().select_partner(random.Random(0), set()) == (None, "no known peers")


def test_select_partner_when_every_member_was_tried() -> None:
    table = _table()
    for p in "abc":
        table.observe(p, _addr(p), now=0.0)
    assert table.select_partner(random.Random(0), {"a", "b", "c"}) == (None, "every known peer was tried this round")


@given(st.integers(0, 2**32 - 1), st.sets(st.sampled_from("abcdef")))
def test_select_partner_picks_only_non_excluded_members(seed: int, exclude: set[str]) -> None:
    table = _table()
    for p in "abcdef":
        table.observe(p, _addr(p), now=0.0)
    table.rumour([PeerRecord("rumoured", _addr("rumoured"))])
    entry, reason = table.select_partner(random.Random(seed), exclude)
    remaining = set("abcdef") - exclude
    if remaining:
        assert entry is not None and entry.peer_id in remaining
        assert reason == f"random pick among {len(remaining)} live peers"
    else:
        assert entry is None


def test_select_partner_reaches_every_eligible_member() -> None:
    table = _table()
    for p in "abcd":
        table.observe(p, _addr(p), now=0.0)
    rng = random.Random(1)
    picks = {table.select_partner(rng, {"d"})[0].peer_id for _ in range(100)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "c"}


# --- whom to contact ----------------------------------------------------------------


def test_to_contact_prefers_candidates_then_stalest_members() -> None:
    table = _table()
    table.observe("recent", _addr("recent"), now=9.0)
    table.observe("stale", _addr("stale"), now=1.0)
    table.observe("middle", _addr("middle"), now=5.0)
    table.rumour([PeerRecord("c1", _addr("c1")), PeerRecord("c2", _addr("c2"))])
    picks = table.to_contact(now=10.0, limit=4)
    assert [p for p, _ in picks] == ["c1", "c2", "stale", "middle"]
    assert picks[0] == ("c1", _addr("c1"))


@pytest.mark.parametrize("limit", [0, 1, 2, 3, 10])
def test_to_contact_respects_the_limit(limit: int) -> None:
    table = _table()
    for i in range(3):
        table.observe(f"m{i}", _addr(f"m{i}"), now=float(i))
    table.rumour([PeerRecord(f"c{i}", _addr(f"c{i}")) for i in range(3)])
    picks = table.to_contact(now=10.0, limit=limit)
    assert len(picks) == min(limit, 6)
    assert [p for p, _ in picks] == ["c0", "c1", "c2", "m0", "m1", "m2"][:limit]


def test_to_contact_skips_candidates_in_backoff() -> None:
    table = _table()
    table.dial_failed("c1", now=0.0, base_delay=5.0)
    table.rumour([PeerRecord("c1", _addr("c1")), PeerRecord("c2", _addr("c2"))])
    assert [p for p, _ in table.to_contact(now=1.0, limit=5)] == ["c2"]
    assert [p for p, _ in table.to_contact(now=5.0, limit=5)] == ["c1", "c2"]


def test_to_contact_greets_a_dormant_peer_that_is_also_rumoured_once() -> None:
    table = _table()
    table.observe("d", _addr("d"), now=0.0)
    table.expire(now=TIMEOUT + 1.0)
    table.rumour([PeerRecord("d", ["/dns/moved/tcp/4001"])])
    assert table.to_contact(now=TIMEOUT + 2.0, limit=5) == [("d", ["/dns/moved/tcp/4001"])]


# --- records for hello ----------------------------------------------------------------


def test_records_share_every_member_when_few() -> None:
    table = _table()
    for p in "abc":
        table.observe(p, _addr(p), now=0.0)
    records = table.records(random.Random(0))
    assert sorted(r.peer_id for r in records) == ["a", "b", "c"]
    assert all(isinstance(r, PeerRecord) and r.addrs == _addr(r.peer_id) for r in records)


def test_records_are_a_bounded_sample_without_duplicates() -> None:
    table = _table()
    for i in range(MAX_PEERS_PER_HELLO + 40):
        table.observe(f"p{i}", _addr(f"p{i}"), now=0.0)
    records = table.records(random.Random(0))
    ids = [r.peer_id for r in records]
    assert len(ids) == MAX_PEERS_PER_HELLO == len(set(ids))
    assert set(ids) <= set(table.members)


def test_records_truncate_long_address_lists() -> None:
    table = _table()
    table.observe("a", [f"/ip4/10.0.0.{i}/tcp/1" for i in range(MAX_ADDRS + 5)], now=0.0)
    (record,) = table.records(random.Random(0))
    assert len(record.addrs) == MAX_ADDRS


def test_records_of_an_empty_table_are_empty() -> None:
    assert _table().records(random.Random(0)) == []


# --- dormant peers (partition healing) -------------------------------------------


def test_expired_member_is_redialed_with_backoff_then_forgotten() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    assert table.expire(now=TIMEOUT + 1) == ["a"]
    assert table.dormant == {"a": _addr("a")}
    assert table.to_contact(now=TIMEOUT + 1.5, limit=3) == []  # backing off
    assert table.to_contact(now=TIMEOUT + 2.0, limit=3) == [("a", _addr("a"))]
    now = TIMEOUT + 2.0
    for _ in range(10):  # every redial fails: the wait doubles until the cap, then it is forgotten
        table.dial_failed("a", now)
        now += 61
    assert "a" not in table.dormant


def test_dormant_peer_that_answers_is_a_member_again() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    table.expire(now=TIMEOUT + 1)
    table.observe("a", _addr("a"), now=TIMEOUT + 3)
    assert "a" in table.members and not table.dormant and table.may_dial("a", TIMEOUT + 3)


def test_a_leaving_peer_is_not_kept_dormant() -> None:
    table = _table()
    table.observe("a", _addr("a"), now=0.0)
    table.expire(now=TIMEOUT + 1)
    table.forget("a")
    assert not table.dormant and table.to_contact(now=1e6, limit=3) == []
