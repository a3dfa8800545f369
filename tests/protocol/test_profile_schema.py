"""NodeProfile: the one schema of the gossiped profile round-trips, and a mistyped or
oversized field is refused with an error naming it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol._schema import packb, unpackb
from protocol.errors import RemoteProtocolError
from protocol.frames import FrameDecoder
from protocol.messages import (
    MAX_PROFILE_DISABLED_OPS,
    MAX_PROFILE_LABELS,
    MAX_PROFILE_TEXT_BYTES,
    Gossip,
    MemberEntry,
    MemberState,
    NodeProfile,
    decode_message,
    encode_message,
)

_text = st.text(max_size=40)
profiles = st.builds(
    NodeProfile,
    device_kind=st.sampled_from(["cpu", "cuda"]),
    device_name=_text,
    device_memory_bytes=st.integers(0, (1 << 64) - 1),
    free_memory_bytes=st.integers(0, 1 << 50),
    job_memory_bytes=st.integers(0, 1 << 50),
    cpu_cores=st.floats(0, 512, allow_nan=False),
    cpu_limit=_text,
    gflops=st.floats(0, 1e6, allow_nan=False) | st.integers(0, 1000),
    plan_flops_other=st.floats(0, 1e15, allow_nan=False),
    plan_flops_attention=st.floats(0, 1e15, allow_nan=False),
    plan_flops_matmul_small=st.floats(0, 1e15, allow_nan=False),
    plan_flops_matmul_tiny=st.floats(0, 1e15, allow_nan=False),
    plan_wake_s=st.floats(0, 1, allow_nan=False),
    torch_version=_text,
    protocol_version=st.integers(0, 1 << 16),
    ops_digest=st.text("0123456789abcdef", max_size=64),
    ops_disabled=st.lists(_text, max_size=5).map(tuple),
    labels=st.dictionaries(st.text(max_size=10), _text, max_size=4),
)


def _through_the_wire(p: NodeProfile) -> NodeProfile:
    got = NodeProfile.from_wire(unpackb(packb(p.to_wire()), "profile"))
    assert isinstance(got, NodeProfile)
    return got


@settings(max_examples=150, deadline=None)
@given(profiles)
def test_a_profile_round_trips_to_equal_typed_values(p: NodeProfile) -> None:
    back = _through_the_wire(p)
    assert back == p
    assert type(back.gflops) is float and isinstance(back.ops_disabled, tuple)
    # re-encoding what was decoded gives the very bytes (the body signature relies on it)
    assert packb(back.to_wire()) == packb(p.to_wire())


def test_a_profile_travels_once_in_a_gossip_entry() -> None:
    p = NodeProfile(gflops=12.5, torch_version="2.13.0", ops_disabled=("aten.relu",))
    entry = MemberEntry(node_id="n1", address=("10.0.0.1", 7420), incarnation=1, heartbeat=2,
                        state=MemberState.ALIVE, profile=p)
    wire = b"".join(bytes(x) for x in encode_message(Gossip(sender="n1", members=(entry,))))
    [frame] = FrameDecoder().feed(wire)
    got = decode_message(frame)
    assert isinstance(got, Gossip) and got.members[0].profile == p
    assert "extra" not in entry.to_wire()["profile"]
    assert bytes(frame.header).count(b"2.13.0") == 1  # not a second copy in a free-form map


@pytest.mark.parametrize(("field", "value", "expected"), [
    ("gflops", "fast", r"NodeProfile\.gflops: expected float, got str"),
    ("memory_bytes", 1.5, r"NodeProfile\.memory_bytes: expected int, got float"),
    ("memory_bytes", True, r"NodeProfile\.memory_bytes: expected int, got bool"),
    ("torch_version", 2, r"NodeProfile\.torch_version: expected str, got int"),
    ("ops_disabled", "aten.relu", r"NodeProfile\.ops_disabled: expected array, got str"),
    ("ops_disabled", ["ok", 3], r"NodeProfile\.ops_disabled\[1\]: expected str, got int"),
    ("labels", {"rack": 1}, r"NodeProfile\.labels\['rack'\]: expected str, got int"),
])
def test_a_mistyped_field_is_named(field: str, value: Any, expected: str) -> None:
    wire = {**NodeProfile().to_wire(), field: value}
    with pytest.raises(RemoteProtocolError, match=expected):
        NodeProfile.from_wire(wire)


@pytest.mark.parametrize(("field", "value"), [
    ("device_name", "x" * (MAX_PROFILE_TEXT_BYTES + 1)),
    ("torch_version", "é" * (MAX_PROFILE_TEXT_BYTES // 2 + 1)),  # bytes, not characters
    ("ops_disabled", ["aten.op"] * (MAX_PROFILE_DISABLED_OPS + 1)),
    ("ops_disabled", ["x" * (MAX_PROFILE_TEXT_BYTES + 1)]),
    ("labels", {f"k{i}": "v" for i in range(MAX_PROFILE_LABELS + 1)}),
    ("labels", {"rack": "v" * (MAX_PROFILE_TEXT_BYTES + 1)}),
])
def test_an_oversized_field_is_refused_naming_it(field: str, value: Any) -> None:
    wire = {**NodeProfile().to_wire(), field: value}
    with pytest.raises(RemoteProtocolError, match=rf"NodeProfile: invalid: {field}"):
        NodeProfile.from_wire(wire)
    # nested in a gossip entry the path says where
    entry = MemberEntry(node_id="n1", address=("h", 1), incarnation=1, heartbeat=1,
                        state=MemberState.ALIVE).to_wire()
    entry["profile"] = wire
    with pytest.raises(RemoteProtocolError,
                       match=rf"Gossip\.members\[0\]\.profile: invalid NodeProfile: {field}"):
        Gossip.from_wire({"sender": "s", "members": [entry]})
    # and the sender cannot build one either
    with pytest.raises(ValueError, match=field):
        NodeProfile(**{field: tuple(value) if isinstance(value, list) else value})


def test_at_the_bound_is_accepted() -> None:
    p = NodeProfile(device_name="x" * MAX_PROFILE_TEXT_BYTES,
                    ops_disabled=("aten.op",) * MAX_PROFILE_DISABLED_OPS,
                    labels={f"k{i}": "v" for i in range(MAX_PROFILE_LABELS)})
    assert _through_the_wire(p) == p


