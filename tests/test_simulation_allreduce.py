"""The ideal all-reduce baseline: one model, stepped at the slowest peer's pace on every peer's batch."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest

from lab.simulation.allreduce import simulate_allreduce
from lab.simulation.config import SimConfig
from lab.simulation.network import NetworkModel


def _config(**changes: Any) -> SimConfig:
    return replace(SimConfig(peers=4, topology="allreduce", max_time=3.0, linger=0.0, eval_every=0.5), **changes)


def test_one_model_steps_at_the_slowest_peers_pace_on_every_peers_batch() -> None:
    config = _config()
    result = simulate_allreduce(config)
    model = NetworkModel()
    profiles = random.Random(config.seed)
    slowest = max(model.step_s(model.draw(profiles)) for _ in range(config.peers))
    assert result.steps == math.floor(result.times[-1] / slowest + 1e-9)
    assert result.samples == config.peers * 32 * result.steps
    assert result.consensus == [0.0] * len(result.times) and result.exchanges == {}
    assert result.accuracy_median[-1] > result.accuracy_median[0]


def test_it_stops_after_the_target_and_repeats_exactly() -> None:
    config = _config(max_time=60.0, target=0.5, linger=1.0)
    first, second = simulate_allreduce(config), simulate_allreduce(config)
    assert first.time_to_target is not None and first.times[-1] == pytest.approx(first.time_to_target + 1.0)
    assert (first.times, first.accuracy_median, first.steps) == (second.times, second.accuracy_median, second.steps)
