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

A round (``probe``) is one RTT measurement, then one warm-up transfer, then timed transfers:

- the warm-up is never counted: after an idle period TCP restarts in slow start (and a new
  connection starts there), so the first transfer of a round runs below the link's rate for
  several RTTs however it is sized (measured on a 20 Mbit/s, 30 ms link: 9.3 Mbit/s for a
  256 KiB warm-up, 18.6-19.2 for the transfers after it). It opens the window (it carries
  ``warmup_rtts`` RTTs of the last estimate, or ``initial_bytes`` without one) and sizes the
  next transfer;
- each timed transfer is sized from the latest sample to last ``duration = max(target_s,
  rtt_factor * RTT)``: a transfer of about one RTT barely opens TCP's window further, so on
  a long fat link a first round would never reach the link's rate (200 Mbit/s at 250 ms:
  31.5 Mbit/s with 0.3 s transfers, 191 with 2 RTTs);
- a sample counts only if its transfer lasted at least a third of ``duration`` (or hit
  ``max_bytes``): one sized from a far too low guess says little; and only if it is not more
  than ``rising`` above the sample before it: a rate still climbing means the window was still
  opening (a first round on a long fat link, where the warm-up is sized blind: 100 Mbit/s at
  60 ms read 70, 83, 95 Mbit/s in a row);
- the round's result is the median of its ``repeats`` counted samples (a stalled sample does
  not drag it), and its accuracy their relative half-range (``spread``: (max - min) / 2 /
  median). A round spends at most ``repeats + extra_transfers`` timed transfers; if none of
  them settled in a first round, the latest sample stands.

Rounds update the estimate by `next_bandwidth`: a round that agrees with the estimate (each
figure's band, its spread but at least ``steady_band``, overlaps the other's) is blended in by
an EWMA whose weight grows with the round's accuracy against the estimate's (`blend_weight`),
so a steady link's estimate does not wander with measurement noise; a round whose band lies
wholly outside the estimate's is a step change (the link was reshaped, a route moved, another
tenant started or stopped) and *replaces* the estimate. An EWMA alone cannot follow a
step: at weight 0.3 per 30 s round, a drop from 100 to 20 Mbit/s took 7 minutes to come within
2x, and every plan made meanwhile used the stale figure. The price of replacing is that one
consistent outlier round (a tight cluster of samples far off the estimate) shows for one round;
the next round, back in its old band, replaces it again.

Units: rates here are bits per second (``_bits_per_s``), sizes bytes; `fusiond.units` converts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fusiond.units import bits_per_s_from_bytes_per_s, bytes_per_s_from_bits_per_s
from protocol.frames import Buffer
from protocol.messages import Message, Ping, Pong, ProbeAck, ProbeData

SendFn = Callable[[str, Message, Sequence[Buffer]], Awaitable[None]]

_MAX_RX = 64
"""Concurrent incoming probes remembered (bounded: a peer cannot grow our memory)."""


@dataclass(frozen=True)
class ProbeConfig:
    """Sizes and timeouts of link probes."""

    target_s: float = 0.3
    """Shortest duration of a timed transfer, seconds."""
    rtt_factor: float = 2.0
    """A timed transfer lasts at least this many RTTs too."""
    warmup_rtts: float = 4.0
    """The uncounted warm-up transfer carries this many RTTs of the last estimate (slow start
    sends about two windows' worth before the window reaches the link's bandwidth-delay
    product)."""
    repeats: int = 3
    """Counted samples per round."""
    extra_transfers: int = 6
    """Timed transfers a round may spend beyond ``repeats`` on samples that do not count."""
    rising: float = 0.1
    """A sample more than this fraction above the one before is not counted (the window was
    still opening)."""
    max_bytes: int = 64 << 20
    min_bytes: int = 64 << 10
    initial_bytes: int = 256 << 10
    chunk_bytes: int = 1 << 20
    min_frames: int = 4
    ewma: float = 0.3
    """Weight of a new round's result in the bandwidth and RTT averages (a round that agrees
    with the estimate; see `next_bandwidth`)."""
    steady_band: float = 0.1
    """Least relative half-width of a bandwidth figure's band (its round's spread where that is
    wider): rounds whose bands overlap the estimate's are blended in, others replace it."""
    timeout_s: float = 5.0
    """A ping or a bulk probe not answered within this is a failure."""


@dataclass(frozen=True)
class LinkEstimate:
    """What we know of our link to one peer."""

    bandwidth_bits_per_s: float | None
    rtt_s: float | None
    measured_at: float
    """time.time() of the last round that measured the bandwidth (the figure's age)."""
    bandwidth_spread_ratio: float = 0.0
    """Accuracy of the figure: the relative half-range of its round's counted samples (0: one
    sample), or where rounds were blended, their spreads blended alike (`blended_spread`)."""
    changed: bool = False
    """That round replaced the estimate (a step change, or the first round) rather than being
    blended into it."""


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


