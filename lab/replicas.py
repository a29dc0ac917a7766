"""Replicas trained per sample in one process, no network, no clock: the core of the learning lab.

Every method trains on the same data streams (stream i is `task.train_batches(shards[i])`)
and is scored against the total samples all its replicas processed:

  `Sync`    one model, each step on a batch from every stream together (synchronous data parallelism);
  `Synced`  one replica per stream; every H local steps all take one outer step on their mean
            pseudo-gradient (DiLoCo; with outer lr 1 and no momentum, the exact mean of their parameters);
  `Gossip`  real `TrainingLoop`s at emulated speeds on an event-time grid, each merging with a random
            partner by the node's own rule and merge code, as `Averager` would, instantly or with a lag.
  `DeltaGossip`  the same, merging by compressed delta gossip (`murmur.node.learn.deltas`).

`run` steps a method to a sample budget and records its `Curve`. The simulator's all-reduce
baseline steps a `Sync` too.
"""

from __future__ import annotations

import copy
import heapq
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from murmur.node.learn.deltas import Compression, Published
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.replica import Replica, Snapshot
from murmur.node.learn.rules import MergeRule, make_rule
from murmur.node.learn.step import scale_learning_rate, train_step
from murmur.node.learn.tasks import Task
from murmur.node.learn.tasks.task import Metric
from murmur.node.learn.weight_average import WeightAverage
from murmur.protocol.sparse import sparse_size


class Method(Protocol):
    def step(self) -> int:
        """Advance by one event; return the samples it trained on (0 for an event that only merges)."""

    def score(self) -> float:
        """The task's held-out metric now (the median replica's, where replicas differ)."""


@dataclass
class Curve:
    """Held-out metric (median replica) against total samples processed by all replicas."""

    samples: list[int] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)

    def at(self, samples: int) -> float:
        """The metric at the last grid point at or before `samples`."""
        return next(m for s, m in zip(reversed(self.samples), reversed(self.metric)) if s <= samples)

    def samples_to(self, target: float, metric: Metric) -> int | None:
        """The first grid point's samples where `metric` reached `target`, or None."""
        return next((s for s, m in zip(self.samples, self.metric) if metric.reached(m, target)), None)


def run(method: Method, samples: int, eval_every: int) -> Curve:
    """Step `method` until it trained on `samples`; score it every `eval_every` samples and at the end."""
    curve, done, next_eval = Curve(), 0, eval_every
    while done < samples:
        done += method.step()
        if done >= next_eval or done >= samples:
            curve.samples.append(done)
            curve.metric.append(method.score())
            while next_eval <= done:
                next_eval += eval_every
    return curve


class _WithOptimizer:
    """`task` with another optimizer; everything else is the task's."""

    def __init__(self, task: Task, make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]) -> None:
        self._task = task
        self.make_optimizer = make_optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def with_optimizer(task: Task, spec: str) -> Task:
    """`task`: the task itself; `sgd:LR`: the task trained by SGD with momentum 0.9. Raises `ValueError` otherwise."""
    if spec == "task":
        return task
    if spec.startswith("sgd:"):
        lr = float(spec.split(":", 1)[1])
        return _WithOptimizer(task, lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))  # type: ignore[return-value]
    raise ValueError(f"optimizer must be 'task' or 'sgd:LR', not {spec!r}")


class Sync:
    """Synchronous data parallelism: one model, each step on one batch from every stream together.

    One step on the concatenated batch is the all-reduce of equal batches' mean gradients.
    """

    def __init__(self, task: Task, shards: Sequence[int], lr_scale: float = 1.0, ema_decay: float = 0.0) -> None:
        self.task = task
        self.model = task.build_model()
        self.optimizer = task.make_optimizer(self.model)
        scale_learning_rate(self.optimizer, lr_scale)
        self.average = WeightAverage(self.model, ema_decay)
        self._evaluated = copy.deepcopy(self.model)
        self._streams = [task.train_batches(shard) for shard in shards]

    def step(self) -> int:
        xs, ys = zip(*(next(s) for s in self._streams))
        train_step(self.task, self.model, self.optimizer, (torch.cat(xs), torch.cat(ys)))
        self.average.update(self.model)
        return sum(len(y) for y in ys)

    def score(self) -> float:
        self._evaluated.load_state_dict(self.average.averaged(self.model))
        return self.task.evaluate(self._evaluated)[self.task.metric.name]


