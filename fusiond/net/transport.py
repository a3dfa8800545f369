"""Peer links: `PeerNetwork`, the transport the cluster and training use.

Design (docs/security.md and docs/daemon.md say why):

- Connections are one-directional for data: a node sends only on connections it dialed and
  receives only on connections it accepted. That needs no tie-break between two nodes dialing
  each other at once, and a reconnect is always the sender's business.
- Two TCP (or TLS) connections per direction and peer, one per lane. CONTROL frames therefore
  never queue behind tensor bytes in a socket buffer, in the kernel or in TLS; on top of that
  each connection's writer writes BULK frames in chunks (`NetConfig.bulk_chunk_bytes`) and waits
  for the transport to drain between chunks, so the event loop serves the control writer and the
  readers between chunks and a 64 MiB tensor is never copied into a transport buffer whole.
- Each lane has a bounded queue per peer; `send()` awaits while it is full (backpressure), and
  the writer waits for `drain` (the transport's high-water mark) before writing more.
- Connections open lazily on the first send (or `connect()`); a failed dial drops what was queued
  for that lane (counted in `PeerStats.dropped`, so a dead peer never blocks its senders) and the
  next dial waits a jittered exponential backoff.
- Handshake on every connection: the dialer sends Hello (node id, cluster id, the versions it
  speaks, its listen address); the listener answers HelloAck (its node id, the chosen version:
  the highest common one) or Refuse (the reason, naming both version ranges / cluster ids) and
  closes. With TLS the node id claimed in Hello must equal the one in the peer's verified
  certificate.
- Reading: each accepted connection feeds a `FrameDecoder`; decoded messages go to an inbox
  bounded in frames and bytes (`inbox_frames`, `inbox_bytes`), drained by one task that awaits
  `handler(peer, msg)`; reading pauses while the inbox is full (TCP backpressure to the
  sender). A handler error is logged and never kills the reader. Bad bytes, a refused
  handshake, or a peer closing mid-frame close *that* connection with one log line; the
  network keeps serving everyone else.
- Bounded before authenticated: until an accepted connection's peer is authenticated (TLS
  certificate and Hello checked), its decoder accepts frames of at most
  `Limits.max_preauth_frame_bytes` (a Hello or a JoinRequest; nothing larger is allocated for
  a stranger); a dialed connection, which only ever reads the listener's HelloAck, keeps that
  bound. The dialer names the lane in Hello's capabilities (`lane=control` / `lane=bulk`), and
  the listener then bounds a CONTROL connection's frames by `Limits.max_control_frame_bytes`.
- A frame in progress has a deadline, `max(frame_deadline_floor_s, frame_deadline_factor x
  frame bytes / the peer's link rate)` (`set_link_rate`, fed by the cluster's probes; a
  conservative `default_link_bytes_per_s` until then), not counting time we paused reading;
  past it the connection is aborted and the partial buffer freed (and glibc asked to return
  it to the OS).
- Slow-loris: connections still in their handshake are capped per source address
  (`max_pending_handshakes_per_source`) and in total (`max_pending_handshakes`), and the last
  `member_handshake_reserve` slots are kept for addresses members were authenticated from, so
  a flood of strangers never starves members' reconnections. Authenticated connections are
  capped per peer and lane (`max_inbound_per_peer_lane`): a new one closes the oldest, so a
  reconnecting peer always gets through while its stale sockets go.
- Logging about refused and closed connections is rate-limited per source (or peer) and kind
  (`RefusalLog`): a few lines per interval, then one summary line. Refusals by the TLS
  handshake or the trust check, and refused join requests, are counted too (`counts()`:
  /metrics reads them).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from cryptography.hazmat.primitives import serialization

from fusiond.defaults import NetSection as _NET
from fusiond.errors import ConfigError, FusionError, LocalError, RemoteError, SelfAddress, describe
from fusiond.net import tls as tlsmod
from fusiond.net.pki import (
    JOIN_REFUSAL_REASONS,
    JoinAuthority,
    JoinTokenError,
    PKIError,
    TLSMaterial,
)
from fusiond.tasks import raise_if_cancelling
from protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from protocol.errors import ProtocolError
from protocol.frames import FIXED_HEADER_SIZE, Frame, FrameDecoder
from protocol.handshake import Handshake, HandshakeRefused, Role
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    HelloAck,
    JoinRequest,
    JoinResponse,
    Lane,
    Message,
    Refuse,
    decode_message,
    encode_message,
)

log = logging.getLogger("fusiond.net")

__all__ = [
    "TLS_REFUSAL_CHECKS",
    "Lane",
    "NetConfig",
    "NetCounts",
    "PeerNetwork",
    "PeerRefused",
    "PeerStats",
    "PeerUnreachable",
    "UnknownPeer",
    "tune_allocator",
]

Buffer = bytes | bytearray | memoryview
Handler = Callable[[str, Message], Awaitable[None]]
Address = tuple[str, int]

_MiB: Final = 1 << 20
REFUSE_SELF: Final = "self"
"""Refuse code: the dialer is this node itself (it dialled its own address)."""


class PeerRefused(RemoteError):
    """The peer refused our handshake (or we refused theirs); the message names the reason."""


class PeerUnreachable(RemoteError):
    """We could not open a connection to the peer's address."""


class DialedSelf(PeerRefused, SelfAddress):
    """The address we dialled is this node itself (the listener said so, or its HelloAck
    named us)."""


class UnknownPeer(LocalError):
    """`send()` to a node whose address we never learned (via connect or add_peer_address)."""


@dataclass(frozen=True)
class NetConfig:
    """Every knob of the transport. The defaults are the daemon's (`fusiond.defaults.NetSection`,
    ``[net]`` in fusiond.toml); tests shrink the timeouts."""

    connect_timeout_s: float = _NET.connect_timeout_s
    handshake_timeout_s: float = _NET.handshake_timeout_s
    backoff_initial_s: float = _NET.backoff_initial_s
    backoff_max_s: float = _NET.backoff_max_s
    backoff_jitter: float = _NET.backoff_jitter
    """Each backoff delay is multiplied by a uniform factor in [1 - jitter, 1 + jitter]."""
    control_queue_frames: int = _NET.control_queue_frames
    bulk_queue_frames: int = _NET.bulk_queue_frames
    inbox_frames: int = _NET.inbox_frames
    """Decoded messages waiting for the handler per connection before reading pauses."""
    inbox_bytes: int = _NET.inbox_bytes
    """Bytes of decoded frames waiting for the handler per connection before reading pauses
    (a single larger frame still gets through, alone)."""
    bulk_chunk_bytes: int = _NET.bulk_chunk_bytes
    direct_payload_bytes: int = _NET.direct_payload_bytes
    """Payloads at least this large are received straight into their own buffer."""
    write_high_water_bytes: int = _NET.write_high_water_bytes
    limits: Limits = DEFAULT_LIMITS
    payload_check: bool | None = None
    """xxh3 over payloads. None = only where nothing else guarantees integrity: plaintext links
    to a non-loopback address (TLS authenticates every record; loopback has no wire)."""
    allow_plaintext_remote: bool = _NET.allow_plaintext_remote
    """Plaintext is for loopback development; this must be set to listen on anything else."""
    close_timeout_s: float = _NET.close_timeout_s
    tune_allocator: bool = _NET.tune_allocator
    """Call `tune_allocator()` at start (glibc: reuse freed frame buffers, see there)."""
    max_pending_handshakes: int = _NET.max_pending_handshakes
    """Accepted connections still in TLS/Hello; more are closed at once (slow-loris guard)."""
    max_pending_handshakes_per_source: int = _NET.max_pending_handshakes_per_source
    """Connections still in their handshake from one address that never authenticated here;
    more from it are closed at once. Member addresses are bound only by the total."""
    member_handshake_reserve: int = _NET.member_handshake_reserve
    """Of `max_pending_handshakes`, slots only addresses of known members may take, so
    strangers (however many addresses they use) never starve members' reconnections."""
    max_inbound_per_peer_lane: int = _NET.max_inbound_per_peer_lane
    """Authenticated accepted connections per peer and lane; a new one closes the oldest (a
    restarted peer's new links win over its stale ones)."""
    frame_deadline_floor_s: float = _NET.frame_deadline_floor_s
    """A frame whose first bytes arrived must be complete within max(this, factor x its bytes
    / the link's rate); reading paused by us does not count."""
    frame_deadline_factor: float = _NET.frame_deadline_factor
    default_link_bytes_per_s: float = _NET.default_link_bytes_per_s
    """The link rate assumed for frame deadlines until `set_link_rate` reports one (1 Mbit/s:
    conservative, so a slow link is never cut off)."""
    refusal_log_interval_s: float = _NET.refusal_log_interval_s
    """Refused/closed-connection warnings: at most `refusal_log_burst` lines per source and
    kind per interval, then one summary line at its end."""
    refusal_log_burst: int = _NET.refusal_log_burst
    versions: tuple[int, int] = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
    """(min, max) protocol versions this node speaks (tests narrow it to provoke a refusal)."""


