"""What a secure peer link costs: PeerNetwork throughput vs a raw asyncio socket pair.

Two processes on loopback (a receiver child and this sender), so sender and receiver each get
their own core and GIL, as two daemons would. Each trial sends N tensors of 64 MiB fp32:

- raw:        the baseline the targets refer to: a raw asyncio socket pair with plain streams.
              The sender does writelines([tensor bytes]) + drain per tensor; the receiver
              readexactly(64 MiB) per tensor (what receiving a tensor with asyncio streams
              costs: StreamReader buffers, then copies out).
- raw-discard: the ceiling (no target): the sender writes 1 MiB memoryview slices with
              drain; the receiver's BufferedProtocol only counts bytes landing in one reused,
              cache-hot 256 KiB buffer: no message, no copy, no memory kept. Anything that
              keeps the tensors pays at least the writes into fresh memory on top of this.
- net-plain:  PeerNetwork without TLS: Forward messages carrying RAW tensors
              (protocol.tensors.encode(..).buffers(), not copied), the payload received
              straight into its own buffer, the tensor decoded (a view). As configured by
              default on loopback: no xxh3 payload check (loopback has no wire to corrupt).
- net-xxh3:   reference only: net-plain with the xxh3 payload check forced on, as on a
              plaintext link over a real network.
- net-tls:    PeerNetwork with mutual TLS 1.3 (the cluster CA, ECDSA P-256 certificates); the
              payload check is off there because TLS already authenticates every record.
- tls-socket: for reference only (no target): the same bytes over OpenSSL on blocking
              sockets, no asyncio at all: what TLS itself costs on this machine.

Every process runs with `fusiond.net.tune_allocator()` (what PeerNetwork applies at start).
The sender starts its clock before the first send and stops it when the receiver's reply says
it has all N tensors. The modes run in `--trials` interleaved rounds (every mode once per
round, each against a fresh receiver) and each keeps its best round, so the baseline and the
modes compared with it meet the same background load. Besides GB/s, the
table shows GB moved per CPU-second of the sending and the receiving process: the cost per
byte, which a busy machine does not distort the way it distorts wall-clock throughput.
Targets (issue 7): net-tls >= 0.5 x raw, net-plain >= 0.8 x raw. Exit 1 on a miss. The
"x ceil" column gives every mode against raw-discard as well.

    python bench/links.py [--count 8] [--trials 5] [--loop uvloop|asyncio] [--modes net-tls,...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusiond.net import NetConfig, PeerNetwork, TLSMaterial
from fusiond.net import tls as tlsmod
from fusiond.net.pki import (
    create_cluster_ca,
    issue_node_certificate,
    load_or_create_node_identity,
    store_node_credentials,
)
from fusiond.net.transport import tune_allocator
from protocol.messages import Ack, Forward, Message
from protocol.tensors import decode, encode

_CPU0 = [0.0]
"""The receiver's CPU time when it started listening (start-up is not part of the cost)."""
TENSOR_BYTES = 64 << 20
CHUNK = 1 << 20
CLUSTER = "c-bench"
MODES = ("raw", "raw-discard", "net-plain", "net-tls", "net-xxh3", "tls-socket")
TARGETS: dict[str, float | None] = {
    "raw": None, "raw-discard": None, "net-plain": 0.8, "net-tls": 0.5, "net-xxh3": None,
    "tls-socket": None,
}


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _make_credentials(root: Path) -> None:
    ca = create_cluster_ca(root / "ca")
    for name in ("send", "recv"):
        ident = load_or_create_node_identity(root / name)
        cert = issue_node_certificate(ca, ident.key.public_key())
        store_node_credentials(root / name, cert, ca.cert)


def _net_config(mode: str) -> NetConfig:
    # net-plain runs the default: no payload checksum on loopback (no wire to corrupt bytes);
    # net-xxh3 forces it on, as on a plaintext link over a real network.
    return NetConfig(bulk_queue_frames=4, payload_check=True if mode == "net-xxh3" else None)


