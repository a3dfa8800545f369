"""Trust boundaries of PeerNetwork: bounded before authenticated, frames with deadlines,
slow-loris, per-peer connection caps, rate-limited logging. Each attack is the reproduction
of a finding (docs/security.md, "Bounds"); daemon-level versions are in
tests/daemon/test_trust_bounds.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import socket
import ssl
import struct
import time
from pathlib import Path

import pytest
import xxhash

from fusiond.net import JoinAuthority, NetConfig
from fusiond.net import tls as tlsmod
from fusiond.net.pki import init_cluster
from fusiond.net.transport import RefusalLog, _malloc_trim
from protocol._schema import packb
from protocol.frames import FLAG_NO_PAYLOAD_CHECK, MAGIC
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import Hello, Message, Ping, ProbeData, encode_message
from tests.net.conftest import FAST, Inbox, NetFactory, make_cluster, make_node, until

_MiB = 1 << 20
GiB = 1 << 30


def frame_head(msg_type: int, header: bytes, payload_len: int) -> bytes:
    """A valid fixed header + message header declaring `payload_len` payload bytes (not sent)."""
    prefix = struct.pack("<4sBBHIIQQ", MAGIC, 1, FLAG_NO_PAYLOAD_CHECK, msg_type, len(header),
                         0, payload_len, 0)
    check = xxhash.xxh3_64_intdigest(prefix + header)
    return prefix + check.to_bytes(8, "little") + header


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hello(node_id: str, lane: str = "bulk") -> bytes:
    return b"".join(encode_message(Hello(node_id=node_id, cluster_id="c-test", min_version=1,
                                         max_version=1, capabilities=(f"lane={lane}",),
                                         address=("127.0.0.1", 1))))


async def stream_zeros(writer: asyncio.StreamWriter, reader: asyncio.StreamReader,
                       limit: int) -> int:
    """Write zeros in 1 MiB chunks until the peer closes or `limit` bytes went; bytes sent."""
    zeros = bytes(_MiB)
    sent = 0
    with contextlib.suppress(ConnectionError, ssl.SSLError, OSError):
        while sent < limit:
            if reader.at_eof() or writer.is_closing():
                break
            writer.write(zeros)
            async with asyncio.timeout(5):
                await writer.drain()
            sent += len(zeros)
    return sent


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    try:
        async with asyncio.timeout(within):
            while await reader.read(1 << 16):
                pass
        return True
    except TimeoutError:  # (an OSError too: first)
        return False
    except (ConnectionError, ssl.SSLError, OSError):
        return True


# -- bounded before authenticated --------------------------------------------------------


async def test_a_client_without_a_certificate_cannot_declare_a_big_frame(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """On the CA holder (its listener takes clients without a certificate, for joins), a
    first frame declaring 1 GiB is refused at its header: nothing is allocated, the stream
    of zeros after it goes nowhere, memory stays flat over four rounds."""
    ca, ident, material = init_cluster(tmp_path / "m")
    b = await net_factory(ident.node_id, ca.cluster_id, tls=material,
                          join_authority=JoinAuthority(ca, tmp_path / "m"))
    header = packb({"request_id": 1, "token": "x", "node_id": "n", "csr": b""})
    gc.collect()
    before = rss_bytes()
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        for _ in range(4):
            reader, writer = await asyncio.open_connection(
                *b.address, ssl=tlsmod.join_client_context(), server_hostname="x")
            writer.write(frame_head(22, header, GiB - 1000))  # a JoinRequest "of 1 GiB"
            # (A TLS writer may go on "sending" a while into a connection already reset:
            # the server side is what is checked: its memory and its log.)
            await stream_zeros(writer, reader, 96 * _MiB)
            assert await closed_by_peer(reader, 5.0)
            writer.close()
    grown = rss_bytes() - before
    assert grown < 48 * _MiB, f"RSS grew {grown / _MiB:.0f} MiB"
    lines = [r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()]
    assert len(lines) == 4, lines
    assert all(f"limit is {DEFAULT_LIMITS.max_preauth_frame_bytes}" in x for x in lines)


async def test_before_hello_frames_are_small(
    net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Plaintext: a first frame declaring 512 MiB, or a Hello of 100 KiB, is refused."""
    inbox = Inbox()
    b = await net_factory("b", handler=inbox)
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        reader, writer = await asyncio.open_connection(*b.address)
        writer.write(frame_head(20, packb({"probe_id": 1, "seq": 0, "count": 1}), 512 * _MiB))
        sent = await stream_zeros(writer, reader, 64 * _MiB)
        assert await closed_by_peer(reader, 5.0) and sent < 32 * _MiB
        writer.close()
        big = Hello(node_id="m", cluster_id="c-test", min_version=1, max_version=1,
                    software={"blob": "x" * (100 << 10)})
        reader, writer = await asyncio.open_connection(*b.address)
        writer.write(b"".join(encode_message(big)))
        assert await closed_by_peer(reader, 5.0)
        writer.close()
    assert not inbox.items and "m" not in b.stats()
    assert sum("limit is 65536" in r.getMessage() for r in caplog.records) == 2


