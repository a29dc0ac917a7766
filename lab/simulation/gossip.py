"""The gossip simulation: a swarm of real averagers over simulated links, in simulated time.

Each peer is a `TrainingLoop` and the `Averager` that `build_averager` wires for it (merge
rule, screening, work claims, the sans-IO exchange and tensor codec, state sync for
newcomers), given `Runtime.simulated()`: the event loop's clock, and torch work run
inline so that it takes no simulated time. Its partners come from the topology under
test (`TopologyTable`). Training is the simulated device: sleep the step's simulated
compute time, then take the real torch step (`TrainingLoop.step`), so the update lands
when the device would have finished it.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
import trio.testing

from lab.simulation.config import SimConfig, SimResult, accuracy_task
from lab.simulation.links import LinkTransport
from lab.simulation.network import Profile
from lab.simulation.topologies import Partial, TopologyTable, make_topology
from murmur.node.averaging.averager import Averager
from murmur.node.averaging.factory import build_averager
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.rules import make_rule
from murmur.node.learn.runtime import Runtime
from murmur.node.net.transport import MemoryNetwork

SIMULATED = Runtime.simulated()


def _stream(seed: int, peer_id: str, purpose: str) -> random.Random:
    """A random stream of one peer's for one purpose: one task draws from it at any simulated instant."""
    return random.Random(f"{seed}/{peer_id}/{purpose}")


@dataclass
class _Peer:
    peer_id: str
    profile: Profile
    rng: random.Random  # topology moves: joining, its shuffles and its answers to others' shuffles
    loop: TrainingLoop
    transport: LinkTransport
    averager: Averager
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    ready: bool = False  # trains (initial peers) or has finished state sync (newcomers)


class GossipSimulation:
    """A swarm of real averagers in simulated time; `run()` returns the curves.

    Raises `ValueError` for the `allreduce` topology (see `simulate_allreduce`).
    """

    def __init__(self, config: SimConfig) -> None:
        if config.topology == "allreduce":
            raise ValueError("use simulate_allreduce for the all-reduce baseline")
        self.config = config
        self.task = accuracy_task(config.task)
        self.network = MemoryNetwork()
        self.peers: dict[str, _Peer] = {}
        self.topology = make_topology(config.topology, config.view_size, config.shuffle_length)
        # Separate streams, so every topology of one seed sees the same machines and churn.
        self._profiles = random.Random(config.seed)
        self._churn_rng = random.Random(config.seed + 1)
        self._eval_rng = random.Random(config.seed + 2)
        self._created = 0
        self._exchange_s: list[float] = []
        self.result = SimResult(config)

    def run(self) -> SimResult:
        """Run to the stop condition of `config`; blocks, taking real CPU time only.

        The same config gives the same result (only `wall_s` differs). Every draw comes
        from a seeded stream, and no stream is shared by tasks that may run at one
        simulated instant: each peer's averager, training and topology moves have their
        own, as do the swarm's machines, churn and evaluation sample. Trio runs the tasks
        it wakes at one instant in an order it randomizes on purpose; that order does
        not change the result unless two events touching the same peer fall due at
        exactly the same simulated time, which the continuous random delays (start
        offsets, jittered periods, latencies from positions) make vanishingly unlikely.
        """
        torch.set_num_threads(1)
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
        cfg = self.config
        index = self._created
        self._created += 1
        peer_id = f"p{index:05d}"
        loop = TrainingLoop(self.task, shard=index, rule=make_rule(cfg.weighting), runtime=SIMULATED)
        transport = LinkTransport(self.network, peer_id, self._link)
        averager = build_averager(
            transport, loop.replica, table=TopologyTable(peer_id, self.topology), rng=_stream(cfg.seed, peer_id, "averaging"),
            exchange_timeout=cfg.exchange_timeout, runtime=SIMULATED,
        )  # fmt: skip
        peer = _Peer(
            peer_id,
            cfg.network.draw(self._profiles),
            _stream(cfg.seed, peer_id, "topology"),
            loop,
            transport,
            averager,
        )
        self.peers[peer_id] = peer
        return peer

    async def _main(self) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for _ in range(self.config.peers):
                await tg.start(self._run_peer, self._new_peer(), False)
            if isinstance(self.topology, Partial):
                self.topology.random_start(random.Random(self.config.seed + 3))
            if self.config.network.churn > 0:
                tg.start_soon(self._churn)
            await self._observe()
            tg.cancel_scope.cancel()
        if isinstance(self.topology, Partial):
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
                    await peer.averager.state_sync.sync_from_swarm()
                peer.ready = True
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._train, peer)
                    tg.start_soon(peer.averager.run, self.config.average_every)
                    if isinstance(self.topology, Partial):
                        tg.start_soon(self._shuffle, peer)

    async def _train(self, peer: _Peer) -> None:
        """Sleep each step's simulated compute time, then take the real torch step."""
        step_s = self.config.network.step_s(peer.profile)
        # Peers do not start in lockstep, and no two steps fall due at one instant.
        await anyio.sleep(_stream(self.config.seed, peer.peer_id, "training").uniform(0, step_s))
        while True:
            await anyio.sleep(step_s)
            peer.loop.step()

    async def _shuffle(self, peer: _Peer) -> None:
        """Cyclon: every `shuffle_every` s swap descriptors with the oldest neighbour."""
        assert isinstance(self.topology, Partial)
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
        self.result.steps += peer.loop.replica.samples // self.task.batch_size
        self.result.samples += peer.loop.replica.samples
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
            accuracy = [self.peers[p].loop.evaluate().metrics["accuracy"] for p in sample if self.peers[p].ready]
            if result.record(t, accuracy, consensus_distance([p.loop for p in ready]), len(self.peers)):
                return
            if time.perf_counter() - wall_start > cfg.max_wall_s:
                result.truncated = True
                return
            grid += 1


def consensus_distance(loops: Sequence[TrainingLoop]) -> float:
    """Mean squared L2 distance of the models' exchanged tensors from their average."""
    flat = torch.stack([torch.cat([t.flatten() for t in tr.replica.snapshot().state.values()]) for tr in loops])
    return float(((flat - flat.mean(dim=0)) ** 2).sum(dim=1).mean())
