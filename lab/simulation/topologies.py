"""Topologies: who is live in a simulated swarm, and whom each peer's averager may pick as a partner.

`gossip` (`FullView`): a random partner among all live peers, an ideal membership
list. `partial` (`Partial`): a random partner from a bounded `PartialView` kept by
Cyclon shuffles (the simulation drives the shuffles). `ring` (`Ring`): only the two
ring neighbours. `alone` (`Alone`): no partner ever, the no-averaging reference.
`TopologyTable` plugs a topology into the averager in place of its `PeerTable`.
"""

from __future__ import annotations

import abc
import bisect
import math
import random
import statistics
from collections import Counter
from collections.abc import Sequence

from murmur.node.net.peers import PeerEntry, PeerTable
from murmur.node.net.view import PartialView


class Topology(abc.ABC):
    """Who is live and whom each peer may pick as a partner."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self._index: dict[str, int] = {}

    def join(self, peer_id: str, rng: random.Random) -> None:
        self._index[peer_id] = len(self.live)
        self.live.append(peer_id)

    def leave(self, peer_id: str) -> None:
        # Swap-remove keeps this O(1) and the order the same in every topology of one seed.
        i = self._index.pop(peer_id)
        last = self.live.pop()
        if last != peer_id:
            self.live[i] = last
            self._index[last] = i

    @abc.abstractmethod
    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        """A partner for `peer_id` outside `exclude` (or None), and why."""


class FullView(Topology):
    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        for _ in range(8):  # a rejection draw almost always succeeds; fall back to a scan
            choice = rng.choice(self.live)
            if choice != peer_id and choice not in exclude:
                return choice, f"random pick among {len(self.live) - 1} live peers (full view)"
        rest = [p for p in self.live if p != peer_id and p not in exclude]
        return (rng.choice(rest), "random pick (full view)") if rest else (None, "no other live peer")


class Alone(Topology):
    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        return None, "no averaging in this run"


class Ring(Topology):
    """Peers sit at random positions on a ring (drawn from the `rng` they join with)."""

    def __init__(self) -> None:
        super().__init__()
        self.position: dict[str, float] = {}
        self.order: list[tuple[float, str]] = []

    def join(self, peer_id: str, rng: random.Random) -> None:
        super().join(peer_id, rng)
        self.position[peer_id] = rng.random()
        bisect.insort(self.order, (self.position[peer_id], peer_id))

    def leave(self, peer_id: str) -> None:
        super().leave(peer_id)
        self.order.remove((self.position.pop(peer_id), peer_id))

    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        if peer_id not in self.position:
            return None, "not on the ring"
        i = bisect.bisect_left(self.order, (self.position[peer_id], peer_id))
        neighbours = {self.order[i - 1][1], self.order[(i + 1) % len(self.order)][1]} - {peer_id} - exclude
        if not neighbours:
            return None, "both ring neighbours were tried"
        return rng.choice(sorted(neighbours)), "a ring neighbour"


class Partial(Topology):
    """A `PartialView` of at most `size` per peer; the simulation runs their shuffles."""

    def __init__(self, size: int, shuffle_length: int) -> None:
        super().__init__()
        self.size, self.shuffle_length = size, shuffle_length
        self.views: dict[str, PartialView] = {}

    def join(self, peer_id: str, rng: random.Random) -> None:
        # A newcomer copies its bootstrap peer's view and the bootstrap admits it; shuffles do the rest.
        view = PartialView(peer_id, self.size, self.shuffle_length)
        if self.live:
            bootstrap = self.views[rng.choice(self.live)]
            for descriptor in list(bootstrap.entries.values())[: self.size - 1]:
                view.admit(descriptor.peer_id)
            view.admit(bootstrap.self_id)
            bootstrap.admit(peer_id)
        self.views[peer_id] = view
        super().join(peer_id, rng)

    def leave(self, peer_id: str) -> None:
        super().leave(peer_id)
        del self.views[peer_id]  # others find out when they next shuffle with it (or fail to average)

    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        descriptor, reason = self.views[peer_id].sample(rng, exclude)
        return (descriptor.peer_id if descriptor else None), reason

    def random_start(self, rng: random.Random) -> None:
        """Refill every view with random live peers: a swarm that has been shuffling for a while."""
        for view in self.views.values():
            view.entries.clear()
            for other in rng.sample(self.live, min(len(self.live), self.size + 1)):
                if len(view) < self.size:
                    view.admit(other)

    def stats(self) -> dict[str, float]:
        """Sizes, in-degrees, dead descriptors and whether the overlay is (weakly) connected."""
        sizes = [len(v) for v in self.views.values()]
        indegree = Counter(p for v in self.views.values() for p in v.entries)
        dead = sum(1 for v in self.views.values() for p in v.entries if p not in self._index)
        return {
            "size_min": min(sizes), "size_mean": statistics.fmean(sizes), "size_max": max(sizes),
            "indegree_mean": statistics.fmean(indegree.get(p, 0) for p in self.live),
            "indegree_max": max(indegree.get(p, 0) for p in self.live),
            "dead_fraction": dead / max(1, sum(sizes)),
            "connected": float(connected(self.live, {p: [q for q in v.entries if q in self._index] for p, v in self.views.items()})),
        }  # fmt: skip


def make_topology(name: str, view_size: int, shuffle_length: int) -> Topology:
    """The topology called `name` (`gossip`, `partial`, `ring` or `alone`); raises `ValueError` for others."""
    if name == "partial":
        return Partial(view_size, shuffle_length)
    kinds: dict[str, type[Topology]] = {"gossip": FullView, "ring": Ring, "alone": Alone}
    if name not in kinds:
        raise ValueError(f"no partner-picking topology {name!r}; choose from {['partial', *kinds]}")
    return kinds[name]()


def connected(nodes: Sequence[str], edges: dict[str, list[str]]) -> bool:
    """Whether the undirected graph of `edges` joins every node in `nodes`."""
    undirected: dict[str, set[str]] = {n: set() for n in nodes}
    for a, targets in edges.items():
        for b in targets:
            undirected[a].add(b)
            undirected[b].add(a)
    seen, frontier = {nodes[0]}, [nodes[0]]
    while frontier:
        for n in undirected[frontier.pop()]:
            if n not in seen:
                seen.add(n)
                frontier.append(n)
    return len(seen) == len(nodes)


class TopologyTable(PeerTable):
    """The averager's peer table in the simulator: partners come from the topology under test."""

    def __init__(self, self_id: str, topology: Topology) -> None:
        super().__init__(self_id, liveness_timeout=math.inf)
        self.topology = topology

    def select_partner(self, rng: random.Random, exclude: set[str]) -> tuple[PeerEntry | None, str]:
        peer_id, reason = self.topology.pick(self.self_id, rng, exclude)
        return (PeerEntry(peer_id, [], 0.0) if peer_id else None), reason
