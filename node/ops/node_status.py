"""A node's status as one frozen type: what `Node.status()` returns and the data dir's status.json holds.

status.json is an interface: `murmur status`, the Docker HEALTHCHECK (`murmur status --health`),
the lab and operators' scripts read its keys. `NodeStatus.to_json` writes them, one per field
(the network's fields at the top level too, and the node's work under both `work` and `weight`);
`NodeStatus.from_json` reads them back and raises `NotAStatus` for anything else.
This module needs no torch, so reading a status stays cheap enough for a HEALTHCHECK.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types
import typing
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from murmur.node.averaging.outcome import Outcome


class NotAStatus(ValueError):
    """A document that is not a Murmur status; the message says why, in one line."""


@dataclass(frozen=True)
class NetworkStatus:
    """How the node is reached: AutoNAT's verdict and the kind of each connection (libp2p transports).

    The defaults are what a transport without NAT traversal reports.
    """

    reachability: str = "unknown"  # "public" | "private" | "unknown"
    reachability_reason: str = ""
    connections: Mapping[str, str] = field(default_factory=dict)  # peer ID -> "direct" | "relayed"
    relayed_via: Mapping[str, str] = field(default_factory=dict)  # relayed peer ID -> its relay's ID ("" if unknown)
    relays: tuple[str, ...] = ()  # this node's relayed addresses
    hole_punched: int = 0
    relayed_bytes: int = 0  # forwarded for others, as a relay

    def __post_init__(self) -> None:
        object.__setattr__(self, "relays", tuple(self.relays))  # a transport reports a list


@dataclass(frozen=True)
class NodeStatus:
    """One node's state at Unix time `t`. Counts are totals since the node started; fractions are of `uptime_s`."""

    peer_id: str
    addrs: tuple[str, ...]
    task: str
    device: str
    t: float
    phase: str  # "joining", "waiting" (ready, not yet told to start), "training"
    uptime_s: float
    samples: int
    samples_per_s: float
    work: float  # the work weight the model carries (samples or tokens, own and merged in)
    loss: float | None  # the latest step's; NaN before the first
    eval: Mapping[str, float]  # the latest held-out evaluation, by metric
    exchanges: Mapping[str, int]  # by `Result` (a `str`, so `exchanges.get(Result.MERGED, 0)` works)
    recent_exchanges: tuple[Outcome, ...]  # oldest first
    mean_exchange_s: float | None  # of the recent merged ones
    bytes_sent: int  # parameters sent in exchanges
    known_peers: int
    peers: tuple[str, ...]
    compute_fraction: float
    eval_fraction: float
    pid: int
    status_interval: float  # seconds between two writes of status.json
    bytes_in: int  # on every Murmur stream, not only parameters
    bytes_out: int
    partner_distance: float | None
    metrics_url: str | None
    dashboard_url: str | None
    network: NetworkStatus = field(default_factory=NetworkStatus)
    # Whether the node knows a live peer of its run now; when it does not, `alone_reason` says why
    # (each bootstrap peer's last outcome, or that a node without bootstrap peers waits to be joined).
    joined: bool = True
    alone_reason: str | None = None
    bootstrap: Mapping[str, str] = field(default_factory=dict)  # bootstrap address -> its last greeting's outcome
    bytes_per_merge: float | None = None  # parameter bytes sent per recent merged exchange
    model_bytes: int = 0  # the exchanged tensors' size in float32: what a merge sends uncompressed (0: not stated)
    trio_tasks: int | None = None  # tasks alive in the node's Trio run (None: not stated, or not on Trio)
    trio_task_names: Mapping[str, int] = field(default_factory=dict)  # the commonest of them, by name: what grows

    def to_dict(self) -> dict[str, Any]:
        """The status.json document as a dict (`to_json`'s content); floats may be NaN."""
        doc = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "network"}
        doc["weight"] = self.work  # the key every status.json has carried
        doc.update(_plain(self.network))
        return doc

    def to_json(self) -> str:
        """The text of status.json (NaN written as `NaN`, as Python's `json` reads back)."""
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeStatus:
        """The status that `to_json` wrote; raises `NotAStatus` for text that is not JSON or not a status.

        Every field is checked against its type; keys beyond the fields are ignored, and a
        missing `work` is read from `weight`, the key every version writes.
        """
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise NotAStatus(f"not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise NotAStatus(f"not a Murmur status file: a JSON {type(doc).__name__}, not an object")
        if "work" not in doc and "weight" in doc:
            doc = {**doc, "work": doc["weight"]}
        return dataclasses.replace(_read(cls, doc, skip=("network",)), network=_read(NetworkStatus, doc))


def current_trio_tasks() -> int | None:
    """How many tasks the calling thread's Trio run has alive now (a leak shows as growth); None outside a Trio run."""
    import trio  # here: a status reader (a HEALTHCHECK) need not import it

    try:
        return trio.lowlevel.current_statistics().tasks_living
    except RuntimeError:  # not inside trio.run: a user's thread, or another backend
        return None


def current_trio_task_names(top: int = 12) -> dict[str, int]:
    """The `top` commonest task names in the calling thread's Trio run, with their counts; {} outside a Trio run."""
    import trio

    try:
        pending = [trio.lowlevel.current_root_task()]
    except RuntimeError:
        return {}
    names: Counter[str] = Counter()
    while pending:  # the task tree: each task's nurseries hold its children
        task = pending.pop()
        names[task.name] += 1
        pending.extend(child for nursery in task.child_nurseries for child in nursery.child_tasks)
    return dict(names.most_common(top))


def _plain(value: Any) -> Any:
    """`value` as JSON-ready data: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _read(cls: type, doc: Mapping[str, Any], skip: tuple[str, ...] = ()) -> Any:
    """An instance of the dataclass `cls` from `doc`'s keys, each checked against its field's type."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in doc:
            values[f.name] = _convert(hints[f.name], doc[f.name], f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise NotAStatus(f"not a Murmur status file: no {f.name!r}")
    return cls(**values)


def _convert(kind: Any, value: Any, name: str) -> Any:
    """`value` as the type `kind` (the field types used here), or `NotAStatus` naming the field."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (kind,) = [a for a in args if a is not type(None)]
        return _convert(kind, value, name)
    if origin is tuple and isinstance(value, list):
        return tuple(_convert(args[0], v, name) for v in value)
    if origin is Mapping and isinstance(value, dict):
        return {_convert(args[0], k, name): _convert(args[1], v, name) for k, v in value.items()}
    if dataclasses.is_dataclass(kind) and isinstance(value, dict):
        return _read(kind, value)
    if isinstance(kind, type) and issubclass(kind, Enum):
        with contextlib.suppress(ValueError):
            return kind(value)
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind in (int, str) and isinstance(value, kind) and not isinstance(value, bool):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    raise NotAStatus(f"not a Murmur status file: {name!r} is {value!r}, not {getattr(kind, '__name__', kind)}")
