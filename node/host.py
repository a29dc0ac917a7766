"""Build the node's libp2p host: TCP, Noise only, yamux.

py-libp2p's default host also accepts plaintext and secio sessions; Murmur offers
Noise alone, so an unencrypted or secio dial fails during negotiation.
"""

from __future__ import annotations

from libp2p import new_host
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.host.basic_host import BasicHost
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport


def build_host(key_pair: KeyPair) -> BasicHost:
    """Return an unstarted host with identity `key_pair` that speaks only Noise."""
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise}, muxer_preference="YAMUX")
    assert isinstance(host, BasicHost)
    return host
