"""A small TCP meter for `check`: RTT by 1-byte echoes, bandwidth by a timed bulk transfer.

``serve``: listens on ADDR:PORT (inside one host's namespace), prints ``READY``; every
connection starts with one mode byte: ``P`` echoes each byte back (RTT), ``B`` swallows a bulk
stream until EOF and then answers with a JSON timeline of what arrived (one sample about every
5 ms: seconds since the first byte, cumulative bytes).

``measure``: connects from the sender's namespace, times ``--pings`` echoes (median RTT; both
ends of the echo run SCHED_RR for those few milliseconds where allowed, see `realtime`), then
sends ``--bytes`` and computes the rate from the receiver's timeline, leaving out the first
quarter of the transfer (or six RTTs, whichever is longer) so TCP slow start does not count.
Prints one JSON object: ``{"rtt_s": ..., "rtt_min_s": ..., "bandwidth_bits_per_s": ..., ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence

from fusiond.units import bits_per_s_from_bytes_per_s

_CHUNK = 1 << 20
_SAMPLE_S = 0.005


def realtime(on: bool) -> None:
    """Switch the calling thread to SCHED_RR (or back to normal). Echo timing is what `check`
    reports as the RTT: on a loaded machine a normal-priority thread can wait milliseconds for a
    CPU after each packet, which is the host's scheduler, not the emulated link. Only the
    short ping phases run real-time; bulk transfers never do. No-op where not permitted."""
    try:
        if on:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(5))
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError):
        pass


def _serve_conn(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"P":
            realtime(True)  # this thread only (Linux schedules threads individually)
            while True:
                b = conn.recv(1)
                if not b:
                    return
                conn.sendall(b)
        elif mode == b"B":
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            total = 0
            t0: float | None = None
            samples: list[tuple[float, int]] = []
            last_sample = 0.0
            while True:
                n = conn.recv_into(view)
                now = time.monotonic()
                if n == 0:
                    break
                if t0 is None:
                    t0 = now
                    samples.append((0.0, 0))
                total += n
                if now - last_sample >= _SAMPLE_S:
                    samples.append((now - t0, total))
                    last_sample = now
            if t0 is not None and samples[-1][1] != total:
                samples.append((last_sample - t0, total))
            conn.sendall(json.dumps({"bytes": total, "samples": samples}).encode())


def serve(addr: str, port: int) -> None:
    """Accept forever (the testbed kills the process); one thread per connection."""
    lsock = socket.create_server((addr, port), reuse_port=False)
    print("READY", flush=True)
    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=_serve_conn, args=(conn,), daemon=True).start()


def rate_from_samples(samples: Sequence[Sequence[float]], rtt_s: float) -> float:
    """Bits/s over the part of the timeline after slow start (see the module docstring)."""
    if len(samples) < 2:
        raise ValueError("too few samples to time the transfer")
    span = samples[-1][0]
    skip = min(max(0.25 * span, 6 * rtt_s), 0.6 * span)
    start = next(s for s in samples if s[0] >= skip)
    end = samples[-1]
    if end[0] - start[0] <= 0:
        raise ValueError("transfer too short to time")
    return bits_per_s_from_bytes_per_s((end[1] - start[1]) / (end[0] - start[0]))


def measure(addr: str, port: int, nbytes: int, pings: int, timeout: float) -> dict[str, float]:
    """RTT (median of `pings` echoes) and bandwidth (a bulk transfer of `nbytes`) to addr:port."""
    rtts: list[float] = []
    realtime(True)
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(b"P")
            for _ in range(pings + 1):
                t = time.monotonic()
                s.sendall(b"x")
                if s.recv(1) != b"x":
                    raise ConnectionError("echo server closed early")
                rtts.append(time.monotonic() - t)
    finally:
        realtime(False)
    rtts = rtts[1:]  # the first echo pays for lazy setup (ARP, thread start)
    rtt = statistics.median(rtts)
    t0 = time.monotonic()
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"B")
        chunk = memoryview(bytes(_CHUNK))
        left = nbytes
        while left > 0:
            n = min(left, _CHUNK)
            s.sendall(chunk[:n])
            left -= n
        s.shutdown(socket.SHUT_WR)
        reply = bytearray()
        while True:
            part = s.recv(1 << 16)
            if not part:
                break
            reply += part
    report = json.loads(reply)
    if report["bytes"] != nbytes:
        raise ConnectionError(f"receiver got {report['bytes']} of {nbytes} bytes")
    return {"rtt_s": rtt, "rtt_min_s": min(rtts),
            "bandwidth_bits_per_s": rate_from_samples(report["samples"], rtt),
            "bytes": float(nbytes), "wall_s": time.monotonic() - t0}


def main(argv: list[str] | None = None) -> int:
    """CLI: ``serve ADDR PORT`` or ``measure ADDR PORT --bytes N``."""
    ap = argparse.ArgumentParser(prog="python -m deploy.testbed.meter")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("serve")
    sp.add_argument("addr")
    sp.add_argument("port", type=int)
    mp = sub.add_parser("measure")
    mp.add_argument("addr")
    mp.add_argument("port", type=int)
    mp.add_argument("--bytes", type=int, required=True)
    mp.add_argument("--pings", type=int, default=10)
    mp.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        serve(args.addr, args.port)
        return 0
    print(json.dumps(measure(args.addr, args.port, args.bytes, args.pings, args.timeout)),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