class Synced:
    """One replica per stream; every `local_steps` steps each, one outer Nesterov step from the shared
    anchor on their mean pseudo-gradient (anchor − replica), as torchft's DiLoCo does with
    `SGD(nesterov=True)`. Optimizer state stays per replica. `outer_lr=1, outer_momentum=0`
    sets every replica to the exact mean of their parameters."""

    def __init__(
        self, task: Task, shards: Sequence[int], local_steps: int, outer_lr: float, outer_momentum: float,
        lr_scale: float = 1.0, ema_decay: float = 0.0,
    ) -> None:
        self.task, self.local_steps = task, local_steps
        self.loops = [TrainingLoop(task, shard=shard, ema_decay=ema_decay) for shard in shards]
        for replica in self.replicas:
            replica.model.load_state_dict(self.replicas[0].model.state_dict())
            scale_learning_rate(replica.optimizer, lr_scale)
        self._anchor = [p.detach().clone().requires_grad_(True) for p in self.replicas[0].model.parameters()]
        self._outer = torch.optim.SGD(self._anchor, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)

    @property
    def replicas(self) -> list[Replica]:
        return [loop.replica for loop in self.loops]

    def step(self) -> int:
        """Every replica's local steps, then the outer step; returns the samples of all local steps."""
        before = sum(r.samples for r in self.replicas)
        for loop in self.loops:
            for _ in range(self.local_steps):
                loop.step()
        with torch.no_grad():
            for k, a in enumerate(self._anchor):
                a.grad = a - torch.stack([list(r.model.parameters())[k] for r in self.replicas]).mean(0)
            self._outer.step()
            for replica in self.replicas:
                for p, a in zip(replica.model.parameters(), self._anchor):
                    p.copy_(a)
                replica.average.update(replica.model)  # the synced model is this replica's next point
        return sum(r.samples for r in self.replicas) - before

    def score(self) -> float:
        return self.loops[0].evaluate().metrics[self.task.metric.name]


def merge_pair(a: Replica, b: Replica, reset_adam: bool = False, snapshots: tuple[Snapshot, Snapshot] | None = None) -> None:
    """Both sides of one exchange, as two averagers would apply it (no screening: honest peers),
    from `snapshots` taken when it began (default: at once). `reset_adam` clears both optimizers' state after."""
    snap_a, snap_b = snapshots or (a.snapshot(), b.snapshot())
    for replica, local, remote in ((a, snap_a, snap_b), (b, snap_b, snap_a)):
        decision = replica.rule.decide(local.work, remote.work, (local.fresh, remote.fresh))
        replica.merge(local, remote.state, decision.remote_share, decision.work_after)
        if reset_adam:
            replica.optimizer.state.clear()


STEP, START_MERGE, END_MERGE = 0, 1, 2  # event kinds; at one time, steps come first