def transfer_duration(config: ProbeConfig, rtt_s: float) -> float:
    """How long a timed transfer should last on a link with this RTT."""
    return max(config.target_s, config.rtt_factor * rtt_s)


def transfer_size(config: ProbeConfig, bandwidth_bits_per_s: float | None, seconds: float
                  ) -> int:
    """Bytes that take `seconds` at `bandwidth_bits_per_s` (``initial_bytes`` when unknown),
    within ``min_bytes`` and ``max_bytes``."""
    size = (config.initial_bytes if not bandwidth_bits_per_s
            else int(bytes_per_s_from_bits_per_s(bandwidth_bits_per_s) * seconds))
    return max(config.min_bytes, min(config.max_bytes, size))


def bandwidth_from_ack(ack: ProbeAck, frames: int, sent_bytes: int, duration_s: float,
                       rtt_s: float) -> tuple[float, float]:
    """(bits per second, seconds the transfer took) from a probe's ack and the sender's timing:
    the smaller of the receiver's and the sender's estimate (see the module docstring)."""
    span_s = max(duration_s - rtt_s, 1e-6)
    sender_bits_per_s = bits_per_s_from_bytes_per_s(sent_bytes / span_s)
    if frames >= 2 and ack.received == frames and ack.elapsed_s >= 1e-3:
        receiver_bits_per_s = bits_per_s_from_bytes_per_s(
            ack.nbytes * (frames - 1) / frames / ack.elapsed_s)
        if receiver_bits_per_s < sender_bits_per_s:
            return receiver_bits_per_s, ack.elapsed_s
    return sender_bits_per_s, span_s


def round_figure(samples: Sequence[float]) -> tuple[float, float]:
    """(median, spread) of a round's counted samples: spread is the relative half-range,
    (max - min) / 2 / median (0 for one sample). ValueError when `samples` is empty."""
    if not samples:
        raise ValueError("a round needs at least one sample")
    median = statistics.median(samples)
    if not median > 0:
        return median, 0.0
    return median, (max(samples) - min(samples)) / 2 / median


def next_bandwidth(old_bits_per_s: float | None, old_spread_ratio: float,
                   new_bits_per_s: float, new_spread_ratio: float, *, alpha: float,
                   steady_band: float) -> tuple[float, bool]:
    """(the estimate after a round, whether the round replaced it rather than being blended).

    Each figure stands for a band around it, ``[x / (1 + b), x * (1 + b)]`` with ``b`` its
    spread but at least `steady_band`. Bands that overlap are the same link measured with
    noise: the round goes into the EWMA (weight `alpha`). A round whose band lies wholly
    outside the estimate's saw a different link (a step change): it replaces the estimate, so
    a step shows in the first round that measures it. No estimate yet: the round is it.
    """
    if old_bits_per_s is None or not old_bits_per_s > 0 or not new_bits_per_s > 0:
        return new_bits_per_s, True
    b_old = max(steady_band, old_spread_ratio)
    b_new = max(steady_band, new_spread_ratio)
    apart = abs(math.log(new_bits_per_s / old_bits_per_s))
    if apart > math.log1p(b_old) + math.log1p(b_new):
        return new_bits_per_s, True
    weight = blend_weight(old_spread_ratio, new_spread_ratio, alpha=alpha,
                          steady_band=steady_band)
    return ewma(old_bits_per_s, new_bits_per_s, weight), False


def blend_weight(old_spread_ratio: float, new_spread_ratio: float, *, alpha: float,
                 steady_band: float) -> float:
    """The weight a round that agrees with the estimate gets in it: `alpha` when both are as
    accurate, scaled by the ratio of their variances (bands squared, each at least
    `steady_band`) and at most 1. A tight round after a loose estimate (a first round whose
    window was still opening: +-42 % at 80 Mbit/s on a 100 Mbit/s link) takes over instead of
    being averaged in at `alpha` for minutes; a loose round barely moves a tight estimate."""
    b_old = max(steady_band, old_spread_ratio)
    b_new = max(steady_band, new_spread_ratio)
    return min(1.0, alpha * (b_old / b_new) ** 2)


def blended_spread(old_spread_ratio: float, new_spread_ratio: float, *, alpha: float,
                   steady_band: float) -> float:
    """The accuracy of an estimate a round was blended into (`blend_weight` of each)."""
    w = blend_weight(old_spread_ratio, new_spread_ratio, alpha=alpha, steady_band=steady_band)
    return (1.0 - w) * old_spread_ratio + w * new_spread_ratio


