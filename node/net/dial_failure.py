"""Why a dial failed, in a few words a user can act on.

py-libp2p wraps the real cause several layers deep (a dial error holding a list of
per-address errors, each caused by a security or socket error). `dial_failure` walks
that chain and names the most specific cause it recognises: a peer that answered with
another identity ("peer ID mismatch: expected …, got …"), or the socket's own reason
("connection refused", "timed out", "name not resolved"). Anything it does not recognise
ends up as the innermost message, cut short, never as a nested repr.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

MAX_REASON = 100  # characters: one log line at 80-120 columns with the bootstrap address beside it
PEER_ID_MISMATCH = "peer ID mismatch"
# py-libp2p's Noise error: "peer id does not correspond to the received pubkey: remote_peer=X, remote_peer_id_from_pubkey=Y"
_MISMATCH = re.compile(r"remote_peer=(\w+), remote_peer_id_from_pubkey=(\w+)")


def _causes(exc: BaseException, depth: int = 0) -> Iterator[BaseException]:
    """`exc`, then its causes and grouped errors, depth first (bounded: chains can be cyclic)."""
    if depth > 16:
        return
    yield exc
    grouped = getattr(exc, "exceptions", None) or getattr(exc, "errors", None)
    if isinstance(grouped, (list, tuple)):
        for inner in grouped:
            if isinstance(inner, BaseException):
                yield from _causes(inner, depth + 1)
    inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if inner is not None:
        yield from _causes(inner, depth + 1)


def _socket_reason(exc: OSError) -> str:
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return (exc.strerror or str(exc) or type(exc).__name__).lower()


def short(text: str, limit: int = MAX_REASON) -> str:
    """`text` on one line, at most `limit` characters (an ellipsis marks a cut)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def dial_failure(exc: BaseException) -> str:
    """Why dialing or greeting a peer failed, in one short line.

    "peer ID mismatch: expected …<id tail>, got <full id>" when the address answered with another
    identity; otherwise "unreachable: <reason>" (the socket's or transport's). Never raises.
    """
    causes = list(_causes(exc))
    for cause in causes:
        found = _MISMATCH.search(str(cause))
        if found:
            return f"{PEER_ID_MISMATCH}: expected …{found.group(1)[-8:]}, got {found.group(2)}"
    for cause in causes:
        if (
            isinstance(cause, OSError)
            and not isinstance(cause, BaseExceptionGroup)
            and (cause.errno or isinstance(cause, socket.gaierror))
        ):
            return f"unreachable: {_socket_reason(cause)}"
    if isinstance(exc, TimeoutError):
        return "unreachable: no answer in time"
    innermost = causes[-1]
    return f"unreachable: {short(str(innermost) or type(innermost).__name__)}"
