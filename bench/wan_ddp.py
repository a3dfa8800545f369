"""PyTorch DDP (gloo) baseline for `bench/wan.py`: one process per testbed host.

Every rank builds the same model (`fusiond.train.model.build_model`, same seed), and at each
step takes its contiguous 1/world share of the SAME global batch fusion trains on
(`TextWindows.batch(step, batch)`), in `micro_batches / world` micro-batches (at least 1) so
that the per-sample work matches; gradients are all-reduced by DDP on the last micro-batch.
The reported loss is the global batch's mean (one extra float all-reduced per step).
Rank 0 writes the trace after the wall-clock budget (all ranks stop at the same step: rank 0
broadcasts 'continue' with the loss all-reduce).

    python bench/wan_ddp.py --rank R --world W --master ADDR:PORT --budget 60 \
        --workload workload.json --out trace.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from bench.wan_common import Trace, Workload
from fusiond.train.data import Batch, make_source, split_micro_batches
from fusiond.train.model import build_model, loss_fn
from fusiond.train.optim import make_optimizer
from fusiond.train.spec import parse_job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="ADDR:PORT of rank 0")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = Workload.from_dict(json.loads(Path(args.workload).read_text()))
    if wl.batch % args.world:
        raise SystemExit(f"global batch {wl.batch} does not split over {args.world} ranks")
    spec = parse_job(wl.job_toml(adatopk=False))
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=datetime.timedelta(seconds=300))
    try:
        run(args, wl, spec)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, wl: Workload, spec: object) -> None:
    from fusiond.train.spec import JobSpec

    assert isinstance(spec, JobSpec)
    source = make_source(spec.data, spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    lossf = loss_fn(spec.loss)
    share = wl.batch // args.world
    micro = max(1, wl.micro_batches // args.world)
    while share % micro:
        micro -= 1
    t0 = time.perf_counter()  # the parameter broadcast in DDP's constructor counts
    ddp = DistributedDataParallel(model)
    opt = make_optimizer(spec.optimizer, ddp.parameters())
    events: list[tuple[float, int, float | None, int]] = []
    step = 0
    while True:
        full = source.batch(step, wl.batch)
        lo = args.rank * share
        mine = Batch(full.inputs[lo:lo + share], full.targets[lo:lo + share])
        total = 0.0
        mbs = split_micro_batches(mine, micro)
        for i, mb in enumerate(mbs):
            ctx = ddp.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()
            with ctx:
                loss = lossf(ddp(mb.inputs), mb.targets)
                (loss / micro).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        # one tensor: [sum of mean losses, keep going] -- rank 0 alone decides the budget
        t = time.perf_counter() - t0
        flag = torch.tensor([total / micro, 1.0 if (args.rank != 0 or t < args.budget) else 0.0])
        dist.all_reduce(flag)
        events.append((time.perf_counter() - t0, step, float(flag[0]) / args.world,
                       (step + 1) * wl.tokens_per_step))
        step += 1
        if flag[1] < args.world:
            break
    if args.rank == 0:
        Path(args.out).write_text(Trace("ddp", events, {"world": args.world,
                                                        "micro_per_rank": micro}).to_json())


if __name__ == "__main__":
    main()
