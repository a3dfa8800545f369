"""Messages: every kind round-trips; unknown fields ignored; bad fields named; handshake."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from protocol._schema import WIRE, Struct
from protocol.errors import LimitExceeded, LocalProtocolError, RemoteProtocolError
from protocol.frames import Frame, FrameDecoder, encode_frame, frame_bytes
from protocol.handshake import (
    Handshake,
    HandshakeRefused,
    Role,
    State,
    negotiate_version,
    version_refusal,
)
from protocol.limits import Limits
from protocol.messages import (
    _REGISTRY,
    MESSAGE_TYPES,
    Ack,
    Assign,
    AssignConfig,
    Backward,
    DataConfig,
    DeviceProfile,
    EdgeFigures,
    EdgeRoute,
    Error,
    Forward,
    Gossip,
    Hello,
    HelloAck,
    JobSubmitReply,
    Lane,
    LinkMeasurement,
    MemberEntry,
    MemberState,
    Message,
    NodeProfile,
    OptimizerConfig,
    Ping,
    ProbeData,
    Refuse,
    StepFigures,
    decode_message,
    encode_message,
    message_class,
)

# The wire contract: these ids never change (docs/protocol.md lists the same table).
EXPECTED_TYPE_IDS = {
    "Hello": 1, "HelloAck": 2, "Refuse": 3, "Heartbeat": 4, "Profile": 5, "Gossip": 6,
    "Leave": 7, "VoteRequest": 8, "Vote": 9, "Leader": 10, "LeaderAck": 11, "Assign": 12,
    "Ready": 13, "Forward": 14, "Backward": 15, "Ack": 16, "Error": 17, "Ping": 18, "Pong": 19,
    "ProbeData": 20, "ProbeAck": 21, "JoinRequest": 22, "JoinResponse": 23,
}  # fmt: skip
BULK = {"Assign", "Forward", "Backward", "ProbeData", "JobResult", "StageCheckpoint",
        "JobSubmit", "JobUpdate", "JobOutput", "JobsAnswer"}
KINDS: list[type[Message]] = sorted(MESSAGE_TYPES.values(), key=lambda c: c.TYPE_ID)
I64_MIN, U64_MAX = -(1 << 63), (1 << 64) - 1

# --- strategies generated from the annotations, so new messages are covered automatically --

msgpack_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(I64_MIN, U64_MAX)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    simple: dict[Any, st.SearchStrategy[Any]] = {
        int: st.integers(I64_MIN, U64_MAX),
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: st.text(max_size=12),
        bytes: st.binary(max_size=40),
        Any: msgpack_values,
    }
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        [inner] = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(inner)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=3).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy_for(args[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and issubclass(tp, Struct):
        return struct_strategy(tp)
    raise AssertionError(f"no strategy for {tp!r}")


def sample(tp: Any) -> Any:
    """A fixed, fully populated value of `tp` (every optional and container non-empty)."""
    simple = {int: 7, float: 1.5, bool: True, str: "s", bytes: b"b", Any: {"k": [1, None]}}
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        return sample(next(a for a in args if a is not type(None)))
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return (sample(args[0]),)
        return tuple(sample(a) for a in args)
    if origin is dict:
        return {"k": sample(args[1])}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp))
    hints = typing.get_type_hints(tp)
    return tp(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(tp)
                 if f.metadata.get(WIRE, True)})  # fmt: skip


def struct_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: st.deferred(lambda t=hints[f.name]: strategy_for(t))
        for f in dataclasses.fields(cls)
        if f.metadata.get(WIRE, True)
    }
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


any_message: st.SearchStrategy[Message] = st.sampled_from(KINDS).flatmap(struct_strategy)


def roundtrip(msg: Message, payload: bytes | None = None, **kw: Any) -> Message:
    parts = encode_message(msg, () if payload is None else [payload], **kw)
    [frame] = FrameDecoder().feed(frame_bytes(parts))
    return decode_message(frame)


def header_frame(cls: type[Message], header: Any) -> Frame:
    raw = msgpack.packb(header, use_bin_type=True)
    [frame] = FrameDecoder().feed(frame_bytes(encode_frame(cls.TYPE_ID, raw)))
    return frame


# --- registry --------------------------------------------------------------------------------


def test_type_ids_and_lanes_are_the_documented_ones() -> None:
    got = {cls.__name__: tid for tid, cls in MESSAGE_TYPES.items()}
    for name, tid in EXPECTED_TYPE_IDS.items():
        assert got[name] == tid
    for cls in MESSAGE_TYPES.values():
        assert cls.lane is (Lane.BULK if cls.__name__ in BULK else Lane.CONTROL), cls
    assert message_class(14) is Forward
    with pytest.raises(RemoteProtocolError, match="unknown message type 9999"):
        message_class(9999)


def test_every_expected_reply_carries_a_request_id() -> None:
    for name in ("VoteRequest", "Vote", "Leader", "LeaderAck", "Assign", "Ready", "Ack",
                 "Error", "Ping", "Pong", "JoinRequest", "JoinResponse"):  # fmt: skip
        assert "request_id" in {
            f.name for f in dataclasses.fields(MESSAGE_TYPES[EXPECTED_TYPE_IDS[name]])
        }, name


def test_a_message_is_added_by_appending_a_dataclass() -> None:
    @dataclass(frozen=True)
    class Extra(Message):
        TYPE_ID: ClassVar[int] = 60001
        lane: ClassVar[Lane] = Lane.BULK
        name: str
        sizes: tuple[int, ...] = ()
        peer: MemberEntry | None = None

    try:
        msg = Extra("x", (1, 2), MemberEntry("n", ("h", 1), 1, 2, MemberState.DEAD))
        back = roundtrip(msg, b"data")
        assert back == msg and bytes(back.payload) == b"data" and back.lane is Lane.BULK
        with pytest.raises(TypeError, match="taken by Extra"):

            @dataclass(frozen=True)
            class Clash(Message):
                TYPE_ID: ClassVar[int] = 60001
    finally:
        del _REGISTRY[60001]


# --- round trips -----------------------------------------------------------------------------


@given(msg=any_message, payload=st.binary(max_size=64), check=st.booleans())
@settings(max_examples=200, deadline=None)
def test_every_message_kind_round_trips(msg: Message, payload: bytes, check: bool) -> None:
    back = roundtrip(msg, payload, payload_check=check)
    assert type(back) is type(msg)
    assert back == msg
    assert bytes(back.payload) == payload
    assert back.lane is msg.lane


@pytest.mark.parametrize("cls", KINDS)
def test_each_kind_round_trips_at_least_once(cls: type[Message]) -> None:
    # Explicit per-kind coverage, so a kind hypothesis happened not to draw still runs.
    msg = sample(cls)
    assert roundtrip(msg, b"p") == msg


def test_payload_defaults_to_msg_payload_and_is_not_part_of_equality() -> None:
    msg = Forward("job", 1, 2, 3, "e7", payload=memoryview(b"tensor"))
    back = roundtrip(msg)
    assert bytes(back.payload) == b"tensor"
    assert back == Forward("job", 1, 2, 3, "e7")
    [frame] = FrameDecoder().feed(frame_bytes(encode_message(msg, [b"explicit"])))
    assert bytes(decode_message(frame).payload) == b"explicit"


def test_floats_accept_msgpack_ints_and_nan_survives() -> None:
    # Another implementation may send a whole-number float as a msgpack int.
    ping = decode_message(header_frame(Ping, {"request_id": 1, "sent_at": 5}))
    assert isinstance(ping, Ping) and ping.sent_at == 5.0 and isinstance(ping.sent_at, float)
    nan = decode_message(header_frame(Ping, {"request_id": 1, "sent_at": math.nan}))
    assert isinstance(nan, Ping) and math.isnan(nan.sent_at)


# --- forward compatibility and validation ----------------------------------------------------


@given(
    msg=any_message,
    extra=st.dictionaries(st.text(min_size=1, max_size=8).map(lambda s: "x_" + s),
                          msgpack_values, max_size=3),
)  # fmt: skip
@settings(max_examples=100, deadline=None)
def test_unknown_fields_are_ignored(msg: Message, extra: dict[str, Any]) -> None:
    header = {**msg.to_wire(), **extra}
    assert decode_message(header_frame(type(msg), header)) == msg


def test_unknown_fields_in_nested_structs_are_ignored() -> None:
    entry = {
        "node_id": "n", "address": ["h", 1], "incarnation": 1, "heartbeat": 2,
        "state": "alive", "new_field": {"a": [1, 2]},
        "profile": {"node_id": "n", "gpu_count": 8},
    }  # fmt: skip
    g = decode_message(header_frame(Gossip, {"sender": "s", "members": [entry]}))
    assert isinstance(g, Gossip) and g.members[0].profile == NodeProfile()


@pytest.mark.parametrize("cls", KINDS)
def test_missing_required_fields_are_named(cls: type[Message]) -> None:
    full = sample(cls).to_wire()
    for name, _label, required in cls.wire_fields():
        if not required:
            continue
        header = {k: v for k, v in full.items() if k != name}
        with pytest.raises(RemoteProtocolError, match=f"{cls.__name__}: missing field '{name}'"):
            decode_message(header_frame(cls, header))


def wrong_value(label: str) -> Any:
    base = label.removesuffix(" | None")
    return {"str": 123, "int": "1", "float": "1.0", "bool": 1, "bytes": "b"}.get(base, 2.5)


@pytest.mark.parametrize("cls", KINDS)
def test_mistyped_fields_are_named(cls: type[Message]) -> None:
    full = sample(cls).to_wire()
    for name, label, _ in cls.wire_fields():
        if label == "any" or label.endswith("any]"):
            continue
        header = {**full, name: wrong_value(label)}
        with pytest.raises(RemoteProtocolError, match=rf"^{cls.__name__}\.{name}: expected"):
            decode_message(header_frame(cls, header))
        with pytest.raises(LocalProtocolError, match=rf"{cls.__name__}\.{name}: expected"):
            encode_message(dataclasses.replace(sample(cls),
                                               **{name: wrong_value(label)}))  # fmt: skip


def test_nested_errors_name_the_path() -> None:
    entry = {"node_id": "n", "address": ["h", 1], "incarnation": 1, "heartbeat": 2,
             "state": "alive", "profile": {"node_id": "n", "memory_bytes": "lots"}}  # fmt: skip
    with pytest.raises(
        RemoteProtocolError, match=r"Gossip\.members\[0\]\.profile\.memory_bytes: expected int"
    ):
        decode_message(header_frame(Gossip, {"sender": "s", "members": [entry]}))
    entry = {**entry, "profile": None, "state": "zombie"}
    with pytest.raises(RemoteProtocolError, match=r"members\[0\]\.state: 'zombie' is not a"):
        decode_message(header_frame(Gossip, {"sender": "s", "members": [entry]}))
    entry = {**entry, "state": "dead", "address": ["h", 1, 2]}
    with pytest.raises(RemoteProtocolError, match=r"address: expected 2 items, got 3"):
        decode_message(header_frame(Gossip, {"sender": "s", "members": [entry]}))
    links = [{"peer": "p", "bandwidth_bits_per_s": 1.0}]
    with pytest.raises(RemoteProtocolError, match=r"links\[0\]: missing field 'rtt_s'"):
        decode_message(header_frame(Gossip, {"sender": "s", "members": [{**entry,
                       "address": ["h", 1], "links": links}]}))  # fmt: skip


def test_bools_are_not_ints_and_ints_are_64_bit() -> None:
    with pytest.raises(RemoteProtocolError, match=r"Ack\.request_id: expected int, got bool"):
        decode_message(header_frame(Ack, {"request_id": True}))
    with pytest.raises(LocalProtocolError, match="does not fit in 64 bits"):
        encode_message(Error("c", "m", request_id=1 << 64))
    assert roundtrip(Error("c", "m", request_id=U64_MAX)) == Error("c", "m", U64_MAX)
    assert roundtrip(Error("c", "m", request_id=I64_MIN)) == Error("c", "m", I64_MIN)


def test_header_must_be_one_msgpack_map() -> None:
    for raw, match in [
        (msgpack.packb([1, 2]), "expected a map of Error fields"),
        (msgpack.packb({"code": "c", "message": "m"}) + b"\xc0", "malformed msgpack"),
        (b"\xc1", "malformed msgpack"),
        (b"", "malformed msgpack"),
        (b"\x81\x01\xa1x", "malformed msgpack"),  # int map key
        (b"\x81\xa4code\xa2\xff\xfe", "malformed msgpack"),  # invalid UTF-8
        (b"\x82\xa4code\xd6\xff\x00\x00\x00\x00\xa7message\xa0", "ext"),  # timestamp ext
    ]:
        [frame] = FrameDecoder().feed(frame_bytes(encode_frame(Error.TYPE_ID, raw)))
        with pytest.raises(RemoteProtocolError, match=match):
            decode_message(frame)


def test_huge_declared_containers_are_refused_before_allocation() -> None:
    for raw in (b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                b"\xc6\xff\xff\xff\xff"):  # fmt: skip
        [frame] = FrameDecoder().feed(frame_bytes(encode_frame(Error.TYPE_ID, raw)))
        with pytest.raises(RemoteProtocolError):
            decode_message(frame)


def test_sizes_are_bounded_by_limits_both_ways() -> None:
    small = Limits(max_string_bytes=8, max_list_items=8)  # maps of fields count too
    ok = Gossip("s" * 8, ())
    [frame] = FrameDecoder().feed(frame_bytes(encode_message(ok)))
    assert decode_message(frame, small) == ok
    [frame] = FrameDecoder().feed(frame_bytes(encode_message(Gossip("s" * 9, ()))))
    with pytest.raises(LimitExceeded):
        decode_message(frame, small)
    with pytest.raises(LocalProtocolError, match=r"Gossip\.sender: str is 9 bytes"):
        encode_message(Gossip("s" * 9, ()), limits=small)
    members = tuple(MemberEntry(str(i), ("h", i), 0, 0, MemberState.ALIVE) for i in range(9))
    [frame] = FrameDecoder().feed(frame_bytes(encode_message(Gossip("s", members))))
    with pytest.raises(LimitExceeded, match="max_array_len"):
        decode_message(frame, small)
    with pytest.raises(LocalProtocolError, match=r"Gossip\.members: 9 items, limit is 8"):
        encode_message(Gossip("s", members), limits=small)


def test_any_fields_are_bounded_in_depth() -> None:
    deep: Any = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(LocalProtocolError, match="nested deeper than"):
        encode_message(JobSubmitReply("r", True, summary={"x": deep}))
    header = {**JobSubmitReply("r", True).to_wire(), "summary": {"x": deep}}
    with pytest.raises(RemoteProtocolError,
                       match=r"JobSubmitReply\.summary\['x'\].*nested deeper"):
        decode_message(header_frame(JobSubmitReply, header))
    # Deeper than msgpack's own stack: still a protocol error, not a RecursionError.
    raw = b"\x91" * 100_000 + b"\xc0"
    [frame] = FrameDecoder().feed(frame_bytes(encode_frame(Assign.TYPE_ID, raw)))
    with pytest.raises(RemoteProtocolError):
        decode_message(frame)


def test_assign_carries_ir_bytes_nodes_and_config() -> None:
    a = Assign(7, 3, "job-1", 2, 1, b"\x00IR\xff", nodes={"a": ("10.0.0.1", 7000)},
               config=sample(AssignConfig))  # fmt: skip
    back = roundtrip(a, b"safetensors...")
    assert back == a and bytes(back.payload) == b"safetensors..."


def test_bulk_messages_are_cheap_to_encode() -> None:
    # The tensor is never inside msgpack: the header of a Forward stays tiny.
    parts = encode_message(Forward("job", 1, 10, 3, "edge:12"), [b"\x00" * 1_000_000])
    assert len(parts[0]) < 128 and memoryview(parts[1]).nbytes == 1_000_000
    assert ProbeData.lane is Backward.lane is Lane.BULK


# --- version negotiation and the handshake ---------------------------------------------------


@given(st.integers(1, 20), st.integers(0, 20), st.integers(1, 20), st.integers(0, 20))
def test_negotiate_version_picks_the_highest_common(a: int, b: int, c: int, d: int) -> None:
    got = negotiate_version(a, a + b, c, c + d)
    common = set(range(a, a + b + 1)) & set(range(c, c + d + 1))
    assert got == (max(common) if common else None)
    assert negotiate_version(c, c + d, a, a + b) == got
    assert negotiate_version(3, 2, 1, 5) is None


def test_handshake_agrees_on_the_highest_common_version() -> None:
    client = Handshake(Role.CLIENT, node_id="a", cluster_id="c", min_version=1, max_version=4,
                       capabilities=["topk"], address=("10.0.0.1", 7000))  # fmt: skip
    server = Handshake(Role.SERVER, node_id="b", cluster_id="c", min_version=2, max_version=3)
    hello = client.start()
    assert isinstance(hello, Hello) and (hello.min_version, hello.max_version) == (1, 4)
    ack = server.receive(hello)
    assert isinstance(ack, HelloAck) and ack.version == 3
    assert client.receive(ack) is None
    assert client.established and server.established
    assert client.version == server.version == 3
    assert client.peer_node_id == "b" and server.peer_node_id == "a"
    assert server.peer_capabilities == ("topk",) and server.peer_address == ("10.0.0.1", 7000)
    with pytest.raises(LocalProtocolError, match="already finished"):
        client.receive(ack)


def test_handshake_over_frames_between_disjoint_versions_refuses_naming_both() -> None:
    """A v5..6 peer's Hello is readable by a v1 node (handshake frames take any version)."""
    client = Handshake(Role.CLIENT, node_id="new", cluster_id="c", min_version=5, max_version=6)
    server = Handshake(Role.SERVER, node_id="old", cluster_id="c")
    srv_dec = FrameDecoder()
    [frame] = srv_dec.feed(frame_bytes(encode_message(client.start(), version=6)))
    reply = server.receive(decode_message(frame))
    assert isinstance(reply, Refuse) and server.state is State.REFUSED
    assert server.refusal is not None and not server.refusal.by_peer
    cli_dec = FrameDecoder(min_version=5, max_version=6)
    [frame] = cli_dec.feed(frame_bytes(encode_message(reply, version=PROTOCOL_VERSION)))
    with pytest.raises(HandshakeRefused) as exc:
        client.receive(decode_message(frame))
    text = str(exc.value)
    assert exc.value.code == "version" and exc.value.by_peer
    assert f"'old' speaks {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}" in text
    assert "'new' speaks 5..6" in text
    assert (reply.peer_min_version, reply.peer_max_version) == (5, 6)
    # Non-handshake frames in a version the decoder does not speak are refused.
    with pytest.raises(RemoteProtocolError, match="version 6"):
        FrameDecoder().feed(frame_bytes(encode_message(Error("c", "m"), version=6)))


