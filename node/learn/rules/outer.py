"""`outer`: DiLoCo's outer optimizer made pairwise — Nesterov momentum on the pair's pseudo-gradient.

The rule keeps an anchor (this peer's model right after its last merge; `reset`, which
the trainer calls with its initial model, sets the first) and a momentum buffer. At a
merge the target is the pair's weighted mean model θ̄ (what its weighting rule, `work`
by default, would merge to); the pseudo-gradient g = anchor − θ̄ holds the local
training since the anchor plus the pull toward the partner. Then m ← μ·m + g and the
new model is anchor − lr·(g + μ·m) (Nesterov), which becomes the next anchor. With
lr 1 and μ 0 it is exactly that weighting's averaging.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from murmur.node.learn.rules.rule import MergeDelta, MergeRule, MixDecision
from murmur.node.learn.rules.work import WorkRule


class _Delta(dict[str, torch.Tensor]):
    """A delta computed up front (the rule's state moved with it); one piece per tensor."""

    def pieces(self, name: str) -> Iterator[tuple[slice, torch.Tensor]]:
        yield slice(None), self[name].reshape(-1)


class OuterRule(MergeRule):
    name = "outer"

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, weighting: MergeRule | None = None) -> None:
        if not 0 < lr <= 2 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be in (0, 2] and momentum in [0, 1), got {lr} and {momentum}")
        self.lr, self.momentum = lr, momentum
        self._weighting = weighting if weighting is not None else WorkRule()
        self.anchor: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}

    def mix(self, local_weight: float, remote_weight: float) -> MixDecision:
        decision = self._weighting.mix(local_weight, remote_weight)
        return MixDecision(decision.remote_share, decision.weight_after, f"outer step toward the {decision.reason}")

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> _Delta:
        averaging = MergeDelta(snapshot, remote, share)  # where plain averaging would move the model
        delta = _Delta()
        for name in snapshot:
            local = snapshot[name]
            target = local + averaging[name]
            gradient = self.anchor[name] - target
            velocity = self.velocity[name].mul_(self.momentum).add_(gradient)
            moved = self.anchor[name] - self.lr * (gradient + self.momentum * velocity)
            delta[name] = moved - local
            self.anchor[name] = moved
        return delta

    def reset(self, model: Mapping[str, torch.Tensor]) -> None:
        self.anchor = {name: model[name].detach().to("cpu", torch.float32, copy=True) for name in model}
        self.velocity = {name: torch.zeros_like(t) for name, t in self.anchor.items()}

    def state_dict(self) -> dict[str, Any]:
        # Copies: a checkpoint is written outside the trainer's lock while merges go on.
        return {
            "lr": self.lr, "momentum": self.momentum,
            "anchor": {n: t.clone() for n, t in self.anchor.items()},
            "velocity": {n: t.clone() for n, t in self.velocity.items()},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"lr", "momentum", "anchor", "velocity"} or set(state["anchor"]) != set(state["velocity"]):
            raise ValueError(f"not an outer rule's state: keys {sorted(state)}")
        self.lr, self.momentum = float(state["lr"]), float(state["momentum"])
        self.anchor = {n: t.to(torch.float32) for n, t in state["anchor"].items()}
        self.velocity = {n: t.to(torch.float32) for n, t in state["velocity"].items()}
