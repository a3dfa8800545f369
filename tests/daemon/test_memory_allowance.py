"""The memory a node may hold (cgroup v2 memory.max, v1 memory.limit_in_bytes), what its
profile offers jobs under it, and the heap helpers a stage keeps within it with."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusiond.heap import near_limit, resident_anon_bytes, trim_heap
from fusiond.profile import (
    MemoryAllowance,
    memory_allowance,
    parse_memory_limit,
    parse_memory_stat,
    parse_proc_cgroup,
)
from tests.daemon.test_cpu_allowance import _fake_proc


@given(st.integers(1, (1 << 60) - 1))
def test_a_limit_in_bytes_is_read_as_bytes(v: int) -> None:
    assert parse_memory_limit(f"{v}\n") == v


@pytest.mark.parametrize("text", ["max\n", "", "9223372036854771712\n", "0\n", "lots\n"])
def test_unset_and_garbage_limits_mean_none(text: str) -> None:
    assert parse_memory_limit(text) is None


def test_memory_stat_gives_one_counter() -> None:
    text = "cache 10\ntotal_inactive_file 4096\nweird x\n"
    assert parse_memory_stat(text, "total_inactive_file") == 4096
    assert parse_memory_stat(text, "weird") is None
    assert parse_memory_stat(text, "absent") is None


def test_proc_cgroup_finds_the_hierarchy_of_the_controller_asked_for() -> None:
    text = "4:memory:/bed-h1\n1:cpu,cpuacct:/other\n0::/\n"
    assert parse_proc_cgroup(text, "memory") == ("/", "/bed-h1")
    assert parse_proc_cgroup(text) == ("/", "/other")


def test_v2_the_tightest_memory_max_on_the_way_to_the_root_binds(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    (root / "job" / "task").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "job" / "memory.max").write_text(f"{512 << 20}\n")
    (root / "job" / "memory.current").write_text(f"{200 << 20}\n")
    (root / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {50 << 20}\n")
    (root / "job" / "task" / "memory.max").write_text(f"{1 << 30}\n")
    proc = _fake_proc(tmp_path, "0::/job/task\n",
                      f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n")
    a = memory_allowance(proc)
    # the working set: usage less the inactive file cache the kernel drops first
    assert a == MemoryAllowance(512 << 20, 150 << 20, f"cgroup2:{root / 'job'}")
    assert a.free_bytes == 362 << 20


def test_v1_reads_the_memory_hierarchy_not_the_cpu_one(tmp_path: Path) -> None:
    mem, cpu = tmp_path / "memory", tmp_path / "cpu"
    (mem / "bed-h1").mkdir(parents=True)
    (cpu / "bed-h1").mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (mem / "bed-h1" / "memory.limit_in_bytes").write_text(f"{428 << 20}\n")
    (mem / "bed-h1" / "memory.usage_in_bytes").write_text(f"{500 << 20}\n")  # past it: cache
    (mem / "bed-h1" / "memory.stat").write_text(f"total_inactive_file {100 << 20}\n")
    proc = _fake_proc(tmp_path, "4:memory:/bed-h1\n2:cpu:/bed-h1\n0::/\n",
                      f"32 31 0:29 / {cpu} rw - cgroup cgroup rw,cpu\n"
                      f"33 31 0:30 / {mem} rw - cgroup cgroup rw,memory\n")
    a = memory_allowance(proc)
    assert a.limit_bytes == 428 << 20 and a.source == f"cgroup1:{mem / 'bed-h1'}"
    assert a.used_bytes == 400 << 20 and a.free_bytes == 28 << 20


def test_without_a_visible_memory_cgroup_there_is_no_limit(tmp_path: Path) -> None:
    a = memory_allowance(_fake_proc(tmp_path, "4:memory:/x\n", ""))
    assert a == MemoryAllowance(None, None, "") and a.free_bytes is None


def test_a_usage_that_cannot_be_read_leaves_the_limit(tmp_path: Path) -> None:
    root = tmp_path / "cg2"
    root.mkdir()
    (root / "memory.max").write_text(f"{1 << 30}\n")
    a = memory_allowance(_fake_proc(tmp_path, "0::/\n",
                                    f"41 31 0:38 / {root} rw - cgroup2 cgroup2 rw\n"))
    assert a.limit_bytes == 1 << 30 and a.used_bytes is None and a.free_bytes is None


def test_this_process_holds_anonymous_memory_and_a_limit_below_it_is_near() -> None:
    held = resident_anon_bytes()
    assert held is not None and held > 1 << 20
    assert near_limit(held / 2)
    assert not near_limit(held * 100)
    assert not near_limit(None) and not near_limit(0)
    assert trim_heap() in (True, False)  # glibc here: True; never raises


def test_an_unreadable_statm_is_none(tmp_path: Path) -> None:
    assert resident_anon_bytes(str(tmp_path / "absent")) is None
    (tmp_path / "statm").write_text("garbage\n")
    assert resident_anon_bytes(str(tmp_path / "statm")) is None
