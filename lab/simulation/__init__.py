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
the simulated compute time and then runs the real torch step inline (`TrainingLoop.step`).

Topologies: `gossip` (random partner among all live peers: a full, ideal membership
list), `partial` (random partner from a bounded `PartialView` kept by Cyclon shuffles),
`ring` (a fixed ring: only the two ring neighbours), `allreduce` (ideal synchronous
data parallelism: every step averages all peers' gradients, communication is free,
each step waits for the slowest peer; no churn), and `alone` (no averaging at all: the
reference that shows what gossip adds). Peer-sampling shuffles are exchanged as direct
calls that take one link latency each way, not over the transport.

Modules: `network` (machines and links), `config` (`SimConfig`, `SimResult`), `links`
(`LinkTransport`), `topologies`, `gossip` (`GossipSimulation`), `allreduce`, and the
runner behind `python -m lab.simulation.cli`: `cli` and `report` (tables and plots).
"""

from __future__ import annotations

from lab.simulation.allreduce import simulate_allreduce
from lab.simulation.config import TOPOLOGIES, SimConfig, SimResult
from lab.simulation.gossip import GossipSimulation, consensus_distance
from lab.simulation.links import LinkTransport
from lab.simulation.network import NetworkModel, Profile

__all__ = [
    "TOPOLOGIES", "GossipSimulation", "LinkTransport", "NetworkModel", "Profile", "SimConfig", "SimResult",
    "consensus_distance", "simulate", "simulate_allreduce",
]  # fmt: skip


def simulate(config: SimConfig) -> SimResult:
    """Run `config` with the simulator its topology needs; the same config gives the same result."""
    if config.topology == "allreduce":
        return simulate_allreduce(config)
    return GossipSimulation(config).run()
