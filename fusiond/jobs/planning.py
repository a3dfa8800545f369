"""From a captured job and the cluster's profile to a layout: estimate, OP-Fence, AdaTopK.

`plan_job(spec, captured, cluster)` runs the planner (`fusiond.plan`) on the job's graph at its
micro-batch size; a job that fits no cut of the machines' memory is refused with the planner's
`PlanError` naming the sizes. `layout_from_plan` turns the plan into the `JobLayout` that
`assign_messages` / `JobCoordinator` take: machines per stage from the plan, densities from its
AdaTopK policy (or the job's forced `compression.density`; with `compression.codec = "int8"`
every float cut edge int8 instead, costed so by the planner). `readapted_densities` is the
scheduler's re-adaptation decision while the job runs: the same cut, densities recomputed for
the links as measured now.

`cluster_for_planner(view)` is the adapter from the daemon's `ClusterView` (members, gossiped
profiles, measured links in bits per second) to the planner's `Cluster` (bytes per second:
`link_bytes_per_s` is the one conversion); a view with no member to run on is `JobRefused`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from fusiond.errors import LocalError
from fusiond.graph import CapturedModel
from fusiond.jobs.assign import JobLayout, layout_job
from fusiond.plan import (
    Cluster,
    JobSettings,
    MachineProfile,
    Plan,
    batch_symbol,
    cost_graph_from_ir,
    plan_opfence,
    readapt,
)
from fusiond.plan.pipeline import SyncReport, sync_groups
from fusiond.profile import device_memory_bytes, machine_from_profile, stage_device
from fusiond.train.codec import EdgeCodec
from fusiond.train.lowrank import sent_fraction
from fusiond.train.schedule import default_in_flight
from fusiond.train.spec import JobSpec
from fusiond.units import bytes_per_s_from_bits_per_s
from protocol import ir
from protocol.messages import Address, NodeProfile

if TYPE_CHECKING:  # the cluster's view types, for annotations only
    from fusiond.cluster import ClusterView

__all__ = [
    "DEFAULT_GFLOPS",
    "DEFAULT_LINK_BYTES_PER_S",
    "JobRefused",
    "cluster_for_planner",
    "job_settings",
    "layout_codecs",
    "layout_from_plan",
    "link_bytes_per_s",
    "plan_job",
    "readapted_codecs",
    "readapted_densities",
    "reserve_for_scheduler",
    "scheduler_reserve_bytes",
]

DEFAULT_GFLOPS = 10.0
"""A member that did not benchmark itself (profile_benchmark off) counts as this fast."""
DEFAULT_LINK_BYTES_PER_S = bytes_per_s_from_bits_per_s(1e9)
"""An unmeasured link counts as 1 Gbit/s (the prober fills in the real figure)."""


class JobRefused(LocalError):
    """A submission the cluster cannot run; nothing was started."""


def _member_memory_bytes(profile: NodeProfile) -> float:
    """The memory a member offers to jobs: its operator's `job_memory_gib`, else its free
    memory, else its total memory (0: unknown)."""
    for v in (profile.job_memory_bytes, profile.free_memory_bytes, profile.memory_bytes):
        if v > 0:
            return float(v)
    return 0.0


def scheduler_reserve_bytes(captured: CapturedModel) -> float:
    """What the scheduler's own machine holds for a job beyond what its free memory shows when
    it plans (the captured model is loaded by then): its own stage's Assign, joined into one
    buffer on local delivery, and a checkpoint of every stage in flight to it, the model's
    state once each. Measured on the WAN bench (four-groups, 428 MiB per host): a plan that
    left the lead's machine these two copies of a 19 MB model short had the kernel kill it
    before its first step."""
    return 2.0 * float(sum(t.numel() * t.element_size() for t in captured.state.values()))


def reserve_for_scheduler(cluster: Cluster, scheduler: str, reserve_bytes: float) -> Cluster:
    """`cluster` with `reserve_bytes` less memory on machine `scheduler` (never below one
    byte; unchanged where that machine is not in it, or is planned on its GPU, whose memory
    the scheduler's host-side copies do not take)."""
    if reserve_bytes <= 0 or scheduler not in cluster.ids() or any(
            m.id == scheduler and m.device != "cpu" for m in cluster.machines):
        return cluster
    machines = tuple(replace(m, memory_bytes=max(1.0, m.memory_bytes - reserve_bytes))
                     if m.id == scheduler else m for m in cluster.machines)
    return replace(cluster, machines=machines)


def cluster_for_planner(view: ClusterView, exclude: Iterable[str] = (),
                        op_sets: Mapping[str, frozenset[str] | None] | None = None, *,
                        device: str = "auto", precision: str = "fp32"
                        ) -> tuple[Cluster, dict[str, Address], dict[str, int]]:
    """The planner's `Cluster` from a `ClusterView`: alive members (less `exclude`), their
    gossiped profiles (speed, memory offered to jobs) and the measured bandwidth/RTT matrix (an
    unmeasured link counts as `DEFAULT_LINK_BYTES_PER_S`). Also every member's address and
    memory (for the capacity check). `op_sets`: member -> the ops it runs
    (`fusiond.jobs.opsets`; a member absent or None runs every op), so that the planner places
    each stage only where every op of it runs.

    The view's links are in bits per second, as probed and gossiped; the planner's `Cluster`
    is in bytes per second: `link_bytes_per_s` is the one conversion.

    `device` is the job's device policy (`fusiond.profile.DEVICE_POLICIES`): each member is
    priced on the device a stage would compute on there (`stage_device`: its first usable
    accelerator, by that device's own rates and memory, or its CPU); a "cuda" job leaves out
    the members without a usable accelerator, and is refused, naming why, where none has one.
    `precision` prices matmuls at that dtype's measured rate."""
    skip = set(exclude)
    alive = sorted((m for m in view.members if m.state == "alive" and m.node_id not in skip),
                   key=lambda m: m.node_id)
    where_of = {m.node_id: stage_device(m.profile, device) for m in alive}
    members = [m for m in alive if where_of[m.node_id] is not None]
    if not members:
        if alive:
            why = "; ".join(f"{m.node_id}: {m.profile.device_error or 'no CUDA device'}"
                            for m in alive[:8])
            raise JobRefused(f"job.device = {device!r} but no alive member offers a usable "
                             f"CUDA device ({why}); set job.device = \"auto\" to train on CPUs "
                             "where there is none")
        raise JobRefused("no alive member to run a job on")
    machines = []
    memory: dict[str, int] = {}
    for m in members:
        prof: NodeProfile = m.profile
        where = where_of[m.node_id] or "cpu"
        mem = device_memory_bytes(prof, where) or _member_memory_bytes(prof)
        memory[m.node_id] = int(mem)
        # the member's own calibration at its CPU allowance (fusiond.profile), or its device's;
        # else its matmul rate for every op class (sustained too), else a default
        machine = machine_from_profile(m.node_id, prof, mem, device=where, precision=precision)
        if machine is None:
            rate = (prof.gflops if prof.gflops > 0 else DEFAULT_GFLOPS) * 1e9
            machine = MachineProfile(id=m.node_id, flops={"other": rate}, mem_bw=rate / 2,
                                     op_overhead_s=2e-5, memory_bytes=max(mem, 1.0),
                                     kind="cpu")
        ops = (op_sets or {}).get(m.node_id)
        if ops is not None:
            machine = replace(machine, ops=ops)
        machines.append(machine)
    ids = [m.node_id for m in members]
    links = dict(view.links)
    k = len(ids)
    bw_bytes_per_s = [[DEFAULT_LINK_BYTES_PER_S] * k for _ in range(k)]
    rtt_s = [[0.0] * k for _ in range(k)]
    for i, a in enumerate(ids):
        for j, b in enumerate(ids):
            got = links.get((a, b)) or links.get((b, a))
            if got is not None:
                measured_bytes_per_s = link_bytes_per_s(got)
                if measured_bytes_per_s is not None:
                    bw_bytes_per_s[i][j] = measured_bytes_per_s
                rtt_s[i][j] = max(0.0, float(got[1]))
    addresses = {m.node_id: (str(m.address[0]), int(m.address[1])) for m in members}
    return Cluster.build(machines, bw_bytes_per_s, rtt_s), addresses, memory


def link_bytes_per_s(link: Sequence[float]) -> float | None:
    """The planner's rate (bytes per second) of one measured link of a `ClusterView`, whose
    first field is the gossiped rate in bits per second (`fusiond.cluster.membership.Link`);
    None while no bandwidth sample has counted (0). The only bits -> bytes conversion on the
    way from the prober to the planner."""
    bits_per_s = float(link[0])
    if not (bits_per_s > 0 and math.isfinite(bits_per_s)):
        return None
    return bytes_per_s_from_bits_per_s(bits_per_s)


def job_settings(spec: JobSpec, graph: ir.Graph | None = None) -> JobSettings:
    """The planner's view of a job; with its `graph`, the floor of a compressed gradient
    reduction (`grad_floor`), else dense reductions only."""
    return JobSettings(
        micro_batch_size=spec.batch.micro_batch_size,
        num_micro_batches=spec.batch.micro_batches,
        schedule=spec.batch.pipeline,
        density_floor=spec.compression.density_floor,
        exact_edges=frozenset(spec.compression.exact_edges),
        edge_encoding=spec.compression.edge_encoding,
        codec_choice=spec.compression.choice,
        accuracy_budget=spec.compression.accuracy_budget,
        grad_density_floor=1.0 if graph is None else grad_floor(spec, graph),
        grad_rank=max(1, spec.compression.grad_rank),
        recompute=spec.batch.recompute,
        offload=spec.batch.offload,
        offload_params=spec.precision != "fp16",
        reduce_in_backward=spec.precision != "fp16",
        snapshots=spec.checkpoint_interval > 0 or spec.eval_interval > 0,
        # the stage runtime weighs each micro-batch's loss by its size (StageExecutor)
        sized_micro_batches=spec.batch.replicas,
    )


def grad_floor(spec: JobSpec, graph: ir.Graph) -> float:
    """The share of the dense gradient a low-rank reduction at the job's `grad_rank` sends,
    over the graph's trainable parameters (vectors and small matrices dense): the least a
    replicated stage's reduction may send (1.0: the job keeps gradients dense)."""
    rank = spec.compression.grad_rank
    if rank <= 0:
        return 1.0
    shapes = [ir.eval_shape(p.meta.shape, graph.symbols) for p in graph.params
              if p.kind is ir.ParamKind.PARAMETER and p.requires_grad]
    return min(1.0, sent_fraction(shapes, rank))


def grad_rank_of(plan: Plan, spec: JobSpec) -> int | None:
    """The job's rank for its summed gradients: the spec's when the plan compresses any
    replicated stage's reduction (its density, between the floor and 1, is rounded down to
    the floor's rank: the runtime sends at most what the plan costs), else dense."""
    if spec.compression.grad_rank <= 0:
        return None
    if any(x.density < 1.0 for x in plan.evaluation.syncs):
        return spec.compression.grad_rank
    return None


def plan_job(spec: JobSpec, captured: CapturedModel, cluster: Cluster) -> Plan:
    """Plan the job on `cluster` (OP-Fence; each slow link's codec with `codec = "auto"`,
    AdaTopK densities with `compression.adatopk`)."""
    sym = batch_symbol(captured.graph)
    symbols = {sym: spec.batch.micro_batch_size} if sym else {}
    o = spec.optimizer
    opt_factor = 2.0 if o.kind == "adamw" else (1.0 if o.momentum else 0.0)
    cost = cost_graph_from_ir(captured.graph, symbols, exact_edges=spec.compression.exact_edges,
                              optimizer_state_factor=opt_factor, name=spec.name)
    return plan_opfence(cost, cluster, job_settings(spec, captured.graph),
                        compress=spec.compression.compress, replicate=spec.batch.replicas)


def layout_from_plan(job_id: str, graph: ir.Graph, state: Mapping[str, torch.Tensor],
                     plan: Plan, spec: JobSpec,
                     node_ids: Mapping[str, str] | None = None) -> JobLayout:
    """The job's stages on the plan's machines, with the plan's codecs (or the forced
    density, or the job's one encoding on every cut edge) and its choices per machine
    (memory, device, gradient buckets). `node_ids`: plan machine id -> the node id it runs
    under, where they differ (a test bed's hosts); None: the same."""
    def nid(machine_id: str) -> str:
        return machine_id if node_ids is None else node_ids[machine_id]

    machines = [nid(m) for m in plan.machine_of_stage()]
    op_nodes = {op: machines[s] for op, s in plan.stage_assignment().items()}
    ids = plan.arrays.cluster.ids()
    replicas = {machines[i]: [nid(ids[m]) for m in st.replicas]
                for i, st in enumerate(plan.stages) if st.replicas}
    routes = {machines[i]: list(r) for i, r in plan.routes().items()}
    if spec.compression.edge_encoding != "raw":
        layout = layout_job(job_id, graph, state, op_nodes,
                            encoding=spec.compression.edge_encoding,
                            exact=spec.compression.exact_edges, replicas=replicas, routes=routes)
    elif spec.compression.density is not None:
        layout = layout_job(job_id, graph, state, op_nodes, density=spec.compression.density,
                            exact=spec.compression.exact_edges, replicas=replicas,
                            routes=routes)
    else:
        compress = spec.compression.compress
        layout = layout_job(job_id, graph, state, op_nodes,
                            densities=plan.edge_densities() if compress else {},
                            encodings=plan.edge_encodings() if compress else {},
                            replicas=replicas, routes=routes)
    ev = plan.evaluation
    reps = ev.replicas or ev.stages
    recompute = frozenset(nid(r.machine_id) for r in reps if r.recompute)
    offload = frozenset(nid(r.machine_id) for r in reps if r.offload)
    blocks = {nid(r.machine_id): r.checkpoint_blocks for r in reps if r.checkpoint_blocks}
    weights = frozenset(nid(r.machine_id) for r in reps if r.offload_params)
    devices = {nid(m.id): m.device for m in plan.arrays.cluster.machines if m.device != "cpu"
               and (node_ids is None or m.id in node_ids)}
    buckets = {nid(m): sync.buckets for sync in ev.syncs for m in sync.machine_ids}
    # where the plan keeps more micro-batches in flight than 1F1B's own (a slow link's
    # round trip), on a stage of one machine
    S = len(ev.stages)
    in_flight = {nid(r.machine_id): r.inflight for r in ev.stages
                 if spec.batch.pipeline == "1f1b"
                 and r.inflight > default_in_flight(S, r.index, spec.batch.micro_batches)}
    # a reduction the plan makes hierarchical or two-level: its machines in the bandwidth
    # groups it used
    def first(x: SyncReport) -> str:
        return nid(plan.arrays.cluster.machines[plan.stages[x.stage].machine].id)

    groups = {first(x): tuple(
        tuple(nid(plan.arrays.cluster.machines[m].id) for m in g)
        for g in sync_groups(plan.arrays.cluster, plan.stages[x.stage].machines))
        for x in ev.syncs if x.scheme in ("hierarchical", "two-level")}
    two_level = frozenset(first(x) for x in ev.syncs if x.scheme == "two-level")
    return replace(layout, grad_rank=grad_rank_of(plan, spec), recompute=recompute,
                   offload=offload, checkpoint_blocks=blocks, offload_params=weights,
                   devices=devices, grad_buckets=buckets, in_flight=in_flight,
                   grad_groups=groups, grad_two_level=two_level,
                   micro_batch_sizes=plan.micro_batch_sizes())


def layout_codecs(layout: JobLayout) -> dict[str, EdgeCodec]:
    """Every cut edge of `layout` and how it travels now (top-k density, or encoding)."""
    return {e.edge: EdgeCodec(layout.encodings.get(e.edge, "raw"),
                              layout.densities.get(e.edge) if layout.densities.get(
                                  e.edge, 1.0) < 1.0 else None)
            for e in layout.edges()}


def readapted_codecs(plan: Plan, cluster: Cluster, current: Mapping[str, EdgeCodec], *,
                     tolerance: float = 0.1) -> dict[str, EdgeCodec] | None:
    """The per-link codec choice's re-adaptation: each cut edge's codec under `cluster`'s
    measured links (`fusiond.plan.readapt` with the plan's `codec_choice`), for every edge
    of `current` (the codecs in force). None when nothing should be sent: the machines are
    not the plan's (that needs a re-plan), or no edge changed codec and no top-k density moved
    by more than `tolerance` (relative), so measurement noise does not switch stages every
    period."""
    if cluster.ids() != plan.arrays.cluster.ids():
        return None
    r = readapt(plan, cluster)
    dens = {f"{name}->{dst}": d for (name, dst), d in r.densities.items()}
    encs = {f"{name}->{dst}": e for (name, dst), e in r.encodings.items()}
    new = {e: EdgeCodec(encs.get(e, "raw"), dens.get(e)) for e in current}
    for e, c in new.items():
        old = current[e]
        if c.encoding != old.encoding or (c.density is None) != (old.density is None):
            return new
        if c.density is not None and old.density is not None and (
                abs(c.density - old.density) > tolerance * old.density):
            return new
    return None


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
