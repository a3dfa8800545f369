"""Benchmark: training more than the memory holds (issue 17), every run under a memory limit
the kernel enforces (a memory cgroup, no swap), every figure measured in this run.

Workload: GPT-2 at a fixed width (`--width`, 4 heads, byte vocabulary, `DATA_DIR`),
as deep as asked, batch `--batch` x 64 tokens in `--micro` micro-batches, AdamW. Each run is
a fresh process in its own memory cgroup at `--limit-mib`; it trains `--steps` steps (the
first is warm-up) and reports its step times and its peak memory during training: its
heap and its pages of the training's own files (memory-mapped weights and state), not of
torch's libraries (`AnonPeak`), above what it held before it built the model (Python, torch,
the data, the graph); a process the kernel kills at the limit is reported "out of memory".

Policies (the same model, limit and batches):
- plain: PyTorch eager, the model in memory (what a user runs first);
- ckpt: PyTorch eager with `torch.utils.checkpoint` around every block (non-reentrant);
- ckpt+offload: every block checkpointed and all optimizer state on disk (memory-mapped,
  paged in for the update and dropped after it: ZeRO-Infinity's NVMe offload of the
  optimizer, the static policy a user of a CPU-only machine would set up; DeepSpeed itself is
  not installed here);
- fusion: the captured model as one stage (the stage runtime), with the decisions of fusion's
  memory planner (`fusiond.plan.memory.plan_stage_memory`) for this machine's measured profile
  and the limit less the process's own footprint: which blocks to checkpoint, optimizer
  state and parameters on disk or not. It prints the plan's predicted peak next to the
  measured one.

Table 1: the largest depth each of plain and fusion trains under the limit (plain by doubling
then bisection; fusion checked at the first depth with `--factor` times plain's parameters
and, with `--search`, beyond). Target: fusion trains at least 4x plain's parameters.
Table 2: at one depth that plain cannot train (`--over` times plain's largest), every policy's
step time; target: fusion at least 1.3x the throughput of the best static policy that ran.
Both also print fusion's measured peak against the plan's prediction (target within 10 %).

    python bench/memory.py [--limit-mib 640] [--width 256] [--steps 3] [--quick]

Needs root and a memory cgroup (v1 or v2); exits 2 where there is none.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.testbed.bed import (
    classify_exit,
    detect_memory_cgroup,
    kill_cgroup_processes,
    read_memory_report,
)

POLICIES = ("plain", "ckpt", "ckpt+offload", "fusion")
DATA_DIR = Path(__file__).resolve().parents[1] / "fusiond"
"""The corpus: this project's own source (a few MB; the default corpus, Python's standard
library, is 256 MB of tokens, which every run would hold before its first step)."""
TARGET_PARAMS_RATIO = 4.0
TARGET_SPEEDUP = 1.3
TARGET_PEAK_ERROR = 0.10


# -- the worker (runs inside the cgroup) ------------------------------------------------------

def _spec(width: int, layers: int, batch: int, micro: int, steps: int) -> Any:
    from fusiond.train.spec import parse_job
    return parse_job(f"""
[job]
name = "bench-memory"
steps = {steps}
seed = 0
[model]
zoo = "gpt2"
config = {{ size = "tiny", vocab_size = 256, n_embd = {width}, n_head = 4, n_layer = {layers} }}
[data]
path = "{DATA_DIR}"
seq_len = 64
[optimizer]
lr = 1e-3
[batch]
size = {batch}
micro_batches = {micro}
""")


def params_at(width: int, layers: int) -> int:
    """The model's parameter count at `layers`, built on the meta device (no memory)."""
    import torch

    from fusiond.train.model import build_model
    with torch.device("meta"):
        model = build_model(_spec(width, layers, 8, 2, 3).model, seed=0)
    return sum(p.numel() for p in model.parameters())


def _rss_kib() -> tuple[int, int]:
    """(resident now, peak since the last reset), KiB."""
    now = peak = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            now = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1])
    return now, peak


