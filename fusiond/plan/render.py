"""A plan as a readable plain-text table (what `fusionctl plan JOB` prints), and as structured
data (`plan_summary`: what `fusionctl plan --json` carries next to the table, so a script or a
test reads stages, cut and links without parsing text)."""

from __future__ import annotations

from typing import TypedDict

from fusiond.plan.pipeline import LinkReport, Plan, StageReport
from fusiond.units import bits_per_s_from_bytes_per_s


class PlanStageSummary(TypedDict):
    """One stage: machine `machine_id` runs the cost graph's ops [`start_op`, `stop_op`)."""

    stage: int
    machine_id: str
    start_op: int
    stop_op: int
    first_op: str
    last_op: str
    compute_s: float
    memory_bytes: float
    memory_cap_bytes: float
    """The memory the stage's machine offers (its predicted peak is `memory_bytes`)."""
    recompute: bool
    """It recomputes its activations in the backward (they would not fit kept)."""
    offload: bool
    """It keeps its optimizer state on disk (it would not fit in memory)."""
    checkpoint_blocks: list[int]
    """The blocks it checkpoints (the per-block memory plan; indices into its blocks)."""
    blocks: int
    """How many blocks the stage has (`fusiond.plan.memory.stage_blocks`)."""
    offload_params: bool
    """It keeps its weights and gradients on disk too."""
    replica_machine_ids: list[str]
    """The stage's other machines (data parallelism), each running its share of the
    micro-batches; empty for a stage on one machine."""
    micro_batches: list[int]
    """Micro-batches per iteration of `machine_id`, then of each replica."""
    samples: list[int]
    """Samples per iteration of each, in the same order: its micro-batches x the job's size,
    or the sizes of its own the plan gave it (`StageReport.sizes`)."""
    in_flight: int
    """Micro-batches whose activations it holds at once (1F1B: min(M, S - i), or more where
    the plan covers a slow link's round trip with them; GPipe: M)."""


class PlanSyncSummary(TypedDict):
    """One replicated stage's gradient reduction, once per iteration."""

    stage: int
    machine_ids: list[str]
    grad_bytes: float
    density: float
    scheme: str
    slowest_bytes_per_s: float
    time_s: float
    exposed_s: float
    buckets: int
    """The buckets it goes in, one after another, during the last backward where it can."""


class PlanLinkSummary(TypedDict):
    """One directed stage pair's link as the planner saw it (bytes per second: the planner's
    unit; `fusionctl` shows it in bits)."""

    src_stage: int
    dst_stage: int
    src_machine_id: str
    dst_machine_id: str
    bandwidth_fwd_bytes_per_s: float
    bandwidth_bwd_bytes_per_s: float
    rtt_s: float
    fwd_bytes: float
    bwd_bytes: float
    density: float
    time_s: float
    dense_time_s: float
    """The link's time per micro-batch in the same cut without compression."""
    codec: str
    """How it travels: "exact", "top-k <d>", "bf16", "int8", "int4" (`LinkReport.codec`)."""


class PlanSummary(TypedDict):
    """A plan's decisions and prediction as plain data."""

    method: str
    machines: list[str]
    """Every machine the planner was given, in the cluster's order."""
    stages: list[PlanStageSummary]
    links: list[PlanLinkSummary]
    """Every link between stages (`render_plan` shows the busiest)."""
    syncs: list[PlanSyncSummary]
    """The gradient reductions of replicated stages."""
    idle: dict[str, str]
    iteration_s: float
    samples_per_s: float
    bottleneck: str
    graph_name: str
    micro_batch_size: int
    num_micro_batches: int
    schedule: str
    bottleneck_s: float
    """The bottleneck's time per micro-batch."""
    compute_bottleneck_s: float
    fill_s: float
    optimizer_s: float
    sync_s: float
    """The tied-weight exchange per iteration."""
    grad_sync_s: float
    """What the replicas' gradient reductions add to the iteration (not hidden)."""
    adatopk_gain: float | None
    """AdaTopK's predicted speed-up over the same cut dense (None: no edge compressed)."""
    over_memory: list[str]
    unrunnable: list[str]
    notes: list[str]


