"""The supervisor in-process: readiness notification, clean stop, crash -> non-zero, start
failure -> nothing left half alive, identity across restarts, the local API's error shapes.
Every test runs under asyncio's loop and uvloop (see conftest.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fusiond.config import LoadedConfig, load_config
from fusiond.daemon import Daemon

FAST = {
    "FUSION_PROFILE_BENCHMARK": "0",
    "FUSION_METRICS_LISTEN": "",
    "FUSION_DASHBOARD_LISTEN": "",
    "FUSION_NET_LISTEN": "127.0.0.1:0",
    "FUSION_CLUSTER_MDNS": "0",
    "FUSION_CLUSTER_PROBES": "0",
    "FUSION_CLUSTER_ELECTION_GRACE_S": "0.2",
    "FUSION_CLUSTER_ELECTION_TIMEOUT_S": "0.6",
    "FUSION_CLUSTER_LEADER_LEASE_S": "0.4",
    "FUSION_CLUSTER_LEADER_HEARTBEAT_S": "0.1",
    "FUSION_CLUSTER_ELECTION_STAGGER_S": "0.1",
    "FUSION_STOP_TIMEOUT_S": "5",
}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="fzd"))  # Unix socket paths are limited to 108 bytes
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _config(d: Path, **extra: str) -> LoadedConfig:
    env = {**FAST, "FUSION_STATE_DIR": str(d / "state"), "FUSION_CACHE_DIR": str(d / "cache"),
           "FUSION_API_SOCKET": str(d / "api.sock"), **extra}
    return load_config(env=env)


async def _until(pred: Any, within: float = 10.0) -> None:
    """Poll `pred` (state owned by the daemon under test; no event to wait on)."""
    async with asyncio.timeout(within):
        for _ in iter(int, 1):
            if pred():
                return
            await asyncio.sleep(0.05)


async def _get(sock: Path, path: str) -> tuple[int, Any]:
    conn = aiohttp.UnixConnector(path=str(sock))
    async with aiohttp.ClientSession(connector=conn) as s, s.get(f"http://fusiond{path}") as r:
        return r.status, await r.json()


async def test_ready_is_notified_and_sigterm_path_exits_zero(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notify = short_dir / "notify"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(notify))
    rx.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    d = Daemon(_config(short_dir))
    task = asyncio.create_task(d.run())
    try:
        msg = (await asyncio.wait_for(asyncio.get_running_loop().sock_recv(rx, 4096), 15)).decode()
        assert msg.startswith("READY=1\nSTATUS=") and "fusionctl init" in msg
        ping = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(rx, 4096), 5)
        assert ping == b"WATCHDOG=1"
        status, body = await _get(short_dir / "api.sock", "/v1/status")
        assert status == 200 and body["node"]["phase"] == "unconfigured"
        assert body["cluster"] is None and "fusionctl init" in body["hint"]
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0
        assert not (short_dir / "api.sock").exists()  # drained: the socket is gone
        rest = []
        while True:
            try:
                rest.append(rx.recv(4096).decode())
            except BlockingIOError:
                break
        assert any(m.startswith("STOPPING=1") for m in rest), rest
    finally:
        rx.close()
        if not task.done():
            task.cancel()


async def test_plaintext_daemon_runs_the_cluster_and_elects_itself(short_dir: Path) -> None:
    d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1",
                       FUSION_CLUSTER_ID="unit"))
    task = asyncio.create_task(d.run())
    try:
        await _until(lambda: d.phase == "running", 15)
        sock = short_dir / "api.sock"

        async def leader() -> Any:
            return (await _get(sock, "/v1/status"))[1]["cluster"]["leader"]

        for _ in range(100):
            if await leader() == d.node_id:
                break
            await asyncio.sleep(0.05)
        status, body = await _get(sock, "/v1/status")
        assert body["cluster"]["leader"] == d.node_id and body["cluster"]["has_quorum"]
        assert body["node"]["security"] == "plaintext" and "PLAINTEXT" in body["warning"]
        assert body["node"]["cluster_id"] == "unit"
        status, links = await _get(sock, "/v1/links")
        assert status == 200 and links["members"] == [d.node_id]
    finally:
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0


class _Crashy:
    """A service that becomes ready, then fails."""

    def __init__(self) -> None:
        self.closed = False

    async def start(self) -> None:
        return None

    async def ready(self) -> None:
        return None

    async def wait(self) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("disk on fire")

    async def close(self) -> None:
        self.closed = True


async def test_a_crashing_service_stops_the_daemon_nonzero(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1"))
    task = asyncio.create_task(d.run())
    await _until(lambda: d.phase == "running", 15)
    crashy = _Crashy()
    with caplog.at_level(logging.ERROR, "fusiond"):
        await d._start_service("canary", crashy)
        code = await asyncio.wait_for(task, 15)
    assert code == 1
    assert crashy.closed and d.cluster is not None  # every service was closed ...
    assert not (short_dir / "api.sock").exists()    # ... the API too: never half alive
    line = next(r.getMessage() for r in caplog.records if "stopped because" in r.getMessage())
    assert "service canary crashed" in line and "disk on fire" in line


async def test_a_service_that_cannot_start_leaves_nothing_running(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1",
                           FUSION_NET_LISTEN=f"127.0.0.1:{port}"))
        with caplog.at_level(logging.ERROR, "fusiond"):
            code = await asyncio.wait_for(d.run(), 15)
        assert code == 1
        line = next(r.getMessage() for r in caplog.records if "stopped because" in r.getMessage())
        assert "service net failed to start" in line and "address already in use" in line.lower()
        assert not (short_dir / "api.sock").exists()
    finally:
        busy.close()


async def test_node_identity_survives_restart(short_dir: Path) -> None:
    ids = []
    for _ in range(2):
        d = Daemon(_config(short_dir))
        task = asyncio.create_task(d.run())
        await _until(lambda d=d: d.phase == "unconfigured", 15)
        ids.append(d.node_id)
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0
    assert ids[0] == ids[1] and ids[0].startswith("n")
    assert (short_dir / "state" / "node.key").stat().st_mode & 0o077 == 0


async def test_api_errors_are_json_and_tcp_needs_the_token(short_dir: Path) -> None:
    d = Daemon(_config(short_dir, FUSION_API_TCP="127.0.0.1:0"))
    task = asyncio.create_task(d.run())
    try:
        await _until(lambda: d.phase == "unconfigured", 15)
        assert d.api is not None and d.api.tcp_address is not None
        host, port = d.api.tcp_address
        token = (short_dir / "state" / "api.token").read_text().strip()
        assert (short_dir / "state" / "api.token").stat().st_mode & 0o077 == 0
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{host}:{port}/v1/status") as r:
                assert r.status == 401
                assert "token" in (await r.json())["error"]["message"]
            hdr = {"Authorization": f"Bearer {token}"}
            async with s.get(f"http://{host}:{port}/v1/status", headers=hdr) as r:
                assert r.status == 200 and (await r.json())["node"]["node_id"] == d.node_id
            async with s.post(f"http://{host}:{port}/v1/remove", headers=hdr,
                              data="[1]") as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "bad_request"
            async with s.post(f"http://{host}:{port}/v1/test/block", headers=hdr,
                              json={"node_ids": []}) as r:
                assert r.status == 404  # the test drop switch is off by default
                assert "error" in json.loads(await r.text())
            async with s.post(f"http://{host}:{port}/v1/leave", headers=hdr) as r:
                body = await r.json()
                assert r.status == 409 and "not in a cluster" in body["error"]["message"]
    finally:
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0


async def test_metrics_are_served_on_loopback(short_dir: Path) -> None:
    d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1",
                       FUSION_METRICS_LISTEN="127.0.0.1:0"))
    task = asyncio.create_task(d.run())
    try:
        await _until(lambda: d.phase == "running", 15)
        from prometheus_client import Counter

        # another subsystem (training) adds its own metrics to the daemon's registry
        Counter("fusion_train_tensor_bytes", "before compression", registry=d.registry).inc(5)
        assert d.metrics is not None and d.metrics.address is not None
        host, port = d.metrics.address
        assert host == "127.0.0.1"
        async with aiohttp.ClientSession() as s, \
                s.get(f"http://{host}:{port}/metrics") as r:
            text = await r.text()
        assert r.status == 200
        for name in ("fusion_cluster_term", "fusion_cluster_members{state=\"alive\"} 1.0",
                     "fusion_cluster_quorum", "fusion_daemon_start_time_seconds",
                     "fusion_train_tensor_bytes_total 5.0"):
            assert name in text, name
    finally:
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0


async def test_stop_during_a_slow_start_does_not_wait_for_it(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from fusiond import profile
    from protocol.messages import NodeProfile

    def slow_profile(*a: Any, **k: Any) -> NodeProfile:
        time.sleep(2.0)  # a long benchmark, in its thread
        return NodeProfile(device_kind="cpu", device_name="x", gflops=0.0)

    monkeypatch.setattr(profile, "compute_profile", slow_profile)
    d = Daemon(_config(short_dir))
    task = asyncio.create_task(d.run())
    await _until(lambda: (short_dir / "api.sock").exists(), 10)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    d.request_stop()
    assert await asyncio.wait_for(task, 10) == 0
    assert loop.time() - t0 < 1.5  # did not wait for the benchmark
    assert not (short_dir / "api.sock").exists()


async def test_messages_the_cluster_does_not_take_go_to_registered_handlers(
        short_dir: Path) -> None:
    d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1"))
    task = asyncio.create_task(d.run())
    try:
        await _until(lambda: d.phase == "running", 15)
        seen: list[tuple[str, object]] = []

        async def declines(peer: str, msg: object) -> bool:
            return False

        async def takes(peer: str, msg: object) -> bool:
            seen.append((peer, msg))
            return True

        d.add_message_handler(declines)
        d.add_message_handler(takes)
        job_message = object()  # stands in for a training message (not the cluster's)
        await d._on_message("npeer", job_message)
        assert seen == [("npeer", job_message)]
    finally:
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0


async def test_api_socket_path_never_replaces_a_regular_file(short_dir: Path) -> None:
    precious = short_dir / "api.sock"
    precious.write_text("not a socket")
    d = Daemon(_config(short_dir))
    assert await asyncio.wait_for(d.run(), 15) == 1
    assert precious.read_text() == "not a socket"


async def test_a_certificate_for_another_key_is_named_at_start(
        short_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from cryptography.hazmat.primitives.serialization import Encoding

    from fusiond.net import pki

    ca, _, _ = pki.init_cluster(short_dir / "state")
    stranger = pki.generate_key()
    cert = pki.issue_node_certificate(ca, stranger.public_key())
    (short_dir / "state" / "node.crt").write_bytes(cert.public_bytes(Encoding.PEM))
    d = Daemon(_config(short_dir))
    with caplog.at_level(logging.ERROR, "fusiond"):
        assert await asyncio.wait_for(d.run(), 15) == 1
    line = next(r.getMessage() for r in caplog.records if "stopped because" in r.getMessage())
    assert "was issued to node" in line and "fusionctl join" in line


async def test_systemctl_status_stays_current_and_a_reload_is_announced(
        short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """STATUS= follows the cluster (the scheduler, its term, quorum: it used to say only how
    the daemon started), and SIGHUP is bracketed by RELOADING=1 (with MONOTONIC_USEC) and
    READY=1, as systemd's reload protocol (Type=notify-reload) asks."""
    from fusiond import daemon as daemon_mod

    monkeypatch.setattr(daemon_mod, "STATUS_EVERY_S", 0.1)
    notify = short_dir / "notify"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(notify))
    rx.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(notify))
    d = Daemon(_config(short_dir, FUSION_NET_INSECURE_PLAINTEXT="1",
                       FUSION_CLUSTER_ID="unit"))
    task = asyncio.create_task(d.run())
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    async def until(pred: Any, within: float = 15.0) -> str:
        async with asyncio.timeout(within):
            while True:
                msg = (await loop.sock_recv(rx, 4096)).decode()
                seen.append(msg)
                if pred(msg):
                    return msg

    try:
        await until(lambda m: m.startswith("READY=1"))
        line = await until(lambda m: "scheduler this node" in m)
        assert line.startswith("STATUS=cluster unit: scheduler this node term ")
        assert "quorum yes, 1 of 1 members alive, 0 stage(s) running here" in line
        d._on_sighup()
        got = await until(lambda m: m.startswith("READY=1"), 5.0)
        reload_msg = next(m for m in seen if m.startswith("RELOADING=1"))
        assert "\nMONOTONIC_USEC=" in reload_msg
        assert seen.index(reload_msg) < seen.index(got) and "scheduler this node" in got
    finally:
        d.request_stop()
        assert await asyncio.wait_for(task, 15) == 0
        rx.close()