def test_handshake_refuses_another_cluster_and_non_hello() -> None:
    server = Handshake(Role.SERVER, node_id="b", cluster_id="prod")
    hello = Handshake(Role.CLIENT, node_id="a", cluster_id="test").start()
    reply = server.receive(hello)
    assert isinstance(reply, Refuse) and reply.code == "cluster"
    assert "'test'" in reply.reason and "'prod'" in reply.reason
    server = Handshake(Role.SERVER, node_id="b", cluster_id="prod")
    reply = server.receive(Error("x", "y"))
    assert isinstance(reply, Refuse) and reply.code == "protocol"


def test_client_rejects_a_bad_ack() -> None:
    for ack, match in [
        (HelloAck("b", "c", version=9), "version 9"),
        (HelloAck("b", "other", version=1), "cluster 'other'"),
        (Error("e", "m"), "expected HelloAck or Refuse"),
    ]:
        client = Handshake(Role.CLIENT, node_id="a", cluster_id="c")
        client.start()
        with pytest.raises(RemoteProtocolError, match=match):
            client.receive(ack)
        assert client.state is State.REFUSED


def test_handshake_misuse_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        Handshake(Role.CLIENT, node_id="a", cluster_id="c", min_version=3, max_version=2)
    with pytest.raises(LocalProtocolError):
        Handshake(Role.SERVER, node_id="a", cluster_id="c").start()
    with pytest.raises(LocalProtocolError, match="start"):
        Handshake(Role.CLIENT, node_id="a", cluster_id="c").receive(HelloAck("b", "c", 1))
    r = version_refusal(1, 1, 2, 3)
    assert "1..1" in r.reason and "2..3" in r.reason


