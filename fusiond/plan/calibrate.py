"""Calibration: time representative ops on this machine -> a `MachineProfile`.

The only non-pure part of `fusiond.plan` (it runs torch). The daemon calls it once and gossips
`profile.to_dict()`. Each measurement matches a rule of the estimator, so the two agree on
units: a matmul of transformer-like shape (FLOP/s of class "matmul"), a 3x3 convolution
("conv"), GELU on a large tensor at the estimator's 16 FLOPs per element ("other"), a large add
(memory bandwidth: 3 x 4 bytes per element), and a chain of tiny ops with autograd forward and
backward (the fixed cost per kernel dispatch, which dominates small graphs on a CPU).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from fusiond.plan.model import MachineProfile


def _best_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocator, kernels, caches
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _total_memory(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 8.0 * 2**30


def calibrate(
    machine_id: str = "local",
    *,
    device: str = "cpu",
    repeats: int = 3,
    scale: float = 1.0,
    memory_bytes: float | None = None,
) -> MachineProfile:
    """Measure this machine (takes about a second on a CPU core; `scale` < 1 shrinks the
    problem sizes for tests). The thread count is whatever torch is set to."""
    import torch

    dev = torch.device(device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # matmul: forward + backward of a transformer-shaped linear layer, so the transposed
    # products of backward are in the rate (6 FLOPs per multiply-add triple)
    m = max(64, int(1024 * scale))
    k = max(64, int(768 * scale))
    nout = 3 * k
    a = torch.randn(m, k, device=dev, requires_grad=True)
    w = torch.randn(nout, k, device=dev, requires_grad=True)
    go = torch.randn(m, nout, device=dev)

    def linear_fb() -> None:
        torch.nn.functional.linear(a, w).backward(go)  # type: ignore[no-untyped-call]

    t_mm = _best_time(linear_fb, repeats, sync)
    mm_rate = 6.0 * m * k * nout / t_mm

    with torch.no_grad():
        c = max(8, int(64 * scale))
        x = torch.randn(4, c, 28, 28, device=dev)
        wc = torch.randn(c, c, 3, 3, device=dev)
        t_conv = _best_time(lambda: torch.nn.functional.conv2d(x, wc, padding=1), repeats, sync)
        conv_rate = 2.0 * (4 * c * 28 * 28) * c * 9 / t_conv

        n = max(1 << 16, int((1 << 23) * scale))
        u = torch.randn(n, device=dev)
        v = torch.randn(n, device=dev)
        t_add = _best_time(lambda: u + v, repeats, sync)
        mem_bw = 12.0 * n / t_add
        t_gelu = _best_time(lambda: torch.nn.functional.gelu(u), repeats, sync)
        # GELU is partly memory bound: what is left after the traffic is the FLOP rate
        compute = max(t_gelu - 8.0 * n / mem_bw, t_gelu * 0.25)
        other_rate = 16.0 * n / compute

    chain = 100
    leaf = torch.ones(4, device=dev, requires_grad=True)

    def tiny() -> None:
        y = leaf
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()  # type: ignore[no-untyped-call]

    t_tiny = _best_time(tiny, repeats, sync)
    overhead = t_tiny / (2 * chain + 2)
    return MachineProfile(
        id=machine_id,
        flops={"matmul": mm_rate, "conv": conv_rate, "other": other_rate},
        mem_bw=mem_bw,
        op_overhead_s=overhead,
        memory_bytes=memory_bytes if memory_bytes is not None else _total_memory(device),
        kind=f"{dev.type}:{torch.get_num_threads()}t" if dev.type == "cpu" else str(dev),
    )