# -- a frame in progress has a deadline ----------------------------------------------------


async def test_a_half_sent_frame_is_cut_off_and_its_memory_returned(
    net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An authenticated peer sends 256 MiB of a frame declared as 1 GiB, then nothing: the
    connection is aborted at the frame's deadline (from the measured link rate) and the
    partial buffer's memory is returned to the OS."""
    cfg = dataclasses.replace(FAST, frame_deadline_floor_s=0.5, frame_deadline_factor=3.0)
    inbox = Inbox()
    b = await net_factory("b", handler=inbox, config=cfg)
    b.set_link_rate("r", 1e9)  # measured: 1 GB/s, so 1 GiB may take max(0.5, 3 x 1.07) s
    gc.collect()
    _malloc_trim()  # free heap left resident by earlier tests would hide the partial frame
    before = rss_bytes()
    peak = before
    done = asyncio.Event()

    async def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes())
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    reader, writer = await asyncio.open_connection(*b.address)
    writer.write(hello("r") + frame_head(20, packb({"probe_id": 1, "seq": 0, "count": 1}),
                                         GiB - 1000))
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        t0 = time.monotonic()
        sent = await stream_zeros(writer, reader, 256 * _MiB)
        assert await closed_by_peer(reader, 10.0), "the stalled frame was never cut off"
        took = time.monotonic() - t0
        writer.close()
        done.set()
        await sampler
        await until(lambda: rss_bytes() - before < 64 * _MiB, within=5)
    after = rss_bytes()
    assert peak - before > 200 * _MiB  # the partial frame really was held ...
    assert after - before < 64 * _MiB  # ... and is given back
    assert sent == 256 * _MiB and took < 8.0
    line = next(r.getMessage() for r in caplog.records if "not complete after" in r.getMessage())
    assert "(r)" in line and "1073740" in line
    assert not inbox.items


async def test_the_frame_deadline_does_not_count_time_we_paused_reading(
    net_factory: NetFactory
) -> None:
    """A slow handler pauses reading; a frame in progress meanwhile is not cut off."""
    got: list[int] = []

    async def slow(peer: str, msg: Message) -> None:
        got.append(msg.payload.nbytes)
        if len(got) == 1:
            await asyncio.sleep(1.5)

    cfg = dataclasses.replace(FAST, frame_deadline_floor_s=0.3, frame_deadline_factor=1.0,
                              inbox_frames=1)
    a = await net_factory("a")
    b = await net_factory("b", handler=slow, config=cfg)
    b.set_link_rate("a", 1e9)
    await a.connect(b.address)
    payload = memoryview(bytearray(8 * _MiB))
    for seq in range(4):
        await a.send("b", ProbeData(probe_id=1, seq=seq, count=4), [payload])
    await until(lambda: len(got) == 4, within=15)
    assert b.stats()["a"].inbound == 2 and a.stats()["b"].reconnects == 0


# -- slow-loris ------------------------------------------------------------------------------


async def _idle_sockets(address: tuple[str, int], source: str, n: int) -> list[socket.socket]:
    """`n` TCP connections from `source` that never send a byte."""
    loop = asyncio.get_running_loop()
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        await loop.sock_connect(s, address)
        out.append(s)
    return out


