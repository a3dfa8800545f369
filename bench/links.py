"""What a secure peer link costs: PeerNetwork throughput vs a raw asyncio socket pair.

Two processes on loopback (a receiver child and this sender), so sender and receiver each get
their own core and GIL, as two daemons would. Each trial sends N tensors of 64 MiB fp32:

- raw:        a plain asyncio socket pair. The sender writes the same bytes in 1 MiB
              memoryview slices and waits for drain; the receiver's Protocol only counts the
              bytes it is handed (no parsing, no copies): the ceiling for anything on top.
- net-plain:  PeerNetwork without TLS: Forward messages carrying RAW tensors
              (protocol.tensors.encode(..).buffers(), not copied), xxh3 payload check on,
              frames decoded into a preallocated buffer per frame, tensor decoded (a view).
- net-tls:    PeerNetwork with mutual TLS 1.3 (the cluster CA, ECDSA P-256 certificates); the
              payload check is off there because TLS already authenticates every record.

The sender starts its clock before the first send and stops it when the receiver's reply says
it has all N tensors. Each mode runs `--trials` times (interleaved) and keeps the best.
Targets (issue 7): net-tls >= 0.5 x raw, net-plain >= 0.8 x raw. Exit 1 on a miss.

    python bench/links.py [--count 8] [--trials 3] [--loop uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fusiond.net import NetConfig, PeerNetwork, TLSMaterial
from fusiond.net.pki import (
    create_cluster_ca,
    issue_node_certificate,
    load_or_create_node_identity,
    store_node_credentials,
)
from protocol.messages import Ack, Forward, Message
from protocol.tensors import decode, encode

TENSOR_BYTES = 64 << 20
CHUNK = 1 << 20
CLUSTER = "c-bench"


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _make_credentials(root: Path) -> dict[str, tuple[str, TLSMaterial]]:
    ca = create_cluster_ca(root / "ca")
    out = {}
    for name in ("send", "recv"):
        ident = load_or_create_node_identity(root / name)
        cert = issue_node_certificate(ca, ident.key.public_key())
        out[name] = (ident.node_id, store_node_credentials(root / name, cert, ca.cert))
    return out


def _net_config() -> NetConfig:
    return NetConfig(bulk_queue_frames=4)


# ---------------------------------------------------------------------------------- receiver


class _Counter(asyncio.Protocol):
    def __init__(self, expect: int) -> None:
        self.left = expect
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.left -= len(data)
        if self.left <= 0 and self.transport is not None:
            self.transport.write(b"k")


async def _serve(mode: str, total_bytes: int, count: int, root: Path | None) -> None:
    loop = asyncio.get_running_loop()
    if mode == "raw":
        server = await loop.create_server(lambda: _Counter(total_bytes), "127.0.0.1", 0)
        print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
        await loop.run_in_executor(None, sys.stdin.readline)  # parent says stop
        server.close()
        return
    tls = TLSMaterial.in_state_dir(root / "recv") if root is not None else None
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
    net = PeerNetwork(
        node_id=node_id,
        cluster_id=_cluster(root, mode),
        listen=("127.0.0.1", 0),
        tls=tls,
        handler=handler,
        config=_net_config(),
    )
    await net.start()
    print(json.dumps({"port": net.address[1]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.readline)
    await net.close()


def _cluster(root: Path | None, mode: str) -> str:
    if mode != "net-tls" or root is None:
        return CLUSTER
    return TLSMaterial.in_state_dir(root / "recv").cluster_id()


# ------------------------------------------------------------------------------------ sender


async def _raw_trial(port: int, payload: memoryview, count: int) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.set_write_buffer_limits(high=4 * CHUNK)
    t0 = time.perf_counter()
    for _ in range(count):
        for pos in range(0, payload.nbytes, CHUNK):
            writer.write(payload[pos : pos + CHUNK])
            await writer.drain()
    await reader.readexactly(1)
    dt = time.perf_counter() - t0
    writer.close()
    return dt


async def _net_trial(
    net: PeerNetwork, peer: str, enc_bufs: list[memoryview], count: int, acks: asyncio.Queue[int]
) -> float:
    t0 = time.perf_counter()
    for i in range(count):
        msg = Forward(job_id="bench", plan_version=1, iteration=0, microbatch=i, edge="e0")
        await net.send(peer, msg, enc_bufs)
    await asyncio.wait_for(acks.get(), 120)
    return time.perf_counter() - t0


class _Child:
    def __init__(self, mode: str, count: int, loop_kind: str, root: Path | None) -> None:
        args = [
            sys.executable,
            __file__,
            "--serve",
            mode,
            "--count",
            str(count),
            "--loop",
            loop_kind,
        ]
        if root is not None:
            args += ["--root", str(root)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        self.port = int(json.loads(self.proc.stdout.readline())["port"])

    def stop(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _run_mode(
    mode: str, count: int, trials: int, loop_kind: str, root: Path, arr: np.ndarray[Any, Any]
) -> list[float]:
    """Seconds per trial for `mode` (a fresh receiver process per mode)."""
    total = count * TENSOR_BYTES
    enc = encode(arr, "raw")
    bufs = enc.buffers()
    times: list[float] = []
    if mode == "raw":
        payload = memoryview(arr).cast("B")
        for _ in range(trials):
            child = _Child(mode, count, loop_kind, None)
            try:
                times.append(await _raw_trial(child.port, payload, count))
            finally:
                child.stop()
        return times
    tls_root = root if mode == "net-tls" else None
    child = _Child(mode, count, loop_kind, tls_root)
    acks: asyncio.Queue[int] = asyncio.Queue(16)

    async def handler(peer: str, msg: Message) -> None:
        if isinstance(msg, Ack):
            await acks.put(msg.request_id)

    if tls_root is not None:
        send_id = TLSMaterial.in_state_dir(tls_root / "send").node_id()
        material: TLSMaterial | None = TLSMaterial.in_state_dir(tls_root / "send")
    else:
        send_id, material = "send", None
    net = PeerNetwork(
        node_id=send_id,
        cluster_id=_cluster(tls_root, mode),
        listen=("127.0.0.1", 0),
        tls=material,
        handler=handler,
        config=_net_config(),
    )
    await net.start()
    try:
        peer = await net.connect(("127.0.0.1", child.port))
        for _ in range(trials):
            times.append(await _net_trial(net, peer, bufs, count, acks))
    finally:
        await net.close()
        child.stop()
    assert total > 0
    return times


async def _main(args: argparse.Namespace) -> int:
    arr = np.random.default_rng(0).standard_normal(TENSOR_BYTES // 4, dtype=np.float32)
    total = args.count * TENSOR_BYTES
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fusion-links-") as tmp:
        root = Path(tmp)
        _make_credentials(root)  # both processes read them from here
        for mode in ("raw", "net-plain", "net-tls"):
            ts = await _run_mode(mode, args.count, args.trials, args.loop, root, arr)
            best[mode] = min(ts)
            print(
                f"  {mode:10s} trials: "
                + ", ".join(f"{total / t / 1e9:.2f}" for t in ts)
                + " GB/s",
                file=sys.stderr,
            )
    raw_gbs = total / best["raw"] / 1e9
    targets = {"raw": None, "net-plain": 0.8, "net-tls": 0.5}
    ok = True
    print(
        f"\nfusion peer links on loopback: {args.count} x 64 MiB fp32 per trial, "
        f"best of {args.trials}, loop={args.loop}, 2 processes"
    )
    print(f"{'mode':12s}{'GB/s':>8s}{'x raw':>8s}{'target':>9s}  result")
    for mode, t in best.items():
        gbs = total / t / 1e9
        ratio = gbs / raw_gbs
        tgt = targets[mode]
        if tgt is None:
            print(f"{mode:12s}{gbs:8.2f}{ratio:8.2f}{'-':>9s}  baseline")
            continue
        passed = ratio >= tgt
        ok &= passed
        print(
            f"{mode:12s}{gbs:8.2f}{ratio:8.2f}{'>=' + str(tgt):>9s}  {'PASS' if passed else 'FAIL'}"
        )
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=8, help="64 MiB tensors per trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    ap.add_argument("--serve", choices=("raw", "net-plain", "net-tls"), help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
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
