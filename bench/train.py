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
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def make_spec(args: argparse.Namespace) -> JobSpec:
    return parse_job(f"""
[job]
name = "bench-train"
steps = {args.steps}
seed = 0
[model]
zoo = "gpt2"
config = {{ size = "{args.size}", vocab_size = 256 }}
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


def single_process(spec: JobSpec, tokens_per_step: int, warmup: int) -> dict[str, Any]:
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
    return {"tokens_per_s": tokens_per_step / mean(times[warmup:]), "loss": losses[-1]}


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


async def _processes(spec: JobSpec, captured: Any, density: float | None
                     ) -> list[StepMetrics]:
    """Stage 0 + scheduler here, stages 1 and 2 in their own processes (3 'daemons')."""
    seen: list[StepMetrics] = []
    async with inproc_cluster(1) as here:
        n0 = here["node0"]
        async with spawn_nodes(["node1", "node2"], extra={"node0": n0.net.address}) as procs:
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


def distributed_processes(spec: JobSpec, captured: Any, density: float | None,
                          warmup: int) -> dict[str, Any]:
    ms = asyncio.run(_processes(spec, captured, density))[warmup:]
    tokens = spec.batch.size * spec.data.seq_len
    return {"tokens_per_s": tokens / mean(m.wall_s for m in ms), "loss": ms[-1].loss,
            "payload_bytes": mean(m.wire_bytes for m in ms),
            "busy": {str(k): round(v, 3) for k, v in sorted(ms[-1].stage_busy.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="tiny", help="GPT-2 size: tiny (default), mini, small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--no-processes", dest="processes", action="store_false",
                    help="skip the run with stages 1 and 2 in their own processes")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error("--steps must exceed --warmup")
    spec = make_spec(args)
    t0 = time.perf_counter()
    _, captured = capture_job(spec)
    capture_s = time.perf_counter() - t0
    tokens_per_step = spec.batch.size * spec.data.seq_len
    single = single_process(spec, tokens_per_step, args.warmup)
    dense, _ = distributed(spec, captured, None, args.warmup)
    topk, _ = distributed(spec, captured, args.density, args.warmup)
    procs: dict[str, Any] = {}
    if args.processes:
        procs["dense"] = distributed_processes(spec, captured, None, args.warmup)
        procs["topk"] = distributed_processes(spec, captured, args.density, args.warmup)
    out = {
        "config": {**vars(args), "threads": os.environ.get("OMP_NUM_THREADS"),
                   "cpus": os.cpu_count(), "capture_s": round(capture_s, 2)},
        "single": single, "dense": dense, "topk": topk, "processes": procs,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"GPT-2 {args.size}, batch {args.batch} x {args.seq} tokens, {args.micro} micro-batches, "
          f"{args.steps} steps ({args.warmup} warm-up excluded); 3 stages on loopback peers "
          f"(one process, {os.cpu_count()} CPUs); capture {capture_s:.1f} s")
    print()
    print(f"{'run':<26}{'tokens/s':>10}{'vs single':>11}{'final loss':>12}")
    print(f"{'single process':<26}{single['tokens_per_s']:>10.0f}{1.0:>10.2f}x"
          f"{single['loss']:>12.3f}")
    rows = [("3 stages, dense", dense), (f"3 stages, top-k {args.density}", topk)]
    if procs:
        rows += [("3 processes, dense", procs["dense"]),
                 (f"3 processes, top-k {args.density}", procs["topk"])]
    for name, row in rows:
        print(f"{name:<26}{row['tokens_per_s']:>10.0f}"
              f"{row['tokens_per_s'] / single['tokens_per_s']:>10.2f}x{row['loss']:>12.3f}")
    print()
    print("bytes per iteration (activations + gradients on the cut edges, all micro-batches)")
    print(f"{'run':<22}{'payload':>11}{'dense':>11}{'predicted':>11}{'pred/meas':>10}"
          f"{'sockets':>11}{'tied grads':>11}")
    for name, row in (("dense", dense), (f"top-k {args.density}", topk)):
        print(f"{name:<22}{row['payload_bytes']:>11.0f}{row['dense_bytes']:>11.0f}"
              f"{row['predicted_bytes']:>11.0f}"
              f"{row['predicted_bytes'] / row['payload_bytes']:>10.2f}"
              f"{row['socket_bytes']:>11.0f}{row['shared_bytes']:>11.0f}")
    print()
    print(f"top-k {args.density} moves {topk['payload_bytes'] / dense['payload_bytes']:.3f} of the "
          f"dense payload; stage busy fractions dense {dense['busy']}, top-k {topk['busy']}")


if __name__ == "__main__":
    main()