@dataclass
class PeerStats:
    """A snapshot of one peer link (both lanes, both directions)."""

    node_id: str
    address: Address | None
    connected: bool
    """Our CONTROL connection to the peer is up (handshake done)."""
    inbound: int
    """Accepted connections from the peer that are up."""
    bytes_sent: int
    bytes_received: int
    frames_sent: int
    frames_received: int
    control_queue_depth: int
    bulk_queue_depth: int
    reconnects: int
    dropped: int
    """Frames dropped: queued when a dial failed, or blocked by `set_blocked`."""
    last_error: str | None


TLS_REFUSAL_CHECKS = ("handshake", "identity", "removed", "no_certificate")
"""What refused a peer's connection (either side of it): the TLS `handshake` (no certificate
of this cluster, or none where one is required), its `identity` (a node id its certificate
does not carry), the certificate of a `removed` member, or a message other than a
JoinRequest sent with `no_certificate`."""


@dataclass(frozen=True)
class NetCounts:
    """Counters of the whole transport since it started (a snapshot)."""

    tls_refusals: dict[str, int]
    """`TLS_REFUSAL_CHECKS` -> connections refused by it."""
    join_refusals: dict[str, int]
    """`pki.JOIN_REFUSAL_REASONS` -> join requests refused for it."""


_SEND_NOW_HEADER_BYTES = 4096
"""What `send_now` leaves of a bulk chunk for the frame's header (a Forward's is ~100 bytes)."""


@dataclass
class _Out:
    parts: list[bytes | memoryview]
    nbytes: int
    done: asyncio.Future[None] | None = None


@dataclass
class _Peer:
    node_id: str
    address: Address | None
    queues: dict[Lane, asyncio.Queue[_Out]]
    links: dict[Lane, _Conn | None] = field(default_factory=lambda: {Lane.CONTROL: None,
                                                                     Lane.BULK: None})
    writers: dict[Lane, asyncio.Task[None]] = field(default_factory=dict)
    writing: dict[Lane, bool] = field(default_factory=lambda: {Lane.CONTROL: False,
                                                               Lane.BULK: False})
    """A lane's writer holds a frame it took from the queue and has not written yet."""
    inbound: set[_Conn] = field(default_factory=set)
    backoff: dict[Lane, float] = field(default_factory=lambda: {Lane.CONTROL: 0.0, Lane.BULK: 0.0})
    next_dial: dict[Lane, float] = field(default_factory=lambda: {Lane.CONTROL: 0.0,
                                                                  Lane.BULK: 0.0})
    dial_lock: dict[Lane, asyncio.Lock] = field(
        default_factory=lambda: {Lane.CONTROL: asyncio.Lock(), Lane.BULK: asyncio.Lock()}
    )
    ever_connected: set[Lane] = field(default_factory=set)
    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0
    reconnects: int = 0
    dropped: int = 0
    last_error: str | None = None
    version: int = PROTOCOL_VERSION
    """The protocol version agreed on our last handshake with this peer."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_M_TRIM_THRESHOLD: Final = -1
_M_MMAP_THRESHOLD: Final = -3
_allocator_tuned = False


def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 512 << 20) -> bool:
    """Let glibc reuse freed large buffers instead of mapping fresh pages for every frame.

    By default glibc serves allocations above 32 MiB with mmap and unmaps them on free, so
    every 64 MiB tensor received costs ~16k page faults plus the kernel zeroing the pages
    (measured here: receiving into a fresh buffer runs at half the speed of receiving into a
    reused one). With the mmap threshold above the largest frame, freed payload buffers go
    back to the heap and the next frame reuses them; the trim threshold keeps up to
    `trim_threshold` of free heap before returning it to the OS. Process-wide, idempotent;
    returns False where it does not apply (not glibc).
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold)
        )
    except (OSError, AttributeError):
        return False
    _allocator_tuned = ok
    return ok


def _keepalive(sock: Any) -> None:
    """TCP keepalive, so a peer that vanished without a FIN is noticed within minutes."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 15)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 4)


def _malloc_trim() -> None:
    """glibc: return free heap pages to the OS (blocking: run it in a thread)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _check_config(c: NetConfig) -> None:
    """ConfigError naming the first NetConfig value that cannot work."""
    if c.versions[0] > c.versions[1]:
        raise ConfigError(f"net versions {c.versions}: min is above max")
    positive = ("inbox_frames", "inbox_bytes", "max_pending_handshakes",
                "max_pending_handshakes_per_source", "max_inbound_per_peer_lane",
                "frame_deadline_floor_s", "frame_deadline_factor", "default_link_bytes_per_s",
                "refusal_log_interval_s")
    for name in positive:
        if not getattr(c, name) > 0:
            raise ConfigError(f"net.{name} = {getattr(c, name)!r}: must be positive")
    if not 0 <= c.member_handshake_reserve < c.max_pending_handshakes:
        raise ConfigError(
            f"net.member_handshake_reserve = {c.member_handshake_reserve}: must be at least 0 "
            f"and below net.max_pending_handshakes ({c.max_pending_handshakes})")
    if c.refusal_log_burst < 0:
        raise ConfigError(f"net.refusal_log_burst = {c.refusal_log_burst}: must be >= 0")


