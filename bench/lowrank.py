"""Benchmark: what low-rank gradient reduction (PowerSGD with error feedback, `grad_rank`) costs
in held-out loss, against the same run with dense reductions (issue 21).

A GPT-2 (`--size`, byte vocabulary) cut into `--stages` pipeline stages, each stage on
`--replicas` replicas sharing the micro-batches, trains in this process (`run_replicated`:
the stage executors and their exchanges, in-memory links) for `--steps` steps on the training
split of the default corpus; then replica 0's weights are evaluated on the held-out split with
the yardstick's evaluator (`bench.wan_eval`: the dense weights, fixed windows no step trains
on). Every run starts from the same seeded model and draws the same batches. For each rank it
prints the share of a holder's gradient bytes it sends, the held-out loss and its gap to
dense, per seed (each seed its own initial weights and batch order, against the dense run of
the same seed); the target (issue 21): at the rank the planner may choose (the job's default,
`compression.grad_rank`, after its default dense warm-up steps) the mean gap over the seeds
is at most 1 %. Exits non-zero on a miss.

    python bench/lowrank.py [--size tiny] [--steps 300] [--ranks 1,2,4] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_GAP = 0.01
"""Issue 21: held-out loss at most 1 % above the dense run's after the same steps."""


def run(args: argparse.Namespace, rank: int | None, seed: int
        ) -> tuple[float, float, float, float]:
    """(held-out loss, seconds, sent share, mean training loss of the last fifth of the
    steps) of one run at `rank` (None: dense) from `seed` (the model's initial weights and
    the batches' order)."""
    import torch

    from bench.wan_common import Workload
    from bench.wan_eval import heldout_loss
    from fusiond.graph import contiguous_assignment, partition
    from fusiond.jobs.results import gather_state
    from fusiond.train.data import make_source
    from fusiond.train.local import run_replicated
    from fusiond.train.lowrank import sent_fraction
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.programs import capture_job, stage_programs
    from fusiond.train.spec import parse_job
    from protocol import ir

    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd),
                                   ("n_head", args.n_head)) if v}
    wl = Workload(size=args.size, batch=args.batch, micro_batches=args.micro,
                  seq_len=args.seq, lr=args.lr, seed=seed, corpus=str(args.train_path),
                  **overrides)
    spec = parse_job(wl.job_toml(adatopk=False))
    _, cap = capture_job(spec)
    cut = contiguous_assignment(cap.graph, args.stages)
    parts = partition(cap.graph, cut)
    programs = [list(p) for p in zip(*(stage_programs(cap.graph, parts, cap.state)
                                       for _ in range(args.replicas)), strict=True)]
    routes = [[m % args.replicas for m in range(args.micro)]] * args.stages
    torch.manual_seed(seed)
    t = time.perf_counter()
    res = asyncio.run(run_replicated(
        programs, routes, data=make_source(spec.data, spec.seed), batch_size=args.batch,
        micro_batches=args.micro, optimizer=spec.optimizer, steps=args.steps,
        grad_rank=rank, grad_warmup_steps=args.warmup))
    took = time.perf_counter() - t
    state = gather_state(cap.graph, [res.states[res.slots[(s, 0)]]
                                     for s in range(args.stages)])
    model = build_model(spec.model, seed=spec.seed)
    model.load_state_dict(state, strict=True)
    shapes = [ir.eval_shape(p.meta.shape, cap.graph.symbols) for p in cap.graph.params
              if p.kind is ir.ParamKind.PARAMETER and p.requires_grad]
    tail = res.losses[-max(1, len(res.losses) // 5):]
    return (heldout_loss(model, args.heldout, loss_fn(spec.loss)), took,
            sent_fraction(shapes, rank), sum(tail) / len(tail))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--n-layer", type=int, default=0)
    ap.add_argument("--n-embd", type=int, default=0)
    ap.add_argument("--n-head", type=int, default=0)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--warmup", type=int, default=None,
                    help="dense steps first (default: the job's, compression.grad_warmup_steps)")
    ap.add_argument("--seeds", default="0",
                    help="comma-separated seeds: each rank is run on each, its gap the mean")
    ap.add_argument("--train-mb", type=float, default=2.0)
    ap.add_argument("--heldout-kb", type=float, default=256.0)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--work", default="out/lowrank")
    args = ap.parse_args()

    import torch

    from bench.wan import prepare_data
    from fusiond.train.spec import DEFAULT_GRAD_RANK, DEFAULT_GRAD_WARMUP_STEPS

    torch.set_num_threads(1)
    args.seed = 0  # one split for every seed: the same held-out windows judge every run
    data = prepare_data(args, Path(args.work))
    args.train_path, args.heldout = data.train_path, data.heldout
    if args.warmup is None:
        args.warmup = DEFAULT_GRAD_WARMUP_STEPS
    ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()} | {DEFAULT_GRAD_RANK})
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    print(f"GPT-2 {args.size}, {args.stages} stages x {args.replicas} replicas, batch "
          f"{args.batch} x {args.seq} in {args.micro} micro-batches, AdamW lr {args.lr}, "
          f"{args.steps} steps ({args.warmup} dense first); held-out: {args.eval_windows} "
          f"windows; seeds {seeds}", flush=True)
    dense = {seed: run(args, None, seed) for seed in seeds}
    rows: list[tuple[Any, ...]] = [
        ("dense", 1.0, [dense[x][0] for x in seeds], [0.0] * len(seeds),
         sum(dense[x][1] for x in seeds), "")]
    ok = True
    for r in ranks:
        got = {seed: run(args, r, seed) for seed in seeds}
        gaps = [got[x][0] / dense[x][0] - 1 for x in seeds]
        mean_gap = sum(gaps) / len(gaps)
        verdict = ""
        if r == DEFAULT_GRAD_RANK:
            hit = mean_gap <= TARGET_GAP
            ok &= hit
            verdict = (f"{'PASS' if hit else 'FAIL'} (mean gap <= {TARGET_GAP:.0%}, the "
                       "default rank)")
        rows.append((f"rank {r}", got[seeds[0]][2], [got[x][0] for x in seeds], gaps,
                     sum(got[x][1] for x in seeds), verdict))
    print("\n| gradients | sent share | held-out loss per seed | gap per seed | mean gap "
          "| seconds | target |")
    print("|---|---|---|---|---|---|---|")
    for name, sent, losses, gaps, took, verdict in rows:
        print(f"| {name} | {sent:.4f} | {' '.join(f'{x:.4f}' for x in losses)} "
              f"| {' '.join(f'{g:+.2%}' for g in gaps)} | {sum(gaps) / len(gaps):+.2%} "
              f"| {took:.0f} | {verdict} |")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
