"""A node's Prometheus metrics: bytes on its streams, and a per-node registry served over HTTP.

`CountingTransport` counts the bytes of every Murmur stream by protocol. `NodeMetrics`
holds one `CollectorRegistry` per node (never the process-global one, so several nodes
in one process do not collide) and is updated from the node's own status, on the
node's event loop; `murmur.node.ops.dashboard.serve_dashboard` serves it at `/metrics`, beside the dashboard.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, Info
from prometheus_client import Counter as PromCounter

from murmur.node.net.transport import READ_CHUNK, ByteStream, ForwardingStream, StreamHandler

if TYPE_CHECKING:
    from murmur.node.averaging.outcome import Outcome
    from murmur.node.net.transport import Transport
    from murmur.node.ops.node_status import NodeStatus

# Exchanges take milliseconds on loopback and up to the exchange timeout (10 s default) when a partner stalls.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MetricsUnavailable(RuntimeError):
    """The metrics endpoint could not be started (e.g. its port is taken); the message says where and why."""


class Traffic:
    """Bytes received and sent on Murmur streams, per protocol."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()


class _CountingStream(ForwardingStream):
    def __init__(self, inner: ByteStream, protocol: str, traffic: Traffic) -> None:
        super().__init__(inner)
        self._protocol = protocol
        self._traffic = traffic

    async def receive_some(self, max_bytes: int = READ_CHUNK) -> bytes:
        data = await self.inner.receive_some(max_bytes)
        self._traffic.received[self._protocol] += len(data)
        return data

    async def send_all(self, data: bytes) -> None:
        await self.inner.send_all(data)
        self._traffic.sent[self._protocol] += len(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class CountingTransport:
    """Wraps a `Transport`, counting the bytes of its streams into `traffic`.

    Only `set_handler` and `open_stream` are intercepted; every other attribute is the
    wrapped transport's, so whatever a transport offers beyond the interface still works.
    """

    def __init__(self, inner: Transport, traffic: Traffic) -> None:
        self._inner = inner
        self.traffic = traffic

    def set_handler(self, protocol: str, handler: StreamHandler) -> None:
        async def counted(stream: ByteStream) -> None:
            await handler(_CountingStream(stream, protocol, self.traffic))

        self._inner.set_handler(protocol, counted)

    async def open_stream(self, peer_id: str, addrs: Sequence[str], protocol: str) -> ByteStream:
        return _CountingStream(await self._inner.open_stream(peer_id, addrs, protocol), protocol, self.traffic)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class NodeMetrics:
    """Prometheus metrics of one node, in a registry of its own."""

    def __init__(self, peer_id: str, task: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Info("murmur_node", "This node's identity", registry=r).info({"peer_id": peer_id, "task": task})
        self.samples = PromCounter("murmur_samples", "Training samples processed by this node", registry=r)
        self.samples_per_s = Gauge(
            "murmur_samples_per_second", "Training samples per second since training started", registry=r
        )
        self.loss = Gauge("murmur_loss", "Training loss of the latest step", registry=r)
        self.eval = Gauge("murmur_eval", "Held-out evaluation of the latest evaluation", ["metric"], registry=r)
        self.exchanges = PromCounter("murmur_exchanges", "Averaging exchanges by outcome", ["outcome"], registry=r)
        self.duration = Histogram(
            "murmur_exchange_duration_seconds", "Duration of averaging exchanges by outcome", ["outcome"],
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self.received = PromCounter(
            "murmur_received_bytes", "Bytes received on Murmur streams", ["protocol"], registry=r
        )
        self.sent = PromCounter("murmur_sent_bytes", "Bytes sent on Murmur streams", ["protocol"], registry=r)
        self.known_peers = Gauge("murmur_known_peers", "Live peers in this node's membership table", registry=r)
        self.work = Gauge("murmur_work_weight", "Work weight (samples) carried by this node's model", registry=r)
        self.distance = Gauge(
            "murmur_partner_distance", "L2 distance between this node's parameters and its last accepted partner's, before merging",
            registry=r,
        )  # fmt: skip
        self.bytes_per_merge = Gauge(
            "murmur_bytes_per_merge", "Parameter bytes this node sent per recent merged exchange", registry=r
        )
        self.model_bytes = Gauge("murmur_model_bytes", "The exchanged tensors' size in float32", registry=r)
        self.reachability = Gauge(
            "murmur_reachability", "1 for AutoNAT's current verdict (public, private, unknown), 0 for the others",
            ["state"], registry=r,
        )  # fmt: skip
        self.connections = Gauge("murmur_connections", "Connected peers by connection kind", ["kind"], registry=r)
        self.relayed = PromCounter("murmur_relayed_bytes", "Bytes this node forwarded for others as a relay", registry=r)
        self._seen: dict[tuple[str, ...], float] = {}
        self._exchanges_seen = 0

    def _advance(self, counter: Any, key: tuple[str, ...], total: float) -> None:
        """Move a counter up to `total`, a running total kept by the node."""
        counter.inc(max(0.0, total - self._seen.get(key, 0.0)))
        self._seen[key] = max(total, self._seen.get(key, 0.0))

    def update(self, status: NodeStatus, recent: Sequence[Outcome], traffic: Traffic) -> None:
        """Bring every metric up to date with the node's `status()`, its recent exchanges and traffic.

        `recent` are the latest outcomes in order (the averager keeps 32): the exchanges
        counted since the previous update are the newest ones of it, and their durations
        are observed. More than 32 exchanges between two updates lose the oldest durations.
        """
        self._advance(self.samples, ("samples",), status.samples)
        self.samples_per_s.set(status.samples_per_s)
        self.loss.set(status.loss if status.loss is not None else math.nan)
        for name, value in status.eval.items():
            self.eval.labels(name).set(value)
        for outcome, total in status.exchanges.items():
            self._advance(self.exchanges.labels(outcome), ("exchanges", outcome), total)
        total = sum(status.exchanges.values())
        fresh = list(recent)[len(recent) - min(len(recent), total - self._exchanges_seen) :]
        self._exchanges_seen = total
        for outcome in fresh:
            self.duration.labels(outcome.result).observe(outcome.duration_s)
        for protocol, count in traffic.received.items():
            self._advance(self.received.labels(protocol), ("received", protocol), count)
        for protocol, count in traffic.sent.items():
            self._advance(self.sent.labels(protocol), ("sent", protocol), count)
        self.known_peers.set(status.known_peers)
        self.work.set(status.work)
        if status.partner_distance is not None:
            self.distance.set(status.partner_distance)
        if status.bytes_per_merge is not None:
            self.bytes_per_merge.set(status.bytes_per_merge)
        self.model_bytes.set(status.model_bytes)
        network = status.network
        for state in ("public", "private", "unknown"):
            self.reachability.labels(state).set(1 if network.reachability == state else 0)
        kinds = list(network.connections.values())
        for kind in ("direct", "relayed"):
            self.connections.labels(kind).set(kinds.count(kind))
        self._advance(self.relayed, ("relayed",), network.relayed_bytes)
