"""Shared by the partner-choice tests: members with given exchange speeds, and how often a choice picks each."""

from __future__ import annotations

import random
from collections import Counter

from murmur.node.net.peers import PeerEntry


def members(*rates: float | None) -> list[PeerEntry]:
    """Live members p0, p1, … whose measured exchange speeds (bytes/s) are `rates` (None: not measured)."""
    return [PeerEntry(f"p{i}", [f"/dns/p{i}/tcp/1"], 0.0, exchange_rate=r) for i, r in enumerate(rates)]


def frequencies(choice, members: list[PeerEntry], n: int = 20_000) -> dict[str, float]:  # noqa: ANN001 (any partner choice)
    """The share of `n` seeded picks of `choice` that went to each member."""
    rng = random.Random(0)
    counts = Counter(choice.pick(members, rng)[0].peer_id for _ in range(n))
    return {m.peer_id: counts[m.peer_id] / n for m in members}
