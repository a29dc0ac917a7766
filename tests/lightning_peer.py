"""One peer of a swarm of Lightning `Trainer`s with `MurmurCallback` (CPU), as its own OS process.

Run by tests/test_lightning.py:
`lightning_peer.py OUT NAME --steps N [--devices 2] [--listen ADDR] [--bootstrap ADDR] [--stop-file PATH]`.
With `--devices 2` Lightning launches a second rank (`strategy="ddp"`, gloo). Each rank writes
OUT/NAME-rank<r>.json: whether it opened a peer, that peer's final status, a checksum of its final
model and its final learning rate. `--stop-file`: training ends once that file exists.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from murmur.lightning import MurmurCallback
from murmur.schedule import cosine_with_warmup

BATCH, ACCUMULATE = 8, 2


class Regression(pl.LightningModule):
    """A small MLP fitting a fixed random linear map; its LR follows the swarm (`callback.work`)."""

    def __init__(self, callback: MurmurCallback) -> None:
        super().__init__()
        torch.manual_seed(0)  # every peer starts from the same model
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.callback = callback

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda _: cosine_with_warmup(self.callback.work, warmup=200, total=20_000, floor=0.1)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data(seed: int, size: int = 4096) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1)
    return torch.utils.data.TensorDataset(x, y)


class StopOnFile(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.path.exists():
            trainer.should_stop = True


def trainer(steps: int, callbacks: list[pl.Callback], devices: int = 1, epochs: int = -1) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=steps,
        max_epochs=epochs, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("name")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--stop-file", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    murmur_cb = MurmurCallback(run_id="lightning", listen=[args.listen], bootstrap=args.bootstrap,
                               data_dir=args.out / args.name)  # fmt: skip
    callbacks: list[pl.Callback] = [murmur_cb] + ([StopOnFile(args.stop_file)] if args.stop_file else [])
    module = Regression(murmur_cb)
    fit = trainer(args.steps, callbacks, devices=args.devices)
    seed = sum(map(ord, args.name))
    fit.fit(module, torch.utils.data.DataLoader(data(seed), batch_size=BATCH, shuffle=True))
    result = {
        "peer": murmur_cb.peer is not None,
        "status": murmur_cb.peer.status() if murmur_cb.peer is not None else None,
        "checksum": float(sum(p.detach().double().sum() for p in module.parameters())),
        "lr": fit.optimizers[0].param_groups[0]["lr"],
        "work": murmur_cb.work,
    }
    (args.out / f"{args.name}-rank{fit.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
