"""`murmur.lightning.MurmurCallback`: Lightning `Trainer`s that train with a swarm.

Each swarm peer is its own OS process (tests/lightning_peer.py) over loopback; one of them is
a two-rank DDP group. The step counting is tested on its own and with one real `Trainer`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import murmur  # noqa: E402
from murmur.lightning import MurmurCallback, StepWork  # noqa: E402
from murmur.node.net.identity import load_or_create_identity, peer_id_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_peer import ACCUMULATE, BATCH, Regression, data, trainer  # noqa: E402
from test_tracking import tensorboard_scalars  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def test_a_step_counts_the_batches_since_the_last_one_times_the_ranks() -> None:
    steps = StepWork(global_step=0, ranks=2)
    assert steps.batch_end(8, global_step=0) is None  # accumulating
    assert steps.batch_end(8, global_step=1) == 32  # 2 batches of 8 on each of 2 ranks
    assert steps.batch_end(3, global_step=2) == 6  # an epoch's short last batch ends a step of its own
    resumed = StepWork(global_step=500, ranks=1)  # a resumed Trainer starts at its checkpoint's step
    assert resumed.batch_end(8, global_step=500) is None and resumed.batch_end(8, global_step=501) == 16


def test_bad_counts_are_value_errors() -> None:
    with pytest.raises(ValueError, match="ranks"):
        StepWork(global_step=0, ranks=0)
    with pytest.raises(ValueError, match="non-negative"):
        StepWork(global_step=0, ranks=1).batch_end(-1, global_step=1)


def test_a_bad_option_fails_before_training() -> None:
    with pytest.raises(TypeError, match="did you mean 'bootstrap'"):
        MurmurCallback(bootstraps=["/ip4/127.0.0.1/tcp/1"])


def test_a_trainer_counts_every_sample_once_and_closes_its_peer(tmp_path: Path) -> None:
    callback = MurmurCallback(run_id="lightning", listen=LOOPBACK, data_dir=tmp_path, tensorboard=tmp_path / "tb")
    module = Regression(callback)
    # 100 samples in batches of 8: 12 full batches and a short one (4) per epoch; 2 epochs.
    loader = torch.utils.data.DataLoader(data(0, size=100), batch_size=BATCH)
    trainer(steps=-1, callbacks=[callback], epochs=2).fit(module, loader)
    assert callback.peer is not None
    status = callback.peer.status()
    assert status["samples"] == 200 and status["work"] == 200  # alone: its work is its own
    assert callback.peer.node.stats.steps == 2 * 7  # 6 steps of 2 batches and one of the short batch, per epoch
    with pytest.raises(murmur.PeerClosed):
        callback.peer.step(samples=1)  # closed when training ended
    assert tensorboard_scalars(tmp_path / "tb")["murmur/loss"][-1][0] == 200  # the last point is at its final samples


def test_a_failing_training_closes_its_peer(tmp_path: Path) -> None:
    class Failing(Regression):
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 3:
                raise RuntimeError("the user's step failed")
            return super().training_step(batch, batch_idx)

    callback = MurmurCallback(run_id="lightning", listen=LOOPBACK, data_dir=tmp_path)
    with pytest.raises(RuntimeError, match="the user's step failed"):
        trainer(steps=10, callbacks=[callback]).fit(
            Failing(callback), torch.utils.data.DataLoader(data(0), batch_size=8)
        )
    assert callback.peer is not None
    with pytest.raises(murmur.PeerClosed):
        callback.peer.step(samples=1)
    assert json.loads((tmp_path / "status.json").read_text())["samples"] == 8 * ACCUMULATE  # batches 0 and 1: one step


@pytest.mark.slow
def test_a_trainer_and_a_two_rank_ddp_trainer_train_together(tmp_path: Path) -> None:
    # The first peer's identity and port are fixed beforehand, so both start at once.
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen_a = f"/ip4/127.0.0.1/tcp/{s.getsockname()[1]}"
    addr_a = f"{listen_a}/p2p/{peer_id_of(load_or_create_identity(tmp_path / 'a'))}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(Path(__file__).with_name("lightning_peer.py"))

    def launch(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, script, str(tmp_path), *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip

    # The first trains until the second is done, then stops: the two always overlap, however slow the start.
    first = launch("a", "--steps", "100000", "--listen", listen_a, "--stop-file", str(tmp_path / "stop"))
    second = launch("b", "--steps", "60", "--devices", "2", "--bootstrap", addr_a)
    try:
        out_b, _ = second.communicate(timeout=300)
    finally:
        (tmp_path / "stop").touch()
        try:
            out_a, _ = first.communicate(timeout=120)
        finally:
            for proc in (first, second):
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    assert second.returncode == 0, out_b[-3000:]
    assert first.returncode == 0, out_a[-3000:]
    [a] = [json.loads((tmp_path / "a-rank0.json").read_text())]
    b = [json.loads((tmp_path / f"b-rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["peer"] for r in b] == [True, False]  # one swarm peer for the data-parallel group
    assert b[0]["status"]["samples"] == 60 * BATCH * ACCUMULATE * 2  # each step's batches on 2 ranks, counted once
    assert a["status"]["samples"] > 0 and a["status"]["samples"] % (BATCH * ACCUMULATE) == 0
    assert a["status"]["exchanges"].get("merged", 0) > 0 and b[0]["status"]["exchanges"].get("merged", 0) > 0
    assert b[0]["checksum"] == b[1]["checksum"]  # rank 1 followed the merges
    assert b[0]["work"] == b[1]["work"] > 0 and b[0]["lr"] == b[1]["lr"]  # and the swarm's schedule


def test_lightning_is_no_core_import() -> None:
    code = "import sys, murmur, murmur.peer, murmur.schedule; murmur.Peer; assert 'lightning' not in sys.modules, 'imported'"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
