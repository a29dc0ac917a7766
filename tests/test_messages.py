"""Protocol messages: every type round-trips through a frame, and decoding rejects bad input by field."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from murmur.protocol.errors import MalformedMessage, RemoteProtocolError
from murmur.protocol.messages import (
    FRAME_HEADER,
    MAX_ADDRS,
    MAX_ORIGINS,
    MAX_PARAMS_SIZE,
    MAX_PARTNERS,
    MAX_PEERS_PER_HELLO,
    MAX_TEXT,
    MAX_WORK,
    MESSAGE_TYPES,
    WIRE_DTYPE_NAMES,
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
    PeerSummary,
    Refuse,
    StateReply,
    StateRequest,
    decode_body,
    encode_frame,
)

PEER = PeerRecord("12D3KooWpeer", ["/ip4/127.0.0.1/tcp/4001"])

EXAMPLES: list[Message] = [
    Hello("run-1", "f" * 64, ["/ip4/10.0.0.1/tcp/1", "/ip6/::1/tcp/2"], [PEER, PeerRecord("other", [])], leaving=True),
    Hello("", "", [], []),
    Refuse("task mismatch: run 'a' != 'b'"),
    Refuse("task mismatch: model fingerprint a != b", layout=[["fc.weight", [10, 64]], ["fc.bias", [10]], ["scale", []]]),
    Offer("run-1", "abc", 1234.5),
    Offer("run-1", "abc", 0),
    Accept(7.0),
    Accept(MAX_WORK),
    Busy("already in an exchange"),
    Offer("run-1", "abc", 2.0, "bfloat16"),
    Params("bfloat16", "f" * 64, 123_456),
    Params("int8", "", 0),
    Chunk(b"\x00\x01\xffbinary payload"),
    Chunk(b""),
    Commit(),
    Abort("NonFiniteTensor: tensor 'w' holds NaN or Inf"),
    StateRequest("run-1", "abc"),
    StateRequest("run-1", "abc", "int8"),
    StateReply(0.25),
    StateReply(0.25, {"a1b2c3d4e5f60718": 3}),
    Digest("run-1", "abc", 2, {"a1b2c3d4e5f60718": 3, "ffeeddccbbaa9988": 1}),
    Digest("run-1", "abc", 8, {}),
    Delta("a1b2c3d4e5f60718", 4, 0.25, 96.0, 12_345),
]


def _frame_round_trip(message: Message) -> Message:
    frame = encode_frame(message)
    length, type_code = FRAME_HEADER.unpack_from(frame)
    assert type_code == message.TYPE
    assert length == len(frame) - FRAME_HEADER.size
    return decode_body(type_code, frame[FRAME_HEADER.size :])


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def _hello_fields(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = {"run_id": "r", "fingerprint": "f", "addrs": [], "peers": [], "leaving": False, "summary": None}
    fields.update(overrides)
    return fields


# --- round trips -------------------------------------------------------------------


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_message_round_trips_through_a_frame(message: Message) -> None:
    decoded = _frame_round_trip(message)
    assert type(decoded) is type(message)
    assert decoded == message


def test_hello_peers_decode_into_peer_records() -> None:
    decoded = _frame_round_trip(EXAMPLES[0])
    assert isinstance(decoded, Hello)
    assert all(isinstance(p, PeerRecord) for p in decoded.peers)
    assert decoded.peers[0] == PEER


def test_hello_accepts_dict_peers_on_construction() -> None:
    hello = Hello("r", "f", [], [{"peer_id": "p", "addrs": ["/a"]}])  # type: ignore[list-item]
    assert hello.peers == [PeerRecord("p", ["/a"])]


def test_a_state_reply_without_versions_is_byte_for_byte_what_older_peers_send() -> None:
    assert StateReply(0.25).body() == b'{"work":0.25}'


def test_chunk_body_is_the_raw_payload() -> None:
    frame = encode_frame(Chunk(b"abc"))
    assert frame == FRAME_HEADER.pack(3, Chunk.TYPE) + b"abc"
    assert repr(Chunk(b"abc")) == "Chunk(3 bytes)"


texts = st.text(max_size=40)
works = st.one_of(st.integers(0, int(MAX_WORK)), st.floats(0, MAX_WORK, allow_nan=False))
addr_lists = st.lists(st.text(max_size=30), max_size=MAX_ADDRS)
records = st.builds(PeerRecord, st.text(max_size=20), addr_lists)
messages = st.one_of(
    st.builds(Hello, texts, texts, addr_lists, st.lists(records, max_size=5), st.booleans()),
    st.builds(Refuse, st.text(max_size=MAX_TEXT)),
    st.builds(Offer, texts, texts, works, st.sampled_from(WIRE_DTYPE_NAMES)),
    st.builds(Accept, works),
    works.flatmap(lambda w: st.builds(Offer, texts, texts, st.just(w), st.sampled_from(WIRE_DTYPE_NAMES), st.floats(0, w))),
    works.flatmap(lambda w: st.builds(Accept, st.just(w), st.floats(0, w))),
    st.builds(Busy, texts),
    st.builds(Params, st.sampled_from(["float32", "x" * 16]), texts, st.integers(0, MAX_PARAMS_SIZE)),
    st.builds(Chunk, st.binary(max_size=64)),
    st.just(Commit()),
    st.builds(Abort, texts),
    st.builds(StateRequest, texts, texts, st.sampled_from(WIRE_DTYPE_NAMES)),
    st.builds(StateReply, works),
)


@given(messages)
def test_any_valid_message_round_trips(message: Message) -> None:
    assert _frame_round_trip(message) == message


# --- rejections, by field -------------------------------------------------------


@pytest.mark.parametrize(
    ("type_code", "body", "field"),
    [
        (Offer.TYPE, _body(run_id=5, fingerprint="f", work=1, wire_dtype="float32"), "run_id"),
        (Offer.TYPE, _body(run_id="r", fingerprint=None, work=1, wire_dtype="float32"), "fingerprint"),
        (Offer.TYPE, _body(run_id="r" * 129, fingerprint="f", work=1, wire_dtype="float32"), "run_id"),
        (Offer.TYPE, _body(run_id="r", fingerprint="f", work=1, wire_dtype="float64"), "wire_dtype"),
        (StateRequest.TYPE, _body(run_id="r", fingerprint="f" * 129, wire_dtype="float32"), "fingerprint"),
        (StateRequest.TYPE, _body(run_id="r", fingerprint="f", wire_dtype=["int8"]), "wire_dtype"),
        (Params.TYPE, _body(dtype="float32", layout="l", size=-1), "size"),
        (Params.TYPE, _body(dtype="float32", layout="l", size=1.5), "size"),
        (Params.TYPE, _body(dtype="float32", layout="l", size=True), "size"),
        (Params.TYPE, _body(dtype="float32", layout="l", size=2**41), "size"),
        (Params.TYPE, _body(dtype="x" * 17, layout="l", size=1), "dtype"),
        (Params.TYPE, _body(dtype="float32", layout=7, size=1), "layout"),
        (Refuse.TYPE, _body(reason="x" * (MAX_TEXT + 1)), "reason"),
        (Busy.TYPE, _body(reason=["not", "text"]), "reason"),
        (Abort.TYPE, _body(reason=3), "reason"),
        (Hello.TYPE, _body(**_hello_fields(addrs="/ip4/1")), "addrs"),
        (Hello.TYPE, _body(**_hello_fields(addrs=["/a"] * (MAX_ADDRS + 1))), "addrs"),
        (Hello.TYPE, _body(**_hello_fields(addrs=["x" * 257])), "addrs"),
        (Hello.TYPE, _body(**_hello_fields(addrs=[1])), "addrs"),
        (Hello.TYPE, _body(**_hello_fields(leaving="yes")), "leaving"),
        (Hello.TYPE, _body(**_hello_fields(leaving=0)), "leaving"),
        (Hello.TYPE, _body(**_hello_fields(run_id="r" * 129)), "run_id"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=3, versions={}), "bits"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=True, versions={}), "bits"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=2, versions=[]), "versions"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=2, versions={"o": 0}), "versions"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=2, versions={"o": 1.5}), "versions"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=2, versions={"o" * 33: 1}), "versions"),
        (Digest.TYPE, _body(run_id="r", fingerprint="f", bits=2, versions={f"o{i}": 1 for i in range(MAX_ORIGINS + 1)}), "versions"),
        (StateReply.TYPE, _body(work=1, versions={"o": -1}), "versions"),
        (Delta.TYPE, _body(origin="o", seq=0, scale=0.5, work=1, size=8), "seq"),
        (Delta.TYPE, _body(origin="o", seq=2**53 + 1, scale=0.5, work=1, size=8), "seq"),
        (Delta.TYPE, _body(origin="o", seq=1, scale=0, work=1, size=8), "scale"),
        (Delta.TYPE, _body(origin="o", seq=1, scale=1.5, work=1, size=8), "scale"),
        (Delta.TYPE, _body(origin="o", seq=1, scale="0.5", work=1, size=8), "scale"),
        (Delta.TYPE, _body(origin="o", seq=1, scale=0.5, work=1, size=-8), "size"),
        (Delta.TYPE, _body(origin=["o"], seq=1, scale=0.5, work=1, size=8), "origin"),
    ],
)
def test_bad_field_is_rejected_by_name(type_code: int, body: bytes, field: str) -> None:
    with pytest.raises(MalformedMessage, match=f"field '{field}'"):
        decode_body(type_code, body)


@pytest.mark.parametrize("msg_type", [Offer, Accept, StateReply])
@pytest.mark.parametrize(
    "work_json",
    ["NaN", "Infinity", "-Infinity", "-1", "-0.5", "1e16", str(int(MAX_WORK) + 1), '"5"', "null", "true", "false", "[1]"],
)
def test_bad_work_is_rejected(msg_type: type[Message], work_json: str) -> None:
    fields = {"run_id": "r", "fingerprint": "f", "wire_dtype": "float32"} if msg_type is Offer else {}
    body = json.dumps(fields)[:-1] + (", " if fields else "") + f'"work": {work_json}}}'
    with pytest.raises(MalformedMessage, match="field 'work' must be a finite number"):
        decode_body(msg_type.TYPE, body.encode())


@pytest.mark.parametrize("value", [True, False, math.nan, math.inf, -1.0, MAX_WORK * 2, "1"])
def test_bad_work_is_rejected_on_construction(value: object) -> None:
    with pytest.raises(MalformedMessage, match="field 'work'"):
        Accept(value)  # type: ignore[arg-type]


def test_work_bounds_are_inclusive() -> None:
    assert Accept(0).work == 0
    assert Accept(MAX_WORK).work == MAX_WORK


@pytest.mark.parametrize(
    ("type_code", "body"),
    [
        (Offer.TYPE, _body(run_id="r", fingerprint="f")),  # missing
        (Offer.TYPE, _body(run_id="r", fingerprint="f", work=1, extra=1)),  # extra
        (Accept.TYPE, _body(weight=1)),  # wrong name
        (Hello.TYPE, _body(run_id="r", fingerprint="f", addrs=[], peers=[])),  # missing the defaulted field
        (Commit.TYPE, _body(anything=1)),
        (Refuse.TYPE, b"[]"),
        (Refuse.TYPE, b'"reason"'),
        (Refuse.TYPE, b"null"),
    ],
)
def test_wrong_field_set_is_rejected(type_code: int, body: bytes) -> None:
    name = MESSAGE_TYPES[type_code].__name__
    with pytest.raises(MalformedMessage, match=f"{name}: expected fields"):
        decode_body(type_code, body)


def test_wrong_field_set_lists_expected_and_received_fields() -> None:
    with pytest.raises(MalformedMessage) as info:
        decode_body(Offer.TYPE, _body(run_id="r", fingerprint="f", weight=1))
    assert "['fingerprint', 'run_id', 'wire_dtype', 'work']" in str(info.value)
    assert "['fingerprint', 'run_id', 'weight']" in str(info.value)


@pytest.mark.parametrize("body", [b"", b"{", b"not json", b"{'reason': 'x'}", b'{"reason": "x"} trailing'])
def test_non_json_body_is_rejected(body: bytes) -> None:
    with pytest.raises(MalformedMessage, match="Refuse: body is not UTF-8 JSON"):
        decode_body(Refuse.TYPE, body)


def test_non_utf8_body_is_rejected() -> None:
    with pytest.raises(MalformedMessage, match="Busy: body is not UTF-8 JSON"):
        decode_body(Busy.TYPE, b'{"reason": "\xff\xfe"}')


@pytest.mark.parametrize("type_code", [0, 14, 42, 255])
def test_unknown_type_code_is_rejected(type_code: int) -> None:
    with pytest.raises(MalformedMessage, match=f"unknown message type {type_code}"):
        decode_body(type_code, b"{}")


def test_hello_with_too_many_peers_is_rejected() -> None:
    peers = [{"peer_id": f"p{i}", "addrs": []} for i in range(MAX_PEERS_PER_HELLO + 1)]
    with pytest.raises(MalformedMessage, match=f"field 'peers' must be a list of at most {MAX_PEERS_PER_HELLO}"):
        decode_body(Hello.TYPE, _body(**_hello_fields(peers=peers)))


def test_hello_with_the_maximum_number_of_peers_is_accepted() -> None:
    peers = [{"peer_id": f"p{i}", "addrs": []} for i in range(MAX_PEERS_PER_HELLO)]
    hello = decode_body(Hello.TYPE, _body(**_hello_fields(peers=peers)))
    assert isinstance(hello, Hello) and len(hello.peers) == MAX_PEERS_PER_HELLO


@pytest.mark.parametrize(
    ("peers", "match"),
    [
        ({"peer_id": "p", "addrs": []}, "field 'peers' must be a list"),
        (["p"], "field 'peers' must hold"),
        ([["p", []]], "field 'peers' must hold"),
        ([None], "field 'peers' must hold"),
        ([{"peer_id": "p"}], "Hello: .*'addrs'"),
        ([{"peer_id": "p", "addrs": [], "x": 1}], "Hello: .*'x'"),
        ([{"peer_id": 7, "addrs": []}], "field 'peer_id'"),
        ([{"peer_id": "p" * 129, "addrs": []}], "field 'peer_id'"),
        ([{"peer_id": "p", "addrs": "/ip4"}], "field 'addrs'"),
        ([{"peer_id": "p", "addrs": ["/a"] * (MAX_ADDRS + 1)}], "field 'addrs'"),
    ],
)
def test_hello_with_malformed_peer_records_is_rejected(peers: object, match: str) -> None:
    with pytest.raises(MalformedMessage, match=match):
        decode_body(Hello.TYPE, _body(**_hello_fields(peers=peers)))


# --- decoding never fails with anything but a protocol error ------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
field_names = st.sampled_from(["run_id", "fingerprint", "addrs", "peers", "leaving", "reason", "work", "peer_id", "x"])
json_objects = st.dictionaries(field_names, json_values, max_size=6)


def _decode_or_protocol_error(type_code: int, body: bytes) -> None:
    try:
        message = decode_body(type_code, body)
    except RemoteProtocolError:
        return
    assert isinstance(message, MESSAGE_TYPES[type_code])


@settings(max_examples=300)
@given(st.integers(0, 255), st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_a_protocol_error(type_code: int, body: bytes) -> None:
    _decode_or_protocol_error(type_code, body)


@settings(max_examples=300)
@given(st.sampled_from(sorted(MESSAGE_TYPES)), json_objects)
def test_arbitrary_json_objects_decode_or_raise_a_protocol_error(type_code: int, fields: dict) -> None:
    _decode_or_protocol_error(type_code, json.dumps(fields).encode())


# --- hostile input ------------------------------------------------------------------


def test_huge_integer_work_is_rejected_as_malformed() -> None:
    with pytest.raises(MalformedMessage, match="field 'work'"):
        decode_body(Accept.TYPE, b'{"work": 1' + b"0" * 400 + b"}")


def test_integer_with_too_many_digits_is_rejected_as_malformed() -> None:
    with pytest.raises(MalformedMessage):
        decode_body(Accept.TYPE, b'{"work": ' + b"1" * 5000 + b"}")


def test_deeply_nested_json_is_rejected_as_malformed() -> None:
    with pytest.raises(MalformedMessage):
        decode_body(Refuse.TYPE, b"[" * 50_000)


SUMMARY = PeerSummary("digits", 812.5, "accuracy", 0.93, 0.21, 1.5e4, "training", 0.12, ["12D3KooWa", "12D3KooWb"])


def _summary_fields(**overrides: object) -> dict[str, object]:
    fields = dict(SUMMARY.__dict__)
    fields.update(overrides)
    return fields


def test_hello_carries_a_peer_summary_through_a_frame() -> None:
    hello = Hello("r", "f", [], [], summary=SUMMARY)
    frame = encode_frame(hello)
    (length, type_code) = FRAME_HEADER.unpack(frame[: FRAME_HEADER.size])
    decoded = decode_body(type_code, frame[FRAME_HEADER.size :])
    assert decoded == hello and isinstance(decoded.summary, PeerSummary)


def test_markup_in_a_summary_is_plain_text_to_the_protocol() -> None:
    """The protocol bounds text, it does not interpret it: showing it as text is the dashboard's job."""
    hello = Hello("r", "f", [], [], summary=PeerSummary(**_summary_fields(task="<script>alert(1)</script>")))
    assert decode_body(Hello.TYPE, hello.body()).summary.task == "<script>alert(1)</script>"


