"""Calibration: time representative ops on this machine -> a `MachineProfile`.

It measures this node for the planner (`fusiond.plan`, which stays pure: no torch, no clocks),
so it lives with the rest of the node's profile. The daemon calls it once and gossips
`profile.to_dict()`. Each measurement matches a rule of the estimator (`fusiond.plan.estimator`,
whose FLOP counts it uses), so the two agree on units:

- "matmul": forward + backward of a transformer-shaped linear layer, at three sizes
  (`fusiond.plan.model.MATMUL_SHAPES`: a GPT-2 small projection over 1024 tokens, and
  "matmul_small" and "matmul_tiny", a 256- and a 32-wide model's over 256): a small product
  runs at a fraction of a big one's rate per FLOP, and the planner interpolates between them
  by each product's size;
- "conv": a 3x3 convolution;
- "attention": forward + backward of scaled dot-product attention at a GPT-2-like head shape
  (its small per-head products run at a fraction of a big matmul's rate: 2x slower on the
  machine this was written on);
- "other": forward + backward of the nonlinear ops that fill a network between its products
  (GELU in both forms, SiLU, layer norm, softmax), at the estimator's FLOPs per element. One
  synthetic GELU on a large tensor, which this used to time, ran 3-7x faster than these ops do
  in a model (erf GELU vectorises well; the tanh form, norms and softmax do not), so the
  planner saw every host's non-matmul work 3x too cheap;
- the memory bandwidth (a large add: 3 x 4 bytes per element), a loopback round trip of a
  tensor through the transport's cipher (its CPU per byte), and a chain of tiny ops with
  autograd forward and backward (the fixed cost per kernel dispatch, which dominates small
  graphs on a CPU).

Each time is the median of `repeats` runs after a warm-up (the sustained speed, not the
luckiest run). On a CPU every time is CPU time of this process (`time.thread_time`), not
wall-clock: a benchmark of milliseconds under a CFS quota runs inside the first period at full
speed, and other tenants' load would bend wall-clock times either way. `calibrate` then scales
the rates per CPU second to the cores this process may really use
(`fusiond.profile.cpu_allowance`: cgroup quota, affinity) with `scale_machine`, so the
planner's compute time of a stage is its work over the speed at the host's real CPU share (see
`fusiond.profile` for the contract). `bench/plan_accuracy.py` checks the result against
measured partitions of GPT-2.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from fusiond.plan.estimator import (
    NORM_FLOPS_PER_ELEMENT,
    SOFTMAX_FLOPS_PER_ELEMENT,
    attention_flops,
    elementwise_flops_per_element,
)
from fusiond.plan.model import (
    MATMUL_SHAPES,
    SMALL_MATMUL,
    TINY_MATMUL,
    MachineProfile,
    matmul_flops_per_call,
    scale_machine,
    slower_of,
)


def _median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None],
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """The median of `repeats` timed runs of `fn` after one warm-up (allocator, kernels,
    caches)."""
    fn()
    sync()
    times = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    times.sort()
    return max(times[len(times) // 2], 1e-9)


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
    cpu_cores: float | None = None,
) -> MachineProfile:
    """This machine's sustained speed as the planner should see it (about a second of CPU on
    one core; `scale` < 1 shrinks the problem sizes for tests). The thread count is whatever
    torch is set to. On a CPU: `measure` per CPU second on one thread, scaled to `cpu_cores`
    (default: this process's `cpu_allowance().cores`) by `at_allowance`, and with more than
    one thread capped by the wall-clock rates at that thread count."""
    kw: dict[str, Any] = {"device": device, "repeats": repeats, "scale": scale,
                          "memory_bytes": memory_bytes}
    if not device.startswith("cpu"):
        return measure(machine_id, **kw)
    import torch

    if cpu_cores is None:
        from fusiond.profile import cpu_allowance

        cpu_cores = cpu_allowance().cores
    threads = torch.get_num_threads()
    raw = measure(machine_id, per_cpu_second=True, **kw)
    wall = measure(machine_id, per_cpu_second=False, **kw) if threads > 1 else None
    return at_allowance(raw, threads, cpu_cores, wall)


def at_allowance(raw: MachineProfile, threads: int, cpu_cores: float,
                 wall: MachineProfile | None = None) -> MachineProfile:
    """A one-thread calibration per CPU second -> what `threads` threads sustain on
    `cpu_cores` cores: rates x min(threads, cores), the one-thread dispatch cost /
    min(1, cores); never faster than `wall` (the wall-clock rates at `threads` threads, where
    measured: threads rarely scale perfectly)."""
    cores = max(cpu_cores, 1e-3)
    out = scale_machine(raw, parallel=min(float(max(1, threads)), cores),
                        serial=min(1.0, cores), note=f"{cores:.3g}c")
    return out if wall is None else slower_of(out, wall)


def measure(
    machine_id: str = "local",
    *,
    device: str = "cpu",
    repeats: int = 3,
    scale: float = 1.0,
    memory_bytes: float | None = None,
    per_cpu_second: bool | None = None,
) -> MachineProfile:
    """The raw calibration. `per_cpu_second` (default: on a CPU): one torch thread, timed in
    CPU time of the calling thread (`time.thread_time`: exact for it, while the accounting of
    other threads' in-flight CPU time lags), so no quota or neighbour changes it and
    `at_allowance` makes it sustained. Otherwise wall-clock time at torch's thread count."""
    import torch

    dev = torch.device(device)
    cpu_s = dev.type == "cpu" if per_cpu_second is None else per_cpu_second
    if cpu_s and dev.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _measure(machine_id, dev, repeats, scale, memory_bytes, time.thread_time)
        finally:
            torch.set_num_threads(threads)
    return _measure(machine_id, dev, repeats, scale, memory_bytes, time.perf_counter)


def _measure(machine_id: str, dev: Any, repeats: int, scale: float,
             memory_bytes: float | None, clock: Callable[[], float]) -> MachineProfile:
    import torch

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(fn: Callable[[], object]) -> float:
        return _median_time(fn, repeats, sync, clock)

    # Each benchmark's tensors live in its own function, so they are freed before the next:
    # the calibration's memory stays small (a daemon under a tight limit runs it).

    def matmul(shape: tuple[int, int, int]) -> float:
        # forward + backward of a transformer-shaped linear layer, so the transposed products
        # of backward are in the rate (6 FLOPs per multiply-add triple)
        m, k, nout = (max(16, int(d * scale)) for d in shape)
        a = torch.randn(m, k, device=dev, requires_grad=True)
        w = torch.randn(nout, k, device=dev, requires_grad=True)
        go = torch.randn(m, nout, device=dev)

        def linear_fb() -> None:
            torch.nn.functional.linear(a, w).backward(go)  # type: ignore[no-untyped-call]

        return matmul_flops_per_call((m, k, nout)) / timed(linear_fb)

    def conv() -> float:
        c = max(8, int(64 * scale))
        x = torch.randn(4, c, 28, 28, device=dev)
        wc = torch.randn(c, c, 3, 3, device=dev)
        return 2.0 * (4 * c * 28 * 28) * c * 9 / timed(
            lambda: torch.nn.functional.conv2d(x, wc, padding=1))

    def bandwidth() -> float:
        # twice the last-level cache of most CPUs (48 MiB in all), written into one buffer
        # (no allocation per repeat): the rate is memory's, and the peak stays at 3 vectors
        n = max(1 << 16, int((1 << 22) * scale))
        u = torch.randn(n, device=dev)
        v = torch.randn(n, device=dev)
        out = torch.empty(n, device=dev)
        return 12.0 * n / timed(lambda: torch.add(u, v, out=out))

    def attention() -> float:
        # GPT-2's head shape (64 per head), 4 sequences x 4 heads of 128 tokens (/ scale)
        seq = max(16, int(128 * scale))
        lead = 16
        q, k, v = (torch.randn(4, 4, seq, 64, device=dev, requires_grad=True)
                   for _ in range(3))
        go = torch.randn(4, 4, seq, 64, device=dev)

        def sdpa_fb() -> None:
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True).backward(go)  # type: ignore[no-untyped-call]

        f, b = attention_flops(lead, seq, seq, 64, 64)
        return (f + b) / timed(sdpa_fb)

    def nonlinear() -> float:
        # the ops between a network's products, forward + backward each, on 256 tokens x 1024
        # features (a GPT-2 small MLP's hidden width / 3; / scale): what they take over the
        # FLOPs the estimator charges them
        rows = max(16, int(256 * scale))
        x = torch.randn(rows, 1024, device=dev, requires_grad=True)
        go = torch.randn(rows, 1024, device=dev)
        f = torch.nn.functional
        ops: list[tuple[Callable[[Any], Any], tuple[float, float]]] = [
            (lambda t: f.gelu(t, approximate="tanh"), elementwise_flops_per_element("gelu")),
            (f.gelu, elementwise_flops_per_element("gelu")),
            (f.silu, elementwise_flops_per_element("silu")),
            (lambda t: f.layer_norm(t, (1024,)), NORM_FLOPS_PER_ELEMENT),
            (lambda t: f.softmax(t, -1), SOFTMAX_FLOPS_PER_ELEMENT),
        ]

        def run() -> None:
            for op, _ in ops:
                op(x).backward(go)

        per_element = sum(fw + bw for _, (fw, bw) in ops)
        return per_element * x.numel() / timed(run)

    mm_rate = matmul(MATMUL_SHAPES["matmul"])
    mm_small_rate = matmul(MATMUL_SHAPES[SMALL_MATMUL])
    mm_tiny_rate = matmul(MATMUL_SHAPES[TINY_MATMUL])
    attention_rate = attention()
    other_rate = nonlinear()
    with torch.no_grad():
        conv_rate = conv()
        mem_bw = bandwidth()

    overhead = dispatch_cost_s(dev, timed)
    wire_bytes = max(1 << 20, int((1 << 22) * scale))
    wire = timed(_wire_round_trip(wire_bytes))
    return MachineProfile(
        id=machine_id,
        flops={"matmul": mm_rate, SMALL_MATMUL: mm_small_rate, TINY_MATMUL: mm_tiny_rate,
               "conv": conv_rate, "attention": attention_rate, "other": other_rate},
        mem_bw=mem_bw,
        op_overhead_s=overhead,
        memory_bytes=memory_bytes if memory_bytes is not None else _total_memory(str(dev)),
        kind=f"{dev.type}:{torch.get_num_threads()}t" if dev.type == "cpu" else str(dev),
        wire_s_per_byte=wire / wire_bytes / 2,
    )


DISPATCH_BLOCKS = 20
"""Blocks of the dispatch benchmark (`dispatch_cost_s`)."""
DISPATCH_LAUNCHES_PER_BLOCK = 24
"""Launches of one block, forward + backward, counted as the estimator counts them
(`fusiond.plan.estimator`): a linear and a layer norm 1 + 2 each, the GELU, the softmax and
the residual add 1 + 1 each, four views 1 + 1 each, and one gradient accumulation for each of
the block's own four parameters."""


def dispatch_cost_s(dev: Any, timed: Callable[[Callable[[], object]], float]) -> float:
    """The fixed cost of one kernel launch, forward and backward: `DISPATCH_BLOCKS`
    transformer-like blocks (linear, layer norm, GELU, head-split views, softmax, residual
    add) on tensors of 64 elements, where every op's work is nil, over the launches the
    estimator counts for them. A chain of one cheap op (which this used to time) dispatches
    faster than a model's mix does: 5.8 against 8.2 us per launch on the machine this was
    written on, and the model's small stages paid the difference unpredicted."""
    import torch

    f = torch.nn.functional
    width = 8
    # each block its own parameters, as a model's blocks have: one gradient accumulation per
    # parameter (shared ones would add autograd's sums of their uses, which no model has)
    params = [(torch.randn(width, width, device=dev, requires_grad=True),
               torch.zeros(width, device=dev, requires_grad=True),
               torch.ones(width, device=dev, requires_grad=True),
               torch.zeros(width, device=dev, requires_grad=True))
              for _ in range(DISPATCH_BLOCKS)]
    x = torch.randn(2, 4, width, device=dev, requires_grad=True)

    def blocks() -> None:
        h = x
        for w, b, g, beta in params:
            y = f.layer_norm(f.linear(h, w, b), (width,), g, beta)
            y = f.gelu(y, approximate="tanh").view(2, 4, 2, width // 2).transpose(1, 2)
            y = torch.softmax(y, -1).transpose(1, 2).reshape(2, 4, width)
            h = h + y
        h.sum().backward()  # type: ignore[no-untyped-call]

    launches = DISPATCH_BLOCKS * DISPATCH_LAUNCHES_PER_BLOCK + 2  # and the loss's sum
    return timed(blocks) / launches


def _wire_round_trip(nbytes: int) -> Callable[[], None]:
    """One tensor of `nbytes` through what a stage's cut edge costs its hosts' CPU: the
    tensor's bytes, AES-GCM in 16 kB records (TLS 1.3's record layer), a loopback TCP socket
    (the kernel's copies; a socket pair where no loopback is up), decryption and a tensor
    again. Both ends run here, so half of its time is one side's cost per byte."""
    import socket

    import torch
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aes = AESGCM(bytes(32))
    nonce = bytes(12)  # a benchmark, not a channel: the key never protects anything
    src = torch.randn(nbytes // 4)
    record = 1 << 14

    def connect() -> tuple[socket.socket, socket.socket]:
        try:
            with socket.create_server(("127.0.0.1", 0)) as srv:
                a = socket.create_connection(srv.getsockname()[:2], timeout=5)
                b, _ = srv.accept()
                return a, b
        except OSError:
            return socket.socketpair()

    def run() -> None:
        a, b = connect()
        try:
            data = src.numpy().tobytes()
            view = memoryview(data)
            out = bytearray()
            for off in range(0, len(data), record):
                sealed = aes.encrypt(nonce, view[off:off + record], None)
                a.sendall(sealed)
                got = bytearray()
                while len(got) < len(sealed):
                    got += b.recv(len(sealed) - len(got))
                out += aes.decrypt(nonce, bytes(got), None)
            torch.frombuffer(out, dtype=torch.float32).clone()
        finally:
            a.close()
            b.close()

    return run


def matmul_rate(device: str = "cpu", dtype: Any = None, *, repeats: int = 3, scale: float = 1.0,
                per_cpu_second: bool | None = None) -> float:
    """FLOP per second of forward + backward of the calibration's largest linear product
    (`MATMUL_SHAPES["matmul"]`) in `dtype` (default float32) on `device`: the "matmul" rate
    of `measure`, at another dtype. On a CPU (by default) per CPU second of one thread, as
    `measure`; bfloat16 there may well be slower than float32 (no native bf16 units), and
    the planner should see that."""
    import torch

    dev = torch.device(device)
    dt = dtype if dtype is not None else torch.float32
    cpu_s = dev.type == "cpu" if per_cpu_second is None else per_cpu_second and dev.type == "cpu"
    clock = time.thread_time if cpu_s else time.perf_counter
    m, k, nout = (max(16, int(d * scale)) for d in MATMUL_SHAPES["matmul"])

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    threads = torch.get_num_threads()
    if cpu_s:
        torch.set_num_threads(1)
    try:
        a = torch.randn(m, k, device=dev, dtype=dt, requires_grad=True)
        w = torch.randn(nout, k, device=dev, dtype=dt, requires_grad=True)
        go = torch.randn(m, nout, device=dev, dtype=dt)

        def linear_fb() -> None:
            torch.nn.functional.linear(a, w).backward(go)  # type: ignore[no-untyped-call]

        return matmul_flops_per_call((m, k, nout)) / _median_time(linear_fb, repeats, sync,
                                                                   clock)
    finally:
        torch.set_num_threads(threads)


def copy_rates(device: str, nbytes: int = 64 << 20, repeats: int = 3) -> tuple[float, float]:
    """(host-to-device, device-to-host) bytes per second between pinned host memory and
    `device` (a CUDA device), each the median of `repeats` after a warm-up."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"copy rates are measured between host and an accelerator, not {dev}")
    n = max(1, nbytes // 4)
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    on_dev = torch.empty(n, dtype=torch.float32, device=dev)

    def sync() -> None:
        torch.cuda.synchronize(dev)

    h2d = _median_time(lambda: on_dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _median_time(lambda: host.copy_(on_dev, non_blocking=True), repeats, sync)
    return 4.0 * n / h2d, 4.0 * n / d2h
