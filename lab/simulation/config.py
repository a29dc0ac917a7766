"""One simulation run's configuration, and its result: curves on a simulated-time grid and totals."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lab.simulation.network import NetworkModel
from murmur.node.learn.tasks import Task, load_task
from murmur.node.learn.tasks.task import Metric

ACCURACY = Metric("accuracy", higher_is_better=True)  # the simulator's metric (see `accuracy_task`)

TOPOLOGIES = ("gossip", "partial", "ring", "allreduce", "alone")


@dataclass(frozen=True)
class SimConfig:
    """One simulation run. Times are simulated seconds; `task` must report `accuracy` (digits).

    The run stops `linger` seconds after 90 % of the evaluated peers (and so the
    median) have reached `target` accuracy, or at `max_time`, or after `max_wall_s` of
    real time (then the result says `truncated`). `eval_sample` peers are evaluated at
    each `eval_every` grid point (a dead one is replaced by a random live peer);
    consensus distance uses every live peer. Raises `ValueError` for an unknown
    topology or fewer than 2 peers.
    """

    peers: int = 100
    topology: str = "gossip"
    task: str = "digits"
    target: float = 0.95
    max_time: float = 30.0
    linger: float = 2.0
    eval_every: float = 0.25
    eval_sample: int = 32
    average_every: float = 0.1
    weighting: str = "work"
    exchange_timeout: float = 10.0
    view_size: int = 32
    shuffle_length: int = 8
    shuffle_every: float = 1.0
    network: NetworkModel = field(default_factory=NetworkModel)
    seed: int = 0
    max_wall_s: float = 900.0

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose from {list(TOPOLOGIES)}")
        if self.peers < 2:
            raise ValueError(f"need at least 2 peers, got {self.peers}")


@dataclass
class SimResult:
    """Curves on the evaluation grid and totals of one run (JSON-ready via `to_json`)."""

    config: SimConfig
    times: list[float] = field(default_factory=list)
    accuracy_median: list[float] = field(default_factory=list)  # over the evaluated sample
    accuracy_mean: list[float] = field(default_factory=list)
    accuracy_p10: list[float] = field(default_factory=list)  # the slowest-learning 10 % of the sample
    consensus: list[float] = field(default_factory=list)  # mean ||θ_i − θ̄||² over live peers
    live: list[int] = field(default_factory=list)
    time_to_target: float | None = None  # the median evaluated peer reaches the target
    time_to_target_p10: float | None = None  # 90 % of evaluated peers do
    wall_s: float = 0.0
    steps: int = 0
    samples: int = 0
    exchanges: dict[str, int] = field(default_factory=dict)  # outcomes, counted on both sides
    exchange_s: float | None = None  # median over peers of their averagers' typical merged-exchange time
    joins: int = 0
    leaves: int = 0
    view: dict[str, float] | None = None  # partial views at the end: sizes, dead entries, connectivity
    truncated: bool = False

    @property
    def evaluated(self) -> int:
        return min(self.config.eval_sample, self.config.peers)

    def record(self, t: float, accuracy: Sequence[float], consensus: float, live: int) -> bool:
        """Add one grid point; return True once the run may stop (targets reached, lingered)."""
        cfg = self.config
        self.times.append(t)
        self.accuracy_median.append(statistics.median(accuracy))
        self.accuracy_mean.append(statistics.fmean(accuracy))
        self.accuracy_p10.append(quantile(accuracy, 0.1))
        self.consensus.append(consensus)
        self.live.append(live)
        if self.time_to_target is None and ACCURACY.reached(self.accuracy_median[-1], cfg.target):
            self.time_to_target = t
        if self.time_to_target_p10 is None and ACCURACY.reached(self.accuracy_p10[-1], cfg.target):
            self.time_to_target_p10 = t
        return self.time_to_target_p10 is not None and t >= self.time_to_target_p10 + cfg.linger

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def accuracy_task(name: str) -> Task:
    """The task called `name`; raises `ValueError` unless it reports accuracy (the simulator's metric)."""
    task = load_task(name)
    if task.metric != ACCURACY:
        raise ValueError(f"the simulator measures accuracy; task {name!r} reports {task.metric.name!r}")
    return task