def test_a_full_summary_stays_small() -> None:
    biggest = PeerSummary(**_summary_fields(task="t" * 64, metric="m" * 32, phase="p" * 16,
                                            partners=["x" * 128] * MAX_PARTNERS))  # fmt: skip
    assert len(json.dumps(biggest.__dict__)) < 1600


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"task": "t" * 65}, "task"),
        ({"task": 3}, "task"),
        ({"samples_per_s": -1.0}, "samples_per_s"),
        ({"samples_per_s": math.inf}, "samples_per_s"),
        ({"samples_per_s": None}, "samples_per_s"),
        ({"samples_per_s": True}, "samples_per_s"),
        ({"metric": "m" * 33}, "metric"),
        ({"metric_value": math.nan}, "metric_value"),
        ({"metric_value": "0.9"}, "metric_value"),
        ({"loss": 1e300}, "loss"),
        ({"work": -1}, "work"),
        ({"phase": "p" * 17}, "phase"),
        ({"idle": 1.5}, "idle"),
        ({"idle": -0.1}, "idle"),
        ({"partners": ["p"] * (MAX_PARTNERS + 1)}, "partners"),
        ({"partners": [7]}, "partners"),
        ({"partners": "p"}, "partners"),
    ],
)
def test_bad_summary_field_is_rejected_by_name(overrides: dict[str, object], field: str) -> None:
    body = _body(**_hello_fields(summary=_summary_fields(**overrides)))
    with pytest.raises(MalformedMessage, match=f"field '{field}'"):
        decode_body(Hello.TYPE, body)


