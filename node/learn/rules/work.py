"""`work`: each model counts in proportion to the work (samples) it embodies.

Both sides keep the pair's mean work, which conserves Σ work × parameters too.
"""

from __future__ import annotations

from murmur.node.learn.rules.rule import Fresh, MergeRule, MixDecision


class WorkRule(MergeRule):
    name = "work"

    def mix(self, local_work: float, remote_work: float, fresh: Fresh | None = None) -> MixDecision:
        total = local_work + remote_work
        if total == 0:
            return MixDecision(0.5, 0.0, "work: neither side has work, equal shares")
        share = remote_work / total
        return MixDecision(share, total / 2, f"work: partner holds {share:.0%} of the pair's work")
