"""Planner benchmark: OP-Fence against what a competent user would run instead, at a fixed batch.

Captures the real models (GPT-2 small and ResNet-101 from `fusiond.models`, through
`fusiond.graph.capture`), estimates them (`fusiond.plan.cost_graph_from_ir`) and plans each on
the topologies in `bench/topologies/` (48 machines each, 8 Mbit/s to 10 Gbit/s links, three GPU
kinds). Every system trains the same fixed global batch per optimizer step (GPT-2 small: 512
sequences of 512 tokens; ResNet-101: 1536 images; docs/planner.md says why), picks its
micro-batch from the same sizes, and is scored with the planner's own cost model
(`fusiond.plan.pipeline.evaluate`). Systems (`bench/plan_baselines.py`):

    (a) best single machine      (b) even block split (GPipe / torch.distributed.pipelining)
    (c) bandwidth-aware block placement (in the manner of Petals / SWARM / DT-FM)
    (f) DDP + PowerSGD (the k fastest machines that hold the model, every k)
    (d) OP-Fence                 (e) OP-Fence + AdaTopK
    (g) OP-Fence with replicas (pipelines, data parallelism and their mixes as one space)

Replicated stages reduce their gradients once per iteration, low-rank (PowerSGD-style) down to
`--grad-density-floor` (default 0.01, about rank 4 on these models' matrices) where the
reduction would not hide behind the drain; DDP's PowerSGD hook gets the same floor.

Per plan: predicted samples/s, machines used, bottleneck, `fraction_of_aggregate_compute`
(samples/s over the sum of what each machine reaches alone), planning time. Targets per model
and topology: OP-Fence's best >= `--min-ratio` (1.0) x the strongest baseline, and (issue 21)
its fraction of aggregate compute >= 0.6 on campus and 0.4 on geo and volunteer; a miss prints
FAIL and the bench exits 1.

    .venv/bin/python bench/plan.py [--models gpt2-small,resnet101] [--topologies a.json,...]
                                   [--json | --markdown] [--show-plan] [--min-ratio 1.0]
                                   [--grad-density-floor 0.01]

Exit codes: 0 every target met, 1 a target missed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.plan_baselines import (  # noqa: E402
    Outcome,
    Verdict,
    Workload,
    bandwidth_groups,
    compare,
    fraction_of_aggregate_compute,
    verdict,
)
from fusiond.graph.capture import capture  # noqa: E402
from fusiond.models.gpt2 import gpt2, lm_loss  # noqa: E402
from fusiond.models.resnet import classification_loss, resnet101  # noqa: E402
from fusiond.plan import (  # noqa: E402
    Cluster,
    PlanError,
    cluster_from_topology,
    cost_graph_from_ir,
    plan_from_stages,
    render_plan,
)
from protocol import ir  # noqa: E402

#: the data-parallel issue's targets on fraction_of_aggregate_compute
ISSUE21_FRACTION_TARGET: dict[str, float] = {"campus": 0.6, "geo": 0.4, "volunteer": 0.4}
#: PowerSGD at rank 4 sends about 1 % of these models' gradients (GPT-2 small's 768 x 768 to
#: 50257 x 768 matrices: 0.5-1.0 %; ResNet-101's convolutions as out x in*k*k: 0.5-1.6 %;
#: biases and norms dense, 0.1 % of the parameters); rank 4 is where PowerSGD's paper matches
#: full-precision accuracy
GRAD_DENSITY_FLOOR = 0.01


@dataclass(frozen=True)
class ModelSpec:
    """How the bench builds a workload: the model, its global batch, the micro-batch sizes."""

    global_batch: int
    micro_batches: tuple[int, ...]
    sample: str
    block_pattern: str
    capture: Callable[[], ir.Graph]
    symbols: Callable[[int], dict[str, int]]


def _capture_gpt2(size: str) -> Callable[[], ir.Graph]:
    def run() -> ir.Graph:
        torch.manual_seed(0)
        model = gpt2(size)
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        cm = capture(model, [x], targets=x, loss=lm_loss,
                     dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
        return cm.graph
    return run


def _capture_resnet101() -> ir.Graph:
    torch.manual_seed(0)
    model = resnet101()
    x = torch.randn(2, 3, 224, 224)
    y = torch.randint(0, 1000, (2,))
    return capture(model, [x], targets=y, loss=classification_loss).graph


MODELS: dict[str, ModelSpec] = {
    # GPT-2 trained with 512 sequences per step (Radford et al. 2019, of 1024 tokens; the bench
    # keeps its 512-token context)
    "gpt2-small": ModelSpec(512, (2, 4, 8, 16, 32), "sequences of 512 tokens",
                            r"transformer\.h\.\d+", _capture_gpt2("small"),
                            lambda b: {"batch": b, "seq": 512}),
    # torchvision's ImageNet recipe: 32 images per GPU; on 48 GPUs 1536 (Goyal et al. 2017:
    # the linear learning-rate rule holds to 8k)
    "resnet101": ModelSpec(1536, (8, 16, 32, 64, 128), "images of 224x224",
                           r"layer\d+\.\d+", _capture_resnet101, lambda b: {"batch": b}),
    # the bench's own test (tests/bench/test_plan.py): seconds, not a result
    "gpt2-tiny": ModelSpec(32, (8,), "sequences of 64 tokens", r"transformer\.h\.\d+",
                           _capture_gpt2("tiny"), lambda b: {"batch": b, "seq": 64}),
}


def block_bounds(graph: ir.Graph, pattern: str) -> tuple[int, ...]:
    """Where each block (module path matching `pattern`, e.g. `transformer.h.3`) starts in the
    graph's node order, then one past the last block's last op. Raises PlanError when a block's
    ops are not contiguous (a cut at its boundary would not be a block boundary)."""
    rx = re.compile(rf"^({pattern})(?:\.|$)")
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    order: list[str] = []
    for i, node in enumerate(graph.nodes):
        m = rx.match(node.module_path)
        if m is None:
            continue
        key = m.group(1)
        if key not in first:
            if order and i <= last[order[-1]]:
                raise PlanError(f"block {key} starts inside block {order[-1]}")
            first[key] = i
            order.append(key)
        elif key != order[-1]:
            raise PlanError(f"block {key} resumes after block {order[-1]} started")
        last[key] = i
    if not order:
        raise PlanError(f"no module path of the graph matches {pattern!r}")
    return (*(first[k] for k in order), last[order[-1]] + 1)


def build_workload(name: str, grad_density_floor: float = 1.0) -> tuple[Workload, float]:
    """The workload and the capture time in seconds."""
    spec = MODELS[name]
    t0 = time.perf_counter()
    graph = spec.capture()
    graphs = {b: cost_graph_from_ir(graph, spec.symbols(b), name=name)
              for b in spec.micro_batches}
    wl = Workload(name, spec.global_batch, graphs, block_bounds(graph, spec.block_pattern),
                  grad_density_floor)
    return wl, time.perf_counter() - t0


@dataclass(frozen=True)
class Result:
    workload: Workload
    topology: str
    cluster: Cluster
    groups: int
    outcomes: list[Outcome]
    alone: list[float]
    verdict: Verdict

    @property
    def aggregate(self) -> float:
        return float(sum(self.alone))

    def fraction(self, o: Outcome) -> float:
        return fraction_of_aggregate_compute(o.samples_per_s, self.alone)


def run(models: Sequence[str], topologies: Sequence[Path], min_ratio: float,
        grad_density_floor: float = 1.0) -> list[Result]:
    out: list[Result] = []
    for mname in models:
        wl, _ = build_workload(mname, grad_density_floor)
        for tp in topologies:
            spec = json.loads(tp.read_text())
            cluster, _ = cluster_from_topology(spec)
            outcomes, alone = compare(wl, cluster)
            out.append(Result(wl, str(spec.get("name", tp.stem)), cluster,
                              len(bandwidth_groups(cluster)), outcomes, alone,
                              verdict(outcomes, min_ratio)))
    return out


def _kinds(r: Result, o: Outcome) -> str:
    kinds: dict[str, int] = {}
    by_id = {m.id: m for m in r.cluster.machines}
    for i in o.machine_ids:
        k = by_id[i].kind or "?"
        kinds[k] = kinds.get(k, 0) + 1
    return " ".join(f"{k}x{n}" for k, n in kinds.items())


def rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One JSON row per model x topology x system."""
    out: list[dict[str, Any]] = []
    for r in results:
        v = r.verdict
        for o in r.outcomes:
            ev = o.found.evaluation if o.found else None
            out.append({
                "model": r.workload.name, "topology": r.topology, "system": o.system,
                "label": o.label, "fits": o.fits, "note": o.note,
                "global_batch": r.workload.global_batch,
                "micro_batch_size": o.micro_batch_size,
                "num_micro_batches": (r.workload.global_batch // o.micro_batch_size
                                      if o.micro_batch_size else 0),
                "samples_per_s": o.samples_per_s,
                "iteration_s": ev.iteration_s if ev else None,
                "machines_used": o.machines_used, "machines": list(o.machine_ids),
                "machine_kinds": _kinds(r, o),
                "bottleneck": ev.bottleneck if ev else None,
                "fraction_of_aggregate_compute": r.fraction(o),
                "aggregate_samples_per_s": r.aggregate,
                "planning_s": o.planning_s,
                "vs_strongest_baseline": (o.samples_per_s / v.strongest.samples_per_s
                                          if v.strongest else None),
            })
    return out


