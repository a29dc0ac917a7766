"""Circuit relay v2 on loopback with real libp2p hosts: peers that cannot be dialed take part through a relay."""

import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
import torch
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.security.noise.io import NoiseTransportReadWriter

from lab.swarm import ForkedPeer, stop_processes
from murmur.node.averaging.averager import Averager
from murmur.node.averaging.factory import build_averager
from murmur.node.averaging.outcome import Result
from murmur.node.learn.loop import TrainingLoop
from murmur.node.learn.tasks import DigitsTask
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.membership import PEERS_PROTOCOL, Membership
from murmur.node.net.peers import PeerTable
from murmur.node.net.relay import circuit_address
from murmur.node.net.transport import TransportError
from murmur.node.ops.node_status import NodeStatus

pytestmark = pytest.mark.anyio


@dataclass
class Peer:
    transport: Libp2pTransport
    loop: TrainingLoop
    table: PeerTable
    averager: Averager
    membership: Membership

    @property
    def id(self) -> str:
        return self.transport.peer_id

    def connections(self, other: "Peer") -> list:
        return list(self.transport.host.get_network().get_connections(ID.from_base58(other.id)))


def make_peer(transport: Libp2pTransport, shard: int) -> Peer:
    loop = TrainingLoop(DigitsTask(), shard=shard)
    table = PeerTable(transport.peer_id, liveness_timeout=1e9)
    rng = random.Random(shard)
    averager = build_averager(transport, loop.replica, table=table, rng=rng)
    membership = Membership(transport, table, averager.identity, rng=rng, clock=lambda: 0.0)
    transport.set_handler(PEERS_PROTOCOL, membership.serve)
    return Peer(transport, loop, table, averager, membership)


@asynccontextmanager
async def relay_and_natted_peers() -> AsyncIterator[tuple[Peer, Peer, Peer]]:
    """A relay R (also a Murmur peer) and peers A, B that listen on no address at all."""
    async with AsyncExitStack() as stack:
        relay = make_peer(Libp2pTransport(create_new_key_pair(), relay_service=True), 0)
        await stack.enter_async_context(relay.transport.run(["/ip4/127.0.0.1/tcp/0"]))
        relay_addr = relay.transport.addresses()[0]
        natted = []
        for shard in (1, 2):
            peer = make_peer(Libp2pTransport(create_new_key_pair(), relays=[relay_addr]), shard)
            await stack.enter_async_context(peer.transport.run([]))  # waits for the first reservation attempt
            natted.append(peer)
        yield relay, natted[0], natted[1]


async def test_peers_behind_nat_exchange_models_through_a_relay() -> None:
    with anyio.fail_after(60):
        async with relay_and_natted_peers() as (relay, a, b):
            relay_addr = relay.transport.addresses()[0]
            for peer in (a, b):
                # Nothing listens: no direct inbound connection is possible, only the relay's circuit.
                assert peer.transport.host.get_transport_addrs() == []
                assert peer.transport.addresses() == [circuit_address(relay_addr, peer.id)]
            assert await a.membership.greet(relay.id, [relay_addr]) == "ok"
            assert await b.membership.greet(relay.id, [relay_addr]) == "ok"
            # B learns A, under its circuit address, from the relay's peer exchange.
            assert b.table.candidates.get(a.id) == a.transport.addresses()
            assert await b.membership.greet(a.id, b.table.candidates[a.id]) == "ok"
            for _ in range(3):
                a.loop.step()
                b.loop.step()
            before_a, before_b = a.loop.replica.snapshot().state, b.loop.replica.snapshot().state
            outcome = await b.averager.exchange_with(a.id, b.table.members[a.id].addrs)
            while a.averager.outcomes[Result.MERGED] < 1:  # the responder finishes a moment later
                await anyio.sleep(0.01)
            assert outcome.result == Result.MERGED, outcome.reason
            after_a, after_b = a.loop.replica.snapshot().state, b.loop.replica.snapshot().state
            assert any(not torch.equal(before_a[k], after_a[k]) for k in before_a)
            assert any(not torch.equal(before_b[k], after_b[k]) for k in before_b)
            # Every A-B connection is a circuit through R, secured by a Noise session between A and B
            # themselves (R forwards the ciphertext of that session).
            assert a.connections(b) and b.connections(a)
            for conn, remote in [(c, b) for c in a.connections(b)] + [(c, a) for c in b.connections(a)]:
                assert conn.get_connection_type() == ConnectionType.RELAYED
                session = conn.muxed_conn.secured_conn
                assert isinstance(session.conn, NoiseTransportReadWriter)
                assert session.remote_peer == ID.from_base58(remote.id)


