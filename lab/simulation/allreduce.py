"""The ideal all-reduce baseline: synchronous data parallelism on the gossip runs' machines."""

from __future__ import annotations

import random
import time

import torch

from lab.replicas import Sync
from lab.simulation.config import SimConfig, SimResult, accuracy_task


def simulate_allreduce(config: SimConfig) -> SimResult:
    """Ideal synchronous data parallelism on the same machines as `GossipSimulation`.

    Each step every peer computes a gradient on its own 32-sample batch, the gradients
    are averaged (`lab.replicas.Sync`: one step on the concatenated batch), and the
    step takes the slowest peer's compute time; communication is free and nobody
    churns. Deterministic: no event loop, and every draw is seeded by `config.seed`.
    """
    result = SimResult(config)
    start = time.perf_counter()
    torch.set_num_threads(1)
    task = accuracy_task(config.task)
    profiles_rng = random.Random(config.seed)
    step_s = max(config.network.step_s(config.network.draw(profiles_rng)) for _ in range(config.peers))
    sync = Sync(task, shards=range(config.peers))
    now, grid, metric = 0.0, 0, sync.score()
    while grid * config.eval_every <= config.max_time + 1e-9:
        t = grid * config.eval_every
        while now + step_s <= t:  # steps that finish before this grid point
            result.samples += sync.step()
            result.steps += 1
            now += step_s
            metric = sync.score()
        if result.record(t, [metric], 0.0, config.peers):  # one model: no spread, no consensus distance
            break
        if time.perf_counter() - start > config.max_wall_s:
            result.truncated = True
            break
        grid += 1
    result.wall_s = time.perf_counter() - start
    return result
