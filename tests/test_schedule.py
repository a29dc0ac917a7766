"""`murmur.schedule` and `Peer.work`: a learning-rate schedule that follows the swarm, so a newcomer
resumes it where the swarm is instead of restarting it. Real libp2p peers over loopback."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from on_thread import looping

import murmur
from murmur.node.learn.tasks import DigitsTask
from murmur.schedule import cosine_with_warmup

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_the_factor_warms_up_then_follows_a_cosine_down_to_its_floor() -> None:
    assert cosine_with_warmup(0, warmup=100, total=1100) == 0.0
    assert cosine_with_warmup(50, warmup=100, total=1100) == 0.5
    assert cosine_with_warmup(100, warmup=100, total=1100) == 1.0
    assert cosine_with_warmup(600, warmup=100, total=1100, floor=0.1) == pytest.approx(0.55)  # half way down
    assert cosine_with_warmup(1100, warmup=100, total=1100, floor=0.1) == pytest.approx(0.1)
    assert cosine_with_warmup(5000, warmup=100, total=1100, floor=0.1) == pytest.approx(0.1)  # past the end: the floor
    assert cosine_with_warmup(0, warmup=0, total=10) == 1.0  # no warmup: starts at the peak
    factors = [cosine_with_warmup(p, warmup=100, total=1100) for p in range(100, 1200, 10)]
    assert all(a >= b for a, b in itertools.pairwise(factors))


@pytest.mark.parametrize(
    ("progress", "options", "message"),
    [
        (-1.0, {}, "progress"), (math.nan, {}, "progress"), (math.inf, {}, "progress"),
        (1.0, {"total": 0}, "total"), (1.0, {"total": math.inf}, "total"),
        (1.0, {"warmup": 10}, "warmup"), (1.0, {"warmup": -1}, "warmup"),
        (1.0, {"floor": 1.5}, "floor"), (1.0, {"floor": -0.1}, "floor"),
    ],
)  # fmt: skip
def test_a_bad_argument_is_a_value_error(progress: float, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cosine_with_warmup(progress, **{"warmup": 1, "total": 10, **options})


@contextmanager
def serving(peer: murmur.Peer) -> Iterator[None]:
    """`peer`'s loop stays alive without training (steps of no work) for the block, so the node can hand
    its model to a newcomer (a state sync runs between two of the owner's steps) while its work stays put."""

    def idle(_: int) -> None:
        peer.step(samples=0)
        time.sleep(0.002)

    with looping(idle, 60_000, join_s=30):
        yield


def test_a_newcomer_resumes_the_swarms_schedule_instead_of_restarting_it(tmp_path: Path) -> None:
    task = DigitsTask()
    warmup, total, base_lr = 500.0, 10_000.0, 0.1
    model_a = task.build_model()
    optimizer_a = task.make_optimizer(model_a)
    with murmur.Peer(model_a, optimizer_a, run_id="sched", listen=LOOPBACK, data_dir=tmp_path / "a") as peer_a:
        batches = task.train_batches(0)
        for _ in range(40):
            x, y = next(batches)
            optimizer_a.zero_grad()
            task.loss(model_a, (x, y)).backward()
            optimizer_a.step()
            peer_a.step(samples=len(x))
        assert peer_a.work == peer_a.samples == 40 * task.batch_size

        with serving(peer_a):
            model_b = task.build_model()
            optimizer_b = torch.optim.SGD(model_b.parameters(), lr=base_lr)
            with murmur.Peer(
                model_b, optimizer_b, run_id="sched", listen=LOOPBACK, data_dir=tmp_path / "b", bootstrap=peer_a.addrs
            ) as peer_b:
                # The newcomer's schedule, built the usual way once the peer is open (as at a fresh start).
                scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer_b, lambda _: cosine_with_warmup(peer_b.work, warmup=warmup, total=total)
                )
                assert peer_b.node.sync_outcome is not None and peer_b.node.sync_outcome.result == "synced"
                assert peer_b.samples == 0  # it trained nothing itself...
                assert peer_b.work == peer_a.work  # ...yet holds the swarm's progress, which its schedule follows
                lr = scheduler.get_last_lr()[0]
                assert lr == pytest.approx(base_lr * cosine_with_warmup(peer_a.work, warmup=warmup, total=total))
                assert lr > base_lr * cosine_with_warmup(0, warmup=warmup, total=total)  # not the warmup's first step
                for name, tensor in model_b.state_dict().items():  # it adopted A's model with it
                    torch.testing.assert_close(tensor, model_a.state_dict()[name], rtol=0, atol=0)
