"""Robust merging: what a partner may claim and how far its model may pull ours.

Both checks are pure (pass `now`) and return a value plus the reason, which the
averager logs and, for clear offences, turns into a strike against the peer.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from murmur.protocol.codec import pieces


@dataclass(frozen=True)
class Claim:
    """The work we credit a partner with, why, and whether the claim was an offence."""

    work: float
    reason: str
    offence: bool = False


@dataclass
class WorkClaimLimiter:
    """Caps a partner's claimed work at what is plausible.

    The work of honest peers stays within a small factor of each other's, so a
    claim may exceed `ratio` × our own work only by what the partner could have
    computed since its last claim at `speed_factor` × our own rate, and never
    `ceiling`. A claim over `offence_factor` × that cap is an offence (strike).
    """

    ratio: float = 4.0
    speed_factor: float = 16.0
    ceiling: float = 1e12
    offence_factor: float = 25.0
    min_local: float = 32.0
    _last: dict[str, float] = field(default_factory=dict)

    def credit(self, peer_id: str, claimed: float, local_work: float, local_rate: float, now: float) -> Claim:
        """The work to credit `peer_id` with for `claimed`, given our own work and samples/s."""
        previous = self._last.get(peer_id)
        growth = (now - previous) * self.speed_factor * max(local_rate, 1.0) if previous is not None else 0.0
        cap = min(self.ceiling, self.ratio * max(local_work, self.min_local) + growth)
        self._last[peer_id] = now
        if local_work < self.min_local:
            # No yardstick yet (we are new); a newcomer adopts its partner's model anyway.
            return Claim(min(claimed, self.ceiling), "no yardstick: our own weight is still tiny")
        if claimed <= cap:
            return Claim(claimed, "claim plausible")
        offence = claimed > self.offence_factor * cap
        return Claim(cap, f"claimed work {claimed:.3g} capped at {cap:.3g} (ours {local_work:.3g})", offence)


@dataclass(frozen=True)
class Screening:
    """How far to let a partner's model pull ours, why, and whether it was an offence.

    `pull` is 1.0 to merge the partner's model as is, less than 1 to merge
    `local + pull × (remote − local)` instead (clipped), and None to reject it.
    """

    pull: float | None
    reason: str
    distance: float
    offence: bool = False


def _norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(torch.linalg.vector_norm(p).item() ** 2 for n in state for _, p in pieces(state, n)))


def _distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The L2 distance between two models, piece by piece (no model-sized temporaries)."""
    total = 0.0
    for name in a:
        for (_, pa), (_, pb) in zip(pieces(a, name), pieces(b, name), strict=True):
            total += torch.linalg.vector_norm(pa - pb).item() ** 2
    return math.sqrt(total)


@dataclass
class ClippedGossip:
    """Clip a partner's pull to a radius learned from recent distances; reject absurd models.

    A model farther from ours than `reject_ratio` × our own norm (a ×1000 model, random
    noise) is rejected as an offence. Otherwise, once `min_history` distances are known,
    the pull is clipped to `clip_factor` × their median. Clipped distances enter the
    history, so after a long partition or a restart the radius widens again within a
    few exchanges and honest peers that drifted apart still converge.
    """

    clip_factor: float = 3.0
    reject_ratio: float = 3.0
    min_history: int = 8
    history: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    def screen(self, local: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor]) -> Screening:
        return self.judge(_distance(local, remote), _norm(local))

    def judge(self, distance: float, norm: float) -> Screening:
        """Screen a pull of length `distance` on a model of norm `norm` (how `screen` judges a partner's model)."""
        if distance == 0:  # identical models say nothing about honest spread: a zero radius would clip every merge
            return Screening(1.0, "identical models", 0.0)
        if distance > self.reject_ratio * max(norm, 1.0):
            reason = f"model is {distance:.3g} away, more than {self.reject_ratio:g}x our norm {norm:.3g}"
            return Screening(None, reason, distance, offence=True)
        if len(self.history) < self.min_history:
            self.history.append(distance)
            return Screening(1.0, "accepted", distance)
        radius = self.clip_factor * statistics.median(self.history)
        self.history.append(min(distance, radius))
        if distance <= radius:
            return Screening(1.0, "accepted", distance)
        return Screening(radius / distance, f"clipped from {distance:.3g} to radius {radius:.3g}", distance)
