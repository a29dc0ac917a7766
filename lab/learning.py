"""Learning per sample, in one process and in event time: merge rules against synchronous training.

The wall-clock benchmark (`murmur bench`) mixes two things: how fast peers process
samples and how much each sample teaches. This lab isolates the second, exactly and
repeatably (`lab.replicas`): every method trains on the same data streams, one per peer,
and is scored at the same total sample counts. Gossip variants are N real `TrainingLoop`s (the
node's own step, merge rules and merge code) stepping at their emulated speeds on an
event-time grid; every `period` (in steps of the fastest peer) each merges with a random
partner, as `Averager` would, without a network.

    python -m lab.learning --task charlm --samples 20480 --variants sync,average,outer:0.7:0.9
    python -m lab.learning --task charlm --samples 15360 --variants sync,mean:1,mean:6 --optimizer sgd:0.3

Variants (comma-separated; `*LR` multiplies the task's learning rate, e.g. `average*2`):
  sync                  one model, each step on all peers' batches together (sync-equal)
  average               pairwise work-weighted averaging (`--merge average`)
  outer:LR:MU[:K]       pairwise outer Nesterov steps (`--merge outer --outer-lr LR --outer-momentum MU`);
                        K is the staleness discount κ (default: the rule's; 0 = shares from cumulative work only)
  diloco:H:LR:MU        every rank takes H local steps, then all average their pseudo-gradients and take
                        one outer Nesterov step (synchronous DiLoCo; per sample, speeds do not matter)
  mean:H                every rank takes H local steps, then all take the exact mean of their parameters
                        (`diloco:H:1:0`). With SGD and momentum, `mean:1` is `sync` exactly; so what a gossip
                        swarm loses at equal samples comes from models drifting apart between merges (H > 1).
                        With Adam(W) each replica normalises its steps by its own batch's gradient statistics,
                        so even `mean:1` differs from sync's N-batch step at the same learning rate
  delta:DENSITY:BITS[:LR]  compressed delta gossip: at each merge both sides publish the top DENSITY of their
                        unpublished progress in BITS bits (2, 4 or 8), for every model to add LR/N of (default
                        1/N for N peers: their mean progress), and swap the deltas the other lacks
  ...+adam-avg          the pair also averages Adam's moments (`+adam-avg1`: only the first, exp_avg);
                        `+adam-reset` restarts them after a merge

`--lag L` makes each merge take L steps of the fastest peer, as a real exchange does: the pair
snapshots at its start, keeps stepping, and applies it at its end (`--lag 0`: instant).
`--ema-decay D` scores every method's moving average of its weights (`WeightAverage`), not its live model.
`--optimizer sgd:LR` trains every method with SGD and momentum 0.9 instead of the task's own optimizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.outer_merge import DISCOUNT, OuterRule
from lab.replicas import DeltaGossip, Gossip, Method, Sync, Synced, run, with_optimizer
from murmur.node.learn.deltas import Compression
from murmur.node.learn.rules import MergeRule, WorkRule, make_rule
from murmur.node.learn.tasks import Task, load_task

MERGES = ("sync", "average", "outer", "diloco", "mean", "delta")


@dataclass(frozen=True)
class Variant:
    """One method of the lab, parsed from its name (see the module docstring)."""

    name: str
    merge: str  # one of MERGES
    lr_scale: float = 1.0
    local_steps: int = 0  # diloco's and mean's H
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_discount: float = DISCOUNT
    adam: str = "keep"  # what a merge does to Adam's moments: keep, avg, avg1 (exp_avg only) or reset
    compression: Compression | None = None  # delta's

    @classmethod
    def parse(cls, text: str) -> "Variant":
        """`outer:0.7:0.9*2+adam-reset` and the like; raises `ValueError` for anything else."""
        body, _, adam = text.partition("+adam-")
        body, _, scale = body.partition("*")
        merge, *hyper = body.split(":")
        arity = {"sync": 0, "average": 0, "outer": 3, "diloco": 3, "mean": 1, "delta": 3}
        if merge not in MERGES or len(hyper) > arity[merge] or adam not in ("", "keep", "avg", "avg1", "reset") \
                or (merge == "mean" and len(hyper) != 1) or (merge == "delta" and len(hyper) < 2):
            raise ValueError(f"unknown variant {text!r}; see the module docstring")
        if merge == "delta":
            return cls(text, merge, float(scale or 1.0), outer_lr=float(hyper[2]) if len(hyper) > 2 else 1.0,
                       compression=Compression(float(hyper[0]), int(hyper[1])))
        if merge == "mean":
            return cls(text, merge, float(scale or 1.0), int(hyper[0]), outer_lr=1.0, outer_momentum=0.0, adam=adam or "keep")
        names = ("local_steps", "outer_lr", "outer_momentum") if merge == "diloco" else ("outer_lr", "outer_momentum", "outer_discount")
        outer = {k: (int if k == "local_steps" else float)(v) for k, v in zip(names, hyper)}
        return cls(text, merge, float(scale or 1.0), adam=adam or "keep", **outer)


def method(
    task: Task, variant: Variant, slowdowns: list[float], seed: int, period: float, lag: float = 0.0, ema_decay: float = 0.0,
) -> Method:
    """The `lab.replicas` method `variant` names, one replica (or stream) per slowdown, on shards `1000 * seed + i`."""
    shards = [1000 * seed + i for i in range(len(slowdowns))]
    if variant.merge == "sync":
        return Sync(task, shards, variant.lr_scale, ema_decay)
    if variant.merge == "delta":
        assert variant.compression is not None
        return DeltaGossip(task, slowdowns, shards, variant.compression, seed, period, variant.outer_lr, variant.lr_scale, ema_decay)
    if variant.merge in ("diloco", "mean"):
        return Synced(task, shards, variant.local_steps, variant.outer_lr, variant.outer_momentum, variant.lr_scale, ema_decay)

    def rule() -> MergeRule:
        made = make_rule("work") if variant.merge == "average" else \
            OuterRule(variant.outer_lr, variant.outer_momentum, weighting=WorkRule(), discount=variant.outer_discount)
        if variant.adam in ("avg", "avg1"):  # what `optimizer_state` travels with the model
            made.optimizer_state = ("exp_avg", "exp_avg_sq") if variant.adam == "avg" else ("exp_avg",)
        return made

    return Gossip(task, slowdowns, shards, rule, seed, period, lag, variant.adam == "reset", variant.lr_scale, ema_decay)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--samples", type=int, default=20480, help="total samples per run")
    parser.add_argument("--eval-every", type=int, default=2048, help="samples between evaluations")
    parser.add_argument("--slowdowns", default="1,1,2,4")
    parser.add_argument("--period", type=float, default=4.0, help="steps of the fastest peer between a peer's merges")
    parser.add_argument("--lag", type=float, default=0.0, help="steps of the fastest peer a merge takes (0: instant)")
    parser.add_argument("--ema-decay", type=float, default=0.0, help="score moving averages of the weights (0: live models)")
    parser.add_argument("--optimizer", default="task", help="task (its own) or sgd:LR (SGD with momentum 0.9)")
    parser.add_argument("--variants", default="sync,average,outer:0.7:0.9")
    parser.add_argument("--target", type=float, default=None, help="report samples to reach this metric")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("results/learning.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = with_optimizer(load_task(args.task), args.optimizer)
    slowdowns = [float(s) for s in args.slowdowns.split(",")]
    variants = [Variant.parse(v) for v in args.variants.split(",")]
    rows = []
    for seed in range(args.seeds):  # seeds outer, variants inner: interleaved
        for variant in variants:
            began = time.monotonic()
            runner = method(task, variant, slowdowns, seed, args.period, args.lag, args.ema_decay)
            curve = run(runner, args.samples, args.eval_every)
            row = {"variant": variant.name, "seed": seed, "samples": curve.samples, "metric": curve.metric,
                   "final": curve.metric[-1], "wall_s": round(time.monotonic() - began, 1)}
            if isinstance(runner, DeltaGossip):  # what a merge sends, against the model's float32 bytes
                row["sent_share_per_exchange"] = runner.sent_bytes / max(1, runner.exchanges) / (4 * runner.spec.numel)
                row["deltas_per_exchange"] = runner.sent / max(1, runner.exchanges)
            if args.target is not None:
                row["samples_to_target"] = curve.samples_to(args.target, task.metric)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("samples", "metric")}), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\n{task.name}, slowdowns {args.slowdowns}, period {args.period:g}, lag {args.lag:g}, EMA decay {args.ema_decay:g}, "
          f"optimizer {args.optimizer}, {args.samples} samples, medians over {args.seeds} seeds:")
    print("| variant | final " + task.metric.name + " | samples to target |")
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant.name]
        reached = [r.get("samples_to_target") for r in mine]
        to_target = statistics.median(s for s in reached if s) if all(reached) and args.target else None
        print(f"| {variant.name} | {statistics.median(r['final'] for r in mine):.3f} | {to_target or '—'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
