"""How an exchange or a state sync ended, with its reason: what the averager logs, counts and reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Outcome:
    """How one exchange ended (merged, busy, refused, rejected, failed) or one state sync (synced, kept,
    failed, no-partner), with the reason."""

    result: str
    partner: str
    reason: str
    duration_s: float = 0.0
    remote_share: float = 0.0
    bytes_sent: int = 0
