"""The membership table: which live peers of our task we know, as pure state.

Only peers we have heard from directly (a hello or an exchange) are members;
peers rumoured by others are candidates until we reach them ourselves, so a dead peer
that others still list cannot come back. A member that goes silent becomes dormant:
it is redialed with exponential backoff for a while (so two halves of a healed
partition find each other again) and then forgotten. Every method takes `now`;
nothing here sleeps or does I/O.

With `view_size`, the members form a bounded `PartialView`: admitting a new member
to a full view drops the oldest one, so a node in a large swarm keeps a rotating
sample of it (fed by the peers rumoured in hellos) instead of a full list.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from murmur.node.net.partners import PartnerChoice, UniformPartners
from murmur.node.net.view import PartialView
from murmur.protocol.messages import MAX_PEERS_PER_HELLO, PeerRecord

MAX_CANDIDATES = 256


@dataclass
class PeerEntry:
    peer_id: str
    addrs: list[str]
    last_seen: float
    exchanges: int = 0  # completed with this peer
    exchange_rate: float | None = None  # bytes/s of those exchanges (moving average), for partner choices that weigh links (the lab's `link-speed`)


@dataclass
class _Backoff:
    retry_at: float
    delay: float


@dataclass
class PeerTable:
    """Members (verified live), candidates (rumoured) and dial backoff, by peer ID.

    `view_size` bounds the members (None: unbounded); `view` then holds the same peer IDs.
    """

    self_id: str
    liveness_timeout: float
    partners: PartnerChoice = field(default_factory=UniformPartners)
    members: dict[str, PeerEntry] = field(default_factory=dict)
    candidates: dict[str, list[str]] = field(default_factory=dict)
    dormant: dict[str, list[str]] = field(default_factory=dict)
    _backoff: dict[str, _Backoff] = field(default_factory=dict)
    # Members that answered an exchange with this node and are now swapping models with it (open exchanges per
    # peer): their bytes are arriving, so they are alive however long the transfer takes over their link, while
    # their hellos queue behind it; the exchange's own timeout bounds how long that lasts. An attempt the
    # partner never answered proves nothing, so a dead peer still expires while attempts on it time out.
    exchanging: Counter[str] = field(default_factory=Counter)
    view_size: int | None = None
    view: PartialView | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.view_size is not None:
            self.view = PartialView(self.self_id, self.view_size, shuffle_length=min(8, self.view_size))

    def observe(self, peer_id: str, addrs: list[str], now: float) -> bool:
        """Record direct contact with `peer_id`; return True if it is a new member."""
        if peer_id == self.self_id:
            return False
        self.candidates.pop(peer_id, None)
        self.dormant.pop(peer_id, None)
        self._backoff.pop(peer_id, None)
        entry = self.members.get(peer_id)
        if entry is None:
            if self.view is not None:
                admission = self.view.admit(peer_id, addrs)
                if admission.evicted is not None:  # it may come back later through peer exchange
                    self.members.pop(admission.evicted, None)
            self.members[peer_id] = PeerEntry(peer_id, list(addrs), now)
            return True
        entry.last_seen = now
        if addrs:
            entry.addrs = list(addrs)
        return False

    @contextlib.contextmanager
    def swapping_with(self, peer_id: str) -> Iterator[None]:
        """Hold `peer_id` a member while its model arrives (see `exchanging`)."""
        self.exchanging[peer_id] += 1
        try:
            yield
        finally:
            self.exchanging[peer_id] -= 1
            if not self.exchanging[peer_id]:
                del self.exchanging[peer_id]

    def has_record(self, peer_id: str) -> bool:
        """Whether `peer_id` is a member that completed an exchange with this node."""
        entry = self.members.get(peer_id)
        return entry is not None and entry.exchanges > 0

    def record_exchange(self, peer_id: str, nbytes: int, seconds: float, now: float) -> None:
        """A member completed an exchange of `nbytes` (each way) in `seconds`: it is alive, and its link that fast.

        Unlike `observe`, this never (re)admits a peer."""
        entry = self.members.get(peer_id)
        if entry is None:
            return
        entry.last_seen = now
        entry.exchanges += 1
        if nbytes > 0 and seconds > 0:
            rate = nbytes / seconds
            entry.exchange_rate = rate if entry.exchange_rate is None else entry.exchange_rate + 0.5 * (rate - entry.exchange_rate)

    def rumour(self, records: list[PeerRecord]) -> None:
        """Note peers another peer knows; they become candidates to contact."""
        for record in records:
            if record.peer_id == self.self_id or record.peer_id in self.members or not record.addrs:
                continue
            if len(self.candidates) < MAX_CANDIDATES:
                self.candidates[record.peer_id] = list(record.addrs)

    def dial_failed(self, peer_id: str, now: float, base_delay: float = 1.0, max_delay: float = 60.0) -> None:
        """Back off from `peer_id`: each consecutive failure doubles the wait.

        A dormant peer whose wait reaches `max_delay` is forgotten. A member's failures do
        not count: the liveness timeout judges members, and backoff starts when it goes
        dormant (counting every failed greet of a member in a partition would push its backoff
        to the cap within seconds, and the healed halves would never redial each other).
        """
        if peer_id in self.members:
            return
        self.candidates.pop(peer_id, None)
        previous = self._backoff.get(peer_id)
        delay = min(max_delay, previous.delay * 2) if previous else base_delay
        self._backoff[peer_id] = _Backoff(now + delay, delay)
        if delay >= max_delay:
            self.dormant.pop(peer_id, None)

    def may_dial(self, peer_id: str, now: float) -> bool:
        backoff = self._backoff.get(peer_id)
        return backoff is None or now >= backoff.retry_at

    def forget(self, peer_id: str) -> None:
        """Drop `peer_id` entirely (it said it is leaving): it will not be redialed."""
        self.members.pop(peer_id, None)
        if self.view is not None:
            self.view.remove(peer_id)
        self.candidates.pop(peer_id, None)
        self.dormant.pop(peer_id, None)

    def expire(self, now: float) -> list[str]:
        """Make members silent for longer than the liveness timeout, and not in an exchange, dormant; return their IDs."""
        dead = [p for p, e in self.members.items() if now - e.last_seen > self.liveness_timeout and not self.exchanging[p]]
        for peer_id in dead:
            entry = self.members.pop(peer_id)
            if self.view is not None:
                self.view.remove(peer_id)
            if len(self.dormant) < MAX_CANDIDATES:
                self.dormant[peer_id] = entry.addrs
                self.dial_failed(peer_id, now)
        return dead

    def to_contact(self, now: float, limit: int) -> list[tuple[str, list[str]]]:
        """Whom to greet this round: candidates, then dormant peers (both past their backoff), then the stalest members."""
        waiting = dict(self.candidates)
        for peer_id, addrs in self.dormant.items():  # a dormant peer also rumoured is greeted once
            waiting.setdefault(peer_id, addrs)
        picks = [(p, a) for p, a in waiting.items() if self.may_dial(p, now)][:limit]
        stale = sorted(self.members.values(), key=lambda e: e.last_seen)
        picks += [(e.peer_id, e.addrs) for e in stale[: max(0, limit - len(picks))]]
        return picks

    def select_partner(self, rng: random.Random, exclude: set[str]) -> tuple[PeerEntry | None, str]:
        """Pick a member not in `exclude` by this table's `partners` choice, and say why (or why none)."""
        choices = [e for p, e in self.members.items() if p not in exclude]
        if not choices:
            reason = "no known peers" if not self.members else "every known peer was tried this round"
            return None, reason
        return self.partners.pick(choices, rng)

    def records(self, rng: random.Random) -> list[PeerRecord]:
        """A random sample of members to share in a hello."""
        entries = list(self.members.values())
        sample = rng.sample(entries, min(len(entries), MAX_PEERS_PER_HELLO))
        return [PeerRecord(e.peer_id, e.addrs[:16]) for e in sample]
