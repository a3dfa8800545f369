"""The GPU check (issue 18), for one machine with a CUDA GPU; `scripts/gpu-check` sets up and
runs it (about 5 minutes on an H100/H200).

    python bench/gpu.py                 # every part
    python bench/gpu.py --skip-cluster  # the in-process parts only

What it runs, each a row of the table with PASS or FAIL (non-zero exit on a miss):
1. Exactness on the GPU: GPT-2 small captured as 1 and as 4 partitions (the in-process
   remote-autodiff driver, `fusiond.graph.Driver`, on cuda:0) against the eager model on
   cuda:0, fp32 with TF32 off and deterministic algorithms asked for: the loss and every
   parameter gradient within 1e-5 relative (gradient: ||captured - eager|| / ||eager||).
2. Speed on the GPU: forward + backward of the captured graph against eager, interleaved,
   best of N after warm-up, each timed with CUDA events (target: at most 1.15x for one
   partition, 1.25x for four).
3. The stage executor on the GPU (`pytest -m gpu`): partitioned equals unpartitioned on the
   GPU, a CPU stage beside a GPU stage matches the all-CPU run, bf16 on the GPU cut in three
   trains as one stage. The tests must run, not skip.
4. A 3-daemon local cluster on this GPU (`fusionctl local up -n 3 --benchmark`, real daemons
   on loopback with mutual TLS; each profiles the GPU and offers it), GPT-2 mini in bf16
   (`job.device = "cuda"`, `job.precision = "bf16"`) cut in 3 by `fusionctl submit --stages
   3`, 50 steps: the loss falls, and its samples per second are printed against the same
   model trained eagerly in bf16 in one process on the GPU (the same batches and optimizer).
   The cluster's three stages share one GPU over loopback, so this row checks that a
   cluster trains on a GPU, not that it is faster than one process (it is not; the ratio is
   printed as measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.graph import best_of, captured_gpt2  # noqa: E402
from fusiond.graph import Driver, contiguous_assignment  # noqa: E402
from fusiond.models.gpt2 import lm_loss  # noqa: E402

TARGET_ONE = 1.15
TARGET_MANY = 1.25
EXACT_REL = 1e-5
CLUSTER_STEPS = 50

JOB = """[job]
name = "gpu-check"
steps = {steps}
seed = 0
device = "{device}"
precision = "bf16"
output = "{out}"

[model]
zoo = "gpt2"
config = {{ size = "mini", vocab_size = 256 }}

[data]
seq_len = 64

[optimizer]
lr = 2e-3
weight_decay = 0.1
schedule = "cosine"
warmup_steps = 5

[batch]
size = 32
micro_batches = 4

[compression]
adatopk = false
"""


class Table:
    """Rows of (check, figure, target, PASS/FAIL)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, bool | None]] = []

    def add(self, check: str, figure: str, target: str, ok: bool | None) -> None:
        self.rows.append((check, figure, target, ok))
        verdict = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {check:<44} {figure:<34} {target:<14} {verdict}", flush=True)

    @property
    def failed(self) -> bool:
        return any(ok is False for *_, ok in self.rows)

    def render(self) -> str:
        out = [f"  {'check':<44} {'measured':<34} {'target':<14} result"]
        for check, fig, target, ok in self.rows:
            verdict = "" if ok is None else ("PASS" if ok else "FAIL")
            out.append(f"  {check:<44} {fig:<34} {target:<14} {verdict}")
        return "\n".join(out)


def cuda_time(fn: Callable[[], object], repeats: int, dev: str = "cuda") -> float:
    """Best of `repeats` runs of `fn` in seconds, timed with CUDA events after one warm-up
    (with `time.perf_counter` on the CPU: the smoke run)."""
    if not dev.startswith("cuda"):
        return best_of(fn, repeats)
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()  # type: ignore[no-untyped-call]
        fn()
        end.record()  # type: ignore[no-untyped-call]
        end.synchronize()  # type: ignore[no-untyped-call]
        best = min(best, start.elapsed_time(end) / 1e3)  # type: ignore[no-untyped-call]
    return best


