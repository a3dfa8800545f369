"""FrameDecoder's bounds for a transport: set_limits, hold/resume (decide a connection's limits
after its first frame, however the stream is chunked), frame_bytes, release."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import LimitExceeded, LocalProtocolError
from protocol.frames import FIXED_HEADER_SIZE, FrameDecoder, encode_frame, frame_bytes
from protocol.limits import DEFAULT_LIMITS, Limits

SMALL = DEFAULT_LIMITS.for_preauth()


def _frames(sizes: list[int]) -> bytes:
    return b"".join(frame_bytes(encode_frame(20, b"\x80", [bytes([i % 251]) * n]))
                    for i, n in enumerate(sizes))


def test_for_preauth_and_for_control_bound_frames_and_headers() -> None:
    assert SMALL.max_frame_bytes == SMALL.max_header_bytes == 64 << 10
    ctl = DEFAULT_LIMITS.for_control()
    assert ctl.max_frame_bytes == ctl.max_header_bytes == 1 << 20
    assert ctl.max_string_bytes == DEFAULT_LIMITS.max_string_bytes  # only frames change
    tiny = Limits(max_frame_bytes=1000, max_header_bytes=500)
    assert tiny.for_control().max_frame_bytes == 1000  # never above the base limits


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(min_value=1, max_value=300_000), max_size=30),
       direct=st.booleans())
def test_hold_stops_after_the_first_frame_in_any_chunking(cuts: list[int], direct: bool) -> None:
    """First a small frame under the small limits, then (after resume with the large limits)
    frames far above them: the same frames come out whatever the read boundaries were."""
    sizes = [100, 200_000, 0, 70_000, 3]
    stream = _frames(sizes)
    dec = FrameDecoder(SMALL, direct_bytes=64 << 10)
    dec.hold = True
    got: list[int] = []
    pos = 0
    resumed = False
    for n in [*cuts, len(stream)]:
        if pos >= len(stream):
            break
        chunk = stream[pos : pos + n]
        pos += len(chunk)
        if direct:
            off = 0
            while off < len(chunk):
                buf = dec.get_buffer(-1)
                k = min(len(buf), len(chunk) - off)
                buf[:k] = chunk[off : off + k]
                off += k
                out = dec.buffer_updated(k)
                got.extend(f.payload.nbytes for f in out)
                if out and not resumed:
                    dec.set_limits(DEFAULT_LIMITS)
                    resumed = True
                    got.extend(f.payload.nbytes for f in dec.resume())
        else:
            out = dec.feed(chunk)
            got.extend(f.payload.nbytes for f in out)
            if out and not resumed:
                dec.set_limits(DEFAULT_LIMITS)
                resumed = True
                got.extend(f.payload.nbytes for f in dec.resume())
    assert got == sizes


def test_without_resume_the_next_large_frame_is_refused_under_the_small_limits() -> None:
    dec = FrameDecoder(SMALL)
    with pytest.raises(LimitExceeded, match="limit is 65536"):
        dec.feed(_frames([10, 100_000]))


def test_bytes_held_past_a_read_are_bounded() -> None:
    dec = FrameDecoder(SMALL)
    dec.hold = True
    assert len(dec.feed(_frames([10]))) == 1
    dec.feed(bytes(60_000))
    with pytest.raises(LimitExceeded, match="before the first frame was answered"):
        dec.feed(bytes(10_000))


def test_frame_bytes_and_release() -> None:
    stream = _frames([1 << 20])
    dec = FrameDecoder()
    assert dec.frame_bytes is None
    dec.feed(stream[:30])
    assert dec.frame_bytes is None  # fixed header incomplete
    dec.feed(stream[30:5000])
    assert dec.frame_bytes == FIXED_HEADER_SIZE + 1 + (1 << 20) and not dec.idle
    assert dec.buffered > 4000
    buf = dec._payload
    assert isinstance(buf, np.ndarray)
    dec.release()
    assert dec.buffered == 0 and dec._payload is None and dec.frame_bytes is None
    with pytest.raises(LocalProtocolError, match="released"):
        dec.feed(stream[5000:])
