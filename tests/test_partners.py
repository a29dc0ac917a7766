"""Partner choice: uniform by default; a table picks by whatever choice it is given (the lab registers more)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from partner_sampling import frequencies, members

from murmur.node.net.partners import PARTNER_CHOICES, UniformPartners
from murmur.node.net.peers import PeerEntry, PeerTable


def test_uniform_ignores_link_speed() -> None:
    freq = frequencies(UniformPartners(), members(10e6, 1e6, None))
    assert all(f == pytest.approx(1 / 3, abs=0.02) for f in freq.values())


def test_the_product_offers_uniform_partners() -> None:
    assert isinstance(PARTNER_CHOICES["uniform"](), UniformPartners)


class FastestPartners:
    """A test-only choice: the member with the fastest measured exchanges."""

    name = "fastest-test"

    def pick(self, members: Sequence[PeerEntry], rng: random.Random) -> tuple[PeerEntry, str]:
        return max(members, key=lambda m: m.exchange_rate or 0.0), "fastest"


def test_a_table_picks_partners_by_its_choice_from_measured_exchanges() -> None:
    table = PeerTable("self", liveness_timeout=30.0, partners=FastestPartners())
    for peer_id in ("fast", "slow"):
        table.observe(peer_id, [f"/dns/{peer_id}/tcp/1"], now=0.0)
    table.record_exchange("fast", 9_000_000, 1.0, now=1.0)
    table.record_exchange("slow", 1_000_000, 1.0, now=1.0)
    rng = random.Random(0)
    assert table.select_partner(rng, set()) == (table.members["fast"], "fastest")
    assert table.select_partner(rng, {"fast"})[0].peer_id == "slow"  # type: ignore[union-attr]