def check_captured(table: Table, dev: str, size: str, batch: int, seq: int, parts: int,
                   repeats: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    model, x, y, cap, cap_s = captured_gpt2(size, batch, seq)
    print(f"captured GPT-2 {size} in {cap_s:.1f} s ({len(cap.graph.nodes)} nodes)", flush=True)
    model.to(dev)
    xd, yd = x.to(dev), y.to(dev)
    drivers = {1: Driver(cap.graph, contiguous_assignment(cap.graph, 1), cap.state, device=dev),
               parts: Driver(cap.graph, contiguous_assignment(cap.graph, parts, by="params"),
                             cap.state, device=dev)}

    def eager() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(xd), yd)
        loss.backward()
        return loss.detach()

    def run(d: Driver) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            d.zero_grad()
            return d.forward_backward([xd, yd])["loss"]

        return step

    want = float(eager())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    for n, d in drivers.items():
        got = float(run(d)())
        loss_rel = abs(got - want) / abs(want)
        mine = d.named_grads()
        worst, name = 0.0, ""
        missing = [k for k in grads if k not in mine]
        for k, g in grads.items():
            if k in mine:
                rel = float((mine[k].to(g.device) - g).norm() / g.norm().clamp_min(1e-30))
                if rel > worst:
                    worst, name = rel, k
        ok = loss_rel <= EXACT_REL and worst <= EXACT_REL and not missing
        table.add(f"fp32 on {dev}, {n} partition(s) vs eager",
                  f"loss {loss_rel:.1e}, grad {worst:.1e}{' (' + name + ')' if name else ''}"
                  [:34] + (f", {len(missing)} missing" if missing else ""),
                  f"<= {EXACT_REL:g} rel", ok)
    te = t1 = tn = float("inf")
    for _ in range(repeats):  # interleaved: the GPU's clocks and the host's noise hit all alike
        te = min(te, cuda_time(eager, 1, dev))
        t1 = min(t1, cuda_time(run(drivers[1]), 1, dev))
        tn = min(tn, cuda_time(run(drivers[parts]), 1, dev))
    smoke = not dev.startswith("cuda")
    table.add(f"fwd+bwd GPT-2 {size} b{batch}x{seq}, eager", f"{te * 1e3:.2f} ms", "", None)
    table.add("  captured, 1 partition / eager", f"{t1 / te:.3f} ({t1 * 1e3:.2f} ms)",
              f"<= {TARGET_ONE}", None if smoke else t1 / te <= TARGET_ONE)
    table.add(f"  captured, {parts} partitions / eager", f"{tn / te:.3f} ({tn * 1e3:.2f} ms)",
              f"<= {TARGET_MANY}", None if smoke else tn / te <= TARGET_MANY)
    drivers.clear()
    model.cpu()
    torch.cuda.empty_cache()


def check_gpu_tests(table: Table) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs",
                          "-p", "no:randomly", "tests/train/test_device.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    tail = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-200:]
    ran = out.returncode == 0 and "passed" in tail and not any(
        word in tail for word in ("skipped", "failed", "error"))
    if not ran:
        print(out.stdout[-3000:], out.stderr[-2000:], sep="\n")
    table.add("pytest -m gpu (stage executor on the GPU)", tail[:34], "all pass", ran)