def _blocks_in(plan: Plan, start: int, stop: int) -> int:
    """Blocks of ops [start, stop) (`stage_blocks`' count)."""
    starts = plan.arrays.graph.block_starts or range(len(plan.arrays.graph))
    return 1 + sum(1 for p in starts if start < p < stop)


def _samples(plan: Plan, r: StageReport) -> int:
    """The samples `r` runs per iteration."""
    return sum(r.sizes) if r.sizes else r.micro_batches * plan.arrays.settings.micro_batch_size


def _raised_in_flight(plan: Plan, r: StageReport) -> bool:
    """Whether the plan keeps more micro-batches in flight on `r` than 1F1B's own."""
    return (plan.arrays.settings.schedule == "1f1b"
            and r.inflight > min(r.micro_batches, len(plan.stages) - r.index))


def _memory_note(plan: Plan, r: StageReport) -> str:
    """A stage's memory decisions, as `fusionctl plan` prints them."""
    out = "  recompute" if r.recompute else ""
    if _raised_in_flight(plan, r):
        out += f"  {r.inflight} in flight"
    if r.checkpoint_blocks:
        out += f"  checkpoint {len(r.checkpoint_blocks)}/{_blocks_in(plan, r.start, r.stop)}"
    out += "  offload" if r.offload else ""
    return out + ("  weights-on-disk" if r.offload_params else "")


def plan_summary(plan: Plan) -> PlanSummary:
    """Stages (machine ids, op ranges), links (bytes/s, bytes, density) and the prediction."""
    ev = plan.evaluation
    ids = plan.arrays.cluster.ids()
    st = plan.arrays.settings
    dense_links = {(lk.src_stage, lk.dst_stage): lk for lk in plan.dense.links}
    return PlanSummary(
        method=plan.method,
        machines=ids,
        stages=[PlanStageSummary(stage=r.index, machine_id=r.machine_id, start_op=r.start,
                                 stop_op=r.stop, first_op=r.first_op, last_op=r.last_op,
                                 compute_s=r.compute_s, memory_bytes=r.memory_bytes,
                                 memory_cap_bytes=r.memory_cap, recompute=r.recompute,
                                 offload=r.offload,
                                 checkpoint_blocks=list(r.checkpoint_blocks),
                                 blocks=_blocks_in(plan, r.start, r.stop),
                                 offload_params=r.offload_params,
                                 replica_machine_ids=[x.machine_id for x in ev.replicas
                                                      if x.index == r.index and x.replica],
                                 micro_batches=[x.micro_batches for x in ev.replicas
                                                if x.index == r.index],
                                 samples=[_samples(plan, x) for x in ev.replicas
                                          if x.index == r.index],
                                 in_flight=r.inflight)
                for r in ev.stages],
        syncs=[PlanSyncSummary(stage=x.stage, machine_ids=list(x.machine_ids),
                               grad_bytes=x.grad_bytes, density=x.density, scheme=x.scheme,
                               slowest_bytes_per_s=x.slowest_bytes_per_s, time_s=x.time_s,
                               exposed_s=x.exposed_s, buckets=x.buckets)
               for x in ev.syncs],
        links=[PlanLinkSummary(src_stage=lk.src_stage, dst_stage=lk.dst_stage,
                               src_machine_id=ids[lk.src], dst_machine_id=ids[lk.dst],
                               bandwidth_fwd_bytes_per_s=lk.bandwidth_fwd_bytes_per_s,
                               bandwidth_bwd_bytes_per_s=lk.bandwidth_bwd_bytes_per_s,
                               rtt_s=lk.rtt_s, fwd_bytes=lk.fwd_bytes, bwd_bytes=lk.bwd_bytes,
                               density=lk.density, time_s=lk.time_s, codec=lk.codec,
                               dense_time_s=dense_links.get((lk.src_stage, lk.dst_stage),
                                                            lk).time_s)
               for lk in ev.links],
        idle=dict(plan.idle),
        iteration_s=ev.iteration_s,
        samples_per_s=ev.samples_per_s,
        bottleneck=ev.bottleneck,
        graph_name=plan.arrays.graph.name,
        micro_batch_size=st.micro_batch_size,
        num_micro_batches=st.num_micro_batches,
        schedule=str(st.schedule),
        bottleneck_s=ev.bottleneck_s,
        compute_bottleneck_s=ev.compute_bottleneck_s,
        fill_s=ev.fill_s,
        optimizer_s=ev.optimizer_s,
        sync_s=ev.sync_s,
        grad_sync_s=ev.grad_sync_s,
        adatopk_gain=plan.gain if plan.densities else None,
        over_memory=list(ev.over_memory),
        unrunnable=list(ev.unrunnable),
        notes=list(plan.notes),
    )


