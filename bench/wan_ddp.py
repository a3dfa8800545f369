"""The plain-PyTorch baselines of `bench/wan.py` (issue 14), one process per testbed host used.

- `--world 1`: (0) the single host alone: the whole global batch per step, no network (with
  `--checkpoint-activations`, each transformer block recomputed in the backward pass, what a
  user does when the activations do not fit).
- `--world N`: (4) DDP over gloo, each rank its contiguous 1/N share of the SAME global batch
  fusion trains on (`TextWindows.batch(step, batch)` of the training split), gradients
  all-reduced by DDP with a comm hook, configured as torch's docs say: `--hook fp16`
  (`default_hooks.fp16_compress_hook`) or `--hook powersgd` (`powerSGD_hook.PowerSGDState`,
  rank `--powersgd-rank`, error feedback and warm start, vanilla all-reduce for the first
  `--powersgd-start` steps), with a single bucket (`bucket_cap_mb` above the model's size:
  PowerSGD on gloo needs one bucket) so one collective per step carries every gradient.
  No other collective per step: the budget's end is agreed through a stop file in the shared
  `--stop-dir` (the hosts share one machine's file system, as a control message would on
  real machines): rank 0, once past the budget at the end of step k, writes "stop after k+1";
  every rank reads it at the end of each step. Rank 0 cannot finish step k+1's all-reduce
  before writing it, and no other rank can either, so every rank stops after the same step.

- `--fsdp`: FSDP (`torch.distributed.fsdp.fully_shard`, FSDP2: each transformer block, then
  the model) over gloo, for the regime where the model does not fit one host: each rank holds
  1/N of the parameters, gradients and Adam state. Every rank writes its own shards after
  every step (`fsdp-rank<r>-step<s>.safetensors`, no collective); `bench/wan.py` reassembles
  the steps at its fixed wall-clock points (rank 0's clock) and the last.

Rank 0 saves the dense weights each `--snapshot-interval` seconds of wall clock and at the end
(`bench.wan_eval.save_snapshot`), evaluated after the run by `bench/wan.py`. The clock starts
after the rendezvous (reported as `startup_s`), before DDP's constructor (its parameter
broadcast counts). The loss in the trace is rank 0's own share (no collective for it); the
verdict reads the held-out loss.

    python bench/wan_ddp.py --rank R --world W --master ADDR:PORT --budget 60 --hook powersgd \
        --workload workload.json --out trace.json --snapshot-dir DIR --stop-dir DIR
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from bench.wan_common import Trace, Workload
from bench.wan_eval import SnapshotClock, save_snapshot
from fusiond.train.data import Batch, make_source, split_micro_batches
from fusiond.train.model import build_model, loss_fn
from fusiond.train.optim import make_optimizer
from fusiond.train.spec import JobSpec, parse_job

T_PROCESS = time.perf_counter()
"""After the imports: start-up = rendezvous, model and data (imports cost every system alike)."""
HOOKS = ("none", "fp16", "powersgd")


def checkpoint_blocks(model: nn.Module) -> int:
    """Recompute every transformer block's activations in the backward pass (torch's
    activation checkpointing, non-reentrant); returns how many blocks were wrapped."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    if blocks is None:
        raise SystemExit("--checkpoint-activations: the model has no transformer.h blocks")
    for block in blocks:
        inner = block.forward

        def fwd(x: torch.Tensor, _inner: Any = inner) -> torch.Tensor:
            out: torch.Tensor = checkpoint(_inner, x, use_reentrant=False)
            return out

        block.forward = fwd
    return len(blocks)