def eager_bf16(job: Path, dev: str, steps: int) -> tuple[float, list[float]]:
    """Samples per second (median step) and losses of the job's model trained eagerly in bf16
    on `dev` in this process: the same batches, micro-batches and optimizer as the job."""
    from fusiond.train.data import Batch, make_source, split_micro_batches
    from fusiond.train.model import build_model, loss_fn, output_tensor
    from fusiond.train.optim import lr_at, make_optimizer, set_lr
    from fusiond.train.spec import load_job

    spec = load_job(job)
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, seed=spec.seed).to(dev)
    loss = loss_fn(spec.loss)
    source = make_source(spec.data, spec.seed)
    opt = make_optimizer(spec.optimizer, list(model.parameters()))
    m = spec.batch.micro_batches
    times, losses = [], []
    kind = torch.device(dev).type
    for step in range(steps):
        if kind == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        batch: Batch = source.batch(step, spec.batch.size)
        total = torch.zeros((), device=dev)
        for mb in split_micro_batches(batch, m):
            x, y = mb.inputs.to(dev, non_blocking=True), mb.targets.to(dev, non_blocking=True)
            with torch.autocast(device_type=kind, dtype=torch.bfloat16):
                out = output_tensor(model(x))
            value = loss(out.float(), y)
            (value / m).backward()
            total += value.detach()
        set_lr(opt, lr_at(spec.optimizer, step, spec.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(total) / m)
        times.append(time.perf_counter() - t0)
    times.sort()
    return spec.batch.size / times[len(times) // 2], losses


def check_cluster(table: Table, dev: str, steps: int) -> None:
    ctl = [sys.executable, "-m", "fusionctl"]
    with tempfile.TemporaryDirectory(prefix="fusion-gpu-check-") as d:
        job = Path(d) / "gpu-check.toml"
        out_dir = Path(d) / "out"
        job.write_text(JOB.format(steps=steps, out=out_dir,
                                  device="cuda" if dev.startswith("cuda") else "cpu"))
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        up = subprocess.run([*ctl, "local", "up", "-n", "3", "--dir", f"{d}/cluster",
                             "--discovery", "bootstrap", "--benchmark", "--wait", "180"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                            check=False)
        try:
            if up.returncode != 0:
                table.add("3-daemon cluster on the GPU", f"local up failed ({up.returncode})",
                          "trains", False)
                print(up.stdout[-2000:], up.stderr[-3000:], sep="\n")
                return
            env["FUSION_API_SOCKET"] = f"{d}/cluster/node0/fusiond.sock"
            status = subprocess.run([*ctl, "status", "--json"], cwd=ROOT, env=env,
                                    capture_output=True, text=True, timeout=60, check=False)
            prof = json.loads(status.stdout or "{}").get("node", {}).get("profile", {})
            devices = prof.get("devices") or []
            on_gpu = dev.startswith("cuda")
            table.add("daemon offers the GPU in its profile",
                      f"{len(devices)} device(s), error {prof.get('device_error') or '-'}"[:34],
                      ">= 1" if on_gpu else "(smoke)",
                      bool(devices) and not prof.get("device_error") if on_gpu else None)
            t0 = time.perf_counter()
            run = subprocess.run([*ctl, "submit", str(job), "--stages", "3", "--force"],
                                 cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=420, check=False)
            wall = time.perf_counter() - t0
            if run.returncode != 0:
                table.add("3-daemon cluster, bf16, 50 steps", f"submit exited {run.returncode}",
                          "trains", False)
                print(run.stdout[-2000:], run.stderr[-4000:], sep="\n")
                return
            metrics = json.loads((out_dir / "metrics.json").read_text())
            rows = metrics["steps"]
            losses = [r["loss"] for r in rows]
            head, tail = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
            rates = sorted(r["samples_per_s"] for r in rows[len(rows) // 5:])
            rate = rates[len(rates) // 2]
            table.add("3-daemon cluster, bf16, loss first/last 5",
                      f"{head:.3f} -> {tail:.3f} ({wall:.0f} s in all)", "falls", tail < head)
            eager_rate, eager_losses = eager_bf16(job, dev, steps)
            table.add("  samples/s: cluster / one process bf16",
                      f"{rate:.0f} / {eager_rate:.0f} = {rate / eager_rate:.2f}x", "(printed)",
                      None)
            e_head, e_tail = sum(eager_losses[:5]) / 5, sum(eager_losses[-5:]) / 5
            table.add("  one process bf16, loss first/last 5", f"{e_head:.3f} -> {e_tail:.3f}",
                      "(printed)", None)
        finally:
            subprocess.run([*ctl, "local", "down", "--dir", f"{d}/cluster"], cwd=ROOT,
                           capture_output=True, timeout=120, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--size", default="small", help="GPT-2 size for parts 1-2 (default small)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--steps", type=int, default=CLUSTER_STEPS)
    ap.add_argument("--skip-cluster", action="store_true")
    ap.add_argument("--skip-tests", action="store_true")
    args = ap.parse_args()
    smoke = args.device == "cpu"
    if smoke:  # every part but the gpu tests, on the CPU, no target enforced: catches misuse
        print("a smoke run on the CPU (--device cpu): no GPU figure; timing targets not "
              "enforced", flush=True)
    elif not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False; torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}). Run it on a machine with an "
              "NVIDIA GPU and a CUDA build of torch.", file=sys.stderr)
        return 2
    name = "CPU (smoke run)" if smoke else torch.cuda.get_device_name(torch.device(args.device))
    print(f"GPU check on {args.device}: {name}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda})", flush=True)
    t0 = time.perf_counter()
    table = Table()
    check_captured(table, args.device, args.size, args.batch, args.seq, args.parts,
                   args.repeats)
    if not args.skip_tests and not smoke:
        check_gpu_tests(table)
    if not args.skip_cluster:
        check_cluster(table, args.device, args.steps)
    print(f"\nGPU check on {name} ({time.perf_counter() - t0:.0f} s)")
    print(table.render())
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
