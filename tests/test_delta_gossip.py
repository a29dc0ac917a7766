"""Delta gossip between averagers over the in-memory transport, on simulated time (`averager_harness`)."""

from __future__ import annotations

import math
import struct

import anyio
import pytest
import torch
import trio.testing
from averager_harness import Peer, last, make_peer, running, settled, stall

from murmur.node.averaging.delta_gossip import GOSSIP_PROTOCOL, DeltaGossiper, DeltaLog, EncodedDelta
from murmur.node.averaging.outcome import Result
from murmur.node.learn.deltas import Compression, Published
from murmur.node.net.transport import ByteStream, MemoryNetwork
from murmur.protocol.exchange import GOSSIP, Exchange, Role
from murmur.protocol.messages import Chunk, Delta, Digest
from murmur.protocol.sparse import encode_sparse, quantize_sparse

pytestmark = pytest.mark.anyio
EXACT = Compression(1.0, 8)  # every entry: the tests compare models, not compression error
SPARSE = Compression(0.05, 2)


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


def _swarm(n: int, compression: Compression = EXACT) -> tuple[MemoryNetwork, list[Peer]]:
    net = MemoryNetwork()
    peers = [make_peer(net, f"peer{i}", i, compression=compression) for i in range(n)]
    start = peers[0].replica.model.state_dict()
    for p in peers:  # one common start, as state sync gives a swarm
        p.replica.model.load_state_dict(start)
        p.replica.deltas.reset(p.replica.exchanged)
        p.averager.log.budget = 1 << 30  # an EXACT delta outweighs the model: keep every one
    return net, peers


def _residual(p: Peer) -> dict[str, torch.Tensor]:
    return {n: t.detach() - p.replica.deltas.reference[n] for n, t in p.replica.exchanged.items()}


def _live(p: Peer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in p.replica.exchanged.items()}


async def test_an_exchange_swaps_fresh_deltas_and_models_then_differ_by_their_residuals_only() -> None:
    _, (a, b) = _swarm(2)
    async with running(a, b):
        a.know(b)
        b.know(a)
        a.steps(3)
        b.steps(2)
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
    assert outcome.result == Result.MERGED and outcome.reason == "received 1 deltas, sent 1"
    assert outcome.bytes_sent == len(a.averager.log.entries[0].data)
    assert last(b) == (Result.MERGED, "received 1 deltas, sent 1")
    assert a.replica.delta_versions() == b.replica.delta_versions()
    ra, rb = _residual(a), _residual(b)
    for name, xa in _live(a).items():
        torch.testing.assert_close(xa - _live(b)[name], ra[name] - rb[name], atol=1e-5, rtol=0)


async def test_deltas_reach_a_peer_that_never_met_their_origin() -> None:
    _, (a, b, c) = _swarm(3)
    async with running(a, b, c):
        a.know(b)
        b.know(c)
        a.steps(2)
        assert (await a.averager.exchange_with(b.id, b.transport.addresses())).result == Result.MERGED
        await settled(a, b)
        b.steps(1)
        outcome = await b.averager.exchange_with(c.id, c.transport.addresses())
        await settled(a, b, c)
    assert outcome.reason == "received 0 deltas, sent 2"  # a's, passed on, and b's own
    assert c.replica.delta_versions() == b.replica.delta_versions()
    assert a.replica.deltas.origin in c.replica.delta_versions()


async def test_a_second_exchange_sends_only_what_is_new() -> None:
    _, (a, b) = _swarm(2, SPARSE)
    async with running(a, b):
        a.steps(2)
        await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())  # no new work anywhere
        await settled(a, b)
        a.steps(1)
        third = await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
    assert (outcome.reason, outcome.bytes_sent) == ("received 0 deltas, sent 0", 0)
    assert third.reason == "received 0 deltas, sent 1"
    # 5 % of the entries at 2 bits: a small share of the float32 model.
    assert third.bytes_sent < 0.07 * 4 * a.replica.spec.numel


