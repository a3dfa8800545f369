"""Frames: byte layout per docs/protocol.md, streaming decode in any chunking, limits first."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import PROTOCOL_VERSION
from protocol.errors import LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.frames import (
    FIXED_HEADER_SIZE,
    FLAG_NO_PAYLOAD_CHECK,
    MAGIC,
    Frame,
    FrameDecoder,
    encode_frame,
    frame_bytes,
)
from protocol.limits import Limits


def spec_frame(
    msg_type: int,
    header: bytes,
    payload: bytes,
    *,
    version: int = 1,
    flags: int = 0,
    payload_check: int | None = None,
    header_len: int | None = None,
    payload_len: int | None = None,
    reserved: int = 0,
) -> bytes:
    """A frame built straight from the byte layout in docs/protocol.md, not from frames.py."""
    if payload_check is None:
        payload_check = 0 if flags & 1 else xxhash.xxh3_64_intdigest(payload)
    prefix = (
        b"FSN\x00"
        + bytes([version, flags])
        + msg_type.to_bytes(2, "little")
        + (len(header) if header_len is None else header_len).to_bytes(4, "little")
        + reserved.to_bytes(4, "little")
        + (len(payload) if payload_len is None else payload_len).to_bytes(8, "little")
        + payload_check.to_bytes(8, "little")
    )
    hcheck = xxhash.xxh3_64_intdigest(prefix + header)
    return prefix + hcheck.to_bytes(8, "little") + header + payload


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(data)]:
        out.append(data[last:p])
        last = p
    return out


def decode_all(dec: FrameDecoder, chunks: list[bytes]) -> list[Frame]:
    frames: list[Frame] = []
    for c in chunks:
        frames += dec.feed(c)
    return frames


def test_encoder_matches_the_documented_byte_layout() -> None:
    for flags, check in ((0, True), (FLAG_NO_PAYLOAD_CHECK, False)):
        parts = encode_frame(
            7, b"\x81\xa1a\x01", [b"abc", b"", bytearray(b"de")], payload_check=check
        )
        assert frame_bytes(parts) == spec_frame(7, b"\x81\xa1a\x01", b"abcde", flags=flags)
    raw = spec_frame(0x1234, b"h", b"p")
    assert raw[:4] == MAGIC == b"FSN\x00"
    assert struct.unpack_from("<H", raw, 6)[0] == 0x1234  # little-endian type at offset 6
    assert len(raw) == FIXED_HEADER_SIZE + 2


def test_gather_list_keeps_payload_buffers_uncopied() -> None:
    payload = bytearray(b"x" * 1000)
    arr = np.arange(10, dtype=np.float32)
    parts = encode_frame(14, b"\x80", [payload, arr])
    assert len(parts) == 3
    assert isinstance(parts[1], memoryview) and parts[1].obj is payload
    assert isinstance(parts[2], memoryview) and parts[2].nbytes == 40 and parts[2].format == "B"
    [frame] = FrameDecoder().feed(frame_bytes(parts))
    assert bytes(frame.payload) == bytes(payload) + arr.tobytes()


def test_payload_check_over_pieces_equals_check_over_whole() -> None:
    pieces = [b"a" * 1000, b"", b"b" * 3, b"c" * 70000]
    head = frame_bytes(encode_frame(1, b"", pieces))[:FIXED_HEADER_SIZE]
    assert int.from_bytes(head[24:32], "little") == xxhash.xxh3_64_intdigest(b"".join(pieces))


@given(
    frames=st.lists(
        st.tuples(
            st.integers(0, 65535).filter(lambda t: t not in (1, 2, 3)),
            st.binary(max_size=64),
            st.lists(st.binary(max_size=300), max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=4,
    ),
    cuts=st.lists(st.integers(0, 10_000), max_size=20),
    as_bytearray=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_round_trip_under_arbitrary_chunking(
    frames: list[tuple[int, bytes, list[bytes], bool]], cuts: list[int], as_bytearray: bool
) -> None:
    stream = b"".join(frame_bytes(encode_frame(t, h, p, payload_check=c)) for t, h, p, c in frames)
    chunks = chunked(stream, cuts)
    dec = FrameDecoder()
    got = decode_all(dec, [bytearray(c) if as_bytearray else c for c in chunks])
    assert [(f.msg_type, f.header, bytes(f.payload), f.payload_checked) for f in got] == [
        (t, h, b"".join(p), c) for t, h, p, c in frames
    ]
    assert dec.idle and dec.buffered == 0
    assert all(f.version == PROTOCOL_VERSION for f in got)


def test_one_byte_chunks_and_empty_feeds() -> None:
    stream = b"".join(frame_bytes(encode_frame(9, b"hdr" * i, [b"p" * (i * 7)])) for i in range(5))
    dec = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(stream)):
        got += dec.feed(b"")
        got += dec.feed(stream[i : i + 1])
        assert dec.buffered <= FIXED_HEADER_SIZE + 12 + 28
    assert [(f.header, bytes(f.payload)) for f in got] == [
        (b"hdr" * i, b"p" * (i * 7)) for i in range(5)
    ]


def test_zero_byte_payload_and_zero_byte_header() -> None:
    dec = FrameDecoder()
    [f] = dec.feed(frame_bytes(encode_frame(5, b"", [])))
    assert f.header == b"" and f.payload.nbytes == 0
    [f] = dec.feed(frame_bytes(encode_frame(5, b"\x80", [b""])))
    assert f.header == b"\x80" and bytes(f.payload) == b""


def test_whole_payload_in_one_bytes_chunk_is_zero_copy() -> None:
    data = frame_bytes(encode_frame(14, b"\x80", [b"z" * 100_000]))
    [f] = FrameDecoder().feed(data)
    assert f.payload.obj is data  # a view into what was fed, no copy
    # A mutable buffer may be reused by the caller, so it is copied out.
    ba = bytearray(data)
    [g] = FrameDecoder().feed(ba)
    assert g.payload.obj is not ba
    ba[-1] ^= 0xFF
    assert bytes(g.payload) == b"z" * 100_000


def test_owned_buffers_are_viewed_not_copied() -> None:
    data = bytearray(frame_bytes(encode_frame(14, b"\x80", [b"w" * 5000])))
    dec = FrameDecoder()
    [f] = dec.feed(data, owned=True)
    assert f.payload.obj is data and bytes(f.payload) == b"w" * 5000
    # Split across feeds, an owned buffer's payload is still gathered into one buffer.
    [g] = dec.feed(data[:100], owned=True) + dec.feed(data[100:], owned=True)
    assert bytes(g.payload) == b"w" * 5000


def test_split_payload_is_preallocated_once_at_declared_size() -> None:
    size = 3 << 20
    data = frame_bytes(encode_frame(14, b"\x80", [b"q" * size]))
    dec = FrameDecoder()
    assert dec.feed(data[:100]) == []
    # After the first payload bytes the decoder owns one buffer of exactly the payload's size.
    assert dec._payload is not None and len(dec._payload) == size
    buf = dec._payload
    got: list[Frame] = []
    for i in range(100, len(data), 65536):
        got += dec.feed(data[i : i + 65536])
        assert dec._payload is None or dec._payload is buf
    [f] = got
    assert f.payload.obj is buf and f.payload.nbytes == size
    assert bytes(f.payload[:10]) == b"q" * 10


def test_absurd_payload_length_is_refused_from_the_fixed_header_alone() -> None:
    bad = spec_frame(14, b"\x80", b"", payload_len=1 << 40)[:FIXED_HEADER_SIZE]
    dec = FrameDecoder()
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded, match="payload length is 1099511627776"):
            dec.feed(bad)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert dec.buffered == 0


def test_header_length_over_limit_is_refused_before_buffering() -> None:
    limits = Limits(max_header_bytes=100)
    bad = spec_frame(6, b"x" * 101, b"")
    dec = FrameDecoder(limits)
    with pytest.raises(LimitExceeded, match="message header length is 101"):
        dec.feed(bad[:FIXED_HEADER_SIZE])


def test_total_frame_length_over_limit() -> None:
    limits = Limits(max_frame_bytes=1000, max_header_bytes=900)
    ok = spec_frame(6, b"h" * 500, b"p" * 460)
    [f] = FrameDecoder(limits).feed(ok)
    assert f.payload.nbytes == 460
    with pytest.raises(LimitExceeded, match="frame length is 1001"):
        FrameDecoder(limits).feed(spec_frame(6, b"h" * 500, b"p" * 461))
    with pytest.raises(LocalProtocolError, match="limit is 1000"):
        encode_frame(6, b"h" * 500, [b"p" * 461], limits=limits)
    with pytest.raises(LocalProtocolError, match="message header is 901 bytes"):
        encode_frame(6, b"h" * 901, limits=limits)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"XSN\x00" + spec_frame(6, b"", b"")[4:], "bad frame magic"),
        (spec_frame(6, b"", b"", flags=0x02), "unknown flags 0x02"),
        (spec_frame(6, b"", b"", reserved=1), "reserved field"),
        (spec_frame(6, b"", b"", version=2), "version 2 is not in the accepted range"),
        (spec_frame(6, b"", b"", version=0), "version 0"),
        (spec_frame(6, b"", b"x", flags=1, payload_check=5), "NO_PAYLOAD_CHECK"),
        (spec_frame(6, b"", b"x", payload_check=5), "payload check failed"),
    ],
)
def test_bad_fixed_header_fields(raw: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        FrameDecoder().feed(raw)


def test_handshake_types_are_accepted_in_any_version() -> None:
    for t in (1, 2, 3):
        [f] = FrameDecoder().feed(spec_frame(t, b"\x80", b"", version=200))
        assert f.version == 200
    with pytest.raises(RemoteProtocolError):
        FrameDecoder().feed(spec_frame(1, b"\x80", b"", version=0))


def test_set_version_pins_the_decoder() -> None:
    dec = FrameDecoder(min_version=1, max_version=3)
    assert len(dec.feed(spec_frame(6, b"", b"", version=3))) == 1
    dec.set_version(2)
    assert len(dec.feed(spec_frame(6, b"", b"", version=2))) == 1
    with pytest.raises(RemoteProtocolError, match="version 3"):
        dec.feed(spec_frame(6, b"", b"", version=3))


def test_every_single_bit_flip_is_detected_or_stalls() -> None:
    """A flipped bit never yields a frame: it raises, or (a grown length) waits for more."""
    good = spec_frame(6, b"\x81\xa1k\xa1v", b"payload!")
    for bit in range(len(good) * 8):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        dec = FrameDecoder()
        try:
            frames = dec.feed(bytes(bad))
        except RemoteProtocolError:
            continue
        assert frames == [], f"bit {bit} flipped went undetected"
        assert not dec.idle


def test_payload_corruption_is_not_detected_when_the_sender_skipped_the_check() -> None:
    good = bytearray(spec_frame(6, b"", b"payload", flags=FLAG_NO_PAYLOAD_CHECK))
    good[-1] ^= 1
    [f] = FrameDecoder().feed(bytes(good))
    assert not f.payload_checked and bytes(f.payload) == b"payloae"


def test_truncated_stream_yields_only_complete_frames() -> None:
    one = spec_frame(6, b"\x80", b"abc")
    stream = one * 3
    for cut in range(len(stream)):
        dec = FrameDecoder()
        frames = dec.feed(stream[:cut])
        assert len(frames) == cut // len(one)
        assert dec.idle == (cut % len(one) == 0)


def test_errors_are_sticky() -> None:
    dec = FrameDecoder()
    with pytest.raises(RemoteProtocolError) as first:
        dec.feed(b"garbage" * 10)
    with pytest.raises(RemoteProtocolError) as second:
        dec.feed(spec_frame(6, b"", b""))
    assert second.value is first.value


def test_encoder_rejects_bad_arguments() -> None:
    with pytest.raises(LocalProtocolError, match="version 0"):
        encode_frame(6, b"", version=0)
    with pytest.raises(LocalProtocolError, match="message type 70000"):
        encode_frame(70000, b"")
    with pytest.raises(LocalProtocolError, match="C-contiguous"):
        encode_frame(14, b"", [np.arange(10, dtype=np.uint8)[::2]])


@given(st.binary(max_size=400), st.lists(st.integers(0, 400), max_size=5))
@settings(max_examples=300, deadline=None)
def test_random_bytes_raise_only_protocol_errors(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(Limits(max_frame_bytes=1 << 16, max_header_bytes=1 << 12))
    with contextlib.suppress(ProtocolError):
        decode_all(dec, chunked(data, cuts))
    assert dec.buffered <= 1 << 16


def receive_buffered(dec: FrameDecoder, stream: bytes, reads: list[int]) -> list[Frame]:
    """Drive the decoder like asyncio.BufferedProtocol: get_buffer, write, buffer_updated."""
    frames: list[Frame] = []
    pos, i = 0, 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        n = min(len(buf), len(stream) - pos, reads[i % len(reads)] if reads else len(buf))
        i += 1
        buf[:n] = stream[pos : pos + n]
        pos += n
        frames += dec.buffer_updated(n)
    return frames


@given(
    frames=st.lists(
        st.tuples(st.binary(max_size=40), st.binary(max_size=3000), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    reads=st.lists(st.integers(1, 5000), max_size=6),
    direct=st.sampled_from([1, 100, 1 << 20]),
)
@settings(max_examples=100, deadline=None)
def test_buffered_protocol_round_trip(
    frames: list[tuple[bytes, bytes, bool]], reads: list[int], direct: int
) -> None:
    stream = b"".join(frame_bytes(encode_frame(6, h, [p], payload_check=c)) for h, p, c in frames)
    dec = FrameDecoder(direct_bytes=direct, scratch_bytes=512)
    got = receive_buffered(dec, stream, reads)
    assert [(f.header, bytes(f.payload)) for f in got] == [(h, p) for h, p, _ in frames]
    assert dec.idle


def test_buffered_protocol_receives_big_payloads_in_place() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    stream = frame_bytes(encode_frame(14, b"\x80", [payload]))
    dec = FrameDecoder()
    views: list[memoryview] = []
    frames: list[Frame] = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        views.append(buf)
        n = min(len(buf), 65536, len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        frames += dec.buffer_updated(n)
    [f] = frames
    assert bytes(f.payload) == payload
    # Except for the read that carried the headers and a tail under direct_bytes, the kernel
    # would write straight into the frame's payload buffer.
    in_place = [v.obj is f.payload.obj for v in views]
    assert in_place[0] is False and sum(in_place) == len(views) - 2
    # A corrupted payload received in place is still caught by the payload check.
    bad = bytearray(stream)
    bad[-1] ^= 1
    with pytest.raises(RemoteProtocolError, match="payload check failed"):
        receive_buffered(FrameDecoder(), bytes(bad), [65536])


def test_buffered_protocol_checks_limits_before_handing_out_a_payload_buffer() -> None:
    dec = FrameDecoder(Limits(max_frame_bytes=1000))
    buf = dec.get_buffer(-1)
    head = spec_frame(14, b"", b"", payload_len=5000)[:FIXED_HEADER_SIZE]
    buf[:FIXED_HEADER_SIZE] = head
    with pytest.raises(LimitExceeded):
        dec.buffer_updated(FIXED_HEADER_SIZE)
    with pytest.raises(LimitExceeded):
        dec.get_buffer(-1)
