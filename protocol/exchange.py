"""The sans-IO conversation state machine shared by Murmur's stream protocols.

An `Exchange` knows no sockets and no clock: feed it bytes with `receive_data`, pull
messages with `next_event` (a message, or `NEED_DATA`), and turn messages into bytes
with `send`. One transition table per protocol (`Flow`) says which message each side
may send or receive in each state; anything else raises `LocalProtocolError` (our
bug) or `ProtocolViolation` (the peer's), naming the message, role and state. Frame
sizes are checked from the header, before the body is buffered.

A `Params` (or `Delta`) announcement is followed by exactly its `size` bytes in `Chunk` frames,
which the machine counts per direction: a chunk nobody announced, one that overruns
the announcement, or any other message (`Abort` excepted) before the announced bytes
are complete is a violation. Averaging is full duplex: after `Accept`, both sides
stream their parameters at once, in either order; then each commits once it has
checked the other's model, the responder first, so neither applies a merge that the
other refused.

    ex = Exchange(Role.RESPONDER, AVERAGE)
    ex.receive_data(frame[:5]); assert ex.next_event() is NEED_DATA
    ex.receive_data(frame[5:]); assert isinstance(ex.next_event(), Offer)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from murmur.protocol.errors import FrameTooLarge, LocalProtocolError, ProtocolViolation, StreamClosed
from murmur.protocol.messages import (
    FRAME_HEADER,
    MAX_CHUNK_BYTES,
    MAX_CONTROL_BYTES,
    Abort,
    Accept,
    Busy,
    Chunk,
    Commit,
    Delta,
    Digest,
    Hello,
    Message,
    Offer,
    Params,
    Refuse,
    StateReply,
    StateRequest,
    decode_body,
    encode_frame,
)


class Role(enum.Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
START: Final = "start"
DONE: Final = "done"
CLOSED: Final = "closed"  # ended early: refused, busy or aborted
_TERMINAL = {DONE, CLOSED}

# (state, sender role, message type) -> next state
Table = dict[tuple[str, Role, type[Message]], str]
I, R = Role.INITIATOR, Role.RESPONDER


@dataclass(frozen=True)
class Flow:
    """A protocol's transition table, keyed by (state, sender, message type), and the messages a
    side may send while the other still owes announced bytes (`crossing`; `Abort` always may)."""

    name: str
    table: Table
    crossing: tuple[type[Message], ...] = (Params,)


AVERAGE = Flow(
    "average",
    {
        (START, I, Offer): "offered",
        ("offered", R, Accept): "accepted",
        ("offered", R, Busy): CLOSED,
        ("offered", R, Refuse): CLOSED,
        ("accepted", I, Params): "initiator_sent",
        ("accepted", R, Params): "responder_sent",
        ("initiator_sent", R, Params): "both_sent",
        ("responder_sent", I, Params): "both_sent",
        ("both_sent", R, Commit): "responder_committed",  # the initiator's model passed the responder's checks
        ("responder_committed", I, Commit): DONE,
    },
)

PEER_EXCHANGE = Flow(
    "peer-exchange",
    {
        (START, I, Hello): "greeted",
        ("greeted", R, Hello): DONE,
        ("greeted", R, Refuse): CLOSED,
    },
)

# Both sides state what they hold, then each streams the deltas the other lacks, in any number,
# and commits once it has sent them all; the conversation is done when both have committed.
GOSSIP = Flow(
    "gossip",
    {
        (START, I, Digest): "digested",
        ("digested", R, Digest): "swapping",
        ("digested", R, Busy): CLOSED,
        ("digested", R, Refuse): CLOSED,
        ("swapping", I, Delta): "swapping",
        ("swapping", R, Delta): "swapping",
        ("swapping", I, Commit): "initiator_sent",
        ("swapping", R, Commit): "responder_sent",
        ("initiator_sent", R, Delta): "initiator_sent",
        ("initiator_sent", R, Commit): DONE,
        ("responder_sent", I, Delta): "responder_sent",
        ("responder_sent", I, Commit): DONE,
    },
    crossing=(Delta, Commit),
)

STATE_SYNC = Flow(
    "state-sync",
    {
        (START, I, StateRequest): "requested",
        ("requested", R, StateReply): "replied",
        ("requested", R, Refuse): CLOSED,
        ("replied", R, Params): DONE,
    },
)


class Exchange:
    """One side of one conversation of `flow`, as a pure state machine.

    `max_params_bytes` caps the size a peer's `Params` or `Delta` may announce (set it to
    the local model's wire size, or the largest delta accepted); `Chunk` frames are capped at `MAX_CHUNK_BYTES` and every
    other frame at `MAX_CONTROL_BYTES`. Either side may send `Abort` at any time
    before the conversation ends.
    """

    def __init__(self, role: Role, flow: Flow, *, max_params_bytes: int = 0) -> None:
        self.role = role
        self.flow = flow
        self.state: str = START
        self._max_params_bytes = max_params_bytes
        self._buffer = bytearray()
        self._eof = False
        self._owed = {Role.INITIATOR: 0, Role.RESPONDER: 0}  # announced parameter bytes not yet sent

    @property
    def finished(self) -> bool:
        return self.state in _TERMINAL and not any(self._owed.values())

    def send(self, message: Message) -> bytes:
        """Advance the state for our `message` and return its frame.

        Raises `LocalProtocolError` if this role may not send it now.
        """
        self._advance(message, self.role, LocalProtocolError)
        return encode_frame(message)

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; `b""` means the peer closed its side."""
        if data:
            self._buffer += data
        else:
            self._eof = True

    def next_event(self) -> Message | _NeedData:
        """Return the next complete message from the peer, or `NEED_DATA`.

        Raises `FrameTooLarge` as soon as a header announces an oversized frame,
        `MalformedMessage` for an undecodable body, `ProtocolViolation` for a message
        not allowed now, and `StreamClosed` if the peer closed mid-conversation.
        """
        if len(self._buffer) < FRAME_HEADER.size:
            return self._need_data()
        length, type_code = FRAME_HEADER.unpack_from(self._buffer)
        limit = MAX_CHUNK_BYTES if type_code == Chunk.TYPE else MAX_CONTROL_BYTES
        if length > limit:
            raise FrameTooLarge(f"{self.flow.name}: frame of type {type_code} announces {length} bytes, limit {limit}")
        end = FRAME_HEADER.size + length
        if len(self._buffer) < end:
            return self._need_data()
        body = bytes(self._buffer[FRAME_HEADER.size : end])
        del self._buffer[:end]
        message = decode_body(type_code, body)
        if isinstance(message, _ANNOUNCING) and message.size > self._max_params_bytes:
            name = type(message).__name__
            raise FrameTooLarge(f"{self.flow.name}: {name} announces {message.size} bytes, limit {self._max_params_bytes}")
        self._advance(message, _peer_of(self.role), ProtocolViolation)
        return message

    def _need_data(self) -> _NeedData:
        if self._eof:
            raise StreamClosed(f"{self.flow.name}: peer closed the stream in state {self.state!r}")
        return NEED_DATA

    def _advance(self, message: Message, sender: Role, error: type[Exception]) -> None:
        owed = self._owed[sender]
        if isinstance(message, Chunk):
            if not 0 < len(message.payload) <= owed:  # an empty chunk would be a free no-op
                raise error(f"{self.flow.name}: Chunk of {len(message.payload)} bytes from {sender.value}, {owed} announced bytes left")
            self._owed[sender] -= len(message.payload)
            return
        if isinstance(message, Abort) and any(self._owed.values()):
            # Parameter bytes were still flowing (possibly after the last transition): stop them.
            self._owed = {Role.INITIATOR: 0, Role.RESPONDER: 0}
            self.state = CLOSED
            return
        if owed:
            raise error(f"{self.flow.name}: {type(message).__name__} from {sender.value} with {owed} parameter bytes still owed")
        other_owed = self._owed[_peer_of(sender)]
        if other_owed and not isinstance(message, (Abort, *self.flow.crossing)):
            raise error(f"{self.flow.name}: {type(message).__name__} from {sender.value} while {other_owed} parameter bytes are still due to it")
        self.state = self._transition(message, sender, error)
        if isinstance(message, _ANNOUNCING):
            self._owed[sender] = message.size

    def _transition(self, message: Message, sender: Role, error: type[Exception]) -> str:
        if self.state in _TERMINAL:
            raise error(f"{self.flow.name}: {type(message).__name__} from {sender.value} after the conversation ended ({self.state})")
        if isinstance(message, Abort):
            return CLOSED
        next_state = self.flow.table.get((self.state, sender, type(message)))
        if next_state is None:
            raise error(f"{self.flow.name}: {type(message).__name__} from {sender.value} not allowed in state {self.state!r}")
        return next_state


_ANNOUNCING = (Params, Delta)  # messages followed by exactly `size` bytes of `Chunk`s


def _peer_of(role: Role) -> Role:
    return Role.RESPONDER if role is Role.INITIATOR else Role.INITIATOR
