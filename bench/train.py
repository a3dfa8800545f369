"""Benchmark: distributed GPT-2 (tiny by default) on 3 loopback peers vs single process.

Measures, in the same run:
- tokens/s of single-process eager training (same batches, micro-batches and optimizer);
- tokens/s of the pipelined job on 3 stage hosts, each with its own PeerNetwork on 127.0.0.1
  (real TCP sockets and frames; one process, so the stages share this machine's cores), dense
  and with top-k at `--density` on every cut edge;
- the same job through the full job protocol (Assign/Ready/JobStart/StageStep/JobResult) with
  stages 1 and 2 in their own processes (`fusiond.harness.node`) and the scheduler + stage 0 here:
  three "daemons" without membership or API;
- bytes on the wire per iteration: the tensor payloads the stages sent (and their dense size),
  every byte the sockets carried (frames, headers, tied-weight gradients included), and what the
  planner's byte model (`fusiond.plan.model.wire_bytes`) predicts for the same cut edges.

The first `--warmup` steps of each run are excluded from throughput. Usage:
    python bench/train.py [--steps 30] [--batch 16] [--micro 4] [--seq 64] [--density 0.1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from statistics import mean, median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusiond.cli import run_on_loop
from fusiond.graph import contiguous_assignment
from fusiond.harness.inproc import inproc_cluster
from fusiond.harness.loopback import LoopbackResult, run_loopback
from fusiond.harness.node import spawn_nodes
from fusiond.jobs.assign import layout_job
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.planning import job_settings
from fusiond.plan import (
    Cluster,
    GraphArrays,
    MachineProfile,
    StageSpec,
    batch_symbol,
    cost_graph_from_ir,
    evaluate,
)
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer, StepMetrics
from fusiond.train.model import build_model, loss_fn
from fusiond.train.programs import capture_job
from fusiond.train.spec import JobSpec, parse_job

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},
    # about 8x tiny's parameters (0.27 M vs 0.035 M; the "model 8x larger"): twice the
    # width, 2.5x the layers
    "tiny8x": {"n_embd": 64, "n_layer": 5},
}
"""Models the bench runs: GPT-2 `tiny` with these overrides (vocabulary 256, context 64)."""


def make_spec(args: argparse.Namespace, model: str = "") -> JobSpec:
    size = args.size if not model else "tiny"
    extra = "".join(f", {k} = {v}" for k, v in MODELS.get(model, {}).items())
    return parse_job(f"""
[job]
name = "bench-train"
steps = {args.steps}
seed = 0
[model]
zoo = "gpt2"
config = {{ size = "{size}", vocab_size = 256{extra} }}
[data]
seq_len = {args.seq}
[optimizer]
lr = 1e-3
[batch]
size = {args.batch}
micro_batches = {args.micro}
""")


def predicted_bytes(res: LoopbackResult, spec: JobSpec, captured: Any,
                    density: float | None) -> float:
    """The planner's prediction for the cut this run used, per iteration (all micro-batches):
    `fusiond.plan.evaluate` of the same stages on the IR's cost graph, with `density` on every
    compressible cut tensor (`LinkReport` bytes are per micro-batch)."""
    g = captured.graph
    sym = batch_symbol(g)
    cost = cost_graph_from_ir(g, {sym: spec.batch.micro_batch_size} if sym else {})
    index = cost.index()
    # The contiguous cut: stage i starts at its first op (in the cost graph's order).
    starts = sorted(min(index[n] for n in s.partition.node_ids if n in index)
                    for s in res.layout.stages)
    starts[0] = 0
    ends = [*starts[1:], len(cost)]
    stages = [StageSpec(machine=i, start=a, stop=b)
              for i, (a, b) in enumerate(zip(starts, ends, strict=True))]
    machines = [MachineProfile(id=f"m{i}", flops={"other": 1e10}, mem_bw=1e10,
                               op_overhead_s=1e-5, memory_bytes=64e9) for i in range(len(stages))]
    arrays = GraphArrays(cost, Cluster.build(machines, [[1e9] * len(stages)] * len(stages)),
                         job_settings(spec))
    ev = evaluate(arrays, stages)
    if density is not None:
        dens = {(t, lk.dst_stage): density for lk in ev.links for t in lk.tensors}
        ev = evaluate(arrays, stages, dens)
    return sum(lk.fwd_bytes + lk.bwd_bytes for lk in ev.links) * spec.batch.micro_batches


def single_process(spec: JobSpec, tokens_per_step: int, warmup: int,
                   threads: int | None = None) -> dict[str, Any]:
    """Eager training in this process (`threads` torch threads; None: as set)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        model = build_model(spec.model, seed=spec.seed)
        rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                              data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                              micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
        times: list[float] = []
        losses: list[float] = []
        for s in range(spec.steps):
            t0 = time.perf_counter()
            losses.append(rt.step(s))
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    step_s = median(times[warmup:])
    return {"tokens_per_s": tokens_per_step / mean(times[warmup:]), "loss": losses[-1],
            "step_s": step_s, "threads": threads or before,
            "params": sum(p.numel() for p in model.parameters())}


