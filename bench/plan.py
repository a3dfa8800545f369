"""Planner benchmark: uniform split vs OP-Fence vs OP-Fence + AdaTopK on reference topologies.

Captures the real models (GPT-2 small and ResNet-101 from `fusiond.models`, through
`fusiond.graph.capture`), estimates them (`fusiond.plan.cost_graph_from_ir`) and plans each on
the three topologies in `bench/topologies/` (48 machines each, 8 Mbit/s to 10 Gbit/s links,
three GPU kinds). Prints predicted throughput of (a) a uniform split (equal ops per machine,
machines in id order, no compression), (b) OP-Fence without compression, (c) OP-Fence +
AdaTopK, the speed-ups (b)/(a) and (c)/(a), each plan's bottleneck, and the planning time.

    .venv/bin/python bench/plan.py [--models gpt2-small,resnet101] [--show-plan]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fusiond.graph.capture import capture
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.models.resnet import classification_loss, resnet101
from fusiond.plan import (
    CostGraph,
    JobSettings,
    Plan,
    cluster_from_topology,
    cost_graph_from_ir,
    plan_opfence,
    render_plan,
    uniform_plan,
)

HERE = Path(__file__).resolve().parent
TARGET = 1.45


def model_costs(name: str) -> tuple[CostGraph, JobSettings]:
    """Capture a small example, then evaluate the costs at the benchmark's sizes."""
    torch.manual_seed(0)
    if name == "gpt2-small":
        model = gpt2("small")
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        cm = capture(model, [x], targets=x, loss=lm_loss,
                     dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
        cg = cost_graph_from_ir(cm.graph, {"batch": 8, "seq": 512}, name=name)
        return cg, JobSettings(micro_batch_size=8, num_micro_batches=16)
    if name == "resnet101":
        model = resnet101()
        x = torch.randn(2, 3, 224, 224)
        y = torch.randint(0, 1000, (2,))
        cm = capture(model, [x], targets=y, loss=classification_loss)
        cg = cost_graph_from_ir(cm.graph, {"batch": 32}, name=name)
        return cg, JobSettings(micro_batch_size=32, num_micro_batches=16)
    raise SystemExit(f"unknown model {name!r}")


def run(models: list[str], show: bool) -> tuple[list[dict[str, Any]], list[str]]:
    rows: list[dict[str, Any]] = []
    shown: list[str] = []
    topos = sorted((HERE / "topologies").glob("*.json"))
    for mname in models:
        t0 = time.perf_counter()
        cg, settings = model_costs(mname)
        cap_s = time.perf_counter() - t0
        for tp in topos:
            spec = json.loads(tp.read_text())
            cluster, _ = cluster_from_topology(spec)
            plans: dict[str, Plan] = {}
            secs: dict[str, float] = {}
            for label in ("a", "b", "c"):
                t1 = time.perf_counter()
                if label == "a":
                    plans[label] = uniform_plan(cg, cluster, settings)
                else:
                    plans[label] = plan_opfence(cg, cluster, settings, compress=label == "c")
                secs[label] = time.perf_counter() - t1
            a, b, c = plans["a"], plans["b"], plans["c"]
            rows.append({
                "model": mname, "topology": spec["name"], "ops": len(cg.ops),
                "capture_s": cap_s,
                "a": a.samples_per_s, "b": b.samples_per_s, "c": c.samples_per_s,
                "b/a": b.samples_per_s / a.samples_per_s,
                "c/a": c.samples_per_s / a.samples_per_s,
                "bott_a": a.evaluation.bottleneck, "bott_b": b.evaluation.bottleneck,
                "bott_c": c.evaluation.bottleneck,
                "stages_b": len(b.stages), "stages_c": len(c.stages),
                "mem_a": "ok" if a.evaluation.memory_ok else "OVER",
                "plan_s_b": secs["b"], "plan_s_c": secs["c"],
                "densities": sorted({round(d, 3) for d in c.densities.values()}),
            })
            if show:
                shown += [render_plan(p) for p in (a, b, c)]
    return rows, shown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,resnet101")
    ap.add_argument("--show-plan", action="store_true", help="also print every plan's table")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, shown = run(args.models.split(","), args.show_plan)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("predicted samples/s: (a) uniform, (b) OP-Fence, (c) OP-Fence + AdaTopK; "
          "GPT-2 small: micro-batch 8 x 512 tokens, ResNet-101: 32 x 224^2; 16 micro-batches")
    hdr = (f"{'model':<11}{'topology':<10}{'(a)':>9}{'(b)':>9}{'(c)':>9}"
           f"{'b/a':>9}{'c/a':>9}{'c/b':>6}"
           f"  {'bottleneck (a)':<24}{'bottleneck (b)':<24}{'bottleneck (c)':<24}"
           f"{'stages b/c':>11}{'plan s b/c':>12}  densities (c)")
    print(hdr)
    worst = float("inf")
    for r in rows:
        worst = min(worst, r["c/a"])
        dens = ",".join(f"{d:g}" for d in r["densities"][:4]) or "-"
        print(f"{r['model']:<11}{r['topology']:<10}{r['a']:>9.3g}{r['b']:>9.3g}{r['c']:>9.3g}"
              f"{r['b/a']:>9.1f}{r['c/a']:>9.1f}{r['c'] / r['b']:>6.2f}"
              f"  {r['bott_a'][:23]:<24}{r['bott_b'][:23]:<24}"
              f"{r['bott_c'][:23]:<24}{r['stages_b']:>5}/{r['stages_c']:<5}"
              f"{r['plan_s_b']:>6.2f}/{r['plan_s_c']:<5.2f}  {dens}"
              + ("" if r["mem_a"] == "ok" else "  (a) over memory"))
    print(f"\nworst (c)/(a): {worst:.2f}x (target >= {TARGET}x)")
    for s in shown:
        print("\n" + s)
    return 0 if worst >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