@pytest.mark.parametrize("summary", [[], "x", 3, {"task": "t"}, {**SUMMARY.__dict__, "extra": 1}])
def test_summary_of_the_wrong_shape_is_rejected(summary: object) -> None:
    with pytest.raises(MalformedMessage, match="summary"):
        decode_body(Hello.TYPE, _body(**_hello_fields(summary=summary)))


# --- fresh work (work since the sender's anchor), optional in Offer and Accept ----------------


def test_fresh_work_travels_only_when_stated_so_older_frames_stay_byte_for_byte() -> None:
    offer = b'{"run_id":"r","fingerprint":"f","work":2.0,"wire_dtype":"float32"}'  # as before the field
    assert encode_frame(Offer("r", "f", 2.0)) == FRAME_HEADER.pack(len(offer), Offer.TYPE) + offer
    assert encode_frame(Accept(7.0)) == FRAME_HEADER.pack(12, Accept.TYPE) + b'{"work":7.0}'
    assert encode_frame(Accept(7.0, 3.0)) == FRAME_HEADER.pack(24, Accept.TYPE) + b'{"work":7.0,"fresh":3.0}'
    assert decode_body(Accept.TYPE, b'{"work":7.0}') == Accept(7.0, None)  # a peer from before the field
    assert decode_body(Offer.TYPE, b'{"run_id":"r","fingerprint":"f","work":2,"wire_dtype":"int8","fresh":2}').fresh == 2


