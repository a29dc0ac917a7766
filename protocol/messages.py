"""Protocol messages: frozen dataclasses that validate on creation, and their frames.

A frame is `length:u32be | type:u8 | body`, where `length` counts the body only.
Control messages carry a UTF-8 JSON object body; `Chunk` carries raw parameter bytes
(see `murmur.protocol.codec`). Decoding checks every field's type and bound and raises
`MalformedMessage` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, ClassVar

from murmur.protocol.errors import MalformedMessage

FRAME_HEADER = struct.Struct("!IB")
MAX_CONTROL_BYTES = 64 * 1024
MAX_TEXT = 512
MAX_ADDRS = 16
MAX_PEERS_PER_HELLO = 64
MAX_WORK = 1e15
MAX_PARTNERS = 8  # recent averaging partners a peer summary names
MAX_RATE = 1e12  # samples/s: a bound for the type, far above any real peer
MAX_PARAMS_SIZE = 1 << 40  # a bound for the type; each receiver caps by its own model
MAX_CHUNK_BYTES = 1 << 20
MAX_LAYOUT_ENTRIES = 4096  # tensors a `Refuse` may describe (a frame's 64 KiB bounds it first)
MAX_ORIGINS = 256  # delta origins a `Digest` or `StateReply` may list
MAX_SEQ = 1 << 53  # a delta's sequence number: exact in JSON's doubles
WIRE_DTYPE_NAMES = ("float32", "bfloat16", "float16", "int8")
SPARSE_BITS = (2, 4, 8)  # the bit widths a delta's values may travel in (`murmur.protocol.sparse`)


def _check_text(name: str, value: Any, limit: int = MAX_TEXT) -> None:
    if not isinstance(value, str) or len(value) > limit:
        raise MalformedMessage(f"field {name!r} must be a string of at most {limit} characters")


def _check_work(name: str, value: Any) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    # Range first: a 400-digit JSON integer would overflow `math.isfinite`; NaN fails the range.
    if not ok or not 0 <= value <= MAX_WORK or not math.isfinite(value):
        raise MalformedMessage(f"field {name!r} must be a finite number in [0, {MAX_WORK:g}], got {value!r}")


def _check_wire_dtype(name: str, value: Any) -> None:
    if value not in WIRE_DTYPE_NAMES:
        raise MalformedMessage(f"field {name!r} must be one of {list(WIRE_DTYPE_NAMES)}, got {value!r}")


def _check_addrs(name: str, value: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_ADDRS:
        raise MalformedMessage(f"field {name!r} must be a list of at most {MAX_ADDRS} addresses")
    for addr in value:
        _check_text(name, addr, 256)


def _check_fresh(value: Any, work: Any) -> None:
    """`fresh` (work since the sender's anchor) is null, or a finite number in [0, work]."""
    if value is None:
        return
    _check_work("fresh", value)
    if value > work:
        raise MalformedMessage(f"field 'fresh' must not exceed the stated work {work!r}, got {value!r}")


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[int]
    # Fields a sender leaves out while they are None, so that its frames stay byte for byte what
    # peers from before the field expect; a decoder takes them as None when absent.
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    def body(self) -> bytes:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if not (k in self.OPTIONAL and v is None)}
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_body(cls, body: bytes) -> Message:
        try:
            fields = json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, huge ints, deep nesting
            raise MalformedMessage(f"{cls.__name__}: body is not UTF-8 JSON ({exc})") from None
        expected = {f.name for f in dataclasses.fields(cls)}
        required = expected - cls.OPTIONAL
        if not isinstance(fields, dict) or not required <= set(fields) <= expected:
            got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
            optional = f" (optional {sorted(cls.OPTIONAL)})" if cls.OPTIONAL else ""
            raise MalformedMessage(f"{cls.__name__}: expected fields {sorted(required)}{optional}, got {got}")
        try:
            return cls(**fields)
        except TypeError as exc:  # a nested field of the wrong shape
            raise MalformedMessage(f"{cls.__name__}: {exc}") from None


