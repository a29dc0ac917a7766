"""What a peer exchanges: each storage once (tied weights travel as one entry), and the
optimizer state a merge rule asks for, materialised without changing the first step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from murmur.node.learn.checkpoint import read_checkpoint, save_checkpoint
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.replica import Replica
from murmur.node.learn.rules import MergeRule, MixDecision
from murmur.node.learn.step import train_step
from murmur.node.learn.tasks.task import Batch, Metric
from murmur.node.learn.tensors import OPTIMIZER_PREFIX, ExchangedTensors, UnsupportedOptimizerState

VOCAB, DIM = 16, 8
MakeOptimizer = Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]


class TinyLM(nn.Module):
    """Embedding -> tanh(Linear) -> head, the head tied to the embedding (as GPT-2 does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


class TiedTask:
    """Next-token prediction on random tokens with a tied model; the optimizer is the test's choice."""

    name = "tied-test"
    metric = Metric("loss", higher_is_better=False)
    batch_size = 8

    def __init__(self, make_optimizer: MakeOptimizer = lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)) -> None:
        self._make_optimizer = make_optimizer

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return TinyLM()

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self._make_optimizer(model.parameters())

    def train_batches(self, shard: int) -> Iterator[Batch]:
        gen = torch.Generator().manual_seed(shard)
        while True:
            tokens = torch.randint(VOCAB, (self.batch_size, 2), generator=gen)
            yield tokens[:, 0], tokens[:, 1]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return {"loss": 0.0}


class HalfRule(MergeRule):
    """Equal shares, carrying the optimizer state named in `optimizer_state` (set per test)."""

    name = "half-test"

    def mix(self, local_work: float, remote_work: float) -> MixDecision:
        return MixDecision(0.5, (local_work + remote_work) / 2, "half")


def half_rule(*keys: str) -> HalfRule:
    return type("HalfRuleWith", (HalfRule,), {"optimizer_state": keys})()


def stepped(loop: TrainingLoop, n: int) -> Replica:
    """`loop`'s replica after `n` of its steps."""
    for _ in range(n):
        loop.step()
    return loop.replica


# --- tied weights -------------------------------------------------------------------------


def test_tied_weights_travel_as_one_entry() -> None:
    model = TinyLM()
    assert {"emb.weight", "head.weight"} <= model.state_dict().keys()
    exchanged = ExchangedTensors(model)
    assert list(exchanged) == ["emb.weight", "mix.weight", "mix.bias"]
    assert exchanged.aliases == {"head.weight": "emb.weight"}
    assert exchanged["emb.weight"].data_ptr() == model.head.weight.data_ptr()  # the live tensor, not a copy


def test_equal_but_separate_tensors_are_not_aliases() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    with torch.no_grad():
        model[1].weight.copy_(model[0].weight)  # same values, own storage
    exchanged = ExchangedTensors(model)
    assert len(exchanged) == 4 and exchanged.aliases == {}


def test_a_replica_sends_a_tied_matrix_once() -> None:
    trainer = TrainingLoop(TiedTask(), shard=0).replica
    unique = sum(t.numel() for t in trainer.exchanged.values())
    assert unique == VOCAB * DIM + DIM * DIM + DIM
    assert trainer.spec.wire_size("float32") == 4 * unique
    assert trainer.snapshot().state.keys() == {"emb.weight", "mix.weight", "mix.bias"}


def test_a_half_merge_moves_a_tied_tensor_to_the_mean() -> None:
    a, b = stepped(TrainingLoop(TiedTask(), shard=1), 3), stepped(TrainingLoop(TiedTask(), shard=2), 3)
    sa, sb = a.snapshot(), b.snapshot()
    assert (sa.state["emb.weight"] - sb.state["emb.weight"]).abs().max() > 1e-3  # they differ
    a.merge(sa, sb.state, 0.5, work_after=sa.work)
    mean = (sa.state["emb.weight"] + sb.state["emb.weight"]) / 2
    torch.testing.assert_close(a.model.emb.weight.detach(), mean, rtol=0, atol=1e-6)
    assert a.model.head.weight is a.model.emb.weight  # still one tensor


