"""Delta gossip, the model side: a peer's progress leaves it as sparse, low-bit deltas.

Beside its live tensors x, a peer keeps a *reference* r: x − r is the progress of its own
that the swarm has not received yet, its error buffer (nothing else holds it). Publishing
compresses that residual, u = C(x − r) (the top entries of each tensor, quantized), and the
swarm adds s·u to its models, this peer included: r += s·u and x −= (1 − s)·u. So

- the residual loses exactly u: residual after + u = residual before, and what compression
  left out stays in the residual for the next delta (error feedback, no mass lost);
- a peer that applies a delta d adds it to both x and r, so its own residual is untouched;
- every model is the common start, plus s·u for each delta it has applied, plus its own
  residual: peers that applied the same deltas differ only by their residuals.

The origin picks s (1/N for N peers averages everyone's progress, as DiLoCo's outer step
does with learning rate 1). References are private: no two peers need the same one.

A delta is named by its origin (a random name per `DeltaReference`, so a restarted peer never
reuses one) and a sequence number. `versions` holds the highest one applied per origin, so
no delta is applied twice; it travels with the model (state sync, checkpoints), because it
says which deltas the model already holds.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from murmur.node.learn.tensors import flat_update
from murmur.protocol.sparse import SPARSE_BITS, SparseTensor, quantize_sparse

SparseDelta = dict[str, SparseTensor]
MAX_ORIGINS = 256  # origins a peer remembers; the least recently heard go first
EXACT_BELOW = 1 << 20  # entries: smaller tensors get an exact top-k
THRESHOLD_SAMPLE = 1 << 16  # entries sampled to estimate a large tensor's top-k threshold
THRESHOLD_MARGIN = 1.25  # the threshold aims this much above k, so that the sample's error rarely leaves fewer


class StaleDelta(ValueError):
    """A delta this model already holds (its sequence number is not above its origin's version)."""


@dataclass(frozen=True)
class Published:
    """Delta `seq` of `origin`, the share `scale` of it every model adds, and the work that share carries."""

    origin: str
    seq: int
    delta: SparseDelta
    scale: float
    work: float


@dataclass(frozen=True)
class Compression:
    """How a residual is compressed: the share of each tensor's entries sent (`density`, the
    largest in magnitude), each in `bits` bits. Raises `ValueError` outside (0, 1] or `SPARSE_BITS`."""

    density: float
    bits: int

    def __post_init__(self) -> None:
        if not 0 < self.density <= 1:
            raise ValueError(f"a compression density must be in (0, 1], got {self.density}")
        if self.bits not in SPARSE_BITS:
            raise ValueError(f"compression bits must be one of {list(SPARSE_BITS)}, got {self.bits}")

    def entries(self, numel: int) -> int:
        """How many of a tensor's `numel` entries a delta sends: at least one of a non-empty tensor."""
        return min(numel, max(1, math.ceil(self.density * numel))) if numel else 0


COMPRESSIONS = ("none", "sparse", "strong")
STRONG = Compression(0.005, 2)  # the most compression that still learned close to uncompressed gossip


def compression_for(name: str, density: float, bits: int) -> Compression | None:
    """The compression `--compression NAME` (with its density and bits) asks for: None for "none".

    Raises `ValueError` for a name not in `COMPRESSIONS`, or a density or bits `Compression` refuses.
    """
    if name not in COMPRESSIONS:
        raise ValueError(f"unknown compression {name!r}; choose from {list(COMPRESSIONS)}")
    return None if name == "none" else STRONG if name == "strong" else Compression(density, bits)


def top_entries(magnitude: torch.Tensor, k: int, sampler: torch.Generator | None = None) -> torch.Tensor:
    """The flat indices of at most `k` of the largest entries of `magnitude` (NaN counts as largest),
    ascending (int64, CPU).

    Exact below `EXACT_BELOW` entries or without a `sampler`. Above it, a threshold estimated from
    a random sample of `THRESHOLD_SAMPLE` entries preselects the candidates, and the exact top `k`
    of those is returned: any choice of entries conserves mass (what is left stays in the
    residual), so a near-top set costs little, while an exact top-k of a large tensor costs a
    sort's worth of time.
    """
    flat = magnitude.reshape(-1)
    if k >= flat.numel():
        return torch.arange(flat.numel())
    if sampler is not None and flat.numel() >= EXACT_BELOW:
        sample = flat[torch.randint(flat.numel(), (THRESHOLD_SAMPLE,), generator=sampler).to(flat.device)]
        above = min(THRESHOLD_SAMPLE, math.ceil(THRESHOLD_MARGIN * THRESHOLD_SAMPLE * k / flat.numel()))
        threshold = sample.kthvalue(THRESHOLD_SAMPLE - above + 1).values  # NaN sorts last: a NaN sample keeps all
        candidates = ((flat >= threshold) | flat.isnan()).nonzero().squeeze(1)
        if candidates.numel() <= k:
            return candidates.cpu()
        return candidates[flat[candidates].topk(k, sorted=False).indices].sort().values.cpu()
    return flat.topk(k, sorted=False).indices.sort().values.cpu()


class DeltaReference:
    """A peer's reference r for its exchanged tensors (float32, on their device); see the module docstring.

    Callers serialise access (the replica's lock): `publish` and `apply` write the live tensors.
    """

    def __init__(self, exchanged: Mapping[str, torch.Tensor]) -> None:
        self.origin = secrets.token_hex(8)
        self.seq = 0
        self._sampler = torch.Generator().manual_seed(secrets.randbits(63))  # not the user's global RNG
        self.reference: dict[str, torch.Tensor] = {}
        self.versions: dict[str, int] = {}
        self.reset(exchanged)

    def reset(self, exchanged: Mapping[str, torch.Tensor], versions: Mapping[str, int] | None = None) -> None:
        """Start over with no residual: r = x (a new model, one adopted whole, or one restored without r),
        a model that holds the deltas `versions` names (none by default)."""
        self.reference = {name: _contiguous_copy(t, t.device) for name, t in exchanged.items()}
        self._hold(versions or {})

    def _hold(self, versions: Mapping[str, int]) -> None:
        """The model holds the deltas `versions` names, and this origin's own."""
        self.versions = {}
        for origin, seq in versions.items():
            self._advance(origin, seq)
        if self.seq:
            self._advance(self.origin, self.seq)

    def _advance(self, origin: str, seq: int) -> None:
        self.versions.pop(origin, None)  # re-inserted last: the dict's order is the eviction order
        self.versions[origin] = seq
        while len(self.versions) > MAX_ORIGINS:
            del self.versions[next(iter(self.versions))]

    def holds(self, origin: str, seq: int) -> bool:
        """Whether this model already holds delta `seq` of `origin`."""
        return seq <= self.versions.get(origin, 0)

    def residual_norm(self, exchanged: Mapping[str, torch.Tensor]) -> float:
        """‖x − r‖: how much unpublished progress this peer holds."""
        return math.sqrt(sum(float((x.float() - self.reference[n]).square().sum()) for n, x in exchanged.items()))

    def select(self, exchanged: Mapping[str, torch.Tensor], compression: Compression) -> dict[str, torch.Tensor]:
        """Which entries of each tensor's residual a delta sends: its largest (`top_entries`).

        Safe without the caller's lock, while the model trains: a step or merge meanwhile
        changes which entries are chosen, never what `publish` then sends or keeps, so mass is
        conserved whatever this read saw. A tensor's residual is read once, one tensor-sized
        temporary at a time.
        """
        selection = {}
        for name, x in exchanged.items():
            magnitude = (x.detach().float() - self.reference[name]).abs_()  # the one tensor-sized temporary
            selection[name] = top_entries(magnitude, compression.entries(magnitude.numel()), self._sampler)
        return selection

    def publish(
        self, exchanged: Mapping[str, torch.Tensor], selection: Mapping[str, torch.Tensor], bits: int, scale: float,
        work: float,
    ) -> Published:
        """Quantize the residual's `selection` (from `select`, ascending flat indices per tensor) to `bits`
        into a delta u, keep s·u of it here (`scale` s in (0, 1]) and return u, named as this origin's
        next delta, carrying `work`.

        Reads and writes only the selected entries. Raises `ValueError` for a scale outside (0, 1]
        or a selected residual that is not finite (the model diverged): nothing was written then.
        """
        if not 0 < scale <= 1:
            raise ValueError(f"a delta's scale must be in (0, 1], got {scale}")
        residuals = {}
        for name, indices in selection.items():
            reference = self.reference[name].view(-1)
            at = indices.to(reference.device)
            values = (exchanged[name].detach().reshape(-1)[at].float() - reference[at]).cpu()
            residuals[name] = quantize_sparse(indices, values, bits)  # refuses NaN and inf
        for name, delta in residuals.items():
            self._add(exchanged[name], name, delta, scale, live_share=scale - 1)
        self.seq += 1
        self._advance(self.origin, self.seq)
        return Published(self.origin, self.seq, residuals, scale, work)

    def apply(self, exchanged: Mapping[str, torch.Tensor], published: Published) -> None:
        """Add another peer's delta, `scale` × u, to the live tensors and to the reference alike.

        Raises `StaleDelta` (writing nothing) for a delta this model already holds.
        """
        if self.holds(published.origin, published.seq):
            raise StaleDelta(f"delta {published.seq} of {published.origin} is already in this model")
        for name, tensor in published.delta.items():
            self._add(exchanged[name], name, tensor, published.scale, live_share=published.scale)
        self._advance(published.origin, published.seq)

    def _add(self, live: torch.Tensor, name: str, delta: SparseTensor, scale: float, live_share: float) -> None:
        if not delta.indices.numel():
            return
        reference = self.reference[name].view(-1)
        indices = delta.indices.to(reference.device)
        values = delta.values.to(reference.device)
        reference.index_add_(0, indices, values, alpha=scale)
        with flat_update(live.detach()) as flat:
            flat.index_add_(0, indices, values.to(flat.dtype), alpha=live_share)

    def state_dict(self) -> dict:
        """The reference (CPU tensors) and the versions, for checkpoints."""
        return {"reference": {name: t.cpu() for name, t in self.reference.items()}, "versions": dict(self.versions)}

    def load_state_dict(self, state: Mapping, exchanged: Mapping[str, torch.Tensor]) -> None:
        """Restore `state_dict()` output for these tensors; raises `ValueError` if names or shapes differ."""
        saved = state.get("reference", {})
        if set(saved) != set(exchanged) or any(saved[n].shape != t.shape for n, t in exchanged.items()):
            raise ValueError("the saved delta reference does not fit this model's tensors")
        self.reference = {n: _contiguous_copy(saved[n], t.device) for n, t in exchanged.items()}
        self._hold(state.get("versions", {}))


def _contiguous_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().to(device, torch.float32).clone(memory_format=torch.contiguous_format)
