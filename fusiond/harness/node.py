"""A bare job node in its own process: a PeerNetwork (plaintext, loopback) and a JobWorker.

For benchmarks and tests that want stages in separate processes without full daemons:
`python -m fusiond.harness.node NAME` prints `READY <host> <port>` on stdout, then reads lines
`PEER <name> <host> <port>` on stdin; closing stdin shuts the node down (exit 0).
`spawn_nodes(names)` starts several and wires them to each other and to extra in-process
addresses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from fusiond.cli import run_on_loop
from fusiond.jobs.worker import JobWorker, local_send_now, local_sender
from fusiond.net.transport import NetConfig, PeerNetwork
from fusiond.train.stage import StageConfig
from protocol.messages import Address, Message

__all__ = ["NodeProcess", "spawn_nodes"]


async def _serve(name: str, cluster: str, recv_timeout_s: float) -> None:
    worker: JobWorker | None = None

    async def dispatch(peer: str, msg: Message) -> None:
        assert worker is not None
        await worker.handle(peer, msg)

    net = PeerNetwork(node_id=name, cluster_id=cluster, listen=("127.0.0.1", 0), tls=None,
                      handler=dispatch, config=NetConfig(connect_timeout_s=5,
                                                         handshake_timeout_s=5))
    await net.start()
    worker = JobWorker(node_id=name, send=local_sender(name, net.send, dispatch),
                       stage_config=StageConfig(recv_timeout_s=recv_timeout_s),
                       send_now=local_send_now(name, net.send_now))
    net.set_receive_now(worker.receive_now)
    await worker.start()
    host, port = net.address
    print(f"READY {host} {port}", flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            parts = line.decode().split()
            if len(parts) == 4 and parts[0] == "PEER":
                net.add_peer_address(parts[1], (parts[2], int(parts[3])))
    finally:
        await worker.close()
        await net.close()


@dataclass
class NodeProcess:
    """A spawned node: its name, address and process."""

    name: str
    address: Address
    proc: asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def spawn_nodes(names: list[str], *, cluster: str = "inproc",
                      extra: Mapping[str, Address] | None = None,
                      start_timeout_s: float = 60.0,
                      recv_timeout_s: float = 120.0,
                      threads: int | None = None,
                      loop: str = "auto") -> AsyncIterator[dict[str, NodeProcess]]:
    """Start one process per name, tell each every other's address (and `extra`'s); on exit
    close their stdin and wait for them (killed after 10 s). `threads`: torch's compute
    threads in each (None: the daemon's rule, `fusiond.profile.threads`); `loop`: the event
    loop each runs (a daemon's `loop` setting: "auto" is uvloop where installed)."""
    procs: dict[str, NodeProcess] = {}
    try:
        for name in names:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "fusiond.harness.node", name, "--cluster", cluster,
                "--recv-timeout", str(recv_timeout_s),
                *(["--threads", str(threads)] if threads is not None else []),
                "--loop", loop,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                env=dict(os.environ),
            )
            assert proc.stdout is not None
            async with asyncio.timeout(start_timeout_s):
                line = (await proc.stdout.readline()).decode().split()
            if len(line) != 3 or line[0] != "READY":
                raise RuntimeError(f"node {name} did not start: {line}")
            procs[name] = NodeProcess(name, (line[1], int(line[2])), proc)
        book = {n: p.address for n, p in procs.items()} | dict(extra or {})
        text = "".join(f"PEER {n} {h} {p}\n" for n, (h, p) in book.items()).encode()
        for p in procs.values():
            assert p.proc.stdin is not None
            p.proc.stdin.write(text)
            await p.proc.stdin.drain()
        yield procs
    finally:
        for p in procs.values():
            if p.proc.stdin is not None:
                p.proc.stdin.close()
        for p in procs.values():
            try:
                async with asyncio.timeout(10):
                    await p.proc.wait()
            except TimeoutError:
                p.proc.kill()
                await p.proc.wait()


def main() -> None:
    """Entry point of a node process."""
    ap = argparse.ArgumentParser(prog="python -m fusiond.harness.node")
    ap.add_argument("name")
    ap.add_argument("--cluster", default="inproc")
    ap.add_argument("--recv-timeout", type=float, default=120.0,
                    help="seconds a stage waits for an input before failing the job")
    ap.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                    help="the event loop (a daemon's `loop` setting)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch compute threads (default: from the CPU allowance, as fusiond)")
    args = ap.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(max(1, args.threads))
    else:
        from fusiond.profile.threads import apply_cpu_allowance

        apply_cpu_allowance()
    run_on_loop(_serve(args.name, args.cluster, args.recv_timeout), args.loop)


if __name__ == "__main__":
    main()