def _log_crash(task: asyncio.Task[None]) -> None:
    """A writer that died of a bug says so (the next send() starts a new one)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed", task.get_name(), exc_info=task.exception())


def _fmt(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return str(addr)


_LANE_CAPABILITY: Final = {Lane.CONTROL: "lane=control", Lane.BULK: "lane=bulk"}
"""Hello capability naming the lane of the connection it opens (the listener bounds frames by
lane); a Hello without one (an older peer) gets the BULK limits."""


def _lane_of(capabilities: Sequence[str]) -> Lane | None:
    for lane, cap in _LANE_CAPABILITY.items():
        if cap in capabilities:
            return lane
    return None


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    last: str = ""


class RefusalLog:
    """Rate-limited warnings about refused or closed connections; pure (takes `now`).

    Per (key, kind) (key: a source address, or an authenticated peer's node id; kind: "busy",
    "tls", "timeout", "frame", "refused", ...), the first `burst` events of an interval are
    logged one line each; the rest are counted and summarised in one line when the interval
    ends. At most `max_keys` keys are tracked; events of further keys share one key.
    """

    def __init__(self, interval_s: float = 10.0, burst: int = 5, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self.max_keys = max_keys
        self._windows: dict[tuple[str, str], _Window] = {}
        self._first_end = float("inf")
        """When the oldest window's interval ends (due() has nothing to do before)."""

    def note(self, key: str, kind: str, line: str, now: float) -> str | None:
        """Record one event; the line to log now, or None (it counts toward a summary)."""
        k = (key, kind)
        w = self._windows.get(k)
        if w is None:
            if len(self._windows) >= self.max_keys:
                k = ("other sources", kind)
                w = self._windows.get(k)
            if w is None:
                w = self._windows[k] = _Window(now)
                self._first_end = min(self._first_end, now + self.interval_s)
        if w.logged < self.burst:
            w.logged += 1
            return line
        w.suppressed += 1
        w.last = line
        return None

    def due(self, now: float) -> list[str]:
        """Summary lines of the intervals that ended by `now` (their windows are dropped)."""
        out: list[str] = []
        if now < self._first_end:
            return out  # a flood of refusals costs O(1) each, not a scan of every source
        self._first_end = float("inf")
        for k, w in list(self._windows.items()):
            if now - w.start < self.interval_s:
                self._first_end = min(self._first_end, w.start + self.interval_s)
                continue
            del self._windows[k]
            if w.suppressed:
                out.append(f"{w.suppressed} more connection(s) from {k[0]} refused or closed "
                           f"({k[1]}) in the last {self.interval_s:g} s; the last: {w.last}")
        return out

    def next_due(self) -> float | None:
        """When the earliest interval with a summary to write ends (None: nothing pending)."""
        ends = [w.start + self.interval_s for w in self._windows.values() if w.suppressed]
        return min(ends) if ends else None


class _Slot:
    """One accepted connection's place among those still in their handshake."""

    def __init__(self, net: PeerNetwork, host: str) -> None:
        self.net = net
        self.host = host
        self.held = True
        net._handshaking[host] = net._handshaking.get(host, 0) + 1
        net._handshaking_total += 1

    def release(self) -> None:
        """Give the place back (idempotent): handshake done, refused, or connection gone."""
        if not self.held:
            return
        self.held = False
        net = self.net
        left = net._handshaking[self.host] - 1
        if left:
            net._handshaking[self.host] = left
        else:
            del net._handshaking[self.host]
        net._handshaking_total -= 1


