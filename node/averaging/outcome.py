"""How an exchange or a state sync ended, with its reason: what the averager logs, counts and reports."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Result(StrEnum):
    """How an exchange or a state sync ended.

    A `str` whose value is what status.json, the logs and the Prometheus `outcome` label show,
    so a member compares, hashes and serialises as that string.
    """

    MERGED = "merged"  # an exchange: both sides merged
    BUSY = "busy"  # an exchange: one side was already in another
    REFUSED = "refused"  # an exchange: the responder declined (another task, too slow a link, ...)
    REJECTED = "rejected"  # an exchange: the partner's model failed screening, or the merge would not be finite
    FAILED = "failed"  # an exchange or a state sync: an error or a timeout
    SYNCED = "synced"  # a state sync: adopted a peer's model
    KEPT = "kept"  # a state sync: no peer was far enough ahead, the local model stays
    NO_PARTNER = "no-partner"  # an exchange or a state sync: nobody to ask


@dataclass(frozen=True)
class Outcome:
    """How one exchange or one state sync ended (`result`), with the reason.

    `cpu_s` is the CPU time this side spent on the exchange (encryption, codec, screening, merging);
    the rest of `duration_s` was spent waiting on the link or the partner.
    """

    result: Result
    partner: str
    reason: str
    duration_s: float = 0.0
    remote_share: float = 0.0
    bytes_sent: int = 0
    cpu_s: float = 0.0
