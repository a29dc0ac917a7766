"""A simulation's config is validated, and its result records curves and stops after the target plus linger."""

from __future__ import annotations

import pytest
import torch

from lab.simulation.config import SimConfig, SimResult, accuracy_task, quantile


def test_unknown_topologies_and_tiny_swarms_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown topology 'star'"):
        SimConfig(topology="star")
    with pytest.raises(ValueError, match="at least 2 peers"):
        SimConfig(peers=1)


def test_quantile_interpolates_like_numpy() -> None:
    values = [0.3, 0.9, 0.1, 0.5, 0.7, 0.2]
    for q in (0.0, 0.1, 0.5, 0.9, 1.0):
        assert quantile(values, q) == pytest.approx(float(torch.quantile(torch.tensor(values), q)))


def test_the_result_records_times_to_target_and_stops_after_lingering() -> None:
    result = SimResult(SimConfig(peers=4, target=0.9, linger=0.5, eval_sample=4))
    assert not result.record(0.0, [0.1, 0.2, 0.3, 0.4], 1.0, 4)
    assert not result.record(0.25, [0.5, 0.9, 0.95, 0.99], 0.5, 4)  # the median is there, the slowest 10 % are not
    assert result.time_to_target == 0.25 and result.time_to_target_p10 is None
    assert not result.record(0.5, [0.9, 0.91, 0.95, 0.99], 0.2, 4)
    assert result.time_to_target_p10 == 0.5
    assert not result.record(0.75, [0.9] * 4, 0.1, 4)
    assert result.record(1.0, [0.9] * 4, 0.1, 4)  # 0.5 s of linger after the p10 target
    assert result.times == [0.0, 0.25, 0.5, 0.75, 1.0] and result.live == [4] * 5
    assert result.accuracy_median[0] == pytest.approx(0.25) and result.accuracy_mean[0] == pytest.approx(0.25)
    assert result.to_json()["config"]["target"] == 0.9 and result.evaluated == 4


def test_only_tasks_that_report_accuracy_can_be_simulated() -> None:
    assert accuracy_task("digits").metric.name == "accuracy"
    with pytest.raises(ValueError, match="measures accuracy; task 'charlm' reports 'loss'"):
        accuracy_task("charlm")
