"""In-process swarm simulator: Murmur's real averaging code at 1,000 peers, in simulated time.

Each simulated peer is a real `Averager` (merge policy, screening, work claims, the
sans-IO `Exchange` and the chunked tensor codec, state sync for newcomers) over a
`LinkTransport`: a `MemoryTransport` whose streams take simulated time for latency and
bandwidth. Trio's `MockClock(autojump_threshold=0)` jumps from one deadline to the
next, so a simulated second costs only the CPU of what happens in it.

The network model (`NetworkModel`): per-peer compute speed from a heavy-tailed Pareto
distribution (a step of 32 samples takes `step_ms × slowdown`), per-pair latency from
positions in a unit square, per-peer bandwidth from a lognormal, and churn (peers
crash and newcomers join, at a steady swarm size). Training is a small loop that sleeps
the simulated compute time and then runs the real torch step inline (`Trainer.step`).

Topologies: `gossip` (random partner among all live peers: a full, ideal membership
list), `partial` (random partner from a bounded `PartialView` kept by Cyclon shuffles),
`ring` (a fixed ring: only the two ring neighbours), `allreduce` (ideal synchronous
data parallelism: every step averages all peers' gradients, communication is free,
each step waits for the slowest peer; no churn), and `alone` (no averaging at all: the
reference that shows what gossip adds). Peer-sampling shuffles are exchanged as direct
calls that take one link latency each way, not over the transport.
"""

from __future__ import annotations

import abc
import bisect
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import torch
import trio.testing

from node.averaging.averager import Averager
from node.averaging.factory import build_averager
from node.learn.rules import make_rule
from node.learn.runtime import Runtime
from node.learn.tasks import Task, load_task
from node.learn.trainer import Trainer
from node.net.peers import PeerEntry, PeerTable
from node.net.transport import READ_CHUNK, ByteStream, MemoryNetwork, MemoryTransport, TransportError
from node.net.view import PartialView

TOPOLOGIES = ("gossip", "partial", "ring", "allreduce", "alone")
# Simulated seconds on the mock clock, and torch work inline (a worker thread would let the clock jump ahead).
SIMULATED = Runtime.simulated()


@dataclass(frozen=True)
class Profile:
    """One simulated machine: compute slowdown, a position (for latency) and uplink bytes/s."""

    slowdown: float
    position: tuple[float, float]
    bandwidth: float


@dataclass(frozen=True)
class NetworkModel:
    """How simulated peers differ and how their links behave.

    A step of 32 samples takes `step_ms × slowdown` ms, slowdown ~ Pareto(`pareto_alpha`)
    ≥ 1, capped at `max_slowdown`. One-way latency between two peers is `latency_ms` +
    `latency_span_ms` × their distance in the unit square / √2. Uplinks are lognormal with
    median `bandwidth_mbps` Mbit/s and shape `bandwidth_sigma`; a link runs at the slower
    of its two ends. `churn`: the fraction of the swarm replaced per simulated second.
    """

    step_ms: float = 20.0
    pareto_alpha: float = 1.5
    max_slowdown: float = 30.0
    latency_ms: float = 5.0
    latency_span_ms: float = 50.0
    bandwidth_mbps: float = 50.0
    bandwidth_sigma: float = 1.0
    churn: float = 0.01

    def draw(self, rng: random.Random) -> Profile:
        """A new machine; the same `rng` state always draws the same one."""
        slowdown = min(self.max_slowdown, rng.paretovariate(self.pareto_alpha))
        bandwidth = self.bandwidth_mbps * 1e6 / 8 * math.exp(rng.gauss(0.0, self.bandwidth_sigma))
        return Profile(slowdown, (rng.random(), rng.random()), bandwidth)

    def step_s(self, profile: Profile) -> float:
        """Simulated seconds one 32-sample step takes on `profile`."""
        return self.step_ms / 1000 * profile.slowdown

    def link(self, a: Profile, b: Profile) -> tuple[float, float]:
        """(one-way latency in s, bytes/s) between two peers."""
        distance = math.dist(a.position, b.position) / math.sqrt(2)
        return (self.latency_ms + self.latency_span_ms * distance) / 1000, min(a.bandwidth, b.bandwidth)