def verdict_rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for r in results:
        v = r.verdict
        best = v.best
        out.append({
            "model": r.workload.name, "topology": r.topology,
            "strongest_baseline": v.strongest.system if v.strongest else None,
            "strongest_baseline_samples_per_s": v.strongest.samples_per_s if v.strongest else 0,
            "opfence_best": best.system if best else None,
            "opfence_best_samples_per_s": best.samples_per_s if best else 0.0,
            "ratio": v.ratio, "dense_ratio": v.dense_ratio, "min_ratio": v.min_ratio,
            "passed": v.passed,
            "fraction_of_aggregate_compute": r.fraction(best) if best else 0.0,
            "issue21_fraction_target": ISSUE21_FRACTION_TARGET.get(r.topology),
            "fraction_passed": fraction_passed(r),
        })
    return out


def _fmt_rate(x: float) -> str:
    return f"{x:.4g}" if x < 1e4 else f"{x:.0f}"


def _table(r: Result, md: bool) -> list[str]:
    wl, v = r.workload, r.verdict
    sample = MODELS[wl.name].sample if wl.name in MODELS else "samples"
    head = (f"{wl.name} on {r.topology}: {len(r.cluster)} machines in {r.groups} bandwidth "
            f"groups; global batch {wl.global_batch} {sample}; micro-batch from "
            f"{', '.join(map(str, wl.micro_batches))} for every system; aggregate compute "
            f"{_fmt_rate(r.aggregate)} samples/s (each machine alone, summed)")
    cols = ["system", "samples/s", "vs strongest baseline", "machines", "micro-batch x M",
            "bottleneck", "fraction of aggregate", "plan s"]
    body: list[list[str]] = []
    for o in r.outcomes:
        if not o.found:
            body.append([o.label, o.note, "-", "-", "-", "-", "-", f"{o.planning_s:.2f}"])
            continue
        ev = o.found.evaluation
        vs = (f"{o.samples_per_s / v.strongest.samples_per_s:.2f}x" if v.strongest else "-")
        body.append([o.label, _fmt_rate(o.samples_per_s), vs,
                     f"{o.machines_used} ({_kinds(r, o)})",
                     f"{o.micro_batch_size} x {wl.global_batch // o.micro_batch_size}",
                     ev.bottleneck, f"{r.fraction(o):.3f}", f"{o.planning_s:.2f}"])
    lines: list[str] = []
    if md:
        lines += [f"#### {wl.name} on {r.topology}", "", head, "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        lines.append("")
    else:
        widths = [max(len(c), *(len(row[i]) for row in body)) for i, c in enumerate(cols)]
        lines += [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
        lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True))
                  for row in body]
    lines += [("- " if md else "") + _verdict_line(r),
              ("- " if md else "") + _fraction_line(r)]
    return lines