class ShareRule(MergeRule):
    """The share each test example draws: the rule itself does not decide it here."""

    name = "share-test"

    def mix(self, local_work: float, remote_work: float) -> MixDecision:
        raise AssertionError("the test passes its share to `merge` directly")


@settings(max_examples=40, deadline=None)
@given(share=st.floats(min_value=0.0, max_value=1.0))
def test_a_merge_moves_a_tied_tensor_by_exactly_its_share_of_the_difference(share: float) -> None:
    a, b = stepped(TrainingLoop(TiedTask(), shard=1, rule=ShareRule()), 2), stepped(TrainingLoop(TiedTask(), shard=2, rule=ShareRule()), 2)
    sa, sb = a.snapshot(), b.snapshot()
    local, remote = sa.state["emb.weight"], sb.state["emb.weight"]
    a.merge(sa, sb.state, share, work_after=sa.work)
    expected = local + share * (remote - local)
    torch.testing.assert_close(a.model.emb.weight.detach(), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.model.head.weight.detach(), expected, rtol=0, atol=1e-6)


def test_a_checkpoint_stores_a_tied_tensor_once(tmp_path: Path) -> None:
    state = stepped(TrainingLoop(TiedTask(), shard=1), 1).checkpoint_state()["model"]
    assert state["head.weight"].untyped_storage().data_ptr() == state["emb.weight"].untyped_storage().data_ptr()
    loaded = read_checkpoint(save_checkpoint(tmp_path, {"model": state}))["model"]
    assert loaded["head.weight"].untyped_storage().data_ptr() == loaded["emb.weight"].untyped_storage().data_ptr()


def test_a_checkpoint_round_trip_keeps_the_tie(tmp_path: Path) -> None:
    source = stepped(TrainingLoop(TiedTask(), shard=1), 3)
    resumed = TrainingLoop(TiedTask(), shard=1).replica
    resumed.restore(read_checkpoint(save_checkpoint(tmp_path, source.checkpoint_state())))
    assert resumed.model.head.weight is resumed.model.emb.weight
    assert resumed.exchanged.aliases == {"head.weight": "emb.weight"}
    torch.testing.assert_close(resumed.model.emb.weight, source.model.emb.weight, rtol=0, atol=0)
    batch = next(TiedTask().train_batches(9))
    for replica in (source, resumed):  # the same next step: momentum came back with the tie
        train_step(TiedTask(), replica.model, replica.optimizer, batch)
    torch.testing.assert_close(resumed.model.emb.weight, source.model.emb.weight)
    assert resumed.model.head.weight is resumed.model.emb.weight


# --- optimizer state ----------------------------------------------------------------------

OPTIMIZERS: dict[str, tuple[MakeOptimizer, tuple[str, ...]]] = {
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ("momentum_buffer",)),
    "sgd-nesterov": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), ("momentum_buffer",)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2), ("exp_avg", "exp_avg_sq")),
    "adamw-amsgrad": (lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True), ("exp_avg", "exp_avg_sq")),
    "adam-exp-avg-only": (lambda p: torch.optim.Adam(p, lr=1e-2), ("exp_avg",)),
}


