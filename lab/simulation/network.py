"""How simulated machines differ: compute speed, position (for latency) and uplink bandwidth."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """One simulated machine: compute slowdown, a position (for latency) and uplink bytes/s."""

    slowdown: float
    position: tuple[float, float]
    bandwidth: float


@dataclass(frozen=True)
class NetworkModel:
    """How simulated peers differ and how their links behave.

    A step of 32 samples takes `step_ms × slowdown` ms, slowdown ~ Pareto(`pareto_alpha`)
    ≥ 1, capped at `max_slowdown`. One-way latency between two peers is `latency_ms` +
    `latency_span_ms` × their distance in the unit square / √2. Uplinks are lognormal with
    median `bandwidth_mbps` Mbit/s and shape `bandwidth_sigma`; a link runs at the slower
    of its two ends. `churn`: the fraction of the swarm replaced per simulated second.
    """

    step_ms: float = 20.0
    pareto_alpha: float = 1.5
    max_slowdown: float = 30.0
    latency_ms: float = 5.0
    latency_span_ms: float = 50.0
    bandwidth_mbps: float = 50.0
    bandwidth_sigma: float = 1.0
    churn: float = 0.01

    def draw(self, rng: random.Random) -> Profile:
        """A new machine; the same `rng` state always draws the same one."""
        slowdown = min(self.max_slowdown, rng.paretovariate(self.pareto_alpha))
        bandwidth = self.bandwidth_mbps * 1e6 / 8 * math.exp(rng.gauss(0.0, self.bandwidth_sigma))
        return Profile(slowdown, (rng.random(), rng.random()), bandwidth)

    def step_s(self, profile: Profile) -> float:
        """Simulated seconds one 32-sample step takes on `profile`."""
        return self.step_ms / 1000 * profile.slowdown

    def link(self, a: Profile, b: Profile) -> tuple[float, float]:
        """(one-way latency in s, bytes/s) between two peers."""
        distance = math.dist(a.position, b.position) / math.sqrt(2)
        return (self.latency_ms + self.latency_span_ms * distance) / 1000, min(a.bandwidth, b.bandwidth)
