"""The testbed's per-host memory limit (issue 14): applied by the kernel, and a host the kernel
kills at its limit is reported as "out of memory", never as a run that missed its target."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.testbed import (
    OUT_OF_MEMORY,
    MemoryReport,
    Testbed,
    TopologyError,
    classify_exit,
    detect_memory_cgroup,
    parse_topology,
    read_memory_report,
    testbed,
)
from tests.netns.conftest import NETNS_SKIP, state_dir  # noqa: F401  (the fixture)

LIMIT_MIB = 96
ALLOC = ("import sys\n"
         "x = b'a' * (int(sys.argv[1]) << 20)\n"  # bytes * n writes every page
         "print(len(x))\n")


def _topo(memory: object) -> dict[str, Any]:
    return {"name": "mem", "hosts": ["x", "y"], "defaults": {"bandwidth": "1gbit"},
            "host": {"y": {"memory": memory}}}


def test_topology_parses_memory_sizes() -> None:
    t = parse_topology(_topo("96MiB"))
    assert t.memory_bytes == {"y": 96 << 20}
    assert parse_topology(_topo("200MB")).memory_bytes["y"] == 200_000_000
    assert parse_topology(_topo(1 << 30)).memory_bytes["y"] == 1 << 30
    for bad in ("lots", "1kB", True, 1.5, "2TiB"):
        with pytest.raises(TopologyError, match=r"host\.y\.memory"):
            parse_topology(_topo(bad))


def test_classify_exit() -> None:
    hit_v1 = MemoryReport(limit_bytes=1, peak_bytes=1, limit_hits=5, oom_kills=1)
    old_kernel = MemoryReport(limit_bytes=1, peak_bytes=1, limit_hits=5, oom_kills=None)
    calm = MemoryReport(limit_bytes=1, peak_bytes=1, limit_hits=0, oom_kills=0)
    assert classify_exit(-9, hit_v1) == OUT_OF_MEMORY
    # a peer killed at the limit while the main process then failed on the broken link
    assert classify_exit(1, hit_v1) == OUT_OF_MEMORY
    assert classify_exit(137, old_kernel) == OUT_OF_MEMORY
    assert classify_exit(1, old_kernel) == "failed (exit 1)"
    assert classify_exit(-9, calm) == "failed (exit -9)"  # killed by someone, not the limit
    assert classify_exit(0, calm) == "ok"
    assert classify_exit(0, None) == "ok"
    assert classify_exit(-9, None) == "failed (exit -9)"


def test_read_memory_report_v1_and_v2(tmp_path: Path) -> None:
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.limit_in_bytes").write_text("100663296\n")
    (v1 / "memory.max_usage_in_bytes").write_text("100663296\n")
    (v1 / "memory.failcnt").write_text("42\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert read_memory_report(v1, "v1") == MemoryReport(100663296, 100663296, 42, 1)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("100663296\n")
    (v2 / "memory.peak").write_text("5000\n")
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    assert read_memory_report(v2, "v2") == MemoryReport(100663296, 5000, 7, 1)


@pytest.mark.netns
@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
def test_a_host_over_its_memory_limit_is_killed_and_reported_oom(
        state_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    cg = detect_memory_cgroup()
    if cg.root is None:
        pytest.skip(f"memory limits unavailable here: {cg.reason}")
    topo = tmp_path / "mem.toml"
    topo.write_text('name = "mem"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "1gbit"\n'
                    f'[host.y]\nmemory = "{LIMIT_MIB}MiB"\ncpu = 0.5\n')
    made: list[str] = []
    with testbed(topo, name=f"fzy{os.getpid() % 100000}m", state_dir=state_dir) as tb:
        made = list(tb.state["cgroups"])
        path = tb.memory_cgroup_path("y")
        assert path is not None and path.is_dir() and str(path) in made
        assert tb.memory_cgroup_path("x") is None and tb.memory_report("x") is None
        # under the limit: fine, and the cgroup saw it
        small = tb.exec("y", [sys.executable, "-c", ALLOC, "16"], stdout=subprocess.PIPE)
        out, _ = small.communicate(timeout=60)
        rep = tb.memory_report("y")
        assert rep is not None and rep.limit_bytes == LIMIT_MIB << 20
        assert small.returncode == 0 and int(out) == 16 << 20
        assert classify_exit(small.returncode, rep) == "ok", rep
        assert rep.peak_bytes is not None and rep.peak_bytes >= 16 << 20
        # over it: the kernel kills it, and that is out of memory
        big = tb.exec("y", [sys.executable, "-c", ALLOC, str(4 * LIMIT_MIB)],
                      stdout=subprocess.PIPE)
        big.communicate(timeout=60)
        rep = tb.memory_report("y")
        assert big.returncode == -9, big.returncode
        assert rep is not None and (rep.oom_kills or rep.limit_hits), rep
        assert classify_exit(big.returncode, rep) == OUT_OF_MEMORY, rep
        # the unlimited host allocates the same without harm
        free = tb.exec("x", [sys.executable, "-c", ALLOC, str(4 * LIMIT_MIB)],
                       stdout=subprocess.PIPE)
        free.communicate(timeout=60)
        assert free.returncode == 0
    assert made and all(not Path(c).exists() for c in made), made


@pytest.mark.netns
@pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")
def test_memory_cgroups_are_removed_when_the_body_fails(
        state_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    if detect_memory_cgroup().root is None:
        pytest.skip("memory limits unavailable here")
    topo = tmp_path / "mem.toml"
    topo.write_text('name = "mem"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "1gbit"\n'
                    '[host.x]\nmemory = "64MiB"\n')
    made: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), \
            testbed(topo, name=f"fzy{os.getpid() % 100000}f", state_dir=state_dir) as tb:
        made = list(tb.state["cgroups"])
        tb.exec("x", [sys.executable, "-c", "import time; time.sleep(60)"])
        raise RuntimeError("boom")
    assert made and all(not Path(c).exists() for c in made), made
    assert isinstance(tb, Testbed)