def distributed(spec: JobSpec, captured: Any, density: float | None, warmup: int
                ) -> tuple[dict[str, Any], LoopbackResult]:
    res = asyncio.run(run_loopback(spec, captured, stages=3, density=density,
                                   tokens_per_sample=spec.data.seq_len))
    ms = res.metrics[warmup:]
    tokens = spec.batch.size * spec.data.seq_len
    row = {
        "tokens_per_s": tokens / mean(m.wall_s for m in ms),
        "loss": res.metrics[-1].loss,
        "payload_bytes": mean(m.wire_bytes for m in ms),
        "dense_bytes": mean(m.dense_bytes for m in ms),
        "shared_bytes": mean(m.shared_bytes for m in ms),
        "socket_bytes": mean(res.socket_bytes[warmup:]),
        "predicted_bytes": predicted_bytes(res, spec, captured, density),
        "busy": {str(k): round(v, 3) for k, v in sorted(ms[-1].stage_busy.items())},
        "cut_edges": len(res.metrics[-1].edges),
    }
    return row, res


async def _processes(spec: JobSpec, captured: Any, density: float | None,
                     threads: int | None = None, loop: str = "auto") -> list[StepMetrics]:
    """Stage 0 + scheduler here, stages 1 and 2 in their own processes (3 'daemons')."""
    seen: list[StepMetrics] = []
    async with inproc_cluster(1) as here:
        n0 = here["node0"]
        async with spawn_nodes(["node1", "node2"], extra={"node0": n0.net.address},
                               threads=threads, loop=loop) as procs:
            for p in procs.values():
                n0.net.add_peer_address(p.name, p.address)
            names = ["node0", "node1", "node2"]
            cut = contiguous_assignment(captured.graph, 3)
            layout = layout_job("bench", captured.graph, captured.state,
                                {op: names[i] for op, i in cut.items()}, density=density)
            addresses = {"node0": n0.net.address} | {n: p.address for n, p in procs.items()}
            coord = JobCoordinator(send=n0.send_fn(), spec=spec, captured=captured,
                                   layout=layout, addresses=addresses, term=1,
                                   tokens_per_sample=spec.data.seq_len, on_step=seen.append)
            n0.coordinators.append(coord)
            out = await coord.run()
            if not out.ok:
                raise SystemExit(f"benchmark job failed: {out.failure}")
    return seen


BREAKDOWN = ("dispatch", "kernel", "codec", "no_cpu", "send", "overhead", "handoff")
"""Per-task figures (ms, median over every task of every stage after warm-up): dispatch (inputs
in -> compute thread starts), kernel (the model's forward or autograd's backward), codec
(decode + encode), no_cpu (the task's wall time in which its thread did not run: the GIL or a
core held elsewhere), send (blocked on a full outbound queue), overhead (all of the task's time
from inputs in to outputs queued that is not kernel: the runtime's own cost), handoff (a
task's end on one stage to its outputs being in on the next, `handoffs`)."""


