"""Hugging Face `transformers`: `Trainer(..., callbacks=[MurmurCallback(bootstrap=[...])])` joins a swarm.

Needs the `[hf]` extra (`pip install -e '.[hf]'` in a checkout; the distribution is `murmur-gossip`); Murmur's core does not import this module.
The callback opens a `murmur.Peer` on the trainer's model and optimizer when training
begins, counts each optimizer step's samples (batch size × accumulation steps × ranks), and
closes the peer (checkpoint, goodbye) when training ends.

With several processes (`torchrun`, `accelerate launch`), the data-parallel group is one swarm
peer: only its first process (world rank 0) opens a `Peer`, in its `data_dir`, and counts the
whole group's samples once. The others follow: whenever the swarm changed rank 0's model (a
merge, a state sync, a resume), rank 0 broadcasts the model and the optimizer's state, so every
rank steps the same model, as data parallelism requires.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from murmur._ranks import Follower, distributed
from murmur.peer import Peer, check_options


def _torch_optimizer(kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """The callback's torch optimizer (accelerate wraps it)."""
    optimizer = kwargs["optimizer"]
    return getattr(optimizer, "optimizer", optimizer)


class MurmurCallback(TrainerCallback):
    """A `TrainerCallback` that trains the `Trainer`'s model with a Murmur swarm.

    Takes `murmur.Peer`'s keyword options (`murmur run`'s, same names and defaults); they are
    checked here, so a typo (or `wandb=` without its package) fails before training starts. `peer` is the open peer while training
    runs, on world rank 0 only (None on the other ranks, which follow rank 0's model).
    """

    def __init__(self, **options: Any) -> None:
        check_options(options)  # a bad option fails now, not when training starts
        self.options = options
        self.peer: Peer | None = None
        self._follower = Follower()

    @property
    def work(self) -> float:
        """The swarm's progress for an LR schedule: rank 0's `peer.work` (0.0 before training), on every rank."""
        if self.peer is not None:
            return self.peer.work
        return self._follower.work

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        model, optimizer = kwargs["model"], _torch_optimizer(kwargs)
        if state.is_world_process_zero:
            self.peer = Peer(model, optimizer, **self.options)
        if distributed():
            # Rank 0 may have resumed or pulled the swarm's model (and optimizer state): everyone starts from it.
            self._follower.start(self.peer, model, optimizer)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            # One step of the whole data-parallel group, counted once: every rank's batch.
            self.peer.step(samples=args.train_batch_size * args.gradient_accumulation_steps * args.world_size)
        if distributed():
            self._follower.follow(self.peer, kwargs["model"], _torch_optimizer(kwargs))

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            self.peer.close()  # its parting merge may change the model once more: the others follow it too
        if distributed():
            self._follower.follow(self.peer, kwargs["model"], _torch_optimizer(kwargs))
