"""Build the node's libp2p host: TCP, Noise only, yamux.

py-libp2p's default host also accepts plaintext and secio sessions; Murmur offers
Noise alone, so an unencrypted or secio dial fails during negotiation.
"""

from __future__ import annotations

from collections.abc import Callable

import multiaddr
from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport


def build_host(
    key_pair: KeyPair,
    *,
    max_connections: int = 300,
    addrs_factory: Callable[[list[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]] | None = None,
) -> BasicHost:
    """Return an unstarted host with identity `key_pair` that speaks only Noise.

    At most `max_connections` connections in all, and 3 per peer. `addrs_factory`, if
    given, maps the listen addresses to the ones identify advertises (announced addresses).
    """
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    # Murmur chooses whom to dial itself: no auto-connecting to reach watermarks.
    limits = ConnectionConfig(
        max_connections=max_connections, max_connections_per_peer=3,
        min_connections=0, low_watermark=0, high_watermark=max_connections,
    )
    host = new_host(
        key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX", connection_config=limits,
        addrs_factory=addrs_factory,
    )
    assert isinstance(host, BasicHost)
    return host