def test_the_log_passes_on_the_deltas_a_model_lacks_within_its_budget() -> None:
    log = DeltaLog(budget=25)
    for seq in (1, 2, 3):
        log.add(EncodedDelta("a", seq, 0.5, 1.0, b"x" * 10))
    assert [e.seq for e in log.entries] == [2, 3] and log.size == 20  # the oldest went first
    assert [e.seq for e in log.missing({"a": 2})] == [3] and log.missing({"a": 3}) == []
    assert [(e.origin, e.seq) for e in log.missing({"b": 9})] == [("a", 2), ("a", 3)]
    log.add(EncodedDelta("b", 1, 0.5, 1.0, b"y" * 40))  # the newest stays, even over the budget
    assert [(e.origin, e.seq) for e in log.entries] == [("b", 1)]


async def test_a_newcomer_syncs_the_model_with_the_deltas_it_holds() -> None:
    net, (a, b) = _swarm(2)
    newcomer = make_peer(net, "new", 9, compression=EXACT)
    async with running(a, b, newcomer):
        a.steps(2)
        await a.averager.exchange_with(b.id, b.transport.addresses())
        await settled(a, b)
        newcomer.know(b)
        outcome = await newcomer.averager.state_sync.sync_from_swarm()
        assert outcome.result == Result.SYNCED
        # Later exchanges send it nothing it already holds.
        exchange = await newcomer.averager.exchange_with(b.id, b.transport.addresses())
    assert newcomer.replica.delta_versions() == b.replica.delta_versions()
    assert exchange.reason == "received 0 deltas, sent 0"
    assert all(float(r.abs().max()) == 0 for r in _residual(newcomer).values())  # nothing of its own to publish


async def test_peers_whose_deltas_travel_in_other_bits_refuse_each_other() -> None:
    net = MemoryNetwork()
    a, b = (
        make_peer(net, "a", 0, compression=Compression(0.1, 2)),
        make_peer(net, "b", 1, compression=Compression(0.1, 4)),
    )
    async with running(a, b):
        a.steps(1)
        outcome = await a.averager.exchange_with(b.id, b.transport.addresses())
    assert (outcome.result, outcome.reason) == (Result.REFUSED, "deltas travel in 4 bits here, 2 there")


def _delta_bytes(spec, index: int, scale: float, value: float = 1.0) -> bytes:
    """A delta of one entry of the first tensor, at `index`; `scale` as sent (8 bits)."""
    first = spec.entries[0][0]
    state = {}
    for name, shape in spec.entries:
        indices = torch.tensor([0] if name == first else [], dtype=torch.int64)
        state[name] = quantize_sparse(indices, torch.full((len(indices),), value), 8)
    data = bytearray(b"".join(bytes(c) for c in encode_sparse(state, spec, 8)))
    data[4:8] = struct.pack("<f", scale) if scale is not None else data[4:8]
    data[8:12] = struct.pack("<I", index)
    return bytes(data)


async def _hostile(
    send, caplog, min_link_mbit: float = math.inf, steps: int = 2, holds: dict[str, int] | None = None
) -> tuple[Peer, dict, dict, object]:
    """`a` (8-bit deltas, holding the deltas `holds` names) initiates with a partner that answers its
    digest, then sends `send(a, digest)`'s messages."""
    net = MemoryNetwork()
    a = make_peer(net, "a", 0, compression=EXACT)
    for origin, seq in (holds or {}).items():
        a.replica.absorb(Published(origin, seq, {}, 0.5, 0.0))
    a.averager._min_link_mbit = min_link_mbit
    hostile = net.transport("hostile")

    async def serve(stream: ByteStream) -> None:
        ex = Exchange(Role.RESPONDER, GOSSIP, max_params_bytes=1 << 30)
        while not isinstance(digest := ex.next_event(), Digest):
            ex.receive_data(await stream.receive_some())
        await stream.send_all(ex.send(Digest(digest.run_id, digest.fingerprint, digest.bits, {})))
        for message in send(a, digest):
            await stream.send_all(ex.send(message))
        await anyio.sleep_forever()

    hostile.set_handler(GOSSIP_PROTOCOL, serve)
    async with running(a), hostile.run():
        a.steps(steps)
        before = _live(a)  # a knows no member: it keeps all of what it publishes (scale 1)
        outcome = await a.averager.exchange_with(hostile.peer_id, hostile.addresses())
    strikes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("strike")]
    return a, before, {"outcome": outcome, "strikes": strikes}, hostile.peer_id


