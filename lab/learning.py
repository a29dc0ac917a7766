"""Learning per sample, in one process and in event time: gossip merge rules against synchronous training.

The wall-clock benchmark (`murmur bench`) mixes two things: how fast peers process
samples and how much each sample teaches. This lab isolates the second, exactly and
repeatably. N real `TrainingLoop`s (the node's own step, merge rules and merge code) step at
their emulated speeds on an event-time grid; every `period` (in steps of the fastest
peer) each peer merges with a random partner, as `Averager` would, instantly and
without a network. Synchronous data parallelism is one model stepping on all ranks'
batches at once. Every method is scored at the same total sample counts.

    python -m lab.learning --task charlm --samples 20480 --variants sync,average,outer:0.7:0.9

Variants (comma-separated; `*LR` multiplies the task's learning rate, e.g. `average*2`):
  sync                  one model, each step on all peers' batches together (sync-equal)
  average               pairwise work-weighted averaging (`--merge average`)
  outer:LR:MU[:K]       pairwise outer Nesterov steps (`--merge outer --outer-lr LR --outer-momentum MU`);
                        K is the staleness discount κ (default: the rule's; 0 = shares from cumulative work only)
  diloco:H:LR:MU        every rank takes H local steps, then all average their pseudo-gradients and take
                        one outer Nesterov step (synchronous DiLoCo; per sample, speeds do not matter)
  ...+adam-avg          the pair also averages Adam's moments (`+adam-avg1`: only the first, exp_avg);
                        `+adam-reset` restarts them after a merge

`--lag L` makes each merge take L steps of the fastest peer, as a real exchange does: the pair
snapshots at its start, keeps stepping, and applies it at its end (`--lag 0`: instant).
`--ema-decay D` scores every method's moving average of its weights (`WeightAverage`), not its live model.
"""

from __future__ import annotations

import sys
import copy
import heapq
import random
import statistics
from dataclasses import dataclass, field

import torch

from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.replica import Snapshot
from murmur.node.learn.rules import DISCOUNT, make_rule
from murmur.node.learn.step import scale_learning_rate, train_step
from murmur.node.learn.tasks import Task
from murmur.node.learn.weight_average import WeightAverage


@dataclass(frozen=True)
class Variant:
    """One method of the lab, parsed from its name (see the module docstring)."""

    name: str
    merge: str  # "sync", "average", "outer" or "diloco"
    lr_scale: float = 1.0
    local_steps: int = 0  # diloco's H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_discount: float = DISCOUNT
    adam: str = "keep"  # what a merge does to Adam's moments: keep, avg, avg1 (exp_avg only) or reset

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """`outer:0.7:0.9*2+adam-reset` and the like; raises `ValueError` for anything else."""
        body, _, adam = text.partition("+adam-")
        body, _, scale = body.partition("*")
        merge, *hyper = body.split(":")
        if merge not in ("sync", "average", "outer", "diloco") or (hyper and merge in ("sync", "average")) or adam not in ("", "keep", "avg", "avg1", "reset"):
            raise ValueError(f"unknown variant {text!r}; see the module docstring")
        names = ("local_steps", "outer_lr", "outer_momentum") if merge == "diloco" else ("outer_lr", "outer_momentum", "outer_discount")
        outer = {k: (int if k == "local_steps" else float)(v) for k, v in zip(names, hyper)}
        return cls(text, merge, float(scale or 1.0), adam=adam or "keep", **outer)


@dataclass
class Curve:
    """Held-out metric (median peer) against total samples processed by all peers."""

    samples: list[int] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)

    def at(self, samples: int) -> float:
        """The metric at the last grid point at or before `samples`."""
        return next(m for s, m in zip(reversed(self.samples), reversed(self.metric)) if s <= samples)

    def samples_to(self, target: float, higher: bool) -> int | None:
        return next((s for s, m in zip(self.samples, self.metric) if (m >= target if higher else m <= target)), None)


