"""10,000 random and mutated frames over real libp2p streams against a running, training node."""

import random
import resource
from pathlib import Path

import anyio
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from murmur.node.averaging.averager import AVERAGE_PROTOCOL
from murmur.node.averaging.outcome import Result
from murmur.node.averaging.state_sync import STATE_PROTOCOL
from murmur.node.learn.step import Pacing
from murmur.node.net.libp2p_transport import Libp2pTransport
from murmur.node.net.membership import PEERS_PROTOCOL
from murmur.node.net.security import BanList, GuardedTransport
from murmur.node.net.transport import TransportError
from murmur.node.ops.node import Node, NodeConfig
from murmur.protocol.messages import (
    FRAME_HEADER,
    Accept,
    Chunk,
    Commit,
    Hello,
    Offer,
    Params,
    StateRequest,
    encode_frame,
)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
FRAMES = 10_000
PER_STREAM = 5


def valid_frames(fingerprint: str) -> list[bytes]:
    return [
        encode_frame(Offer("digits", fingerprint, 100.0)),
        encode_frame(Accept(5.0)),
        encode_frame(Commit()),
        encode_frame(Params("float32", fingerprint, 64)),
        encode_frame(Chunk(b"\0" * 64)),
        encode_frame(StateRequest("digits", fingerprint)),
        encode_frame(Hello("digits", fingerprint, ["/ip4/127.0.0.1/tcp/1/p2p/x"], [], False)),
    ]


def mutate(rng: random.Random, frames: list[bytes]) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:  # random bytes
        return rng.randbytes(rng.randrange(0, 200))
    frame = bytearray(rng.choice(frames))
    if kind == 1:  # flip bytes
        for _ in range(rng.randrange(1, 6)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
    elif kind == 2:  # truncate
        frame = frame[: rng.randrange(len(frame))]
    elif kind == 3:  # lie about the length, up to 4 GiB
        frame[:5] = FRAME_HEADER.pack(rng.choice([0, 1, 2**16, 2**31, 2**32 - 1]), frame[4])
    # kind 4: a valid frame, usually out of order
    return bytes(frame)


async def test_node_survives_ten_thousand_hostile_frames(tmp_path: Path) -> None:
    bans = BanList(strikes_to_ban=10**9)  # keep the fuzzer talking so every decoder is exercised
    config = NodeConfig(data_dir=tmp_path / "node", listen=["/ip4/127.0.0.1/tcp/0"], checkpoint_every=1e9)
    node = Node(config, GuardedTransport(Libp2pTransport(create_new_key_pair()), bans=bans, max_streams_per_peer=64), bans, pacing=Pacing(step_time_ms=5))
    fuzzer = Libp2pTransport(create_new_key_pair())
    rng = random.Random(0)
    frames = valid_frames(node.replica.fingerprint)
    async with anyio.create_task_group() as tg, fuzzer.run(["/ip4/127.0.0.1/tcp/0"]):
        addrs = await tg.start(node.run)
        with anyio.fail_after(30):  # training has started
            while node.stats.steps == 0:
                await anyio.sleep(0.05)
        steps_before = node.stats.steps
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        sent = 0
        with anyio.fail_after(300):
            while sent < FRAMES:
                protocol = rng.choice([AVERAGE_PROTOCOL, PEERS_PROTOCOL, STATE_PROTOCOL])
                try:
                    stream = await fuzzer.open_stream(node.peer_id, addrs, protocol)
                    await stream.send_all(b"".join(mutate(rng, frames) for _ in range(PER_STREAM)))
                    with anyio.move_on_after(0.005):
                        await stream.receive_some()
                    await stream.reset()
                except TransportError:
                    pass  # the node reset the stream: exactly what it should do
                sent += PER_STREAM
        rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
        print(f"fuzz: {sent} frames, peak RSS grew {rss_growth_mb:.1f} MB, {node.averager.outcomes['failed']} exchanges refused")
        assert rss_growth_mb < 200, f"memory grew {rss_growth_mb:.0f} MB"
        assert node.stats.steps > steps_before  # it kept training throughout
        with anyio.fail_after(config.exchange_timeout + 5):  # never stuck in an exchange
            while node.averager.in_exchange:
                await anyio.sleep(0.01)
        assert node.averager.outcomes[Result.FAILED] > 100  # the hostile exchanges were seen and refused

        # Afterwards an honest peer still completes a well-formed exchange.
        honest = Node(NodeConfig(data_dir=tmp_path / "honest", listen=["/ip4/127.0.0.1/tcp/0"], checkpoint_every=1e9),
                      Libp2pTransport(create_new_key_pair()))
        async with honest.transport.run(honest.config.listen):
            for _ in range(3):
                honest.loop.step()
            with anyio.fail_after(30):
                for _ in range(50):  # the node may be busy in an exchange of its own: retry
                    outcome = await honest.averager.exchange_with(node.peer_id, addrs)
                    if outcome.result != Result.BUSY:
                        break
                    await anyio.sleep(0.05)
        assert outcome.result == Result.MERGED, outcome.reason
        tg.cancel_scope.cancel()