class LinkProber:
    """Measures links to peers; answers the peers' probes. One event loop only."""

    def __init__(self, *, send: SendFn, config: ProbeConfig) -> None:
        self._send = send
        self.config = config
        """Sizes and timeouts; may be replaced between rounds (frames stay within the first
        config's ``chunk_bytes``: the filler is allocated once)."""
        self._ids = itertools.count(1)
        self._pings: dict[int, asyncio.Future[float]] = {}
        self._acks: dict[int, asyncio.Future[ProbeAck]] = {}
        self._rx: OrderedDict[tuple[str, int], _Rx] = OrderedDict()
        self._filler = memoryview(os.urandom(min(config.chunk_bytes, config.max_bytes)))
        self.links: dict[str, LinkEstimate] = {}
        self.failures: dict[str, int] = {}
        """Peer -> rounds that failed (no answer in time, or the transport failed), until
        the peer is forgotten."""

    # -- measuring -----------------------------------------------------------------------------

    async def rtt(self, peer: str) -> float:
        """Smallest of ``repeats`` ping round trips to `peer`; ProbeFailed if none answered."""
        best = math.inf
        for _ in range(self.config.repeats):
            rid = next(self._ids)
            fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
            self._pings[rid] = fut
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    await self._send(peer, Ping(request_id=rid, sent_at=time.monotonic()), ())
                    best = min(best, await fut)
            except TimeoutError:
                continue
            finally:
                self._pings.pop(rid, None)
        if not math.isfinite(best):
            raise ProbeFailed(f"no Pong from {peer} within {self.config.timeout_s}s")
        return best

    async def bulk(self, peer: str, nbytes: int, rtt_s: float) -> tuple[float, float]:
        """One timed transfer of about `nbytes`: (bits per second, seconds it took)."""
        cfg = self.config
        frames = max(cfg.min_frames, math.ceil(nbytes / cfg.chunk_bytes))
        chunk = min(max(1, math.ceil(nbytes / frames)), len(self._filler))
        probe_id = next(self._ids)
        fut: asyncio.Future[ProbeAck] = asyncio.get_running_loop().create_future()
        self._acks[probe_id] = fut
        # Sending (backpressure) and the answer must fit in the timeout plus twice what the
        # last estimate says the transfer takes: a slow link is not a dead one.
        est = self.links.get(peer)
        expected_s = (frames * chunk / bytes_per_s_from_bits_per_s(est.bandwidth_bits_per_s)
                      if est is not None and est.bandwidth_bits_per_s else 0.0)
        limit = cfg.timeout_s + 2 * expected_s
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
        """Measure RTT then bandwidth to `peer` (one round, see the module docstring), update
        and return its estimate.

        Raises ProbeFailed when the peer does not answer (the estimate is kept); errors of the
        transport (peer unreachable, ...) propagate. Either counts in `failures`.
        """
        try:
            return await self._round(peer)
        except Exception:
            self.failures[peer] = self.failures.get(peer, 0) + 1
            raise

    async def _round(self, peer: str) -> LinkEstimate:
        cfg = self.config
        rtt = await self.rtt(peer)
        old = self.links.get(peer)
        avg = old.bandwidth_bits_per_s if old is not None else None
        rtt_avg = ewma(old.rtt_s if old is not None else None, rtt, cfg.ewma)
        duration = transfer_duration(cfg, rtt)
        # Warm-up: opens TCP's window after an idle period; its sample only sizes the next.
        guess, _ = await self.bulk(peer, transfer_size(cfg, avg, cfg.warmup_rtts * rtt), rtt)
        # A rate well above the one before means the window was still opening (slow start
        # outlasted the warm-up, e.g. a first round on a long fat link): not counted. The first
        # timed transfer compares with the last round's result where there is one, since the
        # warm-up's own sample is low by design.
        prev = avg if avg is not None else guess
        samples: list[float] = []
        sample = guess
        for _ in range(cfg.repeats + cfg.extra_transfers):
            size = transfer_size(cfg, guess, duration)
            sample, took = await self.bulk(peer, size, rtt)
            rising = sample > prev * (1.0 + cfg.rising)
            guess = prev = sample  # the next transfer is sized from the latest sample
            if (took >= duration / 3 or size >= cfg.max_bytes) and not rising:
                samples.append(sample)
                if len(samples) >= cfg.repeats:
                    break
        if not samples and avg is None:
            samples.append(sample)  # nothing settled: the latest is the best there is
        if not samples:  # nothing counted: the bandwidth figure (and its age) stands
            assert old is not None
            est = dataclasses.replace(old, rtt_s=rtt_avg, changed=False)
        else:
            median, spread = round_figure(samples)
            old_spread = old.bandwidth_spread_ratio if old is not None else 0.0
            rate, changed = next_bandwidth(avg, old_spread, median, spread, alpha=cfg.ewma,
                                           steady_band=cfg.steady_band)
            if not changed:
                spread = blended_spread(old_spread, spread, alpha=cfg.ewma,
                                        steady_band=cfg.steady_band)
            est = LinkEstimate(rate, rtt_avg, time.time(), spread, changed)
        self.links[peer] = est
        return est

    def forget(self, peer: str) -> None:
        """Drop what we measured to `peer` (it left or was removed)."""
        self.links.pop(peer, None)
        self.failures.pop(peer, None)

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