@dataclass(frozen=True)
class SimConfig:
    """One simulation run. Times are simulated seconds; `task` must report `accuracy` (digits).

    The run stops `linger` seconds after 90 % of the evaluated peers (and so the
    median) have reached `target` accuracy, or at `max_time`, or after `max_wall_s` of
    real time (then the result says `truncated`). `eval_sample` peers are evaluated at
    each `eval_every` grid point (a dead one is replaced by a random live peer);
    consensus distance uses every live peer.
    """

    peers: int = 100
    topology: str = "gossip"
    task: str = "digits"
    target: float = 0.95
    max_time: float = 30.0
    linger: float = 2.0
    eval_every: float = 0.25
    eval_sample: int = 32
    average_every: float = 0.1
    weighting: str = "work"
    exchange_timeout: float = 10.0
    view_size: int = 32
    shuffle_length: int = 8
    shuffle_every: float = 1.0
    network: NetworkModel = field(default_factory=NetworkModel)
    seed: int = 0
    max_wall_s: float = 900.0

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose from {list(TOPOLOGIES)}")
        if self.peers < 2:
            raise ValueError(f"need at least 2 peers, got {self.peers}")


@dataclass
class SimResult:
    """Curves on the evaluation grid and totals of one run (JSON-ready via `to_json`)."""

    config: SimConfig
    times: list[float] = field(default_factory=list)
    accuracy_median: list[float] = field(default_factory=list)  # over the evaluated sample
    accuracy_mean: list[float] = field(default_factory=list)
    accuracy_p10: list[float] = field(default_factory=list)  # the slowest-learning 10 % of the sample
    consensus: list[float] = field(default_factory=list)  # mean ||θ_i − θ̄||² over live peers
    live: list[int] = field(default_factory=list)
    time_to_target: float | None = None  # the median evaluated peer reaches the target
    time_to_target_p10: float | None = None  # 90 % of evaluated peers do
    wall_s: float = 0.0
    steps: int = 0
    samples: int = 0
    exchanges: dict[str, int] = field(default_factory=dict)  # outcomes, counted on both sides
    exchange_s: float | None = None  # median over peers of their averagers' typical merged-exchange time
    joins: int = 0
    leaves: int = 0
    view: dict[str, float] | None = None  # partial views at the end: sizes, dead entries, connectivity
    truncated: bool = False

    @property
    def evaluated(self) -> int:
        return min(self.config.eval_sample, self.config.peers)

    def record(self, t: float, accuracy: Sequence[float], consensus: float, live: int) -> bool:
        """Add one grid point; return True once the run may stop (targets reached, lingered)."""
        cfg = self.config
        self.times.append(t)
        self.accuracy_median.append(statistics.median(accuracy))
        self.accuracy_mean.append(statistics.fmean(accuracy))
        self.accuracy_p10.append(_quantile(accuracy, 0.1))
        self.consensus.append(consensus)
        self.live.append(live)
        if self.time_to_target is None and self.accuracy_median[-1] >= cfg.target:
            self.time_to_target = t
        if self.time_to_target_p10 is None and self.accuracy_p10[-1] >= cfg.target:
            self.time_to_target_p10 = t
        return self.time_to_target_p10 is not None and t >= self.time_to_target_p10 + cfg.linger

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# --- simulated links --------------------------------------------------------------------


class _LinkStream(ByteStream):
    """One end of a simulated link: writes take size/bandwidth of sender time and arrive `latency` later."""

    def __init__(self, remote_peer: str, send: Any, receive: Any, latency: float, bandwidth: float) -> None:
        self.remote_peer = remote_peer
        self._send, self._receive = send, receive
        self.latency, self.bandwidth = latency, bandwidth
        self._free_at = 0.0  # when our side of the link has sent its last queued byte
        self._pending = b""
        self._pending_at = 0.0

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        if not self._pending:
            try:
                self._pending_at, self._pending = await self._receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return b""
            except anyio.BrokenResourceError as exc:
                raise TransportError(f"stream from {self.remote_peer} was reset") from exc
        await anyio.sleep_until(self._pending_at)
        chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return chunk

    async def send_all(self, data: bytes) -> None:
        # Serialization holds the sender; propagation does not (the next write may follow at once).
        done = max(anyio.current_time(), self._free_at) + len(data) / self.bandwidth
        self._free_at = done
        await anyio.sleep_until(done)
        try:
            self._send.send_nowait((done + self.latency, bytes(data)))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise TransportError(f"write to {self.remote_peer} failed: stream closed") from exc

    async def close(self) -> None:
        self._send.close()

    async def reset(self) -> None:
        self._send.close()
        self._receive.close()


