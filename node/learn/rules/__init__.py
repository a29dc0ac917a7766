"""Merge rules. Adding one: a module here with a `MergeRule` subclass, its entry here, one test file."""

from __future__ import annotations

from node.learn.rules.outer import OuterRule
from node.learn.rules.rule import MergeDelta, MergeRule, MixDecision, newcomer_decision
from node.learn.rules.uniform import UniformRule
from node.learn.rules.work import WorkRule

# How the two models of a pair are weighted (`--weighting`).
RULES: dict[str, type[MergeRule]] = {rule.name: rule for rule in (UniformRule, WorkRule)}
# What a merge does with that weighted pair (`--merge`): move to it, or take an outer step toward it.
MERGES = ("average", "outer")


def make_rule(weighting: str = "work", merge: str = "average", *, outer_lr: float = 0.7, outer_momentum: float = 0.9) -> MergeRule:
    """A fresh rule: `weighting` averaging, or (`merge="outer"`) outer steps toward the pair's `weighting` mean.

    Raises `ValueError` naming the choices for an unknown name, or for outer hyperparameters out of range.
    """
    if weighting not in RULES:
        raise ValueError(f"unknown merge rule {weighting!r}; choose from {sorted(RULES)}")
    if merge not in MERGES:
        raise ValueError(f"unknown merge {merge!r}; choose from {list(MERGES)}")
    averaging = RULES[weighting]()
    return averaging if merge == "average" else OuterRule(outer_lr, outer_momentum, weighting=averaging)


__all__ = [
    "MERGES", "RULES", "MergeDelta", "MergeRule", "MixDecision", "OuterRule", "UniformRule", "WorkRule",
    "make_rule", "newcomer_decision",
]  # fmt: skip
