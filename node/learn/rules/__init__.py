"""Merge rules. Adding one: a module here with a `MergeRule` subclass, its entry here, one test file.

The registries below are the seams `murmur run`'s choices come from: code outside the product
(the lab) registers more before a parser is built.
"""

from __future__ import annotations

from collections.abc import Callable

from murmur.node.learn.rules.rule import Fresh, MergeDelta, MergeRule, MixDecision, newcomer_decision
from murmur.node.learn.rules.uniform import UniformRule
from murmur.node.learn.rules.work import WorkRule

# How the two models of a pair are weighted (`--weighting`).
RULES: dict[str, type[MergeRule]] = {rule.name: rule for rule in (UniformRule, WorkRule)}
# What a merge does with that weighted pair (`--merge`): each entry turns the weighting's rule into the
# merge's. `average` moves to the weighted mean; the lab registers the merges that lost its measurements.
MERGES: dict[str, Callable[[MergeRule], MergeRule]] = {"average": lambda weighting: weighting}
# What a merge does with the inner optimizer's state (`--optimizer-state`): the per-parameter state
# keys that travel and merge with the model (`MergeRule.optimizer_state`); "keep" moves none.
OPTIMIZER_STATE: dict[str, tuple[str, ...]] = {"keep": ()}


def make_rule(weighting: str = "work", merge: str = "average", *, optimizer_state: str = "keep") -> MergeRule:
    """A fresh rule: the `merge` (`MERGES`) of two models weighted by `weighting` (`RULES`).

    `optimizer_state` names the inner optimizer's per-parameter state (Adam's moments, SGD's
    momentum) that travels and merges with the model (`OPTIMIZER_STATE`); `"keep"` leaves each peer its own.
    Raises `ValueError` naming the choices for an unknown name.
    """
    if optimizer_state not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer state handling {optimizer_state!r}; choose from {list(OPTIMIZER_STATE)}")
    if weighting not in RULES:
        raise ValueError(f"unknown merge rule {weighting!r}; choose from {sorted(RULES)}")
    if merge not in MERGES:
        raise ValueError(f"unknown merge {merge!r}; choose from {list(MERGES)}")
    rule = MERGES[merge](RULES[weighting]())
    if OPTIMIZER_STATE[optimizer_state]:
        rule.optimizer_state = OPTIMIZER_STATE[optimizer_state]
    return rule


__all__ = [
    "MERGES", "OPTIMIZER_STATE", "RULES", "Fresh", "MergeDelta", "MergeRule", "MixDecision", "UniformRule", "WorkRule",
    "make_rule", "newcomer_decision",
]  # fmt: skip
