"""Learning-rate schedules that follow the swarm's progress rather than this process's step count.

A peer that joins a run late adopts the swarm's model (state sync) and its work (`Peer.work`);
a schedule driven by that work resumes where the swarm is, where one driven by the process's
own step count would restart at step 0 (warming up a trained model again, at the peak rate).

    from murmur.schedule import cosine_with_warmup

    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda _: cosine_with_warmup(peer.work, warmup=20_000, total=1_000_000))
    # each step: optimizer.step(); scheduler.step(); peer.step(samples=...)

`LambdaLR` multiplies each parameter group's initial learning rate by the factor; its own step
count (the argument) is ignored.
"""

from __future__ import annotations

import math


def cosine_with_warmup(progress: float, *, warmup: float, total: float, floor: float = 0.0) -> float:
    """The learning-rate factor at `progress` (in the unit of `Peer.work`: samples or tokens).

    Rises linearly from 0 to 1 over the first `warmup`, then follows a half cosine from 1 down
    to `floor` at `total`, and stays at `floor` after. Raises `ValueError` for a progress that is
    negative or not finite, a `warmup` outside [0, `total`), a `total` that is not positive and
    finite, or a `floor` outside [0, 1].
    """
    if not math.isfinite(total) or total <= 0:
        raise ValueError(f"total must be positive and finite, got {total!r}")
    if not 0 <= warmup < total:
        raise ValueError(f"warmup must be in [0, total={total:g}), got {warmup!r}")
    if not 0 <= floor <= 1:
        raise ValueError(f"floor must be in [0, 1], got {floor!r}")
    if not math.isfinite(progress) or progress < 0:
        raise ValueError(f"progress must be a non-negative finite number, got {progress!r}")
    if progress < warmup:
        return progress / warmup
    done = min(1.0, (progress - warmup) / (total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