def _one_delta(data: bytes, origin: str = "0123456789abcdef", seq: int = 1, scale: float = 0.5):
    return lambda a, digest: [Delta(origin, seq, scale, 1.0, len(data)), Chunk(data)]


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda spec: _delta_bytes(spec, 10**6, 1.0), "MalformedMessage: tensor '{first}': index 1000000 ≥"),
        (lambda spec: _delta_bytes(spec, 0, math.nan), "NonFiniteTensor: tensor '{first}'"),
        (
            lambda spec: _delta_bytes(spec, 0, 1.0, value=1e6),
            "ProtocolViolation: gossip: rejected delta 1 of 0123456789abcdef",
        ),
    ],
    ids=["index out of range", "NaN scale", "a huge delta"],
)
async def test_a_bad_delta_fails_the_exchange_earns_a_strike_and_never_touches_the_model(
    make, reason: str, caplog
) -> None:
    spec = make_peer(MemoryNetwork(), "x", 0, compression=EXACT).replica.spec
    a, before, seen, hostile = await _hostile(_one_delta(make(spec)), caplog)
    outcome = seen["outcome"]
    assert outcome.result == Result.FAILED and outcome.reason.startswith(reason.format(first=spec.entries[0][0]))
    assert len(seen["strikes"]) == 1 and hostile[-8:] in seen["strikes"][0]
    assert all(torch.equal(t, before[n]) for n, t in _live(a).items())
    assert a.averager.log.entries and all(
        p.origin == a.replica.deltas.origin for p in a.averager.log.entries
    )  # nothing passed on


async def test_a_delta_our_digest_said_we_hold_is_a_violation(caplog) -> None:
    def resend_what_we_hold(a: Peer, digest: Digest) -> list:
        assert digest.versions["0123456789abcdef"] == 5
        return _one_delta(_delta_bytes(a.replica.spec, 0, 1.0), seq=3)(a, digest)

    a, before, seen, _ = await _hostile(resend_what_we_hold, caplog, holds={"0123456789abcdef": 5})
    assert seen["outcome"].reason.startswith("ProtocolViolation: gossip: delta 3 of 0123456789abcdef, which our digest")
    assert len(seen["strikes"]) == 1
    assert all(torch.equal(t, before[n]) for n, t in _live(a).items())


async def test_an_announced_delta_extends_the_deadline_by_its_transfer_time_and_a_trickle_times_out(caplog) -> None:
    def trickle(a: Peer, digest: Digest) -> list:
        return [Delta("0123456789abcdef", 1, 0.5, 1.0, 10_000), Chunk(b"x" * 10)]  # then nothing more

    # No exchange measured the link yet: 10 kB at --min-link-mbit 0.08 (10 kB/s), with 25 % overhead, is 1.25 s.
    # (`a` has no progress to publish, so it sends nothing that would extend the deadline too.)
    a, before, seen, _ = await _hostile(trickle, caplog, min_link_mbit=0.08, steps=0)
    outcome = seen["outcome"]
    assert (outcome.result, outcome.reason) == (Result.FAILED, "timed out after 2.25s")
    assert outcome.duration_s == pytest.approx(1.0 + 1.25)
    assert seen["strikes"] == [] and all(torch.equal(t, before[n]) for n, t in _live(a).items())
    assert not a.averager.in_exchange


async def test_a_busy_gossiper_answers_at_once() -> None:
    net, (a, b, c) = _swarm(3)
    staller = net.transport("staller")
    staller.set_handler(GOSSIP_PROTOCOL, stall)
    async with running(a, b, c), staller.run():
        a.steps(1)
        b.steps(1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.averager.exchange_with, staller.peer_id, staller.addresses())
            with anyio.fail_after(1):
                while not b.averager.in_exchange:
                    await anyio.sleep(0.001)
            busy = await a.averager.exchange_with(b.id, b.transport.addresses())
            tg.cancel_scope.cancel()
    assert (busy.result, busy.reason) == (Result.BUSY, "already in an exchange")


async def test_a_replica_with_compression_gets_a_delta_gossiper_and_one_without_an_averager() -> None:
    net = MemoryNetwork()
    plain, compressed = make_peer(net, "plain", 0), make_peer(net, "compressed", 1, compression=SPARSE)
    assert type(plain.averager).__name__ == "Averager" and plain.averager.protocol == "/murmur/average/2.0.0"
    assert isinstance(compressed.averager, DeltaGossiper) and compressed.averager.protocol == GOSSIP_PROTOCOL