def _cluster(root: Path, mode: str) -> str:
    if mode != "net-tls":
        return CLUSTER
    return TLSMaterial.in_state_dir(root / "recv").cluster_id()


# ---------------------------------------------------------------------------------- receiver


class _Counter(asyncio.BufferedProtocol):
    """Counts received bytes into one reused buffer; answers b"k" after `expect` bytes."""

    def __init__(self, expect: int) -> None:
        self.left = expect
        self.buf = memoryview(bytearray(256 << 10))
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buf

    def buffer_updated(self, nbytes: int) -> None:
        self.left -= nbytes
        if self.left <= 0 and self.transport is not None:
            self.transport.write(b"k")


def _tls_socket_server(root: Path, total: int) -> None:
    """Blocking OpenSSL receiver (thread): recv_into one reused buffer, answer b"k"."""
    ctx = tlsmod.server_context(TLSMaterial.in_state_dir(root / "recv"))
    lsock = socket.create_server(("127.0.0.1", 0))
    _CPU0[0] = time.process_time()
    print(json.dumps({"port": lsock.getsockname()[1]}), flush=True)
    buf = memoryview(bytearray(1 << 20))
    lsock.settimeout(60)
    while True:
        try:
            raw, _ = lsock.accept()
        except TimeoutError:
            return
        with ctx.wrap_socket(raw, server_side=True) as conn:
            left = total
            while left > 0:
                n = conn.recv_into(buf)
                if n == 0:
                    break
                left -= n
            conn.sendall(b"k")