def _verdict_line(r: Result) -> str:
    v = r.verdict
    tag = "PASS" if v.passed else "FAIL"
    if v.best is None:
        ours = "OP-Fence found no plan"
    else:
        ours = f"{v.best.label} {_fmt_rate(v.best.samples_per_s)} samples/s"
    base = (f"strongest baseline {v.strongest.label} {_fmt_rate(v.strongest.samples_per_s)} "
            "samples/s" if v.strongest else "no baseline fits")
    dense = (f"; (d) dense alone {v.dense_ratio:.3f}x, the same wire format as the baselines"
             if v.dense_ratio is not None and v.best is not None
             and v.best.system != "opfence" else "")
    return (f"{tag}  OP-Fence best / strongest baseline >= {v.min_ratio:g}x: {v.ratio:.3f}x "
            f"({ours}; {base}{dense})")


def fraction_passed(r: Result) -> bool | None:
    """Issue 21's target on the fraction of aggregate compute (None: none for this topology)."""
    tgt = ISSUE21_FRACTION_TARGET.get(r.topology)
    if tgt is None:
        return None
    best = r.verdict.best
    return best is not None and r.fraction(best) >= tgt


def _fraction_line(r: Result) -> str:
    best = r.verdict.best
    frac = r.fraction(best) if best else 0.0
    tgt = ISSUE21_FRACTION_TARGET.get(r.topology)
    ok = fraction_passed(r)
    tag = "info" if ok is None else "PASS" if ok else "FAIL"
    goal = f">= {tgt:g}" if tgt is not None else "(no target for this topology)"
    return (f"{tag}  fraction_of_aggregate_compute of OP-Fence best {goal}: {frac:.3f}; "
            f"strongest baseline: "
            f"{r.fraction(r.verdict.strongest) if r.verdict.strongest else 0.0:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,resnet101",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--topologies", default="",
                    help="comma-separated topology files (default: bench/topologies/*.json)")
    ap.add_argument("--show-plan", action="store_true", help="also print every plan's table")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the rows as JSON")
    out.add_argument("--markdown", action="store_true", help="print the tables as Markdown")
    ap.add_argument("--min-ratio", type=float, default=1.0,
                    help="target: OP-Fence best >= this x the strongest baseline (default 1.0)")
    ap.add_argument("--grad-density-floor", type=float, default=GRAD_DENSITY_FLOOR,
                    help="the least share of a replicated stage's gradient bytes its reduction "
                         f"may send, for DDP's PowerSGD hook and OP-Fence alike (default "
                         f"{GRAD_DENSITY_FLOOR:g}; 1 = dense)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    topos = ([Path(p) for p in args.topologies.split(",") if p] if args.topologies
             else sorted((HERE / "topologies").glob("*.json")))
    missing = [str(p) for p in topos if not p.is_file()]
    if missing or not topos:
        ap.error(f"topology file(s) not found: {missing or '(none given)'}")
    if not args.min_ratio > 0:
        ap.error("--min-ratio must be > 0")
    if not 0 < args.grad_density_floor <= 1:
        ap.error("--grad-density-floor must be in (0, 1]")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    results = run(models, topos, args.min_ratio, args.grad_density_floor)
    ok = all(r.verdict.passed and fraction_passed(r) is not False for r in results)
    if args.json:
        print(json.dumps({"rows": rows(results), "verdicts": verdict_rows(results)}, indent=1))
        return 0 if ok else 1
    for r in results:
        print("\n".join(_table(r, args.markdown)))
        print()
    passed = sum(r.verdict.passed for r in results)
    fr = [f for f in map(fraction_passed, results) if f is not None]
    print(f"{passed} of {len(results)} targets met (OP-Fence best >= {args.min_ratio:g}x the "
          f"strongest baseline); {sum(fr)} of {len(fr)} fraction-of-aggregate-compute targets "
          f"met; bench took {time.perf_counter() - t0:.0f} s")
    if args.show_plan:
        for r in results:
            for o in r.outcomes:
                if not o.found:
                    continue
                b = o.micro_batch_size
                fusion = o.system == "opfence+replicas"
                plan = plan_from_stages(r.workload.graphs[b], r.cluster,
                                        r.workload.settings(b, fusion=fusion),
                                        o.found.stages, compress=o.system == "opfence+adatopk")
                print(f"\n{r.workload.name} on {r.topology}, {o.label}:\n{render_plan(plan)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