class Gossip:
    """Replicas stepping at speeds 1/slowdown; each starts a merge with a random partner every `period`
    (time unit: a step of the fastest replica). Replica i trains on stream `shards[i]`.

    With `lag` > 0 a merge takes that long, as a real exchange does: both sides snapshot at its
    start, keep stepping, and apply it at its end; a merge that would involve a replica already
    in one is skipped (a busy answer).
    """

    def __init__(
        self, task: Task, slowdowns: Sequence[float], shards: Sequence[int], rule: Callable[[], MergeRule], seed: int,
        period: float, lag: float = 0.0, reset_adam: bool = False, lr_scale: float = 1.0, ema_decay: float = 0.0,
    ) -> None:
        self.task, self.slowdowns, self.period, self.lag, self.reset_adam = task, slowdowns, period, lag, reset_adam
        self.loops = [self._loop(task, shard, rule(), ema_decay) for shard in shards]
        for loop in self.loops:
            scale_learning_rate(loop.replica.optimizer, lr_scale)
        self._rng = random.Random(seed)
        self._fastest = min(slowdowns)
        n = len(slowdowns)
        # (time, kind, replica, merge): a replica is in at most one merge, so `merge` is never compared.
        self._events: list[tuple] = [(s / self._fastest, STEP, i, None) for i, s in enumerate(slowdowns)]
        self._events += [(period * (i + 1) / n, START_MERGE, i, None) for i in range(n)]
        heapq.heapify(self._events)
        self._in_merge: set[int] = set()

    def _loop(self, task: Task, shard: int, rule: MergeRule, ema_decay: float) -> TrainingLoop:
        return TrainingLoop(task, shard=shard, rule=rule, ema_decay=ema_decay)

    def step(self) -> int:
        t, kind, i, merge = heapq.heappop(self._events)
        if kind == STEP:
            self.loops[i].step()
            heapq.heappush(self._events, (t + self.slowdowns[i] / self._fastest, STEP, i, None))
            return self.task.batch_size
        if kind == START_MERGE:
            partner = self._rng.choice([j for j in range(len(self.loops)) if j != i])
            heapq.heappush(self._events, (t + self.period, START_MERGE, i, None))
            pair = self.loops[i].replica, self.loops[partner].replica
            if not self.lag:
                self._merge_now(i, partner)
            elif not self._in_merge & {i, partner}:
                self._in_merge |= {i, partner}
                heapq.heappush(self._events, (t + self.lag, END_MERGE, i, (partner, (pair[0].snapshot(), pair[1].snapshot()))))
            return 0
        partner, snapshots = merge
        merge_pair(self.loops[i].replica, self.loops[partner].replica, self.reset_adam, snapshots)
        self._in_merge -= {i, partner}
        return 0

    def _merge_now(self, i: int, partner: int) -> None:
        merge_pair(self.loops[i].replica, self.loops[partner].replica, self.reset_adam)

    def score(self) -> float:
        return statistics.median(loop.evaluate().metrics[self.task.metric.name] for loop in self.loops)


class DeltaGossip(Gossip):
    """`Gossip`'s replicas and schedule, merging by delta gossip (`murmur.node.learn.deltas`): at each
    exchange both sides publish their progress compressed by `compression`, at scale `outer_lr`/N, then each
    applies the deltas it has and the other lacks. Merges are instant (no lag).

    `sent` counts the deltas and `sent_bytes` their encoded bytes, over `exchanges`.
    """

    def __init__(self, task: Task, slowdowns: Sequence[float], shards: Sequence[int], compression: Compression, seed: int,
                 period: float, outer_lr: float = 1.0, lr_scale: float = 1.0, ema_decay: float = 0.0) -> None:
        self._compression = compression
        self._scale = min(1.0, outer_lr / len(slowdowns))
        super().__init__(task, slowdowns, shards, lambda: make_rule("work"), seed, period, 0.0, False, lr_scale, ema_decay)
        start = self.loops[0].replica.model.state_dict()
        for loop in self.loops:  # one common start, as state sync gives a swarm
            loop.replica.model.load_state_dict(start)
            assert loop.replica.deltas is not None
            loop.replica.deltas.reset(loop.replica.exchanged)
        self._published: list[Published] = []
        self._has: list[set[int]] = [set() for _ in self.loops]
        self.sent = self.sent_bytes = self.exchanges = 0
        self.spec = self.loops[0].replica.spec

    def _loop(self, task: Task, shard: int, rule: MergeRule, ema_decay: float) -> TrainingLoop:
        return TrainingLoop(task, shard=shard, rule=rule, ema_decay=ema_decay, compression=self._compression)

    def _merge_now(self, i: int, partner: int) -> None:
        for k in (i, partner):
            self._published.append(self.loops[k].replica.publish(self._scale))
            self._has[k].add(len(self._published) - 1)
        for giver, taker in ((i, partner), (partner, i)):
            for n in sorted(self._has[giver] - self._has[taker]):
                self.loops[taker].replica.absorb(self._published[n])
                self._has[taker].add(n)
                self.sent += 1
                self.sent_bytes += sparse_size(self._published[n].delta, self._compression.bits)
        self.exchanges += 1
