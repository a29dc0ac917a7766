"""The in-process averaging comparison: what it rests on."""

import pytest
import torch

from murmur.node.learn.tasks import DigitsTask
from lab.averaging_gap import make_optimizer, train_replicas, train_sync


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_sgd_replicas_averaged_every_step_equal_sync_training() -> None:
    # Digits trains with SGD and momentum: averaging 4 replicas after every step is
    # exactly one model trained on their batches together.
    task = DigitsTask()
    sync = train_sync(task, task.make_optimizer, steps=20, replicas=4, seed=0)
    replicas = train_replicas(task, task.make_optimizer, steps=20, replicas=4, seed=0, every=1)
    torch.testing.assert_close(_flat(replicas[0]), _flat(sync), rtol=0, atol=1e-4)  # float rounding only
    # Averaging less often does not.
    apart = train_replicas(task, task.make_optimizer, steps=20, replicas=4, seed=0, every=5)
    assert (_flat(apart[0]) - _flat(sync)).abs().max() > 1e-3  # 10x the rounding allowed above


def test_optimizer_choices() -> None:
    task = DigitsTask()
    model = task.build_model()
    assert isinstance(make_optimizer(task, "sgd:0.1")(model), torch.optim.SGD)
    with pytest.raises(ValueError, match="sgd:LR"):
        make_optimizer(task, "adam")
