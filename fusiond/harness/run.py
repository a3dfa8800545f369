"""`python -m fusiond.train JOB.toml`: train a job on N stages in this process, over loopback.

The daemon's job path without daemons: the job file is validated and captured here, a
scheduler and N workers (each with its own PeerNetwork on 127.0.0.1) run it, progress goes to
stderr, and the result is written to the job's output directory (model.safetensors,
metrics.json). For text jobs a short sample of generated text is printed at the end.
Exit status: 0 the job finished, 1 it failed (the report names machine, stage, step, cause),
2 the job was refused (bad file, model, data).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from fusiond.errors import FusionError
from fusiond.graph import contiguous_assignment
from fusiond.harness.inproc import inproc_cluster, run_job
from fusiond.harness.node import spawn_nodes
from fusiond.jobs.assign import layout_job
from fusiond.jobs.coordinator import JobCoordinator, save_checkpoint, write_outputs
from fusiond.jobs.submit import prepare_job
from fusiond.plan.model import DEVICE_RE
from fusiond.train.local import StepMetrics
from fusiond.train.model import build_model
from fusiond.train.sample import sample_bytes


def _progress(total: int, t0: float) -> tuple[list[float], Callable[[StepMetrics], None]]:
    losses: list[float] = []
    every = max(1, total // 20)

    def on_step(m: StepMetrics) -> None:
        if m.loss is not None:
            losses.append(m.loss)
        done = m.step + 1
        if done % every and done != total:
            return
        d = m.as_dict()
        rate = d["tokens_per_s"] or d["samples_per_s"] or 0.0
        unit = "tokens/s" if d["tokens_per_s"] else "samples/s"
        elapsed = time.perf_counter() - t0
        eta = elapsed / done * (total - done)
        loss = "-" if m.loss is None else f"{m.loss:.4f}"
        busy = " ".join(f"{v:.2f}" for _, v in sorted(m.stage_busy.items()))
        print(f"step {done:>6}/{total}  loss {loss}  {rate:>9.0f} {unit}  busy [{busy}]  "
              f"wire {m.wire_bytes / 1e6:.2f} MB/step  ETA {eta:5.0f}s", file=sys.stderr)

    return losses, on_step


async def _main(args: argparse.Namespace) -> int:
    try:
        job = prepare_job(args.job)
    except FusionError as e:
        print(f"fusion: job refused: {e}", file=sys.stderr)
        return 2
    spec = job.spec
    if args.steps is not None:
        spec = replace(spec, steps=args.steps)
    where = "processes" if args.processes else "one process"
    print(f"{spec.name}: {len(job.captured.graph.nodes)} ops captured in {job.prepare_s:.1f}s; "
          f"{spec.steps} steps on {args.stages} stages (loopback, {where})", file=sys.stderr)
    t0 = time.perf_counter()
    losses, on_step = _progress(spec.steps, t0)
    def on_checkpoint(step: int, state: dict[str, torch.Tensor]) -> None:
        save_checkpoint(spec.output, step, state)

    if not args.processes:
        async with inproc_cluster(args.stages) as nodes:
            outcome = await run_job(
                nodes, spec, job.captured, job_id=spec.name, density=args.density,
                tokens_per_sample=job.tokens_per_sample, on_step=on_step,
                on_checkpoint=on_checkpoint, device=args.device,
            )
    else:
        async with inproc_cluster(1) as here:
            n0 = here["node0"]
            others = [f"node{i}" for i in range(1, args.stages)]
            async with spawn_nodes(others, extra={"node0": n0.net.address}) as procs:
                for p in procs.values():
                    n0.net.add_peer_address(p.name, p.address)
                names = ["node0", *others]
                cut = contiguous_assignment(job.captured.graph, args.stages)
                density = args.density if args.density is not None else spec.compression.density
                layout = layout_job(spec.name, job.captured.graph, job.captured.state,
                                    {op: names[i] for op, i in cut.items()}, density=density,
                                    exact=spec.compression.exact_edges,
                                    encoding=spec.compression.edge_encoding)
                if args.device != "cpu":
                    layout = replace(layout, devices={n: args.device for n in names})
                coord = JobCoordinator(
                    send=n0.send_fn(), spec=spec, captured=job.captured, layout=layout,
                    addresses={"node0": n0.net.address}
                    | {n: p.address for n, p in procs.items()},
                    term=1, tokens_per_sample=job.tokens_per_sample, on_step=on_step,
                    on_checkpoint=on_checkpoint,
                )
                n0.coordinators.append(coord)
                outcome = await coord.run()
    paths = write_outputs(outcome, spec.output)
    if not outcome.ok:
        print(f"fusion: {outcome.failure}", file=sys.stderr)
        return 1
    print(f"done in {outcome.wall_s:.1f}s: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"model {paths['model']}, metrics {paths['metrics']}", file=sys.stderr)
    if (spec.data.is_text and spec.data.tokenizer == "bytes" and spec.loss.kind == "causal_lm"
            and args.sample > 0):  # a sample means next-token prediction
        model = build_model(spec.model)
        assert outcome.state is not None
        model.load_state_dict(outcome.state, strict=True)
        print(sample_bytes(model, args.prompt, length=args.sample,
                           context=spec.data.seq_len))
    return 0


def main() -> None:
    """Entry point."""
    ap = argparse.ArgumentParser(prog="python -m fusiond.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", help="the job file (see docs/jobs.md, examples/)")
    ap.add_argument("--stages", type=int, default=3, help="pipeline stages (default 3)")
    ap.add_argument("--steps", type=int, default=None, help="override job.steps")
    ap.add_argument("--density", type=float, default=None,
                    help="top-k density on every cut edge (default: compression.density)")
    ap.add_argument("--sample", type=int, default=200, help="bytes of text to generate")
    ap.add_argument("--prompt", default="def ", help="prompt for the sample")
    ap.add_argument("--processes", action="store_true",
                    help="run stages 1.. in their own processes (the scheduler and stage 0 "
                         "stay here)")
    ap.add_argument("--device", default="cpu",
                    help="where every stage computes: cpu (default) or cuda:N (this machine's "
                         "GPU N; stages share it)")
    args = ap.parse_args()
    if args.stages < 1:
        ap.error("--stages must be >= 1")
    if not DEVICE_RE.fullmatch(args.device):
        ap.error(f"--device must be cpu or cuda:N, got {args.device!r}")
    sys.exit(asyncio.run(_main(args)))


if __name__ == "__main__":
    main()