def run_sync(
    task: Task, peers: int, samples: int, eval_every: int, seed: int, lr_scale: float = 1.0, ema_decay: float = 0.0,
) -> Curve:
    """One model; each step takes one batch from each of `peers` data streams (equal batches)."""
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    scale_learning_rate(optimizer, lr_scale)
    average, evaluated = WeightAverage(model, ema_decay), copy.deepcopy(model)
    streams = [task.train_batches(1000 * seed + i) for i in range(peers)]
    curve, done = Curve(), 0
    while done < samples:
        xs, ys = zip(*(next(s) for s in streams))
        train_step(task, model, optimizer, (torch.cat(xs), torch.cat(ys)))
        average.update(model)
        done += sum(len(x) for x in xs)
        if done % eval_every < peers * task.batch_size or done >= samples:
            evaluated.load_state_dict(average.averaged(model))
            curve.samples.append(done)
            curve.metric.append(task.evaluate(evaluated)[task.metric.name])
    return curve


def run_diloco(
    task: Task, variant: Variant, peers: int, samples: int, eval_every: int, seed: int, ema_decay: float = 0.0,
) -> Curve:
    """Synchronous DiLoCo: `peers` replicas each take H local steps, then one outer Nesterov step
    on their mean pseudo-gradient (anchor − replica), as torchft's DiLoCo does with `SGD(nesterov=True)`."""
    replicas = [TrainingLoop(task, shard=1000 * seed + i, ema_decay=ema_decay) for i in range(peers)]
    for trainer in replicas[1:]:
        trainer.replica.model.load_state_dict(replicas[0].replica.model.state_dict())
    for trainer in replicas:
        scale_learning_rate(trainer.replica.optimizer, variant.lr_scale)
    anchor = [p.detach().clone().requires_grad_(True) for p in replicas[0].replica.model.parameters()]
    outer = torch.optim.SGD(anchor, lr=variant.outer_lr, momentum=variant.outer_momentum, nesterov=variant.outer_momentum > 0)
    curve, done, next_eval = Curve(), 0, eval_every
    while done < samples:
        for trainer in replicas:
            for _ in range(variant.local_steps):
                trainer.step()
        done += peers * variant.local_steps * task.batch_size
        with torch.no_grad():
            for k, a in enumerate(anchor):
                a.grad = a - torch.stack([list(t.replica.model.parameters())[k] for t in replicas]).mean(0)
            outer.step()
            for trainer in replicas:
                for p, a in zip(trainer.replica.model.parameters(), anchor):
                    p.copy_(a)
                trainer.replica.average.update(trainer.replica.model)  # the synced model is this replica's next point
        if done >= next_eval or done >= samples:
            curve.samples.append(done)
            curve.metric.append(replicas[0].evaluate().metrics[task.metric.name])
            next_eval += eval_every
    return curve


def _merge(a: TrainingLoop, b: TrainingLoop, adam: str, snapshots: tuple[Snapshot, Snapshot] | None = None) -> None:
    """Both sides of one exchange, as two averagers would apply it (no screening: honest peers),
    from `snapshots` taken when it began (default: now)."""
    snap_a, snap_b = snapshots or (a.replica.snapshot(), b.replica.snapshot())
    for trainer, local, remote in ((a, snap_a, snap_b), (b, snap_b, snap_a)):
        decision = trainer.replica.rule.decide(local.work, remote.work, (local.fresh, remote.fresh))
        trainer.replica.merge(local, remote.state, decision.remote_share, decision.work_after)
        if adam == "reset":
            trainer.replica.optimizer.state.clear()


