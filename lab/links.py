"""Slow links for `murmur bench --link-mbit`: the caps, and one capped network namespace per peer.

`--link-mbit 20` caps every peer's link at 20 Mbit/s; `--link-mbit 100,50,20,10` gives each peer
its own cap, in peer order (volunteers differ in bandwidth as much as in compute). Each peer, or
synchronous rank, then runs in its own namespace of a `lab.netns.Network`, on a veth pair to
a shared bridge whose two ends a `tc tbf` token bucket caps (both directions); a transfer between
two peers therefore runs at the smaller of their caps. Needs root and iproute2; outside them
`links_unavailable_reason()` says why in one line.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator, Sequence

from lab.netns import Netns, Network, netns_unavailable_reason

NAMESPACE_PREFIX = "mb"  # namespaces are named mb<pid>-p<i>; netns removes a dead run's leftovers
LINK_DEVICE = "eth0"  # each peer namespace's capped veth end (what gloo binds to: GLOO_SOCKET_IFNAME)


class LinkSpecError(ValueError):
    """A `--link-mbit` value that names no usable caps; the message says what is wrong."""


class LinksUnavailable(RuntimeError):
    """This machine cannot build capped namespaces (not root, or no `ip`/`tc`); the message says which."""


def parse_link_mbit(text: str) -> list[float]:
    """Parse `--link-mbit`: one cap ("20") or one per peer ("100,50,20,10"), in Mbit/s.

    Raises `LinkSpecError` for an empty item, a non-number, or a cap that is not a positive, finite number.
    """
    items = [item.strip() for item in text.split(",")]
    caps = []
    for item in items:
        try:
            cap = float(item)
        except ValueError:
            raise LinkSpecError(f"--link-mbit: {item!r} is not a number of Mbit/s (give one cap, or one per peer: 100,50,20,10)") from None
        if not (cap > 0 and math.isfinite(cap)):
            raise LinkSpecError(f"--link-mbit: caps must be positive Mbit/s, got {item!r}")
        caps.append(cap)
    return caps


def caps_for(caps: Sequence[float], peers: int) -> list[float]:
    """Each of `peers` peers' cap: one cap for all, or exactly one per peer.

    Raises `LinkSpecError` when the number of caps is neither 1 nor `peers`.
    """
    if len(caps) == 1:
        return [float(caps[0])] * peers
    if len(caps) != peers:
        raise LinkSpecError(f"--link-mbit has {len(caps)} caps for {peers} peers: give one cap, or exactly one per peer")
    return [float(c) for c in caps]


def links_unavailable_reason() -> str | None:
    """None when this machine can build capped namespaces, else one line saying why not."""
    return netns_unavailable_reason()


@contextmanager
def peer_links(caps: Sequence[float]) -> Iterator[list[Netns]]:
    """One namespace per cap on a bridge, its link capped at that many Mbit/s; yields them in peer order.

    Everything is removed on exit, on an exception or a KeyboardInterrupt included: processes started
    through `Netns.popen` are killed by PID, then the namespaces (and their veth pairs) are deleted.
    Raises `NetnsError` when a namespace command fails (after removing what it had built).
    """
    with Network(prefix=NAMESPACE_PREFIX) as network:
        yield [network.host(f"p{i}", link_mbit=cap) for i, cap in enumerate(caps)]