def breakdown(ms: list[StepMetrics]) -> dict[str, float]:
    """Medians of the per-task figures over every task of every stage in `ms`, in ms."""
    rows: dict[str, list[float]] = {k: [] for k in BREAKDOWN}
    for m in ms:
        for rep in m.reports.values():
            for t in rep.timeline:
                rows["dispatch"].append(t.dispatch_s)
                rows["kernel"].append(t.kernel_s)
                rows["codec"].append(t.codec_s)
                rows["no_cpu"].append(max(0.0, t.end_s - t.start_s - t.cpu_s))
                rows["send"].append(t.send_s)
                rows["overhead"].append(t.overhead_s)
    rows["handoff"] = handoffs(ms)
    return {k: round(median(v) * 1e3, 3) if v else float("nan") for k, v in rows.items()}


def handoffs(ms: list[StepMetrics]) -> list[float]:
    """From a task's end on one stage to its successor's inputs being in on the next (F m on
    stage k after F m on k-1, B m on k after B m on k+1), where the successor was waiting for
    them (else its start says nothing of the hand-off): the send, the wire and the receive.
    The stages share this machine's monotonic clock."""
    out: list[float] = []
    for m in ms:
        ends: dict[tuple[int, str], float] = {}
        for stage, rep in m.reports.items():
            if rep.start_mono is None:
                continue
            for t in rep.timeline:
                ends[(stage, t.task)] = rep.start_mono + t.end_s
        for stage, rep in m.reports.items():
            if rep.start_mono is None:
                continue
            for t in rep.timeline:
                prev = (stage - 1 if t.task.startswith("F") else stage + 1, t.task)
                if t.wait_s > 0 and prev in ends:
                    out.append(max(0.0, rep.start_mono + t.ready_s - ends[prev]))
    return out


def distributed_processes(spec: JobSpec, captured: Any, density: float | None,
                          warmup: int, threads: int | None = None,
                          loop: str = "auto") -> dict[str, Any]:
    # every process on the loop a daemon runs (its `loop` setting; auto: uvloop if installed)
    ms = run_on_loop(_processes(spec, captured, density, threads, loop), loop)[warmup:]
    tokens = spec.batch.size * spec.data.seq_len
    return {"tokens_per_s": tokens / mean(m.wall_s for m in ms), "loss": ms[-1].loss,
            "step_s": median(m.wall_s for m in ms),
            "payload_bytes": mean(m.wire_bytes for m in ms),
            "busy": {str(k): round(v, 3) for k, v in sorted(ms[-1].stage_busy.items())},
            "tasks": breakdown(ms)}


