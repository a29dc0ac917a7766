"""Merge rules. Adding one: a module here with a `MergeRule` subclass, its entry in `RULES`, one test file."""

from __future__ import annotations

from node.learn.rules.rule import MergeDelta, MergeRule, MixDecision, newcomer_decision
from node.learn.rules.outer import OuterRule
from node.learn.rules.uniform import UniformRule
from node.learn.rules.work import WorkRule

RULES: dict[str, type[MergeRule]] = {rule.name: rule for rule in (UniformRule, WorkRule, OuterRule)}


def make_rule(name: str) -> MergeRule:
    """A fresh rule called `name`; raises `ValueError` listing the choices."""
    if name not in RULES:
        raise ValueError(f"unknown merge rule {name!r}; choose from {sorted(RULES)}")
    return RULES[name]()


__all__ = ["RULES", "MergeDelta", "MergeRule", "MixDecision", "OuterRule", "UniformRule", "WorkRule", "make_rule", "newcomer_decision"]
