"""Keeping a public swarm's hostile peers out: allow-lists, a swarm secret, bans, stream limits.

`GuardedTransport` wraps any `Transport` and enforces, for every Murmur stream:

- an optional peer-ID allow-list (others are refused; on libp2p their connections are
  also closed as soon as they open, see `Libp2pTransport.on_connect`);
- an optional shared swarm secret: each stream starts with an HMAC-SHA256
  challenge-response bound to both peer IDs and the protocol, so only holders of the
  secret take part in Murmur's protocols (transport encryption stays Noise's job);
- the `BanList`: banned peers are refused in both directions;
- a cap on concurrent inbound streams per peer.

Each refusal is logged once with its reason.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from murmur.node.net.transport import (
    READ_CHUNK,
    ByteStream,
    ForwardingStream,
    ForwardingTransport,
    StreamHandler,
    Transport,
    TransportError,
)
from murmur.protocol.errors import RemoteProtocolError

log = logging.getLogger("murmur.security")
NONCE = 32
MAC = 32
AUTH_TIMEOUT = 5.0


class AuthenticationFailed(RemoteProtocolError):
    """The peer could not prove it holds the swarm secret."""


def load_allow_list(path: Path) -> set[str]:
    """Peer IDs from `path`, one per line; blank lines and `#` comments are ignored."""
    ids = {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()}
    return {i for i in ids if i}


def load_secret(path: Path) -> bytes:
    """The swarm secret: the file's bytes, stripped; raises `ValueError` if under 16 bytes."""
    secret = path.read_bytes().strip()
    if len(secret) < 16:
        raise ValueError(f"{path}: a swarm secret needs at least 16 bytes, found {len(secret)}")
    return secret


@dataclass
class BanList:
    """Strikes per peer; `strikes_to_ban` strikes within `window` seconds ban a peer for `ban_seconds`.

    Bans (not strikes) are saved to `path` so they survive restarts. Times are Unix times.
    """

    path: Path | None = None
    strikes_to_ban: int = 3
    window: float = 300.0
    ban_seconds: float = 600.0
    banned_until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.path and self.path.exists():
            try:
                self.banned_until = {str(k): float(v) for k, v in json.loads(self.path.read_text()).items()}
            except (ValueError, AttributeError) as exc:
                log.warning("ignoring unreadable ban list %s: %s", self.path, exc)

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        until = self.banned_until.get(peer_id)
        return until is not None and (time.time() if now is None else now) < until

    def strike(self, peer_id: str, reason: str, now: float | None = None) -> bool:
        """Record one offence; return True if it got the peer banned."""
        now = time.time() if now is None else now
        recent = [t for t in self._strikes.get(peer_id, []) if now - t < self.window] + [now]
        self._strikes[peer_id] = recent
        log.warning("strike %d/%d for %s: %s", len(recent), self.strikes_to_ban, peer_id[-8:], reason)
        if len(recent) < self.strikes_to_ban or self.is_banned(peer_id, now):
            return False
        self.banned_until[peer_id] = now + self.ban_seconds
        self._strikes.pop(peer_id, None)
        log.warning("banned %s for %.0fs after %d strikes (last: %s)", peer_id[-8:], self.ban_seconds, len(recent), reason)
        self._save(now)
        return True

    def _save(self, now: float) -> None:
        if self.path is None:
            return
        live = {p: t for p, t in self.banned_until.items() if t > now}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(live))
        os.replace(tmp, self.path)


class _Prefixed(ForwardingStream):
    """A stream whose first bytes were already read (during authentication)."""

    def __init__(self, inner: ByteStream, pending: bytes) -> None:
        super().__init__(inner)
        self._pending = pending

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        if self._pending:
            chunk, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
            return chunk
        return await self.inner.receive_some(max_bytes)


