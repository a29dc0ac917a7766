"""The `MergeRule` seam: how two peers' models become one at an exchange.

A rule decides the partner's share of the merge and says why (`decide`), produces the
change to add to the live model (`delta`), and owns whatever state it needs between
merges (`state_dict`, `load_state_dict`, `reset`), which the replica checkpoints with
the model. Both sides of an exchange evaluate the same symmetric decision, so they
arrive at the same merged parameters. Each side keeps the pair's mean work, which
conserves Σ work across the pair.

Besides the cumulative (credited) work, a decision may see each side's *fresh*
work: the samples trained since that side's model last merged (its anchor). Rules that
do not use it ignore it; a side that did not state it (`None`) leaves the rule to its
work alone.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from murmur.protocol.codec import pieces

# Work since each side's anchor, (local, remote): the samples its model gained since it last merged.
Fresh = tuple[float, float]


@dataclass(frozen=True)
class MixDecision:
    """The partner's share of the merged model, the work both sides keep, and why.

    `screen` is False while the local side has no work: it has no model of its own to
    defend, so the partner's is not screened against it (and identical initial models
    do not teach screening a radius of zero).
    """

    remote_share: float
    work_after: float
    reason: str
    screen: bool = True


def newcomer_decision(local_work: float, remote_work: float) -> MixDecision | None:
    """A side with no work yet takes the other's model whole; None when neither is a newcomer."""
    mean = (local_work + remote_work) / 2
    if local_work == 0 and remote_work > 0:
        return MixDecision(1.0, mean, "local model has no work yet: adopt the partner's", screen=False)
    if remote_work == 0 and local_work > 0:
        return MixDecision(0.0, mean, "partner has no work yet: keep the local model")
    return None


class MergeDelta(Mapping[str, torch.Tensor]):
    """The change that turns `snapshot` into `snapshot + share × (remote − snapshot)`, one tensor per lookup.

    Adding it to the live model (rather than overwriting) keeps whatever the local
    replica learned while the exchange was in flight. Each tensor is computed when
    read, and `pieces` computes it a few MB at a time, so applying a merge never holds
    a second copy of the model.
    """

    def __init__(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> None:
        self._snapshot = snapshot
        self._remote = remote
        self._share = share

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


class MergeRule(abc.ABC):
    """How this peer merges with a partner. Subclasses implement `mix`; see the module docstring."""

    name: ClassVar[str]
    # Optimizer state (per-parameter keys, e.g. "exp_avg") that travels with the model for this rule.
    optimizer_state: ClassVar[tuple[str, ...]] = ()
    # Whether `mix` uses the sides' fresh work, so that exchanges state it.
    uses_fresh_work: ClassVar[bool] = False

    def decide(self, local_work: float, remote_work: float, fresh: Fresh | None = None) -> MixDecision:
        """The merge of a local model and a partner's, given their (credited) work and,
        if both sides stated it, their fresh work (local, remote) since their anchors.

        A newcomer (no work) adopts its partner's model, whatever the rule.
        """
        decision = newcomer_decision(local_work, remote_work) or self.mix(local_work, remote_work, fresh)
        return replace(decision, screen=False) if local_work == 0 else decision

    @abc.abstractmethod
    def mix(self, local_work: float, remote_work: float, fresh: Fresh | None = None) -> MixDecision:
        """The rule's own decision for two peers that both have work (`fresh` as in `decide`)."""

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> MergeDelta:
        """The change to add to the live model, given the exchanged `snapshot`, the partner's
        `remote` tensors (both as CPU float32 on read) and the partner's final `share`.

        Called once per committed merge, under the replica's lock: a stateful rule may
        update its state here.
        """
        return MergeDelta(snapshot, remote, share)

    def state_dict(self) -> dict[str, Any]:
        """The rule's state, for checkpoints (plain tensors and numbers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; raises `ValueError` if it is not this rule's."""
        if state:
            raise ValueError(f"merge rule {self.name!r} keeps no state, got keys {sorted(state)}")

    def reset(self, model: Mapping[str, torch.Tensor]) -> None:
        """The local model was replaced by `model` wholesale (state sync): start over from it."""