async def _serve(mode: str, total: int, count: int, root: Path) -> None:
    loop = asyncio.get_running_loop()
    if mode == "tls-socket":
        import threading

        threading.Thread(target=_tls_socket_server, args=(root, total), daemon=True).start()
        await loop.run_in_executor(None, sys.stdin.readline)
        print(json.dumps({"cpu_s": time.process_time() - _CPU0[0]}), flush=True)
        return
    if mode == "raw":

        async def conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for _ in range(count):
                data = await reader.readexactly(TENSOR_BYTES)
                assert len(data) == TENSOR_BYTES
                del data
            writer.write(b"k")
            await writer.drain()
            writer.close()

        streams = await asyncio.start_server(conn, "127.0.0.1", 0)
        _CPU0[0] = time.process_time()
        print(json.dumps({"port": streams.sockets[0].getsockname()[1]}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # the parent says stop
        streams.close()
        print(json.dumps({"cpu_s": time.process_time() - _CPU0[0]}), flush=True)
        return
    if mode == "raw-discard":
        server = await loop.create_server(lambda: _Counter(total), "127.0.0.1", 0)
        _CPU0[0] = time.process_time()
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # the parent says stop
        server.close()
        print(json.dumps({"cpu_s": time.process_time() - _CPU0[0]}), flush=True)
        return
    tls = TLSMaterial.in_state_dir(root / "recv") if mode == "net-tls" else None
    got = {"n": 0}
    net: PeerNetwork | None = None

    async def handler(peer: str, msg: Message) -> None:
        if isinstance(msg, Forward):
            arr = decode(msg.payload)
            assert arr.nbytes == TENSOR_BYTES
            got["n"] += 1
            if got["n"] % count == 0:
                assert net is not None
                await net.send(peer, Ack(request_id=got["n"]))

    node_id = tls.node_id() if tls is not None else "recv"
    net = PeerNetwork(node_id=node_id, cluster_id=_cluster(root, mode), listen=("127.0.0.1", 0),
                      tls=tls, handler=handler, config=_net_config(mode))
    await net.start()
    _CPU0[0] = time.process_time()
    print(json.dumps({"port": net.address[1]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await net.close()
    print(json.dumps({"cpu_s": time.process_time() - _CPU0[0]}), flush=True)


# ------------------------------------------------------------------------------------ sender


class _Child:
    """The receiver process for one mode; prints its port, then its CPU seconds at stop."""

    def __init__(self, mode: str, count: int, loop_kind: str, root: Path) -> None:
        args = [sys.executable, __file__, "--serve", mode, "--count", str(count),
                "--loop", loop_kind, "--root", str(root)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert self.proc.stdout is not None
        self.port = int(json.loads(self.proc.stdout.readline())["port"])

    def stop(self) -> float:
        """Stop the receiver; return the CPU seconds it used (NaN if it died)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        cpu = float("nan")
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
            cpu = float(json.loads(self.proc.stdout.readline())["cpu_s"])
        except (BrokenPipeError, ValueError, KeyError):
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return cpu


@dataclass
class _Result:
    times: list[float]
    send_cpu_s: float
    recv_cpu_s: float
    """From the moment the receiver listens (its imports and set-up excluded)."""


async def _stream_trials(port: int, payload: memoryview, count: int, trials: int,
                         times: list[float]) -> None:
    for _ in range(trials):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.perf_counter()
        for _ in range(count):
            writer.writelines([payload])
            await writer.drain()
        await reader.readexactly(1)
        times.append(time.perf_counter() - t0)
        writer.close()


async def _raw_trials(port: int, payload: memoryview, count: int, trials: int,
                      times: list[float]) -> None:
    for _ in range(trials):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.set_write_buffer_limits(high=4 * CHUNK)
        t0 = time.perf_counter()
        for _ in range(count):
            for pos in range(0, payload.nbytes, CHUNK):
                writer.write(payload[pos : pos + CHUNK])
                await writer.drain()
        await reader.readexactly(1)
        times.append(time.perf_counter() - t0)
        writer.close()


def _tls_socket_trials(port: int, root: Path, payload: memoryview, count: int, trials: int,
                       times: list[float]) -> None:
    ctx = tlsmod.client_context(TLSMaterial.in_state_dir(root / "send"))
    for _ in range(trials):
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port))) as s:
            t0 = time.perf_counter()
            for _ in range(count):
                for pos in range(0, payload.nbytes, CHUNK):
                    s.sendall(payload[pos : pos + CHUNK])
            s.recv(1)
            times.append(time.perf_counter() - t0)


async def _net_trials(mode: str, port: int, root: Path, arr: np.ndarray[Any, Any], count: int,
                      trials: int, times: list[float]) -> None:
    bufs = encode(arr, "raw").buffers()
    acks: asyncio.Queue[int] = asyncio.Queue(16)

    async def handler(peer: str, msg: Message) -> None:
        if isinstance(msg, Ack):
            await acks.put(msg.request_id)

    material = TLSMaterial.in_state_dir(root / "send") if mode == "net-tls" else None
    send_id = material.node_id() if material is not None else "send"
    net = PeerNetwork(node_id=send_id, cluster_id=_cluster(root, mode),
                      listen=("127.0.0.1", 0), tls=material, handler=handler,
                      config=_net_config(mode))
    await net.start()
    try:
        peer = await net.connect(("127.0.0.1", port))
        for _ in range(trials):
            t0 = time.perf_counter()
            for i in range(count):
                msg = Forward(job_id="bench", plan_version=1, iteration=0, microbatch=i,
                              edge="e0")
                await net.send(peer, msg, bufs)
            await asyncio.wait_for(acks.get(), 300)
            times.append(time.perf_counter() - t0)
    finally:
        await net.close()


async def _run_mode(mode: str, args: argparse.Namespace, root: Path,
                    arr: np.ndarray[Any, Any]) -> _Result:
    """One trial of `mode` against a fresh receiver process."""
    times: list[float] = []
    child = _Child(mode, args.count, args.loop, root)
    payload = memoryview(arr).cast("B")
    try:
        cpu0 = time.process_time()
        if mode == "raw":
            await _stream_trials(child.port, payload, args.count, 1, times)
        elif mode == "raw-discard":
            await _raw_trials(child.port, payload, args.count, 1, times)
        elif mode == "tls-socket":
            _tls_socket_trials(child.port, root, payload, args.count, 1, times)
        else:
            await _net_trials(mode, child.port, root, arr, args.count, 1, times)
        send_cpu = time.process_time() - cpu0
    finally:
        recv_cpu = child.stop()
    return _Result(times, send_cpu, recv_cpu)


async def _main(args: argparse.Namespace) -> int:
    arr = np.random.default_rng(0).standard_normal(TENSOR_BYTES // 4, dtype=np.float32)
    total = args.count * TENSOR_BYTES
    wanted = {"raw", "raw-discard", *args.modes.split(",")}
    unknown = wanted - set(MODES)
    if unknown:
        print(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    modes = [m for m in MODES if m in wanted]
    results = {m: _Result([], 0.0, 0.0) for m in modes}
    with tempfile.TemporaryDirectory(prefix="fusion-links-") as tmp:
        root = Path(tmp)
        _make_credentials(root)  # both processes read them from here
        # Rounds, not one mode after another: each round runs every mode once, so a baseline
        # and the modes compared with it see the same background load (this machine is noisy
        # and its load drifts over a minute); each mode keeps its best round.
        for rnd in range(args.trials):
            for mode in modes:
                res = await _run_mode(mode, args, root, arr)
                r = results[mode]
                r.times += res.times
                r.send_cpu_s += res.send_cpu_s
                r.recv_cpu_s += res.recv_cpu_s
                print(f"  round {rnd + 1}: {mode:11s} {total / res.times[0] / 1e9:.2f} GB/s",
                      file=sys.stderr)
    raw_gbs = total / min(results["raw"].times) / 1e9
    ceil_gbs = total / min(results["raw-discard"].times) / 1e9
    ok = True
    print(f"\nfusion peer links on loopback: {args.count} x 64 MiB fp32 per trial, best of "
          f"{args.trials} interleaved rounds, loop={args.loop}, sender and receiver in 2 "
          f"processes, {os.cpu_count()} CPUs")
    print(f"{'mode':12s}{'GB/s':>7s}{'x raw':>7s}{'x ceil':>7s}{'target':>8s}  {'result':9s}"
          f"{'send GB/cpu-s':>14s}{'recv GB/cpu-s':>14s}")
    for mode, r in results.items():
        gbs = total / min(r.times) / 1e9
        ratio = gbs / raw_gbs
        ceil = gbs / ceil_gbs
        moved = total * len(r.times) / 1e9
        cpu = f"{moved / r.send_cpu_s:14.2f}{moved / r.recv_cpu_s:14.2f}"
        tgt = TARGETS[mode]
        if tgt is None:
            verdict, tgt_s = ("baseline" if mode == "raw" else "reference"), "-"
        else:
            passed = ratio >= tgt
            ok &= passed
            verdict, tgt_s = ("PASS" if passed else "FAIL"), f">={tgt}"
        print(f"{mode:12s}{gbs:7.2f}{ratio:7.2f}{ceil:7.2f}{tgt_s:>8s}  {verdict:9s}{cpu}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--count", type=int, default=8, help="64 MiB tensors per trial")
    ap.add_argument("--trials", type=int, default=5,
                    help="rounds; each round runs every mode once, each mode keeps its best")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="comma-separated modes to run (raw and raw-discard always run)")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # Every mode runs with the allocator setting PeerNetwork applies at start (freed large
    # buffers are reused, not unmapped), so the baselines are not handicapped by page faults.
    tune_allocator()
    loop = _new_loop(args.loop)
    try:
        if args.serve:
            total = args.count * TENSOR_BYTES
            loop.run_until_complete(_serve(args.serve, total, args.count, args.root))
            return 0
        return loop.run_until_complete(_main(args))
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
