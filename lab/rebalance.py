"""Splitting a synchronous step (or a DiLoCo round) by speed, and re-measuring the speeds as the ranks train.

Modes `adaptive` and `diloco-proportional` of `lab.sync_rank` start from the speeds they are told
(1 / slowdown, or a trace's initial ones) and then trust only what they measure: each rank times its
own compute (the emulated device's padding included, the all-reduce excluded) per sample, writes the
figure into its own control slot of the all-reduce buffer (every other rank writes 0 there, so the sum
hands every rank every figure), and at each rebalance every rank computes the same split from the same
numbers:

- `adaptive` (every `rebalance_every` steps): batch_r = `proportional_split(n * B, speeds)`;
- `diloco-proportional` (every round): inner steps H_r = `steps_split(local_steps, speeds)`, so that
  the ranks reach the all-reduce together.

`ResizedBatches` lets a rank's data stream change its batch size without skipping or repeating a row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from murmur.node.learn.tasks import Batch


def proportional_split(total: int, speeds: Sequence[float]) -> list[int]:
    """Split `total` units by speed: round-half-up of total * speed_r / sum(speeds), at least 1 each.

    The parts sum to about `total` (rounding and the floor of 1 may move it by a few). Raises
    `ValueError` unless every speed is positive and finite.
    """
    _check(speeds)
    s = sum(speeds)
    return [max(1, math.floor(total * v / s + 0.5)) for v in speeds]


def steps_split(local_steps: int, speeds: Sequence[float]) -> list[int]:
    """Each rank's inner steps for one DiLoCo round: the fastest does `local_steps`, rank r
    max(1, round-half-up(local_steps * speed_r / max(speeds))). Raises `ValueError` as `proportional_split`."""
    _check(speeds)
    top = max(speeds)
    return [max(1, math.floor(local_steps * v / top + 0.5)) for v in speeds]


def _check(speeds: Sequence[float]) -> None:
    if not speeds or not all(math.isfinite(v) and v > 0 for v in speeds):
        raise ValueError(f"speeds must be positive and finite, not {list(speeds)!r}")


class Balance:
    """One rank's speed meter: what it measured since the last rebalance, and everyone's speeds as last agreed.

    Speeds are in samples per second of compute. A rank that measured nothing in a window (or a
    figure that is not a positive finite number) keeps its previous speed, so the split never divides by 0.
    """

    def __init__(self, speeds: Sequence[float]) -> None:
        _check(speeds)
        self.speeds = [float(v) for v in speeds]
        self.count = 0  # rebalances so far
        self._seconds = 0.0
        self._samples = 0

    def add(self, seconds: float, samples: int) -> None:
        """Count one step: `seconds` of compute for `samples` samples."""
        self._seconds += seconds
        self._samples += samples

    def write(self, slots: torch.Tensor, rank: int) -> None:
        """Put this rank's seconds per sample (0 if it measured nothing) into `slots[rank]`; leave the rest alone."""
        slots[rank] = self._seconds / self._samples if self._samples else 0.0

    def update(self, slots: torch.Tensor) -> list[float]:
        """Take every rank's seconds per sample from the all-reduced `slots`; start a new window; return the speeds."""
        for i, per_sample in enumerate(slots[: len(self.speeds)].tolist()):
            if math.isfinite(per_sample) and per_sample > 0:
                self.speeds[i] = 1.0 / per_sample
        self._seconds, self._samples = 0.0, 0
        self.count += 1
        return list(self.speeds)


class ResizedBatches:
    """Batches of exactly `size` rows, taking rows from `stream` in order; `size` may be changed between batches.

    Rows left over from one batch start the next, so no sample is skipped or repeated beyond what
    the stream itself does, whatever the sizes.
    """

    def __init__(self, stream: Iterator[Batch], size: int) -> None:
        self.stream = stream
        self.size = size
        self._xs: list[torch.Tensor] = []
        self._ys: list[torch.Tensor] = []
        self._have = 0

    def __iter__(self) -> ResizedBatches:
        return self

    def __next__(self) -> Batch:
        size = self.size
        while self._have < size:
            x, y = next(self.stream)
            self._xs.append(x)
            self._ys.append(y)
            self._have += len(y)
        x, y = (self._xs[0], self._ys[0]) if len(self._xs) == 1 else (torch.cat(self._xs), torch.cat(self._ys))
        self._xs, self._ys, self._have = [x[size:]], [y[size:]], self._have - size
        return x[:size], y[:size]
