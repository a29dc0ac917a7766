"""What a synchronous rank is told (`Config`, pickled to its process) and the rules that follow from it alone:
its trace peer (`slot_of`) and its first share of the step (`batch_sizes`). `lab.sync_rank` re-exports them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lab.rebalance import proportional_split
from lab.traces import Trace

MODES = ("equal", "proportional", "diloco", "adaptive", "diloco-proportional")
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Config:
    """Everything a rank needs; pickled to each rank's process."""

    task: str
    slowdowns: tuple[float, ...]
    mode: str
    duration: float
    step_time_ms: float | None
    target: float | None
    eval_every: float
    seed: int
    port: int
    pg_timeout_s: float
    lr_scale: float = 1.0  # multiplies the task's learning rate (the sweep's knob)
    local_steps: int = 16  # diloco: inner steps between syncs
    outer_lr: float = 0.7  # diloco's outer Nesterov step
    outer_momentum: float = 0.9
    min_samples: int = 0  # train past the target until this many samples (where the bench compares every method)
    ema_decay: float = 0.0  # evaluate a moving average of the weights, as `murmur run --ema-decay` does
    # Where the rendezvous store listens. On loopback the parent hosts it; over slow links each rank has its own
    # network namespace, which the parent is not in, so rank 0 hosts it on its namespace's address.
    store_host: str = HOST
    store_on_rank0: bool = False
    trace: Trace | None = None  # paces the ranks instead of `slowdowns` (then the trace's initial ones)
    slots: tuple[int, ...] | None = None  # each rank's trace peer and data shard (default: rank r is peer r)
    rebalance_every: int = 10  # adaptive: steps between re-splits of the batch
    outer_wire: str = "int8"  # diloco modes: how the pseudo-gradients travel ("float32" or "int8")
    broadcast_init: bool = True  # start from rank 0's model; False: from the task's seeded one, which every rank builds alike


def slot_of(cfg: Config, rank: int) -> int:
    """The trace peer that `rank` stands for: its pacing and data shard follow the peer, not the rank number."""
    return rank if cfg.slots is None else cfg.slots[rank]


def batch_sizes(base: int, slowdowns: Sequence[float], mode: str) -> list[int]:
    """Return each rank's per-step batch for `mode`; raises `ValueError` for an unknown mode.

    equal and the diloco modes: `base` everywhere. proportional and adaptive (its first
    split): round-half-up of base * n * speed_r / sum(speeds), at least 1, with
    speed_r = 1 / slowdown_r, so the whole step holds about n * base samples split by speed.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode not in ("proportional", "adaptive"):
        return [base] * len(slowdowns)
    return proportional_split(base * len(slowdowns), [1.0 / s for s in slowdowns])
