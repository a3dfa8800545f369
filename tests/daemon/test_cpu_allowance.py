"""The CPU a node may use (cgroup v2 cpu.max, v1 CFS quota, affinity) and the profile on it."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusiond import profile
from fusiond.plan import MachineProfile
from fusiond.plan.model import DEFAULT_DISK_BYTES_PER_S, DISK_FREE_SHARE
from fusiond.profile import (
    CpuAllowance,
    cgroup_dirs,
    combine_allowance,
    cpu_allowance,
    machine_from_profile,
    parse_cfs,
    parse_cfs_period,
    parse_cpu_max,
    parse_cpu_max_period,
    parse_mountinfo,
    parse_proc_cgroup,
    planner_fields,
    sustained,
    tightest,
)
from protocol.messages import NodeProfile

quotas = st.integers(min_value=1000, max_value=10**7)
periods = st.integers(min_value=1000, max_value=10**6)


@given(quotas, periods)
def test_cpu_max_is_quota_over_period(q: int, p: int) -> None:
    assert parse_cpu_max(f"{q} {p}\n") == pytest.approx(q / p)
    assert parse_cfs(f"{q}\n", f"{p}\n") == pytest.approx(q / p)


@given(quotas, periods)
def test_the_cfs_period_is_read_in_seconds(q: int, p: int) -> None:
    assert parse_cpu_max_period(f"{q} {p}\n") == pytest.approx(p / 1e6)
    assert parse_cfs_period(f"{p}\n") == pytest.approx(p / 1e6)
    assert parse_cpu_max_period(f"{q}") == pytest.approx(0.1)  # the kernel's default
    for bad in ("abc", "999", "1000001"):  # the kernel takes 1 ms .. 1 s
        assert parse_cfs_period(bad) is None
        assert parse_cpu_max_period(f"{q} {bad}") is None


@given(st.floats(min_value=0.01, max_value=64), st.integers(min_value=1, max_value=64),
       st.floats(min_value=0.001, max_value=1.0))
def test_a_woken_thread_waits_out_the_throttled_part_of_the_period(
        quota: float, threads: int, period: float) -> None:
    a = CpuAllowance(quota, quota, 64, "cgroup2:/x", period)
    share = min(1.0, quota / threads)
    assert a.wake_s(threads) == pytest.approx((1 - share) * period)
    assert 0 <= a.wake_s(threads) < period
    # no quota, or the affinity binds: nothing throttles a woken thread
    assert CpuAllowance(4.0, None, 4, "affinity").wake_s(threads) == 0
    assert CpuAllowance(2.0, 3.0, 2, "affinity", period).wake_s(threads) == 0


def test_the_binding_limit_brings_its_period() -> None:
    a = combine_allowance((0.5, "cgroup2:/a"), 4, {"cgroup2:/a": 0.01, "cgroup2:/": 0.1})
    assert a.period_s == 0.01 and a.wake_s(1) == pytest.approx(0.005)
    assert combine_allowance((0.5, "cgroup2:/a"), 4).period_s is None


@given(periods)
def test_unlimited_and_garbage_mean_no_limit(p: int) -> None:
    assert parse_cpu_max(f"max {p}") is None
    assert parse_cpu_max("") is None
    assert parse_cpu_max("lots 100000") is None
    assert parse_cfs("-1", str(p)) is None
    assert parse_cfs("", "") is None
    assert parse_cpu_max("50000") == pytest.approx(0.5)  # period defaults to the kernel's 100 ms


def test_proc_cgroup_finds_the_v2_path_and_the_v1_cpu_hierarchy() -> None:
    text = ("12:pids:/a\n4:cpu,cpuacct:/docker/abc\n2:cpuset:/x\n1:name=systemd:/s\n"
            "0::/user.slice/app.scope\n")
    assert parse_proc_cgroup(text) == ("/user.slice/app.scope", "/docker/abc")
    assert parse_proc_cgroup("0::/\n") == ("/", None)
    assert parse_proc_cgroup("3:cpuacct:/q\n") == (None, None)  # cpuacct is not cpu


def test_mountinfo_keeps_cgroup_mounts_with_their_root() -> None:
    text = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
            "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw,nosuid shared:9 - cgroup cgroup "
            "rw,cpu,cpuacct\n"
            "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    assert parse_mountinfo(text) == [
        ("/docker/abc", "/sys/fs/cgroup/cpu", "cgroup", "rw,cpu,cpuacct"),
        ("/", "/sys/fs/cgroup/unified", "cgroup2", "rw")]


def test_cgroup_dirs_walk_from_the_leaf_to_the_visible_root() -> None:
    assert cgroup_dirs("/", "/m", "/a/b") == ["/m/a/b", "/m/a", "/m"]
    assert cgroup_dirs("/", "/m", "/") == ["/m"]
    # a container sees its own subtree mounted as the root
    assert cgroup_dirs("/docker/abc", "/m", "/docker/abc/x") == ["/m/x", "/m"]
    assert cgroup_dirs("/docker/abc", "/m", "/other") == []


@given(st.lists(st.one_of(st.none(), st.floats(min_value=0.01, max_value=64)), max_size=6),
       st.integers(min_value=1, max_value=256))
def test_allowance_is_the_tightest_limit_and_never_above_the_affinity(
        limits: list[float | None], affinity: int) -> None:
    a = combine_allowance(tightest((x, f"l{i}") for i, x in enumerate(limits)), affinity)
    finite = [x for x in limits if x is not None]
    assert a.cores == pytest.approx(min([*finite, float(affinity)]))
    assert 0 < a.cores <= affinity
    if finite and min(finite) < affinity:
        assert a.source == f"l{limits.index(min(finite))}"
    else:
        assert a.source == "affinity"


@given(st.floats(min_value=1e6, max_value=1e13), st.integers(min_value=1, max_value=64),
       st.floats(min_value=0.01, max_value=64))
def test_sustained_rate_is_per_cpu_second_times_the_cores_threads_can_use(
        rate: float, threads: int, cores: float) -> None:
    got = sustained(rate, threads, cores)
    assert got == pytest.approx(rate * min(threads, cores))
    assert got <= rate * threads * (1 + 1e-12)


def _fake_proc(tmp_path: Path, cgroup: str, mountinfo: str) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return str(proc)


def test_cpu_allowance_reads_v2_cpu_max_up_to_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    (root / "job" / "task").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "job" / "cpu.max").write_text("150000 100000\n")  # 1.5 cores for the job
    (root / "job" / "task" / "cpu.max").write_text("max 100000\n")
    proc = _fake_proc(tmp_path, "0::/job/task\n",
                      f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n")
    a = cpu_allowance(proc)
    aff = len(os.sched_getaffinity(0))
    if aff > 1.5:
        assert a == CpuAllowance(1.5, 1.5, aff, f"cgroup2:{root / 'job'}", 0.1)
    else:
        assert a.cores == aff and a.quota_cores == pytest.approx(1.5)


def test_cpu_allowance_falls_back_to_v1_cfs_quota(tmp_path: Path) -> None:
    root = tmp_path / "cpu"
    (root / "bed-h1").mkdir(parents=True)
    (root / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu.cfs_period_us").write_text("100000\n")
    (root / "bed-h1" / "cpu.cfs_quota_us").write_text("25000\n")
    (root / "bed-h1" / "cpu.cfs_period_us").write_text("100000\n")
    # a hybrid host: cgroup2 mounted without the cpu controller (no cpu.max files)
    (tmp_path / "unified").mkdir()
    proc = _fake_proc(tmp_path, "1:cpu:/bed-h1\n0::/\n",
                      f"32 31 0:29 / {root} rw - cgroup cgroup rw,cpu\n"
                      f"41 31 0:38 / {tmp_path / 'unified'} rw - cgroup2 cgroup2 rw\n")
    a = cpu_allowance(proc)
    assert a.cores == pytest.approx(0.25) and a.quota_cores == pytest.approx(0.25)
    assert a.source == f"cgroup1:{root / 'bed-h1'}"
    assert a.period_s == pytest.approx(0.1)
    assert a.wake_s(1) == pytest.approx(0.075)  # a quarter core: 75 of each 100 ms throttled


def test_cpu_allowance_without_a_visible_cgroup_is_the_affinity(tmp_path: Path) -> None:
    a = cpu_allowance(_fake_proc(tmp_path, "1:cpu:/x\n", ""))
    assert a.quota_cores is None and a.source == "affinity"
    assert a.cores == len(os.sched_getaffinity(0))


def test_planner_fields_round_trip_through_the_gossiped_profile() -> None:
    m = MachineProfile("x", {"matmul": 4e10, "conv": 3e10, "other": 1e9}, mem_bw=5e9,
                       op_overhead_s=2e-5, memory_bytes=1.0)
    prof = NodeProfile(device_kind="cpu", **planner_fields(m))
    back = machine_from_profile("node-1", prof, 2**30)
    assert back is not None
    assert back.flops == m.flops and back.mem_bw == m.mem_bw
    assert back.op_overhead_s == m.op_overhead_s and back.memory_bytes == 2**30
    assert back.id == "node-1"
    assert machine_from_profile("n", NodeProfile(gflops=10.0), 1.0) is None  # no calibration
    slow = machine_from_profile("n", dataclasses.replace(prof, plan_wake_s=0.008), 1.0)
    assert slow is not None and slow.wake_s == 0.008 and back.wake_s == 0.0
    # a gossiped profile cannot claim a wake-up beyond the longest CFS period
    huge = machine_from_profile("n", dataclasses.replace(prof, plan_wake_s=1e9), 1.0)
    assert huge is not None and huge.wake_s == profile.MAX_WAKE_S
    # the disk rate travels; an unmeasured or bogus one counts as the planner's default
    disk = machine_from_profile("n", dataclasses.replace(prof, plan_disk_bytes_per_s=3e8), 1.0)
    assert disk is not None and disk.disk_rate_bytes_per_s == 3e8
    for bad in (0.0, -1.0, float("nan")):
        d = machine_from_profile("n", dataclasses.replace(prof, plan_disk_bytes_per_s=bad), 1.0)
        assert d is not None and d.disk_bytes_per_s == 0.0
        assert d.disk_rate_bytes_per_s == DEFAULT_DISK_BYTES_PER_S
    # the free disk travels too; unknown (0, or a negative claim) bounds nothing
    room = machine_from_profile("n", dataclasses.replace(prof, disk_free_bytes=10**9), 1.0)
    assert room is not None and room.disk_free_bytes == 1e9
    assert room.disk_room_bytes == pytest.approx(DISK_FREE_SHARE * 1e9)
    assert MachineProfile.from_dict(room.to_dict()) == room
    for bad in (0, -5):
        d = machine_from_profile("n", dataclasses.replace(prof, disk_free_bytes=bad), 1.0)
        assert d is not None and d.disk_free_bytes == 0.0 and d.disk_room_bytes == math.inf


def test_the_profile_gossips_the_state_directorys_free_disk(tmp_path: Path) -> None:
    """`Profiler(disk_dir=...)` re-reads the free space where stages keep their files on
    every profile; without a directory it claims none."""
    static = NodeProfile(device_kind="cpu")
    got = profile.Profiler(static, disk_dir=tmp_path)()
    free = shutil.disk_usage(tmp_path).free
    assert got.disk_free_bytes > 0 and abs(got.disk_free_bytes - free) < 256 << 20
    assert profile.Profiler(static)().disk_free_bytes == 0
    assert profile.Profiler(static, disk_dir=tmp_path / "missing")().disk_free_bytes == 0


def test_the_disk_rate_is_measured_past_the_page_cache(tmp_path: Path) -> None:
    rate = profile.disk_bytes_per_s(tmp_path, size=4 << 20)
    assert 1e6 < rate < 1e12  # written, synced, read back: some real rate
    assert not list(tmp_path.iterdir())  # the probe file is gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert profile.disk_bytes_per_s(blocker / "under", size=1 << 20) == 0.0  # not a dir


@pytest.mark.slow  # imports torch and calibrates
def test_profile_speed_follows_the_allowance(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: no wall-clock cap, the shares are exact
    try:
        full = profile.compute_profile(tmp_path, benchmark=True)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    aff = len(os.sched_getaffinity(0))
    monkeypatch.setattr(profile, "cpu_allowance",
                        lambda proc="/proc/self": CpuAllowance(0.25, 0.25, aff, "test", 0.01))
    quarter = profile.compute_profile(tmp_path, benchmark=True)  # cached: same raw numbers
    assert quarter.cpu_cores == 0.25 and quarter.cpu_limit == "test"
    assert quarter.cpu_quota_period_s == 0.01
    assert quarter.plan_wake_s == pytest.approx(0.0075)  # 0.75 of each 10 ms period
    assert full.threads == 1 and quarter.threads == 1
    share = min(1.0, full.cpu_cores) / 0.25
    assert quarter.gflops == pytest.approx(full.gflops_per_cpu_s * 0.25, rel=0.01)
    assert full.gflops / quarter.gflops == pytest.approx(share, rel=0.01)
    assert full.plan_flops_matmul / quarter.plan_flops_matmul == pytest.approx(share)
    assert quarter.plan_op_overhead_s / full.plan_op_overhead_s == pytest.approx(share)
    assert quarter.plan_wire_s_per_byte / full.plan_wire_s_per_byte == pytest.approx(share)
    # the real transport's cost per message (two PeerNetworks over loopback TLS) is measured
    assert 1e-7 < full.plan_msg_s < 1e-2
    assert quarter.plan_msg_s / full.plan_msg_s == pytest.approx(share)


@given(st.floats(min_value=0.001, max_value=256), st.integers(min_value=1, max_value=128))
def test_compute_threads_are_the_allowed_cores_rounded_up_within_torchs_default(
        cores: float, default: int) -> None:
    from fusiond.profile.threads import threads_for

    n = threads_for(cores, default)
    assert 1 <= n <= default
    assert n == min(default, max(1, math.ceil(cores - 1e-9)))
    assert threads_for(0.5, 2) == 1 and threads_for(1.5, 4) == 2 and threads_for(8.0, 2) == 2


def test_operator_thread_choice_is_kept() -> None:
    import torch

    from fusiond.profile.threads import apply_cpu_allowance

    before = torch.get_num_threads()
    got = apply_cpu_allowance(CpuAllowance(0.25, 0.25, 4, "test"), env={"OMP_NUM_THREADS": "3"})
    assert got.threads == before == torch.get_num_threads() and "OMP_NUM_THREADS" in got.why


_CHILD = ("from fusiond.profile.threads import apply_cpu_allowance; import torch; "
          "c = apply_cpu_allowance(); print(c.default, c.threads, torch.get_num_threads())")


@pytest.mark.netns
def test_a_process_under_a_cpu_quota_runs_no_more_torch_threads_than_it_may_keep_busy(
        tmp_path: Path) -> None:
    """The real kernel limit: a process put into a cgroup with a 0.5-core CFS quota before it
    starts python sets torch to 1 thread; the same command outside the cgroup keeps torch's
    default (the cores of this machine)."""
    import subprocess
    import sys

    from deploy.testbed.bed import detect_cgroup

    cg = detect_cgroup()
    if cg.root is None or os.geteuid() != 0:
        pytest.skip(f"needs root and a writable cpu cgroup: {cg.reason}")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to tell a quota of 0.5 core from the machine")
    path = cg.root / f"fusion-test-threads-{os.getpid()}"
    path.mkdir()
    try:
        if cg.kind == "v2":
            (path / "cpu.max").write_text("50000 100000")
        else:
            (path / "cpu.cfs_period_us").write_text("100000")
            (path / "cpu.cfs_quota_us").write_text("50000")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        procs = "cgroup.procs"
        inside = subprocess.run(
            ["sh", "-c", f'echo $$ > "{path / procs}" && exec "$0" -c "$1"', sys.executable,
             _CHILD], capture_output=True, text=True, env=env, timeout=120, check=True)
        outside = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                                 env=env, timeout=120, check=True)
    finally:
        path.rmdir()
    d_in, n_in, now_in = map(int, inside.stdout.split())
    d_out, n_out, now_out = map(int, outside.stdout.split())
    assert d_in >= 2 and n_in == now_in == 1, inside.stdout
    assert n_out == now_out == d_out >= 2, outside.stdout
