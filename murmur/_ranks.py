"""Several data-parallel ranks as one swarm peer: world rank 0 holds the `murmur.Peer`, the others follow.

Shared by the trainer callbacks (`murmur.hf`, `murmur.lightning`). Every function here that
talks to the other ranks is a collective: every rank calls it, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from murmur.peer import Peer


def distributed() -> bool:
    """Whether this process is one of several ranks of an initialized process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
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


class Follower:
    """Keeps a rank's model, optimizer state and view of the swarm's `work` equal to world rank 0's.

    Rank 0 passes its `Peer`, the other ranks None. `work` is rank 0's `peer.work` as of the
    last `start` or `follow`, on every rank (0.0 before), so an LR schedule that follows the
    swarm gives every rank the same learning rate.
    """

    def __init__(self) -> None:
        self.version = -1  # rank 0's `model_version` this rank holds
        self.work = 0.0

    def start(self, peer: Peer | None, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """At training's start: every rank takes rank 0's model and optimizer state (a resume or a
        state sync may have changed them before the first step). Collective."""
        payload = [optimizer.state_dict() if peer is not None else None]
        dist.broadcast_object_list(payload, src=0)
        if peer is None:
            optimizer.load_state_dict(payload[0])  # creates the state tensors `follow` fills
        self.follow(peer, model, optimizer, force=True)

    def follow(
        self, peer: Peer | None, model: nn.Module, optimizer: torch.optim.Optimizer, force: bool = False
    ) -> None:
        """Copy rank 0's model and optimizer state to this rank if the swarm changed it since the
        last call (or `force`), and rank 0's work. Collective: every rank calls it after each optimizer step."""
        device = _device()
        version = peer.model_version if peer is not None else 0
        work = peer.work if peer is not None else 0.0
        news = torch.tensor(
            [1.0 if force or version != self.version else 0.0, work], dtype=torch.float64, device=device
        )
        dist.broadcast(news, src=0)
        self.work = float(news[1].item())
        if not news[0].item():
            return
        for tensor in [*model.state_dict().values(), *_optimizer_tensors(optimizer)]:
            _broadcast(tensor, device)
        self.version = version
