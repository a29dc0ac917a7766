"""The replica: work counted, merges that keep in-flight progress, its merge rule's state, checkpoints, access through its owner."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from lab.outer_merge import OuterRule
from murmur.node.learn.checkpoint import read_checkpoint, save_checkpoint
from murmur.node.learn.deltas import Compression
from murmur.node.learn.replica import MergeRefused, Replica, Snapshot
from murmur.node.learn.rules import MergeDelta, MergeRule, UniformRule, WorkRule, make_rule
from murmur.node.learn.step import train_step
from murmur.node.learn.tasks import DigitsTask
from murmur.node.learn.tensors import ALL_OPTIMIZER_STATE, OPTIMIZER_PREFIX
from murmur.node.learn.user_loop import StepGate

TASK = DigitsTask()


BATCHES = TASK.train_batches(0)


def make(rule: MergeRule | None = None, seed: int = 0, **options: Any) -> Replica:
    """A digits replica whose initial model is seed `seed`'s."""
    torch.manual_seed(seed)
    model = TASK.build_model()
    return Replica(TASK.name, model, TASK.make_optimizer(model), rule=rule, **options)


def step(replica: Replica) -> float:
    """One training step on the next digits batch, as the built-in loop takes it."""
    batch = next(BATCHES)
    return replica.step(lambda model, optimizer: train_step(TASK, model, optimizer, batch), len(batch[0]))


def test_step_counts_work_and_merge_keeps_in_flight_progress() -> None:
    replica = make()
    step(replica)
    snapshot = replica.snapshot()
    assert snapshot.work == replica.samples == 32
    step(replica)  # progress made while an exchange is in flight
    progressed = replica.snapshot().state
    remote = {n: torch.zeros_like(t) for n, t in snapshot.state.items()}
    replica.merge(snapshot, remote, 0.5, work_after=40.0)
    after = replica.snapshot()
    for name, tensor in after.state.items():
        expected = progressed[name] + 0.5 * (remote[name] - snapshot.state[name])
        torch.testing.assert_close(tensor, expected)
    assert after.work == 40.0 + 32  # the merge's work plus the step taken meanwhile


class CountingRule(WorkRule):
    """A test-only stateful rule: counts merges and keeps every share it applied."""

    name = "counting-test"

    def __init__(self) -> None:
        self.merges = 0
        self.shares = torch.zeros(0, dtype=torch.float64)
        self.reset_with: dict[str, torch.Tensor] | None = None

    def delta(self, snapshot: Mapping[str, torch.Tensor], remote: Mapping[str, torch.Tensor], share: float) -> MergeDelta:
        self.merges += 1
        self.shares = torch.cat([self.shares, torch.tensor([share], dtype=torch.float64)])
        return super().delta(snapshot, remote, share)

    def state_dict(self) -> dict[str, Any]:
        return {"merges": self.merges, "shares": self.shares.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.keys() != {"merges", "shares"}:
            raise ValueError(f"not a {self.name} state: {sorted(state)}")
        self.merges, self.shares = int(state["merges"]), state["shares"].clone()

    def reset(self, model: Mapping[str, torch.Tensor]) -> None:
        self.merges, self.shares = 0, torch.zeros(0, dtype=torch.float64)
        self.reset_with = {name: tensor.detach().clone() for name, tensor in model.items()}


def _merge_with_zeros(replica: Replica, share: float) -> None:
    snapshot = replica.snapshot()
    replica.merge(snapshot, {n: torch.zeros_like(t) for n, t in snapshot.state.items()}, share, snapshot.work)


def test_the_rules_state_is_checkpointed_and_restored_exactly(tmp_path: Path) -> None:
    replica = make(rule=CountingRule())
    step(replica)
    for share in (0.25, 1 / 3):
        _merge_with_zeros(replica, share)
    resumed = make(rule=CountingRule())
    resumed.restore(read_checkpoint(save_checkpoint(tmp_path, replica.checkpoint_state())))
    assert resumed.rule.merges == 2
    assert torch.equal(resumed.rule.shares, torch.tensor([0.25, 1 / 3], dtype=torch.float64))
    _merge_with_zeros(resumed, 0.5)  # and it goes on from there
    assert resumed.rule.merges == 3 and replica.rule.merges == 2


def test_adopt_starts_the_rule_over_from_the_adopted_model() -> None:
    source = make(seed=1)
    for _ in range(3):
        step(source)
    replica = make(rule=CountingRule())
    step(replica)
    _merge_with_zeros(replica, 0.5)
    adopted = source.snapshot()
    replica.adopt(adopted.state, adopted.work)
    assert replica.rule.merges == 0 and replica.rule.reset_with is not None
    assert replica.rule.reset_with.keys() == adopted.state.keys()
    for name, tensor in adopted.state.items():
        torch.testing.assert_close(replica.rule.reset_with[name], tensor)
    assert replica.work == adopted.work


def test_a_checkpoint_of_another_rule_keeps_the_model_and_starts_the_rule_over() -> None:
    # Switching --weighting or --merge between runs must not throw away a peer's work.
    written = make(rule=UniformRule())
    step(written)
    replica = make(rule=CountingRule())
    replica.restore(written.checkpoint_state())
    assert replica.samples == 32 and replica.rule.merges == 0 and replica.rule.reset_with is not None
    model = written.snapshot().state
    assert all(torch.equal(t, model[n]) for n, t in replica.snapshot().state.items())


def test_a_checkpoint_from_before_merge_rules_restores_with_a_fresh_rule() -> None:
    written = make()
    step(written)
    state = written.checkpoint_state()
    del state["merge_rule"]
    replica = make(rule=CountingRule())
    step(replica)
    _merge_with_zeros(replica, 0.5)
    replica.restore(state)
    assert replica.samples == 32 and replica.rule.merges == 0 and replica.rule.reset_with is not None


def test_a_checkpoint_that_names_the_work_weight_still_resumes() -> None:
    written = make()
    step(written)
    state = written.checkpoint_state()
    state["weight"] = state.pop("work")  # as checkpoints on disk from before the rename say it
    replica = make()
    replica.restore(state)
    assert (replica.work, replica.samples) == (32.0, 32)


def test_a_checkpoint_of_another_model_is_refused() -> None:
    other = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="fingerprint differs"):
        make().restore(Replica("digits", other, torch.optim.SGD(other.parameters(), lr=0.1)).checkpoint_state())