@dataclass(frozen=True)
class PeerRecord:
    """A peer's ID and dialable addresses, as shared by peer exchange."""

    peer_id: str
    addrs: list[str]

    def __post_init__(self) -> None:
        _check_text("peer_id", self.peer_id, 128)
        _check_addrs("addrs", self.addrs)


def _check_optional_number(name: str, value: Any, bound: float = MAX_RATE) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not -bound <= value <= bound or not math.isfinite(value):
        raise MalformedMessage(f"field {name!r} must be null or a finite number in [-{bound:g}, {bound:g}], got {value!r}")


@dataclass(frozen=True)
class PeerSummary:
    """What a peer says about itself for dashboards: peer-supplied text, shown as text only.

    Every field is bounded (short strings, finite numbers, at most `MAX_PARTNERS`
    partner IDs), so a summary adds at most ~1.5 KiB to a `Hello`.
    """

    task: str
    samples_per_s: float
    metric: str  # the name of the latest held-out metric ("" before the first evaluation)
    metric_value: float | None
    loss: float | None
    work: float
    phase: str
    idle: float  # fraction of wall time not spent computing, 0..1
    partners: list[str]  # recent averaging partners, newest last

    def __post_init__(self) -> None:
        _check_text("task", self.task, 64)
        _check_optional_number("samples_per_s", self.samples_per_s)
        if self.samples_per_s is None or self.samples_per_s < 0:
            raise MalformedMessage(f"field 'samples_per_s' must be a number >= 0, got {self.samples_per_s!r}")
        _check_text("metric", self.metric, 32)
        _check_optional_number("metric_value", self.metric_value)
        _check_optional_number("loss", self.loss)
        _check_work("work", self.work)
        _check_text("phase", self.phase, 16)
        _check_optional_number("idle", self.idle, 1.0)
        if self.idle is None or self.idle < 0:
            raise MalformedMessage(f"field 'idle' must be a number in [0, 1], got {self.idle!r}")
        if not isinstance(self.partners, list) or len(self.partners) > MAX_PARTNERS:
            raise MalformedMessage(f"field 'partners' must be a list of at most {MAX_PARTNERS} peer IDs")
        for partner in self.partners:
            _check_text("partners", partner, 128)


@dataclass(frozen=True)
class Hello(Message):
    """Peer exchange: who I am, which task I train, which peers I know."""

    TYPE: ClassVar[int] = 1
    run_id: str
    fingerprint: str
    addrs: list[str]
    peers: list[PeerRecord]
    leaving: bool = False
    summary: PeerSummary | None = None  # for dashboards; None from a peer that shares none

    def __post_init__(self) -> None:
        _check_text("run_id", self.run_id, 128)
        _check_text("fingerprint", self.fingerprint, 128)
        _check_addrs("addrs", self.addrs)
        if not isinstance(self.peers, list) or len(self.peers) > MAX_PEERS_PER_HELLO:
            raise MalformedMessage(f"field 'peers' must be a list of at most {MAX_PEERS_PER_HELLO} records")
        # JSON decoding yields dicts; normalise them into records (validated there).
        records = [p if isinstance(p, PeerRecord) else PeerRecord(**p) if isinstance(p, dict) else None for p in self.peers]
        if any(r is None for r in records):
            raise MalformedMessage("field 'peers' must hold {peer_id, addrs} objects")
        object.__setattr__(self, "peers", records)
        if not isinstance(self.leaving, bool):
            raise MalformedMessage("field 'leaving' must be a boolean")
        if isinstance(self.summary, dict):
            try:
                object.__setattr__(self, "summary", PeerSummary(**self.summary))
            except TypeError as exc:  # missing or unknown keys
                raise MalformedMessage(f"field 'summary': {exc}") from None
        elif self.summary is not None and not isinstance(self.summary, PeerSummary):
            raise MalformedMessage("field 'summary' must be null or a summary object")


