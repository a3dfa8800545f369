"""The userspace delay stage: holds each IPv4 packet of an NFQUEUE until its due time.

Used where the kernel has no ``netem`` (see TESTBED.md). It runs in the bridge namespace;
iptables sends the forwarded packets of every delayed (src, dst) pair to one queue, and this
program accepts each packet ``delay(src, dst)`` seconds after it arrived. Packets are kept in a
heap ordered by due time (a packet never overtakes an earlier one of the same pair, because each
pair has one fixed delay); the loop sleeps in ``select`` until the next due time, so the added
delay is accurate to about a millisecond on an idle machine.

Run: ``python -m deploy.testbed.delay --queue 0 --config delays.json`` where the JSON file is
``{"delays": [["10.250.0.1", "10.250.0.2", 0.02], ...]}`` (one-way seconds). Prints ``READY``
once the queue is bound; exits 0 on SIGTERM/SIGINT after releasing every held packet.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any, Protocol


class _Packet(Protocol):
    def get_payload(self) -> bytes: ...
    def accept(self) -> None: ...


def load_delays(path: str) -> dict[bytes, float]:
    """(src+dst as 8 raw bytes) -> one-way delay in seconds, from the JSON config."""
    with open(path) as f:
        data = json.load(f)
    out: dict[bytes, float] = {}
    for src, dst, delay in data["delays"]:
        out[socket.inet_aton(src) + socket.inet_aton(dst)] = float(delay)
    return out


class DelayStage:
    """Holds packets for a fixed per-pair delay; the NetfilterQueue callback and release loop."""

    def __init__(self, delays: dict[bytes, float]) -> None:
        self.delays = delays
        self.heap: list[tuple[float, int, _Packet]] = []
        self.seq = 0
        self.held_max = 0
        self.passed = 0

    def on_packet(self, pkt: _Packet) -> None:
        """NFQUEUE callback: compute the due time and hold the packet (or pass it at once)."""
        now = time.monotonic()
        head = pkt.get_payload()
        delay = self.delays.get(head[12:20], 0.0) if len(head) >= 20 else 0.0
        if delay <= 0.0:
            pkt.accept()
            self.passed += 1
            return
        self.seq += 1
        heapq.heappush(self.heap, (now + delay, self.seq, pkt))
        if len(self.heap) > self.held_max:
            self.held_max = len(self.heap)

    def release_due(self, lead_s: float = 0.0, now: float | None = None) -> float | None:
        """Accept every packet due within `lead_s` from now; seconds until the next one is
        (None: empty). `lead_s` is how late the loop's sleep tends to wake (`WakeLateness`):
        released that much early, packets leave on time on average instead of late."""
        heap = self.heap
        now = time.monotonic() if now is None else now
        while heap and heap[0][0] <= now + lead_s:
            heapq.heappop(heap)[2].accept()
            self.passed += 1
        return max(0.0, heap[0][0] - now - lead_s) if heap else None

    def flush(self) -> None:
        """Release everything held (on exit: never strand packets in the kernel queue)."""
        while self.heap:
            heapq.heappop(self.heap)[2].accept()


class WakeLateness:
    """How late a timed sleep wakes past its timeout, as an EWMA, within `cap_s`.

    Every held packet waits for the loop to wake, so each wake-up's lateness is added to its
    delay: about 0.5 ms per direction on an idle machine, more where the kernel's timers are
    coarse or the host is busy (a CI run read 12.5 ms for a 10 ms RTT). Sleeping that much
    less takes it out."""

    def __init__(self, *, weight: float = 0.1, cap_s: float = 0.003) -> None:
        self.weight = weight
        self.cap_s = cap_s
        self.estimate_s = 0.0

    def observe(self, asked_s: float, slept_s: float) -> None:
        """One sleep that ran to its timeout: asked for `asked_s`, took `slept_s`."""
        late = min(self.cap_s, max(0.0, slept_s - asked_s))
        self.estimate_s += self.weight * (late - self.estimate_s)


def raise_priority() -> str:
    """Run ahead of the emulated hosts' work: a delay stage that waits for a CPU adds that
    wait to every packet (ms on a loaded 2-core machine). Real-time round robin where allowed
    (the kernel still caps real-time tasks at 95 % of each CPU), else a lower nice value."""
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
        return "SCHED_RR 10"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice -10"
    except OSError as exc:
        return f"normal ({exc})"


def main(argv: list[str] | None = None) -> int:
    """Bind the queue, then loop: read packets when readable, release them when due."""
    ap = argparse.ArgumentParser(prog="python -m deploy.testbed.delay", description=__doc__)
    ap.add_argument("--queue", type=int, default=0, help="NFQUEUE number")
    ap.add_argument("--config", required=True, help="JSON file with the per-pair delays")
    ap.add_argument("--max-held", type=int, default=200_000,
                    help="kernel queue length (packets held at once)")
    ap.add_argument("--no-realtime", action="store_true",
                    help="stay at normal CPU priority (default: SCHED_RR, else nice -10)")
    args = ap.parse_args(argv)
    if not args.no_realtime:
        print(f"delay stage priority: {raise_priority()}", file=sys.stderr, flush=True)

    from netfilterqueue import COPY_PACKET, NetfilterQueue  # imported here: optional dependency

    stage = DelayStage(load_delays(args.config))
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    nfq = NetfilterQueue()
    # Copy only the IPv4 header's first 20 bytes: the addresses are all we read, and copying
    # whole packets to userspace would cost most of the CPU this stage uses.
    nfq.bind(args.queue, stage.on_packet, max_len=args.max_held, mode=COPY_PACKET, range=20,
             sock_len=64 << 20)
    fd = nfq.get_fd()
    print("READY", flush=True)
    late = WakeLateness()
    try:
        while not stop:
            timeout = stage.release_due(late.estimate_s)
            asked = 0.2 if timeout is None else timeout
            t0 = time.monotonic()
            try:
                readable, _, _ = select.select([fd], [], [], asked)
            except InterruptedError:
                continue
            if readable:
                nfq.run(block=False)
            elif timeout is not None and asked >= 0.0005:  # a zero timeout says nothing
                late.observe(asked, time.monotonic() - t0)
    finally:
        stage.flush()
        nfq.unbind()
        print(f"delay stage: passed {stage.passed} packets, held at most {stage.held_max}, "
              f"woke {late.estimate_s * 1e3:.2f} ms late", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
