"""Scored merges: a partner's model is judged by the loss it adds or removes on data this peer holds.

Distance screening (`screening.py`) cannot tell a poisoned model that stays inside the
honest spread from an honest one. Scoring can: before merging, the merged model is
scored on a few batches this peer never trains on, and a merge that raises their loss
by more than a tolerance is refused, with the figure as its reason (Templar's Gauntlet
scores contributions the same way, by the loss they remove on the validator's data).

Scoring costs forward passes, so `Trust` decides which merges to score: every merge
with a peer it has no record of, then, as the peer's merges keep lowering the held loss,
a share that falls slowly to `min_rate`. A failed score resets that peer's record, so a peer that
behaves until trusted and then attacks is scored on every merge again at once.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from murmur.node.learn.tensors import ExchangedTensors, flat_update
from murmur.protocol.codec import pieces

Batch = tuple[torch.Tensor, torch.Tensor]
HELD_SHARD = 1 << 20  # held batches come from the stream of shard HELD_SHARD + this peer's: one it does not train on


@dataclass(frozen=True)
class Score:
    """The loss of our model and of the merged one on the held batches, and the verdict.

    `passed` is False when the merge would raise the loss by more than the tolerance;
    `reason` says by how much either way.
    """

    local_loss: float
    merged_loss: float
    passed: bool
    reason: str

    @property
    def change(self) -> float:
        """The merge's relative change of the held batches' loss (negative: the merge helps)."""
        return _relative_change(self.local_loss, self.merged_loss)


@dataclass
class Trust:
    """A peer's record of scored merges: which of its merges to score, and whether its models show training.

    A peer with `n` passes since its last failure is scored with probability
    max(`min_rate`, `ramp` / (`ramp` + `n`)): trust grows slowly and never to blind. Only a
    pass that did not raise the held loss counts: a merge that raises it within the
    tolerance is allowed, but earns no trust, so a peer whose models only just pass (the
    dissensus attack, a free-rider's stale echo) is scored on every merge. A failure puts
    the peer on probation: its next `probation` merges are refused unscored.
    Work earns credit only with evidence of training: once a peer has `min_evidence` recent
    scores (of the last `window`), their mean change of our held loss must be at most
    `max_mean_change`; a peer whose models add loss on average (a free-rider echoing stale
    models, a subtle poisoner just inside the tolerance) is refused until its record improves.
    """

    ramp: float = 1.0
    min_rate: float = 0.1
    probation: int = 4
    window: int = 8
    min_evidence: int = 4
    max_mean_change: float = 0.002
    passes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    changes: dict[str, deque[float]] = field(default_factory=dict)
    _probation: dict[str, int] = field(default_factory=dict)

    def rate(self, peer_id: str) -> float:
        """The probability that `peer_id`'s next merge is scored."""
        return max(self.min_rate, self.ramp / (self.ramp + self.passes.get(peer_id, 0)))

    def should_score(self, peer_id: str, rng: random.Random) -> bool:
        return rng.random() < self.rate(peer_id)

    def on_probation(self, peer_id: str) -> str | None:
        """Why `peer_id`'s merge is refused unscored (it failed a score lately), counting it; None if it is not."""
        left = self._probation.get(peer_id, 0)
        if not left:
            return None
        self._probation[peer_id] = left - 1
        return f"on probation after a failed score ({left - 1} more merges refused)"

    def record(self, peer_id: str, score: Score) -> None:
        """Count a scored merge: a pass that did not raise the held loss adds to the peer's record, a failure
        wipes it and starts a probation."""
        self.changes.setdefault(peer_id, deque(maxlen=self.window)).append(score.change)
        if score.passed:
            if score.change <= 0.0:
                self.passes[peer_id] = self.passes.get(peer_id, 0) + 1
        else:
            self.passes[peer_id] = 0
            self.failures[peer_id] = self.failures.get(peer_id, 0) + 1
            self._probation[peer_id] = self.probation

    def lacks_evidence(self, peer_id: str) -> str | None:
        """Why `peer_id`'s models show no training (its recent scores add loss on average), or None."""
        changes = self.changes.get(peer_id, ())
        if len(changes) < self.min_evidence:
            return None
        mean = sum(changes) / len(changes)
        if mean <= self.max_mean_change:
            return None
        return f"no evidence of training: its last {len(changes)} scored models raised our held loss by {mean:.2%} on average"


class MergeScorer:
    """Scores merges on `batches` (data this peer holds and does not train on) with `loss`.

    Keeps one scratch copy of `model` (same device) to load the models it scores into.
    `tolerance` is the relative rise of the held loss a merge may cause and still pass.
    """

    def __init__(
        self,
        model: nn.Module,
        loss: Callable[[nn.Module, Batch], torch.Tensor],
        batches: Sequence[Batch],
        *,
        tolerance: float = 0.01,
    ) -> None:
        """Raises `ValueError` without batches or for a negative tolerance."""
        if not batches:
            raise ValueError("a scorer needs at least one held batch")
        if tolerance < 0:
            raise ValueError(f"tolerance must be at least 0, not {tolerance}")
        self._scratch = copy.deepcopy(model)
        self._scratch.eval()
        self._tensors = ExchangedTensors(self._scratch)  # tied weights once: writing one name writes both
        device = next(self._scratch.parameters()).device
        self._batches = [(x.to(device), y.to(device)) for x, y in batches]
        self._loss = loss
        self.tolerance = tolerance

    def held_loss(
        self, state: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor] | None = None, share: float = 0.0
    ) -> float:
        """The mean loss on the held batches of `state + share × (remote − state)` (`state` alone without `remote`).

        Names outside the model (travelling optimizer state) are ignored.
        """
        with torch.no_grad():
            for name, tensor in self._tensors.items():
                with flat_update(tensor) as flat:
                    if remote is None or share == 0.0:
                        for elements, piece in pieces(state, name):
                            flat[elements].copy_(piece)
                    else:
                        for (elements, mine), (_, theirs) in zip(
                            pieces(state, name), pieces(remote, name), strict=True
                        ):
                            flat[elements].copy_(mine + share * (theirs - mine))
            return sum(float(self._loss(self._scratch, batch)) for batch in self._batches) / len(self._batches)

    def score(self, local: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> Score:
        """Whether merging `share` of `remote` into `local` keeps the held loss within the tolerance."""
        before = self.held_loss(local)
        after = self.held_loss(local, remote, share)
        change = _relative_change(before, after)
        if change > self.tolerance:
            return Score(
                before, after, False, f"scored: merging the partner's model raises our held loss by {change:.1%}"
            )
        return Score(before, after, True, f"scored: held loss {'+' if change >= 0 else ''}{change:.1%}")


def _relative_change(before: float, after: float) -> float:
    return (after - before) / max(abs(before), 1e-12)


def held_batches(batches: Iterator[Batch], windows: int) -> list[Batch]:
    """The first `windows` examples of `batches` (a task's stream), in its batches; raises `ValueError` for none."""
    if windows < 1:
        raise ValueError(f"a scorer needs at least one held window, not {windows}")
    held: list[Batch] = []
    while windows > 0:
        x, y = next(batches)
        held.append((x[:windows], y[:windows]))
        windows -= len(held[-1][0])
    return held
