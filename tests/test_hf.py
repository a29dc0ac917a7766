"""`murmur.hf.MurmurCallback`: two Hugging Face `Trainer`s, each on its own thread with its own
peer over loopback, train a GPT-2 built from a config (no download) together."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from on_thread import looping  # noqa: E402

import murmur  # noqa: E402
from murmur.hf import MurmurCallback  # noqa: E402

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, seed: int) -> None:
        self.data = torch.randint(64, (4096, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def trainer(tmp_path: Path, name: str, callback: MurmurCallback, steps: int, seed: int) -> transformers.Trainer:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / f"out-{name}"), max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        gradient_accumulation_steps=2, save_strategy="no", report_to=[], use_cpu=True, seed=seed, disable_tqdm=True,
    )
    return transformers.Trainer(model=gpt2(), args=args, train_dataset=RandomTokens(seed), callbacks=[callback])


@contextmanager
def training_beside(peer: murmur.Peer, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """A plain training loop on another thread, stepping `peer`, for the duration of the block; its errors fail the test."""
    data = RandomTokens(1)

    def train_step(step: int) -> None:
        batch = {k: torch.stack([data[i][k] for i in range(step % 512 * 8, step % 512 * 8 + 8)]) for k in ("input_ids", "labels")}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        peer.step(samples=8)

    with looping(train_step, 20_000):
        yield


def test_a_bad_option_fails_before_training() -> None:
    with pytest.raises(TypeError, match="did you mean 'bootstrap'"):
        MurmurCallback(bootstraps=["/ip4/127.0.0.1/tcp/1"])


def test_a_tracker_without_its_package_fails_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(murmur.TrackingUnavailable, match=r"pip install 'murmur-gossip\[wandb\]'"):
        MurmurCallback(wandb="my-project")


def test_a_trainer_and_a_loop_on_another_thread_train_together(tmp_path: Path) -> None:
    # Two `Trainer`s cannot share one process (accelerate's state is global): the first peer is a
    # plain loop on a thread here; tests/test_examples.py runs two `Trainer` processes.
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with murmur.Peer(model, optimizer, run_id="hf", listen=LOOPBACK, data_dir=tmp_path / "loop") as loop_peer:
        with training_beside(loop_peer, model, optimizer):
            callback = MurmurCallback(run_id="hf", listen=LOOPBACK, bootstrap=loop_peer.addrs, data_dir=tmp_path / "hf",
                                      tensorboard=tmp_path / "tb")  # fmt: skip
            trainer(tmp_path, "hf", callback, steps=150, seed=2).train()
        status_loop = loop_peer.status()
    assert callback.peer is not None
    status_hf = callback.peer.status()
    assert status_hf["samples"] == 150 * 16  # batch x accumulation per optimizer step
    assert status_hf["exchanges"].get("merged", 0) > 0 and status_loop["exchanges"].get("merged", 0) > 0
    # The callback's options reach its peer: the swarm's side, tracked at the Trainer's samples.
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert events.Scalars("murmur/merges")[-1].step == 150 * 16
    assert events.Scalars("murmur/merges")[-1].value == status_hf["exchanges"]["merged"]
    # GPT-2's output layer is its token embedding: it travels and merges as one tensor.
    assert callback.peer.node.replica.exchanged.aliases == {"lm_head.weight": "transformer.wte.weight"}


@pytest.mark.slow
def test_two_ranks_under_torchrun_are_one_swarm_peer_that_counts_samples_once(tmp_path: Path) -> None:
    import json
    import socket
    import subprocess
    import sys

    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with (murmur.Peer(model, optimizer, run_id="hf", listen=LOOPBACK, data_dir=tmp_path / "loop") as loop_peer,
          training_beside(loop_peer, model, optimizer)):
        job = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
             "--master_port", str(port), str(Path(__file__).with_name("hf_ranks.py")), str(tmp_path), loop_peer.addrs[0], "60"],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400, check=False,
        )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["peer"] for r in ranks] == [True, False]  # one swarm peer for the data-parallel group
    status = ranks[0]["status"]
    assert status["samples"] == 60 * 8 * 2 * 2  # batch x accumulation x 2 ranks per step, counted once
    assert status["exchanges"].get("merged", 0) > 0
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # rank 1 followed the merges
    assert ranks[0]["work"] == ranks[1]["work"] > 0  # and knows rank 0's work, for the swarm's schedule
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("peer")) == ["peer"]