class LinkTransport(MemoryTransport):
    """A `MemoryTransport` whose streams follow `links(a, b) -> (latency s, bytes/s)` in simulated time.

    Opening a stream costs one round trip (protocol negotiation), then each write
    costs its serialization time on the sender and arrives one latency later.
    """

    def __init__(self, network: MemoryNetwork, peer_id: str, links: Callable[[str, str], tuple[float, float]]) -> None:
        super().__init__(network, peer_id)
        self._links = links

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        latency, bandwidth = self._links(self.peer_id, peer_id)
        await anyio.sleep(2 * latency)
        remote = self.network.transports.get(peer_id)
        if not isinstance(remote, LinkTransport) or remote._task_group is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: unreachable")
        handler = remote._handlers.get(protocol)
        if handler is None:
            raise TransportError(f"cannot open {protocol} to {peer_id}: protocol not supported")
        a_send, b_receive = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)
        b_send, a_receive = anyio.create_memory_object_stream[tuple[float, bytes]](math.inf)
        remote._task_group.start_soon(handler, _LinkStream(self.peer_id, b_send, b_receive, latency, bandwidth))
        return _LinkStream(peer_id, a_send, a_receive, latency, bandwidth)


# --- topologies: where a peer's averager finds partners -----------------------------------


class _Topology(abc.ABC):
    """Who is live and whom each peer may pick as a partner."""

    name = ""

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


class _FullView(_Topology):
    name = "gossip"

    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        for _ in range(8):  # a rejection draw almost always succeeds; fall back to a scan
            choice = rng.choice(self.live)
            if choice != peer_id and choice not in exclude:
                return choice, f"random pick among {len(self.live) - 1} live peers (full view)"
        rest = [p for p in self.live if p != peer_id and p not in exclude]
        return (rng.choice(rest), "random pick (full view)") if rest else (None, "no other live peer")


class _Alone(_Topology):
    name = "alone"

    def pick(self, peer_id: str, rng: random.Random, exclude: set[str]) -> tuple[str | None, str]:
        return None, "no averaging in this run"


class _Ring(_Topology):
    name = "ring"

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


class _Partial(_Topology):
    name = "partial"

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
            "connected": float(_connected(self.live, {p: [q for q in v.entries if q in self._index] for p, v in self.views.items()})),
        }  # fmt: skip


def _connected(nodes: Sequence[str], edges: dict[str, list[str]]) -> bool:
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


class _TopologyTable(PeerTable):
    """The averager's peer table in the simulator: partners come from the topology under test."""

    def __init__(self, self_id: str, topology: _Topology) -> None:
        super().__init__(self_id, liveness_timeout=math.inf)
        self.topology = topology

    def select_partner(self, rng: random.Random, exclude: set[str]) -> tuple[PeerEntry | None, str]:
        peer_id, reason = self.topology.pick(self.self_id, rng, exclude)
        return (PeerEntry(peer_id, [], 0.0) if peer_id else None), reason


# --- the gossip simulation -----------------------------------------------------------------


@dataclass
class _Peer:
    peer_id: str
    profile: Profile
    rng: random.Random
    trainer: Trainer
    transport: LinkTransport
    averager: Averager
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ready: bool = False  # trains (initial peers) or has finished state sync (newcomers)