def run_gossip(
    task: Task, variant: Variant, slowdowns: list[float], samples: int, eval_every: int, seed: int, period: float,
    lag: float = 0.0, ema_decay: float = 0.0,
) -> Curve:
    """Peers stepping at speeds 1/slowdown; each starts a merge with a random partner every `period`
    (time unit: a step of the fastest peer). Returns the median peer's metric against total samples.

    With `lag` > 0 a merge takes that long, as a real exchange does: both sides snapshot at its
    start, keep stepping, and apply it at its end; a merge that would involve a peer already in
    one is skipped (a busy answer).
    """
    rng = random.Random(seed)
    trainers = []
    for i in range(len(slowdowns)):
        rule = make_rule(
            "work", variant.merge, outer_lr=variant.outer_lr, outer_momentum=variant.outer_momentum,
            outer_discount=variant.outer_discount,
        )
        if variant.adam in ("avg", "avg1"):  # what `optimizer_state` travels with the model
            rule.optimizer_state = ("exp_avg", "exp_avg_sq") if variant.adam == "avg" else ("exp_avg",)
        trainer = TrainingLoop(task, shard=1000 * seed + i, rule=rule, ema_decay=ema_decay)
        scale_learning_rate(trainer.replica.optimizer, variant.lr_scale)
        trainers.append(trainer)
    fastest = min(slowdowns)
    # (time, kind, peer, merge): kind 0 = a step ends, 1 = the peer starts a merge, 2 = its merge (partner,
    # snapshots) ends; ties resolve steps first. A peer is in at most one merge, so `merge` is never compared.
    events: list[tuple] = [(s / fastest, 0, i, None) for i, s in enumerate(slowdowns)]
    events += [(period * (i + 1) / len(slowdowns), 1, i, None) for i in range(len(slowdowns))]
    heapq.heapify(events)
    in_merge: set[int] = set()
    curve, done, next_eval = Curve(), 0, eval_every
    while done < samples:
        t, kind, i, merge = heapq.heappop(events)
        if kind == 0:
            trainers[i].step()
            done += task.batch_size
            heapq.heappush(events, (t + slowdowns[i] / fastest, 0, i, None))
        elif kind == 1:
            partner = rng.choice([j for j in range(len(trainers)) if j != i])
            heapq.heappush(events, (t + period, 1, i, None))
            if not lag:
                _merge(trainers[i], trainers[partner], variant.adam)
            elif not in_merge & {i, partner}:
                in_merge |= {i, partner}
                heapq.heappush(events, (t + lag, 2, i, (partner, (trainers[i].replica.snapshot(), trainers[partner].replica.snapshot()))))
        else:
            partner, snapshots = merge
            _merge(trainers[i], trainers[partner], variant.adam, snapshots)
            in_merge -= {i, partner}
        if done >= next_eval or done >= samples:
            curve.samples.append(done)
            curve.metric.append(statistics.median(tr.evaluate().metrics[task.metric.name] for tr in trainers))
            next_eval += eval_every
    return curve


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import time
    from pathlib import Path

    from murmur.node.learn.tasks import load_task

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--samples", type=int, default=20480, help="total samples per run")
    parser.add_argument("--eval-every", type=int, default=2048, help="samples between evaluations")
    parser.add_argument("--slowdowns", default="1,1,2,4")
    parser.add_argument("--period", type=float, default=4.0, help="steps of the fastest peer between a peer's merges")
    parser.add_argument("--lag", type=float, default=0.0, help="steps of the fastest peer a merge takes (0: instant)")
    parser.add_argument("--ema-decay", type=float, default=0.0, help="score moving averages of the weights (0: live models)")
    parser.add_argument("--variants", default="sync,average,outer:0.7:0.9")
    parser.add_argument("--target", type=float, default=None, help="report samples to reach this metric")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/learning.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = load_task(args.task)
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    variants = [Variant.parse(v) for v in args.variants.split(",")]
    rows = []
    for seed in range(args.seeds):  # seeds outer, variants inner: interleaved
        for variant in variants:
            began = time.monotonic()
            if variant.merge == "sync":
                curve = run_sync(task, len(slowdowns), args.samples, args.eval_every, seed, variant.lr_scale, args.ema_decay)
            elif variant.merge == "diloco":
                curve = run_diloco(task, variant, len(slowdowns), args.samples, args.eval_every, seed, args.ema_decay)
            else:
                curve = run_gossip(task, variant, slowdowns, args.samples, args.eval_every, seed, args.period, args.lag, args.ema_decay)
            row = {"variant": variant.name, "seed": seed, "samples": curve.samples, "metric": curve.metric,
                   "final": curve.metric[-1], "wall_s": round(time.monotonic() - began, 1)}
            if args.target is not None:
                row["samples_to_target"] = curve.samples_to(args.target, task.metric.higher_is_better)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("samples", "metric")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\n{task.name}, slowdowns {args.slowdowns}, period {args.period:g}, lag {args.lag:g}, EMA decay {args.ema_decay:g}, "
          f"{args.samples} samples, medians over {args.seeds} seeds:")
    print("| variant | final " + task.metric.name + " | samples to target |")
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant.name]
        reached = [r.get("samples_to_target") for r in mine]
        to_target = statistics.median(s for s in reached if s) if all(reached) and args.target else None
        print(f"| {variant.name} | {statistics.median(r['final'] for r in mine):.3f} | {to_target or '—'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
