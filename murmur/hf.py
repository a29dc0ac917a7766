"""Hugging Face `transformers`: `Trainer(..., callbacks=[MurmurCallback(bootstrap=[...])])` joins a swarm.

Needs the `[hf]` extra (`pip install murmur[hf]`); Murmur's core does not import this module.
The callback opens a `murmur.Peer` on the trainer's model and optimizer when training
begins, counts each optimizer step's samples (batch size × accumulation steps), and
closes the peer (checkpoint, goodbye) when training ends.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from murmur.peer import Peer, run_config


class MurmurCallback(TrainerCallback):
    """A `TrainerCallback` that trains the `Trainer`'s model with a Murmur swarm.

    Takes `murmur.Peer`'s keyword options (`murmur run`'s, same names and defaults); they are
    checked here, so a typo fails before training starts. `peer` is the open peer while training runs.
    """

    def __init__(self, **options: Any) -> None:
        run_config(options)  # raises TypeError/ValueError now rather than at `on_train_begin`
        self.options = options
        self.peer: Peer | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        optimizer = kwargs["optimizer"]
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        self.peer = Peer(kwargs["model"], optimizer, **self.options)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            self.peer.step(samples=args.train_batch_size * args.gradient_accumulation_steps * args.world_size)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            self.peer.close()
