"""How a peer picks its next exchange partner among its live members (`murmur run --partners`).

- `uniform`: any live member, uniformly at random.
- `link-speed`: a member is picked with probability proportional to its measured exchange
  speed (bytes per second of this peer's completed exchanges with it). An exchange takes time
  inversely proportional to that speed, so every member gets about the same share of this
  peer's exchange time, and a slow link no longer takes most of it. A member not measured yet
  counts as the fastest measured one, so each gets measured.

Both are pure: they take the members and a random generator, and say why they picked.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # peers.py imports this module for its default
    from murmur.node.net.peers import PeerEntry


class PartnerChoice(Protocol):
    """Picks one of `members` (never empty) and says why."""

    name: str

    def pick(self, members: Sequence[PeerEntry], rng: random.Random) -> tuple[PeerEntry, str]: ...


class UniformPartners:
    name = "uniform"

    def pick(self, members: Sequence[PeerEntry], rng: random.Random) -> tuple[PeerEntry, str]:
        return rng.choice(list(members)), f"random pick among {len(members)} live peers"


class LinkSpeedPartners:
    name = "link-speed"

    def pick(self, members: Sequence[PeerEntry], rng: random.Random) -> tuple[PeerEntry, str]:
        measured = [m.exchange_rate for m in members if m.exchange_rate]
        if not measured:
            entry, reason = UniformPartners().pick(members, rng)
            return entry, f"{reason} (no link measured yet)"
        fastest = max(measured)
        speeds = [m.exchange_rate or fastest for m in members]
        i = rng.choices(range(len(members)), weights=speeds)[0]
        speed = members[i].exchange_rate
        said = f"{speed / 1e6:.2f} MB/s" if speed else "not measured yet"
        return members[i], f"link-speed pick among {len(members)} live peers (its exchanges: {said}; p={speeds[i] / sum(speeds):.2f})"


PARTNER_CHOICES: dict[str, type[UniformPartners] | type[LinkSpeedPartners]] = {
    UniformPartners.name: UniformPartners, LinkSpeedPartners.name: LinkSpeedPartners,
}
