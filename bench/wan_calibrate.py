"""Where `bench/wan.py`'s held-out target sits on this workload's learning curve (issue 14).

Trains the yardstick's workload (`bench.wan_common.Workload`: the same model, training split,
global batch, micro-batches and optimizer) in this process on one thread, evaluating the dense
weights on the same held-out windows as `bench/wan.py` every `--every` steps, and prints the
curve with its CPU seconds per step: where the descent flattens into the plateau, and how many
steps (and so how many seconds on a host of a given CPU quota) a target needs.

    python bench/wan_calibrate.py [--steps 150] [--every 5] [--lr 1e-3] [--batch 16]
                                  [--betas 0.9,0.95]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--betas", default="",
                    help="AdamW's betas, e.g. 0.9,0.95 (default: the job's, 0.9,0.999)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-mb", type=float, default=2.0)
    ap.add_argument("--heldout-kb", type=float, default=256.0)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--work", default="out/wan-calibrate")
    args = ap.parse_args()

    import torch

    from bench.wan import prepare_data
    from bench.wan_common import Workload
    from bench.wan_eval import heldout_loss
    from fusiond.train.data import make_source
    from fusiond.train.local import ReferenceTrainer
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import parse_job

    torch.set_num_threads(1)
    wl0 = Workload(seed=args.seed)
    args.seq = wl0.seq_len
    data = prepare_data(args, Path(args.work))
    wl = Workload(size="mini", batch=args.batch, lr=args.lr, seed=args.seed, n_layer=6,
                  n_embd=256, n_head=4, corpus=str(data.train_path))
    toml = wl.job_toml(adatopk=False)
    if args.betas:
        b1, b2 = (float(x) for x in args.betas.split(","))
        toml = toml.replace('kind = "adamw"', f'kind = "adamw"\nbetas = [{b1}, {b2}]', 1)
    spec = parse_job(toml)
    model = build_model(spec.model, seed=spec.seed)
    lossf = loss_fn(spec.loss)
    rt = ReferenceTrainer(model, lossf, spec.optimizer, data=make_source(spec.data, spec.seed),
                          batch_size=wl.batch, micro_batches=wl.micro_batches,
                          total_steps=args.steps)
    print(f"workload: GPT-2 {wl.size} {wl.model_overrides()}, batch {wl.batch} x "
          f"{wl.seq_len}, {wl.micro_batches} micro-batches, AdamW lr {wl.lr}")
    print(f"{'steps':>6} {'held-out':>9} {'cpu s/step':>11}")
    print(f"{0:>6} {heldout_loss(model, data.heldout, lossf):>9.3f} {'-':>11}")
    cpu = 0.0
    for step in range(args.steps):
        t = time.process_time()
        rt.step(step)
        cpu += time.process_time() - t
        if (step + 1) % args.every == 0:
            print(f"{step + 1:>6} {heldout_loss(model, data.heldout, lossf):>9.3f} "
                  f"{cpu / (step + 1):>11.3f}", flush=True)


if __name__ == "__main__":
    main()