@pytest.mark.slow
async def test_slowloris_from_one_source_does_not_starve_members(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """300 idle sockets from one address take 16 handshake slots; every one of 10 member
    connections made meanwhile succeeds, and the refusals are a handful of log lines."""
    ca = make_cluster(tmp_path)
    idb, mb = make_node(tmp_path, ca, "b")
    ida, ma = make_node(tmp_path, ca, "a")
    cfg = dataclasses.replace(FAST, handshake_timeout_s=20.0)
    inbox = Inbox()
    b = await net_factory(idb, ca.cluster_id, tls=mb, config=cfg, handler=inbox)
    a = await net_factory(ida, ca.cluster_id, tls=ma)
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        idle = await _idle_sockets(b.address, "127.0.0.2", 300)
        try:
            await until(lambda: b._handshaking_total == 16, within=5)
            ok = 0
            for _ in range(10):
                with contextlib.suppress(Exception):
                    ok += await a.connect(b.address) == idb
            await a.send(idb, Ping(request_id=1, sent_at=0.0))
            await inbox.wait_for(1)
        finally:
            for s in idle:
                s.close()
    assert ok == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
                and "PLAINTEXT" not in r.getMessage()]
    assert len(warnings) <= 10, warnings
    assert any("127.0.0.2 are already in their handshake" in w for w in warnings)


async def test_member_addresses_keep_a_reserve_when_strangers_fill_the_rest(
    net_factory: NetFactory
) -> None:
    """Strangers from many addresses fill every slot but the reserve; a member (its address
    authenticated before) still reconnects, a new stranger does not get in."""
    cfg = dataclasses.replace(FAST, handshake_timeout_s=20.0, max_pending_handshakes=40,
                              member_handshake_reserve=10, max_pending_handshakes_per_source=4)
    inbox = Inbox()
    b = await net_factory("b", handler=inbox, config=cfg)
    a = await net_factory("a")
    await a.connect(b.address)  # a member: 127.0.0.1 is now a known address
    idle: list[socket.socket] = []
    try:
        for i in range(10):
            idle += await _idle_sockets(b.address, f"127.0.0.{10 + i}", 4)
        await until(lambda: b._handshaking_total == 30, within=5)
        for _ in range(5):
            assert await a.connect(b.address) == "b"
        late = await _idle_sockets(b.address, "127.0.0.99", 1)
        idle += late
        await asyncio.sleep(0.2)
        assert "127.0.0.99" not in b._handshaking
    finally:
        for s in idle:
            s.close()


def test_refusal_log_writes_a_few_lines_then_one_summary() -> None:
    rl = RefusalLog(interval_s=10.0, burst=3, max_keys=2)
    lines = [rl.note("10.0.0.5", "busy", f"refused #{i}", now=100.0 + i * 0.01)
             for i in range(287)]
    assert [x for x in lines if x] == ["refused #0", "refused #1", "refused #2"]
    assert rl.due(105.0) == [] and rl.next_due() == 110.0
    (summary,) = rl.due(110.0)
    assert summary.startswith("284 more connection(s) from 10.0.0.5 refused or closed (busy)")
    assert "refused #286" in summary and rl.next_due() is None
    # keys are bounded: a third source shares the overflow key
    rl.note("a", "busy", "x", now=200.0)
    rl.note("b", "busy", "x", now=200.0)
    for _ in range(10):
        rl.note("c", "busy", "x", now=200.0)
    assert len(rl._windows) == 3 and ("other sources", "busy") in rl._windows


# -- per-peer connection bound ----------------------------------------------------------------


