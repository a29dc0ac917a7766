"""Pairwise merging: how much of the partner's model to take, and the merge itself.

A `WeightingPolicy` decides the partner's share of the merged model from both work
weights and says why. Both sides of an exchange evaluate the same symmetric rule, so
they arrive at the same merged parameters; each then sets its weight to the pair's
mean, which conserves Σ weight across the pair and, under `work`, Σ weight × parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from protocol.codec import pieces


@dataclass(frozen=True)
class MixDecision:
    """The partner's share of the merged model, the weight both sides keep, and why."""

    remote_share: float
    weight_after: float
    reason: str


class WeightingPolicy(Protocol):
    name: str

    def mix(self, local_weight: float, remote_weight: float) -> MixDecision:
        """Decide a merge of a local model and a partner's, given their work weights."""


def _newcomer(local_weight: float, remote_weight: float) -> MixDecision | None:
    mean = (local_weight + remote_weight) / 2
    if local_weight == 0 and remote_weight > 0:
        return MixDecision(1.0, mean, "local model has no work yet: adopt the partner's")
    if remote_weight == 0 and local_weight > 0:
        return MixDecision(0.0, mean, "partner has no work yet: keep the local model")
    return None


class UniformWeighting:
    """Plain gossip averaging: both models count equally (newcomers excepted)."""

    name = "uniform"

    def mix(self, local_weight: float, remote_weight: float) -> MixDecision:
        return _newcomer(local_weight, remote_weight) or MixDecision(
            0.5, (local_weight + remote_weight) / 2, "uniform: equal shares"
        )


class WorkWeighting:
    """Each model counts in proportion to the work (samples) it embodies."""

    name = "work"

    def mix(self, local_weight: float, remote_weight: float) -> MixDecision:
        total = local_weight + remote_weight
        if total == 0:
            return MixDecision(0.5, 0.0, "work: neither side has work, equal shares")
        decision = _newcomer(local_weight, remote_weight)
        if decision:
            return decision
        share = remote_weight / total
        return MixDecision(share, total / 2, f"work: partner holds {share:.0%} of the pair's work")


POLICIES: dict[str, type[UniformWeighting] | type[WorkWeighting]] = {"uniform": UniformWeighting, "work": WorkWeighting}


def make_policy(name: str) -> WeightingPolicy:
    """Return the policy called `name`; raises `ValueError` listing the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown weighting {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()


class MergeDelta(Mapping[str, torch.Tensor]):
    """The change that turns `snapshot` into the merged model, one tensor per lookup.

    Adding it to the live model (rather than overwriting) keeps whatever the local
    trainer learned while the exchange was in flight. Each tensor is computed when
    read, and `pieces` computes it a few MB at a time, so applying a merge never holds
    a second copy of the model.
    """

    def __init__(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], remote_share: float) -> None:
        self._snapshot = snapshot
        self._remote = remote
        self._share = remote_share

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.sub(self._remote[name], self._snapshot[name]).mul_(self._share)  # one temporary, not two

    def pieces(self, name: str) -> Iterator[tuple[slice, torch.Tensor]]:
        """Tensor `name` of the delta as (elements, flat float32 piece): a few MB at a time."""
        for (elements, snap), (_, remote) in zip(pieces(self._snapshot, name), pieces(self._remote, name), strict=True):
            yield elements, torch.sub(remote, snap).mul_(self._share)  # pieces may be views: no in-place

    def __iter__(self) -> Iterator[str]:
        return iter(self._snapshot)

    def __len__(self) -> int:
        return len(self._snapshot)


def merge_delta(
    snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], remote_share: float
) -> MergeDelta:
    """The change that turns `snapshot` into `snapshot + remote_share × (remote − snapshot)`."""
    return MergeDelta(snapshot, remote, remote_share)
