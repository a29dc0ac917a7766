"""The learning-per-sample lab (lab/learning.py): its variants, and merges instant or lagged."""

from __future__ import annotations

import pytest
import torch

from lab.learning import Variant, _merge, run_gossip
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.rules import make_rule
from murmur.node.learn.tasks import DigitsTask


def test_variants_parse_their_names() -> None:
    assert Variant.parse("average*2") == Variant("average*2", "average", 2.0)
    outer = Variant.parse("outer:0.8:0.3+adam-avg")
    assert (outer.merge, outer.outer_lr, outer.outer_momentum, outer.adam) == ("outer", 0.8, 0.3, "avg")
    assert Variant.parse("diloco:8:0.7:0.9").local_steps == 8
    for bad in ("averag", "average:1", "sync+adam-maybe"):
        with pytest.raises(ValueError, match="unknown variant"):
            Variant.parse(bad)


def test_a_lagged_merge_applies_the_snapshots_and_keeps_the_steps_taken_meanwhile() -> None:
    task = DigitsTask()
    a, b = (TrainingLoop(task, shard=i, rule=make_rule("work", "average")) for i in range(2))
    for trainer in (a, b):
        trainer.step()
    snapshots = a.replica.snapshot(), b.replica.snapshot()
    a.step()  # during the exchange
    before = {n: t.clone() for n, t in a.replica.exchanged.items()}
    _merge(a, b, "keep", snapshots)
    for name, now in a.replica.exchanged.items():
        expected = before[name] + 0.5 * (snapshots[1].state[name] - snapshots[0].state[name])
        torch.testing.assert_close(now, expected)
    # Both had 32 samples of work at the snapshots and keep the pair's mean; a also keeps its later step.
    assert (a.replica.work, b.replica.work) == (64, 32)


@pytest.mark.parametrize("lag", [0.0, 1.5])
def test_gossip_runs_are_repeatable_and_learn(lag: float) -> None:
    runs = [run_gossip(DigitsTask(), Variant.parse("average"), [1.0, 2.0], 1024, 512, seed=0, period=2.0, lag=lag) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0].samples[-1] >= 1024 and runs[0].metric[-1] > 0.5