@pytest.mark.parametrize("msg_type", [Offer, Accept])
@pytest.mark.parametrize(
    ("fresh_json", "match"),
    [
        ("-1", "field 'fresh' must be a finite number in"),
        ("NaN", "field 'fresh' must be a finite number in"),
        ("Infinity", "field 'fresh' must be a finite number in"),
        ("1e400", "field 'fresh' must be a finite number in"),
        ("true", "field 'fresh' must be a finite number in"),
        ('"5"', "field 'fresh' must be a finite number in"),
        ("10.5", "field 'fresh' must not exceed the stated work 10, got 10.5"),
    ],
)
def test_bad_fresh_work_is_rejected_by_name(msg_type: type[Message], fresh_json: str, match: str) -> None:
    fields = '"run_id":"r","fingerprint":"f","wire_dtype":"float32",' if msg_type is Offer else ""
    with pytest.raises(MalformedMessage, match=match):
        decode_body(msg_type.TYPE, ('{' + fields + '"work":10,"fresh":' + fresh_json + "}").encode())


def test_fresh_work_above_the_stated_work_is_refused_on_construction() -> None:
    with pytest.raises(MalformedMessage, match="field 'fresh' must not exceed the stated work 1.0, got 2.0"):
        Accept(1.0, 2.0)


def test_a_missing_required_field_names_the_optional_ones_too() -> None:
    with pytest.raises(MalformedMessage, match=r"Accept: expected fields \['work'\] \(optional \['fresh'\]\), got \['fresh'\]"):
        decode_body(Accept.TYPE, b'{"fresh":1}')


def test_a_refusal_without_a_layout_stays_byte_for_byte_and_a_bad_layout_is_rejected() -> None:
    assert Refuse("no").body() == b'{"reason":"no"}'  # what peers from before `layout` send and expect
    for layout in ("fc", [["fc.weight"]], [["fc.weight", [-1]]], [["fc.weight", [True]]], [[1, [2]]]):
        with pytest.raises(MalformedMessage, match="field 'layout'"):
            Refuse("x", layout=layout)  # type: ignore[arg-type]