async def test_a_member_cannot_hold_hundreds_of_connections(net_factory: NetFactory) -> None:
    """300 authenticated connections of one member: only the newest few per lane stay open,
    and the newest still delivers."""
    inbox = Inbox()
    b = await net_factory("b", handler=inbox)
    conns = []
    try:
        for _ in range(300):
            reader, writer = await asyncio.open_connection(*b.address)
            writer.write(hello("m", "control"))
            async with asyncio.timeout(5):
                await reader.readexactly(40)  # the HelloAck's fixed header
            conns.append(writer)
        await until(lambda: b.stats()["m"].inbound <= 4, within=5)
        assert b.stats()["m"].inbound == 4
        conns[-1].write(b"".join(encode_message(Ping(request_id=7, sent_at=0.0))))
        ((peer, msg),) = await inbox.wait_for(1)
        assert peer == "m" and isinstance(msg, Ping)
    finally:
        for w in conns:
            w.close()


def test_net_config_rejects_what_cannot_work() -> None:
    from fusiond.errors import ConfigError
    from fusiond.net import PeerNetwork

    for bad in ({"member_handshake_reserve": 256}, {"inbox_bytes": 0},
                {"frame_deadline_factor": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            PeerNetwork(node_id="a", cluster_id="c", listen=("127.0.0.1", 0), tls=None,
                        handler=Inbox(), config=NetConfig(**bad))  # type: ignore[arg-type]


def test_the_frame_deadline_follows_the_measured_link_and_its_sharing() -> None:
    from fusiond.net import PeerNetwork

    net = PeerNetwork(node_id="a", cluster_id="c", listen=("127.0.0.1", 0), tls=None,
                      handler=Inbox(), config=NetConfig())
    p = net._peer("b")
    assert net._frame_deadline_s(p, 1000) == 30.0  # the floor
    assert net._frame_deadline_s(p, GiB) == pytest.approx(4 * GiB / 125_000)  # 1 Mbit/s
    net.set_link_rate("b", 1.25e8)  # measured: 1 Gbit/s
    assert net._frame_deadline_s(p, GiB) == pytest.approx(4 * GiB / 1.25e8)  # 34 s
    assert net._frame_deadline_s(p, GiB, share=3) == pytest.approx(3 * 4 * GiB / 1.25e8)
    net.set_link_rate("b", 0.0)  # unknown again
    assert net._frame_deadline_s(p, GiB) == pytest.approx(4 * GiB / 125_000)


def _client_hello_prefix() -> bytes:
    """The first half of a real TLS ClientHello."""
    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="x")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    hello_bytes = outgoing.read()
    return hello_bytes[: len(hello_bytes) // 2]


@pytest.mark.slow
async def test_idle_and_half_open_handshakes_are_all_closed_and_members_still_served(
    tmp_path: Path, net_factory: NetFactory
) -> None:
    """What held and must keep holding: 500 idle TCP connections and 200 half-open TLS
    handshakes are all closed (at once beyond the caps, else by the handshake timeout); the
    slots come back, memory stays flat, members are served."""
    ca = make_cluster(tmp_path)
    idb, mb = make_node(tmp_path, ca, "b")
    ida, ma = make_node(tmp_path, ca, "a")
    cfg = dataclasses.replace(FAST, handshake_timeout_s=1.0)
    inbox = Inbox()
    b = await net_factory(idb, ca.cluster_id, tls=mb, config=cfg, handler=inbox)
    gc.collect()
    before = rss_bytes()
    idle = await _idle_sockets(b.address, "127.0.0.3", 500)
    half = await _idle_sockets(b.address, "127.0.0.4", 200)
    prefix = _client_hello_prefix()
    for s in half:
        s.send(prefix)
    try:
        loop = asyncio.get_running_loop()

        async def closed(s: socket.socket) -> bool:
            try:
                async with asyncio.timeout(4.0):
                    while await loop.sock_recv(s, 1 << 16):
                        pass
                return True
            except TimeoutError:
                return False
            except OSError:
                return True

        results = await asyncio.gather(*(closed(s) for s in idle + half))
        assert all(results), f"{results.count(False)} connections still open"
        await until(lambda: b._handshaking_total == 0, within=3)
        a = await net_factory(ida, ca.cluster_id, tls=ma)
        await a.connect(b.address)
        await a.send(idb, Ping(request_id=1, sent_at=0.0))
        await inbox.wait_for(1)
    finally:
        for s in idle + half:
            s.close()
    assert rss_bytes() - before < 32 * _MiB
