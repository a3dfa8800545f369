"""Frames: the fixed header, the gather-list encoder and the streaming `FrameDecoder`.

A frame on the wire is three parts, back to back (docs/protocol.md is the byte-level spec):

    fixed header (40 bytes) | message header (msgpack, `header_len` bytes) | payload (`payload_len`)

Fixed header, all integers little-endian:

    offset size field
    0      4    magic            b"FSN\\x00"
    4      1    version          protocol version this frame is written in
    5      1    flags            bit 0: NO_PAYLOAD_CHECK; bits 1..7 reserved, must be 0
    6      2    type             message type id (u16)
    8      4    header_len       u32, length of the msgpack message header
    12     4    reserved         u32, must be 0
    16     8    payload_len      u64
    24     8    payload_check    u64, xxh3_64(payload); 0 when NO_PAYLOAD_CHECK is set
    32     8    header_check     u64, xxh3_64(fixed[0:32] + message header), always present

The header check covers the lengths and the payload check, and is verified before a single
payload byte is buffered, so a corrupted length is caught before it can make us allocate.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

from protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

Buffer = bytes | bytearray | memoryview
"""What the encoder accepts as payload and the decoder accepts as input (any C-contiguous
buffer works at run time, e.g. a numpy array; this alias is for type checking)."""

MAGIC: Final = b"FSN\x00"
FIXED_HEADER_SIZE: Final = 40
FLAG_NO_PAYLOAD_CHECK: Final = 0x01
"""The sender did not checksum the payload (the link already guarantees integrity, e.g. TLS)."""
KNOWN_FLAGS: Final = FLAG_NO_PAYLOAD_CHECK

HANDSHAKE_TYPES: Final = frozenset({1, 2, 3})
"""Hello, HelloAck and Refuse: their frames are accepted in any version >= 1, because they are
exchanged before a version is agreed (their layout and schema are frozen for all versions)."""

_PREFIX: Final = struct.Struct("<4sBBHIIQQ")  # everything the header check covers (32 bytes)
_FIXED: Final = struct.Struct("<4sBBHIIQQQ")
_MAX_U64: Final = (1 << 64) - 1
_EMPTY: Final = memoryview(b"")

assert _PREFIX.size == 32 and _FIXED.size == FIXED_HEADER_SIZE


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its checks passed and its lengths were within limits.

    `header` is the msgpack message header; `payload` is a memoryview into either the bytes
    object passed to `FrameDecoder.feed` (zero-copy) or a buffer owned by this frame.
    """

    version: int
    msg_type: int
    flags: int
    header: bytes
    payload: memoryview

    @property
    def payload_checked(self) -> bool:
        """Whether the payload's xxh3 checksum was present (and therefore verified)."""
        return not self.flags & FLAG_NO_PAYLOAD_CHECK


def _as_bytes_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of `buf`, without copying; LocalProtocolError if impossible."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if not mv.c_contiguous:
        raise LocalProtocolError("payload buffer is not C-contiguous; copy it first")
    return mv.cast("B")


def encode_frame(
    msg_type: int,
    header: bytes,
    payload: Sequence[Buffer] = (),
    *,
    version: int = PROTOCOL_VERSION,
    payload_check: bool = True,
    limits: Limits = DEFAULT_LIMITS,
) -> list[bytes | memoryview]:
    """Build one frame as a gather list for `writelines`: [fixed+header bytes, *payload views].

    The payload buffers are not copied; the caller must not mutate them until written.
    `payload_check=False` sets NO_PAYLOAD_CHECK (only for links that guarantee integrity).
    Raises LocalProtocolError if a field is out of range or the frame exceeds `limits`.
    """
    if not 0 < version < 256:
        raise LocalProtocolError(f"frame version {version} is not in 1..255")
    if not 0 <= msg_type < 1 << 16:
        raise LocalProtocolError(f"message type {msg_type} is not in 0..65535")
    views = [_as_bytes_view(p) for p in payload]
    payload_len = sum(v.nbytes for v in views)
    header_len = len(header)
    if header_len > limits.max_header_bytes:
        raise LocalProtocolError(
            f"message header is {header_len} bytes, limit is {limits.max_header_bytes}"
        )
    total = FIXED_HEADER_SIZE + header_len + payload_len
    if total > limits.max_frame_bytes:
        raise LocalProtocolError(f"frame is {total} bytes, limit is {limits.max_frame_bytes}")
    flags = 0
    check = 0
    if payload_check:
        hasher = xxhash.xxh3_64()
        for v in views:
            hasher.update(v)
        check = hasher.intdigest()
    else:
        flags |= FLAG_NO_PAYLOAD_CHECK
    prefix = _PREFIX.pack(MAGIC, version, flags, msg_type, header_len, 0, payload_len, check)
    hcheck = xxhash.xxh3_64(prefix)
    hcheck.update(header)
    head = prefix + hcheck.intdigest().to_bytes(8, "little") + header
    out: list[bytes | memoryview] = [head]
    out.extend(v for v in views if v.nbytes)
    return out


