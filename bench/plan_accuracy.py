"""Estimator accuracy: predicted vs measured forward+backward time of GPT-2 partitions, here.

Calibrates this machine (`fusiond.profile.calibrate`), captures GPT-2 (tiny and small by default),
cuts each into contiguous partitions, runs every partition's forward and backward with remote-
autodiff semantics (`fusiond.graph.driver.Driver`) and compares the measured time per partition
with the estimator's prediction (and, beside it, the error with every product priced at the big
matmul's rate, as before the calibration had a rate per product size). Prints a table; exits 1
if any partition is off by more than `--tolerance` (default 25 %).

    .venv/bin/python bench/plan_accuracy.py [--models tiny,small] [--batch 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from fusiond.graph.capture import capture
from fusiond.graph.driver import Driver
from fusiond.graph.partition import contiguous_assignment
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.plan.estimator import cost_graph_from_ir
from fusiond.plan.model import SMALL_MATMUL, TINY_MATMUL, op_times
from fusiond.profile.calibrate import calibrate


def _timed(fn: Callable[..., Any], acc: list[float]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **k)
        acc.append(time.perf_counter() - t0)
        return out

    return wrapper


def measure(size: str, batch: int, seq: int, parts: int, repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = gpt2(size)
    seq = min(seq, model.config.block_size)
    x = torch.randint(0, model.config.vocab_size, (batch, seq))
    cm = capture(model, [x], targets=x, loss=lm_loss,
                 dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
    graph = cm.graph
    cg = cost_graph_from_ir(graph, {"batch": batch, "seq": seq})
    prof = calibrate(repeats=7)
    print(f"calibrated: {prof.to_dict()}", file=sys.stderr)
    pred_op = op_times(cg, prof, batch)
    # the same calibration with every product at the big matmul's rate (before the rates of
    # smaller products)
    one_rate = dataclasses.replace(
        prof, flops={k: v for k, v in prof.flops.items() if k not in (SMALL_MATMUL, TINY_MATMUL)})
    pred_one = op_times(cg, one_rate, batch)
    idx = cg.index()
    assign = contiguous_assignment(graph, parts)
    drv = Driver(graph, assign, cm.state)
    fw: list[list[float]] = [[] for _ in drv.runners]
    bw: list[list[float]] = [[] for _ in drv.runners]
    for i, r in enumerate(drv.runners):
        r.forward = _timed(r.forward, fw[i])  # type: ignore[method-assign]
        r.backward = _timed(r.backward, bw[i])  # type: ignore[method-assign]
    best = [float("inf")] * len(drv.runners)
    t0 = time.perf_counter()
    drv.forward_backward({"input": x, "targets": x})  # warm-up, and sizes the repeat count
    one = time.perf_counter() - t0
    repeats = max(repeats, min(50, int(0.5 / max(one, 1e-6))))  # >= ~0.5 s of samples
    for rep in range(repeats + 1):
        for i in range(len(drv.runners)):
            fw[i].clear()
            bw[i].clear()
        drv.zero_grad()
        drv.forward_backward({"input": x, "targets": x})
        if rep == 0:
            continue  # warm-up
        for i in range(len(drv.runners)):
            best[i] = min(best[i], sum(fw[i]) + sum(bw[i]))
    rows = []
    for i, p in enumerate(drv.partitions):
        pred = float(sum(pred_op[idx[n]] for n in p.node_ids if n in idx))
        one = float(sum(pred_one[idx[n]] for n in p.node_ids if n in idx))
        rows.append({"model": f"gpt2-{size}", "part": i, "nodes": len(p.node_ids),
                     "batch": batch, "seq": seq, "predicted_s": pred, "measured_s": best[i],
                     "error": pred / best[i] - 1, "error_one_matmul_rate": one / best[i] - 1})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tolerance", type=float, default=0.25)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for size in args.models.split(","):
        rows += measure(size, args.batch, args.seq, args.parts, args.repeats)
    print(f"{'model':<12}{'part':>5}{'nodes':>7}{'batch':>7}{'seq':>6}"
          f"{'predicted ms':>14}{'measured ms':>13}{'error':>9}{'one matmul rate':>17}")
    bad = 0
    for r in rows:
        flag = "" if abs(r["error"]) <= args.tolerance else "  <-- over tolerance"
        bad += bool(flag)
        print(f"{r['model']:<12}{r['part']:>5}{r['nodes']:>7}{r['batch']:>7}{r['seq']:>6}"
              f"{r['predicted_s'] * 1e3:>14.2f}{r['measured_s'] * 1e3:>13.2f}"
              f"{r['error'] * 100:>8.1f}%{r['error_one_matmul_rate'] * 100:>16.1f}%{flag}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
