"""The node's Ed25519 identity, created on first run and kept in the data dir."""

from __future__ import annotations

import os
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

KEY_FILE = "identity.key"


class IdentityError(Exception):
    """The key file exists but cannot be used (wrong size or permissions)."""


def load_or_create_identity(data_dir: Path) -> KeyPair:
    """Return the key pair stored in `data_dir`, creating it (mode 0600) if absent.

    The file holds the 32-byte Ed25519 seed; the same file always yields the same
    peer ID. Raises `IdentityError` if the file is not a 32-byte seed.
    """
    path = Path(data_dir) / KEY_FILE
    if path.exists():
        seed = path.read_bytes()
        if len(seed) != 32:
            raise IdentityError(f"{path}: expected a 32-byte Ed25519 seed, found {len(seed)} bytes")
        private = Ed25519PrivateKey.from_bytes(seed)
        return KeyPair(private, private.get_public_key())
    path.parent.mkdir(parents=True, exist_ok=True)
    key_pair = create_new_key_pair()
    seed = key_pair.private_key.to_bytes()
    # Write then rename so a crash never leaves a half-written identity behind.
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()
