"""The trust-boundary reproductions against a real fusiond (a socket attack is met by the
daemon, not by an in-process fake): the daemon's RSS and its log are what is measured.

Each test starts one daemon that holds the cluster CA key (its listener takes clients without
a certificate, for joins), as `fusionctl init` leaves it; the attacker is this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.daemon.harness import Cluster

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(120)]

_MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def daemon_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="fznb"))  # short: Unix socket paths max out at 108
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _start(root: Path, net: dict[str, Any] | None = None) -> tuple[Cluster, tuple[str, int]]:
    c = Cluster(root, 1, {"net": net or {}})
    c.start()
    c.wait_up()
    host, port = c.address(c.nodes[0]).rsplit(":", 1)
    return c, (host, int(port))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _member(c: Cluster, state: Path) -> tuple[str, str, Any]:
    """Credentials for this process as a member: (node id, cluster id, TLSMaterial)."""
    from fusiond.net import pki

    ca = pki.load_cluster_ca(c.nodes[0].state_dir)
    assert ca is not None
    ident = pki.load_or_create_node_identity(state)
    material = pki.store_node_credentials(
        state, pki.issue_node_certificate(ca, ident.key.public_key()), ca.cert)
    return ident.node_id, ca.cluster_id, material


def _head(msg_type: int, header: bytes, payload_len: int) -> bytes:
    """A valid fixed + message header declaring `payload_len` payload bytes (NO_PAYLOAD_CHECK)."""
    prefix = struct.pack("<4sBBHIIQQ", b"FSN\x00", 1, 1, msg_type, len(header), 0,
                         payload_len, 0)
    return prefix + xxhash.xxh3_64_intdigest(prefix + header).to_bytes(8, "little") + header


def _hello(node_id: str, cluster_id: str, lane: str) -> bytes:
    from protocol.messages import Hello, encode_message

    return b"".join(encode_message(Hello(node_id=node_id, cluster_id=cluster_id, min_version=1,
                                         max_version=1, capabilities=(f"lane={lane}",))))


async def _stream_zeros(addr: tuple[str, int], ctx: ssl.SSLContext, first: bytes,
                        limit: int, *, stall_s: float = 0.0) -> tuple[int, bool]:
    """Send `first`, then zeros until the daemon closes or `limit` went; then wait up to
    `stall_s` for the daemon to close. Returns (bytes of zeros sent, closed by the daemon)."""
    reader, writer = await asyncio.open_connection(*addr, ssl=ctx, server_hostname="x")
    zeros = bytes(_MiB)
    sent = 0
    closed = False
    try:
        writer.write(first)
        while sent < limit and not reader.at_eof() and not writer.is_closing():
            writer.write(zeros)
            async with asyncio.timeout(10):
                await writer.drain()
            sent += len(zeros)
        async with asyncio.timeout(max(stall_s, 5.0)):
            while await reader.read(1 << 16):
                pass
        closed = True
    except TimeoutError:  # (an OSError too: first)
        closed = False
    except (ConnectionError, ssl.SSLError, OSError):
        closed = True
    finally:
        writer.close()
    return sent, closed


def test_no_certificate_client_declaring_1GiB_leaves_the_ca_node_flat(
        daemon_dir: Path) -> None:
    """Four rounds of: TLS without a certificate, a first frame declaring 1 GiB, zeros. The
    frame is refused at its header; the daemon's memory stays flat (issue: 786 -> 3112 MB)."""
    from fusiond.net import tls
    from protocol._schema import packb

    c, addr = _start(daemon_dir)
    try:
        pid = c.nodes[0].pid
        assert pid is not None
        header = packb({"request_id": 1, "token": "x", "node_id": "n", "csr": b""})
        before = _rss(pid)
        rounds = []
        for _ in range(4):
            sent, closed = asyncio.run(_stream_zeros(
                addr, tls.join_client_context(), _head(22, header, GiB - 1000), 256 * _MiB))
            rounds.append((sent, closed, _rss(pid)))
        after = _rss(pid)
        report = [(s // _MiB, cl, r // _MiB) for s, cl, r in rounds]
        # (What this side manages to write before it notices the abort varies: a TLS writer
        # may keep "sending" into a connection the daemon already reset; the daemon's log
        # says when it refused each one.)
        assert all(closed for _, closed, _ in rounds), report
        assert after - before < 32 * _MiB, (before // _MiB, report)
        refused = [x for x in c.nodes[0].log_text().splitlines()
                   if "frame payload length is 1073740824, limit is 65536" in x]
        assert len(refused) == 4, refused
        print(f"daemon RSS {before / _MiB:.0f} MB -> {after / _MiB:.0f} MB; rounds (MiB sent, "
              f"closed, RSS MB): {report}")
    finally:
        c.stop()


def test_member_holding_a_half_sent_1GiB_frame_is_cut_off_and_memory_returned(
        daemon_dir: Path, tmp_path: Path) -> None:
    """An authenticated member sends 256 MiB of a frame declared as 1 GiB and stalls: the
    daemon aborts it at the frame's deadline (here from a 250 MB/s link rate, factor 1, floor
    1 s) and gives the memory back (issue: +400 MB, never returned)."""
    from fusiond.net import tls
    from protocol._schema import packb

    # The deadline, 1 GiB at 250 MB/s = 4.3 s, leaves the 256 MiB time to arrive first on a
    # slow machine (at 1 GB/s, 1.07 s: a CI run's TLS managed 231 MiB in that time).
    c, addr = _start(daemon_dir, {"frame_deadline_floor_s": 1.0, "frame_deadline_factor": 1.0,
                                  "default_link_bytes_per_s": 2.5e8})
    try:
        pid = c.nodes[0].pid
        assert pid is not None
        node_id, cluster_id, material = _member(c, tmp_path / "m")
        before = _rss(pid)
        peak = 0

        async def attack() -> tuple[int, bool, float]:
            nonlocal peak
            first = _hello(node_id, cluster_id, "bulk") + _head(
                20, packb({"probe_id": 1, "seq": 0, "count": 1}), GiB - 1000)
            t0 = time.monotonic()
            task = asyncio.create_task(_stream_zeros(addr, tls.client_context(material), first,
                                                     256 * _MiB, stall_s=15.0))
            while not task.done():
                peak = max(peak, _rss(pid))
                await asyncio.sleep(0.05)
            sent, closed = await task
            return sent, closed, time.monotonic() - t0

        sent, closed, took = asyncio.run(attack())
        deadline = time.monotonic() + 5
        while _rss(pid) - before > 64 * _MiB and time.monotonic() < deadline:
            time.sleep(0.1)
        after = _rss(pid)
        figures = (f"RSS {before / _MiB:.0f} -> peak {peak / _MiB:.0f} -> {after / _MiB:.0f} MB,"
                   f" {sent / _MiB:.0f} MiB sent, closed after {took:.1f} s")
        print(figures)
        assert closed and sent == 256 * _MiB, figures
        assert took < 10, figures
        assert peak - before > 200 * _MiB, figures  # the partial frame was held...
        assert after - before < 64 * _MiB, figures  # ... and is returned
        assert "not complete after" in c.nodes[0].log_text()
    finally:
        c.stop()


async def _slowloris(addr: tuple[str, int], n: int, stop: asyncio.Event) -> int:
    """Keep `n` idle TCP connections from 127.0.0.2 open (reopening what the daemon closes)
    until `stop`; returns how many were opened in all."""
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    opened = 0

    async def one() -> None:
        nonlocal opened
        s = socket.socket()
        s.setblocking(False)
        s.bind(("127.0.0.2", 0))
        with contextlib.suppress(OSError):
            await loop.sock_connect(s, addr)
            opened += 1
        socks.append(s)

    try:
        while not stop.is_set():
            alive = []
            for s in socks:
                try:
                    gone = s.recv(1, socket.MSG_PEEK) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                (s.close() if gone else alive.append(s))
            socks[:] = alive
            while len(socks) < n:
                await one()
            await asyncio.sleep(0.05)
    finally:
        for s in socks:
            s.close()
    return opened


def test_slowloris_from_one_host_does_not_starve_member_connections(
        daemon_dir: Path, tmp_path: Path) -> None:
    """300 idle sockets from 127.0.0.2, kept up while 10 member connections are made: all 10
    succeed and the daemon writes a handful of warning lines (issue: 10 of 10 failed, 725
    warning lines in 15 s)."""
    from fusiond.net import NetConfig, PeerNetwork

    c, addr = _start(daemon_dir)
    try:
        node_id, cluster_id, material = _member(c, tmp_path / "m")
        log_before = len(c.nodes[0].log_text().splitlines())

        async def run() -> tuple[int, int, float]:
            async def drop(peer: str, msg: object) -> None:
                return None

            net = PeerNetwork(node_id=node_id, cluster_id=cluster_id, listen=("127.0.0.1", 0),
                              tls=material, handler=drop,
                              config=NetConfig(connect_timeout_s=5.0, handshake_timeout_s=5.0))
            await net.start()
            stop = asyncio.Event()
            attacker = asyncio.create_task(_slowloris(addr, 300, stop))
            ok = 0
            t0 = time.monotonic()
            try:
                await asyncio.sleep(3.0)  # the flood is up (and the daemon has timed some out)
                for _ in range(10):
                    with contextlib.suppress(Exception):
                        ok += await net.connect(addr) == c.node_id(c.nodes[0])
                    await asyncio.sleep(1.0)
            finally:
                stop.set()
                opened = await attacker
                await net.close()
            return ok, opened, time.monotonic() - t0

        ok, opened, took = asyncio.run(run())
        time.sleep(0.5)
        lines = c.nodes[0].log_text().splitlines()[log_before:]
        warnings = [x for x in lines if "WARNING" in x]
        print(f"{ok}/10 member connections, {opened} attacker sockets in {took:.0f} s, "
              f"{len(warnings)} warning lines")
        assert ok == 10, warnings[-10:]
        assert len(warnings) <= 30, warnings[:40]
    finally:
        c.stop()


def test_a_member_cannot_hold_300_authenticated_connections(
        daemon_dir: Path, tmp_path: Path) -> None:
    """One member opens 300 authenticated CONTROL connections: the daemon keeps the newest
    few (max_inbound_per_peer_lane) and closes the rest."""
    from fusiond.net import tls

    c, addr = _start(daemon_dir)
    try:
        node_id, cluster_id, material = _member(c, tmp_path / "m")

        async def run() -> int:
            ctx = tls.client_context(material)
            conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            try:
                for _ in range(300):
                    reader, writer = await asyncio.open_connection(*addr, ssl=ctx,
                                                                   server_hostname="x")
                    writer.write(_hello(node_id, cluster_id, "control"))
                    async with asyncio.timeout(10):
                        await reader.readexactly(40)  # HelloAck
                    conns.append((reader, writer))
                await asyncio.sleep(1.0)
                open_ = 0
                for reader, _ in conns:
                    try:
                        async with asyncio.timeout(0.05):
                            while await reader.read(1 << 16):  # the rest of the HelloAck
                                pass
                    except TimeoutError:  # (an OSError too: first)
                        open_ += 1  # nothing more to read, and not closed
                    except (ConnectionError, ssl.SSLError, OSError):
                        pass
                return open_
            finally:
                for _, w in conns:
                    w.close()

        still_open = asyncio.run(run())
        print(f"{still_open} of 300 authenticated connections left open")
        assert still_open == 4
        assert c.nodes[0].alive()
    finally:
        c.stop()