@dataclass(frozen=True)
class Refuse(Message):
    """The responder will not take part, for a stated reason (e.g. task mismatch).

    On a model fingerprint mismatch it may add `layout`, its model's tensor names and shapes
    in order (the first ones, within a frame), so the refused peer can name what differs.
    """

    TYPE: ClassVar[int] = 2
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"layout"})
    reason: str
    layout: list | None = None  # [[name, [dim, ...]], ...]

    def __post_init__(self) -> None:
        _check_text("reason", self.reason)
        if self.layout is None:
            return
        if not isinstance(self.layout, list) or len(self.layout) > MAX_LAYOUT_ENTRIES:
            raise MalformedMessage(f"field 'layout' must be a list of at most {MAX_LAYOUT_ENTRIES} entries")
        for entry in self.layout:
            ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and len(entry[0]) <= MAX_TEXT
            if not ok or not isinstance(entry[1], list) or len(entry[1]) > 16 or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in entry[1]
            ):
                raise MalformedMessage("field 'layout' must hold [name, [dim, ...]] entries")


@dataclass(frozen=True)
class Offer(Message):
    """Averaging: the initiator proposes an exchange and states its work weight.

    `fresh`, the part of `work` the initiator trained since its model last merged, lets
    a staleness-aware rule discount the less fresh side; None (left out) states nothing.
    """

    TYPE: ClassVar[int] = 3
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"fresh"})
    run_id: str
    fingerprint: str
    work: float
    wire_dtype: str = "float32"  # both sides send their model in this dtype
    fresh: float | None = None

    def __post_init__(self) -> None:
        _check_text("run_id", self.run_id, 128)
        _check_text("fingerprint", self.fingerprint, 128)
        _check_work("work", self.work)
        _check_wire_dtype("wire_dtype", self.wire_dtype)
        _check_fresh(self.fresh, self.work)


@dataclass(frozen=True)
class Accept(Message):
    """Averaging: the responder agrees and states its own work weight (and `fresh`, as in `Offer`)."""

    TYPE: ClassVar[int] = 4
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"fresh"})
    work: float
    fresh: float | None = None

    def __post_init__(self) -> None:
        _check_work("work", self.work)
        _check_fresh(self.fresh, self.work)


@dataclass(frozen=True)
class Busy(Message):
    """Averaging: the responder is already in an exchange; try someone else."""

    TYPE: ClassVar[int] = 5
    reason: str

    def __post_init__(self) -> None:
        _check_text("reason", self.reason)


@dataclass(frozen=True)
class Params(Message):
    """Announces a model's parameters: wire dtype, layout digest and exact byte size.

    Exactly `size` bytes follow in `Chunk` frames (see `murmur.protocol.codec`); the receiver
    checks all three fields against its own model before it allocates anything.
    """

    TYPE: ClassVar[int] = 6
    dtype: str
    layout: str
    size: int

    def __post_init__(self) -> None:
        _check_text("dtype", self.dtype, 16)
        _check_text("layout", self.layout, 128)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 0 <= self.size <= MAX_PARAMS_SIZE:
            raise MalformedMessage(f"field 'size' must be an integer in [0, {MAX_PARAMS_SIZE}], got {self.size!r}")


@dataclass(frozen=True)
class Chunk(Message):
    """A piece of the parameter bytes announced by the last `Params` (raw, not JSON)."""

    TYPE: ClassVar[int] = 11
    payload: bytes

    def body(self) -> bytes:
        return self.payload

    @classmethod
    def from_body(cls, body: bytes) -> Chunk:
        return cls(payload=bytes(body))

    def __repr__(self) -> str:
        return f"Chunk({len(self.payload)} bytes)"


@dataclass(frozen=True)
class Commit(Message):
    """Averaging: the initiator has both models; both sides apply the merge."""

    TYPE: ClassVar[int] = 7


@dataclass(frozen=True)
class Abort(Message):
    """Either side gives up; nothing is applied."""

    TYPE: ClassVar[int] = 8
    reason: str

    def __post_init__(self) -> None:
        _check_text("reason", self.reason)