async def test_connection_gate_closes_a_refused_peer_arriving_through_the_relay() -> None:
    with anyio.fail_after(30):
        async with relay_and_natted_peers() as (_relay, a, b):
            a.transport.gate_connections(lambda peer: "not on the allow-list" if peer == b.id else None)
            with pytest.raises(TransportError):
                await b.transport.open_stream(a.id, a.transport.addresses(), PEERS_PROTOCOL)
            while a.connections(b):  # the gate closes it a moment after it opened (bounded by fail_after)
                await anyio.sleep(0.05)


async def test_a_refused_reservation_is_logged_and_nothing_advertised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="murmur.relay")
    plain = Libp2pTransport(create_new_key_pair())  # does not run --relay-service
    async with plain.run(["/ip4/127.0.0.1/tcp/0"]):
        natted = Libp2pTransport(create_new_key_pair(), relays=[plain.addresses()[0]])
        with anyio.fail_after(20):
            async with natted.run([]):
                assert natted.addresses() == []
                other = Libp2pTransport(create_new_key_pair())
                async with other.run([]):
                    with pytest.raises(TransportError, match=f"through relay {plain.peer_id[-8:]}"):
                        circuit = circuit_address(plain.addresses()[0], natted.peer_id)
                        await other.open_stream(natted.peer_id, [circuit], PEERS_PROTOCOL)
    assert any(m.startswith(f"no reservation on relay {plain.addresses()[0]}") for m in caplog.messages)


def _start(data_dir: Path, *args: str) -> ForkedPeer:
    """`murmur run` forked from a server that imported everything once: ready in a second, not several."""
    data_dir.mkdir(parents=True)
    argv = ["run", "--data-dir", str(data_dir), "--addr-file", str(data_dir / "addrs.txt"),
            "--step-time", "20", "--average-every", "0.2", "--log-level", "DEBUG", *args]  # exchanges log at DEBUG
    return ForkedPeer(argv, data_dir / "log.txt")


def _wait_for_addrs(proc: ForkedPeer, data_dir: Path, timeout: float = 90.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, (data_dir / "log.txt").read_text()
        path = data_dir / "addrs.txt"
        if path.exists() and path.read_text().strip():
            return path.read_text().split()
        time.sleep(0.2)
    raise AssertionError(f"no address from {data_dir}: {(data_dir / 'log.txt').read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["trio"])
def test_murmur_run_peers_behind_a_relay_exchange_through_it(tmp_path: Path, anyio_backend: str) -> None:
    """`murmur run --relay-service` and two `murmur run --relay` peers that advertise only their circuits."""
    procs: list[ForkedPeer] = []
    try:
        relay = _start(tmp_path / "relay", "--listen", "/ip4/127.0.0.1/tcp/0", "--relay-service", "--duration", "60")
        procs.append(relay)
        relay_addr = _wait_for_addrs(relay, tmp_path / "relay")[0]
        for name in ("a", "b"):
            procs.append(_start(tmp_path / name, "--listen", "/ip4/127.0.0.1/tcp/0", "--relay", relay_addr,
                                "--bootstrap", relay_addr, "--duration", "8"))
        ids = {}
        for name, proc in zip(("a", "b"), procs[1:], strict=True):
            addrs = _wait_for_addrs(proc, tmp_path / name)
            circuits = [a for a in addrs if "/p2p-circuit/" in a]
            assert len(circuits) == 1 and circuits[0].startswith(relay_addr + "/p2p-circuit/p2p/")
            ids[name] = circuits[0].rsplit("/p2p/", 1)[1]
            out = (tmp_path / name / "log.txt").read_text()
            assert f"murmur: announcing {circuits[0]}" in out
        for proc in procs[1:]:
            proc.wait(timeout=120)
        logs = {name: (tmp_path / name / "log.txt").read_text() for name in ("a", "b")}
        # A and B only ever learn each other's circuit address, so they meet through the relay.
        pairs = (("a", "b"), ("b", "a"))
        assert any(f"connected to {ids[other][-8:]} through relay" in logs[name] for name, other in pairs)
        for name, other in pairs:
            assert f"exchange with {ids[other][-8:]}: merged" in logs[name], logs[name]
            assert NodeStatus.from_json((tmp_path / name / "status.json").read_text()).exchanges[Result.MERGED] >= 1
    finally:
        stop_processes(procs, timeout=30)