class GossipSimulation:
    """A swarm of real averagers in simulated time; `run()` returns the curves."""

    def __init__(self, config: SimConfig) -> None:
        if config.topology == "allreduce":
            raise ValueError("use simulate_allreduce for the all-reduce baseline")
        self.config = config
        self.task = _accuracy_task(config.task)
        self.network = MemoryNetwork()
        self.peers: dict[str, _Peer] = {}
        self.topology: _Topology = {
            "gossip": _FullView, "ring": _Ring, "alone": _Alone,
            "partial": lambda: _Partial(config.view_size, config.shuffle_length),
        }[config.topology]()  # fmt: skip
        # Separate streams, so every topology of one seed sees the same machines and churn.
        self._profiles = random.Random(config.seed)
        self._churn_rng = random.Random(config.seed + 1)
        self._eval_rng = random.Random(config.seed + 2)
        self._created = 0
        self._exchange_s: list[float] = []
        self.result = SimResult(config)

    def run(self) -> SimResult:
        """Run to the stop condition of `config`; blocks, taking real CPU time only.

        The same config gives the same result: besides the seeded draws here, Trio's
        scheduler flips the order of tasks woken together with its own RNG, seeded too.
        """
        torch.set_num_threads(1)
        scheduler_rng = getattr(trio._core._run, "_r", None)  # private; without it runs differ slightly
        if isinstance(scheduler_rng, random.Random):
            scheduler_rng.seed(self.config.seed)
        start = time.perf_counter()
        anyio.run(self._main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
        self.result.wall_s = time.perf_counter() - start
        return self.result

    def _link(self, a: str, b: str) -> tuple[float, float]:
        pa, pb = self.peers.get(a), self.peers.get(b)
        if pa is None or pb is None:  # a peer that already left: any finite link will do
            return self.config.network.latency_ms / 1000, self.config.network.bandwidth_mbps * 1e6 / 8
        return self.config.network.link(pa.profile, pb.profile)

    def _new_peer(self) -> _Peer:
        index = self._created
        self._created += 1
        peer_id = f"p{index:05d}"
        trainer = Trainer(self.task, shard=index, rule=make_rule(self.config.weighting), runtime=SIMULATED)
        transport = LinkTransport(self.network, peer_id, self._link)
        rng = random.Random(f"{self.config.seed}/{peer_id}")
        averager = build_averager(
            transport, trainer, table=_TopologyTable(peer_id, self.topology), rng=rng,
            exchange_timeout=self.config.exchange_timeout, runtime=SIMULATED,
        )  # fmt: skip
        peer = _Peer(peer_id, self.config.network.draw(self._profiles), rng, trainer, transport, averager)
        self.peers[peer_id] = peer
        return peer

    async def _main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for _ in range(self.config.peers):
                await tg.start(self._run_peer, self._new_peer(), False)
            if isinstance(self.topology, _Partial):
                self.topology.random_start(random.Random(self.config.seed + 3))
            if self.config.network.churn > 0:
                tg.start_soon(self._churn)
            await self._observe()
            tg.cancel_scope.cancel()
        if isinstance(self.topology, _Partial):
            self.result.view = self.topology.stats()
        for peer in self.peers.values():
            self._retire(peer)
        self.result.exchange_s = statistics.median(self._exchange_s) if self._exchange_s else None

    async def _run_peer(self, peer: _Peer, newcomer: bool, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        with peer.scope:
            async with peer.transport.run():
                self.topology.join(peer.peer_id, peer.rng)
                task_status.started()
                if newcomer:
                    await peer.averager.sync_from_swarm()
                peer.ready = True
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._train, peer)
                    tg.start_soon(peer.averager.run, self.config.average_every)
                    if isinstance(self.topology, _Partial):
                        tg.start_soon(self._shuffle, peer)

    async def _train(self, peer: _Peer) -> None:
        """Sleep each step's simulated compute time, then take the real torch step."""
        step_s = self.config.network.step_s(peer.profile)
        await anyio.sleep(peer.rng.uniform(0, step_s))  # peers do not start in lockstep
        while True:
            await anyio.sleep(step_s)
            peer.trainer.step()

    async def _shuffle(self, peer: _Peer) -> None:
        """Cyclon: every `shuffle_every` s swap descriptors with the oldest neighbour."""
        assert isinstance(self.topology, _Partial)
        view = self.topology.views[peer.peer_id]
        while True:
            await anyio.sleep(self.config.shuffle_every * peer.rng.uniform(0.8, 1.2))
            offer = view.start_shuffle(peer.rng)
            if offer.target is None:
                if self.topology.live:  # isolated: rejoin through a random live peer, as a restart would
                    view.admit(peer.rng.choice(self.topology.live))
                continue
            latency, _ = self._link(peer.peer_id, offer.target.peer_id)
            await anyio.sleep(latency)
            target = self.topology.views.get(offer.target.peer_id)
            if target is None:
                continue  # it left: the dead descriptor is already gone
            reply = target.answer_shuffle(offer.entries, self.peers[offer.target.peer_id].rng)
            await anyio.sleep(latency)
            view.finish_shuffle(reply, offer.entries)

    async def _churn(self) -> None:
        """Poisson crashes at `churn × N` per second, each followed by a newcomer (steady size)."""
        rate = self.config.network.churn * self.config.peers
        while True:
            await anyio.sleep(self._churn_rng.expovariate(rate))
            victim = self.peers[self._churn_rng.choice(self.topology.live)]
            self.topology.leave(victim.peer_id)
            victim.scope.cancel()
            self._retire(victim)
            del self.peers[victim.peer_id]
            self.result.leaves += 1
            await self._tg.start(self._run_peer, self._new_peer(), True)
            self.result.joins += 1

    def _retire(self, peer: _Peer) -> None:
        self.result.steps += peer.trainer.samples // self.task.batch_size
        self.result.samples += peer.trainer.samples
        for outcome, count in peer.averager.outcomes.items():
            self.result.exchanges[outcome] = self.result.exchanges.get(outcome, 0) + count
        if peer.averager.typical_exchange_s > 0:
            self._exchange_s.append(peer.averager.typical_exchange_s)

    async def _observe(self) -> None:
        cfg, result = self.config, self.result
        sample = self._eval_rng.sample(sorted(self.peers), min(cfg.eval_sample, len(self.peers)))
        wall_start = time.perf_counter()
        grid = 0
        while grid * cfg.eval_every <= cfg.max_time + 1e-9:
            t = grid * cfg.eval_every
            await anyio.sleep_until(t)
            ready = [p for p in self.peers.values() if p.ready]
            sample = [p if p in self.peers else self._eval_rng.choice(ready).peer_id for p in sample]
            accuracy = [self.peers[p].trainer.evaluate().metrics["accuracy"] for p in sample if self.peers[p].ready]
            if result.record(t, accuracy, consensus_distance([p.trainer for p in ready]), len(self.peers)):
                return
            if time.perf_counter() - wall_start > cfg.max_wall_s:
                result.truncated = True
                return
            grid += 1


def _accuracy_task(name: str) -> Task:
    task = load_task(name)
    if task.metric.name != "accuracy":
        raise ValueError(f"the simulator measures accuracy; task {name!r} reports {task.metric.name!r}")
    return task


def consensus_distance(trainers: Sequence[Trainer]) -> float:
    """Mean squared L2 distance of the models' exchanged tensors from their average."""
    flat = torch.stack([torch.cat([t.flatten() for t in tr.snapshot().state.values()]) for tr in trainers])
    return float(((flat - flat.mean(dim=0)) ** 2).sum(dim=1).mean())


# --- the ideal all-reduce baseline -----------------------------------------------------------


def simulate_allreduce(config: SimConfig) -> SimResult:
    """Ideal synchronous data parallelism on the same machines as `GossipSimulation`.

    Each step every peer computes a gradient on its own 32-sample batch, the gradients
    are averaged (one step on the concatenated batch: the same mean), and the step
    takes the slowest peer's compute time; communication is free and nobody churns.
    """
    result = SimResult(config)
    start = time.perf_counter()
    torch.set_num_threads(1)
    task = _accuracy_task(config.task)
    profiles_rng = random.Random(config.seed)
    step_s = max(config.network.step_s(config.network.draw(profiles_rng)) for _ in range(config.peers))
    model = task.build_model()
    optimizer = task.make_optimizer(model)
    streams = [task.train_batches(shard) for shard in range(config.peers)]
    now, grid, metric = 0.0, 0, task.evaluate(model)["accuracy"]
    while grid * config.eval_every <= config.max_time + 1e-9:
        t = grid * config.eval_every
        while now + step_s <= t:  # steps that finish before this grid point
            batches = [next(s) for s in streams]
            model.train()
            loss = task.loss(model, (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            now += step_s
            result.steps += 1
            result.samples += sum(len(b[1]) for b in batches)
            metric = task.evaluate(model)["accuracy"]
        if result.record(t, [metric], 0.0, config.peers):  # one model: no spread, no consensus distance
            break
        if time.perf_counter() - start > config.max_wall_s:
            result.truncated = True
            break
        grid += 1
    result.wall_s = time.perf_counter() - start
    return result


def simulate(config: SimConfig) -> SimResult:
    """Run `config` with the simulator its topology needs."""
    if config.topology == "allreduce":
        return simulate_allreduce(config)
    return GossipSimulation(config).run()
