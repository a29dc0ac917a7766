"""Log output of a node: one readable line per record, or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TextIO

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
