"""The simulator's machines and links: heavy-tailed, bounded, reproducible."""

from __future__ import annotations

import math
import random

import pytest

from lab.simulation.network import NetworkModel


def test_profiles_are_heavy_tailed_bounded_and_reproducible() -> None:
    model = NetworkModel()
    draws = [model.draw(random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1]
    slowdowns = [model.draw(rng).slowdown for rng in [random.Random(0)] for _ in range(5000)]
    assert min(slowdowns) >= 1.0 and max(slowdowns) == model.max_slowdown  # the cap is reached
    assert sorted(slowdowns)[len(slowdowns) // 2] == pytest.approx(2 ** (1 / model.pareto_alpha), rel=0.1)


def test_a_step_takes_step_ms_times_the_slowdown() -> None:
    model = NetworkModel(step_ms=20.0)
    profile = model.draw(random.Random(3))
    assert model.step_s(profile) == pytest.approx(0.020 * profile.slowdown)


def test_link_latency_grows_with_distance_and_bandwidth_is_the_slower_end() -> None:
    model = NetworkModel(latency_ms=5.0, latency_span_ms=50.0)
    a, b = model.draw(random.Random(1)), model.draw(random.Random(2))
    latency, bandwidth = model.link(a, b)
    assert latency == pytest.approx((5.0 + 50.0 * math.dist(a.position, b.position) / math.sqrt(2)) / 1000)
    assert bandwidth == min(a.bandwidth, b.bandwidth)
    assert model.link(a, a)[0] == pytest.approx(0.005)
