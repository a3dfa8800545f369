"""The node profile (measured, cached) and the sd_notify datagram."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import protocol
from fusiond import profile
from fusiond.daemon import sd_notify


@pytest.mark.slow  # importing torch takes seconds on a loaded 2-core machine
def test_profile_measures_once_then_uses_the_cache(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    first = profile.compute_profile(tmp_path, benchmark=True)
    assert first.gflops > 0.1  # a real measurement, not a constant
    assert first.device_kind in ("cpu", "cuda")
    assert first.protocol_version == protocol.PROTOCOL_VERSION
    assert first.torch_version != "none" and first.memory_bytes > 0
    cached = json.loads((tmp_path / "profile.json").read_text())
    assert round(cached["gflops"], 2) == (first.gflops_per_cpu_s or first.gflops)

    def boom(*a: object, **k: object) -> float:
        raise AssertionError("the benchmark ran again despite the cache")

    monkeypatch.setattr(profile, "matmul_gflops", boom)
    again = profile.compute_profile(tmp_path, benchmark=True)
    assert again.gflops == first.gflops
    # free memory is re-read on every call of the profiler, the rest is fixed
    prof = profile.Profiler(again)
    assert prof().free_memory_bytes > 0 and prof().gflops == first.gflops


def test_profile_without_benchmark_skips_torch(tmp_path: Path) -> None:
    p = profile.compute_profile(tmp_path, benchmark=False)
    assert p.gflops == 0.0 and p.device_kind == "cpu"
    assert not (tmp_path / "profile.json").exists()


def test_the_produced_profile_is_typed_and_survives_the_wire(tmp_path: Path) -> None:
    from fusiond.plan import MachineProfile
    from protocol._schema import packb, unpackb
    from protocol.messages import NodeProfile

    static = profile.compute_profile(tmp_path, benchmark=False)
    assert isinstance(static, NodeProfile) and static.cpu_count > 0 and static.cpu_cores > 0
    assert static.protocol_version == protocol.PROTOCOL_VERSION and static.python_version
    prof = profile.Profiler(static)
    m = MachineProfile("x", {"matmul": 4e10, "other": 1e9}, mem_bw=5e9, op_overhead_s=2e-5,
                       memory_bytes=1.0)
    prof.update(**profile.planner_fields(m), job_memory_bytes=3 << 30)
    prof.update(ops_digest="a" * 64, ops_count=2, ops_disabled=["aten.relu.default"])
    got = prof()
    assert got.ops_disabled == ("aten.relu.default",) and got.free_memory_bytes > 0
    back = NodeProfile.from_wire(unpackb(packb(got.to_wire()), "profile"))
    assert back == got
    assert back.plan_flops_matmul == 4e10 and back.plan_mem_bw == 5e9
    assert back.job_memory_bytes == 3 << 30 and back.device_kind == static.device_kind
    assert profile.machine_from_profile("n", back, 1.0) is not None


def test_sd_notify_plain_and_abstract_sockets(tmp_path: Path) -> None:
    assert sd_notify("READY=1", env={}) is False  # not under systemd: nothing to do
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(tmp_path / "n"))
    rx.settimeout(5)
    try:
        assert sd_notify("READY=1\nSTATUS=hi", env={"NOTIFY_SOCKET": str(tmp_path / "n")})
        assert rx.recv(100) == b"READY=1\nSTATUS=hi"
    finally:
        rx.close()
    name = f"fusion-test-{id(tmp_path)}"
    ab = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    ab.bind("\0" + name)
    ab.settimeout(5)
    try:
        assert sd_notify("STOPPING=1", env={"NOTIFY_SOCKET": "@" + name})
        assert ab.recv(100) == b"STOPPING=1"
    finally:
        ab.close()
    assert sd_notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone")}) is False


def test_watchdog_interval_follows_systemd() -> None:
    import os

    from fusiond.daemon import watchdog_interval

    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "60000000"}) == 30.0
    assert watchdog_interval({"WATCHDOG_USEC": "60000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000",
                              "WATCHDOG_PID": str(os.getpid())}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