class _Conn(asyncio.BufferedProtocol):
    """One TCP/TLS connection: frame decoding, an inbox for the handler, write flow control.

    Receive path (FrameDecoder.get_buffer/buffer_updated): headers land in a reused scratch
    buffer; once the decoder has checked magic, version, limits and the header checksum, a
    payload of at least `NetConfig.direct_payload_bytes` is received straight into its own
    buffer (numpy.empty: no zeroing pass): one copy from the kernel (or TLS) into the
    tensor's final memory, hashed chunk by chunk while hot in cache.
    """

    def __init__(self, net: PeerNetwork, *, inbound: bool, lane: Lane | None = None,
                 slot: _Slot | None = None) -> None:
        self.net = net
        self.inbound = inbound
        self.lane = lane
        self.slot = slot
        """Our place among connections in their handshake (accepted connections only)."""
        self.seq = next(net._conn_seq)
        self.transport: asyncio.Transport | None = None
        self.peername = "?"
        self.host = "?"
        # Bounded before authenticated: a stranger's frames (and the HelloAck a dialer reads)
        # are small; the listener relaxes this once the peer's Hello is accepted.
        self.decoder = FrameDecoder(
            net._preauth_limits, direct_bytes=net.config.direct_payload_bytes
        )
        # ... and whatever follows the first frame waits, undecoded, until that frame (the
        # handshake) is handled and the connection's limits are known.
        self.decoder.hold = inbound
        self.peer: _Peer | None = None
        self.cert_node_id: str | None = None
        self.tls = False
        self.join_only = False
        self.closed = asyncio.get_running_loop().create_future()
        self.first_frame: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.inbox: deque[tuple[Message, int]] = deque()
        """Decoded messages for the handler, with their frame sizes."""
        self.inbox_bytes = 0
        self.inbox_event = asyncio.Event()
        self.reader_task: asyncio.Task[None] | None = None
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.handling = False
        """The reader task is in the handler with one of this connection's messages."""
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._paused_reading = False
        self._paused_at = 0.0
        self.version = PROTOCOL_VERSION
        self.bytes_in = 0
        self._aborted = False
        # The deadline of the frame in progress: which frame (frames decoded before it, its
        # declared size once known), when its first bytes came, reading time we paused.
        self._frame_key: tuple[int, int | None] | None = None
        self._frame_started = 0.0
        self._frame_paused_s = 0.0
        self._frame_share = 1
        """Most frames this node was receiving at once while this one was (they share our
        downlink, so each gets that much longer)."""
        self._frame_timer: asyncio.TimerHandle | None = None

    @property
    def mid_frame(self) -> bool:
        """Part of a frame has arrived and the rest has not."""
        return not self.decoder.idle

    @property
    def who(self) -> str:
        """The peer's node id once authenticated, else its address (for log lines)."""
        return self.peer.node_id if self.peer is not None else self.host

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        transport = self.transport
        peer = transport.get_extra_info("peername")
        self.peername = _fmt(peer)
        self.host = str(peer[0]) if isinstance(peer, tuple) and peer else self.peername
        self._secured(transport)
        if self.inbound:
            self.net._conns.add(self)
            self.handshake_timer = asyncio.get_running_loop().call_later(
                self.net.config.handshake_timeout_s, self._handshake_timeout
            )

    def _secured(self, transport: asyncio.Transport) -> None:
        transport.set_write_buffer_limits(high=self.net.config.write_high_water_bytes)
        sslobj = transport.get_extra_info("ssl_object")
        self.tls = sslobj is not None
        self.cert_node_id = tlsmod.peer_node_id(sslobj)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
        self._cancel_frame_timer()
        if self._frame_key is not None:
            self._frame_key = None
            self.net._mid_frames -= 1
        if self.slot is not None:
            self.slot.release()
        self._can_write.set()
        quiet = self.net._closing or self._aborted  # abort() already logged why
        if self.mid_frame and not quiet:
            peer = f" ({self.peer.node_id})" if self.peer is not None else ""
            self.net._log_conn(self, "frame", f"connection from {self.peername}{peer} closed "
                               "mid-frame")
        partial = self.decoder.buffered
        self.decoder.release()  # the partial frame's buffer goes now, not when we are collected
        if partial >= _MiB:
            self.net._return_memory()
        if not self.first_frame.done():
            self.first_frame.set_exception(
                ConnectionResetError(f"connection to {self.peername} closed: {exc or 'EOF'}")
            )
            self.first_frame.exception()  # mark retrieved: nobody may be waiting
        if not self.closed.done():
            self.closed.set_result(None)
        self.inbox_event.set()
        self.net._conn_lost(self)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_in += nbytes
        if self.peer is not None:
            self.peer.bytes_received += nbytes
        try:
            msgs = self._decode(self.decoder.buffer_updated(nbytes))
        except ProtocolError as e:
            self._bad_frame(e)
            return
        self._deliver(msgs)
        if self.transport is not None and not self.transport.is_closing():
            self._track_frame()
            if self._frame_key is not None and self.net._mid_frames > self._frame_share:
                self._frame_share = self.net._mid_frames

    def _decode(self, frames: list[Frame]) -> deque[tuple[Message, int]]:
        limits = self.net.config.limits
        return deque(
            (decode_message(f, limits), FIXED_HEADER_SIZE + len(f.header) + f.payload.nbytes)
            for f in frames
        )

    def _bad_frame(self, e: ProtocolError) -> None:
        self.abort(f"bad frame from {self.peername} ({self.peer_label()}): {e}", "frame")

    def peer_label(self) -> str:
        return self.peer.node_id if self.peer is not None else "unauthenticated peer"

    def _deliver(self, msgs: deque[tuple[Message, int]]) -> None:
        while msgs:
            msg, size = msgs.popleft()
            if not self.first_frame.done():
                self.first_frame.set_result(msg)
                if self.inbound:
                    try:
                        self.net._on_first_frame(self, msg)
                    except Exception as e:  # a bug must not leave a half-open connection
                        log.exception("handshake with %s failed", self.peername)
                        self.abort(f"handshake with {self.peername} failed: {e!r}", "refused")
                        return
                    if self.peer is not None:  # accepted: decode what it sent after Hello
                        try:
                            msgs.extend(self._decode(self.decoder.resume()))
                        except ProtocolError as e:
                            self._bad_frame(e)
                            return
                continue
            if not self.inbound or self.peer is None:
                # A dialed connection carries only the listener's HelloAck; an accepted one
                # nothing after a refusal or a join exchange.
                self.abort(f"unexpected {type(msg).__name__} from {self.peername} "
                           "on a connection that carries no messages in this direction", "frame")
                return
            self.peer.frames_received += 1
            if self.peer.node_id in self.net._blocked:
                continue
            take = self.net._receive_now
            if take is not None and not self.inbox and not self.handling:
                try:
                    if take(self.peer.node_id, msg):
                        continue
                except Exception:  # a bug in the taker must not break the connection
                    log.exception("receiving %s from %s failed", type(msg).__name__,
                                  self.peer.node_id)
                    continue
            self.inbox.append((msg, size))
            self.inbox_bytes += size
            self.inbox_event.set()
        c = self.net.config
        if (
            (len(self.inbox) >= c.inbox_frames or self.inbox_bytes >= c.inbox_bytes)
            and not self._paused_reading
            and self.transport is not None
            and not self.transport.is_closing()
        ):
            self._paused_reading = True
            self._paused_at = time.monotonic()
            self._cancel_frame_timer()  # the frame clock stops while we do not read
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport

    # -- frame deadlines -------------------------------------------------------------------

    def _track_frame(self) -> None:
        """Arm, re-arm (its size became known) or drop the deadline of the frame in progress."""
        d = self.decoder
        if d.idle:
            if self._frame_key is not None:
                self._frame_key = None
                self.net._mid_frames -= 1
                self._cancel_frame_timer()
            return
        key = (d.frames_decoded, d.frame_bytes)
        if key == self._frame_key:
            return
        if self._frame_key is None:
            self.net._mid_frames += 1
        if self._frame_key is None or self._frame_key[0] != key[0]:
            self._frame_started = time.monotonic()
            self._frame_paused_s = 0.0
            self._frame_share = self.net._mid_frames
        self._frame_key = key
        self._arm_frame_timer()

    def _frame_deadline_s(self) -> float:
        assert self._frame_key is not None
        return self.net._frame_deadline_s(self.peer, self._frame_key[1], self._frame_share)

    def _arm_frame_timer(self) -> None:
        self._cancel_frame_timer()
        if self._frame_key is None or self._paused_reading:
            return
        left = (self._frame_started + self._frame_paused_s + self._frame_deadline_s()
                - time.monotonic())
        self._frame_timer = asyncio.get_running_loop().call_later(
            max(0.0, left), self._frame_expired
        )

    def _cancel_frame_timer(self) -> None:
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _frame_expired(self) -> None:
        self._frame_timer = None
        if self._frame_key is None:
            return
        left = (self._frame_started + self._frame_paused_s + self._frame_deadline_s()
                - time.monotonic())
        if left > 0.001:  # other frames arrived meanwhile and shared the link: more time
            self._arm_frame_timer()
            return
        size = self._frame_key[1]
        rate = self.net._link_rate(self.peer)
        self.abort(
            f"frame from {self.peername} ({self.peer_label()}) of "
            f"{'?' if size is None else size} bytes not complete after "
            f"{self._frame_deadline_s():.1f} s ({self.decoder.buffered} bytes in; link rate "
            f"{rate:.0f} bytes/s): closing it and freeing the partial frame", "frame")

    # -- helpers ---------------------------------------------------------------------------

    def _handshake_timeout(self) -> None:
        if self.peer is None and not self.join_only:
            self.abort(f"handshake from {self.peername} timed out", "timeout")

    def abort(self, why: str, kind: str = "closed") -> None:
        """Close this connection now with one (rate-limited) log line, unless already going."""
        if self.transport is None or self.transport.is_closing():
            return
        self._aborted = True
        if not self.net._closing:
            self.net._log_conn(self, kind, f"closing connection: {why}")
        if self.peer is not None:
            self.peer.last_error = why
        self.transport.abort()

    def write_small(self, parts: Sequence[bytes | memoryview]) -> None:
        """Write a frame of at most one bulk chunk as one buffer: one send() for the frame
        instead of one per part (a Forward is 4-6 parts; each write of an idle transport is a
        system call of its own). The join copies at most a chunk."""
        assert self.transport is not None
        self.transport.write(parts[0] if len(parts) == 1 else b"".join(parts))

    async def write_frame(self, out: _Out, chunk: int) -> None:
        """Write one frame in `chunk`-sized pieces, waiting for the transport to drain.

        Between chunks it yields to the event loop even when the transport could take more,
        so at most one chunk of encryption/copying sits between two turns of the loop: the
        CONTROL writer and every reader get their turn (a heartbeat's latency behind a bulk
        frame is one chunk's work, not the whole socket buffer's).
        """
        t = self.transport
        assert t is not None
        for part in out.parts:
            mv = part if isinstance(part, memoryview) else memoryview(part)
            n = mv.nbytes
            pos = 0
            while pos < n:
                if t.is_closing():
                    raise ConnectionResetError(f"connection to {self.peername} closed")
                end = min(n, pos + chunk)
                t.write(mv[pos:end])
                pos = end
                if not self._can_write.is_set():
                    await self._can_write.wait()
                else:
                    await asyncio.sleep(0)
        if t.is_closing():
            raise ConnectionResetError(f"connection to {self.peername} closed")

    def take(self) -> Message:
        """The next message for the handler (the inbox must not be empty)."""
        msg, size = self.inbox.popleft()
        self.inbox_bytes -= size
        self.resume_if_drained()
        return msg

    def resume_if_drained(self) -> None:
        c = self.net.config
        if (
            self._paused_reading
            and len(self.inbox) < max(1, c.inbox_frames // 2)
            and self.inbox_bytes < max(1, c.inbox_bytes // 2)
        ):
            self._paused_reading = False
            self._frame_paused_s += time.monotonic() - self._paused_at
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()
                self._arm_frame_timer()


class PeerNetwork:
    """The peer transport: a listener, lazy persistent links, two lanes, backpressure.

    `handler(node_id, msg)` is awaited for each message a peer sends, in order per connection
    (CONTROL and BULK arrive on different connections, so their relative order is not kept).
    `join_authority` (members holding the CA key) lets nodes without a certificate exchange a
    join token for one; without it such connections are refused at the TLS layer.
    """

    def __init__(
        self,
        *,
        node_id: str,
        cluster_id: str,
        listen: Address,
        tls: TLSMaterial | None,
        handler: Handler,
        config: NetConfig | None = None,
        join_authority: JoinAuthority | None = None,
        advertise: Address | None = None,
    ) -> None:
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.listen = listen
        self.tls = tls
        self.handler = handler
        self.config = config or NetConfig()
        self.join_authority = join_authority
        self.advertise = advertise
        self._lsock: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._peers: dict[str, _Peer] = {}
        self._conns: set[_Conn] = set()
        self._blocked: frozenset[str] = frozenset()
        self._denied: frozenset[str] = frozenset()
        self._closing = False
        self._ready = asyncio.Event()
        self._server_ctx: ssl.SSLContext | None = None
        self._client_ctx: ssl.SSLContext | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._handshaking: dict[str, int] = {}
        """Source address -> accepted connections from it still in their handshake."""
        self._handshaking_total = 0
        self._member_hosts: set[str] = set()
        """Addresses members were authenticated from, or that members listen on."""
        self._link_rates: dict[str, float] = {}
        """node id -> measured link rate in bytes/s (`set_link_rate`), for frame deadlines."""
        self._mid_frames = 0
        """Connections with a frame in progress (for the frame deadline's link share)."""
        self._conn_seq = itertools.count()
        self._refusals = RefusalLog(self.config.refusal_log_interval_s,
                                    self.config.refusal_log_burst)
        self._refusal_timer: asyncio.TimerHandle | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._trim_again = False
        lim = self.config.limits
        self._preauth_limits = lim.for_preauth()
        self._control_limits = lim.for_control()
        self._receive_now: Callable[[str, Message], bool] | None = None
        self._tls_refusals = dict.fromkeys(TLS_REFUSAL_CHECKS, 0)
        self._join_refusals = dict.fromkeys(JOIN_REFUSAL_REASONS, 0)
        _check_config(self.config)

    # -- service ---------------------------------------------------------------------------

    @property
    def plaintext(self) -> bool:
        """True when links are unauthenticated and unencrypted (loopback development only)."""
        return self.tls is None

    @property
    def address(self) -> Address:
        """The bound listen address (port 0 resolved to the real port)."""
        if self._lsock is None:
            raise LocalError("PeerNetwork is not started")
        name = self._lsock.getsockname()
        return (str(name[0]), int(name[1]))

    @property
    def advertised_address(self) -> Address:
        """The address peers should dial us at (what Hello carries)."""
        return self.advertise or self.address

    async def start(self) -> None:
        """Bind the listener (raises ConfigError for plaintext on a non-loopback address)."""
        if self._lsock is not None:
            return
        if self.config.tune_allocator and tune_allocator():
            log.debug("glibc malloc tuned to reuse large frame buffers")
        host, port = self.listen
        if self.tls is None:
            if not _is_loopback(host) and not self.config.allow_plaintext_remote:
                raise ConfigError(
                    f"net.listen {host}:{port}: plaintext peer links are allowed on loopback "
                    "only; configure TLS credentials (fusionctl init / join)"
                )
            log.warning(
                "PLAINTEXT PEER LINKS: node %s listens on %s:%s without TLS; anyone who can "
                "reach it can read and inject traffic. Use only for loopback development.",
                self.node_id, host, port,
            )
        else:
            try:
                self._server_ctx = tlsmod.server_context(
                    self.tls, allow_join=self.join_authority is not None
                )
                self._client_ctx = tlsmod.client_context(self.tls)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"cannot load TLS material {self.tls}: {e}") from e
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            lsock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise ConfigError(f"net.listen {host}:{port}: cannot listen: {e}") from e
        lsock.setblocking(False)
        self._lsock = lsock
        self._acceptor = self._spawn(self._accept_loop(lsock), "net-acceptor")
        self._ready.set()
        log.info("peer listener on %s (%s)", _fmt(self.address),
                 "mutual TLS" if self.tls else "PLAINTEXT")

    async def ready(self) -> None:
        """Return once the listener is bound."""
        await self._ready.wait()

    async def close(self) -> None:
        """Stop listening, cancel writers and readers, close every connection. Idempotent."""
        if self._closing:
            return
        self._closing = True
        tasks: list[asyncio.Task[Any]] = list(self._tasks)
        for p in self._peers.values():
            tasks.extend(p.writers.values())
        for c in list(self._conns):
            if c.reader_task is not None:
                tasks.append(c.reader_task)
        for t in tasks:
            t.cancel()
        if self._refusal_timer is not None:
            self._refusal_timer.cancel()
            self._flush_refusals()
        for c in list(self._conns):
            if c.transport is not None:
                c.transport.abort()
        for p in self._peers.values():
            for link in p.links.values():
                if link is not None and link.transport is not None:
                    link.transport.abort()
            for q in p.queues.values():
                # Unblock senders waiting on a full queue; what they queue is never sent.
                while not q.empty():
                    q.get_nowait()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._lsock is not None:  # after the acceptor task is gone
            self._lsock.close()

    # -- public API ------------------------------------------------------------------------

    def add_peer_address(self, node_id: str, address: Address) -> None:
        """Remember where `node_id` listens; the next send to it dials there."""
        if node_id == self.node_id:
            return
        p = self._peer(node_id)
        if p.address != address:
            p.address = address
        self._member_hosts.add(address[0])

    def set_link_rate(self, node_id: str, bytes_per_s: float) -> None:
        """The measured rate of the link from `node_id` (bytes/s; <= 0: unknown), from which
        the deadline of a frame it sends us is derived (the cluster's probes call this)."""
        if bytes_per_s > 0:
            self._link_rates[node_id] = float(bytes_per_s)
        else:
            self._link_rates.pop(node_id, None)

    def peers(self) -> list[str]:
        """Node ids we know an address for or have heard from."""
        return list(self._peers)

    async def connect(self, address: Address) -> str:
        """Dial `address`, handshake, and return the peer's node id (keeps the CONTROL link)."""
        conn, node_id = await self._dial(address, Lane.CONTROL)
        p = self._peer(node_id)
        p.address = address
        old = p.links[Lane.CONTROL]
        if (
            old is not None
            and old is not conn
            and old.transport is not None
            and not old.transport.is_closing()
        ):
            # Keep the established link; this one was only for discovering the id.
            assert conn.transport is not None
            conn.transport.close()
        else:
            p.links[Lane.CONTROL] = conn
            conn.peer = p
            p.ever_connected.add(Lane.CONTROL)
            self._ensure_writer(p, Lane.CONTROL)
        return node_id

    async def send(self, peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None:
        """Queue `msg` (+ payload buffers, not copied: do not mutate them until sent) for `peer`.

        Awaits while the peer's queue for the message's lane is full. Delivery is at most once:
        frames queued when a dial fails, or to a blocked peer, are dropped (and counted).
        """
        if self._closing:
            raise LocalError("PeerNetwork is closed")
        p = self._peers.get(peer)
        if p is None or p.address is None:
            raise UnknownPeer(f"no address known for peer {peer}")
        if peer in self._blocked or peer in self._denied:
            p.dropped += 1
            return
        lane = msg.lane
        parts = encode_message(
            msg, payload, version=p.version, payload_check=self._payload_check(p),
            limits=self.config.limits,
        )
        nbytes = sum(memoryview(x).nbytes for x in parts)
        self._ensure_writer(p, lane)
        await p.queues[lane].put(_Out(parts, nbytes))

    def send_now(self, peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> bool:
        """Write `msg` (+ payload) to its lane's connection at once, without a turn of the
        lane's writer task, when that keeps the lane's order and bounds: the link is up and
        writable, nothing of the lane is queued or being written before it, and the frame is
        at most one bulk chunk (what the writer too writes in one go). False: nothing was done,
        `send` it. The payload is copied into the transport before this returns."""
        if self._closing:
            raise LocalError("PeerNetwork is closed")
        p = self._peers.get(peer)
        if p is None or peer in self._blocked or peer in self._denied:
            return False
        lane = msg.lane
        conn = p.links[lane]
        if (conn is None or conn.transport is None or conn.transport.is_closing()
                or not conn._can_write.is_set() or p.writing[lane]
                or not p.queues[lane].empty()):
            return False
        size = sum(memoryview(x).nbytes for x in payload)
        if size > self.config.bulk_chunk_bytes - _SEND_NOW_HEADER_BYTES:
            return False
        parts = encode_message(
            msg, payload, version=p.version, payload_check=self._payload_check(p),
            limits=self.config.limits,
        )
        nbytes = sum(memoryview(x).nbytes for x in parts)
        try:
            conn.write_small(parts)
        except (OSError, RuntimeError) as e:
            p.dropped += 1
            p.last_error = str(e)
            log.info("lost %s link to %s while writing: %s", lane.value, p.node_id, e)
            return True  # sent and lost, as the writer's path would lose it
        p.bytes_sent += nbytes
        p.frames_sent += 1
        return True

    def set_receive_now(self, fn: Callable[[str, Message], bool] | None) -> None:
        """`fn(peer, msg)` is offered each message as its bytes arrive, before the handler's
        task: True when it took the message (it must not block or raise), False to leave it
        to the handler. It is offered a message only when nothing of its connection waits
        for the handler or is in it, so a connection's order holds."""
        self._receive_now = fn

    def stats(self) -> dict[str, PeerStats]:
        """Per-peer counters and queue depths (a snapshot)."""
        out: dict[str, PeerStats] = {}
        for nid, p in self._peers.items():
            ctl = p.links[Lane.CONTROL]
            out[nid] = PeerStats(
                node_id=nid,
                address=p.address,
                connected=ctl is not None and ctl.transport is not None
                and not ctl.transport.is_closing(),
                inbound=sum(1 for c in p.inbound if c.transport and not c.transport.is_closing()),
                bytes_sent=p.bytes_sent,
                bytes_received=p.bytes_received,
                frames_sent=p.frames_sent,
                frames_received=p.frames_received,
                control_queue_depth=p.queues[Lane.CONTROL].qsize(),
                bulk_queue_depth=p.queues[Lane.BULK].qsize(),
                reconnects=p.reconnects,
                dropped=p.dropped,
                last_error=p.last_error,
            )
        return out

    def counts(self) -> NetCounts:
        """Refusals since start: by the TLS handshake or the trust check, and of join requests."""
        return NetCounts(dict(self._tls_refusals), dict(self._join_refusals))

    def set_denied(self, node_ids: set[str]) -> None:
        """Refuse these nodes from now on, even with valid certificates (removed members).

        Their handshakes get an `auth` Refuse, their open connections are closed, and nothing
        is sent to them. Certificates cannot be revoked yet (docs/security.md), so the caller
        (the daemon) must persist this list and set it again at start.
        """
        self._denied = frozenset(node_ids)
        for nid in self._denied:
            p = self._peers.get(nid)
            if p is None:
                continue
            for c in [*p.inbound, *(x for x in p.links.values() if x is not None)]:
                c.abort(f"node {nid} is denied (removed from the cluster)")

    def set_blocked(self, node_ids: set[str]) -> None:
        """TEST-ONLY drop switch: silently drop all traffic to and from these nodes."""
        self._blocked = frozenset(node_ids)
        if node_ids:
            log.warning("TEST drop switch: dropping all traffic to/from %s", sorted(node_ids))

    # -- internals: peers and writers ------------------------------------------------------

    def _payload_check(self, p: _Peer) -> bool:
        if self.config.payload_check is not None:
            return self.config.payload_check
        # TLS authenticates every record, and loopback has no wire to corrupt bytes; only a
        # plaintext link over a real network needs the xxh3 check.
        return self.tls is None and not (p.address is not None and _is_loopback(p.address[0]))

    def _peer(self, node_id: str) -> _Peer:
        p = self._peers.get(node_id)
        if p is None:
            c = self.config
            p = _Peer(
                node_id=node_id,
                address=None,
                queues={
                    Lane.CONTROL: asyncio.Queue(c.control_queue_frames),
                    Lane.BULK: asyncio.Queue(c.bulk_queue_frames),
                },
            )
            self._peers[node_id] = p
        return p

    def _ensure_writer(self, p: _Peer, lane: Lane) -> None:
        t = p.writers.get(lane)
        if t is None or t.done():
            t = asyncio.get_running_loop().create_task(
                self._writer(p, lane), name=f"net-writer-{p.node_id}-{lane.value}"
            )
            t.add_done_callback(_log_crash)
            p.writers[lane] = t

    async def _writer(self, p: _Peer, lane: Lane) -> None:
        """Drain one lane's queue onto its connection, dialing (with backoff) when needed."""
        q = p.queues[lane]
        chunk = self.config.bulk_chunk_bytes if lane is Lane.BULK else 1 << 62
        while True:
            out = await q.get()
            p.writing[lane] = True
            try:
                await self._write_out(p, lane, out, chunk)
            finally:
                p.writing[lane] = False

    async def _write_out(self, p: _Peer, lane: Lane, out: _Out, chunk: int) -> None:
        """Write one frame the lane's writer took: dial first if needed (a failed dial drops
        it and what waits behind it)."""
        q = p.queues[lane]
        try:
            conn = await self._link(p, lane)
        except (TimeoutError, OSError, FusionError, ssl.SSLError) as e:
            raise_if_cancelling()
            dropped = 1 + q.qsize()
            while not q.empty():
                q.get_nowait()
            p.dropped += dropped
            p.last_error = str(e)
            log.info("peer %s unreachable on %s lane (%s); dropped %d queued frame(s)",
                     p.node_id, lane.value, e, dropped)
            return
        if p.node_id in self._blocked:
            p.dropped += 1
            return
        try:
            if out.nbytes <= chunk:
                conn.write_small(out.parts)
                if not conn._can_write.is_set():
                    await conn._can_write.wait()
            else:
                await conn.write_frame(out, chunk)
        except (OSError, RuntimeError) as e:
            raise_if_cancelling()
            p.dropped += 1
            p.last_error = str(e)
            log.info("lost %s link to %s while writing: %s", lane.value, p.node_id, e)
            return
        p.bytes_sent += out.nbytes
        p.frames_sent += 1

    async def _link(self, p: _Peer, lane: Lane) -> _Conn:
        """The live connection for (peer, lane), dialing it (after any backoff) if needed."""
        conn = p.links[lane]
        if conn is not None and conn.transport is not None and not conn.transport.is_closing():
            return conn
        async with p.dial_lock[lane]:
            conn = p.links[lane]
            if conn is not None and conn.transport is not None and not conn.transport.is_closing():
                return conn
            if p.address is None:
                raise UnknownPeer(f"no address known for peer {p.node_id}")
            wait = p.next_dial[lane] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                conn, node_id = await self._dial(p.address, lane)
                if node_id != p.node_id:
                    assert conn.transport is not None
                    conn.transport.close()
                    raise PeerRefused(
                        f"{_fmt(p.address)} is node {node_id}, not {p.node_id} as we were told"
                    )
            except (TimeoutError, OSError, RemoteError, ssl.SSLError):
                c = self.config
                b = p.backoff[lane]
                b = c.backoff_initial_s if b == 0 else min(c.backoff_max_s, b * 2)
                p.backoff[lane] = b
                jitter = random.uniform(1 - c.backoff_jitter, 1 + c.backoff_jitter)
                p.next_dial[lane] = time.monotonic() + b * jitter
                raise
            p.backoff[lane] = 0.0
            p.next_dial[lane] = 0.0
            if lane in p.ever_connected:
                p.reconnects += 1
            p.ever_connected.add(lane)
            p.version = conn.version
            conn.peer = p
            p.links[lane] = conn
            return conn

    async def _dial(self, address: Address, lane: Lane) -> tuple[_Conn, str]:
        """Open a connection to `address` and run the Hello handshake; returns (conn, node id)."""
        loop = asyncio.get_running_loop()
        host, port = address
        c = self.config
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Conn(self, inbound=False, lane=lane), host, port,
                    ssl=self._client_ctx,
                    server_hostname=host if self._client_ctx is not None else None,
                    ssl_handshake_timeout=c.handshake_timeout_s if self._client_ctx else None,
                ),
                c.connect_timeout_s,
            )
        except (TimeoutError, OSError) as e:
            if isinstance(e, ssl.SSLCertVerificationError):  # its certificate is not ours
                self._tls_refusals["handshake"] += 1
            after = f" after {c.connect_timeout_s:g}s" if isinstance(e, TimeoutError) else ""
            raise PeerUnreachable(f"cannot connect to {host}:{port}: {describe(e)}{after}") from e
        conn = proto
        assert isinstance(conn, _Conn) and conn.transport is not None
        self._conns.add(conn)
        sock = conn.transport.get_extra_info("socket")  # uvloop: a socket-like object
        if sock is not None:
            _keepalive(sock)
        hs = Handshake(
            Role.CLIENT, node_id=self.node_id, cluster_id=self.cluster_id,
            min_version=c.versions[0], max_version=c.versions[1],
            address=self.advertised_address, capabilities=(_LANE_CAPABILITY[lane],),
        )
        conn.write_small(encode_message(hs.start(), limits=self._preauth_limits))
        try:
            reply = await asyncio.wait_for(conn.first_frame, c.handshake_timeout_s)
        except (TimeoutError, ConnectionError, ssl.SSLError) as e:
            conn.transport.abort()
            after = f" after {c.handshake_timeout_s:g}s" if isinstance(e, TimeoutError) else ""
            raise PeerUnreachable(
                f"handshake with {host}:{port} failed: {describe(e)}{after}") from e
        try:
            hs.receive(reply)
        except ProtocolError as e:
            conn.transport.abort()
            if isinstance(e, HandshakeRefused) and e.code == REFUSE_SELF:
                raise DialedSelf(f"{host}:{port} is this node itself") from e
            log.warning("handshake with %s:%s failed: %s", host, port, e)
            raise PeerRefused(f"{host}:{port}: {e}") from e
        assert isinstance(reply, HelloAck) and hs.version is not None
        if conn.tls and conn.cert_node_id != reply.node_id:
            self._tls_refusals["identity"] += 1
            conn.abort(f"{host}:{port} claims node id {reply.node_id} but its certificate "
                       f"says {conn.cert_node_id}")
            raise PeerRefused(f"{host}:{port} claims a node id its certificate does not carry")
        if reply.node_id == self.node_id:
            conn.transport.abort()
            raise DialedSelf(f"{host}:{port} is this node itself")
        if reply.node_id in self._denied:
            if conn.tls:
                self._tls_refusals["removed"] += 1
            conn.abort(f"{host}:{port} is node {reply.node_id}, which was removed")
            raise PeerRefused(f"{host}:{port} is node {reply.node_id}, which was removed")
        conn.version = hs.version
        conn.decoder.set_version(hs.version)
        return conn, reply.node_id

    # -- internals: accepted connections ---------------------------------------------------

    async def _accept_loop(self, lsock: socket.socket) -> None:
        """Accept connections; each one's TLS handshake runs in its own task."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except OSError as e:
                if self._closing:
                    return
                # EMFILE and friends: log, breathe, keep serving the connections we have.
                log.error("accept on %s failed: %s", _fmt(self.address), e)
                await asyncio.sleep(0.1)
                continue
            self._spawn(self._accepted(sock, addr), f"net-accept-{_fmt(addr)}")

    async def _accepted(self, sock: socket.socket, addr: Any) -> None:
        """Wrap an accepted socket (TLS handshake first, with one log line if it fails)."""
        loop = asyncio.get_running_loop()
        host = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        busy = self._handshake_refusal(host)
        if busy is not None:
            self._log_refusal(host, "busy", f"refused connection from {_fmt(addr)}: {busy}")
            sock.close()
            return
        _keepalive(sock)
        slot = _Slot(self, host)
        try:
            await asyncio.wait_for(
                loop.connect_accepted_socket(
                    lambda: _Conn(self, inbound=True, slot=slot), sock, ssl=self._server_ctx,
                    ssl_handshake_timeout=(
                        self.config.handshake_timeout_s if self._server_ctx else None
                    ),
                ),
                self.config.handshake_timeout_s,
            )
        except (OSError, TimeoutError) as e:
            slot.release()
            sock.close()
            if self._server_ctx is not None:
                self._tls_refusals["handshake"] += 1
            if not self._closing:
                self._log_refusal(host, "tls", f"refused connection from {_fmt(addr)}: TLS "
                                  "handshake failed (no valid cluster certificate?): "
                                  f"{describe(e)}")

    def _handshake_refusal(self, host: str) -> str | None:
        """Why a new connection from `host` may not start a handshake now (None: it may)."""
        c = self.config
        total = self._handshaking_total
        if host in self._member_hosts:
            if total >= c.max_pending_handshakes:
                return f"{total} connections are already in their handshake"
            return None
        strangers = c.max_pending_handshakes - c.member_handshake_reserve
        if total >= strangers:
            return (f"{total} connections are already in their handshake ({strangers} "
                    "allowed from addresses no member was authenticated from)")
        mine = self._handshaking.get(host, 0)
        if mine >= c.max_pending_handshakes_per_source:
            return f"{mine} connections from {host} are already in their handshake"
        return None

    def _conn_lost(self, conn: _Conn) -> None:
        self._conns.discard(conn)
        p = conn.peer
        if p is not None:
            p.inbound.discard(conn)
            for lane, link in p.links.items():
                if link is conn:
                    p.links[lane] = None

    def _refuse(self, conn: _Conn, refuse: Refuse) -> None:
        """Send `refuse`, log one line naming the peer and the reason, close the connection."""
        self._log_conn(conn, "refused", f"refused connection from {conn.peername} "
                       f"({refuse.code}): {refuse.reason}")
        if conn.transport is not None and not conn.transport.is_closing():
            conn.write_small(encode_message(refuse, limits=self._preauth_limits))
            conn.transport.close()

    # -- internals: bounds, deadlines, logging ----------------------------------------------

    def _log_conn(self, conn: _Conn, kind: str, line: str) -> None:
        self._log_refusal(conn.who, kind, line)

    def _log_refusal(self, key: str, kind: str, line: str) -> None:
        """One warning line, rate-limited per (key, kind); the rest are summarised."""
        now = time.monotonic()
        for summary in self._refusals.due(now):
            log.warning("%s", summary)
        out = self._refusals.note(key, kind, line, now)
        if out is not None:
            log.warning("%s", out)
        elif self._refusal_timer is None and not self._closing:
            due = self._refusals.next_due()
            if due is not None:
                self._refusal_timer = asyncio.get_running_loop().call_later(
                    max(0.0, due - now), self._flush_refusals
                )

    def _flush_refusals(self) -> None:
        self._refusal_timer = None
        now = time.monotonic()
        for summary in self._refusals.due(now):
            log.warning("%s", summary)
        due = self._refusals.next_due()
        if due is not None and not self._closing:
            self._refusal_timer = asyncio.get_running_loop().call_later(
                max(0.0, due - now), self._flush_refusals
            )

    def _link_rate(self, p: _Peer | None) -> float:
        rate = self._link_rates.get(p.node_id) if p is not None else None
        return rate if rate is not None else self.config.default_link_bytes_per_s

    def _frame_deadline_s(self, p: _Peer | None, frame_bytes: int | None, share: int = 1
                          ) -> float:
        """How long a frame of `frame_bytes` (None: size not known yet) from `p` may take,
        while at most `share` frames arrive at once (they share this node's downlink)."""
        c = self.config
        size = FIXED_HEADER_SIZE if frame_bytes is None else frame_bytes
        return max(c.frame_deadline_floor_s,
                   c.frame_deadline_factor * size * max(1, share) / self._link_rate(p))

    def _return_memory(self) -> None:
        """A large partial frame was freed: ask glibc (in a thread) to give its pages back.

        `tune_allocator` keeps freed frame buffers in the heap for reuse; a buffer freed in
        the middle of it is never returned by free() alone, so an aborted 1 GiB frame would
        stay resident. malloc_trim returns every free page; at most one runs at a time.
        """
        if not _allocator_tuned or self._closing:
            return
        if self._trim_task is not None and not self._trim_task.done():
            self._trim_again = True
            return

        async def trim() -> None:
            while True:
                self._trim_again = False
                await asyncio.to_thread(_malloc_trim)
                if not self._trim_again:
                    return

        self._trim_task = self._spawn(trim(), "net-malloc-trim")

    def _auth_refusal(self, reason: str) -> Refuse:
        lo, hi = self.config.versions
        return Refuse(code="auth", reason=reason, min_version=lo, max_version=hi)

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _on_first_frame(self, conn: _Conn, msg: Message) -> None:
        """An accepted connection's first message: Hello, or JoinRequest without a cert."""
        if conn.handshake_timer is not None:
            conn.handshake_timer.cancel()
        if conn.slot is not None:
            conn.slot.release()  # the handshake ends here, one way or the other
        if conn.tls and conn.cert_node_id is None:
            # No client certificate: only a join exchange is allowed on this connection.
            if isinstance(msg, JoinRequest) and self.join_authority is not None:
                conn.join_only = True
                self._answer_join(conn, msg)
            else:
                self._tls_refusals["no_certificate"] += 1
                self._refuse(conn, self._auth_refusal(
                    f"{type(msg).__name__} without a client certificate; only a JoinRequest "
                    "may be sent before joining"))
            return
        lo, hi = self.config.versions
        hs = Handshake(
            Role.SERVER, node_id=self.node_id, cluster_id=self.cluster_id,
            min_version=lo, max_version=hi, address=self.advertised_address,
        )
        reply = hs.receive(msg)
        if isinstance(reply, Refuse):
            self._refuse(conn, reply)
            return
        peer_id = hs.peer_node_id
        assert peer_id is not None and hs.version is not None
        if conn.tls and peer_id != conn.cert_node_id:
            self._tls_refusals["identity"] += 1
            self._refuse(conn, self._auth_refusal(
                f"node id {peer_id} in Hello does not match the certificate's "
                f"{conn.cert_node_id}"))
            return
        if peer_id == self.node_id:
            # Not a warning: a node dialling its own address (its own join token's bootstrap
            # address) learns it at once and stops (DialedSelf).
            lo, hi = self.config.versions
            refuse = Refuse(code=REFUSE_SELF, reason="a node cannot connect to itself",
                            min_version=lo, max_version=hi)
            if conn.transport is not None and not conn.transport.is_closing():
                conn.write_small(encode_message(refuse, limits=self._preauth_limits))
                conn.transport.close()
            return
        if peer_id in self._denied:
            if conn.tls:
                self._tls_refusals["removed"] += 1
            self._refuse(conn, self._auth_refusal(f"node {peer_id} was removed from the cluster"))
            return
        assert reply is not None
        conn.write_small(encode_message(reply, limits=self._preauth_limits))
        conn.version = hs.version
        conn.decoder.set_version(hs.version)
        # Authenticated: the lane's frame bound from now on (BULK's for an older peer that
        # does not name its lane).
        conn.lane = _lane_of(hs.peer_capabilities)
        conn.decoder.set_limits(
            self._control_limits if conn.lane is Lane.CONTROL else self.config.limits
        )
        self._member_hosts.add(conn.host)
        p = self._peer(peer_id)
        ctl = p.links[Lane.CONTROL]
        link_up = ctl is not None and ctl.transport is not None and not ctl.transport.is_closing()
        if hs.peer_address is not None and (p.address is None or not link_up):
            # Learn (or, after a restart on another port, relearn) where it listens; a link
            # that works is never redirected by a claim.
            host, port = hs.peer_address
            if not host or host in ("0.0.0.0", "::"):
                # It listens on all interfaces: reach it at the address it dialed us from.
                host = conn.peername.rsplit(":", 1)[0]
            p.address = (host, port)
        conn.peer = p
        self._evict_surplus(p, conn.lane)
        p.inbound.add(conn)
        conn.reader_task = self._spawn(self._reader(conn, p), f"net-reader-{p.node_id}")

    def _evict_surplus(self, p: _Peer, lane: Lane | None) -> None:
        """Make room for one more accepted connection of `p` on `lane`: close the oldest.

        The oldest, not the newest: a peer that restarted or lost its links reconnects while
        its old sockets may linger (no FIN seen yet); refusing the new one would lock it out
        until keepalive noticed. A peer opening hundreds only ever keeps the newest few.
        """
        same = sorted((c for c in p.inbound if c.lane is lane), key=lambda c: c.seq)
        surplus = len(same) + 1 - self.config.max_inbound_per_peer_lane
        for old in same[:max(0, surplus)]:
            p.inbound.discard(old)
            old.abort(f"peer {p.node_id} opened more than "
                      f"{self.config.max_inbound_per_peer_lane} "
                      f"{lane.value if lane else 'unnamed-lane'} connections; closing its "
                      f"oldest, from {old.peername}", "evicted")

    def _answer_join(self, conn: _Conn, req: JoinRequest) -> None:
        """Check a join request, answer JoinResponse (ok or not) and close the connection."""
        assert self.join_authority is not None and conn.transport is not None
        auth = self.join_authority
        try:
            cert = auth.authorize_request(token=req.token, csr_pem=req.csr)
        except (JoinTokenError, PKIError) as e:
            reason = e.reason if isinstance(e, JoinTokenError) else "error"
            self._join_refusals[reason] = self._join_refusals.get(reason, 0) + 1
            self._log_conn(conn, "refused", f"refused join from {conn.peername} "
                           f"({req.node_id}): {e}")
            conn.write_small(encode_message(JoinResponse(
                request_id=req.request_id, ok=False, reason=f"join refused: {e}"),
                limits=self._preauth_limits))
            conn.transport.close()
            return
        log.info("issued a node certificate to %s (%s) for a join token", conn.peername,
                 req.node_id)
        conn.write_small(encode_message(JoinResponse(
            request_id=req.request_id, ok=True, cluster_id=auth.ca.cluster_id,
            certificate=cert.public_bytes(serialization.Encoding.PEM),
            ca_certificate=auth.ca.cert_pem(),
            bootstrap=(self.advertised_address,),
        ), limits=self._preauth_limits))
        conn.transport.close()

    async def _reader(self, conn: _Conn, p: _Peer) -> None:
        """Deliver an accepted connection's messages to the handler, in order."""
        while True:
            while not conn.inbox:
                if conn.closed.done():
                    return
                conn.inbox_event.clear()
                await conn.inbox_event.wait()
            msg = conn.take()
            conn.handling = True
            try:
                await self.handler(p.node_id, msg)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("handler failed on %s from %s", type(msg).__name__, p.node_id)
            finally:
                conn.handling = False
                # not kept until the next message: a connection that goes quiet after a big
                # one (the scheduler's Assign, 21 MB of weights) held it for the job's life
                del msg
