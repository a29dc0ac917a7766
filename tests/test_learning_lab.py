"""The per-sample lab (lab/replicas.py, lab/learning.py): its methods, its variants, merges instant or lagged."""

from __future__ import annotations

import pytest
import torch

from lab.learning import Variant, method
from lab.replicas import Gossip, Sync, Synced, merge_pair, run, with_optimizer
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.rules import make_rule
from murmur.node.learn.tasks import DigitsTask


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_variants_parse_their_names() -> None:
    assert Variant.parse("average*2") == Variant("average*2", "average", 2.0)
    outer = Variant.parse("outer:0.8:0.3+adam-avg")
    assert (outer.merge, outer.outer_lr, outer.outer_momentum, outer.adam) == ("outer", 0.8, 0.3, "avg")
    assert Variant.parse("diloco:8:0.7:0.9").local_steps == 8
    mean = Variant.parse("mean:6")
    assert (mean.merge, mean.local_steps, mean.outer_lr, mean.outer_momentum) == ("mean", 6, 1.0, 0.0)
    for bad in ("averag", "average:1", "sync+adam-maybe", "mean", "mean:1:2"):
        with pytest.raises(ValueError, match="unknown variant"):
            Variant.parse(bad)


def test_each_variant_builds_its_method() -> None:
    task = DigitsTask()
    kinds = {name: type(method(task, Variant.parse(name), [1.0, 2.0], seed=0, period=2.0))
             for name in ("sync", "mean:1", "diloco:4:0.7:0.9", "average", "outer:0.7:0.9")}  # fmt: skip
    assert kinds == {"sync": Sync, "mean:1": Synced, "diloco:4:0.7:0.9": Synced, "average": Gossip, "outer:0.7:0.9": Gossip}


def test_sgd_replicas_averaged_every_step_equal_sync_training() -> None:
    # Digits trains with SGD and momentum: setting 4 replicas to their mean after every step is
    # exactly one model trained on their batches together.
    task, shards = DigitsTask(), [0, 1, 2, 3]
    sync, mean = Sync(task, shards), Synced(task, shards, local_steps=1, outer_lr=1.0, outer_momentum=0.0)
    for _ in range(20):
        assert sync.step() == mean.step() == 4 * task.batch_size
    torch.testing.assert_close(_flat(mean.replicas[0].model), _flat(sync.model), rtol=0, atol=1e-4)  # float rounding only
    # Averaging less often does not.
    apart = Synced(task, shards, local_steps=5, outer_lr=1.0, outer_momentum=0.0)
    for _ in range(4):
        apart.step()
    assert (_flat(apart.replicas[0].model) - _flat(sync.model)).abs().max() > 1e-3  # 10x the rounding allowed above


def test_optimizer_choices() -> None:
    task = DigitsTask()
    assert with_optimizer(task, "task") is task
    sgd = with_optimizer(task, "sgd:0.1")
    optimizer = sgd.make_optimizer(sgd.build_model())
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.1
    assert (sgd.name, sgd.batch_size) == (task.name, task.batch_size)
    with pytest.raises(ValueError, match="sgd:LR"):
        with_optimizer(task, "adam")


def test_a_lagged_merge_applies_the_snapshots_and_keeps_the_steps_taken_meanwhile() -> None:
    task = DigitsTask()
    a, b = (TrainingLoop(task, shard=i, rule=make_rule("work", "average")) for i in range(2))
    for loop in (a, b):
        loop.step()
    snapshots = a.replica.snapshot(), b.replica.snapshot()
    a.step()  # during the exchange
    before = {n: t.clone() for n, t in a.replica.exchanged.items()}
    merge_pair(a.replica, b.replica, snapshots=snapshots)
    for name, now in a.replica.exchanged.items():
        expected = before[name] + 0.5 * (snapshots[1].state[name] - snapshots[0].state[name])
        torch.testing.assert_close(now, expected)
    # Both had 32 samples of work at the snapshots and keep the pair's mean; a also keeps its later step.
    assert (a.replica.work, b.replica.work) == (64, 32)


@pytest.mark.parametrize("lag", [0.0, 1.5])
def test_gossip_runs_are_repeatable_and_learn(lag: float) -> None:
    variant = Variant.parse("average")
    runs = [run(method(DigitsTask(), variant, [1.0, 2.0], seed=0, period=2.0, lag=lag), 1024, 512) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0].samples == [512, 1024] and runs[0].metric[-1] > 0.5


def test_every_method_is_scored_on_the_sample_grid_and_at_the_end() -> None:
    curve = run(Sync(DigitsTask(), [0, 1]), samples=600, eval_every=256)  # steps of 64 samples
    assert curve.samples == [256, 512, 640]
    assert curve.at(600) == curve.metric[1]
