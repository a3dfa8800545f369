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

- `--pipeline`: (1) torch.distributed.pipelining itself: equal transformer blocks per stage
  (rank i runs stage i: the embeddings with the first blocks, the final norm and head with
  the last), `PipelineStage` over gloo point-to-point, `Schedule1F1B` over the job's
  micro-batches of the global batch, gradients scaled by 1/M as the schedule does; the
  embedding tied to the head is a parameter of the first and the last stage, its gradient
  all-reduced between those two ranks before the optimizer step (as Megatron's embedding
  group does). Every rank writes its own stage's parameters after every step, under the full
  model's names (`pipe-rank<r>-step<s>.safetensors`); `bench/wan.py` merges the steps at its
  fixed wall-clock points (rank 0's clock) and the last.
- `--fsdp`: FSDP (`torch.distributed.fsdp.fully_shard`, FSDP2: each transformer block, then
  the model) over gloo, for the regime where the model does not fit one host: each rank holds
  1/N of the parameters, gradients and Adam state. Every rank writes its own shards after
  every step (`fsdp-rank<r>-step<s>.safetensors`, no collective); `bench/wan.py` reassembles
  the steps at its fixed wall-clock points (rank 0's clock) and the last.

Rank 0 saves the dense weights each `--snapshot-interval` seconds of wall clock and at the end
(`bench.wan_eval.save_snapshot`), evaluated after the run by `bench/wan.py`. The clock starts
after the rendezvous and DDP's constructor (its parameter broadcast): everything before is
start-up, reported as `startup_s` apart from the budget. The loss in the trace is rank 0's
own share (no collective for it; none for a pipeline's first stage); the verdict reads the
held-out loss.

    python bench/wan_ddp.py --rank R --world W --master ADDR:PORT --budget 60 --hook powersgd \
        --workload workload.json --out trace.json --snapshot-dir DIR --stop-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
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

from bench.wan_common import POWERSGD_START_STEPS, Trace, Workload
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


class StagePart(nn.Module):
    """Blocks `lo:hi` of a GPT-2 (`fusiond.models.gpt2.GPT`), with the embeddings on the
    first stage and the final norm and head on the last: one stage of an equal-blocks
    pipeline, its parameters those of the full model (the same names under `names`)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool) -> None:
        super().__init__()
        t: Any = model.transformer
        self.first, self.last = first, last
        self.names: dict[str, str] = {}  # this part's name -> the full model's
        self.wte: Any
        self.lm_head: Any
        if first:
            self.wte, self.wpe, self.drop = t.wte, t.wpe, t.drop
            self.names |= {"wte.weight": "transformer.wte.weight",
                           "wpe.weight": "transformer.wpe.weight"}
        self.h = nn.ModuleList(list(t.h)[lo:hi])
        for i, b in enumerate(self.h):
            self.names |= {f"h.{i}.{k}": f"transformer.h.{lo + i}.{k}"
                           for k, _ in b.named_parameters()}
        if last:
            self.ln_f, self.lm_head = t.ln_f, model.lm_head
            self.names |= {f"ln_f.{k}": f"transformer.ln_f.{k}"
                           for k, _ in t.ln_f.named_parameters()}
            self.names["lm_head.weight"] = "lm_head.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for b in self.h:
            x = b(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x

    def full_state(self) -> dict[str, torch.Tensor]:
        own = dict(self.named_parameters(remove_duplicate=False))
        out = {self.names[k]: v.detach().contiguous().clone() for k, v in own.items()
               if k in self.names}
        if self.first and self.last:  # one stage: the tied head is the embedding
            out["lm_head.weight"] = out["transformer.wte.weight"]
        return out


def save_part(directory: Path, rank: int, step: int, state: dict[str, torch.Tensor]) -> None:
    """One pipeline rank's parameters after `step`, as safetensors (no collective)."""
    import safetensors.torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"pipe-rank{rank:03d}-step{step:07d}.safetensors"
    tmp = path.with_suffix(".tmp")
    safetensors.torch.save_file(state, str(tmp))
    tmp.replace(path)


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
    ap.add_argument("--powersgd-start", type=int, default=POWERSGD_START_STEPS,
                    help="steps of vanilla all-reduce before PowerSGD (its docs: a warm-up "
                         "helps accuracy; 2 is the least allowed with error feedback and warm "
                         "start, and on an 8 Mbit/s link each uncompressed step costs tens of "
                         "seconds)")
    ap.add_argument("--micro", type=int, default=1,
                    help="micro-batches per rank and step (1: the rank's share at once)")
    ap.add_argument("--checkpoint-activations", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP (world > 1)")
    ap.add_argument("--hosts", default="", help="the hosts of the ranks (the trace notes them)")
    ap.add_argument("--pipeline", action="store_true",
                    help="torch.distributed.pipelining, rank i = stage i (world > 1)")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--snapshot-dir", required=True, type=Path)
    ap.add_argument("--snapshot-interval", type=float, default=5.0)
    ap.add_argument("--stop-dir", type=Path, help="shared directory of the stop file (world > 1)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    wl = Workload.from_dict(json.loads(Path(args.workload).read_text()))
    if wl.batch % args.world and not args.pipeline:
        raise SystemExit(f"global batch {wl.batch} does not split over {args.world} ranks")
    spec = parse_job(wl.job_toml(adatopk=False))
    if args.world > 1:
        if not args.master or args.stop_dir is None:
            raise SystemExit("--world > 1 needs --master and --stop-dir")
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                                world_size=args.world, timeout=datetime.timedelta(seconds=300))
    try:
        (run_pipeline if args.pipeline else run)(args, wl, spec)
    finally:
        if args.world > 1:
            dist.destroy_process_group()


class StopAgreement:
    """Every rank stops after the same step, with no collective of its own: rank 0, once its
    clock is past the budget at the end of step k, writes "stop after k+1" to the shared stop
    file; every rank reads it at the end of each step. Rank 0 cannot finish step k+1 (its
    collectives or point-to-point transfers need every rank) before writing it, so no rank
    misses it. One rank alone stops at the budget."""

    def __init__(self, stop_dir: Path | None, rank: int, world: int, budget_s: float) -> None:
        if world > 1 and stop_dir is None:
            raise SystemExit("--world > 1 needs --stop-dir")
        self.file = stop_dir / "stop-after" if stop_dir is not None else None
        self.rank, self.world, self.budget_s = rank, world, budget_s
        self.stop_at: int | None = None

    def _read(self) -> int | None:
        assert self.file is not None
        try:
            return int(self.file.read_text())
        except (OSError, ValueError):
            return None

    def done(self, step: int, t_s: float) -> bool:
        """After `step` ended `t_s` into the budget: is this the last step?"""
        if self.world == 1:
            return t_s >= self.budget_s
        assert self.file is not None
        if self.rank == 0 and self.stop_at is None and t_s >= self.budget_s:
            self.stop_at = step + 1
            tmp = self.file.with_suffix(".tmp")
            tmp.write_text(str(self.stop_at))
            tmp.replace(self.file)
        if self.stop_at is None:
            self.stop_at = self._read()
        return self.stop_at is not None and step >= self.stop_at


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
    # the start of training: after the rendezvous and DDP's parameter broadcast (start-up,
    # reported apart from the budget, as fusion's weight shipping and hivemind's DHT are)
    t0 = time.perf_counter()
    startup_s = t0 - T_PROCESS
    clock = SnapshotClock(args.snapshot_interval)
    stop = StopAgreement(args.stop_dir, args.rank, args.world, args.budget)
    events: list[tuple[float, int, float | None, int]] = []
    snaps = 0
    step = 0
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
        if stop.done(step, t):
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


def pipeline_bounds(n_blocks: int, world: int) -> list[tuple[int, int]]:
    """Equal transformer blocks per stage (`round(i * n / k)` boundaries, as an even
    torch.distributed.pipelining split): (lo, hi) of each stage."""
    if not 1 <= world <= n_blocks:
        raise SystemExit(f"{world} pipeline stages need 1..{n_blocks} blocks each")
    cuts = [round(i * n_blocks / world) for i in range(world + 1)]
    return list(itertools.pairwise(cuts))


def run_pipeline(args: argparse.Namespace, wl: Workload, spec: JobSpec) -> None:
    """(1): torch.distributed.pipelining with equal blocks per stage and 1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    source = make_source(spec.data, spec.seed)
    model = build_model(spec.model, seed=spec.seed)
    net: Any = model
    n_blocks = len(net.transformer.h)
    lo, hi = pipeline_bounds(n_blocks, args.world)[args.rank]
    first, last = args.rank == 0, args.rank == args.world - 1
    part = StagePart(model, lo, hi, first, last)
    del model, net  # the other stages' blocks are freed: a stage holds only its own
    lossf = loss_fn(spec.loss)
    micro = wl.micro_batches
    stage = PipelineStage(part, args.rank, args.world, torch.device("cpu"))
    # every rank passes the loss: the schedule runs backward only where it has one
    schedule = Schedule1F1B(stage, n_microbatches=micro, loss_fn=lossf)
    # the embedding is tied to the head: one parameter held by the first and the last stage
    tied = dist.new_group([0, args.world - 1]) if args.world > 1 else None
    tied_param: Any = (part.wte.weight if first else part.lm_head.weight if last else None)
    opt = make_optimizer(spec.optimizer, part.parameters())
    t0 = time.perf_counter()  # the rendezvous done, the stage built: training starts
    startup_s = t0 - T_PROCESS
    stop = StopAgreement(args.stop_dir, args.rank, args.world, args.budget)
    events: list[tuple[float, int, float | None, int]] = []
    step = 0
    while True:
        full = source.batch(step, wl.batch)
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(full.inputs)
        elif last:
            schedule.step(target=full.targets, losses=losses)
        else:
            schedule.step()
        if tied is not None and tied_param is not None and tied_param.grad is not None:
            dist.all_reduce(tied_param.grad, group=tied)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = time.perf_counter() - t0
        loss = float(torch.stack(losses).mean().detach()) if losses else None
        events.append((t, step, loss, (step + 1) * wl.tokens_per_step))
        save_part(args.snapshot_dir, args.rank, step, part.full_state())
        if stop.done(step, t):
            break
        step += 1
    if args.rank == 0:
        Path(args.out).write_text(Trace("pipeline", events, {
            "world": args.world, "micro_batches": micro, "startup_s": startup_s,
            "blocks": pipeline_bounds(n_blocks, args.world),
            "hosts": args.hosts.split(",") if args.hosts else [],
        }).to_json())


if __name__ == "__main__":
    main()
