"""Typed errors of the wire protocol.

`RemoteProtocolError` means the peer broke the rules (drop or penalise it);
`LocalProtocolError` means we did (a bug on our side). Every message names the
field or state at fault so a log line explains the rejection on its own.
"""


class ProtocolError(Exception):
    """Base class of every protocol error."""


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol does not allow in this state."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid; the stream must be reset."""


class FrameTooLarge(RemoteProtocolError):
    """A frame header announced more bytes than the cap for its type."""


class MalformedMessage(RemoteProtocolError):
    """A frame's body does not decode to a valid message of its type."""


class ProtocolViolation(RemoteProtocolError):
    """A well-formed message arrived where the state machine does not allow it."""


class StreamClosed(RemoteProtocolError):
    """The remote side closed the stream before the conversation finished.

    Not `murmur.PeerClosed`, which an API user gets from a `murmur.Peer` that was closed.
    """


class TensorMismatch(RemoteProtocolError):
    """Received tensors do not match the local model (names, shapes, dtypes, sizes)."""


class NonFiniteTensor(RemoteProtocolError):
    """A received tensor holds NaN or Inf."""


class PeerAborted(RemoteProtocolError):
    """The peer sent `Abort`; its reason is the message."""


# Errors only a faulty or hostile peer causes; each is a strike (timeouts, resets and aborts are not).
OFFENCES = (FrameTooLarge, MalformedMessage, ProtocolViolation, TensorMismatch, NonFiniteTensor)
