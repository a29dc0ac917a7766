"""The protocol's error taxonomy: which failures are the peer's fault, and which of those earn a strike."""

import pytest

from murmur.protocol.errors import (
    OFFENCES,
    FrameTooLarge,
    LocalProtocolError,
    MalformedMessage,
    NonFiniteTensor,
    PeerAborted,
    ProtocolError,
    ProtocolViolation,
    RemoteProtocolError,
    StreamClosed,
    TensorMismatch,
)
from murmur.protocol.exchange import AVERAGE, Exchange, Role
from murmur.protocol.messages import Accept, encode_frame


def test_offences_are_what_only_a_broken_or_hostile_peer_sends() -> None:
    assert set(OFFENCES) == {FrameTooLarge, MalformedMessage, ProtocolViolation, TensorMismatch, NonFiniteTensor}
    assert all(issubclass(e, RemoteProtocolError) for e in OFFENCES)


@pytest.mark.parametrize("error", [PeerAborted("rejected your model"), StreamClosed("closed"), LocalProtocolError("ours")])
def test_giving_up_closing_and_our_own_mistakes_are_no_offence(error: ProtocolError) -> None:
    assert isinstance(error, ProtocolError) and not isinstance(error, OFFENCES)


def test_the_same_misstep_is_a_local_error_when_we_make_it_and_an_offence_when_the_peer_does() -> None:
    with pytest.raises(LocalProtocolError):
        Exchange(Role.INITIATOR, AVERAGE).send(Accept(1.0))  # only a responder accepts
    responder = Exchange(Role.RESPONDER, AVERAGE)
    responder.receive_data(encode_frame(Accept(1.0)))  # an initiator that accepts instead of offering
    with pytest.raises(ProtocolViolation) as raised:
        responder.next_event()
    assert isinstance(raised.value, OFFENCES)
