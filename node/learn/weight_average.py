"""The weights a peer evaluates and saves for use: an exponential moving average of its parameters.

Between merges every replica wanders off the swarm's mean by its own minibatch noise, and
the mean scores better than the replicas (digits, 4 equal peers, 10,240 samples: the peers'
mean model 0.963 against 0.944-0.952 for the median peer). Averaging a peer's own last
~1/(1 − decay) steps removes most of that noise without a byte of traffic. Synchronous
training gains from it too, less: the benchmark gives its baselines the same average.

The average never feeds back into training: steps, exchanges and merges use the live model.
`decay` 0 keeps no average (the live model is what is evaluated).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

DEFAULT_DECAY = 0.9  # `murmur run --ema-decay` and the benchmark's every method: ~10 steps


class WeightAverage:
    """θ̄ ← decay · θ̄ + (1 − decay) · θ after every step, starting from the model as given."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        """Raises `ValueError` unless 0 ≤ `decay` < 1."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"a weight-average decay must be in [0, 1), got {decay}")
        self.decay = decay
        self._average: dict[str, torch.Tensor] = {}
        self.reset(model)

    def reset(self, model: nn.Module) -> None:
        """Start over from `model`'s parameters (a model replaced by state sync, or a new start)."""
        if self.decay:
            self._average = {name: p.detach().clone() for name, p in model.named_parameters()}

    def update(self, model: nn.Module) -> None:
        """Fold in `model`'s parameters after one of its optimizer steps."""
        if not self.decay:
            return
        with torch.no_grad():
            for name, p in model.named_parameters():
                self._average[name].lerp_(p.detach(), 1.0 - self.decay)

    def averaged(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """`model`'s state dict with its parameters replaced by their average (buffers stay live).

        Matched by tensor, not by name: a tied weight appears in the state dict under every name it has.
        """
        state = model.state_dict()
        if not self.decay:
            return state
        by_tensor = {p.data_ptr(): self._average[name] for name, p in model.named_parameters()}
        return {key: by_tensor.get(t.data_ptr(), t) for key, t in state.items()}

    def load_averaged(self, state: Mapping[str, torch.Tensor], model: nn.Module) -> None:
        """Resume from a saved `averaged()`; one that does not fit this model (or none) restarts from `model`."""
        fits = all(n in state and state[n].shape == a.shape for n, a in self._average.items())
        if not fits:
            self.reset(model)
            return
        with torch.no_grad():
            for name, avg in self._average.items():
                avg.copy_(state[name])
