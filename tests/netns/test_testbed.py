"""deploy.testbed end to end (root): `up` then `check` on the 3-host topology is within 15 %
on rate and 2 ms on RTT, and `down` leaves no namespace, qdisc, iptables rule or process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.testbed import (
    Testbed,
    detect_cgroup,
    list_namespaces,
    load_topology,
    namespace_pids,
    testbed,
)
from tests.netns.conftest import needs_delay_stage, needs_netns, snapshot

pytestmark = [pytest.mark.netns, needs_netns]

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _assert_gone(tb: Testbed, pids: list[int], before: object) -> None:
    ours = [ns for ns in list_namespaces() if ns.startswith(f"{tb.name}-")]
    assert ours == [], f"namespaces left behind: {ours}"
    deadline = time.monotonic() + 3
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == [], "processes left behind"
    assert snapshot() == before, "the root namespace's links, qdiscs or iptables rules changed"
    assert not tb.state_file.exists()
    assert not tb.work_dir.exists()
    for cg in tb.state.get("cgroups", []):
        assert not Path(cg).exists(), f"cgroup left behind: {cg}"


@pytest.mark.slow
def test_three_hosts_up_check_down(state_dir: Path) -> None:
    why = needs_delay_stage()
    if why:
        pytest.skip(why)
    before = snapshot()
    name = f"fzt{os.getpid() % 100000}t"
    with testbed("three-hosts", name=name, state_dir=state_dir) as tb:
        assert tb.state["delay"] in ("nfqueue", "netem")
        assert sorted(ns for ns in list_namespaces() if ns.startswith(name)) == sorted(
            [f"{name}-a", f"{name}-b", f"{name}-c", f"{name}-bridge"])
        # Nothing of the testbed is visible from the root namespace.
        assert snapshot() == before
        results = tb.check(duration_s=1.0)
        again = [(r.src, r.dst) for r in results if not r.ok]
        if again:  # timings on a shared machine: a link that misses twice is misconfigured
            redo = {(r.src, r.dst): r for r in tb.check(duration_s=1.0, pairs=again)}
            results = [redo.get((r.src, r.dst), r) for r in results]
        report = "\n".join(r.line() for r in results)
        print(report)
        assert len(results) == 6
        assert all(r.ok for r in results), report
        pids = [p for ns in tb.state["namespaces"] for p in namespace_pids(ns)]
        if tb.state["delay"] == "nfqueue":
            assert namespace_pids(tb.bridge_ns), "the delay stage runs in the bridge namespace"
    _assert_gone(tb, pids, before)


def test_cli_down_after_the_creator_is_gone_removes_processes_and_namespaces(
        state_dir: Path) -> None:
    """`up` in one process (which then exits, as after a crash), a long-running process in
    each host, then `down` from another process: everything is found through the state file."""
    before = snapshot()
    name = f"fzt{os.getpid() % 100000}c"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "deploy.testbed", "--state-dir", str(state_dir)]
    up = subprocess.run([*cli, "up", "three-hosts", "--name", name, "--latency", "none",
                         "--start-cmd", "exec sleep 300"],
                        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert up.returncode == 0, up.stderr
    assert "three-hosts" in up.stdout and "processes 1" in up.stdout
    tb = Testbed.load(name, state_dir)
    pids = [p for ns in tb.state["namespaces"] for p in namespace_pids(ns)]
    assert len(pids) == 3  # the three sleeps, one per host
    status = subprocess.run([*cli, "status", name], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=30)
    assert status.returncode == 0 and f"{name}-a" in status.stdout
    down = subprocess.run([*cli, "down", "three-hosts"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=60)
    assert down.returncode == 0, down.stderr
    _assert_gone(tb, pids, before)
    again = subprocess.run([*cli, "down", name], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=60)
    assert again.returncode == 1 and "no testbed" in again.stderr


def test_a_failed_up_removes_what_it_made(state_dir: Path, tmp_path: Path) -> None:
    """A step failing half-way (here: a second testbed with the same name) leaves nothing."""
    before = snapshot()
    name = f"fzt{os.getpid() % 100000}f"
    topo = tmp_path / "two.toml"
    topo.write_text('name = "two"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "10mbit"\n')
    with testbed(topo, name=name, state_dir=state_dir) as tb:
        from deploy.testbed import TestbedError

        dup = Testbed(load_topology(topo), name=name, state_dir=state_dir,
                      topology_path=str(topo))
        with pytest.raises(TestbedError, match="already exists"):
            dup.up()
        assert f"{name}-x" in list_namespaces()  # the first one is untouched
    _assert_gone(tb, [], before)


def test_down_cleans_up_after_up_crashed_half_way(state_dir: Path) -> None:
    """`up` dies (os._exit: no finally, no cleanup) after the namespaces, veths and qdiscs
    exist; `down` in another process finds them all through the write-ahead state file."""
    before = snapshot()
    name = f"fzt{os.getpid() % 100000}k"
    crash = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from deploy.testbed import Testbed, load_topology\n"
        "Testbed._cpu_quotas = lambda self: os._exit(9)\n"
        f"tb = Testbed(load_topology('three-hosts'), name={name!r}, state_dir=Path(sys.argv[1]),"
        " topology_path='three-hosts')\n"
        "tb.up(latency='none')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", crash, str(state_dir)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 9, res.stderr
    left = [ns for ns in list_namespaces() if ns.startswith(f"{name}-")]
    assert len(left) == 4  # the crash really left the testbed behind
    out = subprocess.run(
        [sys.executable, "-m", "deploy.testbed", "--state-dir", str(state_dir), "status"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout
    assert name in out
    down = subprocess.run(
        [sys.executable, "-m", "deploy.testbed", "--state-dir", str(state_dir), "down", "--all"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert down.returncode == 0, down.stderr
    _assert_gone(Testbed(load_topology("three-hosts"), name=name, state_dir=state_dir), [],
                 before)


def test_cpu_quota_limits_a_hosts_processes(state_dir: Path, tmp_path: Path) -> None:
    cg = detect_cgroup()
    if cg.root is None:
        pytest.skip(f"CPU quotas unavailable here: {cg.reason}")
    topo = tmp_path / "quota.toml"
    topo.write_text('name = "quota"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "1gbit"\n'
                    '[host.y]\ncpu = 0.2\n')
    spin = ("import os, time\n"
            "t = time.monotonic()\n"
            "while time.monotonic() - t < 1.0: pass\n"
            "c = os.times()\n"
            "print(c.user + c.system)\n")
    with testbed(topo, name=f"fzt{os.getpid() % 100000}q", state_dir=state_dir) as tb:
        assert tb.state["cgroups"] and all(Path(c).is_dir() for c in tb.state["cgroups"])
        used = float(tb.run("y", [sys.executable, "-c", spin]))
        # the host sees its own quota where a container would (fusiond.profile reads it)
        seen = tb.run("y", [sys.executable, "-c", "from fusiond.profile import cpu_allowance; "
                            "a = cpu_allowance(); print(a.cores, a.source)"]).split()
        free = tb.run("x", [sys.executable, "-c", "from fusiond.profile import cpu_allowance; "
                            "print(cpu_allowance().quota_cores)"]).strip()
    # 0.2 of a core for ~1 s of wall clock (plus interpreter start-up inside the quota too).
    assert used < 0.2 * 1.3 + 0.1, used
    assert float(seen[0]) == pytest.approx(0.2) and seen[1].endswith("-y"), seen
    assert free == "None"  # a host without a quota has none to see
    assert all(not Path(c).exists() for c in tb.state["cgroups"])


def test_a_hosts_processes_see_their_memory_limit(state_dir: Path, tmp_path: Path) -> None:
    """A host's memory limit is visible inside it as in a container (cgroup v1: its memory
    hierarchy mounted beside the cpu one), so a daemon there offers jobs what is left under
    it (`fusiond.profile.free_memory_bytes`) and its stages trim near it."""
    from deploy.testbed import detect_memory_cgroup

    if detect_cgroup().root is None or detect_memory_cgroup().root is None:
        pytest.skip("no writable cpu and memory cgroup hierarchies here")
    topo = tmp_path / "memory.toml"
    topo.write_text('name = "memory"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "1gbit"\n'
                    '[host.y]\nmemory = "300MiB"\n')
    probe = ("from fusiond.profile import memory_allowance, free_memory_bytes, "
             "_total_memory_bytes\n"
             "a = memory_allowance()\n"
             "print(a.limit_bytes, a.source, _total_memory_bytes(), free_memory_bytes())\n")
    with testbed(topo, name=f"fzt{os.getpid() % 100000}m", state_dir=state_dir) as tb:
        limit, source, total, free = tb.run("y", [sys.executable, "-c", probe]).split()
        other = tb.run("x", [sys.executable, "-c", probe]).split()
    assert int(limit) == 300 * 2**20 and source.endswith("-y"), (limit, source)
    assert int(total) == 300 * 2**20
    assert 0 < int(free) < 300 * 2**20  # this interpreter's own pages count
    assert other[0] == "None"  # a host without a limit has none to see


def test_the_state_keeps_the_topology_when_its_file_is_gone(
        state_dir: Path, tmp_path: Path) -> None:
    before = snapshot()
    name = f"fzt{os.getpid() % 100000}g"
    topo = tmp_path / "gone.toml"
    topo.write_text('name = "gone"\nhosts = ["x", "y"]\n[defaults]\nbandwidth = "10mbit"\n')
    tb = Testbed(load_topology(topo), name=name, state_dir=state_dir, topology_path=str(topo))
    tb.up(latency="none")
    topo.unlink()
    again = Testbed.load(name, state_dir)
    assert again.topology.link("x", "y").bandwidth_bits_per_s == 10_000_000
    assert f"{name}-y" in again.describe()
    assert again.down() == []
    _assert_gone(tb, [], before)


def test_up_never_claims_a_namespace_it_did_not_make(state_dir: Path) -> None:
    """A namespace that happens to carry one of our names makes `up` fail, and the cleanup
    of the failed `up` leaves that namespace alone."""
    name = f"fzt{os.getpid() % 100000}n"
    foreign = f"{name}-b"
    subprocess.run(["ip", "netns", "add", foreign], check=True)
    try:
        from deploy.testbed import TestbedError

        tb = Testbed(load_topology("three-hosts"), name=name, state_dir=state_dir)
        with pytest.raises(TestbedError, match="already exists"):
            tb.up(latency="none")
        ours = sorted(ns for ns in list_namespaces() if ns.startswith(f"{name}-"))
        assert ours == [foreign]
        assert not tb.state_file.exists()
    finally:
        subprocess.run(["ip", "netns", "del", foreign], check=False)