TARGET_STEP_RATIO = {"tiny": 1.25, "tiny8x": 1.1}
"""Issue 15: 3 stage processes' step time over the single-process eager step (its best at up
to the same total thread count)."""
TARGET_OVERHEAD_MS = 0.15
"""Issue 15: median runtime overhead per task."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="tiny", help="GPT-2 size of the byte table: tiny (default), "
                    "mini, small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per stage process (the eager baseline gets its best at "
                         "up to 3x this)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                    help="the event loop of every stage process (a daemon's `loop` setting; "
                         "auto: uvloop where installed, as a daemon runs)")
    ap.add_argument("--no-inprocess", dest="inprocess", action="store_false",
                    help="skip the byte table's runs (three stages in this one process)")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    total_threads = 3 * args.threads
    torch.set_num_threads(args.threads)  # stage 0's process is this one
    models: dict[str, Any] = {}
    for name in MODELS:
        spec = make_spec(args, name)
        _, captured = capture_job(spec)
        tokens_per_step = spec.batch.size * spec.data.seq_len
        eager = [single_process(spec, tokens_per_step, args.warmup, t)
                 for t in range(1, min(total_threads, os.cpu_count() or 1, 8) + 1)]
        best = min(eager, key=lambda r: r["step_s"])
        procs = distributed_processes(spec, captured, None, args.warmup, args.threads,
                                      args.loop)
        models[name] = {"params": best["params"], "eager": eager, "best_eager": best,
                        "processes": procs, "ratio": procs["step_s"] / best["step_s"]}
    # the byte table: three stages in this process over loopback sockets (dense and top-k)
    inproc: dict[str, Any] = {}
    if args.inprocess:
        spec = make_spec(args)
        _, captured = capture_job(spec)
        inproc["dense"], _ = distributed(spec, captured, None, args.warmup)
        inproc["topk"], _ = distributed(spec, captured, args.density, args.warmup)
    overhead = max(m["processes"]["tasks"]["overhead"] for m in models.values())
    targets = [
        (f"{name}: 3 stage processes / eager step <= {TARGET_STEP_RATIO[name]}x",
         m["ratio"], m["ratio"] <= TARGET_STEP_RATIO[name]) for name, m in models.items()
    ] + [(f"runtime overhead per task (median, worst model) <= {TARGET_OVERHEAD_MS} ms",
          overhead, overhead <= TARGET_OVERHEAD_MS)]
    out = {"config": {**vars(args), "cpus": os.cpu_count()}, "models": models,
           "inprocess": inproc,
           "targets": [{"target": t, "value": round(v, 3), "pass": ok} for t, v, ok in targets]}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        report(args, models, inproc, targets)
    if not all(ok for _, _, ok in targets):
        sys.exit(1)


def report(args: argparse.Namespace, models: dict[str, Any], inproc: dict[str, Any],
           targets: list[tuple[str, float, bool]]) -> None:
    print(f"GPT-2 tiny and tiny8x, batch {args.batch} x {args.seq} tokens, {args.micro} "
          f"micro-batches, {args.steps} steps ({args.warmup} warm-up excluded), "
          f"{os.cpu_count()} CPUs. 3 stages = stage 0 and the scheduler in this process, stages "
          f"1 and 2 in their own (fusiond.harness.node), {args.threads} torch thread(s) each, "
          "over loopback TCP; contiguous cut")
    print()
    print(f"{'model':<8}{'params':>9}  {'eager step ms by threads':<28}{'3 stages ms':>12}"
          f"{'ratio':>8}{'loss eager':>12}{'loss 3 st.':>12}")
    for name, m in models.items():
        eg = " ".join(f"{r['threads']}:{r['step_s'] * 1e3:.1f}" for r in m["eager"])
        print(f"{name:<8}{m['params']:>9}  {eg:<28}{m['processes']['step_s'] * 1e3:>12.1f}"
              f"{m['ratio']:>7.2f}x{m['best_eager']['loss']:>12.3f}"
              f"{m['processes']['loss']:>12.3f}")
    print()
    print("per task, median ms (every task of every stage after warm-up): " + ", ".join(
        BREAKDOWN))
    for name, m in models.items():
        t = m["processes"]["tasks"]
        print(f"{name:<8}" + "".join(f"{k} {t[k]:.3f}  " for k in BREAKDOWN)
              + f"busy {m['processes']['busy']}")
    if inproc:
        dense, topk = inproc["dense"], inproc["topk"]
        print()
        print("bytes per iteration, tiny (activations + gradients on the cut edges, all "
              "micro-batches; three stages in this process)")
        print(f"{'run':<22}{'payload':>11}{'dense':>11}{'predicted':>11}{'pred/meas':>10}"
              f"{'sockets':>11}{'tied grads':>11}")
        for name, row in (("dense", dense), (f"top-k {args.density}", topk)):
            print(f"{name:<22}{row['payload_bytes']:>11.0f}{row['dense_bytes']:>11.0f}"
                  f"{row['predicted_bytes']:>11.0f}"
                  f"{row['predicted_bytes'] / row['payload_bytes']:>10.2f}"
                  f"{row['socket_bytes']:>11.0f}{row['shared_bytes']:>11.0f}")
    print()
    for t, v, ok in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {t}: {v:.3f}")


if __name__ == "__main__":
    main()