def test_link_measurement_is_validated() -> None:
    lm = LinkMeasurement("p", 1e9, 0.02, 1.7e9, 0.04)
    assert LinkMeasurement.from_wire(lm.to_wire()) == lm


# --- docs/protocol.md is the spec: keep it in step with the code ------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def doc_section(text: str, heading: str) -> str:
    start = text.index(heading)
    ends = [i for i in (text.find("\n\n**", start), text.find("\n## ", start)) if i > 0]
    return text[start : min(ends, default=len(text))]


@pytest.mark.parametrize("cls", KINDS)
def test_docs_list_every_message_with_its_id_and_fields(cls: type[Message]) -> None:
    text = DOC.read_text()
    name, tid = cls.__name__, cls.TYPE_ID
    lane = "**BULK**" if cls.lane is Lane.BULK else "CONTROL"
    assert f"| {tid} | {name} | {lane} |" in text, f"add {name} to the table in {DOC}"
    section = doc_section(text, f"**{tid} {name}**")
    for field_name, _label, _required in cls.wire_fields():
        assert f"`{field_name}`" in section, f"{DOC}: {name} does not list `{field_name}`"


@pytest.mark.parametrize("cls", [LinkMeasurement, NodeProfile, DeviceProfile, MemberEntry,
                                 EdgeRoute, AssignConfig, OptimizerConfig, DataConfig, StepFigures,
                                 EdgeFigures])
def test_docs_list_every_record_field(cls: type[Struct]) -> None:
    section = doc_section(DOC.read_text(), f"**{cls.__name__}**")
    for field_name, _label, _required in cls.wire_fields():
        assert f"| `{field_name}` |" in section, f"{cls.__name__}.{field_name} not in {DOC}"


def test_docs_example_frames_are_byte_exact() -> None:
    text = DOC.read_text().split("## Examples", 1)[1]
    dumps = re.findall(r"```\n(.*?)```", text, re.S)
    got = [bytes.fromhex(" ".join(line[6:53] for line in dump.splitlines())) for dump in dumps[:2]]
    assert got[0] == frame_bytes(encode_message(Ping(request_id=1, sent_at=0.5)))
    fwd = Forward(job_id="j", plan_version=1, iteration=2, microbatch=3, edge="e")
    assert got[1] == frame_bytes(encode_message(fwd, [b"\x00\x01\x02\x03"], payload_check=False))
