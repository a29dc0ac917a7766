"""PyTorch Lightning: `lightning.Trainer(..., callbacks=[MurmurCallback(bootstrap=[...])])` joins a swarm.

Needs the `[lightning]` extra (`pip install 'murmur-gossip[lightning]'`); Murmur's core does not import
this module. The callback opens a `murmur.Peer` on the `LightningModule` and its optimizer when
training starts, counts each optimizer step's samples (the batches since the last step, so
batch size × accumulated batches, × ranks), steps the peer after each optimizer step, and
closes the peer (checkpoint, goodbye) when training ends or fails.

With several processes (`strategy="ddp"`), the data-parallel group is one swarm peer, as with
`murmur.hf`: only world rank 0 opens a `Peer` and counts the group's samples once; whenever the
swarm changed rank 0's model, rank 0 broadcasts the model and the optimizer's state
(`murmur._ranks`), so every rank steps the same model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from murmur._ranks import Follower, distributed
from murmur.peer import Peer, check_options


class StepWork:
    """The work of each optimizer step: the batches' work since the previous step, times the ranks.

    Lightning counts optimizer steps in `trainer.global_step`; a batch after which it moved
    ended a step (the last of `accumulate_grad_batches` batches, or an epoch's short last one).
    """

    def __init__(self, global_step: int, ranks: int) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be at least 1, got {ranks}")
        self.stepped = global_step
        self.ranks = ranks
        self.pending = 0

    def batch_end(self, work: int, global_step: int) -> int | None:
        """Count a finished batch of `work` (this rank's); the step's work once `global_step` moved, else None.

        Raises `ValueError` for negative work.
        """
        if work < 0:
            raise ValueError(f"a batch's work must be non-negative, got {work}")
        self.pending += work
        if global_step == self.stepped:
            return None  # accumulating: no optimizer step yet
        step, self.pending, self.stepped = self.pending * self.ranks, 0, global_step
        return step


def _batch_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> float | None:
    """The loss of the batch that ended a step, for status.json (None if `training_step` returned none)."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not torch.is_tensor(loss) or loss.numel() != 1:
        return None
    # Automatic optimization hands back the loss divided by the accumulated batches.
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    return float(loss.detach()) * scale


class MurmurCallback(pl.Callback):
    """A Lightning `Callback` that trains the `Trainer`'s module with a Murmur swarm.

    Takes `murmur.Peer`'s keyword options (`murmur run`'s, same names and defaults), checked
    here so a typo fails before training starts, and `batch_work`: a batch's work, for
    counting tokens (`lambda batch: batch["input_ids"].numel()`) or a batch whose size
    Lightning cannot find; by default its size (the first dimension of its tensors). `peer` is
    the open peer while training runs, on world rank 0 only (None on the other ranks, which
    follow rank 0's model). Raises `ValueError` at the start of training for a module with
    other than one optimizer.
    """

    def __init__(self, *, batch_work: Callable[[Any], int] | None = None, **options: Any) -> None:
        check_options(options)  # a bad option fails now, not when training starts
        self.options = options
        self.batch_work = batch_work if batch_work is not None else extract_batch_size
        self.peer: Peer | None = None
        self._follower = Follower()
        self._steps: StepWork | None = None

    @property
    def work(self) -> float:
        """The swarm's progress for an LR schedule (`Peer.work`): rank 0's, on every rank; 0.0 before training."""
        if self.peer is not None:
            return self.peer.work
        return self._follower.work

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(
                f"MurmurCallback trains a module with one optimizer; this one has {len(trainer.optimizers)}"
            )
        optimizer = trainer.optimizers[0]
        if trainer.is_global_zero:
            self.peer = Peer(pl_module, optimizer, **self.options)
        if distributed():
            # Rank 0 may have resumed or pulled the swarm's model (and optimizer state): everyone starts from it.
            self._follower.start(self.peer, pl_module, optimizer)
        self._steps = StepWork(trainer.global_step, trainer.world_size)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._steps is not None, "set in on_train_start"
        work = self._steps.batch_end(int(self.batch_work(batch)), trainer.global_step)
        if work is None:
            return
        if self.peer is not None:
            # The whole data-parallel group's step, counted once.
            self.peer.step(samples=work, loss=_batch_loss(trainer, pl_module, outputs))
        if distributed():
            self._follower.follow(self.peer, pl_module, trainer.optimizers[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.peer is not None:
            self.peer.close()  # its parting merge may change the model once more: the others follow it too
        if distributed():
            self._follower.follow(self.peer, pl_module, trainer.optimizers[0])

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Training failed or was interrupted: leave the swarm cleanly (no collective: other ranks may be gone).
        if self.peer is not None:
            self.peer.close()
