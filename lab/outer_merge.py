"""`--merge outer` (a lab plugin, `lab.plugins`): DiLoCo's outer optimizer made pairwise — Nesterov
momentum on the pair's pseudo-gradient. It lost every measurement of the arena (docs/arena.md), so it
is not one of `murmur run`'s own choices.

The rule keeps an anchor (this peer's model right after its last merge; `reset`, which
the replica calls with its initial model, sets the first) and a momentum buffer. At a
merge the target is the pair's weighted mean model θ̄ (what its weighting rule, `work`
by default, would merge to); the pseudo-gradient g = anchor − θ̄ holds the local
training since the anchor plus the pull toward the partner. Then m ← μ·m + g and the
new model is anchor − lr·(g + μ·m) (Nesterov), which becomes the next anchor. With
lr 1 and μ 0 it is exactly averaging with the decision's share. Optimizer state that
travels with the model (`--optimizer-state average`) is averaged with that share, never
stepped: an outer step past the pair's mean could make Adam's second moment negative.

Staleness. Peers of different speeds merge at about the same wall-clock cadence, so
between merges a slow peer's model gains fewer samples since its anchor: its fresh
pseudo-gradient (θ − anchor) is the stale, lesser contribution. Cumulative work grows
without bound and each merge gives both sides their mean, so their ratio tends to 1 and
stops telling the two apart. With `discount` κ, the partner's share is

    s = (1 − κ)·p + κ·q,   p = the weighting's share (`work`: w_r / (w_l + w_r)),
                           q = f_r / (f_l + f_r)   (q = p when f_l + f_r = 0)

where f is each side's work since its anchor, stated in the exchange. One share moves
the whole model, anchor and fresh delta together (a model travels as one tensor), so κ
trades the anchors' right share (p) against the fresh deltas' (q, which is how
synchronous speed-proportional batches weight gradients). s + s' = 1 for the two sides,
so both reach the same target; each keeps the pair's mean work, so Σ work is
conserved. With lr 1 and μ 0 the merge is plain `work` averaging exactly when κ = 0,
when a side did not state its fresh work, or when f_r / (f_l + f_r) = w_r / (w_l + w_r)
(e.g. a pair's first merge from the shared initial model, where w = f).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from murmur.node.learn.rules.rule import Fresh, MergeDelta, MergeRule, MixDecision
from murmur.node.learn.rules.work import WorkRule
from murmur.node.learn.tensors import OPTIMIZER_PREFIX

# κ: how much of the share follows the fresh work (see the module docstring); the per-sample lab's
# comparison of κ values: docs/history/2026-12-04-outer-staleness.md.
DISCOUNT = 1.0


class _Delta(dict[str, torch.Tensor]):
    """A delta computed up front (the rule's state moved with it); one piece per tensor."""

    def pieces(self, name: str) -> Iterator[tuple[slice, torch.Tensor]]:
        yield slice(None), self[name].reshape(-1)


class OuterRule(MergeRule):
    name = "outer"
    uses_fresh_work = True

    def __init__(
        self, lr: float = 0.7, momentum: float = 0.9, weighting: MergeRule | None = None, discount: float = DISCOUNT
    ) -> None:
        """Raises `ValueError` for lr outside (0, 2], momentum outside [0, 1) or `discount` outside [0, 1]."""
        if not 0 < lr <= 2 or not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be in (0, 2] and momentum in [0, 1), got {lr} and {momentum}")
        if not 0 <= discount <= 1:
            raise ValueError(f"staleness discount must be in [0, 1], got {discount}")
        self.lr, self.momentum, self.discount = lr, momentum, discount
        self._weighting = weighting if weighting is not None else WorkRule()
        self.anchor: dict[str, torch.Tensor] = {}
        self.velocity: dict[str, torch.Tensor] = {}

    def mix(self, local_work: float, remote_work: float, fresh: Fresh | None = None) -> MixDecision:
        decision = self._weighting.mix(local_work, remote_work)
        reason = f"outer step toward the {decision.reason}"
        if fresh is None or self.discount == 0:
            return MixDecision(decision.remote_share, decision.work_after, reason)
        local_fresh, remote_fresh = fresh
        total = local_fresh + remote_fresh
        fresh_share = remote_fresh / total if total > 0 else decision.remote_share
        share = (1 - self.discount) * decision.remote_share + self.discount * fresh_share
        reason += f"; partner did {fresh_share:.0%} of the fresh work: share {share:.0%}"
        return MixDecision(share, decision.work_after, reason)

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> _Delta:
        averaging = MergeDelta(snapshot, remote, share)  # where plain averaging would move the model
        delta = _Delta()
        for name in snapshot:
            local = snapshot[name]
            target = local + averaging[name]
            if name.startswith(OPTIMIZER_PREFIX):
                # Optimizer state that travels (Adam's moments) moves to the pair's mean, no outer step:
                # extrapolating past it can drive exp_avg_sq negative, and Adam then steps NaN.
                delta[name] = target - local
                self.anchor[name] = target
                continue
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
        # Copies: a checkpoint is written outside the replica's lock while merges go on.
        return {
            "lr": self.lr, "momentum": self.momentum, "discount": self.discount,
            "anchor": {n: t.clone() for n, t in self.anchor.items()},
            "velocity": {n: t.clone() for n, t in self.velocity.items()},
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # "discount" is absent from checkpoints written before the staleness rule: those keep this rule's.
        keys = {"lr", "momentum", "anchor", "velocity"}
        if not keys <= set(state) <= keys | {"discount"} or set(state["anchor"]) != set(state["velocity"]):
            raise ValueError(f"not an outer rule's state: keys {sorted(state)}")
        self.lr, self.momentum = float(state["lr"]), float(state["momentum"])
        self.discount = float(state.get("discount", self.discount))
        self.anchor = {n: t.to(torch.float32) for n, t in state["anchor"].items()}
        self.velocity = {n: t.to(torch.float32) for n, t in state["velocity"].items()}
