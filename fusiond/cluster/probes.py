"""Link probes: RTT by Ping/Pong, bandwidth by a timed bulk transfer on the tensors' transport.

Bandwidth: one probe sends ``n`` equal ProbeData frames (filler payload) on the BULK lane; the
receiver answers with a ProbeAck once the last has arrived, stating how many bytes it got and
the time from the first frame's arrival to the last one's. Two estimates follow:

- receiver: the ``n - 1`` frames after the first crossed the link in that span
  (``bytes * (n-1)/n / span``). It over-estimates when the first frame is handed over late:
  a lost packet in it holds back the data behind it in TCP's reorder queue, which then arrives
  at once (seen on tbf-shaped links at 10 Mbit/s: +30 % on one sample);
- sender: all bytes crossed between the first send and the ack, less one RTT
  (``bytes / (ack time - RTT)``). It cannot exceed the link's rate; queueing or a stall on
  either side only lowers it.

The sample is the smaller of the two (the sender's alone when the receiver's span is too short
to time, e.g. all frames in one read).

Each probe is sized from the previous estimate to last about ``target_s``; a sample counts only
if the transfer lasted at least a third of that (or the size hit ``max_bytes``), so the first
small sizing probe and TCP slow start do not skew it. Counted samples feed an EWMA.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from protocol.frames import Buffer
from protocol.messages import Message, Ping, Pong, ProbeAck, ProbeData

SendFn = Callable[[str, Message, Sequence[Buffer]], Awaitable[None]]

_MAX_RX = 64
"""Concurrent incoming probes remembered (bounded: a peer cannot grow our memory)."""


@dataclass(frozen=True)
class ProbeConfig:
    """Sizes and timeouts of link probes."""

    target_s: float = 0.3
    repeats: int = 3
    max_bytes: int = 64 << 20
    min_bytes: int = 64 << 10
    initial_bytes: int = 256 << 10
    chunk_bytes: int = 1 << 20
    min_frames: int = 4
    ewma: float = 0.3
    """Weight of a new sample in the bandwidth and RTT averages."""
    timeout_s: float = 5.0
    """A ping or a bulk probe not answered within this is a failure."""


@dataclass(frozen=True)
class LinkEstimate:
    """What we know of our link to one peer."""

    bandwidth_bps: float | None
    rtt_s: float | None
    measured_at: float
    """time.time() of the last update."""


@dataclass
class _Rx:
    first: float
    last: float
    received: int
    nbytes: int


class ProbeFailed(Exception):
    """A probe got no answer in time (the peer is slow, gone, or cut off)."""


def ewma(old: float | None, new: float, alpha: float) -> float:
    """Exponentially weighted moving average; the first sample is taken as is."""
    return new if old is None else alpha * new + (1.0 - alpha) * old


def bandwidth_from_ack(ack: ProbeAck, frames: int, sent_bytes: int, duration_s: float,
                       rtt_s: float) -> tuple[float, float]:
    """(bits per second, seconds the transfer took) from a probe's ack and the sender's timing:
    the smaller of the receiver's and the sender's estimate (see the module docstring)."""
    span = max(duration_s - rtt_s, 1e-6)
    sender = sent_bytes * 8.0 / span
    if frames >= 2 and ack.received == frames and ack.elapsed_s >= 1e-3:
        receiver = ack.nbytes * (frames - 1) / frames * 8.0 / ack.elapsed_s
        if receiver < sender:
            return receiver, ack.elapsed_s
    return sender, span


class LinkProber:
    """Measures links to peers; answers the peers' probes. One event loop only."""

    def __init__(self, *, send: SendFn, config: ProbeConfig) -> None:
        self._send = send
        self._cfg = config
        self._ids = itertools.count(1)
        self._pings: dict[int, asyncio.Future[float]] = {}
        self._acks: dict[int, asyncio.Future[ProbeAck]] = {}
        self._rx: OrderedDict[tuple[str, int], _Rx] = OrderedDict()
        self._filler = memoryview(os.urandom(min(config.chunk_bytes, config.max_bytes)))
        self.links: dict[str, LinkEstimate] = {}

    # -- measuring -----------------------------------------------------------------------------

    async def rtt(self, peer: str) -> float:
        """Smallest of ``repeats`` ping round trips to `peer`; ProbeFailed if none answered."""
        best = math.inf
        for _ in range(self._cfg.repeats):
            rid = next(self._ids)
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            self._pings[rid] = fut
            try:
                async with asyncio.timeout(self._cfg.timeout_s):
                    await self._send(peer, Ping(request_id=rid, sent_at=time.monotonic()), ())
                    best = min(best, await fut)
            except TimeoutError:
                continue
            finally:
                self._pings.pop(rid, None)
        if not math.isfinite(best):
            raise ProbeFailed(f"no Pong from {peer} within {self._cfg.timeout_s}s")
        return best

    async def bulk(self, peer: str, nbytes: int, rtt_s: float) -> tuple[float, float]:
        """One timed transfer of about `nbytes`: (bits per second, seconds it took)."""
        cfg = self._cfg
        frames = max(cfg.min_frames, math.ceil(nbytes / cfg.chunk_bytes))
        chunk = min(max(1, math.ceil(nbytes / frames)), len(self._filler))
        probe_id = next(self._ids)
        fut: asyncio.Future[ProbeAck] = asyncio.get_running_loop().create_future()
        self._acks[probe_id] = fut
        # Sending (backpressure) and the answer must fit in the timeout plus twice what the
        # last estimate says the transfer takes: a slow link is not a dead one.
        est = self.links.get(peer)
        expected = (frames * chunk * 8 / est.bandwidth_bps
                    if est is not None and est.bandwidth_bps else 0.0)
        limit = cfg.timeout_s + 2 * expected
        try:
            async with asyncio.timeout(limit):
                t0 = time.monotonic()
                payload = (self._filler[:chunk],)
                for seq in range(frames):
                    await self._send(peer, ProbeData(probe_id=probe_id, seq=seq, count=frames),
                                     payload)
                ack = await fut
                duration = time.monotonic() - t0
        except TimeoutError as exc:
            raise ProbeFailed(f"bulk probe of {peer} not answered within {limit:.1f}s") from exc
        finally:
            self._acks.pop(probe_id, None)
        return bandwidth_from_ack(ack, frames, frames * chunk, duration, rtt_s)

    async def probe(self, peer: str) -> LinkEstimate:
        """Measure RTT then bandwidth to `peer`, update and return its estimate.

        Raises ProbeFailed when the peer does not answer (the estimate is kept); errors of the
        transport (peer unreachable, ...) propagate.
        """
        cfg = self._cfg
        rtt = await self.rtt(peer)
        old = self.links.get(peer)
        avg = old.bandwidth_bps if old is not None else None
        rtt_avg = ewma(old.rtt_s if old is not None else None, rtt, cfg.ewma)
        guess = avg
        counted = 0
        for _ in range(cfg.repeats + 4):
            size = cfg.initial_bytes if guess is None else int(guess / 8 * cfg.target_s)
            size = max(cfg.min_bytes, min(cfg.max_bytes, size))
            sample, took = await self.bulk(peer, size, rtt)
            guess = sample  # the next probe is sized from the latest sample
            if took >= cfg.target_s / 3 or size >= cfg.max_bytes:
                avg = ewma(avg, sample, cfg.ewma)
                counted += 1
                if counted >= cfg.repeats:
                    break
        est = LinkEstimate(avg, rtt_avg, time.time())
        self.links[peer] = est
        return est

    def forget(self, peer: str) -> None:
        """Drop what we measured to `peer` (it left or was removed)."""
        self.links.pop(peer, None)

    # -- answering -----------------------------------------------------------------------------

    def on_ping(self, peer: str, msg: Ping) -> Pong:
        """The reply to a peer's Ping."""
        return Pong(request_id=msg.request_id, sent_at=msg.sent_at)

    def on_pong(self, peer: str, msg: Pong) -> None:
        """Complete our ping (late or unknown pongs are ignored)."""
        fut = self._pings.get(msg.request_id)
        if fut is not None and not fut.done():
            fut.set_result(max(0.0, time.monotonic() - msg.sent_at))

    def on_probe_data(self, peer: str, msg: ProbeData, now: float) -> ProbeAck | None:
        """Count a probe frame; after the last one, the ProbeAck to send back."""
        key = (peer, msg.probe_id)
        rx = self._rx.get(key)
        size = msg.payload.nbytes
        if rx is None:
            rx = _Rx(now, now, 0, 0)
            self._rx[key] = rx
            while len(self._rx) > _MAX_RX:
                self._rx.popitem(last=False)
        rx.last = now
        rx.received += 1
        rx.nbytes += size
        if msg.seq + 1 < msg.count:
            return None
        del self._rx[key]
        return ProbeAck(probe_id=msg.probe_id, received=rx.received, nbytes=rx.nbytes,
                        elapsed_s=rx.last - rx.first)

    def on_probe_ack(self, peer: str, msg: ProbeAck) -> None:
        """Complete our bulk probe."""
        fut = self._acks.get(msg.probe_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def cancel(self) -> None:
        """Fail every outstanding measurement (on close)."""
        for ping in self._pings.values():
            ping.cancel()
        for ack in self._acks.values():
            ack.cancel()