def _status() -> dict[str, int]:
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {line.split(":")[0]: int(line.split()[1]) // 1024
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.split(":")[0] in keys}


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def _status_kib() -> dict[str, int]:
    return {line.split(":")[0]: int(line.split()[1])
            for line in Path("/proc/self/status").read_text().splitlines()
            if line.split(":")[0] in ("VmHWM", "RssAnon", "RssFile", "RssShmem")}


def mapped_kib(prefix: str) -> int:
    """Resident KiB of this process's mappings of files under `prefix` (/proc/self/smaps)."""
    total = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) == 6 and head[5].startswith(prefix)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


class AnonPeak:
    """The peak of what the training holds resident, KiB, sampled after each task (`sample`):
    the process's anonymous memory (its heap) and its pages of the files under `data_dir`
    (the memory-mapped weights, gradients and optimizer state), not the pages of torch's
    libraries.

    VmHWM, the kernel's peak, also counts those library pages, and a memory cgroup near its
    limit evicts them and faults them back: measured on the same 36-layer fusion run, VmHWM
    rose 263 MiB above its start without a limit and 343 MiB under the 640 MiB one. So the
    peak between two samples is taken as VmHWM less the other file pages mapped at the sample
    (they move little within one task), and the kernel's mark is reset there."""

    def __init__(self, data_dir: Path) -> None:
        self.prefix = str(data_dir.resolve())
        self.base_kib = self._held_kib()
        self.peak_kib = self.base_kib
        self.spent_s = 0.0
        """Seconds the samples took (reading /proc/self/smaps: 10-45 ms each with the state's
        files mapped), which the step times leave out."""

    def _held_kib(self) -> int:
        s = _status_kib()
        return s["RssAnon"] + mapped_kib(self.prefix)

    def sample(self) -> None:
        t0 = time.perf_counter()
        s = _status_kib()
        data = mapped_kib(self.prefix)
        other = s["RssFile"] - data + s.get("RssShmem", 0)
        self.peak_kib = max(self.peak_kib, s["RssAnon"] + data, s["VmHWM"] - other)
        _reset_peak()
        self.spent_s += time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    import torch

    from fusiond.train.data import make_source, split_micro_batches
    from fusiond.train.model import WithLoss, build_model, loss_fn
    from fusiond.train.offload import DiskOptimizerState, trim_heap
    from fusiond.train.optim import lr_at, make_optimizer, set_lr

    spec = _spec(args.width, args.layers, args.batch, args.micro, args.steps)
    data = make_source(spec.data, spec.seed)
    # what the first optimizer imports (torch._dynamo, about 60 MB) is the process's
    # footprint, as in a daemon that has trained before, not training state
    make_optimizer(spec.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    tokens = spec.batch.size * spec.data.seq_len
    out: dict[str, Any] = {"policy": args.worker, "layers": args.layers}
    times: list[float] = []
    losses: list[float] = []
    if args.worker == "fusion":
        run_fusion(args, spec, data, out, times, losses)
    else:
        from torch.utils.checkpoint import checkpoint

        gc.collect()
        anon = AnonPeak(Path(args.scratch).parent)
        model = build_model(spec.model, seed=spec.seed)
        out["params"] = sum(p.numel() for p in model.parameters())
        if args.worker != "plain":
            blocks: Any = model.transformer.h  # type: ignore[union-attr]
            for block in blocks:
                fwd = block.forward
                block.forward = (lambda f: lambda x: checkpoint(f, x, use_reentrant=False))(fwd)
        net = WithLoss(model, loss_fn(spec.loss), None)
        opt = make_optimizer(spec.optimizer, net.parameters())
        disk = (DiskOptimizerState(opt, Path(args.scratch) / "opt")
                if args.worker == "ckpt+offload" else None)
        gc.collect()
        _reset_peak()
        micro = spec.batch.micro_batches
        for s in range(spec.steps):
            # ReferenceTrainer's step, with the C heap trimmed as the stage runtime does
            t0 = time.perf_counter()
            spent = anon.spent_s
            step_losses = []
            for mb in split_micro_batches(data.batch(s, spec.batch.size), micro):
                loss = net.on(mb)
                torch.autograd.backward(loss / micro)
                step_losses.append(float(loss.detach()))
                del loss
                anon.sample()
                trim_heap()
            set_lr(opt, lr_at(spec.optimizer, s, spec.steps))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if disk is not None:
                disk.release()
            anon.sample()
            trim_heap()
            times.append(time.perf_counter() - t0 - (anon.spent_s - spent))
            losses.append(sum(step_losses) / micro)
        if disk is not None:
            disk.close()
        out["base_kib"], out["peak_kib"] = anon.base_kib, anon.peak_kib
    out["step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    out["tokens_per_s"] = tokens / out["step_s"]
    out["losses"] = losses
    out["threads"] = torch.get_num_threads()
    print("RESULT " + json.dumps(out), flush=True)


def run_fusion(args: argparse.Namespace, spec: Any, data: Any, out: dict[str, Any],
               times: list[float], losses: list[float]) -> None:
    import asyncio

    import torch

    from fusiond.graph import contiguous_assignment, partition
    from fusiond.jobs.planning import job_settings
    from fusiond.plan import Cluster, GraphArrays, MachineProfile, batch_symbol, cost_graph_from_ir
    from fusiond.plan.memory import plan_stage_memory, stage_blocks
    from fusiond.train.local import run_pipeline
    from fusiond.train.offload import trim_heap
    from fusiond.train.programs import graph_data_names, stage_program
    from fusiond.train.segments import SegmentPlan
    from fusiond.train.stage import StageConfig
    from protocol import ir

    graph = ir.loads(Path(args.graph).read_bytes())
    machine = MachineProfile.from_dict(json.loads(args.machine))
    sym = batch_symbol(graph)
    cost = cost_graph_from_ir(graph, {sym: spec.batch.micro_batch_size} if sym else {})
    arrays = GraphArrays(cost, Cluster.build([machine], [[1e9]]), job_settings(spec))
    blocks, _ = stage_blocks(arrays, 0, 0, len(cost))
    parts = partition(graph, contiguous_assignment(graph, 1))
    main, targets = graph_data_names(graph)
    gc.collect()
    anon = AnonPeak(Path(args.scratch).parent)  # the weights' file and the stage's files
    # what a daemon offers a job: the limit less its own footprint (all it has resident),
    # measured
    budget = args.limit_mib * 2**20 - _rss_kib()[0] * 1024
    choice = plan_stage_memory(blocks, budget_bytes=budget, micro_batches=spec.batch.micro_batches,
                               inflight=1, disk_bytes_per_s=machine.disk_rate_bytes_per_s,
                               workspace_bytes=float(arrays.out.max()))
    out["plan"] = {"recomputed": choice.recomputed, "blocks": len(blocks),
                   "offload_optimizer": choice.offload_optimizer,
                   "offload_params": choice.offload_params, "fits": choice.fits,
                   "predicted_peak_bytes": choice.peak_bytes, "added_s": choice.added_s,
                   "static_bytes": choice.static_bytes,
                   "activation_bytes": choice.activation_bytes,
                   "workspace_bytes": float(arrays.out.max()),
                   "budget_bytes": budget}
    # the weights as the submitting machine captured them, read from a file on demand
    state = torch.load(args.state, mmap=True, weights_only=True)
    prog = stage_program(parts[0], state, stage_of={parts[0].id: 0}, input_name=main,
                         targets_name=targets, copy=not choice.offload_params,
                         segments=SegmentPlan(tuple(ir.block_starts(parts[0].graph)),
                                              choice.recompute))
    out["params"] = sum(p.numel() for p in prog.module.parameters())
    offload = choice.offload_optimizer or choice.offload_params
    config = StageConfig(offload_dir=Path(args.scratch) / "stage" if offload else None,
                         offload_params=choice.offload_params)
    del state
    last = [time.perf_counter()]

    spent = [0.0]

    def on_executors(_: Any) -> None:
        gc.collect()
        trim_heap()
        if os.environ.get("BENCH_MEMORY_DEBUG"):
            print("at start", _status(), file=sys.stderr)
        _reset_peak()
        last[0] = time.perf_counter()
        spent[0] = anon.spent_s

    def on_step(m: Any) -> None:
        anon.sample()
        now = time.perf_counter()
        times.append(now - last[0] - (anon.spent_s - spent[0]))  # the samples left out
        last[0] = now
        spent[0] = anon.spent_s
        losses.append(m.loss)
        if os.environ.get("BENCH_MEMORY_DEBUG"):
            print("after step", _status(), file=sys.stderr)

    # the peak is sampled after each task and update (`AnonPeak`); BENCH_MEMORY_DEBUG=1
    # prints the memory there too
    from fusiond.train import stage as stage_mod
    debug = bool(os.environ.get("BENCH_MEMORY_DEBUG"))
    for name in ("_forward", "_backward", "_opt_step"):
        real = getattr(stage_mod.StageExecutor, name)

        def wrap(self: Any, *a: Any, real: Any = real, name: str = name, **k: Any) -> Any:
            r = real(self, *a, **k)
            if debug:
                print(name, _status(), "data files", mapped_kib(anon.prefix) // 1024,
                      file=sys.stderr)
            anon.sample()
            return r
        setattr(stage_mod.StageExecutor, name, wrap)
    asyncio.run(run_pipeline([prog], data=data, batch_size=spec.batch.size,
                             micro_batches=spec.batch.micro_batches, optimizer=spec.optimizer,
                             steps=spec.steps, config=config, on_step=on_step,
                             on_executors=on_executors))
    out["base_kib"], out["peak_kib"] = anon.base_kib, anon.peak_kib


# -- the parent -------------------------------------------------------------------------------

@dataclass
class Run:
    policy: str
    layers: int
    outcome: str
    result: dict[str, Any]
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def params(self) -> int:
        return int(self.result.get("params", 0))

    @property
    def peak_bytes(self) -> float:
        return float(self.result["peak_kib"] - self.result["base_kib"]) * 1024.0


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int) -> Iterator[tuple[Path, str]]:
    cg = detect_memory_cgroup()
    if cg.root is None:
        raise SystemExit(2)
    path = cg.root / f"fusion-bench-memory-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    path.mkdir()
    try:
        if cg.kind == "v2":
            (path / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        yield path, cg.kind
    finally:
        kill_cgroup_processes(path)
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                kill_cgroup_processes(path)
                time.sleep(0.1)


class Bench:
    """Runs policies at depths under the limit, each once (cached); `machine` (a
    `MachineProfile` as JSON) is what fusion plans for (None: this machine's measured
    profile)."""

    def __init__(self, args: argparse.Namespace, scratch: Path, machine: str | None = None
                 ) -> None:
        self.args = args
        self.scratch = scratch
        self.cache: dict[tuple[str, int], Run] = {}
        self.machine = machine or self._machine()
        self.footprint_kib = 0

    def _machine(self) -> str:
        from fusiond.profile import compute_profile, machine_from_profile
        prof = compute_profile(self.scratch / "profile")
        m = machine_from_profile("bench", prof, self.args.limit_mib * 2.0**20)
        if m is None:
            raise SystemExit("this machine's profile has no calibration")
        return json.dumps(m.to_dict())

    def _capture(self, layers: int) -> tuple[Path, Path]:
        import torch

        from fusiond.train.programs import capture_job
        from protocol import ir
        a = self.args
        g, s = self.scratch / f"graph-{layers}.ir", self.scratch / f"state-{layers}.pt"
        if not g.exists():
            _, cap = capture_job(_spec(a.width, layers, a.batch, a.micro, a.steps))
            g.write_bytes(ir.dumps(cap.graph))
            torch.save(dict(cap.state), s)
        return g, s

    def run(self, policy: str, layers: int) -> Run:
        key = (policy, layers)
        if key in self.cache:
            return self.cache[key]
        a = self.args
        argv = [sys.executable, __file__, "--worker", policy, "--layers", str(layers),
                "--width", str(a.width), "--batch", str(a.batch), "--micro", str(a.micro),
                "--steps", str(a.steps), "--limit-mib", str(a.limit_mib)]
        work = Path(tempfile.mkdtemp(dir=self.scratch))
        argv += ["--scratch", str(work)]
        if policy == "fusion":
            g, s = self._capture(layers)
            argv += ["--graph", str(g), "--state", str(s), "--machine", self.machine]
        t0 = time.perf_counter()
        with memory_cgroup(a.limit_mib << 20) as (path, kind):
            procs = path / "cgroup.procs"
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=a.timeout_s,
                preexec_fn=lambda: procs.write_text(str(os.getpid())), check=False)
            report = read_memory_report(path, kind)
        outcome = classify_exit(proc.returncode, report)
        result: dict[str, Any] = {}
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
        if outcome == "ok" and not result:
            outcome = "failed (no result)"
        if outcome not in ("ok", "out of memory") and a.verbose:
            print(proc.stderr[-2000:], file=sys.stderr)
        run = Run(policy, layers, outcome, result, time.perf_counter() - t0)
        subprocess.run(["rm", "-rf", str(work)], check=False)
        self.cache[key] = run
        if a.verbose:
            print(f"  {policy:<13} {layers:>4} layers: {outcome}"
                  + (f", {run.result['step_s']:.2f} s/step" if run.ok else ""), file=sys.stderr)
        return run

    def largest(self, policy: str, lo: int, hi_cap: int) -> int:
        """The largest depth in [lo, hi_cap] that trains (0: not even `lo`)."""
        if not self.run(policy, lo).ok:
            return 0
        good, bad = lo, None
        while bad is None:
            nxt = min(good * 2, hi_cap)
            if nxt == good:
                return good
            if self.run(policy, nxt).ok:
                good = nxt
            else:
                bad = nxt
        while bad - good > 1:
            mid = (good + bad) // 2
            if self.run(policy, mid).ok:
                good = mid
            else:
                bad = mid
        return good


def footprint_kib(args: argparse.Namespace) -> int:
    """What a worker holds before training: Python, torch, the stage runtime, the data."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})\n"
            "import torch, fusiond.train.local, fusiond.train.programs, fusiond.plan\n"
            "from fusiond.train.data import make_source\n"
            "from bench.memory import _spec, _rss_kib\n"
            "from fusiond.train.optim import make_optimizer\n"
            "spec = _spec(64, 1, 8, 2, 3)\n"
            "make_source(spec.data, 0)\n"
            "make_optimizer(spec.optimizer, [torch.nn.Parameter(torch.zeros(1))])\n"
            "print(_rss_kib()[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit-mib", type=int, default=640)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--factor", type=float, default=TARGET_PARAMS_RATIO,
                    help="check fusion at this many times plain's largest parameter count")
    ap.add_argument("--over", type=float, default=1.5,
                    help="table 2's depth, in multiples of plain's largest")
    ap.add_argument("--search", action="store_true", help="search fusion's largest depth too")
    ap.add_argument("--quick", action="store_true", help="2 steps, no fusion search")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    # worker
    ap.add_argument("--worker", choices=POLICIES, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--graph", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--machine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.steps = 2
    # a TERM ends the run as an exception does: the cgroups and scratch files are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if detect_memory_cgroup().root is None:
        print("no writable memory cgroup (needs root): nothing measured", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory(prefix="fusion-bench-memory-") as tmp:
        bench = Bench(args, Path(tmp))
        bench.footprint_kib = footprint_kib(args)
        report(args, bench)


def report(args: argparse.Namespace, bench: Bench) -> None:
    plain_l = bench.largest("plain", 1, 512)
    if plain_l == 0:
        print(f"plain PyTorch cannot train even 1 layer under {args.limit_mib} MiB: raise "
              "--limit-mib", file=sys.stderr)
        sys.exit(1)
    plain = bench.run("plain", plain_l)
    # the first depth with `factor` times plain's parameters (the embedding does not grow)
    at = plain_l + 1
    while params_at(args.width, at) < args.factor * plain.params:
        at += 1
    fus = bench.run("fusion", at)
    fusion_l = at if fus.ok else 0
    if args.search and fus.ok:
        fusion_l = bench.largest("fusion", at, 16 * plain_l)
    best_fusion = bench.run("fusion", fusion_l) if fusion_l else fus
    over = max(plain_l + 1, round(plain_l * args.over))
    runs = {p: bench.run(p, over) for p in POLICIES}
    static = [r for p, r in runs.items() if p != "fusion" and r.ok]
    best_static = max(static, key=lambda r: r.result["tokens_per_s"], default=None)
    fr = runs["fusion"]
    speedup = (fr.result["tokens_per_s"] / best_static.result["tokens_per_s"]
               if fr.ok and best_static is not None else float("inf") if fr.ok else 0.0)
    params_ratio = best_fusion.params / plain.params if best_fusion.ok else 0.0
    peaks = [r for r in (best_fusion, fr) if r.ok]
    peak_err = max((abs(r.peak_bytes / r.result["plan"]["predicted_peak_bytes"] - 1)
                    for r in peaks), default=float("inf"))
    targets = [
        (f"fusion trains >= {TARGET_PARAMS_RATIO:.0f}x plain's parameters under the limit",
         params_ratio, params_ratio >= TARGET_PARAMS_RATIO),
        (f"fusion >= {TARGET_SPEEDUP}x the best static policy's throughput at "
         f"{over} layers", speedup, speedup >= TARGET_SPEEDUP),
        (f"fusion's measured peak within {TARGET_PEAK_ERROR:.0%} of the plan's prediction",
         peak_err, peak_err <= TARGET_PEAK_ERROR),
    ]
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items()
                                     if not k.startswith(("worker", "graph", "state"))},
                          "footprint_kib": bench.footprint_kib,
                          "runs": [vars(r) for r in bench.cache.values()],
                          "targets": [{"target": t, "value": v, "pass": ok}
                                      for t, v, ok in targets]}, indent=1, default=str))
    else:
        print(f"GPT-2 width {args.width}, 4 heads, batch {args.batch} x 64 tokens in "
              f"{args.micro} micro-batches, AdamW; every run its own process in a "
              f"{args.limit_mib} MiB memory cgroup (no swap), {args.steps} steps, first "
              f"excluded; process footprint before training {bench.footprint_kib / 1024:.0f} "
              "MiB")
        print()
        print("1. largest model that trains under the limit")
        print(f"{'policy':<10}{'layers':>8}{'params':>12}{'ratio':>8}{'peak MiB':>10}"
              f"{'pred. MiB':>11}")
        print(f"{'plain':<10}{plain_l:>8}{plain.params:>12}{1.0:>8.2f}"
              f"{plain.peak_bytes / 2**20:>10.0f}{'':>11}")
        line = f"{'fusion':<10}{fusion_l:>8}{best_fusion.params:>12}{params_ratio:>8.2f}"
        if best_fusion.ok:
            line += (f"{best_fusion.peak_bytes / 2**20:>10.0f}"
                     f"{best_fusion.result['plan']['predicted_peak_bytes'] / 2**20:>11.0f}  "
                     + _decisions(best_fusion))
        else:
            line += f"  {at} layers: {best_fusion.outcome}"
        print(line + ("" if args.search else f"  (checked at {at}, not searched beyond)"))
        print()
        print(f"2. {over} layers ({runs['plain'].params or fr.params} parameters): each policy")
        print(f"{'policy':<14}{'outcome':<16}{'s/step':>8}{'tokens/s':>10}{'peak MiB':>10}"
              f"{'pred. MiB':>11}")
        for p, r in runs.items():
            row = f"{p:<14}{r.outcome:<16}"
            if r.ok:
                row += (f"{r.result['step_s']:>8.2f}{r.result['tokens_per_s']:>10.0f}"
                        f"{r.peak_bytes / 2**20:>10.0f}")
                if p == "fusion":
                    row += (f"{r.result['plan']['predicted_peak_bytes'] / 2**20:>11.0f}  "
                            + _decisions(r))
            print(row)
    print()
    for t, v, ok in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {t}: {v:.3f}")
    if not all(ok for _, _, ok in targets):
        sys.exit(1)


def _decisions(r: Run) -> str:
    p = r.result["plan"]
    parts = [f"checkpoint {p['recomputed']}/{p['blocks']} blocks"]
    if p["offload_optimizer"]:
        parts.append("optimizer on disk")
    if p["offload_params"]:
        parts.append("weights on disk")
    return ", ".join(parts)


if __name__ == "__main__":
    main()
