"""fusiond.plan: workload estimator, OP-Fence scheduler, AdaTopK link policy (pure; no I/O).

Entry points: `cost_graph_from_ir` (IR -> costs), `plan_opfence` (the schedule),
`adapt_densities` / `readapt` (AdaTopK), `uniform_plan` (baseline), `render_plan` (the table),
`plan_summary` (the same as data),
measuring a machine (`calibrate`, which runs torch) is `fusiond.profile.calibrate`.
"""

from fusiond.plan.adatopk import Readaptation, adapt_densities, readapt
from fusiond.plan.estimator import batch_symbol, cost_graph_from_ir
from fusiond.plan.fence import fence_groups, plan_from_stages, plan_opfence, uniform_plan
from fusiond.plan.model import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    PlanError,
    TensorEdge,
    scale_machine,
)
from fusiond.plan.pipeline import Evaluation, GraphArrays, Plan, StageSpec, evaluate
from fusiond.plan.render import PlanSummary, plan_summary, render_plan
from fusiond.plan.topology import cluster_from_topology

__all__ = [
    "Cluster",
    "CostGraph",
    "Evaluation",
    "GraphArrays",
    "JobSettings",
    "MachineProfile",
    "OpCost",
    "Plan",
    "PlanError",
    "PlanSummary",
    "Readaptation",
    "StageSpec",
    "TensorEdge",
    "adapt_densities",
    "batch_symbol",
    "cluster_from_topology",
    "cost_graph_from_ir",
    "evaluate",
    "fence_groups",
    "plan_from_stages",
    "plan_opfence",
    "plan_summary",
    "readapt",
    "render_plan",
    "scale_machine",
    "uniform_plan",
]