def test_work_of_a_step_taken_elsewhere_is_recorded_with_its_loss() -> None:
    replica = make()
    replica.record(7, loss=0.25)
    replica.record(5)
    assert (replica.samples, replica.work, replica.fresh, replica.last_loss) == (12, 12.0, 12.0, 0.25)


def test_a_model_copy_is_a_separate_module_reused_when_given() -> None:
    replica = make(ema_decay=0.5)
    step(replica)
    copied = replica.copy_model()
    assert copied.model is not replica.model and (copied.samples, copied.work) == (32, 32.0)
    averaged = replica.average.averaged(replica.model)
    assert all(torch.equal(t, averaged[n]) for n, t in copied.model.state_dict().items())
    step(replica)
    assert replica.copy_model(copied.model).model is copied.model


def test_the_averaging_side_reaches_the_model_through_the_owners_access() -> None:
    gate = StepGate()
    replica = make(access=gate)
    gate.open()  # an owner thread's loop runs: other threads' calls wait for its `serve`
    taken: list[Snapshot] = []
    thread = threading.Thread(target=lambda: taken.append(replica.snapshot()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while gate.pending() == 0:
        assert time.monotonic() < deadline, "the snapshot never reached the gate"
        time.sleep(0.001)
    replica.record(32)  # the owner's step ends before it serves the snapshot
    assert gate.serve() == 1
    thread.join(10)
    assert [s.work for s in taken] == [32.0]


def test_a_model_on_several_devices_is_refused() -> None:
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="on 2 devices"):
        Replica("t", model, torch.optim.SGD(model.parameters(), lr=0.1))


def _adam_replica(rule: MergeRule) -> Replica:
    """A small linear model under AdamW (charlm's betas) whose moments travel with it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    rule.optimizer_state = ALL_OPTIMIZER_STATE
    return Replica("adam-test", model, torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99)), rule=rule)


def _adam_step(replica: Replica, gradient_scale: float) -> None:
    def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        optimizer.zero_grad()
        loss = gradient_scale * model(torch.ones(3, 6)).square().sum()
        loss.backward()
        optimizer.step()
        return loss.detach()

    replica.step(update, 3)


@pytest.mark.parametrize("merge", ["average", "outer"])
def test_adams_moments_merged_after_steps_in_flight_stay_what_an_adam_would_hold(merge: str) -> None:
    """The moments' change decays as the steps taken during the exchange decayed the snapshot's moments.

    Early large gradients fill the second moment; ~150 small steps decay it below the share
    the merge takes from it. Adding the undecayed change drove it negative, and the next
    Adam step turned the model NaN.
    """
    replica = _adam_replica(make_rule("work") if merge == "average" else OuterRule(weighting=WorkRule()))
    for _ in range(5):
        _adam_step(replica, 100.0)
    snapshot = replica.snapshot()
    steps = 150
    for _ in range(steps):  # the exchange is in flight
        _adam_step(replica, 1e-3)
    live = {n: t.clone() for n, t in replica.exchanged.items()}
    remote = {n: torch.zeros_like(t) if n.startswith(OPTIMIZER_PREFIX) else t for n, t in snapshot.state.items()}
    replica.merge(snapshot, remote, 0.5, snapshot.work)
    for name, decay in replica.exchanged.decay.items():
        expected = live[name] + decay**steps * 0.5 * (remote[name] - snapshot.state[name])
        torch.testing.assert_close(replica.exchanged[name], expected)
    assert all((replica.exchanged[n] >= 0).all() for n in replica.exchanged.nonnegative)
    _adam_step(replica, 1e-3)
    assert all(torch.isfinite(p).all() for p in replica.model.parameters())


def test_a_merge_that_would_not_be_finite_is_refused_and_changes_nothing() -> None:
    replica = _adam_replica(OuterRule(weighting=WorkRule()))
    _adam_step(replica, 1.0)
    snapshot = replica.snapshot()
    remote = {n: t.clone() for n, t in snapshot.state.items()}
    remote["weight"][0, 0] = float("nan")
    before = {n: t.clone() for n, t in replica.exchanged.items()}
    with pytest.raises(MergeRefused, match="'weight' has NaN or inf"):
        replica.merge(snapshot, remote, 0.5, snapshot.work)
    assert all(torch.equal(t, before[n]) for n, t in replica.exchanged.items())
    assert all(torch.equal(replica.rule.anchor[n], t) for n, t in before.items())  # the rule starts over from it
    assert not any(v.any() for v in replica.rule.velocity.values())
    assert (replica.work, replica.fresh, replica.version) == (3.0, 0.0, 0)
    remote["weight"][0, 0] = 3e38  # finite, but an outer step past it overflows
    with pytest.raises(MergeRefused, match="not be finite"):
        replica.merge(snapshot, remote, 1.0, snapshot.work)


def test_publishing_counts_the_work_a_delta_carries_and_absorbing_adds_it() -> None:
    sender, receiver = make(compression=Compression(0.1, 2)), make(compression=Compression(0.1, 2))
    step(sender)
    step(sender)
    published = sender.publish(0.25)
    assert published.work == 0.25 * 2 * TASK.batch_size and sender.fresh == 0
    assert sender.work == 0.25 * 2 * TASK.batch_size  # it keeps its own share of what it sent
    receiver.absorb(published)
    assert receiver.work == published.work and receiver.delta_versions() == sender.delta_versions()
    with pytest.raises(ValueError, match="without compression"):
        make().publish(0.5)


def test_the_delta_reference_and_versions_resume_from_a_checkpoint(tmp_path: Path) -> None:
    replica = make(compression=Compression(0.1, 2))
    step(replica)
    replica.publish(0.5)
    step(replica)  # progress not yet published: it stays x − r across the restart
    resumed = make(compression=Compression(0.1, 2))
    resumed.restore(read_checkpoint(save_checkpoint(tmp_path, replica.checkpoint_state())))
    assert resumed.delta_versions() == replica.delta_versions()
    for name, reference in replica.deltas.reference.items():
        assert torch.equal(resumed.deltas.reference[name], reference)
    plain = make()  # a checkpoint written without compression: nothing unpublished to resume
    again = make(compression=Compression(0.1, 2))
    again.restore(read_checkpoint(save_checkpoint(tmp_path / "plain", plain.checkpoint_state())))
    assert again.deltas.residual_norm(again.exchanged) == 0 and again.delta_versions() == {}


def test_adopting_a_synced_model_takes_the_deltas_it_holds() -> None:
    replica = make(compression=Compression(0.1, 2))
    step(replica)
    replica.adopt(make(seed=1).snapshot().state, 64.0, {"elsewhere": 7})
    assert replica.delta_versions() == {"elsewhere": 7} and replica.deltas.residual_norm(replica.exchanged) == 0


def test_publishing_chooses_its_entries_before_it_waits_for_the_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Selecting the top entries reads the whole model: it runs on the caller's thread, so the
    owner's loop pauses only for reading and moving the chosen entries."""
    inside: list[bool] = []

    class Watched:
        def __init__(self) -> None:
            self.running = False

        def call(self, func: Any, *args: Any) -> Any:
            self.running = True
            try:
                return func(*args)
            finally:
                self.running = False

    access = Watched()
    replica = make(compression=Compression(0.1, 2), access=access)
    select = replica.deltas.select

    def watched_select(*args: Any) -> dict:
        inside.append(access.running)
        return select(*args)

    monkeypatch.setattr(replica.deltas, "select", watched_select)
    step(replica)
    published = replica.publish(0.5)
    assert inside == [False] and published.seq == 1
