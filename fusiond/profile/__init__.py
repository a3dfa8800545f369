"""What this node can do: device, memory, measured compute speed, CPU allowance, versions.

The profile is gossiped to every member (the election ranks on it and the planner sizes
partitions with it) as one typed, bounded schema, `protocol.messages.NodeProfile`: this room
builds it, every reader uses its attributes. Computing it is cheap except the benchmarks, which run
once and are cached by (device, torch version) in the cache directory; `free_memory_bytes` is
re-read every time the profile is asked for.

CPU contract (a CPU node): speeds are measured in work per *CPU second* of this process
(`time.process_time`), so neither a CFS quota's throttling nor other tenants' load bends them,
and then multiplied by the cores this process may really use: `cpu_allowance()` = the
tightest of the cgroup v2 `cpu.max` limits from its cgroup up to the root (cgroup v1
`cpu.cfs_quota_us / cpu.cfs_period_us` where v2 has no cpu controller) and its CPU affinity.
A wall-clock benchmark of a few milliseconds under a quota runs in the first CFS period at full
speed and would overstate a 0.25-core container fourfold. The sustained rate of a job running
`threads` threads is per-CPU-second rate x min(threads, allowed cores); fixed per-dispatch
costs (one thread) are divided by min(1, allowed cores). A quota that is not visible (no cgroup
filesystem mounted in this mount namespace) counts as none: the profile then says what the
node would do alone on its allowed cores, not what other tenants leave it.

`calibrate` (this package's other module) times the planner's op classes on this node -> a
`MachineProfile`: measuring this node is this room's job, so `fusiond.plan` stays pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import platform
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypedDict

import fusiond
import protocol
from fusiond import durable
from fusiond.heap import trim_heap
from fusiond.opsets import OpSet
from fusiond.plan.model import SMALL_MATMUL, TINY_MATMUL, MachineProfile, PlanError
from protocol.messages import DeviceProfile, NodeProfile

log = logging.getLogger("fusiond.profile")

BENCH_N = 512
"""Matrix size of the benchmark: big enough to be compute bound, small enough to take ~10 ms."""
BENCH_REPEATS = 5
CACHE_VERSION = 9
"""Bumped when the cached numbers change meaning (2: per CPU second, before the allowance;
3: with the transport's cost per message; 4: the memory bandwidth over 16 MiB vectors
written into one buffer, so the calibration's peak stays about 100 MiB under a tight limit;
5: class "other" from a network's nonlinear ops, attention its own class, the dispatch cost
from a transformer-like mix, every time a median; 6: the matmul rate at a small product too,
"matmul_small"; 7: the dispatch benchmark's blocks each with their own parameters, their
gradient accumulations counted as launches; 8: "matmul_tiny"; 9: always the CPU's rates, the
accelerators measured apart (`devices.json`), the CPU's bfloat16 matmul rate)."""


# -- the CPU this process may use (pure parsing, then the one function that reads files) ------


@dataclass(frozen=True)
class CpuAllowance:
    """How many cores this process may keep busy: `cores` = min(quota, affinity).

    `quota_cores`: the tightest cgroup CPU limit on the way to the root (None: unlimited or not
    visible); `affinity`: CPUs in the scheduler affinity mask; `source`: where the binding
    limit comes from (for logs and the profile: "cgroup2:/path", "cgroup1:/path", "affinity").
    """

    cores: float
    quota_cores: float | None
    affinity: int
    source: str
    period_s: float | None = None
    """The CFS period of the binding quota (None: no quota binds)."""

    def wake_s(self, threads: int) -> float:
        """What a woken thread waits, on average, once `threads` busy threads have used the
        quota's share of the current period: (1 - share) x period, share = quota / threads
        (at most 1). 0 when no quota binds. A 0.2-core quota with the kernel's default 100 ms
        period makes every hand-off wait 80 ms; with 10 ms, 8 ms."""
        if self.quota_cores is None or self.period_s is None or self.source == "affinity":
            return 0.0
        share = min(1.0, self.quota_cores / max(1, threads))
        return max(0.0, 1.0 - share) * self.period_s


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 `cpu.max` ("QUOTA PERIOD", QUOTA "max" = unlimited) -> cores, or None for
    unlimited or unparsable."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    try:
        quota = float(parts[0])
        period = float(parts[1]) if len(parts) > 1 else 100_000.0
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cpu_max_period(text: str) -> float | None:
    """The period of a cgroup v2 `cpu.max` in seconds (the kernel's default 100 ms when the
    file gives none), or None when unparsable or out of the kernel's 1 ms..1 s range."""
    parts = text.split()
    try:
        period_us = float(parts[1]) if len(parts) > 1 else 100_000.0
    except ValueError:
        return None
    return period_us / 1e6 if 1_000 <= period_us <= 1_000_000 else None


def parse_cfs_period(period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_period_us` in seconds, or None (unparsable, outside 1 ms..1 s)."""
    try:
        period_us = float(period_text.strip())
    except ValueError:
        return None
    return period_us / 1e6 if 1_000 <= period_us <= 1_000_000 else None


def parse_cfs(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 `cpu.cfs_quota_us` (-1 = unlimited) over `cpu.cfs_period_us` -> cores."""
    try:
        quota, period = float(quota_text.strip()), float(period_text.strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_proc_cgroup(text: str, controller: str = "cpu") -> tuple[str | None, str | None]:
    """/proc/self/cgroup -> (cgroup v2 path, cgroup v1 path of the hierarchy holding
    `controller`); None where the file has no such line."""
    v2: str | None = None
    v1: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, ctl, path = parts
        if hid == "0" and ctl == "":
            v2 = path
        elif controller in ctl.split(","):
            v1 = path
    return v2, v1


def parse_mountinfo(text: str) -> list[tuple[str, str, str, str]]:
    """/proc/self/mountinfo -> [(mount root, mount point, fs type, super options)] of the
    cgroup filesystems (v1 "cgroup" and v2 "cgroup2")."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        lf, rf = left.split(), right.split()
        if not sep or len(lf) < 5 or len(rf) < 3 or rf[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((lf[3], lf[4], rf[0], rf[2]))
    return out


def cgroup_dirs(mount_root: str, mount_point: str, path: str) -> list[str]:
    """The directories of cgroup `path` and each ancestor (leaf first) under a mount of the
    hierarchy whose root is `mount_root` (a container sees only its own subtree); [] when the
    path is outside the mounted subtree."""
    root = mount_root.rstrip("/")
    if root and not (path == root or path.startswith(root + "/")):
        return []
    rel = [p for p in path[len(root):].split("/") if p and p not in (".", "..")]
    return [os.path.join(mount_point, *rel[:i]) for i in range(len(rel), -1, -1)]


def tightest(limits: Iterable[tuple[float | None, str]]) -> tuple[float | None, str]:
    """The smallest limit and its source, ignoring None (unlimited); (None, "") when none."""
    best: tuple[float | None, str] = (None, "")
    for cores, src in limits:
        if cores is not None and (best[0] is None or cores < best[0]):
            best = (cores, src)
    return best


def combine_allowance(quota: tuple[float | None, str], affinity: int,
                      periods: Mapping[str, float | None] | None = None) -> CpuAllowance:
    """The allowance from the tightest cgroup limit and the affinity mask; `periods`: the CFS
    period of each limit's source, where known."""
    cores, src = quota
    aff = max(1, affinity)
    if cores is None or cores >= aff:
        return CpuAllowance(float(aff), cores, aff, "affinity")
    return CpuAllowance(cores, cores, aff, src, (periods or {}).get(src))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_allowance(proc: str = "/proc/self") -> CpuAllowance:
    """This process's CPU allowance (see `CpuAllowance`): cgroup v2 `cpu.max` files on the way
    from its cgroup to the root where present, else the v1 cpu hierarchy's CFS quota, and the
    affinity mask. Never raises: what cannot be read counts as unlimited."""
    v2, v1 = parse_proc_cgroup(_read(f"{proc}/cgroup") or "")
    mounts = parse_mountinfo(_read(f"{proc}/mountinfo") or "")
    limits: list[tuple[float | None, str]] = []
    periods: dict[str, float | None] = {}
    for root, point, fstype, opts in mounts:
        if fstype == "cgroup2" and v2 is not None:
            for d in cgroup_dirs(root, point, v2):
                text = _read(os.path.join(d, "cpu.max"))
                if text is not None:
                    limits.append((parse_cpu_max(text), "cgroup2:" + d))
                    periods["cgroup2:" + d] = parse_cpu_max_period(text)
        elif fstype == "cgroup" and v1 is not None and "cpu" in opts.split(","):
            for d in cgroup_dirs(root, point, v1):
                q = _read(os.path.join(d, "cpu.cfs_quota_us"))
                p = _read(os.path.join(d, "cpu.cfs_period_us"))
                if q is not None and p is not None:
                    limits.append((parse_cfs(q, p), "cgroup1:" + d))
                    periods["cgroup1:" + d] = parse_cfs_period(p)
    return combine_allowance(tightest(limits), _affinity(), periods)


def sustained(rate_per_cpu_s: float, threads: int, cores: float) -> float:
    """What a job with `threads` busy threads sustains, from a rate per CPU second: it can keep
    min(threads, cores) cores busy (a quota of 0.25 core gives a quarter of one)."""
    return rate_per_cpu_s * min(float(max(1, threads)), max(cores, 1e-3))


@dataclass(frozen=True)
class MemoryAllowance:
    """The memory this process may hold before the kernel kills it: `limit_bytes`, the
    tightest cgroup memory limit on the way from its cgroup to the root (None: none), from
    `source` ("cgroup2:/path", "cgroup1:/path"); `used_bytes`: that cgroup's working set now
    (its usage less the inactive file cache the kernel drops first; None: not readable)."""

    limit_bytes: int | None
    used_bytes: int | None
    source: str

    @property
    def free_bytes(self) -> int | None:
        """What is left under the limit (None: no limit, or no usage read)."""
        if self.limit_bytes is None or self.used_bytes is None:
            return None
        return max(0, self.limit_bytes - self.used_bytes)


UNLIMITED_MEMORY_BYTES: Final = 1 << 60
"""A cgroup v1 limit at or above this is "no limit" (the kernel writes 2^63 less a page)."""


def parse_memory_limit(text: str) -> int | None:
    """A cgroup memory limit file (v2 `memory.max`: "max" or bytes; v1
    `memory.limit_in_bytes`: bytes, about 2^63 when unset) -> bytes, None when unlimited or
    unreadable."""
    t = text.strip()
    if not t or t == "max":
        return None
    try:
        v = int(t)
    except ValueError:
        return None
    return v if 0 < v < UNLIMITED_MEMORY_BYTES else None


def parse_memory_stat(text: str, key: str) -> int | None:
    """One counter of a cgroup `memory.stat` file (None: absent or odd)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def memory_allowance(proc: str = "/proc/self") -> MemoryAllowance:
    """This process's memory allowance (see `MemoryAllowance`): cgroup v2 `memory.max` on the
    way from its cgroup to the root, else the v1 memory hierarchy's `memory.limit_in_bytes`;
    the usage of the cgroup whose limit binds. Never raises: what cannot be read counts as
    unlimited."""
    v2, v1 = parse_proc_cgroup(_read(f"{proc}/cgroup") or "", "memory")
    mounts = parse_mountinfo(_read(f"{proc}/mountinfo") or "")
    limits: list[tuple[float | None, str]] = []
    files: dict[str, tuple[str, str, str]] = {}
    for root, point, fstype, opts in mounts:
        # (the cgroup's path, "kind", its limit, usage and memory.stat's inactive-cache key)
        if fstype == "cgroup2" and v2 is not None:
            path, kind, names = v2, "cgroup2:", ("memory.max", "memory.current",
                                                 "inactive_file")
        elif fstype == "cgroup" and v1 is not None and "memory" in opts.split(","):
            path, kind, names = v1, "cgroup1:", ("memory.limit_in_bytes",
                                                 "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        for d in cgroup_dirs(root, point, path):
            text = _read(os.path.join(d, names[0]))
            if text is not None:
                limits.append((parse_memory_limit(text), kind + d))
                files[kind + d] = (os.path.join(d, names[1]), os.path.join(d, "memory.stat"),
                                   names[2])
    limit, src = tightest(limits)
    if limit is None:
        return MemoryAllowance(None, None, "")
    used: int | None = None
    usage_file, stat_file, inactive_key = files[src]
    text = _read(usage_file)
    if text is not None and text.strip().isdigit():
        inactive = parse_memory_stat(_read(stat_file) or "", inactive_key) or 0
        used = max(0, int(text) - inactive)
    return MemoryAllowance(int(limit), used, src)


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _total_memory_bytes() -> int:
    """The host's memory, or this process's cgroup limit where that is smaller (a daemon run
    with systemd's `MemoryMax=`, in a container, or on the testbed's hosts)."""
    phys = _physical_memory_bytes()
    limit = memory_allowance().limit_bytes
    if limit is not None and (phys <= 0 or limit < phys):
        return limit
    return phys


def free_memory_bytes() -> int:
    """Available memory now: MemAvailable on Linux, or what is left under this process's
    cgroup limit where that is less (0 when unknown)."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if not avail:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            avail = 0
    left = memory_allowance().free_bytes
    if left is not None and (avail <= 0 or left < avail):
        return left
    return avail


def matmul_gflops(device_kind: str = "cpu", n: int = BENCH_N, repeats: int = BENCH_REPEATS,
                  *, per_cpu_second: bool | None = None) -> float:
    """Measured float32 matmul throughput in GFLOP/s (best of `repeats`, after a warm-up).
    `per_cpu_second` (default: on a CPU): on one thread, per CPU second of that thread
    (`sustained` turns it into what the node's allowance gives); else per wall-clock second
    at torch's thread count."""
    import torch

    dev = torch.device("cuda" if device_kind == "cuda" else "cpu")
    cpu_s = dev.type == "cpu" if per_cpu_second is None else per_cpu_second and dev.type == "cpu"
    clock = time.thread_time if cpu_s else time.perf_counter
    threads = torch.get_num_threads()
    if cpu_s:
        torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, device=dev)
        b = torch.randn(n, n, device=dev)
        torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            t0 = clock()
            torch.mm(a, b)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, clock() - t0)
    finally:
        torch.set_num_threads(threads)
    return (2.0 * n**3) / max(best, 1e-9) / 1e9


def _cpu_info() -> dict[str, Any]:
    name = platform.processor() or platform.machine() or "cpu"
    return {"device_kind": "cpu", "device_name": name,
            "device_memory_bytes": _total_memory_bytes(),
            "device_free_bytes": free_memory_bytes(), "device_count": os.cpu_count() or 1}


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def transport_message_s(count: int = 200, size: int = 1024, rounds: int = 3) -> float:
    """CPU seconds one end of the real transport spends per message (best of `rounds`): two
    `PeerNetwork`s with mutual TLS (throwaway credentials) on loopback in this thread's event
    loop exchange `count` small `Forward` messages, and half the process CPU time per message
    is one end's share. 0.0 (with a warning) where it cannot run (no loopback, no TLS)."""
    import asyncio
    import tempfile

    from fusiond.net import PeerNetwork, TLSMaterial
    from fusiond.net.pki import (
        create_cluster_ca,
        issue_node_certificate,
        load_or_create_node_identity,
        store_node_credentials,
    )
    from protocol.messages import Forward, Message

    async def run(root: Path) -> float:
        ca = create_cluster_ca(root / "ca")
        for n in ("a", "b"):
            ident = load_or_create_node_identity(root / n)
            store_node_credentials(root / n, issue_node_certificate(ca, ident.key.public_key()),
                                   ca.cert)
        ta, tb = TLSMaterial.in_state_dir(root / "a"), TLSMaterial.in_state_dir(root / "b")
        done = asyncio.Event()
        got = [0]

        async def on_b(peer: str, msg: Message) -> None:
            if isinstance(msg, Forward):
                got[0] += 1
                if got[0] >= count:
                    done.set()

        async def on_a(peer: str, msg: Message) -> None:
            return None

        b = PeerNetwork(node_id=tb.node_id(), cluster_id=tb.cluster_id(),
                        listen=("127.0.0.1", 0), tls=tb, handler=on_b)
        a = PeerNetwork(node_id=ta.node_id(), cluster_id=ta.cluster_id(),
                        listen=("127.0.0.1", 0), tls=ta, handler=on_a)
        await b.start()
        await a.start()
        try:
            peer = await a.connect(b.address)
            payload = [memoryview(bytes(size))]
            best = float("inf")
            for _ in range(rounds):
                got[0] = 0
                done.clear()
                c0 = time.process_time()
                for i in range(count):
                    await a.send(peer, Forward(job_id="profile", plan_version=1, iteration=0,
                                               microbatch=i, edge="e"), payload)
                await asyncio.wait_for(done.wait(), 60)
                best = min(best, time.process_time() - c0)
            return best / count / 2
        finally:
            await a.close()
            await b.close()

    try:
        with tempfile.TemporaryDirectory(prefix="fusion-profile-") as d:
            return asyncio.run(run(Path(d)))
    except Exception as e:  # a profile must not fail for want of a loopback
        log.warning("cannot measure the transport's cost per message: %r", e)
        return 0.0


MAX_WAKE_S = 1.0
"""The largest wake-up latency a profile may claim (a CFS period is at most 1 s)."""

PLAN_FIELDS = {"matmul": "plan_flops_matmul", SMALL_MATMUL: "plan_flops_matmul_small",
               TINY_MATMUL: "plan_flops_matmul_tiny", "conv": "plan_flops_conv",
               "attention": "plan_flops_attention", "other": "plan_flops_other"}
"""Profile keys of the planner's calibrated FLOP rates per op class (sustained, at the node's
CPU allowance), beside ``plan_mem_bw``, ``plan_op_overhead_s``, ``plan_wire_s_per_byte`` and
``plan_msg_s`` and ``plan_wake_s``."""


def planner_fields(m: MachineProfile) -> dict[str, float]:
    """The flat profile keys carrying a calibration (the gossiped profile holds scalars)."""
    out = {key: float(m.flops[c]) for c, key in PLAN_FIELDS.items() if c in m.flops}
    out["plan_mem_bw"] = float(m.mem_bw)
    out["plan_op_overhead_s"] = float(m.op_overhead_s)
    out["plan_wire_s_per_byte"] = float(m.wire_s_per_byte)
    out["plan_msg_s"] = float(m.msg_s)
    out["plan_wake_s"] = float(m.wake_s)
    out["plan_disk_bytes_per_s"] = float(m.disk_bytes_per_s)
    return out


DISK_PROBE_BYTES = 32 << 20
"""What `disk_bytes_per_s` writes and reads back: enough to pass the drive's own cache."""


def disk_bytes_per_s(directory: Path, size: int = DISK_PROBE_BYTES) -> float:
    """The rate at which this machine's disk under `directory` writes `size` bytes (synced)
    and reads them back past the page cache: what a stage keeping its optimizer state there
    pays per byte once per step (`fusiond.train.offload`). 0.0 when it cannot be measured
    (no room, a read-only directory): the planner then assumes its default."""
    path = directory / f".disk-probe-{os.getpid()}"
    block = os.urandom(1 << 20)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(max(1, size >> 20)):
                os.write(fd, block)
            os.fsync(fd)
            t1 = time.perf_counter()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.lseek(fd, 0, os.SEEK_SET)
            t2 = time.perf_counter()
            while os.read(fd, 1 << 20):
                pass
            t3 = time.perf_counter()
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("cannot measure the disk under %s: %s", directory, e)
        return 0.0
    finally:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    moved = 2.0 * max(1, size >> 20) * (1 << 20)
    return moved / max((t1 - t0) + (t3 - t2), 1e-9)


DEVICE_POLICIES: Final = ("auto", "cpu", "cuda")
"""A job's `device` setting: "auto" puts each stage on its machine's first usable accelerator
and on the CPU of a machine without one (or whose accelerators fail); "cpu" trains on CPUs
only; "cuda" only on machines with a usable CUDA device (never falling back to a CPU)."""

BF16_RATE_CLASSES: Final = ("matmul", SMALL_MATMUL, TINY_MATMUL, "attention", "conv")
"""The op classes whose rate a bf16 or fp16 job takes from that dtype's matmul rate (the rest
run in float32 under autocast, or are bound by memory and dispatch)."""


def stage_device(profile: NodeProfile, policy: str = "auto") -> str | None:
    """The torch device a stage placed on this machine computes on under the job's `device`
    policy (`DEVICE_POLICIES`): "cpu", the first usable accelerator ("cuda:0"), or None where
    the policy leaves this machine out (a "cuda" job on a machine without a usable one)."""
    if policy not in DEVICE_POLICIES:
        raise ValueError(f"device policy {policy!r} is not one of {list(DEVICE_POLICIES)}")
    if policy == "cpu":
        return "cpu"
    usable = [d for d in profile.devices if d.usable]
    if usable:
        return usable[0].device
    return None if policy == "cuda" else "cpu"


def at_precision(flops: Mapping[str, float], matmul16: Mapping[str, float], precision: str
                 ) -> dict[str, float]:
    """Op-class rates for a job's compute precision: a bf16 (fp16) job's matmul-class ops run
    at the measured bf16 (fp16) matmul rate `matmul16[precision]` over the fp32 one
    (`BF16_RATE_CLASSES`; on a CPU without 16-bit units that ratio is below 1, and the planner
    should see it); unchanged for fp32 or where that rate was not measured."""
    out = dict(flops)
    fp32 = out.get("matmul", 0.0)
    rate16 = matmul16.get(precision, 0.0)
    if precision == "fp32" or not (rate16 > 0 and math.isfinite(rate16)) or fp32 <= 0:
        return out
    ratio = rate16 / fp32
    for c in BF16_RATE_CLASSES:
        if c in out:
            out[c] = out[c] * ratio
    return out


def device_memory_bytes(profile: NodeProfile, device: str) -> float | None:
    """The memory a stage on `device` of this machine may use (the accelerator's free memory
    when profiled, else its total), or None for the CPU (the host's memory)."""
    for d in profile.devices:
        if d.device == device:
            return float(d.free_bytes or d.memory_bytes)
    return None


def machine_from_profile(node_id: str, profile: NodeProfile, memory_bytes: float, *,
                         device: str = "cpu", precision: str = "fp32"
                         ) -> MachineProfile | None:
    """The planner's view of a node from its gossiped profile, or None when the profile
    carries no calibration (an older daemon, or one started without benchmark). `device`
    (`stage_device`): "cpu" prices stages at the CPU's rates (`planner_fields`), an
    accelerator ("cuda:0") at that device's own rates and memory; the transport's and the
    wake-up's costs are the host's either way. `precision` picks the matmul rates
    (`at_precision`)."""
    if device != "cpu":
        dev = next((d for d in profile.devices if d.device == device and d.usable), None)
        if dev is None:
            return None
        return MachineProfile(
            id=node_id, flops=at_precision({c: r for c, r in dev.flop_per_s.items() if r > 0},
                                           {"bf16": dev.matmul_bf16_flop_per_s,
                                            "fp16": dev.matmul_fp16_flop_per_s}, precision),
            mem_bw=max(dev.mem_bw_bytes_per_s, 1.0), op_overhead_s=max(0.0, dev.op_overhead_s),
            memory_bytes=max(float(dev.free_bytes or dev.memory_bytes), 1.0),
            kind=dev.name or dev.device, device=dev.device, **_host_costs(profile))
    rates = {c: float(getattr(profile, key)) for c, key in PLAN_FIELDS.items()}
    flops = {c: r for c, r in rates.items() if r > 0}
    if "other" not in flops or profile.plan_mem_bw <= 0:
        return None
    return MachineProfile(id=node_id,
                          flops=at_precision(flops, {"bf16": profile.plan_matmul_bf16_flop_per_s,
                                                     "fp16": profile.plan_matmul_fp16_flop_per_s},
                                             precision),
                          mem_bw=profile.plan_mem_bw,
                          op_overhead_s=max(0.0, profile.plan_op_overhead_s),
                          memory_bytes=max(memory_bytes, 1.0),
                          kind="cpu", **_host_costs(profile))


class _HostCosts(TypedDict):
    wire_s_per_byte: float
    msg_s: float
    wake_s: float
    disk_bytes_per_s: float
    disk_free_bytes: float


def _host_costs(profile: NodeProfile) -> _HostCosts:
    """What a stage costs its host whatever device computes: the transport's CPU per byte
    and per message, the wake-up latency, the disk's rate and room (bounded as gossiped
    figures must be)."""
    disk = float(profile.plan_disk_bytes_per_s)
    return {"wire_s_per_byte": max(0.0, profile.plan_wire_s_per_byte),
            "msg_s": max(0.0, profile.plan_msg_s),
            "wake_s": min(max(0.0, profile.plan_wake_s), MAX_WAKE_S),
            "disk_bytes_per_s": disk if math.isfinite(disk) and disk > 0 else 0.0,
            "disk_free_bytes": float(max(0, profile.disk_free_bytes))}


def compute_profile(cache_dir: str | Path | None, *, benchmark: bool = True,
                    gpus: frozenset[int] | None = None) -> NodeProfile:
    """The static part of the profile, with the benchmarks cached in `cache_dir` when given.

    `benchmark` False skips importing torch altogether (device probing, the matmul and the
    planner's calibration): the profile then reports the CPU with ``gflops`` 0. Tests that
    start many daemons use it. On a CPU the cache holds rates per CPU second; the allowance
    (`cpu_allowance`) is read again on every start, so a changed quota needs no re-measuring.
    Keys: ``gflops`` (sustained matmul GFLOP/s at the allowance), ``gflops_per_cpu_s``,
    ``threads``, ``cpu_cores`` (allowed), ``cpu_quota_cores`` (0: none seen),
    ``cpu_quota_period_s`` (its CFS period; 0: none), ``cpu_limit`` (where the binding limit
    comes from) and the `planner_fields`. `gpus`: the CUDA devices this daemon owns and
    offers (config `gpus`; None: all).
    """
    allowance = cpu_allowance()
    info = _cpu_info()
    prof: dict[str, Any] = {
        **info,
        "torch_version": _torch_version(),
        "protocol_version": protocol.PROTOCOL_VERSION,
        "fusiond_version": fusiond.__version__,
        "python_version": platform.python_version(),
        "cpu_count": os.cpu_count() or 1,
        "memory_bytes": _total_memory_bytes(),
        "cpu_cores": allowance.cores,
        "cpu_quota_cores": allowance.quota_cores or 0.0,
        "cpu_quota_period_s": allowance.period_s or 0.0,
        "cpu_limit": allowance.source,
        "gflops": 0.0,
    }
    if not benchmark:
        return NodeProfile(**prof)
    import torch

    from fusiond.profile.calibrate import at_allowance, matmul_rate, measure

    kind = "cpu"  # the plan_* rates are the CPU's; accelerators have their own (`devices`)
    threads = torch.get_num_threads()
    key = (f"v{CACHE_VERSION}|{kind}|{info['device_name']}|{prof['torch_version']}|{BENCH_N}"
           f"|{threads}t")
    cache = Path(cache_dir) / "profile.json" if cache_dir else None
    data: dict[str, Any] | None = None
    if cache is not None:
        try:
            data = json.loads(cache.read_text())
            if not isinstance(data, dict) or data.get("key") != key:
                data = None
        except (OSError, ValueError):
            data = None  # no cache yet, or a corrupt one: measure again
    try:
        raw = _raw_benchmarks(data, kind) if data is not None else None
    except (KeyError, TypeError, ValueError, PlanError):
        raw = None  # an older or damaged cache
    if raw is None:
        dev = "cuda" if kind == "cuda" else "cpu"
        multi = kind == "cpu" and threads > 1
        raw_machine = dataclasses.replace(measure("local", device=dev),
                                          msg_s=transport_message_s())
        data = {"key": key, "gflops": matmul_gflops(kind),
                "machine": raw_machine.to_dict(),
                "matmul_bf16": matmul_rate("cpu", torch.bfloat16),
                "matmul_fp16": matmul_rate("cpu", torch.float16),
                "gflops_wall": matmul_gflops(kind, per_cpu_second=False) if multi else None,
                "machine_wall": measure("local", device=dev, per_cpu_second=False).to_dict()
                if multi else None}
        raw = _raw_benchmarks(data, kind)
        # the benchmarks' freed tensors stay resident in the C heap otherwise (measured: 75
        # MiB after the calibration, 38 of them for good: torch's own, first matmul on)
        trim_heap()
        if cache is not None:
            try:
                cache.parent.mkdir(parents=True, exist_ok=True)
                durable.write_bytes(cache, json.dumps(data).encode(), mode=0o644)
            except OSError as e:
                log.warning("cannot cache the profile benchmark in %s: %s", cache, e)
    if cache is not None and data is not None and "disk_bytes_per_s" not in data:
        data["disk_bytes_per_s"] = disk_bytes_per_s(cache.parent)
        try:
            durable.write_bytes(cache, json.dumps(data).encode(), mode=0o644)
        except OSError as e:
            log.warning("cannot cache the disk rate in %s: %s", cache, e)
    disk = float((data or {}).get("disk_bytes_per_s") or 0.0)
    gflops, machine, gflops_wall, machine_wall = raw
    raw_matmul = machine.flops.get("matmul", 0.0)  # per CPU second of one thread, as below
    prof["threads"] = threads
    if kind == "cpu":
        prof["gflops_per_cpu_s"] = round(gflops, 2)
        gflops = sustained(gflops, threads, allowance.cores)
        if gflops_wall is not None:
            gflops = min(gflops, gflops_wall)
        machine = at_allowance(machine, threads, allowance.cores, machine_wall)
    # a quota delays every wake-up of this host's threads, whatever the device
    machine = dataclasses.replace(machine, wake_s=allowance.wake_s(threads),
                                  disk_bytes_per_s=disk if math.isfinite(disk) and disk > 0
                                  else 0.0)
    prof["gflops"] = round(gflops, 2)
    prof.update(planner_fields(machine))
    for dtype in ("bf16", "fp16"):
        # its ratio to float32 per CPU second of one thread, applied to the float32 rate the
        # planner uses (sustained, and capped by the wall-clock rate at `threads`)
        rate = float((data or {}).get(f"matmul_{dtype}") or 0.0)
        if rate > 0 and math.isfinite(rate) and raw_matmul > 0:
            prof[f"plan_matmul_{dtype}_flop_per_s"] = (machine.flops.get("matmul", 0.0)
                                                  * rate / raw_matmul)
    prof.update(_accelerators(cache, prof["torch_version"], gpus))
    return NodeProfile(**prof)


def _accelerators(cache: Path | None, torch_version: str,
                  gpus: frozenset[int] | None = None) -> dict[str, Any]:
    """The profile keys of this machine's CUDA devices (`fusiond.profile.devices`): each
    measured on itself once per (devices, torch) and cached beside the CPU's figures; the
    default device's kind, name and memory where one is usable; the driver's error where it
    fails. Nothing where there is no CUDA (which is then never initialised), or where the
    daemon owns none of it (`gpus` empty)."""
    from fusiond.profile import devices as dv

    if gpus is not None and not gpus:
        return {"device_error": ""}
    found, error = dv.find_cuda(owned=gpus)  # another daemon may own the rest
    out: dict[str, Any] = {"device_error": error}
    if not found:
        return out
    key = (f"v{CACHE_VERSION}|{torch_version}|"
           + ",".join(f"{f.index}:{f.name}:{f.memory_bytes}" for f in found))
    path = cache.parent / "devices.json" if cache is not None else None
    measured: tuple[DeviceProfile, ...] | None = None
    if path is not None:
        try:
            got = json.loads(path.read_text())
            if isinstance(got, dict) and got.get("key") == key:
                measured = dv.devices_from_cache(got.get("devices"))
        except (OSError, ValueError):
            measured = None
    if measured is None or len(measured) != len(found):
        measured = tuple(dv.measure_device(f) for f in found)
        if path is not None:
            try:
                durable.write_bytes(path, json.dumps(
                    {"key": key, "devices": dv.devices_to_cache(measured)}).encode(),
                    mode=0o644)
            except OSError as e:
                log.warning("cannot cache the devices' calibration in %s: %s", path, e)
    measured = dv.with_free_memory(measured, found)
    out["devices"] = measured
    usable = [d for d in measured if d.usable]
    if usable:
        first = usable[0]
        out.update(device_kind=first.kind, device_name=first.name,
                   device_memory_bytes=first.memory_bytes, device_free_bytes=first.free_bytes,
                   device_count=len(found))
    elif not error:
        out["device_error"] = measured[0].error if measured else ""
    return out


def _raw_benchmarks(data: Mapping[str, Any], kind: str
                    ) -> tuple[float, MachineProfile, float | None, MachineProfile | None]:
    """(matmul GFLOP/s, calibration) per CPU second on one thread (per wall second on a GPU),
    and the wall-clock ones at the thread count where that is > 1, from the cache's dict."""
    gw, mw = data.get("gflops_wall"), data.get("machine_wall")
    return (float(data["gflops"]), MachineProfile.from_dict(data["machine"]),
            float(gw) if gw is not None else None,
            MachineProfile.from_dict(mw) if mw is not None and kind == "cpu" else None)


def op_set_fields(disabled: Iterable[str] = ()) -> tuple[OpSet, dict[str, Any]]:
    """This node's op set (its torch's registry less `disabled`) and the profile keys that
    carry it: ``ops_digest`` (sha256 of the sorted names), ``ops_count``, ``ops_disabled``.
    Imports torch (seconds): call it in a thread."""
    from fusiond.graph.registry import op_set

    ops = op_set(disabled)
    return ops, ops.profile_fields()


SOFTWARE_KEYS = ("torch_version", "python_version", "fusiond_version", "protocol_version")
"""NodeProfile fields of the software a node runs."""

MIXED_TORCH_WARNING = ("members run different torch versions ({versions}): a graph is "
                       "captured with the submitter's torch and runs on the others'; the "
                       "planner places each stage only where every op of it runs")


def software_summary(members: Iterable[Any]) -> dict[str, Any]:
    """What `fusionctl status` shows about the software of the members (each a
    `fusiond.cluster.MemberView`: ``node_id``, ``state``, a `NodeProfile` ``profile``): per
    node its torch, Python, fusiond and protocol versions and op set (digest, size, disabled
    ops; null where the member gossips none); the torch versions of the members that are not
    dead or gone, and a warning when they differ."""
    nodes: list[dict[str, Any]] = []
    torch_of: dict[str, list[str]] = {}
    for m in members:
        prof: NodeProfile = m.profile
        node_id = str(m.node_id)
        row: dict[str, Any] = {"node_id": node_id, "state": m.state}
        for key in SOFTWARE_KEYS:
            v = getattr(prof, key)
            row[key.removesuffix("_version")] = str(v) if v else None
        row["ops_digest"] = prof.ops_digest or None
        row["ops_count"] = prof.ops_count if prof.ops_digest else None
        row["ops_disabled"] = list(prof.ops_disabled[:64])
        nodes.append(row)
        if m.state not in ("dead", "left") and row["torch"] is not None:
            torch_of.setdefault(row["torch"], []).append(node_id)
    mixed = len(torch_of) > 1
    versions = "; ".join(f"{v} on {', '.join(sorted(ids))}" for v, ids in sorted(torch_of.items()))
    return {"nodes": sorted(nodes, key=lambda r: r["node_id"]),
            "torch_versions": {v: sorted(ids) for v, ids in sorted(torch_of.items())},
            "mixed_torch": mixed,
            "warning": MIXED_TORCH_WARNING.format(versions=versions) if mixed else None}


def disk_free_bytes(directory: Path) -> int:
    """Free bytes (for this user) of the filesystem holding `directory`; 0 when it cannot be
    read."""
    try:
        return int(shutil.disk_usage(directory).free)
    except OSError as e:
        log.warning("cannot read the free space under %s: %s", directory, e)
        return 0


class Profiler:
    """Holds the static profile; `__call__` adds what changes (free memory, and the free disk
    under `disk_dir`, where stages keep what the planner puts on disk) each time."""

    def __init__(self, static: NodeProfile, disk_dir: Path | None = None) -> None:
        self.static = static
        self.disk_dir = disk_dir

    def update(self, **fields: Any) -> None:
        """Set fields of the static profile (e.g. the op set's, `OpSet.profile_fields`)."""
        if isinstance(fields.get("ops_disabled"), list):
            fields["ops_disabled"] = tuple(fields["ops_disabled"])
        self.static = dataclasses.replace(self.static, **fields)

    def __call__(self) -> NodeProfile:
        disk = disk_free_bytes(self.disk_dir) if self.disk_dir is not None else 0
        return dataclasses.replace(self.static, free_memory_bytes=free_memory_bytes(),
                                   disk_free_bytes=disk)
