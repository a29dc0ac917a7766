"""Hugging Face `Trainer` with a Murmur swarm: one callback.

A small GPT-2 built from a config (no download; its output layer is tied to the token
embedding) learns Python source bytes from the standard library with `Trainer`, while
`MurmurCallback` gossips its weights with the other peers of the run. Its learning rate follows
the swarm's progress (`murmur_cb.work`): cosine with warmup, so a peer that joins late picks up
the schedule where the swarm is.

    HF_HUB_OFFLINE=1 python examples/hf_trainer.py --data-dir /tmp/a --addr-file /tmp/a/addrs
    HF_HUB_OFFLINE=1 python examples/hf_trainer.py --data-dir /tmp/b --bootstrap "$(head -1 /tmp/a/addrs)"

Needs the `hf` extra (`pip install -e '.[hf]'`). Runs offline on a CPU in well under a minute (`--steps`).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the model comes from a config

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from murmur.hf import MurmurCallback  # noqa: E402
from murmur.schedule import cosine_with_warmup  # noqa: E402

CONTEXT = 32


class SourceBytes(torch.utils.data.Dataset):
    """Windows of the standard library's source as byte tokens: `input_ids` and `labels` (shifted inside GPT-2)."""

    def __init__(self, limit: int = 300_000) -> None:
        data = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:60])[:limit]
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self.data) - 1) // CONTEXT

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[i * CONTEXT : (i + 1) * CONTEXT]
        return {"input_ids": window, "labels": window}


class StopOnSigterm(TrainerCallback):
    """A SIGTERM (`kill`, `docker stop`) ends training after the current step; the peer then leaves cleanly."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "requested", True))

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201 (TrainerCallback's signature)
        if self.requested:
            control.should_training_stop = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="~/.murmur-hf-example")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--addr-file")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--schedule-samples", type=float, default=5_000, help="the schedule's length, in `work` (samples)")
    parser.add_argument("--seed", type=int, default=0, help="this peer's data order")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer starts from the same model
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    murmur_cb = MurmurCallback(run_id="hf-example", listen=[args.listen], bootstrap=args.bootstrap,
                               data_dir=args.data_dir, addr_file=args.addr_file)
    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(), max_steps=args.steps, per_device_train_batch_size=16, max_grad_norm=1.0,
        logging_steps=50, save_strategy="no", report_to=[], use_cpu=True, seed=args.seed, data_seed=args.seed,
        disable_tqdm=True,
    )
    # Cosine with warmup over the swarm's progress (the same on every rank), not the Trainer's step count.
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: cosine_with_warmup(
        murmur_cb.work, warmup=0.05 * args.schedule_samples, total=args.schedule_samples, floor=0.1))
    start = time.monotonic()
    result = Trainer(model=model, args=training, train_dataset=SourceBytes(), optimizers=(optimizer, scheduler),
                     callbacks=[murmur_cb, StopOnSigterm()]).train()
    peer = murmur_cb.peer
    assert peer is not None
    status = peer.status()
    print(f"done: {result.global_step} steps in {time.monotonic() - start:.1f} s, mean train loss {result.training_loss:.3f}, "
          f"work {peer.work:.0f}, {status['samples']} own samples, {peer.swarm_samples:.0f} swarm samples, "
          f"merged {status['exchanges'].get('merged', 0)} times", flush=True)


if __name__ == "__main__":
    main()
