"""Log output of a node: one readable line per record, or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import math
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from murmur.node.ops.node_status import NodeStatus

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# py-libp2p and its helpers log routine connection churn at WARNING and above.
NOISY_LOGGERS = ("libp2p", "multiaddr", "async_service")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object: time (UTC, ISO 8601), level, logger, message, peer,
    plus `exception` (the formatted traceback) when the record carries one."""

    def __init__(self, peer_id: str = "") -> None:
        super().__init__()
        self.peer_id = peer_id

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "peer": self.peer_id,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, peer_id: str = "", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every log record at `level` or above to `stream` (stderr), as `fmt` ("text" or "json").

    Text lines are tagged with the peer ID's last 8 characters; JSON lines carry the whole ID.
    Raises `ValueError` for an unknown level or format.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r} (choose from {', '.join(LOG_FORMATS)})")
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(peer_id))
    else:
        tag = f"[{peer_id[-8:]}]" if peer_id else ""
        handler.setFormatter(logging.Formatter(f"murmur{tag} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings become records too: a JSON log stays all JSON
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.CRITICAL)


class _AtDebug(logging.Handler):
    """Hands each record to the `murmur.libp2p` logger at DEBUG (after that logger's level check)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger("murmur.libp2p")
        if target.isEnabledFor(logging.DEBUG):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            target.handle(record)


def route_library_logs() -> None:
    """Log py-libp2p's records (connection churn it reports at WARNING and ERROR) at DEBUG under
    `murmur.libp2p`, so a program using `murmur.Peer` sees them only when it asks for DEBUG, not on
    stderr by default (without a handler, Python's last-resort handler prints them). Leaves a logger
    the program gave a handler alone. Idempotent."""
    for name in NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.handlers:  # the program's, or ours from an earlier call
            continue
        logger.addHandler(_AtDebug())
        logger.propagate = False


def _si(value: float) -> str:
    """A rate in 3 significant digits with a k/M suffix: 950, 12.3k, 1.20M."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def _g(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.3g}"


def _figures(status: NodeStatus, rate: float) -> str:
    parts = [f"{_si(rate)} samples/s", f"loss {_g(status.loss)}"]
    metric, value = next(((k, v) for k, v in status.eval.items() if k != "loss"), next(iter(status.eval.items()), ("", None)))
    if metric:
        parts.append(f"{metric} {_g(value)}")
    merges = status.exchanges.get("merged", 0)
    parts.append(f"{merges} merge{'' if merges == 1 else 's'}")
    parts.append(f"{status.known_peers} peer{'' if status.known_peers == 1 else 's'}" if status.joined else "alone")
    return ", ".join(parts)


def progress_line(status: NodeStatus, before: NodeStatus | None = None) -> str:
    """One short line on how training goes: samples/s since `before` (else since the start), the
    latest loss and held-out metric (accuracy rather than held-out loss), merges so far, and the
    peers known ("alone" when none). Kept under ~50 characters so a log line fits 80 columns."""
    rate = status.samples_per_s
    if before is not None and status.uptime_s > before.uptime_s:
        rate = (status.samples - before.samples) / (status.uptime_s - before.uptime_s)
    return _figures(status, max(0.0, rate))


def exit_summary(status: NodeStatus) -> str:
    """The line a node logs as it stops: what it did over its whole run."""
    return f"done after {status.uptime_s:.0f} s, {status.samples} samples: {_figures(status, status.samples_per_s)}"
