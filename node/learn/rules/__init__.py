"""Merge rules. Adding one: a module here with a `MergeRule` subclass, its entry here, one test file.

The registries below are the seams `murmur run`'s choices come from: code outside the product
(the lab) registers more before a parser is built.
"""

from __future__ import annotations

from murmur.node.learn.rules.outer import DISCOUNT, OuterRule
from murmur.node.learn.rules.rule import Fresh, MergeDelta, MergeRule, MixDecision, newcomer_decision
from murmur.node.learn.rules.uniform import UniformRule
from murmur.node.learn.rules.work import WorkRule

# How the two models of a pair are weighted (`--weighting`).
RULES: dict[str, type[MergeRule]] = {rule.name: rule for rule in (UniformRule, WorkRule)}
# What a merge does with that weighted pair (`--merge`): move to it, or take an outer step toward it.
MERGES = ("average", "outer")
# What a merge does with the inner optimizer's state (`--optimizer-state`): the per-parameter state
# keys that travel and merge with the model (`MergeRule.optimizer_state`); "keep" moves none.
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {"keep": ()}


def make_rule(
    weighting: str = "work", merge: str = "average", *, outer_lr: float = 0.7, outer_momentum: float = 0.9,
    optimizer_state: str = "keep", outer_discount: float = DISCOUNT,
) -> MergeRule:
    """A fresh rule: `weighting` averaging, or (`merge="outer"`) outer steps toward the pair's `weighting` mean.

    `optimizer_state` names the inner optimizer's per-parameter state (Adam's moments, SGD's
    momentum) that travels and merges with the model (`OPTIMIZER_STATE`); `"keep"` leaves each peer its own.
    `outer_discount` is the outer rule's staleness discount κ (see `murmur.node.learn.rules.outer`).
    Raises `ValueError` naming the choices for an unknown name, or for outer hyperparameters out of range.
    """
    if optimizer_state not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer state handling {optimizer_state!r}; choose from {list(OPTIMIZER_STATE)}")
    if weighting not in RULES:
        raise ValueError(f"unknown merge rule {weighting!r}; choose from {sorted(RULES)}")
    if merge not in MERGES:
        raise ValueError(f"unknown merge {merge!r}; choose from {list(MERGES)}")
    averaging = RULES[weighting]()
    rule = averaging if merge == "average" else OuterRule(outer_lr, outer_momentum, weighting=averaging, discount=outer_discount)
    if OPTIMIZER_STATE[optimizer_state]:
        rule.optimizer_state = OPTIMIZER_STATE[optimizer_state]
    return rule


__all__ = [
    "DISCOUNT", "MERGES", "OPTIMIZER_STATE", "RULES", "Fresh", "MergeDelta", "MergeRule", "MixDecision", "OuterRule", "UniformRule", "WorkRule",
    "make_rule", "newcomer_decision",
]  # fmt: skip
