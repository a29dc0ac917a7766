"""A bounded partial view of the swarm, kept fresh by Cyclon-style peer sampling.

Instead of a full membership list, each peer holds at most `size` neighbour
descriptors. Every shuffle round a peer ages its descriptors, picks the oldest
neighbour Q, drops it, and sends Q a few random descriptors plus a fresh one of
itself; Q answers with a few of its own and both integrate what they got, refilling
empty slots first and then the slots of the descriptors they gave away (Voulgaris
et al., "CYCLON: inexpensive membership management for unstructured P2P overlays",
2005). Views stay bounded, the overlay stays connected and close to a random graph,
and a dead neighbour is dropped at the latest when it becomes the oldest.

Pure state, like `murmur.node.net.peers`: no I/O and no clock (ages count shuffle rounds), so
the simulator and the real node drive the same code. Decisions return a reason.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class Descriptor:
    """A neighbour: its peer ID, addresses, and how many shuffle rounds old the descriptor is."""

    peer_id: str
    addrs: list[str] = field(default_factory=list)
    age: int = 0

    def copy(self) -> Descriptor:
        return Descriptor(self.peer_id, list(self.addrs), self.age)


@dataclass(frozen=True)
class Admission:
    """What `PartialView.admit` did: whether the peer is now in the view, whom it displaced, and why."""

    admitted: bool
    evicted: str | None
    reason: str


@dataclass(frozen=True)
class ShuffleOffer:
    """The start of a shuffle: whom to send `entries` to (None if the view is empty), and why."""

    target: Descriptor | None
    entries: list[Descriptor]
    reason: str


class PartialView:
    """At most `size` neighbour descriptors of peer `self_id`, maintained by shuffles of `shuffle_length`."""

    def __init__(self, self_id: str, size: int, shuffle_length: int = 8, self_addrs: Sequence[str] = ()) -> None:
        if size < 1 or not 1 <= shuffle_length <= size:
            raise ValueError(
                f"need size >= 1 and 1 <= shuffle_length <= size, got size={size}, shuffle_length={shuffle_length}"
            )
        self.self_id = self_id
        self.size = size
        self.shuffle_length = shuffle_length
        self.self_addrs = list(self_addrs)
        self.entries: dict[str, Descriptor] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self.entries

    def ids(self) -> list[str]:
        return list(self.entries)

    def admit(self, peer_id: str, addrs: Sequence[str] = ()) -> Admission:
        """Put a peer we heard from directly into the view, as a fresh descriptor.

        A known peer is refreshed in place (age 0, new addresses if given). When the
        view is full, the oldest descriptor makes room (the first admitted among equals).
        """
        if peer_id == self.self_id:
            return Admission(False, None, "that is this peer itself")
        known = self.entries.get(peer_id)
        if known is not None:
            known.age = 0
            if addrs:
                known.addrs = list(addrs)
            return Admission(True, None, "already in the view: refreshed")
        evicted = None
        if len(self.entries) >= self.size:
            evicted = self._oldest().peer_id
            del self.entries[evicted]
        self.entries[peer_id] = Descriptor(peer_id, list(addrs), 0)
        if evicted is None:
            return Admission(True, None, f"room in the view ({len(self.entries)}/{self.size})")
        return Admission(True, evicted, f"view full ({self.size}): replaced the oldest descriptor, {evicted}")

    def remove(self, peer_id: str) -> bool:
        """Drop `peer_id` (it left or did not answer); return whether it was in the view."""
        return self.entries.pop(peer_id, None) is not None

    def sample(self, rng: random.Random, exclude: Iterable[str] = ()) -> tuple[Descriptor | None, str]:
        """A uniformly random neighbour not in `exclude`, and why (or why none)."""
        excluded = set(exclude)
        choices = [d for p, d in self.entries.items() if p not in excluded]
        if not choices:
            return None, "the view is empty" if not self.entries else "every neighbour in the view is excluded"
        return rng.choice(choices), f"random pick among {len(choices)} neighbours in the view"

    def start_shuffle(self, rng: random.Random) -> ShuffleOffer:
        """Begin a shuffle as initiator: age every descriptor, drop the oldest (the target), and pick what to send.

        The offer is a fresh descriptor of this peer plus up to `shuffle_length - 1`
        random others. If the target never answers, nothing else needs undoing: the
        dead neighbour is already gone. Pass the offer's entries to `finish_shuffle`.
        """
        if not self.entries:
            return ShuffleOffer(None, [], "the view is empty: nobody to shuffle with")
        for descriptor in self.entries.values():
            descriptor.age += 1
        target = self._oldest()
        del self.entries[target.peer_id]
        others = rng.sample(list(self.entries.values()), min(len(self.entries), self.shuffle_length - 1))
        offer = [Descriptor(self.self_id, list(self.self_addrs), 0)] + [d.copy() for d in others]
        return ShuffleOffer(target.copy(), offer, f"oldest neighbour (age {target.age}) of {len(self.entries) + 1}")

    def answer_shuffle(self, received: Sequence[Descriptor], rng: random.Random) -> list[Descriptor]:
        """Answer a shuffle as its target: reply with up to `shuffle_length` random descriptors, then integrate `received`."""
        reply = [d.copy() for d in rng.sample(list(self.entries.values()), min(len(self.entries), self.shuffle_length))]
        self._integrate(received, reply)
        return reply

    def finish_shuffle(self, reply: Sequence[Descriptor], sent: Sequence[Descriptor]) -> int:
        """End a shuffle as initiator with the target's `reply`; return how many descriptors were new."""
        return self._integrate(reply, sent)

    def _integrate(self, received: Sequence[Descriptor], sent: Sequence[Descriptor]) -> int:
        # Fill empty slots first, then overwrite the descriptors we just gave away, so the
        # view never grows past `size` and a shuffle moves descriptors rather than copying them.
        replaceable = [d.peer_id for d in sent if d.peer_id in self.entries]
        added = 0
        for descriptor in received:
            if descriptor.peer_id == self.self_id or descriptor.peer_id in self.entries:
                continue
            if len(self.entries) >= self.size:
                if not replaceable:
                    break
                del self.entries[replaceable.pop()]
            self.entries[descriptor.peer_id] = descriptor.copy()
            added += 1
        return added

    def _oldest(self) -> Descriptor:
        # max() keeps the first of equals, i.e. the earliest admitted: ties go first-in, first-out.
        return max(self.entries.values(), key=lambda d: d.age)
