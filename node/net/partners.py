"""How a peer picks its next exchange partner among its live members (`murmur run --partners`).

- `uniform`: any live member, uniformly at random.

A choice is pure: it takes the members and a random generator, and says why it picked. The
peer table measures each member's exchange speed (`PeerEntry.exchange_rate`) for choices that
weigh links.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
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


# `--partners`' choices: the seam other partner choices (the lab's) are registered in, before a parser is built.
PARTNER_CHOICES: dict[str, Callable[[], PartnerChoice]] = {UniformPartners.name: UniformPartners}