def frame_bytes(parts: Iterable[Buffer]) -> bytes:
    """Join a gather list into one bytes object (tests and small control frames only)."""
    return b"".join(parts)


class FrameDecoder:
    """Streaming, sans-IO frame decoder: `feed(data)` in any chunking, whole frames out.

    Every declared length is checked against `limits` as soon as the 40-byte fixed header is
    in; the header check is verified before the payload is buffered; the payload buffer is
    allocated once at its declared size and filled in place (no quadratic concatenation).
    When a whole payload lies inside one `bytes` object given to `feed`, the frame's payload
    is a view into it (zero-copy).

    For asyncio's BufferedProtocol, `get_buffer()` / `buffer_updated(n)` do the same as
    `feed`, but let the transport receive a big payload straight into its final buffer.

    After the first error the decoder is broken: every later `feed` re-raises that error,
    because a byte stream cannot be resynchronised after a bad frame; close the connection.
    """

    def __init__(
        self,
        limits: Limits = DEFAULT_LIMITS,
        *,
        min_version: int = MIN_PROTOCOL_VERSION,
        max_version: int = PROTOCOL_VERSION,
        direct_bytes: int = 64 << 10,
        scratch_bytes: int = 256 << 10,
    ) -> None:
        self.limits = limits
        self.min_version = min_version
        self.max_version = max_version
        self.direct_bytes = max(1, direct_bytes)
        """`get_buffer` hands out the payload buffer itself when at least this much is left."""
        self._scratch_bytes = max(FIXED_HEADER_SIZE, scratch_bytes)
        self._scratch: memoryview | None = None
        self._direct = False
        self._error: ProtocolError | None = None
        # Fixed header + message header bytes of the frame in progress that arrived split
        # across feeds; bounded by FIXED_HEADER_SIZE + limits.max_header_bytes.
        self._head = bytearray()
        self._fixed: _Fixed | None = None
        self._header: bytes | None = None
        self._payload: npt.NDArray[np.uint8] | None = None
        self._payload_view: memoryview = _EMPTY
        self._filled = 0
        self._hasher: xxhash.xxh3_64 | None = None
        self.frames_decoded = 0
        self.bytes_fed = 0
        self.hold = False
        """Stop after the next complete frame: the bytes after it are held back, undecoded,
        until `resume()` (a transport decides the limits of a connection's later frames only
        once its first frame, the handshake, is handled)."""
        self._held = bytearray()
        self._held_later = 0
        self._holding = False

    def set_version(self, version: int) -> None:
        """Accept only `version` from now on (after the handshake agreed on it)."""
        self.min_version = self.max_version = version

    def set_limits(self, limits: Limits) -> None:
        """Apply `limits` from the next frame on (a transport tightens or relaxes the frame
        bound once it knows who the peer is and which lane the connection carries)."""
        self.limits = limits

    @property
    def frame_bytes(self) -> int | None:
        """Declared size (fixed header + message header + payload) of the frame in progress;
        None between frames and while its fixed header is still incomplete."""
        fixed = self._fixed
        if fixed is None:
            return None
        return FIXED_HEADER_SIZE + fixed.header_len + fixed.payload_len

    def resume(self) -> list[Frame]:
        """End `hold`: decode the bytes held back after the frame it stopped at (under the
        limits in force now) and return the frames they complete. Raises ProtocolError."""
        self.hold = False
        self._holding = False
        self._held_later = 0
        data = bytes(self._held)
        self._held = bytearray()
        self.bytes_fed -= len(data)  # counted when they arrived
        return self.feed(data) if data else []

    def release(self) -> None:
        """Drop every buffer of the frame in progress (the connection is gone) and break the
        decoder: later calls raise. Idempotent."""
        if self._error is None:
            self._error = LocalProtocolError("the decoder was released (connection closed)")
        self._head = bytearray()
        self._fixed = None
        self._header = None
        self._payload = None
        self._payload_view = _EMPTY
        self._filled = 0
        self._hasher = None
        self._scratch = None
        self._held = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of the frame in progress held by the decoder (for stats and tests)."""
        return len(self._head) + self._filled

    @property
    def idle(self) -> bool:
        """True between frames: no partial frame is buffered (a clean place to close)."""
        return not self._head and self._fixed is None

    def feed(self, data: Buffer, *, owned: bool = False) -> list[Frame]:
        """Consume `data`; return the frames it completed, in order. Raises ProtocolError.

        `owned=True`: the caller hands `data` over and never mutates it again, so payloads
        that lie wholly inside it are views into it even if it is not `bytes` (a transport
        that receives a large payload straight into a buffer of its own uses this).
        """
        if self._error is not None:
            raise self._error
        try:
            if self._holding:
                self._hold_back(_as_bytes_view(data))
                return []
            return self._feed(data, owned)
        except ProtocolError as exc:
            self._error = exc
            raise

    # -- asyncio.BufferedProtocol style: receive straight into the payload ------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should be written (`BufferedProtocol.get_buffer`).

        In the middle of a payload with at least `direct_bytes` left, this is the unfilled
        part of that frame's own payload buffer, so the bytes land in their final place (the
        decoder allocates it here, after the limit and header checks); otherwise a reused
        scratch buffer. Call `buffer_updated(n)` after writing `n` bytes at its start.
        """
        if self._error is not None:
            raise self._error
        fixed = self._fixed
        if (
            fixed is not None
            and self._header is not None
            and not self._holding
            and fixed.payload_len - self._filled >= self.direct_bytes
        ):
            if self._payload is None:
                self._allocate_payload(fixed)
            self._direct = True
            return self._payload_view[self._filled :]
        self._direct = False
        if self._scratch is None:
            self._scratch = memoryview(bytearray(self._scratch_bytes))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """`nbytes` were written at the start of the last `get_buffer`; the frames completed."""
        if self._error is not None:
            raise self._error
        try:
            if not self._direct:
                assert self._scratch is not None, "buffer_updated() without get_buffer()"
                if self._holding:
                    self._hold_back(self._scratch[:nbytes])
                    return []
                # The scratch buffer is reused, so _feed copies payload bytes out of it.
                return self._feed(self._scratch[:nbytes])
            self._direct = False
            fixed = self._fixed
            assert fixed is not None
            if not 0 <= nbytes <= fixed.payload_len - self._filled:
                raise LocalProtocolError(f"buffer_updated({nbytes}) overruns the buffer")
            if self._hasher is not None:
                self._hasher.update(self._payload_view[self._filled : self._filled + nbytes])
            self._filled += nbytes
            self.bytes_fed += nbytes
            if self._filled < fixed.payload_len:
                return []
            frame = self._finish(self._payload_view, self._hasher)
            self._holding = self.hold
            return [frame]
        except ProtocolError as exc:
            self._error = exc
            raise

    # -- internals -----------------------------------------------------------------------

    def _allocate_payload(self, fixed: _Fixed) -> None:
        # Safe to allocate: the length passed the limits and the header check.
        # np.empty, not bytearray(n): every byte is overwritten, and bytearray's zero-fill
        # touches each page twice (measured: 2x slower for 64 MiB).
        self._payload = np.empty(fixed.payload_len, dtype=np.uint8)
        self._payload_view = self._payload.data  # a flat "B" memoryview
        self._filled = 0
        if fixed.checked:
            self._hasher = xxhash.xxh3_64()

    def _feed(self, data: Buffer, owned: bool = False) -> list[Frame]:
        # Only an immutable bytes object (or an owned buffer) may be viewed past this call;
        # anything else may be reused by the caller, so payloads from it are copied.
        zero_copy = owned or type(data) is bytes
        mv = _as_bytes_view(data)
        end = mv.nbytes
        self.bytes_fed += end
        pos = 0
        frames: list[Frame] = []
        while True:
            fixed = self._fixed
            if fixed is None:
                raw, pos = self._take(mv, pos, FIXED_HEADER_SIZE)
                if raw is None:
                    return frames
                fixed = self._fixed = self._parse_fixed(raw)
            if self._header is None:
                raw, pos = self._take(mv, pos, fixed.header_len)
                if raw is None:
                    return frames
                self._header = bytes(raw)
                self._check_header(fixed, self._header)
            if self._payload is None:
                if fixed.payload_len == 0:
                    frames.append(self._finish(_EMPTY, None))
                    if self.hold:
                        return self._stop(frames, mv, pos)
                    continue
                if zero_copy and end - pos >= fixed.payload_len:
                    view = mv[pos : pos + fixed.payload_len]
                    pos += fixed.payload_len
                    frames.append(self._finish(view, None))
                    if self.hold:
                        return self._stop(frames, mv, pos)
                    continue
                if pos == end:
                    return frames
                self._allocate_payload(fixed)
            take = min(fixed.payload_len - self._filled, end - pos)
            chunk = mv[pos : pos + take]
            self._payload_view[self._filled : self._filled + take] = chunk
            if self._hasher is not None:
                # Hash while the chunk is hot in cache instead of a second pass at the end.
                self._hasher.update(chunk)
            self._filled += take
            pos += take
            if self._filled < fixed.payload_len:
                return frames
            frames.append(self._finish(self._payload_view, self._hasher))
            if self.hold:
                return self._stop(frames, mv, pos)

    def _stop(self, frames: list[Frame], mv: memoryview, pos: int) -> list[Frame]:
        """`hold`: a frame is complete; keep the rest of this input (and what follows, until
        `resume`) undecoded."""
        self._holding = True
        self._hold_back(mv[pos:], counted=True)
        return frames

    def _hold_back(self, data: memoryview, *, counted: bool = False) -> None:
        # The rest of the input that completed the frame is bounded by the caller's read; a
        # peer that keeps sending before `resume` gets at most one more frame's worth held.
        self._held += data
        if not counted:
            self.bytes_fed += data.nbytes
            self._held_later += data.nbytes
            self.limits.check("bytes sent before the first frame was answered",
                              self._held_later, self.limits.max_frame_bytes)

    def _take(self, mv: memoryview, pos: int, need: int) -> tuple[memoryview | None, int]:
        """`need` bytes starting at `pos`, gathered across feeds; (None, end) if not all in."""
        if not self._head and mv.nbytes - pos >= need:
            return mv[pos : pos + need], pos + need
        take = min(need - len(self._head), mv.nbytes - pos)
        self._head += mv[pos : pos + take]
        pos += take
        if len(self._head) < need:
            return None, pos
        raw = bytes(self._head)
        self._head.clear()
        return memoryview(raw), pos

    def _parse_fixed(self, raw: memoryview) -> _Fixed:
        magic, version, flags, msg_type, header_len, reserved, payload_len, pcheck, hcheck = (
            _FIXED.unpack(raw)
        )
        if magic != MAGIC:
            raise RemoteProtocolError(f"bad frame magic {bytes(magic)!r}, expected {MAGIC!r}")
        if msg_type in HANDSHAKE_TYPES:
            if version < 1:
                raise RemoteProtocolError(f"frame version {version} is invalid")
        elif not self.min_version <= version <= self.max_version:
            raise RemoteProtocolError(
                f"frame version {version} is not in the accepted range "
                f"{self.min_version}..{self.max_version}"
            )
        if flags & ~KNOWN_FLAGS:
            raise RemoteProtocolError(f"frame has unknown flags 0x{flags:02x}")
        if reserved:
            raise RemoteProtocolError(f"frame reserved field is {reserved}, must be 0")
        if flags & FLAG_NO_PAYLOAD_CHECK and pcheck:
            raise RemoteProtocolError("frame has a payload check although NO_PAYLOAD_CHECK is set")
        lim = self.limits
        lim.check("frame message header length", header_len, lim.max_header_bytes)
        lim.check("frame payload length", payload_len, lim.max_frame_bytes)
        lim.check("frame length", FIXED_HEADER_SIZE + header_len + payload_len, lim.max_frame_bytes)
        return _Fixed(
            bytes(raw[:32]), version, flags, msg_type, header_len, payload_len, pcheck, hcheck
        )

    @staticmethod
    def _check_header(fixed: _Fixed, header: bytes) -> None:
        hasher = xxhash.xxh3_64(fixed.prefix)
        hasher.update(header)
        computed = hasher.intdigest()
        if computed != fixed.header_check:
            raise RemoteProtocolError(
                f"frame header check failed for message type {fixed.msg_type}: declared "
                f"{fixed.header_check:016x}, computed {computed:016x}; the header is corrupt"
            )

    def _finish(self, payload: memoryview, hasher: xxhash.xxh3_64 | None) -> Frame:
        fixed = self._fixed
        header = self._header
        assert fixed is not None and header is not None
        if fixed.checked:
            computed = (
                hasher.intdigest() if hasher is not None else xxhash.xxh3_64_intdigest(payload)
            )
            if computed != fixed.payload_check:
                raise RemoteProtocolError(
                    f"payload check failed for message type {fixed.msg_type} ({payload.nbytes} "
                    f"bytes): declared {fixed.payload_check:016x}, computed {computed:016x}"
                )
        frame = Frame(fixed.version, fixed.msg_type, fixed.flags, header, payload)
        self._fixed = None
        self._header = None
        self._payload = None
        self._payload_view = _EMPTY
        self._filled = 0
        self._hasher = None
        self.frames_decoded += 1
        return frame


@dataclass(frozen=True, slots=True)
class _Fixed:
    """A parsed fixed header whose lengths passed the limits (header check not yet verified)."""

    prefix: bytes
    version: int
    flags: int
    msg_type: int
    header_len: int
    payload_len: int
    payload_check: int
    header_check: int

    @property
    def checked(self) -> bool:
        return not self.flags & FLAG_NO_PAYLOAD_CHECK
