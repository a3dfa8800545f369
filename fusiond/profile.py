"""What this node can do: device, memory, measured compute speed, versions.

The profile is gossiped to every member (the election ranks on it and the planner sizes
partitions with it), so it is a plain JSON-able dict of str/int/float values. Computing it is
cheap except the matmul benchmark, which runs once and is cached by (device, torch version) in
the cache directory; `free_memory_bytes` is re-read every time the profile is asked for.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import fusiond
import protocol

log = logging.getLogger("fusiond.profile")

BENCH_N = 512
"""Matrix size of the benchmark: big enough to be compute bound, small enough to take ~10 ms."""
BENCH_REPEATS = 5


def _total_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def free_memory_bytes() -> int:
    """Available memory now (MemAvailable on Linux; 0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 0


def device_info() -> dict[str, Any]:
    """Device kind ("cuda" or "cpu"), name and memory of the device training would use."""
    import torch

    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        free, total = torch.cuda.mem_get_info(idx)
        return {"device_kind": "cuda", "device_name": str(props.name),
                "device_memory_bytes": int(total), "device_free_bytes": int(free),
                "device_count": int(torch.cuda.device_count())}
    return _cpu_info()


def matmul_gflops(device_kind: str = "cpu", n: int = BENCH_N, repeats: int = BENCH_REPEATS
                  ) -> float:
    """Measured float32 matmul throughput in GFLOP/s (best of `repeats`, after a warm-up)."""
    import torch

    dev = torch.device("cuda" if device_kind == "cuda" else "cpu")
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
    if dev.type == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
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


def compute_profile(cache_dir: str | Path | None, *, benchmark: bool = True) -> dict[str, Any]:
    """The static part of the profile, with the benchmark cached in `cache_dir` when given.

    `benchmark` False skips importing torch altogether (device probing and the matmul): the
    profile then reports the CPU with ``gflops`` 0. Tests that start many daemons use it.
    """
    info = device_info() if benchmark else _cpu_info()
    prof: dict[str, Any] = {
        **info,
        "torch_version": _torch_version(),
        "protocol_version": protocol.PROTOCOL_VERSION,
        "fusiond_version": fusiond.__version__,
        "python_version": platform.python_version(),
        "cpu_count": os.cpu_count() or 1,
        "memory_bytes": _total_memory_bytes(),
        "gflops": 0.0,
    }
    if not benchmark:
        return prof
    key = f"{info['device_kind']}|{info['device_name']}|{prof['torch_version']}|{BENCH_N}"
    cache = Path(cache_dir) / "profile.json" if cache_dir else None
    if cache is not None:
        try:
            data = json.loads(cache.read_text())
            if data.get("key") == key and isinstance(data.get("gflops"), int | float):
                prof["gflops"] = float(data["gflops"])
                return prof
        except (OSError, ValueError):
            pass  # no cache yet, or a corrupt one: measure again
    gflops = matmul_gflops(info["device_kind"])
    prof["gflops"] = round(gflops, 2)
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": key, "gflops": prof["gflops"]}))
            tmp.replace(cache)
        except OSError as e:
            log.warning("cannot cache the profile benchmark in %s: %s", cache, e)
    return prof


class Profiler:
    """Holds the static profile; `__call__` adds what changes (free memory) each time."""

    def __init__(self, static: dict[str, Any]) -> None:
        self.static = dict(static)

    def __call__(self) -> dict[str, Any]:
        return {**self.static, "free_memory_bytes": free_memory_bytes()}