def _si(x: float, unit: str) -> str:
    for div, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g} {p}{unit}"
    return f"{x:.3g} {unit}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def render_plan(plan: Plan, *, max_links: int = 24) -> str:
    """Stages, links (with AdaTopK densities), the prediction, the bottleneck and idle machines."""
    ev = plan.evaluation
    c = plan.arrays.cluster
    st = plan.arrays.settings
    used = sum(len(s.machines) for s in plan.stages)
    replicated = any(s.replicas for s in plan.stages)
    sized = any(r.sizes for r in ev.replicas)
    lines = [
        f"plan {plan.method} for {plan.arrays.graph.name!r}: {len(plan.stages)} stages on "
        f"{used} of {len(c)} machines; micro-batch {st.micro_batch_size} x "
        f"{st.num_micro_batches} ({st.schedule})",
        "",
        f"{'stage':>5}  {'machine':<14}{'ops':>6}  {'first op':<28}{'last op':<28}"
        f"{'compute ms':>11}{'memory':>12}{'of':>11}" + (f"{'micro-b.':>10}" if replicated
                                                         else "")
        + (f"{'samples':>9}" if sized else ""),
    ]
    for r in (ev.replicas or ev.stages):
        head = f"{r.index:>5}" if r.replica == 0 else f"{'+':>5}"
        lines.append(
            f"{head}  {r.machine_id:<14}{r.stop - r.start:>6}  {r.first_op[:27]:<28}"
            f"{r.last_op[:27]:<28}{_ms(r.compute_s):>11}{_si(r.memory_bytes, 'B'):>12}"
            f"{_si(r.memory_cap, 'B'):>11}" + (f"{r.micro_batches:>10}" if replicated else "")
            + (f"{_samples(plan, r):>9}" if sized else "") + _memory_note(plan, r)
        )
    if any(_raised_in_flight(plan, r) for r in ev.stages):
        lines.append("(k in flight: the stage runs k forwards ahead of its backwards, more than "
                     "1F1B's own, so a slow link's round trip does not leave it waiting)")
    if any(r.recompute for r in (ev.replicas or ev.stages)):
        lines.append("(recompute: the stage keeps only its inputs and runs its forward again in "
                     "the backward; its kept activations would not fit)")
    if any(r.checkpoint_blocks for r in (ev.replicas or ev.stages)):
        lines.append("(checkpoint k/n: the stage keeps only the inputs of k of its n blocks and "
                     "runs their forward again in the backward, the cheapest that fits)")
    if any(r.offload for r in (ev.replicas or ev.stages)):
        lines.append("(offload: the stage keeps its optimizer state on disk, read and written "
                     "once per step; it would not fit in memory)")
    if any(r.offload_params for r in (ev.replicas or ev.stages)):
        lines.append("(weights-on-disk: its weights and gradients too, about two blocks in "
                     "memory at a time; the last resort, read from disk every micro-batch)")
    lines.append("(memory: the predicted peak of the stage's training state, of what its "
                 "machine offers)")
    if replicated:
        lines.append("(+: a replica of the stage above: the same ops on its share of the "
                     "micro-batches)")
    if sized:
        lines.append("(samples: each machine's share of the batch, in micro-batches of its "
                     "own sizes so that the replicas finish together; compute ms is their "
                     "mean)")
    lines += ["", f"{'link':<30}{'Mbit/s':>10}{'dense MB':>10}{'wire MB':>10}{'codec':>11}"
                  f"{'ms':>10}{'dense ms':>10}"]
    dense_links = {(lk.src_stage, lk.dst_stage): lk for lk in plan.dense.links}
    # the busiest links first; size arithmetic fans out tiny scalars to every stage, so
    # links that carry next to nothing are summarised in one line
    def dense_time(lk: LinkReport) -> float:
        d = dense_links.get((lk.src_stage, lk.dst_stage))
        return (d or lk).time_s

    ranked = sorted(ev.links, key=lambda lk: -dense_time(lk))
    shown = [lk for lk in ranked if lk.time_s >= 1e-5 or lk.fwd_bytes + lk.bwd_bytes >= 1e4]
    shown = shown[:max_links]
    hidden = len(ev.links) - len(shown)
    for lk in shown:
        d = dense_links.get((lk.src_stage, lk.dst_stage), lk)
        name = f"{lk.src_stage}:{c.machines[lk.src].id} -> {lk.dst_stage}:{c.machines[lk.dst].id}"
        lines.append(
            f"{name[:29]:<30}"
            f"{bits_per_s_from_bytes_per_s(lk.bandwidth_fwd_bytes_per_s) / 1e6:>10.4g}"
            f"{(lk.dense_fwd_bytes + lk.dense_bwd_bytes) / 1e6:>10.3g}"
            f"{(lk.fwd_bytes + lk.bwd_bytes) / 1e6:>10.3g}{lk.codec[:10]:>11}"
            f"{_ms(lk.time_s):>10}{_ms(d.time_s):>10}"
        )
    if hidden:
        lines.append(f"({hidden} more links, each under "
                     f"{_ms(max((lk.time_s for lk in ev.links if lk not in shown), default=0))}"
                     " ms)")
    if ev.syncs:
        lines += ["", f"{'gradient reduction':<24}{'replicas':>9}{'MB':>9}{'density':>9}"
                      f"{'slowest Mbit/s':>16}{'buckets':>9}{'ms':>9}{'hidden ms':>11}  scheme"]
        for x in ev.syncs:
            lines.append(
                f"{'stage ' + str(x.stage):<24}{len(x.machine_ids):>9}"
                f"{x.grad_bytes * x.density / 1e6:>9.3g}{x.density:>9.3f}"
                f"{bits_per_s_from_bytes_per_s(x.slowest_bytes_per_s) / 1e6:>16.4g}"
                f"{x.buckets:>9}{_ms(x.time_s):>9}{_ms(x.time_s - x.exposed_s):>11}"
                f"  {x.scheme}")
    lines += [
        "",
        f"bottleneck: {ev.bottleneck} ({_ms(ev.bottleneck_s)} ms per micro-batch"
        + (" of the iteration" if ev.syncs else "") + "); "
        f"compute bottleneck {_ms(ev.compute_bottleneck_s)} ms",
        f"iteration: {ev.iteration_s:.4g} s = "
        + (f"({st.num_micro_batches} - 1) x bottleneck" if not ev.syncs else
           "the bottleneck's micro-batches but one")
        + f" + fill "
        f"{ev.fill_s:.4g} s + optimizer {ev.optimizer_s:.3g} s + tied-weight sync "
        f"{ev.sync_s:.3g} s" + (f" + gradient reduction {ev.grad_sync_s:.3g} s (not hidden)"
                                if ev.syncs else ""),
        f"throughput: {ev.samples_per_s:.4g} samples/s"
        + (f"; AdaTopK gain {plan.gain:.2f}x over the same cut dense" if plan.densities else ""),
    ]
    if ev.over_memory:
        lines.append(f"OVER MEMORY on: {', '.join(ev.over_memory)}")
    if ev.unrunnable:
        lines.append(f"CANNOT RUN: {'; '.join(ev.unrunnable)}")
    if plan.idle:
        lines.append("idle machines:")
        by_reason: dict[str, list[str]] = {}
        for m, why in sorted(plan.idle.items()):
            by_reason.setdefault(why, []).append(m)
        for why, ms in by_reason.items():
            names = ", ".join(ms) if len(ms) <= 6 else f"{', '.join(ms[:5])}, ... ({len(ms)})"
            lines.append(f"  {names}: {why}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
