"""Where does averaging lose samples? A controlled comparison in one process, no network, no clock.

Trains a task two ways for the same total samples, on the same data streams:

  sync         one model, each step on the n peers' batches together (n x B), as the
               all-reduce baseline of the heterogeneous benchmark does;
  replicas/H   n models with batch B each, their parameters set to the exact mean every
               H steps (optimizer state stays per replica, as on Murmur peers).

With SGD and momentum, replicas averaged every step (H=1) equal sync exactly, so what a
gossip swarm loses at equal samples comes from models drifting apart between merges
(H > 1). With Adam(W) each replica normalises its steps by its own batch-B gradient
statistics, so even H=1 differs from sync's n x B step at the same learning rate.

    python -m lab.averaging_gap --task charlm --samples 15360 --every 1,6 --optimizer task,sgd:0.3

Writes `--out` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from murmur.node.learn.step import train_step
from murmur.node.learn.tasks import Task, load_task

Optimizer = Callable[[torch.nn.Module], torch.optim.Optimizer]


def make_optimizer(task: Task, spec: str) -> Optimizer:
    """`task`: the task's own optimizer; `sgd:LR`: SGD with momentum 0.9. Raises `ValueError` otherwise."""
    if spec == "task":
        return task.make_optimizer
    if spec.startswith("sgd:"):
        lr = float(spec.split(":", 1)[1])
        return lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be 'task' or 'sgd:LR', not {spec!r}")


def train_sync(task: Task, optimizer: Optimizer, steps: int, replicas: int, seed: int) -> torch.nn.Module:
    """One model, `steps` steps on all replicas' batches at once."""
    model = task.build_model()
    opt = optimizer(model)
    streams = [task.train_batches(1000 * seed + r) for r in range(replicas)]
    for _ in range(steps):
        xs, ys = zip(*(next(s) for s in streams))
        train_step(task, model, opt, (torch.cat(xs), torch.cat(ys)))
    return model


def train_replicas(task: Task, optimizer: Optimizer, steps: int, replicas: int, seed: int, every: int) -> list[torch.nn.Module]:
    """`replicas` models, `steps` steps each on their own batches, parameters averaged every `every` steps."""
    models = [task.build_model() for _ in range(replicas)]
    opts = [optimizer(m) for m in models]
    streams = [task.train_batches(1000 * seed + r) for r in range(replicas)]
    for step in range(1, steps + 1):
        for model, opt, stream in zip(models, opts, streams):
            train_step(task, model, opt, next(stream))
        if step % every == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
    return models


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--samples", type=int, default=15360, help="total samples per method (default: sync-equal's to the charlm target)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--every", default="1,6", help="comma-separated averaging intervals H, in steps")
    parser.add_argument("--optimizer", default="task,sgd:0.3", help="comma-separated: task (its own) and/or sgd:LR")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("results/averaging-gap.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = load_task(args.task)
    metric = task.metric.name
    steps = args.samples // (args.replicas * task.batch_size)
    samples = steps * args.replicas * task.batch_size  # whole steps of every replica
    rows = []
    for spec in args.optimizer.split(","):
        optimizer = make_optimizer(task, spec)
        for seed in range(args.seeds):
            began = time.monotonic()
            row = {"optimizer": spec, "seed": seed, "sync": task.evaluate(train_sync(task, optimizer, steps, args.replicas, seed))[metric]}
            for every in (int(h) for h in args.every.split(",")):
                models = train_replicas(task, optimizer, steps, args.replicas, seed, every)
                row[f"every {every}"] = task.evaluate(models[0])[metric]
            row["wall_s"] = time.monotonic() - began
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"task": args.task, "samples": samples,
                                    "replicas": args.replicas, "metric": metric, "rows": rows}, indent=1))
    columns = [k for k in rows[0] if k not in ("optimizer", "seed", "wall_s")]
    print(f"\n{args.task}, {args.replicas} replicas x batch {task.batch_size}, {samples} samples, held-out {metric}:")
    print("| optimizer | seed | " + " | ".join(columns) + " |")
    for row in rows:
        cells = [f"{row[c]:.3f} ({row[c] / row['sync'] - 1:+.1%})" if c != "sync" else f"{row[c]:.3f}" for c in columns]
        print(f"| {row['optimizer']} | {row['seed']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