def test_optimizer_state_is_exchanged_when_the_rule_asks_for_it_each_parameter_once() -> None:
    trainer = TrainingLoop(TiedTask(OPTIMIZERS["adamw"][0]), shard=0, rule=half_rule("exp_avg", "exp_avg_sq")).replica
    names = [n for n in trainer.exchanged if n.startswith(OPTIMIZER_PREFIX)]
    assert names == [f"{OPTIMIZER_PREFIX}{p}.{k}" for p in ("emb.weight", "mix.weight", "mix.bias") for k in ("exp_avg", "exp_avg_sq")]
    assert trainer.exchanged["optimizer.emb.weight.exp_avg"] is trainer.optimizer.state[trainer.model.emb.weight]["exp_avg"]
    assert not any(n.startswith(OPTIMIZER_PREFIX) for n in TrainingLoop(TiedTask(), shard=0, rule=half_rule()).replica.exchanged)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_materialised_state_leaves_the_first_steps_unchanged(kind: str) -> None:
    make, keys = OPTIMIZERS[kind]
    task = TiedTask()
    own, materialised = task.build_model(), task.build_model()
    own_opt, mat_opt = make(own.parameters()), make(materialised.parameters())
    exchanged = ExchangedTensors(materialised, mat_opt, keys)  # before any step
    assert all(not exchanged[f"{OPTIMIZER_PREFIX}mix.weight.{k}"].any() for k in keys)  # zeros
    batches = task.train_batches(0)
    for _ in range(2):  # the first step, and one more on the state that step left
        batch = next(batches)
        for model, opt in ((own, own_opt), (materialised, mat_opt)):
            opt.zero_grad()
            task.loss(model, batch).backward()
            opt.step()
        for p, q in zip(own.parameters(), materialised.parameters(), strict=True):
            torch.testing.assert_close(q, p, rtol=0, atol=0)


def test_a_half_merge_averages_the_exchanged_optimizer_state() -> None:
    make, keys = OPTIMIZERS["adamw"]
    a = stepped(TrainingLoop(TiedTask(make), shard=1, rule=half_rule(*keys)), 2)
    b = stepped(TrainingLoop(TiedTask(make), shard=2, rule=half_rule(*keys)), 2)
    sa, sb = a.snapshot(), b.snapshot()
    a.merge(sa, sb.state, 0.5, work_after=sa.work)
    live = a.optimizer.state[a.model.emb.weight]["exp_avg_sq"]
    name = "optimizer.emb.weight.exp_avg_sq"
    torch.testing.assert_close(live, (sa.state[name] + sb.state[name]) / 2, rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("make", "keys", "message"),
    [
        (lambda p: torch.optim.RMSprop(p, lr=1e-2), ("square_avg",), r"RMSprop keeps no per-parameter \['square_avg'\]"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), ("exp_avg",), r"SGD keeps no per-parameter \['exp_avg'\]"),
        (lambda p: torch.optim.SGD(p, lr=0.1), ("momentum_buffer",), "SGD with momentum 0 "),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5), ("momentum_buffer",), "dampening 0.5"),
    ],
)
def test_optimizer_state_that_cannot_travel_is_a_typed_error(make: MakeOptimizer, keys: tuple[str, ...], message: str) -> None:
    with pytest.raises(UnsupportedOptimizerState, match=message):
        TrainingLoop(TiedTask(make), shard=0, rule=half_rule(*keys)).replica


def test_optimizer_state_without_an_optimizer_or_of_another_model_is_refused() -> None:
    model = TinyLM()
    with pytest.raises(UnsupportedOptimizerState, match="without an optimizer"):
        ExchangedTensors(model, None, ("momentum_buffer",))
    stranger = torch.optim.SGD(list(model.parameters()) + [nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    with pytest.raises(UnsupportedOptimizerState, match="not the model's"):
        ExchangedTensors(model, stranger, ("momentum_buffer",))


def test_the_optimizer_state_of_a_restored_replica_is_exchanged_live(tmp_path: Path) -> None:
    make, keys = OPTIMIZERS["adamw"]
    source = stepped(TrainingLoop(TiedTask(make), shard=1, rule=half_rule(*keys)), 2)
    resumed = TrainingLoop(TiedTask(make), shard=1, rule=half_rule(*keys)).replica
    resumed.restore(copy.deepcopy(source.checkpoint_state()))
    live = resumed.optimizer.state[resumed.model.mix.weight]["exp_avg"]
    assert resumed.exchanged["optimizer.mix.weight.exp_avg"] is live  # not the state replaced by the restore
    torch.testing.assert_close(live, source.optimizer.state[source.model.mix.weight]["exp_avg"], rtol=0, atol=0)
