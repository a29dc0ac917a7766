"""A replica: one peer's copy of the model, with its optimizer, work count and merge rule.

The replica is what averaging touches: `snapshot`, `merge`, `adopt`, `checkpoint_state` and
`restore`, and, with compression, delta gossip's `publish` and `absorb`. It does not step
itself; a loop does, and counts the work it did: the built-in loop (`murmur.node.learn.loop`)
through `step`, a user's own loop (`murmur.Peer`) through `record`. Every access holds one
lock, so a merge lands between two steps and never tears one.

Who may touch the model when is the owner's business: `access` runs the averaging side's
calls (a `StepGate` hands them to the user's thread; by default they run on the calling
thread). The model lives on its own device; snapshots and checkpoints are CPU copies, and
merged or adopted tensors may come from any device and float dtype.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from murmur.node.learn.deltas import Compression, DeltaReference, Published
from murmur.node.learn.device import cpu_copy
from murmur.node.learn.rules import MergeDelta, MergeRule, WorkRule
from murmur.node.learn.tensors import ExchangedTensors, flat_update
from murmur.node.learn.weight_average import WeightAverage
from murmur.protocol.codec import TensorSpec, WireState, pieces, quantize

T = TypeVar("T")


@dataclass(frozen=True)
class Snapshot:
    """A CPU copy of the model's exchanged tensors in a wire dtype, and the work they carry.

    `state[name]` reads a tensor as CPU float32 (see `WireState`). `fresh` is the part of
    `work` this peer trained itself since its model last merged (or was adopted). `steps`
    counts the optimizer steps the replica had taken when the copy was made. With compression,
    `versions` names the deltas the copy holds (`DeltaReference.versions`).
    """

    state: WireState
    work: float
    fresh: float = 0.0
    steps: int = 0
    versions: dict[str, int] | None = None


class MergeRefused(ValueError):
    """A committed merge would have left a tensor not finite (NaN or ±inf): the replica kept its model."""


@dataclass(frozen=True)
class ModelCopy:
    """A copy of the model to evaluate, and this peer's own samples and the work it holds."""

    model: nn.Module
    samples: int
    work: float


class Access(Protocol):
    """Runs the averaging side's calls where the model may be touched (`StepGate` is one)."""

    def call(self, func: Callable[..., T], *args: Any) -> T: ...


class Direct:
    """`Access` on the calling thread: the replica's lock alone keeps its accesses apart."""

    def call(self, func: Callable[..., T], *args: Any) -> T:
        return func(*args)


def model_device(model: nn.Module) -> torch.device:
    """The one device `model`'s tensors are on; raises `ValueError` if they are spread over several."""
    devices = {t.device for t in model.state_dict().values()}
    if len(devices) != 1:
        raise ValueError(f"the model's tensors are on {len(devices)} devices ({sorted(map(str, devices))}); Murmur needs one")
    return devices.pop()