async def _read_exactly(stream: ByteStream, n: int) -> tuple[bytes, bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some()
        if not chunk:
            raise AuthenticationFailed("peer closed the stream during authentication")
        buf += chunk
    return bytes(buf[:n]), bytes(buf[n:])


def _mac(secret: bytes, role: bytes, nonce_i: bytes, nonce_r: bytes, initiator: str, responder: str, protocol: str) -> bytes:
    message = b"|".join([b"murmur-auth-v1", role, nonce_i, nonce_r, initiator.encode(), responder.encode(), protocol.encode()])
    return hmac.new(secret, message, hashlib.sha256).digest()


class GuardedTransport(ForwardingTransport):
    """Wraps a transport with the allow-list, swarm secret, ban list and per-peer stream cap."""

    def __init__(
        self,
        inner: Transport,
        *,
        allow: set[str] | None = None,
        secret: bytes | None = None,
        bans: BanList | None = None,
        max_streams_per_peer: int = 8,
    ) -> None:
        super().__init__(inner)
        self.allow = allow
        self.secret = secret
        self.bans = bans or BanList()
        self.max_streams_per_peer = max_streams_per_peer
        self._active: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()

    def refusal(self, peer_id: str) -> str | None:
        """Why streams with `peer_id` are refused, or None if they are allowed."""
        if self.allow is not None and peer_id not in self.allow:
            return "not on the allow-list"
        if self.bans.is_banned(peer_id):
            return "banned"
        return None

    def _log_once(self, peer_id: str, reason: str) -> None:
        if (peer_id, reason) not in self._logged:
            self._logged.add((peer_id, reason))
            log.warning("refused peer %s: %s", peer_id[-8:], reason)

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def guarded(stream: ByteStream) -> None:
            peer = stream.remote_peer
            reason = self.refusal(peer)
            if reason is None and self._active[peer] >= self.max_streams_per_peer:
                reason = f"more than {self.max_streams_per_peer} concurrent streams"
            if reason:
                self._log_once(peer, reason)
                await stream.reset()
                return
            self._active[peer] += 1
            try:
                if self.secret is not None:
                    try:
                        with anyio.fail_after(AUTH_TIMEOUT):
                            stream = await self._respond_auth(stream, protocol)
                    except (AuthenticationFailed, TransportError, TimeoutError) as exc:
                        self.bans.strike(peer, f"swarm-secret authentication failed: {exc or 'timed out'}")
                        await stream.reset()
                        return
                await handler(stream)
            finally:
                self._active[peer] -= 1
                if not self._active[peer]:
                    del self._active[peer]

        self.inner.set_handler(protocol, guarded)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        reason = self.refusal(peer_id)
        if reason:
            raise TransportError(f"will not open {protocol} to {peer_id[-8:]}: {reason}")
        stream = await self.inner.open_stream(peer_id, addrs, protocol)
        if self.secret is None:
            return stream
        try:
            with anyio.fail_after(AUTH_TIMEOUT):
                return await self._initiate_auth(stream, protocol)
        except (AuthenticationFailed, TimeoutError) as exc:
            await stream.reset()
            raise TransportError(f"{peer_id[-8:]} failed swarm-secret authentication: {exc or 'timed out'}") from exc
        except BaseException:
            await stream.reset()
            raise

    async def _initiate_auth(self, stream: ByteStream, protocol: str) -> ByteStream:
        assert self.secret is not None
        nonce_i = secrets.token_bytes(NONCE)
        await stream.send_all(nonce_i)
        reply, rest = await _read_exactly(stream, NONCE + MAC)
        nonce_r, mac_r = reply[:NONCE], reply[NONCE:]
        args = (nonce_i, nonce_r, self.peer_id, stream.remote_peer, protocol)
        if not hmac.compare_digest(mac_r, _mac(self.secret, b"R", *args)):
            raise AuthenticationFailed("responder's proof does not match our swarm secret")
        await stream.send_all(_mac(self.secret, b"I", *args))
        return _Prefixed(stream, rest)

    async def _respond_auth(self, stream: ByteStream, protocol: str) -> ByteStream:
        assert self.secret is not None
        nonce_i, _ = await _read_exactly(stream, NONCE)
        nonce_r = secrets.token_bytes(NONCE)
        args = (nonce_i, nonce_r, stream.remote_peer, self.peer_id, protocol)
        await stream.send_all(nonce_r + _mac(self.secret, b"R", *args))
        mac_i, rest = await _read_exactly(stream, MAC)
        if not hmac.compare_digest(mac_i, _mac(self.secret, b"I", *args)):
            raise AuthenticationFailed("initiator's proof does not match our swarm secret")
        return _Prefixed(stream, rest)
