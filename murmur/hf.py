"""Hugging Face `transformers`: `Trainer(..., callbacks=[MurmurCallback(bootstrap=[...])])` joins a swarm.

Needs the `[hf]` extra (`pip install murmur[hf]`); Murmur's core does not import this module.
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
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from murmur.node.ops.tracking import require_trackers
from murmur.peer import Peer, run_config


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device(model: nn.Module) -> torch.device:
    """Where this rank's collectives run: NCCL needs CUDA tensors, gloo takes CPU ones."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast(tensor: torch.Tensor, device: torch.device) -> None:
    """Rank 0's `tensor` into every rank's `tensor`, in place (through `device` if it lives elsewhere)."""
    if tensor.device == device:
        dist.broadcast(tensor, src=0)
        return
    carrier = tensor.detach().to(device)
    dist.broadcast(carrier, src=0)
    with torch.no_grad():
        tensor.copy_(carrier)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors in a fixed order (parameter by parameter, key by key)."""
    tensors = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            tensors += [state[key] for key in sorted(state) if torch.is_tensor(state[key])]
    return tensors


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
        # Raises TypeError/ValueError (and TrackingUnavailable for a tracker's missing package) now, not at `on_train_begin`.
        require_trackers(run_config({k: v for k, v in options.items() if k != "task"}))
        self.options = options
        self.peer: Peer | None = None
        self._followed = -1  # the `model_version` the other ranks hold

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        model, optimizer = kwargs["model"], _torch_optimizer(kwargs)
        if state.is_world_process_zero:
            self.peer = Peer(model, optimizer, **self.options)
        if _distributed():
            # Rank 0 may have resumed or pulled the swarm's model (and optimizer state): everyone starts from it.
            payload = [optimizer.state_dict() if self.peer is not None else None]
            dist.broadcast_object_list(payload, src=0)
            if self.peer is None:
                optimizer.load_state_dict(payload[0])
            self._follow(model, optimizer, force=True)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            # One step of the whole data-parallel group, counted once: every rank's batch.
            self.peer.step(samples=args.train_batch_size * args.gradient_accumulation_steps * args.world_size)
        if _distributed():
            self._follow(kwargs["model"], _torch_optimizer(kwargs))

    def _follow(self, model: nn.Module, optimizer: torch.optim.Optimizer, force: bool = False) -> None:
        """Copy rank 0's model and optimizer state to every rank if the swarm changed it (collective: every rank calls it)."""
        device = _device(model)
        version = self.peer.model_version if self.peer is not None else 0
        changed = torch.tensor([1 if force or version != self._followed else 0], device=device)
        dist.broadcast(changed, src=0)
        if not changed.item():
            return
        for tensor in [*model.state_dict().values(), *_optimizer_tensors(optimizer)]:
            _broadcast(tensor, device)
        self._followed = version

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.peer is not None:
            self.peer.close()  # its parting merge may change the model once more: the others follow it too
        if _distributed():
            self._follow(kwargs["model"], _torch_optimizer(kwargs))