class Replica:
    """One peer's copy of the model and what travels or resumes with it; see the module docstring."""

    def __init__(
        self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer, *,
        rule: MergeRule | None = None, ema_decay: float = 0.0, access: Access | None = None,
        compression: Compression | None = None,
    ) -> None:
        """A replica of `model` (on one device; raises `ValueError` otherwise) stepped by `optimizer`.

        `name` (the task's) labels the fingerprint peers compare. `rule` (default `work`) merges
        this model with partners'; the replica owns its state, so it is checkpointed with the
        model. `ema_decay` > 0 keeps an average of the parameters over the last ~1/(1 − decay)
        steps, which is what `copy_model` gives and checkpoints hold (`WeightAverage`; raises
        `ValueError` outside [0, 1)). `access` runs `snapshot`, `merge`, `adopt`,
        `checkpoint_state` and `restore` (default: on the calling thread). `compression` keeps a
        delta reference, so that the replica can `publish` its progress as compressed deltas.
        """
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.device = model_device(model)
        self.rule = rule if rule is not None else WorkRule()
        self.average = WeightAverage(model, ema_decay)
        self._access = access if access is not None else Direct()
        self.exchanged = ExchangedTensors(model, optimizer, self.rule.optimizer_state)
        self.rule.reset(self.exchanged)  # a stateful rule starts from the initial model
        self.spec = TensorSpec.of(self.exchanged)
        self.compression = compression
        self.deltas = DeltaReference(self.exchanged) if compression else None
        self.architecture = " ".join(type(m).__name__ for m in model.modules())
        self._lock = threading.Lock()
        self.samples = 0  # samples this peer processed itself
        self.work = 0.0  # work in the current model (shared through merges)
        self.fresh = 0.0  # samples trained since the model last merged: the merge rule's staleness measure
        self.steps = 0  # optimizer steps taken: how far travelling optimizer state decayed since a snapshot
        self.last_loss = math.nan
        self.version = 0  # counts the changes to the model from outside its steps: merges, adoptions, restores

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint(f"{self.name}|{self.architecture}")

    def step(self, update: Callable[[nn.Module, torch.optim.Optimizer], torch.Tensor], work: int) -> float:
        """Run `update(model, optimizer)` (one optimizer step, returning its loss) under the lock and count `work`.

        Returns the step's compute time in seconds, lock wait excluded; reading the loss waits
        for the device, so the time is the step's real compute. `update`'s errors propagate.
        """
        with self._lock:
            start = time.perf_counter()
            loss = update(self.model, self.optimizer)
            self.average.update(self.model)
            self._count(work, loss.item())
            return time.perf_counter() - start

    def record(self, work: int, loss: float | None = None) -> None:
        """Count `work` samples (or tokens) of a step that ran outside `step` (the user's own loop) and just ended."""
        with self._lock:
            self._count(work, loss)

    def _count(self, work: int, loss: float | None) -> None:
        self.samples += work
        self.work += work
        self.fresh += work
        self.steps += 1
        if loss is not None:
            self.last_loss = loss

    def copy_model(self, into: nn.Module | None = None) -> ModelCopy:
        """The model as it is now (its weight average, if it keeps one) copied into `into`, or a new copy.

        Only the copy holds the lock: scoring it never pauses a step or a merge.
        """
        with self._lock:
            target = into if into is not None else copy.deepcopy(self.model)
            target.load_state_dict(self.average.averaged(self.model))
            return ModelCopy(target, self.samples, self.work)

    def snapshot(self, wire_dtype: str = "float32") -> Snapshot:
        """A CPU copy of the exchanged tensors in `wire_dtype`, the form they travel in.

        Partners' models arrive in the same wire dtype, so screening and merge deltas
        compare like with like whatever this model's device or dtype.
        """
        return self._access.call(self._snapshot, wire_dtype)

    def _snapshot(self, wire_dtype: str) -> Snapshot:
        with self._lock:
            versions = dict(self.deltas.versions) if self.deltas is not None else None
            return Snapshot(quantize(self.exchanged, self.spec, wire_dtype), self.work, self.fresh, self.steps, versions)

    def merge(self, snapshot: Snapshot, remote: Mapping[str, torch.Tensor], share: float, work_after: float) -> None:
        """Apply a committed merge: add the rule's delta to the live tensors, piece by piece,
        and move the work by the merge's change (steps taken since `snapshot` are kept, and stay fresh).

        Optimizer state that travels is a running average that each step since `snapshot`
        scaled by its decay, so its change is scaled the same way: the live state becomes
        the merged state at the snapshot, decayed, plus the steps taken meanwhile (an
        unscaled change would outweigh what is left of the snapshot and could drive Adam's
        second moment negative). Raises `MergeRefused` if any merged tensor would not be
        finite: the model and its work stay as they were, and the rule, whose state the
        refused delta already moved, starts over from the kept model (as after `adopt`).
        """
        self._access.call(self._merge, snapshot, remote, share, work_after)

    def _merge(self, snapshot: Snapshot, remote: Mapping[str, torch.Tensor], share: float, work_after: float) -> None:
        with self._lock, torch.no_grad():
            delta = self.rule.delta(snapshot.state, remote, share)
            steps = self.steps - snapshot.steps
            scale = {name: decay**steps for name, decay in self.exchanged.decay.items()}
            # Checked before anything is written, so a refused merge leaves the model as it was.
            unfinite = next((name for name in delta if not self._finite_after(name, delta, scale.get(name, 1.0))), None)
            if unfinite is not None:
                # Not a copy of the rule's state on every merge to put back: a refusal is rare, a restart is cheap.
                self.rule.reset(self.exchanged)
                self.fresh = 0.0
                raise MergeRefused(
                    f"the merged model would not be finite ({unfinite!r} has NaN or inf): kept the local model"
                )
            for name in delta:
                with flat_update(self.exchanged[name]) as flat:
                    for elements, change in delta.pieces(name):
                        flat[elements].add_(change.to(flat.device, flat.dtype), alpha=scale.get(name, 1.0))
                    if name in self.exchanged.nonnegative:
                        flat.clamp_(min=0)  # rounding may leave an emptied second moment a hair below 0
            self.work += work_after - snapshot.work
            self.fresh -= snapshot.fresh
            self.version += 1

    def _finite_after(self, name: str, delta: MergeDelta, scale: float) -> bool:
        """Whether tensor `name` stays finite once `delta`'s change (times `scale`) is added."""
        live = self.exchanged[name].reshape(-1)
        return all(  # in the live dtype: a half-precision model overflows sooner than float32
            bool(torch.isfinite((live[elements].to("cpu", torch.float32) + scale * change).to(live.dtype)).all())
            for elements, change in delta.pieces(name)
        )

    def publish(self, scale: float) -> Published:
        """Compress this peer's unpublished progress into a delta that every model adds `scale` of, this one
        included (`DeltaReference.publish`); the fresh work goes with it, and this model keeps its share.

        The costly part, choosing the entries (`DeltaReference.select`), runs on the calling thread
        while the model trains; only reading and moving those entries goes through `access`.
        Raises `ValueError` without compression, or (writing nothing) for a model that is not finite.
        """
        if self.deltas is None or self.compression is None:
            raise ValueError("this replica keeps no delta reference: it was built without compression")
        with torch.no_grad():
            selection = self.deltas.select(self.exchanged, self.compression)
        return self._access.call(self._publish, scale, selection)

    def _publish(self, scale: float, selection: Mapping[str, torch.Tensor]) -> Published:
        assert self.deltas is not None and self.compression is not None
        with self._lock, torch.no_grad():
            published = self.deltas.publish(self.exchanged, selection, self.compression.bits, scale, scale * self.fresh)
            self.work -= self.fresh - published.work
            self.fresh = 0.0
            self.version += 1
            return published

    def model_norm(self) -> float:
        """The L2 norm of the exchanged tensors: the yardstick for how far a partner may move them.

        Read while the model trains, without `access` or the lock: a step more or less moves a
        yardstick by far less than screening's bounds allow.
        """
        norms = [float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32)) for t in self.exchanged.values()]
        return math.sqrt(sum(n * n for n in norms))

    def delta_versions(self) -> dict[str, int]:
        """The deltas this model holds: the highest sequence number per origin (none without compression).

        Under the lock only, not through `access`: it reads no tensor, so it need not wait for the owner's step.
        """
        with self._lock:
            return dict(self.deltas.versions) if self.deltas is not None else {}

    def absorb(self, published: Published) -> None:
        """Add another peer's published delta (its `scale` of it) and the work that carries.

        Raises `ValueError` without compression, `StaleDelta` for a delta this model holds already.
        """
        self._access.call(self._absorb, published)

    def _absorb(self, published: Published) -> None:
        if self.deltas is None:
            raise ValueError("this replica keeps no delta reference: it was built without compression")
        with self._lock, torch.no_grad():
            self.deltas.apply(self.exchanged, published)
            self.work += published.work
            self.version += 1

    def adopt(self, state: Mapping[str, torch.Tensor], work: float, versions: Mapping[str, int] | None = None) -> None:
        """Replace the exchanged tensors with `state` (state sync; any device, float dtype) carrying `work`
        and, with compression, holding the deltas `versions` names.

        Optimizer state that does not travel is kept; the merge rule, the weight average and
        the delta reference start over from the new model.
        """
        self._access.call(self._adopt, state, work, versions)

    def _adopt(self, state: Mapping[str, torch.Tensor], work: float, versions: Mapping[str, int] | None) -> None:
        with self._lock, torch.no_grad():
            for name in state:
                with flat_update(self.exchanged[name]) as flat:
                    for elements, piece in pieces(state, name):
                        flat[elements].copy_(piece.to(flat.device, flat.dtype))
            self.work = work
            self.fresh = 0.0
            self.rule.reset(self.exchanged)
            if self.deltas is not None:
                self.deltas.reset(self.exchanged, versions)  # the progress adopted is the swarm's, not ours to publish
            self.average.reset(self.model)  # the swarm's model replaced this one's past
            self.version += 1

    def checkpoint_state(self) -> dict:
        """Everything needed to resume: model, optimizer, work and counters, as CPU tensors.

        CPU copies keep a checkpoint loadable on any machine: a GPU node's resumes on a CPU one.
        """
        return self._access.call(self._checkpoint_state)

    def _checkpoint_state(self) -> dict:
        with self._lock:
            return {
                "fingerprint": self.fingerprint,
                "model": cpu_copy(self.model.state_dict()),
                "optimizer": cpu_copy(self.optimizer.state_dict()),
                "work": self.work,
                "samples": self.samples,
                "fresh": self.fresh,
                "merge_rule": {"name": self.rule.name, "state": self.rule.state_dict()},
                # the model to use: a complete state dict, loadable as is (absent when no average is kept)
                **({"weight_average": cpu_copy(self.average.averaged(self.model))} if self.average.decay else {}),
                **({"delta_reference": self.deltas.state_dict()} if self.deltas is not None else {}),
            }

    def restore(self, state: dict) -> None:
        """Resume from `checkpoint_state()` output; raises `ValueError` for another model's, `KeyError` for a torn one.

        Tensors are copied onto this model's device and dtype (the optimizer's state follows its
        parameters). The merge rule's state is restored when the checkpoint holds this rule's;
        after a change of rule (or from a checkpoint without one) the rule starts over from the
        restored model. So do the weight average and the delta reference, unless the checkpoint
        holds ones that fit.
        Older checkpoints name the work "weight"; they load too.
        """
        self._access.call(self._restore, state)

    def _difference(self, state: dict) -> str:
        """Where a checkpoint's model differs from this one: the first tensor name or shape, in words."""
        saved = state.get("model")
        if not isinstance(saved, Mapping):
            return "differs"
        theirs = [[n, list(t.shape)] for n, t in saved.items() if torch.is_tensor(t) and t.is_floating_point()]
        ours = TensorSpec.of(self.model.state_dict())
        return ours.difference(theirs, complete=True, here="in this model", there="in the checkpoint")

    def _restore(self, state: dict) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(f"checkpoint belongs to another task or model (fingerprint {self._difference(state)})")
        work = float(state["work"] if "work" in state else state["weight"])
        rule = state.get("merge_rule")
        with self._lock:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.exchanged = ExchangedTensors(self.model, self.optimizer, self.rule.optimizer_state)
            if rule is not None and rule["name"] == self.rule.name:
                self.rule.load_state_dict(rule["state"])
                self.fresh = float(state.get("fresh", 0.0))  # no count saved: as if just merged
            else:
                self.rule.reset(self.exchanged)
                self.fresh = 0.0
            self.average.load_averaged(state.get("weight_average", {}), self.model)
            if self.deltas is not None:
                try:
                    self.deltas.load_state_dict(state.get("delta_reference", {}), self.exchanged)
                except ValueError:  # saved without compression: nothing unpublished to resume
                    self.deltas.reset(self.exchanged)
            self.work = work
            self.samples = int(state["samples"])
            self.version += 1
