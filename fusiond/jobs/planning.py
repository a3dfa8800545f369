"""From a captured job and the cluster's profile to a layout: estimate, OP-Fence, AdaTopK.

`plan_job(spec, captured, cluster)` runs the planner (`fusiond.plan`) on the job's graph at its
micro-batch size; a job that fits no cut of the machines' memory is refused with the planner's
`PlanError` naming the sizes. `layout_from_plan` turns the plan into the `JobLayout` that
`assign_messages` / `JobCoordinator` take: machines per stage from the plan, densities from its
AdaTopK policy (or the job's forced `compression.density`; with `compression.codec = "int8"`
every float cut edge int8 instead, costed so by the planner). `readapted_densities` is the
scheduler's re-adaptation decision while the job runs: the same cut, densities recomputed for
the links as measured now.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fusiond.graph import CapturedModel
from fusiond.jobs.assign import JobLayout, layout_job
from fusiond.plan import (
    Cluster,
    JobSettings,
    Plan,
    batch_symbol,
    cost_graph_from_ir,
    plan_opfence,
    readapt,
)
from fusiond.train.spec import JobSpec
from protocol import ir

__all__ = ["job_settings", "layout_from_plan", "plan_job", "readapted_densities"]


def job_settings(spec: JobSpec) -> JobSettings:
    """The planner's view of a job."""
    return JobSettings(
        micro_batch_size=spec.batch.micro_batch_size,
        num_micro_batches=spec.batch.micro_batches,
        schedule=spec.batch.pipeline,
        density_floor=spec.compression.density_floor,
        exact_edges=frozenset(spec.compression.exact_edges),
        int8_edges=spec.compression.int8,
    )


def plan_job(spec: JobSpec, captured: CapturedModel, cluster: Cluster) -> Plan:
    """Plan the job on `cluster` (OP-Fence; AdaTopK densities when `compression.adatopk`)."""
    sym = batch_symbol(captured.graph)
    symbols = {sym: spec.batch.micro_batch_size} if sym else {}
    o = spec.optimizer
    opt_factor = 2.0 if o.kind == "adamw" else (1.0 if o.momentum else 0.0)
    cost = cost_graph_from_ir(captured.graph, symbols, exact_edges=spec.compression.exact_edges,
                              optimizer_state_factor=opt_factor, name=spec.name)
    return plan_opfence(cost, cluster, job_settings(spec), compress=spec.compression.adatopk)


def layout_from_plan(job_id: str, graph: ir.Graph, state: Mapping[str, torch.Tensor],
                     plan: Plan, spec: JobSpec) -> JobLayout:
    """The job's stages on the plan's machines, with the plan's (or the forced) densities, or
    int8 cut edges."""
    machines = plan.machine_of_stage()
    op_nodes = {op: machines[s] for op, s in plan.stage_assignment().items()}
    if spec.compression.int8:
        return layout_job(job_id, graph, state, op_nodes, int8=True,
                          exact=spec.compression.exact_edges)
    if spec.compression.density is not None:
        return layout_job(job_id, graph, state, op_nodes, density=spec.compression.density,
                          exact=spec.compression.exact_edges)
    densities = plan.edge_densities() if spec.compression.adatopk else {}
    return layout_job(job_id, graph, state, op_nodes, densities=densities)


def readapted_densities(plan: Plan, cluster: Cluster, current: Mapping[str, float],
                        edges: Iterable[str], *, tolerance: float = 0.1) -> dict[str, float] | None:
    """AdaTopK re-adaptation: the densities of `plan`'s cut edges under `cluster`'s measured
    links (`fusiond.plan.readapt`), for every edge in `edges` (the layout's cut edges; 1.0 =
    exact). `current` holds the densities in force (an edge absent = exact).

    None when nothing should be sent: the cluster's machines are not the plan's (a changed
    membership needs a re-plan, not new densities), or no edge's density moved by more than
    `tolerance` (relative), so measurement noise does not make stages switch every period.
    """
    if cluster.ids() != plan.arrays.cluster.ids():
        return None
    fresh = readapt(plan, cluster).densities
    by_edge = {f"{name}->{dst}": d for (name, dst), d in fresh.items()}
    new = {e: float(by_edge.get(e, 1.0)) for e in edges}
    for e, d in new.items():
        old = float(current.get(e, 1.0))
        if abs(d - old) > tolerance * old:
            return new
    return None
