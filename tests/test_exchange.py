"""The sans-IO `Exchange`: two state machines talk purely in bytes, and every rule break is typed and named."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.protocol.errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedMessage,
    ProtocolViolation,
    RemoteProtocolError,
    StreamClosed,
)
from murmur.protocol.exchange import (
    AVERAGE,
    CLOSED,
    DONE,
    GOSSIP,
    NEED_DATA,
    PEER_EXCHANGE,
    START,
    STATE_SYNC,
    Exchange,
    Flow,
    Role,
)
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
    PeerRecord,
    Refuse,
    StateReply,
    StateRequest,
    encode_frame,
)

I, R = Role.INITIATOR, Role.RESPONDER
MAX_PARAMS = 64
OFFER = Offer("run", "fp", 10.0)
PARAMS = Params("float32", "layout", 8)
AVERAGE_SCRIPT: list[tuple[Role, Message]] = [
    (I, OFFER),
    (R, Accept(5.0)),
    (I, PARAMS),
    (I, Chunk(b"i" * 8)),
    (R, PARAMS),
    (R, Chunk(b"r" * 8)),
    (R, Commit()),
    (I, Commit()),
]
AVERAGE_STATES = [START, "offered", "accepted", "initiator_sent", "initiator_sent", "both_sent", "both_sent", "responder_committed", DONE]
HELLO = Hello("run", "fp", ["/ip4/1.2.3.4/tcp/1"], [PeerRecord("p", ["/ip4/5.6.7.8/tcp/2"])])
PEER_EXCHANGE_SCRIPT = [(I, HELLO), (R, Hello("run", "fp", [], []))]
def test_an_empty_chunk_on_any_stream_is_a_violation_not_an_event() -> None:
    # Found by the live fuzzer: an empty Chunk once slipped through as a no-op event.
    for flow in (AVERAGE, PEER_EXCHANGE, STATE_SYNC):
        responder = Exchange(R, flow, max_params_bytes=MAX_PARAMS)
        responder.receive_data(encode_frame(Chunk(b"")))
        with pytest.raises(ProtocolViolation, match=f"{flow.name}: Chunk of 0 bytes from initiator, 0 announced bytes left"):
            responder.next_event()


STATE_SYNC_SCRIPT = [(I, StateRequest("run", "fp")), (R, StateReply(3.0)), (R, PARAMS), (R, Chunk(b"s" * 5)), (R, Chunk(b"s" * 3))]


def _pair(flow: Flow) -> dict[Role, Exchange]:
    return {role: Exchange(role, flow, max_params_bytes=MAX_PARAMS) for role in Role}


def _other(role: Role) -> Role:
    return R if role is I else I


def _deliver(sides: dict[Role, Exchange], sender: Role, message: Message) -> Message:
    """`sender` sends `message`; the other side receives all of it and returns the event."""
    data = sides[sender].send(message)
    receiver = sides[_other(sender)]
    receiver.receive_data(data)
    event = receiver.next_event()
    assert receiver.next_event() is NEED_DATA
    return event  # type: ignore[return-value]


def _run(flow: Flow, script: list[tuple[Role, Message]]) -> dict[Role, Exchange]:
    sides = _pair(flow)
    for sender, message in script:
        assert _deliver(sides, sender, message) == message
    return sides


# --- complete flows -------------------------------------------------------------


def test_average_exchange_completes_on_both_sides() -> None:
    sides = _pair(AVERAGE)
    for (sender, message), state in zip(AVERAGE_SCRIPT, AVERAGE_STATES[1:]):
        assert _deliver(sides, sender, message) == message
        assert sides[I].state == sides[R].state == state
    assert sides[I].finished and sides[R].finished
    assert sides[I].state == sides[R].state == DONE


def _feed_one_byte_at_a_time(script: list) -> dict:
    """Play `script` between a fresh pair, handing each frame over a byte at a time; return the sides."""
    sides = _pair(AVERAGE)
    for sender, message in script:
        data = sides[sender].send(message)
        receiver = sides[_other(sender)]
        for i in range(len(data) - 1):
            receiver.receive_data(data[i : i + 1])
            assert receiver.next_event() is NEED_DATA
        receiver.receive_data(data[-1:])
        assert receiver.next_event() == message
    return sides


def test_average_exchange_fed_one_byte_at_a_time() -> None:
    sides = _feed_one_byte_at_a_time(AVERAGE_SCRIPT)
    assert sides[I].state == sides[R].state == DONE


def test_fresh_work_in_offer_and_accept_fed_one_byte_at_a_time() -> None:
    sides = _feed_one_byte_at_a_time([(I, Offer("run", "fp", 10.0, "bfloat16", 4.0)), (R, Accept(5.0, 5.0))])
    assert sides[I].state == sides[R].state == "accepted"


def test_a_fresh_work_claim_above_the_offered_work_is_malformed() -> None:
    responder = Exchange(R, AVERAGE)
    body = b'{"run_id":"run","fingerprint":"fp","work":1,"wire_dtype":"float32","fresh":2.5}'
    responder.receive_data(len(body).to_bytes(4, "big") + bytes([Offer.TYPE]) + body)
    with pytest.raises(MalformedMessage, match="field 'fresh' must not exceed the stated work 1, got 2.5"):
        responder.next_event()


def test_several_frames_in_one_chunk_are_returned_in_order() -> None:
    responder = Exchange(R, STATE_SYNC)
    initiator = Exchange(I, STATE_SYNC, max_params_bytes=MAX_PARAMS)
    responder.receive_data(initiator.send(StateRequest("run", "fp")))
    assert isinstance(responder.next_event(), StateRequest)
    initiator.receive_data(responder.send(StateReply(3.0)) + responder.send(PARAMS) + responder.send(Chunk(b"s" * 8)))
    assert initiator.next_event() == StateReply(3.0)
    assert initiator.next_event() == PARAMS
    assert initiator.state == DONE and not initiator.finished  # the announced bytes are still due
    assert initiator.next_event() == Chunk(b"s" * 8)
    assert initiator.finished


def test_averaging_is_full_duplex_in_either_order_with_interleaved_chunks() -> None:
    sides = _run(AVERAGE, [(I, OFFER), (R, Accept(5.0)), (R, PARAMS), (R, Chunk(b"r" * 3))])
    assert sides[I].state == "responder_sent"
    for sender, message in [(I, PARAMS), (R, Chunk(b"r" * 5)), (I, Chunk(b"i" * 8))]:
        assert _deliver(sides, sender, message) == message
    assert sides[I].state == sides[R].state == "both_sent"
    _deliver(sides, R, Commit())
    _deliver(sides, I, Commit())
    assert sides[I].finished and sides[R].finished


DIGEST = Digest("run", "fp", 2, {"o1": 3})
DELTA = Delta("o1", 4, 0.25, 8.0, 8)


def test_gossip_swaps_any_number_of_deltas_each_way_full_duplex_and_ends_when_both_commit() -> None:
    sides = _run(GOSSIP, [(I, DIGEST), (R, Digest("run", "fp", 2, {}))])
    assert sides[I].state == sides[R].state == "swapping"
    for sender, message in [
        (I, DELTA), (R, DELTA), (I, Chunk(b"i" * 3)), (R, Chunk(b"r" * 8)),  # both streams at once
        (R, Commit()),  # the responder sent all it had while the initiator's bytes still flow
        (I, Chunk(b"i" * 5)), (I, Delta("o2", 1, 1.0, 0.0, 8)), (I, Chunk(b"j" * 8)),
    ]:
        assert _deliver(sides, sender, message) == message
    assert sides[I].state == sides[R].state == "responder_sent"
    _deliver(sides, I, Commit())
    assert sides[I].finished and sides[R].finished


def test_gossip_with_nothing_to_send_is_two_digests_and_two_commits() -> None:
    sides = _run(GOSSIP, [(I, DIGEST), (R, DIGEST), (I, Commit()), (R, Commit())])
    assert sides[I].state == sides[R].state == DONE


@pytest.mark.parametrize("answer", [Busy("busy"), Refuse("another task")])
def test_gossip_busy_or_refused_ends_closed(answer: Message) -> None:
    sides = _run(GOSSIP, [(I, DIGEST), (R, answer)])
    assert sides[I].state == sides[R].state == CLOSED


def test_gossip_breaks_are_violations() -> None:
    sides = _run(GOSSIP, [(I, DIGEST), (R, DIGEST), (I, DELTA)])
    sides[R].receive_data(encode_frame(Commit()))  # the delta's announced bytes are still owed
    with pytest.raises(ProtocolViolation, match="gossip: Commit from initiator with 8 parameter bytes still owed"):
        sides[R].next_event()
    sides = _run(GOSSIP, [(I, DIGEST), (R, DIGEST), (I, Commit())])
    sides[R].receive_data(encode_frame(DELTA))  # nothing may follow a side's commit
    with pytest.raises(ProtocolViolation, match="gossip: Delta from initiator not allowed in state 'initiator_sent'"):
        sides[R].next_event()
    sides = _run(GOSSIP, [(I, DIGEST)])
    sides[I].receive_data(encode_frame(DELTA))  # deltas only after both digests
    with pytest.raises(ProtocolViolation, match="gossip: Delta from responder not allowed in state 'digested'"):
        sides[I].next_event()


def test_a_delta_announcing_more_than_the_cap_is_too_large() -> None:
    sides = _run(GOSSIP, [(I, DIGEST), (R, DIGEST)])
    sides[R].receive_data(encode_frame(Delta("o", 1, 1.0, 0.0, MAX_PARAMS + 1)))
    with pytest.raises(FrameTooLarge, match=f"gossip: Delta announces {MAX_PARAMS + 1} bytes, limit {MAX_PARAMS}"):
        sides[R].next_event()


def test_peer_exchange_completes() -> None:
    sides = _run(PEER_EXCHANGE, PEER_EXCHANGE_SCRIPT)
    assert sides[I].state == sides[R].state == DONE


def test_peer_exchange_refused_ends_closed() -> None:
    sides = _run(PEER_EXCHANGE, [(I, HELLO), (R, Refuse("run mismatch"))])
    assert sides[I].state == sides[R].state == CLOSED


def test_state_sync_completes() -> None:
    sides = _run(STATE_SYNC, STATE_SYNC_SCRIPT)
    assert sides[I].state == sides[R].state == DONE


def test_state_sync_refused_ends_closed() -> None:
    sides = _run(STATE_SYNC, [(I, StateRequest("run", "fp")), (R, Refuse("fingerprint mismatch"))])
    assert sides[I].state == sides[R].state == CLOSED


@pytest.mark.parametrize("answer", [Busy("already in an exchange"), Refuse("task mismatch")])
def test_busy_or_refuse_ends_closed(answer: Message) -> None:
    sides = _run(AVERAGE, [(I, OFFER), (R, answer)])
    assert sides[I].state == sides[R].state == CLOSED
    assert sides[I].finished and sides[R].finished


# --- abort ----------------------------------------------------------------------

FLOWS = {"average": (AVERAGE, AVERAGE_SCRIPT), "peer": (PEER_EXCHANGE, PEER_EXCHANGE_SCRIPT), "sync": (STATE_SYNC, STATE_SYNC_SCRIPT)}
ABORT_CASES = [
    (flow_name, steps, aborter)
    for flow_name, (_, script) in FLOWS.items()
    for steps in range(len(script))  # every non-terminal state along the script
    for aborter in Role
]


@pytest.mark.parametrize(("flow_name", "steps", "aborter"), ABORT_CASES)
def test_abort_from_either_side_in_any_non_terminal_state_ends_closed(flow_name: str, steps: int, aborter: Role) -> None:
    flow, script = FLOWS[flow_name]
    sides = _run(flow, script[:steps])
    assert not sides[I].finished
    event = _deliver(sides, aborter, Abort("giving up"))
    assert event == Abort("giving up")
    assert sides[I].state == sides[R].state == CLOSED


def test_nothing_may_follow_an_abort() -> None:
    sides = _run(AVERAGE, [(I, OFFER), (R, Abort("bye"))])
    with pytest.raises(LocalProtocolError, match="Abort from initiator after the conversation ended"):
        sides[I].send(Abort("again"))
    sides[I].receive_data(encode_frame(Accept(1.0)))
    with pytest.raises(ProtocolViolation, match=r"Accept from responder after the conversation ended \(closed\)"):
        sides[I].next_event()


# --- rule breaks ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "steps", "message", "text"),
    [
        (R, 0, PARAMS, "average: Params from initiator not allowed in state 'start'"),
        (R, 0, Chunk(b"x"), "average: Chunk of 1 bytes from initiator, 0 announced bytes left"),
        (R, 3, Chunk(b"x" * 9), "average: Chunk of 9 bytes from initiator, 8 announced bytes left"),
        (R, 3, Chunk(b""), "average: Chunk of 0 bytes from initiator, 8 announced bytes left"),
        (R, 3, Commit(), "average: Commit from initiator with 8 parameter bytes still owed"),
        (I, 5, Commit(), "average: Commit from responder with 8 parameter bytes still owed"),
        (R, 5, Commit(), "average: Commit from initiator while 8 parameter bytes are still due to it"),
        (R, 6, Commit(), "average: Commit from initiator not allowed in state 'both_sent'"),
        (R, 0, Commit(), "average: Commit from initiator not allowed in state 'start'"),
        (R, 1, OFFER, "average: Offer from initiator not allowed in state 'offered'"),
        (R, 2, Commit(), "average: Commit from initiator not allowed in state 'accepted'"),
        (I, 0, Accept(1.0), "average: Accept from responder not allowed in state 'start'"),
        (I, 1, PARAMS, "average: Params from responder not allowed in state 'offered'"),
        (I, 2, Accept(1.0), "average: Accept from responder not allowed in state 'accepted'"),
        (I, 3, Commit(), "average: Commit from responder while 8 parameter bytes are still due to it"),
        (I, 4, Commit(), "average: Commit from responder not allowed in state 'initiator_sent'"),
        (I, 1, HELLO, "average: Hello from responder not allowed in state 'offered'"),
    ],
)
def test_message_out_of_order_is_a_violation_naming_message_role_and_state(
    role: Role, steps: int, message: Message, text: str
) -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT[:steps])
    sides[role].receive_data(encode_frame(message))
    with pytest.raises(ProtocolViolation, match=f"^{text}$"):
        sides[role].next_event()


def test_message_after_done_is_a_violation() -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT)
    sides[R].receive_data(encode_frame(Commit()))
    with pytest.raises(ProtocolViolation, match=r"Commit from initiator after the conversation ended \(done\)"):
        sides[R].next_event()


@pytest.mark.parametrize(
    ("role", "steps", "message", "text"),
    [
        (I, 0, PARAMS, "average: Params from initiator not allowed in state 'start'"),
        (I, 2, Chunk(b"x"), "average: Chunk of 1 bytes from initiator, 0 announced bytes left"),
        (R, 0, OFFER, "average: Offer from responder not allowed in state 'start'"),
        (R, 0, Accept(1.0), "average: Accept from responder not allowed in state 'start'"),
        (I, 1, OFFER, "average: Offer from initiator not allowed in state 'offered'"),
        (R, 1, PARAMS, "average: Params from responder not allowed in state 'offered'"),
        (I, 3, Commit(), "average: Commit from initiator with 8 parameter bytes still owed"),
        (I, 4, Commit(), "average: Commit from initiator not allowed in state 'initiator_sent'"),
        (I, 6, Commit(), "average: Commit from initiator not allowed in state 'both_sent'"),
        (I, 8, Commit(), r"average: Commit from initiator after the conversation ended \(done\)"),
    ],
)
def test_sending_out_of_turn_is_a_local_error(role: Role, steps: int, message: Message, text: str) -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT[:steps])
    state = sides[role].state
    with pytest.raises(LocalProtocolError, match=f"^{text}$"):
        sides[role].send(message)
    assert sides[role].state == state


def test_malformed_body_raises_malformed_message() -> None:
    responder = Exchange(R, AVERAGE)
    responder.receive_data(FRAME_HEADER.pack(2, Offer.TYPE) + b"{}")
    with pytest.raises(MalformedMessage, match="Offer: expected fields"):
        responder.next_event()


# --- frame size caps --------------------------------------------------------------


def test_params_announcing_more_than_the_cap_are_too_large() -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT[:2])
    sides[R].receive_data(encode_frame(Params("float32", "layout", MAX_PARAMS + 1)))
    with pytest.raises(FrameTooLarge, match=f"average: Params announces {MAX_PARAMS + 1} bytes, limit {MAX_PARAMS}"):
        sides[R].next_event()


def test_params_at_the_cap_are_accepted_and_counted_down_by_chunks() -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT[:2])
    for message in [Params("float32", "layout", MAX_PARAMS), Chunk(b"p" * (MAX_PARAMS - 1)), Chunk(b"p")]:
        assert _deliver(sides, I, message) == message
    assert sides[R].state == "initiator_sent"


def test_params_are_refused_entirely_without_a_cap() -> None:
    responder = Exchange(R, AVERAGE)  # max_params_bytes defaults to 0
    responder.receive_data(encode_frame(OFFER))
    responder.next_event()
    responder.send(Accept(1.0))
    responder.receive_data(encode_frame(Params("float32", "layout", 1)))
    with pytest.raises(FrameTooLarge, match="limit 0"):
        responder.next_event()


def test_oversized_chunk_frame_is_rejected_from_its_header_alone() -> None:
    responder = Exchange(R, AVERAGE, max_params_bytes=10 * MAX_CHUNK_BYTES)
    responder.receive_data(FRAME_HEADER.pack(MAX_CHUNK_BYTES + 1, Chunk.TYPE))
    with pytest.raises(FrameTooLarge, match=f"frame of type {Chunk.TYPE} announces {MAX_CHUNK_BYTES + 1} bytes, limit {MAX_CHUNK_BYTES}"):
        responder.next_event()


@pytest.mark.parametrize("type_code", [Offer.TYPE, Hello.TYPE, Abort.TYPE, 200])
def test_oversized_control_frame_is_rejected_from_its_header_alone(type_code: int) -> None:
    responder = Exchange(R, AVERAGE, max_params_bytes=10 * MAX_CONTROL_BYTES)
    responder.receive_data(FRAME_HEADER.pack(MAX_CONTROL_BYTES + 1, type_code))
    with pytest.raises(FrameTooLarge, match=f"announces {MAX_CONTROL_BYTES + 1} bytes, limit {MAX_CONTROL_BYTES}"):
        responder.next_event()


def test_control_frame_at_the_cap_waits_for_its_body() -> None:
    responder = Exchange(R, AVERAGE)
    responder.receive_data(FRAME_HEADER.pack(MAX_CONTROL_BYTES, Offer.TYPE))
    assert responder.next_event() is NEED_DATA


def test_partial_header_needs_data() -> None:
    responder = Exchange(R, AVERAGE)
    responder.receive_data(FRAME_HEADER.pack(MAX_CONTROL_BYTES + 1, Offer.TYPE)[:4])
    assert responder.next_event() is NEED_DATA


# --- end of stream ----------------------------------------------------------------


@pytest.mark.parametrize("steps", range(len(AVERAGE_SCRIPT)))
def test_eof_mid_conversation_raises_peer_closed(steps: int) -> None:
    sides = _run(AVERAGE, AVERAGE_SCRIPT[:steps])
    receiver = sides[_other(AVERAGE_SCRIPT[steps][0])]  # the side waiting for the next message
    receiver.receive_data(b"")
    with pytest.raises(StreamClosed, match=f"average: peer closed the stream in state '{AVERAGE_STATES[steps]}'"):
        receiver.next_event()


def test_eof_inside_a_frame_raises_peer_closed() -> None:
    responder = Exchange(R, AVERAGE)
    responder.receive_data(encode_frame(OFFER)[:-1])
    assert responder.next_event() is NEED_DATA
    responder.receive_data(b"")
    with pytest.raises(StreamClosed, match="state 'start'"):
        responder.next_event()


def test_complete_frame_before_eof_is_still_delivered() -> None:
    responder = Exchange(R, AVERAGE)
    responder.receive_data(encode_frame(OFFER))
    responder.receive_data(b"")
    assert responder.next_event() == OFFER
    with pytest.raises(StreamClosed, match="state 'offered'"):
        responder.next_event()


# --- fuzz -----------------------------------------------------------------------

frames = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([encode_frame(m) for _, m in AVERAGE_SCRIPT + PEER_EXCHANGE_SCRIPT + STATE_SYNC_SCRIPT]),
    st.sampled_from([encode_frame(m) for m in (Abort("x"), Busy("b"), Refuse("r"), Accept(1.0))]),
    st.builds(lambda n, t, body: FRAME_HEADER.pack(n, t) + body, st.integers(0, 2**32 - 1), st.integers(0, 255), st.binary(max_size=20)),
)

RESPONDER_ANSWERS: dict[type[Message], list[Message]] = {Offer: [Accept(2.0)], Params: [PARAMS, Chunk(b"r" * 8)]}


INITIATOR_FRAMES = [encode_frame(m) for sender, m in AVERAGE_SCRIPT if sender is I]


@settings(max_examples=300)
@given(st.integers(0, len(INITIATOR_FRAMES)), st.lists(frames, max_size=8), st.integers(1, 16), st.booleans())
def test_arbitrary_bytes_to_a_responder_raise_only_remote_protocol_errors(
    valid_prefix: int, chunks: list[bytes], step: int, eof: bool
) -> None:
    """A valid opening (so every state is reached) followed by arbitrary frames and bytes, in arbitrary chunks."""
    responder = Exchange(R, AVERAGE, max_params_bytes=MAX_PARAMS)
    data = b"".join(INITIATOR_FRAMES[:valid_prefix] + chunks)
    pieces = [data[i : i + step] for i in range(0, len(data), step)] + ([b""] if eof else [])
    allowed = {START: (Offer, Abort), "accepted": (Params, Abort), "both_sent": (Chunk, Abort), "responder_committed": (Commit, Abort)}
    try:
        for piece in pieces:
            responder.receive_data(piece)
            while not responder.finished:
                state = responder.state
                event = responder.next_event()
                if event is NEED_DATA:
                    break
                assert isinstance(event, allowed[state]), (state, event)
                for answer in RESPONDER_ANSWERS.get(type(event), []):
                    responder.send(answer)
                if isinstance(event, Chunk) and responder.state == "both_sent":
                    with contextlib.suppress(LocalProtocolError):  # once all the initiator's bytes are in
                        responder.send(Commit())
    except RemoteProtocolError:
        pass
    assert responder.state in {START, "offered", "accepted", "initiator_sent", "both_sent", "responder_committed", DONE, CLOSED}
