"""The node's web dashboard: `/`, `/api/status`, `/api/swarm` and `/metrics` on one HTTP port.

The node's event loop builds a JSON snapshot of itself and of the swarm as it knows it
(peer summaries from membership, its own bounded history, recent exchanges, traffic)
once per status interval and hands it to `DashboardState` by replacing one reference;
the HTTP server runs on a thread of its own (stdlib `ThreadingHTTPServer`) and only
ever reads those bytes, so serving a page never touches torch or the event loop.

The page (`node/ops/web/`, shipped as package data) is static, hand-written HTML, JS
and SVG with no CDN; it polls `/api/swarm` and renders every peer-supplied string with
`textContent`, never as markup. The server is read-only: GET and HEAD only.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from murmur.node.averaging.outcome import Outcome, Result
from murmur.node.ops.metrics import MetricsUnavailable
from murmur.node.ops.node_status import NodeStatus
from murmur.node.ops.status import _finite

HISTORY_POINTS = 600  # per peer: 10 minutes at one point per second
HISTORY_PEERS = 64  # peers whose history is kept (the newest seen win)
MAX_CLIENTS = 16  # connections served at once; more are closed unanswered (each holds a thread)
STATIC_FILES = {  # path -> (package file, content type): nothing else is served
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/chart.js": ("chart.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
SECURITY_HEADERS = {
    # Only our own script and style; no inline script, no frames, nothing fetched from elsewhere.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class DashboardUnavailable(MetricsUnavailable):
    """The HTTP endpoint could not be started (e.g. its port is taken); the message says where and why.

    A `MetricsUnavailable`: it is the same port, and `murmur run` reports either in one line.
    """


def is_local(host: str) -> bool:
    """Whether binding `host` keeps the endpoint on this machine (a loopback address or `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nonlocal_bind_warning(host: str) -> str | None:
    """The warning to print before binding `host`, or None for a loopback address."""
    if is_local(host):
        return None
    return (f"murmur: warning: the dashboard and metrics on {host} are reachable from other machines; "
            "they are read-only but show this node's peers, addresses and progress")


class SwarmHistory:
    """Points over time for each peer, bounded: `max_points` per peer, `max_peers` peers."""

    def __init__(self, max_points: int = HISTORY_POINTS, max_peers: int = HISTORY_PEERS) -> None:
        self.max_points = max_points
        self.max_peers = max_peers
        self._points: dict[str, deque[dict[str, Any]]] = {}
        self._stamps: dict[str, float] = {}

    def record(self, peer_id: str, point: dict[str, Any], stamp: float | None = None) -> None:
        """Append `point` to the peer's series; a new peer beyond `max_peers` evicts the longest-unseen one.

        `stamp` says when the data behind the point arrived: a point with the same stamp as
        the peer's previous one is the same data again and is not appended.
        """
        if stamp is not None and self._stamps.get(peer_id) == stamp:
            return
        if stamp is not None:
            self._stamps[peer_id] = stamp
        series = self._points.pop(peer_id, None)  # re-inserted last: dict order is recency
        if series is None:
            series = deque(maxlen=self.max_points)
            if len(self._points) >= self.max_peers:
                evicted = next(iter(self._points))
                del self._points[evicted]
                self._stamps.pop(evicted, None)
        series.append(point)
        self._points[peer_id] = series

    def keep_only(self, peer_ids: Iterable[str]) -> None:
        """Forget every peer not in `peer_ids` (those that left or timed out)."""
        live = set(peer_ids)
        for peer_id in [p for p in self._points if p not in live]:
            del self._points[peer_id]
        for peer_id in [p for p in self._stamps if p not in live]:
            del self._stamps[peer_id]

    def series(self) -> dict[str, list[dict[str, Any]]]:
        return {peer_id: list(points) for peer_id, points in self._points.items()}


def swarm_view(
    status: NodeStatus, summaries: Mapping[str, tuple[Any, float]], history: SwarmHistory,
    now: float, recent: Sequence[Outcome], traffic: Mapping[str, Mapping[str, int]],
    members: Iterable[str] = (),
) -> dict[str, Any]:
    """The swarm as this node knows it, as JSON-ready data; also records one history point per peer.

    `status` is the node's own `status()`; `summaries` maps live members to their latest
    `PeerSummary` and when it arrived (on the clock of `now`); `members` are all live
    members, listed with empty fields until a summary arrives (a peer may share none);
    `recent` are this node's latest exchange outcomes; `traffic` its bytes by direction
    and protocol. History values are rounded to 5 significant digits (the page draws
    them; the answer stays small).
    """
    me = status.peer_id
    metric, metric_value = next(iter(status.eval.items()), ("", None))
    own = {
        "peer_id": me, "self": True, "task": status.task, "samples_per_s": status.samples_per_s,
        "metric": metric, "metric_value": metric_value, "loss": status.loss, "work": status.work,
        "phase": status.phase, "idle": max(0.0, 1.0 - status.compute_fraction),
        "partners": recent_partners(recent), "age_s": 0.0,
    }  # fmt: skip
    peers = [own]
    for peer_id, (summary, seen) in sorted(summaries.items()):
        peers.append({"peer_id": peer_id, "self": False, **_summary_dict(summary), "age_s": max(0.0, now - seen),
                      "_seen": seen})
    for peer_id in sorted(set(members) - set(summaries) - {me}):
        peers.append({"peer_id": peer_id, "self": False, **_NO_SUMMARY, "age_s": None})
    t = status.t
    for peer in peers:
        if not peer["self"] and peer["age_s"] is None:
            continue  # nothing known to draw
        point = {"t": round(t, 2), "loss": _round(peer["loss"]), "metric": _round(peer["metric_value"]),
                 "samples_per_s": _round(peer["samples_per_s"]), "idle": _round(peer["idle"])}
        if peer["self"]:
            point.update(bytes_in=status.bytes_in, bytes_out=status.bytes_out)
        # A peer's point only when a new summary came: the same summary twice would draw a flat line.
        history.record(peer["peer_id"], point, peer.pop("_seen", None))
    history.keep_only(p["peer_id"] for p in peers)
    edges = sorted({tuple(sorted((p["peer_id"], partner))) for p in peers for partner in p["partners"]})
    return _finite({
        "self": me, "t": t, "metric": metric, "peers": peers, "history": history.series(),
        "joined": status.joined, "alone_reason": status.alone_reason,
        "bytes_per_merge": status.bytes_per_merge, "model_bytes": status.model_bytes,
        "exchanges": [asdict(o) for o in recent][-20:], "edges": [list(e) for e in edges],
        "traffic": {"in": dict(traffic.get("in", {})), "out": dict(traffic.get("out", {}))},
    })  # fmt: skip


_NO_SUMMARY = {"task": "", "samples_per_s": None, "metric": "", "metric_value": None, "loss": None, "work": None,
               "phase": "", "idle": None, "partners": []}  # fmt: skip


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.5g}")


def recent_partners(recent: Iterable[Outcome], limit: int = 8) -> list[str]:
    """The distinct partners of the latest merged exchanges (`recent` oldest first), newest last, at most `limit`."""
    partners: list[str] = []
    for outcome in recent:
        if outcome.result == Result.MERGED and outcome.partner:
            if outcome.partner in partners:
                partners.remove(outcome.partner)
            partners.append(outcome.partner)
    return partners[-limit:]


def _summary_dict(summary: Any) -> dict[str, Any]:
    return {
        "task": summary.task, "samples_per_s": summary.samples_per_s, "metric": summary.metric,
        "metric_value": summary.metric_value, "loss": summary.loss, "work": summary.work, "phase": summary.phase,
        "idle": summary.idle, "partners": list(summary.partners),
    }  # fmt: skip


class DashboardState:
    """The latest JSON documents the server hands out; written by the node, read by server threads.

    Each `publish` replaces whole byte strings (one reference each), so a reader sees
    either the previous snapshot or the new one, never a mix.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry
        self._documents: dict[str, bytes] = {"/api/status": b"{}", "/api/swarm": b"{}"}

    def publish(self, status: NodeStatus, swarm: Mapping[str, Any]) -> None:
        self._documents = {
            "/api/status": json.dumps(_finite(status.to_dict()), allow_nan=False).encode(),
            "/api/swarm": json.dumps(swarm, allow_nan=False).encode(),
        }

    def document(self, path: str) -> bytes | None:
        return self._documents.get(path)


def _static(name: str) -> bytes:
    return resources.files("murmur.node.ops").joinpath("web", name).read_bytes()


def _handler(state: DashboardState) -> type[BaseHTTPRequestHandler]:
    static = {path: (_static(name), kind) for path, (name, kind) in STATIC_FILES.items()}  # read once, at start

    class Handler(BaseHTTPRequestHandler):
        server_version = "murmur"
        sys_version = ""
        timeout = 10  # seconds a client may stall mid-request before its thread gives up on it

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._respond(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._respond(head=True)

        def _respond(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics" and state.registry is not None:
                body, kind = generate_latest(state.registry), CONTENT_TYPE_LATEST
            elif path in static:
                body, kind = static[path]
            elif (document := state.document(path)) is not None:
                body, kind = document, "application/json"
            else:
                body, kind, code = b"not found\n", "text/plain; charset=utf-8", 404
                self._send(code, kind, body, head)
                return
            self._send(200, kind, body, head)

        def _send(self, code: int, kind: str, body: bytes, head: bool) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in SECURITY_HEADERS.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # a poll per second would flood the log
            pass

    return Handler


class _BoundedServer(ThreadingHTTPServer):
    """A threading HTTP server that serves at most `max_clients` connections at once.

    A connection beyond the limit is closed at once, unanswered: a client that opens
    many connections and sends nothing costs at most `max_clients` threads, each freed
    by the handler's timeout.
    """

    daemon_threads = True  # a browser holding a connection open must not block shutdown

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_clients: int) -> None:
        self._slots = threading.BoundedSemaphore(max_clients)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def url_of(host: str, port: int, path: str = "/") -> str:
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


@asynccontextmanager
async def serve_dashboard(
    state: DashboardState, host: str, port: int, max_clients: int = MAX_CLIENTS
) -> AsyncIterator[str]:
    """Serve the dashboard, its JSON and `/metrics` at `host:port` (0: any free port); yields the base URL.

    The server runs on a daemon thread owned by this context and is shut down on exit,
    even when the context is cancelled; it serves at most `max_clients` connections at
    once (see `_BoundedServer`). Raises `DashboardUnavailable` if it cannot bind.
    """
    try:
        server = _BoundedServer((host, port), _handler(state), max_clients)
    except OSError as exc:
        raise DashboardUnavailable(f"cannot serve metrics and the dashboard on {host}:{port}: {exc.strerror or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="murmur-dashboard", daemon=True)
    thread.start()
    try:
        yield url_of(host, server.server_address[1])
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)  # waits up to its 0.5 s poll: off the event loop
        server.server_close()
        thread.join(timeout=5)
