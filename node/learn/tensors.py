"""The tensors a peer exchanges: its model's floating-point tensors, each storage once,
and the optimizer state its merge rule asks for.

Tied weights (an output layer sharing the embedding's matrix, as in GPT-2) appear in
`state_dict()` under two names but are one tensor; here they are one entry, under the
first name, so they travel once and a merge moves them once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

OPTIMIZER_PREFIX = "optimizer."
ALL_OPTIMIZER_STATE = ("*",)  # as `optimizer_state`: every per-parameter key this optimizer keeps (below)
_NONNEGATIVE = (".exp_avg_sq",)  # second moments: Adam divides by their square root


class UnsupportedOptimizerState(ValueError):
    """A merge rule asks for optimizer state this optimizer does not keep per parameter."""


# Per-parameter state keys, and how to start each one as a fresh optimizer would.
_STATE_KEYS: dict[type[torch.optim.Optimizer], tuple[str, ...]] = {
    torch.optim.SGD: ("momentum_buffer",),
    torch.optim.Adam: ("exp_avg", "exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq"),
}


class ExchangedTensors(Mapping[str, torch.Tensor]):
    """Live tensors by name, in a fixed order: the model's, then the requested optimizer state.

    Writing into a tensor read from here (in place) changes the model or optimizer.
    Optimizer state is materialised at construction (zeros, as the optimizer's first
    step would start it), so peers that have not stepped yet exchange the same names.

    `decay[name]` is, for each optimizer tensor, the factor one optimizer step scales its
    past by (Adam's β1 for `exp_avg`, β2 for `exp_avg_sq`, SGD's momentum): a change made
    to the state k steps ago now weighs `decay ** k`. `nonnegative` names the tensors that
    are never negative (second moments), which Adam takes the square root of.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, optimizer_state: Sequence[str] = ()) -> None:
        # `aliases`: a tied name -> the name it travels under
        self._tensors, self.aliases = untie({n: t for n, t in model.state_dict().items() if t.is_floating_point()})
        self.decay: dict[str, float] = {}
        self.nonnegative: set[str] = set()
        if optimizer_state:
            if optimizer is None:
                raise UnsupportedOptimizerState("optimizer state was requested without an optimizer")
            tensors, self.decay = _optimizer_tensors(model, optimizer, optimizer_state)
            self._tensors.update(tensors)
            self.nonnegative = {name for name in tensors if name.endswith(_NONNEGATIVE)}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


@contextlib.contextmanager
def flat_update(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """A flat view of `tensor` to update in place (via a copy written back if it is not contiguous)."""
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    yield flat
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))


def untie(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`state` with the tensors that share storage (tied weights) kept once, under the first name, and
    {each dropped name: the name it aliases}."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:  # empty tensors share no data, whatever their pointer
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor
    return kept, aliases


def _decays(optimizer: torch.optim.Optimizer, group: dict) -> dict[str, float]:
    """How much one step of `optimizer` keeps of each per-parameter state key's past, for `group`."""
    if isinstance(optimizer, torch.optim.SGD):
        return {"momentum_buffer": float(group["momentum"])}  # dampening is 0 (checked): buf = μ·buf + g
    beta1, beta2 = (float(beta) for beta in group["betas"])
    return {"exp_avg": beta1, "exp_avg_sq": beta2}


def _optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, keys: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The optimizer state tensors by exchanged name, and each one's per-step decay (see `ExchangedTensors`)."""
    supported = next((k for cls, k in _STATE_KEYS.items() if type(optimizer) is cls), ())
    keys = supported if tuple(keys) == ALL_OPTIMIZER_STATE and supported else keys
    missing = [key for key in keys if key not in supported]
    if missing:
        raise UnsupportedOptimizerState(
            f"{type(optimizer).__name__} keeps no per-parameter {missing}; "
            f"exchangeable state: " + ", ".join(f"{cls.__name__} {k}" for cls, k in _STATE_KEYS.items())
        )
    if isinstance(optimizer, torch.optim.SGD):
        for group in optimizer.param_groups:
            # SGD's first step sets the buffer to the gradient: a zero buffer gives the same step only without dampening.
            if group["momentum"] == 0 or group["dampening"] != 0:
                raise UnsupportedOptimizerState(
                    f"SGD with momentum {group['momentum']} and dampening {group['dampening']} keeps no "
                    "momentum_buffer that could start at zero; exchanging it needs momentum > 0 and dampening 0"
                )
    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters once, under the first name
    tensors: dict[str, torch.Tensor] = {}
    decay: dict[str, float] = {}
    for group in optimizer.param_groups:
        decays = _decays(optimizer, group)
        for param in group["params"]:
            if id(param) not in names:
                raise UnsupportedOptimizerState("the optimizer holds a parameter that is not the model's")
            state = optimizer.state[param]
            if not state and isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                # Adam starts its whole state at its first step, as here; a partial state would break that step.
                on_device = group["capturable"] or group["fused"]
                state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
                for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
                name = f"{OPTIMIZER_PREFIX}{names[id(param)]}.{key}"
                tensors[name] = state[key]
                decay[name] = decays[key]
    return tensors, decay