def register_hook(ddp: DistributedDataParallel, hook: str, rank: int, start: int) -> None:
    if hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start,
            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def save_shards(directory: Path, rank: int, step: int, model: nn.Module) -> None:
    """This rank's FSDP shards of every state entry (the local part of each DTensor), as
    safetensors: no collective, so the ranks never wait on each other for a snapshot."""
    import safetensors.torch
    from torch.distributed.tensor import DTensor

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().contiguous().clone()
             for k, v in model.state_dict().items()}
    path = directory / f"fsdp-rank{rank:03d}-step{step:07d}.safetensors"
    tmp = path.with_suffix(".tmp")
    safetensors.torch.save_file(state, str(tmp))
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--master", help="ADDR:PORT of rank 0 (world > 1)")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--hook", choices=HOOKS, default="powersgd")
    ap.add_argument("--powersgd-rank", type=int, default=2)
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="steps of vanilla all-reduce before PowerSGD (its docs: a warm-up "
                         "helps accuracy; 2 is the least allowed with error feedback and warm "
                         "start, and on an 8 Mbit/s link each uncompressed step costs tens of "
                         "seconds)")
    ap.add_argument("--micro", type=int, default=1,
                    help="micro-batches per rank and step (1: the rank's share at once)")
    ap.add_argument("--checkpoint-activations", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP (world > 1)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--snapshot-dir", required=True, type=Path)
    ap.add_argument("--snapshot-interval", type=float, default=5.0)
    ap.add_argument("--stop-dir", type=Path, help="shared directory of the stop file (world > 1)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = Workload.from_dict(json.loads(Path(args.workload).read_text()))
    if wl.batch % args.world:
        raise SystemExit(f"global batch {wl.batch} does not split over {args.world} ranks")
    spec = parse_job(wl.job_toml(adatopk=False))
    if args.world > 1:
        if not args.master or args.stop_dir is None:
            raise SystemExit("--world > 1 needs --master and --stop-dir")
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                                world_size=args.world, timeout=datetime.timedelta(seconds=300))
    try:
        run(args, wl, spec)
    finally:
        if args.world > 1:
            dist.destroy_process_group()


def _stop_after(stop_file: Path) -> int | None:
    try:
        return int(stop_file.read_text())
    except (OSError, ValueError):
        return None


def run(args: argparse.Namespace, wl: Workload, spec: JobSpec) -> None:
    source = make_source(spec.data, spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    if args.checkpoint_activations:
        checkpoint_blocks(model)
    lossf = loss_fn(spec.loss)
    share = wl.batch // args.world
    micro = max(1, min(args.micro, share))
    while share % micro:
        micro -= 1
    t0 = time.perf_counter()
    startup_s = t0 - T_PROCESS
    net: nn.Module = model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    elif args.world > 1:
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ddp = DistributedDataParallel(model, bucket_cap_mb=max(25.0, 2 * n_bytes / 2**20),
                                      gradient_as_bucket_view=True)
        register_hook(ddp, args.hook, args.powersgd_rank, args.powersgd_start)
        net = ddp
    opt = make_optimizer(spec.optimizer, net.parameters())
    clock = SnapshotClock(args.snapshot_interval)
    stop_file = args.stop_dir / "stop-after" if args.stop_dir is not None else None
    events: list[tuple[float, int, float | None, int]] = []
    snaps = 0
    step = 0
    stop_at: int | None = None
    saved = -1
    while True:
        full = source.batch(step, wl.batch)
        lo = args.rank * share
        mine = Batch(full.inputs[lo:lo + share], full.targets[lo:lo + share])
        total = 0.0
        mbs = split_micro_batches(mine, micro)
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            ctx = (net.no_sync() if isinstance(net, DistributedDataParallel) and not last
                   else contextlib.nullcontext())
            with ctx:
                loss = lossf(net(mb.inputs), mb.targets)
                (loss / micro).backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter() - t0
        events.append((t, step, total / micro, (step + 1) * wl.tokens_per_step))
        if args.fsdp:
            save_shards(args.snapshot_dir, args.rank, step, model)
        elif args.rank == 0 and clock.due(t):
            save_snapshot(args.snapshot_dir, snaps, t, step, model.state_dict())
            snaps += 1
            saved = step
        if args.world == 1:
            if t >= args.budget:
                break
        else:
            assert stop_file is not None
            if args.rank == 0 and stop_at is None and t >= args.budget:
                stop_at = step + 1
                tmp = stop_file.with_suffix(".tmp")
                tmp.write_text(str(stop_at))
                tmp.replace(stop_file)
            if stop_at is None:
                stop_at = _stop_after(stop_file)
            if stop_at is not None and step >= stop_at:
                break
        step += 1
    if args.rank == 0 and saved != step and not args.fsdp:
        save_snapshot(args.snapshot_dir, snaps, events[-1][0], step, model.state_dict())
    if args.rank == 0:
        system = ("fsdp" if args.fsdp else "single" if args.world == 1
                  else f"ddp_{args.hook}")
        Path(args.out).write_text(Trace(system, events, {
            "world": args.world, "micro_per_rank": micro, "hook": args.hook,
            "startup_s": startup_s, "checkpoint_activations": args.checkpoint_activations,
            "powersgd_rank": args.powersgd_rank, "powersgd_start": args.powersgd_start,
        }).to_json())


if __name__ == "__main__":
    main()
