"""`uniform`: plain gossip averaging, both models count equally."""

from __future__ import annotations

from murmur.node.learn.rules.rule import Fresh, MergeRule, MixDecision


class UniformRule(MergeRule):
    """Half of each model (newcomers excepted); both sides keep the pair's mean work."""

    name = "uniform"

    def mix(self, local_work: float, remote_work: float, fresh: Fresh | None = None) -> MixDecision:
        return MixDecision(0.5, (local_work + remote_work) / 2, "uniform: equal shares")
