"""Options that lost every measurement so far, kept for the lab and registered through the product's seams.

- `--partners link-speed` (`PARTNER_CHOICES`): a member is picked with probability proportional
  to its measured exchange speed (bytes per second of this peer's completed exchanges with it).
  An exchange takes time inversely proportional to that speed, so every member gets about the
  same share of this peer's exchange time. A member not measured yet counts as the fastest
  measured one, so each gets measured.
- `--optimizer-state average` (`OPTIMIZER_STATE`): the inner optimizer's per-parameter state
  (Adam's moments, SGD's momentum) travels and merges with the model, at more bytes per exchange.
- `--merge outer` (`MERGES`): an outer Nesterov step toward the pair's weighted mean
  (`lab.outer_merge`), with the outer learning rate and momentum given to `register`.

`register()` adds them; `python -m lab.peer` calls it before parsing `murmur run`'s flags, with its
`--outer-lr` and `--outer-momentum`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lab.outer_merge import OuterRule
from murmur.node.learn.rules import MERGES, OPTIMIZER_STATE, MergeRule
from murmur.node.learn.tensors import ALL_OPTIMIZER_STATE
from murmur.node.net.partners import PARTNER_CHOICES, UniformPartners
from murmur.node.net.peers import PeerEntry


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


AVERAGE_OPTIMIZER_STATE = "average"


def register(outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
    """Make the lab's options choices of `murmur run`'s parser and of the node (idempotent; the last
    call's outer hyperparameters hold). Raises `ValueError` for outer hyperparameters out of range."""
    OuterRule(outer_lr, outer_momentum)  # refuse bad values here, not at the first merge

    def outer(weighting: MergeRule) -> MergeRule:
        return OuterRule(outer_lr, outer_momentum, weighting=weighting)

    PARTNER_CHOICES[LinkSpeedPartners.name] = LinkSpeedPartners
    OPTIMIZER_STATE[AVERAGE_OPTIMIZER_STATE] = ALL_OPTIMIZER_STATE
    MERGES[OuterRule.name] = outer
