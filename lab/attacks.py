"""The peers of the poisoning benchmark (`lab.poisoning`): honest ones and five attackers.

Every peer offers a model and a work claim at each exchange and hears how it ended.
Honest peers, data poisoners and sign-flippers run the node's own code: a
`TrainingLoop`, and `Vetting` (claims, screening, optional scoring) and a `BanList` to
judge partners. ALIE, dissensus and free-riding peers craft what they send and accept
whatever comes back; the first two see every honest model (omniscient, the worst case).

  data       trains the same model on corrupted text (targets: a fixed permutation of the next byte),
             with no code changed: an honest peer in every other way
  alie       sends μ − z·σ·sign(μ − θ₀) over the honest models (A Little Is Enough, arXiv 1902.06156):
             inside the honest spread, biased back towards the initial model in every coordinate
  signflip   trains honestly, but sends its anchor minus its update since its last merge (same norm)
  dissensus  sends each partner x + ε·(x − x̄), x̄ the honest mean: pulls it away from the others
             (ClippedGossip's dissensus attack, arXiv 2202.01545)
  freerider  never trains; sends the model it received at its last exchange (merged or refused) and claims
             its partner's work
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.replica import Snapshot
from murmur.node.learn.rules import MixDecision
from murmur.node.learn.tasks import Task
from murmur.node.learn.vetting import Verdict, Vetting
from murmur.node.net.security import BanList
from murmur.protocol.codec import WireState, quantize

ATTACKS = ("data", "alie", "signflip", "dissensus", "freerider")


@dataclass(frozen=True)
class Offer:
    """What a peer sends at an exchange: its model as it travels, its work claim, and, for a replica, its snapshot."""

    state: WireState
    work: float
    snapshot: Snapshot | None = None


class CorruptedTask:
    """`task` whose training targets are a fixed permutation of the true next byte (the data poisoner's own data)."""

    def __init__(self, task: Task, seed: int = 12345) -> None:
        self._task = task
        self._permutation = torch.randperm(256, generator=torch.Generator().manual_seed(seed))

    def train_batches(self, shard: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self._task.train_batches(shard):
            yield x, self._permutation[y]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


class Peer:
    """A peer of the lab swarm: `offer` what to send to a partner, `settle` the exchange's end."""

    honest = False
    loop: TrainingLoop | None = None
    vetting: Vetting | None = None
    bans: BanList | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def offer(self, partner: Peer, swarm: Swarm) -> Offer:
        raise NotImplementedError

    def vet(self, partner: Peer, mine: Offer, theirs: Offer, now: float) -> Verdict:
        """Accept anything: attackers do not screen (overridden by peers that run the node's code)."""
        return Verdict(MixDecision(0.5, theirs.work, "attacker accepts"), "attacker accepts")

    def settle(self, mine: Offer, theirs: Offer, verdict: Verdict | None) -> None:
        """Apply `verdict`'s merge (None: the exchange was refused by either side)."""


class Swarm:
    """What the omniscient attackers see: the honest peers and the initial model."""

    def __init__(self, peers: Sequence[Peer], initial: Mapping[str, torch.Tensor]) -> None:
        self.peers = peers
        self.initial = initial

    def honest_states(self) -> list[dict[str, torch.Tensor]]:
        return [
            {n: t.detach().clone() for n, t in p.loop.replica.exchanged.items()}
            for p in self.peers
            if p.honest and p.loop is not None
        ]

    def honest_work(self) -> float:
        return sum(p.loop.replica.work for p in self.peers if p.honest and p.loop) / max(
            1, sum(p.honest for p in self.peers)
        )


class Replicated(Peer):
    """A peer that runs the node's code: trains its `TrainingLoop` and vets partners with `vetting` and `bans`."""

    def __init__(self, name: str, task: Task, shard: int, vetting: Vetting, honest: bool = True) -> None:
        super().__init__(name)
        self.honest = honest
        self.loop = TrainingLoop(task, shard=shard)
        self.vetting = vetting
        self.bans = BanList()
        self.verdicts: list[tuple[str, Verdict]] = []  # (partner, verdict) of every exchange this peer vetted

    def offer(self, partner: Peer, swarm: Swarm) -> Offer:
        snapshot = self.loop.replica.snapshot()
        return Offer(snapshot.state, snapshot.work, snapshot)

    def vet(self, partner: Peer, mine: Offer, theirs: Offer, now: float) -> Verdict:
        replica = self.loop.replica
        assert mine.snapshot is not None
        verdict = self.vetting.vet(
            partner.name,
            replica.rule,
            mine.snapshot,
            theirs.state,
            theirs.work,
            None,
            replica.samples / max(now, 1.0),
            now,
        )
        for offence in verdict.offences:
            self.bans.strike(partner.name, offence, now)
        self.verdicts.append((partner.name, verdict))
        return verdict

    def settle(self, mine: Offer, theirs: Offer, verdict: Verdict | None) -> None:
        if verdict is not None and verdict.decision is not None and mine.snapshot is not None:
            self.loop.replica.merge(
                mine.snapshot, theirs.state, verdict.decision.remote_share, verdict.decision.work_after
            )


class DataPoisoner(Replicated):
    def __init__(self, name: str, task: Task, shard: int, vetting: Vetting) -> None:
        super().__init__(name, CorruptedTask(task), shard, vetting, honest=False)  # type: ignore[arg-type]


class SignFlipper(Replicated):
    """Trains and merges as an honest peer, but sends `anchor − (model − anchor)`, anchor its model after its last merge."""

    def __init__(self, name: str, task: Task, shard: int, vetting: Vetting) -> None:
        super().__init__(name, task, shard, vetting, honest=False)
        self._anchor = _copy(self.loop.replica.exchanged)

    def offer(self, partner: Peer, swarm: Swarm) -> Offer:
        snapshot = self.loop.replica.snapshot()
        flipped = {n: 2 * self._anchor[n] - snapshot.state[n] for n in snapshot.state}
        return Offer(quantize(flipped, self.loop.replica.spec, "float32"), snapshot.work, snapshot)

    def settle(self, mine: Offer, theirs: Offer, verdict: Verdict | None) -> None:
        super().settle(mine, theirs, verdict)
        if verdict is not None and verdict.decision is not None:
            self._anchor = _copy(self.loop.replica.exchanged)


class Crafted(Peer):
    """An attacker without a model of its own: `craft` what to send; it claims the honest peers' mean work."""

    def __init__(self, name: str, spec: Any) -> None:
        super().__init__(name)
        self.spec = spec

    def offer(self, partner: Peer, swarm: Swarm) -> Offer:
        return Offer(quantize(self.craft(partner, swarm), self.spec, "float32"), max(swarm.honest_work(), 1.0))

    def craft(self, partner: Peer, swarm: Swarm) -> dict[str, torch.Tensor]:
        raise NotImplementedError


class Alie(Crafted):
    def __init__(self, name: str, spec: Any, z: float = 1.0) -> None:
        super().__init__(name, spec)
        self.z = z

    def craft(self, partner: Peer, swarm: Swarm) -> dict[str, torch.Tensor]:
        states = swarm.honest_states()
        out = {}
        for name in states[0]:
            stacked = torch.stack([s[name] for s in states])
            mean, std = stacked.mean(0), stacked.std(0, correction=0)
            out[name] = mean - self.z * std * torch.sign(mean - swarm.initial[name])
        return out


class Dissensus(Crafted):
    def __init__(self, name: str, spec: Any, epsilon: float = 1.0) -> None:
        super().__init__(name, spec)
        self.epsilon = epsilon

    def craft(self, partner: Peer, swarm: Swarm) -> dict[str, torch.Tensor]:
        states = swarm.honest_states()
        if partner.loop is None:  # another attacker: send it the honest mean
            return {n: torch.stack([s[n] for s in states]).mean(0) for n in states[0]}
        mine = partner.loop.replica.exchanged
        return {n: mine[n] + self.epsilon * (mine[n] - torch.stack([s[n] for s in states]).mean(0)) for n in states[0]}


class FreeRider(Peer):
    """Never trains: echoes the model it received at its last exchange and claims its partner's work."""

    def __init__(self, name: str, initial: WireState) -> None:
        super().__init__(name)
        self._echo = initial

    def offer(self, partner: Peer, swarm: Swarm) -> Offer:
        claim = partner.loop.replica.work if partner.loop is not None else swarm.honest_work()
        return Offer(self._echo, max(claim, 1.0))

    def settle(self, mine: Offer, theirs: Offer, verdict: Verdict | None) -> None:
        self._echo = theirs.state  # models cross before either side decides: refused or not, it has the partner's


def _copy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().to("cpu", torch.float32).clone() for n, t in state.items()}


def norm(state: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.pow(2).sum()) for t in state.values()))


def corrupted_charlm() -> CorruptedTask:
    """`--task lab.attacks:corrupted_charlm`: charlm trained on corrupted targets, a data poisoner as a user runs one."""
    from murmur.node.learn.tasks import load_task

    return CorruptedTask(load_task("charlm"))
