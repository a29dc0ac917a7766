"""PyTorch Lightning with a Murmur swarm: one callback.

A small character model (output layer tied to the embedding) learns Python source bytes from
the standard library with `lightning.Trainer`, while `MurmurCallback` gossips its weights with the
other peers of the run. Its learning rate follows the swarm's progress (`callback.work`): cosine
with warmup, so a peer that joins late picks up the schedule where the swarm is.

    python examples/lightning_trainer.py --data-dir /tmp/a --addr-file /tmp/a/addrs
    python examples/lightning_trainer.py --data-dir /tmp/b --bootstrap "$(head -1 /tmp/a/addrs)"

Needs `pip install 'murmur-gossip[lightning]'`. Runs offline on a CPU in well under a minute (`--steps`);
a SIGTERM ends training early, and the peer leaves cleanly.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from murmur.lightning import MurmurCallback
from murmur.schedule import cosine_with_warmup

CONTEXT, DIM, VOCAB = 8, 64, 256


class SourceBytes(torch.utils.data.Dataset):
    """The next byte after `CONTEXT` bytes of the standard library's source: offline, the same on every machine."""

    def __init__(self, limit: int = 300_000) -> None:
        data = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:60])[:limit]
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return len(self.data) - CONTEXT

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i : i + CONTEXT], self.data[i + CONTEXT]


class CharModel(pl.LightningModule):
    def __init__(self, murmur_cb: MurmurCallback, schedule_samples: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Sequential(nn.Linear(CONTEXT * DIM, 256), nn.GELU(), nn.Linear(256, DIM))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: Murmur sends and merges it once
        self.murmur_cb, self.schedule_samples = murmur_cb, schedule_samples

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head(self.mix(self.emb(x).flatten(1))), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        # Cosine with warmup over the swarm's progress, not this process's step count.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda _: cosine_with_warmup(
                self.murmur_cb.work, warmup=0.05 * self.schedule_samples, total=self.schedule_samples, floor=0.1
            ),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="~/.murmur-lightning-example")
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--addr-file")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--schedule-samples", type=float, default=30_000, help="the schedule's length, in `work`")
    parser.add_argument("--seed", type=int, default=0, help="this peer's data order")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every peer starts from the same model
    murmur_cb = MurmurCallback(run_id="lightning-example", listen=[args.listen], bootstrap=args.bootstrap,
                               data_dir=args.data_dir, addr_file=args.addr_file)  # fmt: skip
    model = CharModel(murmur_cb, args.schedule_samples)
    pl.seed_everything(args.seed, verbose=False)  # this peer's data order
    loader = torch.utils.data.DataLoader(SourceBytes(), batch_size=32, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, accumulate_grad_batches=2,
                         gradient_clip_val=1.0, callbacks=[murmur_cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    start = time.monotonic()
    try:
        trainer.fit(model, loader)
    except SIGTERMException:  # `kill`, `docker stop`: the callback already closed the peer
        pass
    peer = murmur_cb.peer
    assert peer is not None
    status = peer.status()
    print(f"done: {trainer.global_step} steps in {time.monotonic() - start:.1f} s, loss {status['loss']:.3f}, "
          f"work {peer.work:.0f}, {status['samples']} own samples, {peer.swarm_samples:.0f} swarm samples, "
          f"merged {status['exchanges'].get('merged', 0)} times", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
