"""`work`: each model counts in proportion to the work (samples) it embodies.

Both sides keep the pair's mean weight, which conserves Σ weight × parameters too.
"""

from __future__ import annotations

from murmur.node.learn.rules.rule import Fresh, MergeRule, MixDecision


class WorkRule(MergeRule):
    name = "work"

    def mix(self, local_weight: float, remote_weight: float, fresh: Fresh | None = None) -> MixDecision:
        total = local_weight + remote_weight
        if total == 0:
            return MixDecision(0.5, 0.0, "work: neither side has work, equal shares")
        share = remote_weight / total
        return MixDecision(share, total / 2, f"work: partner holds {share:.0%} of the pair's work")