@dataclass(frozen=True)
class StateRequest(Message):
    """State sync: a newcomer asks for the current model of the given task."""

    TYPE: ClassVar[int] = 9
    run_id: str
    fingerprint: str
    wire_dtype: str = "float32"  # the dtype the newcomer wants the model in

    def __post_init__(self) -> None:
        _check_text("run_id", self.run_id, 128)
        _check_text("fingerprint", self.fingerprint, 128)
        _check_wire_dtype("wire_dtype", self.wire_dtype)


def _check_versions(value: Any) -> None:
    """`versions`: {origin: highest delta sequence number held}, bounded."""
    if not isinstance(value, dict) or len(value) > MAX_ORIGINS:
        raise MalformedMessage(f"field 'versions' must be an object of at most {MAX_ORIGINS} origins")
    for origin, seq in value.items():
        _check_text("versions", origin, 32)
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq <= MAX_SEQ:
            raise MalformedMessage(f"field 'versions' must map origins to integers in [1, {MAX_SEQ}], got {seq!r}")


@dataclass(frozen=True)
class StateReply(Message):
    """State sync: the work weight of the parameters that follow in a `Params`, and, from a
    swarm that gossips deltas, the deltas that model holds (`versions`, as in `Digest`)."""

    TYPE: ClassVar[int] = 10
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"versions"})
    work: float
    versions: dict[str, int] | None = None

    def __post_init__(self) -> None:
        _check_work("work", self.work)
        if self.versions is not None:
            _check_versions(self.versions)


@dataclass(frozen=True)
class Digest(Message):
    """Delta gossip: which task, the bits deltas travel in, and the deltas the sender's model holds
    (the highest sequence number per origin), so the other side sends only what it lacks."""

    TYPE: ClassVar[int] = 12
    run_id: str
    fingerprint: str
    bits: int
    versions: dict[str, int]

    def __post_init__(self) -> None:
        _check_text("run_id", self.run_id, 128)
        _check_text("fingerprint", self.fingerprint, 128)
        if self.bits not in SPARSE_BITS or isinstance(self.bits, bool):
            raise MalformedMessage(f"field 'bits' must be one of {list(SPARSE_BITS)}, got {self.bits!r}")
        _check_versions(self.versions)


@dataclass(frozen=True)
class Delta(Message):
    """Delta gossip: announces delta `seq` of `origin` (see `murmur.protocol.sparse`), which every
    model adds `scale` of, with the work that share carries; exactly `size` bytes follow in `Chunk`s."""

    TYPE: ClassVar[int] = 13
    origin: str
    seq: int
    scale: float
    work: float
    size: int

    def __post_init__(self) -> None:
        _check_text("origin", self.origin, 32)
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or not 0 < self.seq <= MAX_SEQ:
            raise MalformedMessage(f"field 'seq' must be an integer in [1, {MAX_SEQ}], got {self.seq!r}")
        ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
        if not ok or not 0 < self.scale <= 1:
            raise MalformedMessage(f"field 'scale' must be a number in (0, 1], got {self.scale!r}")
        _check_work("work", self.work)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or not 0 <= self.size <= MAX_PARAMS_SIZE:
            raise MalformedMessage(f"field 'size' must be an integer in [0, {MAX_PARAMS_SIZE}], got {self.size!r}")


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Refuse, Offer, Accept, Busy, Params, Chunk, Commit, Abort, StateRequest, StateReply, Digest, Delta)
}


def encode_frame(message: Message) -> bytes:
    """Return `message` as one frame."""
    body = message.body()
    return FRAME_HEADER.pack(len(body), message.TYPE) + body


def decode_body(type_code: int, body: bytes) -> Message:
    """Decode one frame body of type `type_code`; raises `MalformedMessage`."""
    cls = MESSAGE_TYPES.get(type_code)
    if cls is None:
        raise MalformedMessage(f"unknown message type {type_code}")
    return cls.from_body(body)
