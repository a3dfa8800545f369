"""From a captured job and the cluster's profile to a layout: estimate, OP-Fence, AdaTopK.

`plan_job(spec, captured, cluster)` runs the planner (`fusiond.plan`) on the job's graph at its
micro-batch size; a job that fits no cut of the machines' memory is refused with the planner's
`PlanError` naming the sizes. `layout_from_plan` turns the plan into the `JobLayout` that
`assign_messages` / `JobCoordinator` take: machines per stage from the plan, densities from its
AdaTopK policy (or the job's forced `compression.density`).
"""

from __future__ import annotations

from collections.abc import Mapping

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
)
from fusiond.train.spec import JobSpec
from protocol import ir

__all__ = ["job_settings", "layout_from_plan", "plan_job"]


def job_settings(spec: JobSpec) -> JobSettings:
    """The planner's view of a job."""
    return JobSettings(
        micro_batch_size=spec.batch.micro_batch_size,
        num_micro_batches=spec.batch.micro_batches,
        schedule=spec.batch.pipeline,
        density_floor=spec.compression.density_floor,
        exact_edges=frozenset(spec.compression.exact_edges),
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
    """The job's stages on the plan's machines, with the plan's (or the forced) densities."""
    machines = plan.machine_of_stage()
    op_nodes = {op: machines[s] for op, s in plan.stage_assignment().items()}
    if spec.compression.density is not None:
        return layout_job(job_id, graph, state, op_nodes, density=spec.compression.density,
                          exact=spec.compression.exact_edges)
    densities = plan.edge_densities() if spec.compression.adatopk else {}
    return layout_job(job_id, graph, state, op_nodes, densities=densities)
