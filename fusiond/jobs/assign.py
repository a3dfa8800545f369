"""The scheduler's side of starting a job: lay the graph out on machines, build the Assigns.

Pure functions (no I/O): the daemon's scheduler calls

1. `layout_job(job_id, graph, state, op_nodes, densities=...)` with the plan's op -> machine
   assignment (`fusiond.plan.Plan.assignment`) and per-edge densities (or `int8=True`: every
   float cut edge int8 block-quantized), which cuts the graph
   (`fusiond.graph.partition`) and numbers the partitions in pipeline order (partition id ==
   stage number: stage 0 reads the data, every edge goes from a lower to a higher stage);
2. `assign_parts(layout, spec, state, term=..., plan_version=..., addresses=...)`, which
   returns per machine the `Assign` message and its payload (the partition's initial weights in
   the safetensors layout, as buffers of the tensors themselves; `assign_messages` joins them),
   to send on the CONTROL lane; each machine answers Ready or Error.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fusiond.errors import LocalError
from fusiond.graph import SINK, SOURCE, Partition, partition, state_to_parts
from fusiond.train.codec import EDGE_ENCODINGS, EdgeEncoding
from fusiond.train.data import DATA_PREFIX, compact_arrays, is_default_corpus, load_arrays
from fusiond.train.programs import (
    compressible_edges,
    cut_densities,
    shared_params,
    trainable_params,
)
from fusiond.train.remote import job_config
from fusiond.train.schedule import replica_slots
from fusiond.train.spec import JobSpec
from protocol import ir
from protocol.messages import Address, Assign, EdgeRoute

__all__ = ["JobLayout", "LayoutError", "StagePlan", "assign_messages", "assign_parts", "layout_job",
           "next_request_id"]


_REQUEST_IDS = itertools.count(1)
"""Assign request ids of this process: unique across every job and attempt it schedules, so a
reply can never be taken for another job's (each reply also names its job and plan version)."""


def next_request_id() -> int:
    """A request id no other Assign of this process used."""
    return next(_REQUEST_IDS)


class LayoutError(LocalError):
    """The plan does not fit the graph (an op without a machine, a machine in two places)."""


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: which machine runs which partition."""

    stage: int
    node_id: str
    partition: Partition


@dataclass(frozen=True)
class JobLayout:
    """A job cut into stages, with its compressed edges and tied parameters."""

    job_id: str
    graph: ir.Graph
    stages: tuple[StagePlan, ...]
    densities: Mapping[str, float]
    """edge id -> top-k density (edges absent travel exact)."""
    shared: Mapping[int, Mapping[str, tuple[int, ...]]]
    """stage -> {parameter -> other stages holding it}."""
    input_name: str
    targets_name: str | None
    loss_name: str
    encodings: Mapping[str, EdgeEncoding] = field(default_factory=dict)
    """Edge id -> how it travels quantized both ways ("bf16", "int8", "int4"; never also in
    `densities`); edges absent travel exact or top-k."""
    replicas: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    """stage -> its other machines (data parallelism: the same partition on each, every one
    on its share of the micro-batches); a stage absent runs on its own machine only."""
    routes: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Replicated stage -> which of its machines (0: `StagePlan.node_id`, then `replicas`)
    runs each micro-batch of an iteration."""
    grad_rank: int | None = None
    """The summed gradients (replicas, tied parameters) travel as rank-`grad_rank` factors
    with error feedback, on every stage (None: dense)."""
    recompute: frozenset[str] = frozenset()
    """The machines whose stage recomputes its activations in the backward (the plan's
    choice where they would not fit)."""
    offload: frozenset[str] = frozenset()
    """The machines whose stage keeps its optimizer state on disk (the plan's choice where
    it would not fit in memory)."""
    checkpoint_blocks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Machine -> the blocks of its stage it checkpoints (the per-block memory plan)."""
    offload_params: frozenset[str] = frozenset()
    """The machines whose stage keeps its weights and gradients on disk too."""
    devices: Mapping[str, str] = field(default_factory=dict)
    """Machine -> the accelerator its stage computes on ("cuda:0"; the plan's
    `MachineProfile.device`); a machine absent computes on its CPU."""
    grad_buckets: Mapping[str, int] = field(default_factory=dict)
    """Machine -> the buckets its replicated stage reduces its gradients in (the plan's
    `SyncReport.buckets`, the same on every replica); a machine absent: the runtime's own
    split by size."""
    grad_groups: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)
    """A replicated stage's first machine -> its machines in bandwidth groups, where the plan
    reduces its gradients hierarchically (`SyncReport.scheme`); absent: one ring."""
    grad_two_level: frozenset[str] = frozenset()
    """Those of `grad_groups` the plan reduces two-level instead (`SyncReport.scheme`)."""
    in_flight: Mapping[str, int] = field(default_factory=dict)
    """Machine -> the micro-batches 1F1B keeps in flight on its stage, where the plan raised
    it above the schedule's own (`StageReport.inflight`: a slow link's round trip)."""
    micro_batch_sizes: tuple[int, ...] = ()
    """The samples of each micro-batch of an iteration, where the plan gives a one-stage
    job's replicas sizes of their own (`Plan.micro_batch_sizes`); empty: equal."""

    @property
    def int8_edges(self) -> frozenset[str]:
        """Edge ids that travel int8."""
        return frozenset(e for e, enc in self.encodings.items() if enc == "int8")

    @property
    def stage_nodes(self) -> dict[int, str]:
        """stage -> machine (its first one, with replicas)."""
        return {s.stage: s.node_id for s in self.stages}

    def slots(self) -> dict[tuple[int, int], int]:
        """(stage, replica) -> slot: what each machine runs and reports as (replica 0 of stage
        s is slot s; the others are numbered on from the number of stages)."""
        return replica_slots([1 + len(self.replicas.get(s.stage, ())) for s in self.stages])

    @property
    def slot_nodes(self) -> dict[int, str]:
        """slot -> machine, for every machine of the job (= `stage_nodes` without replicas)."""
        nodes = {s.stage: (s.node_id, *self.replicas.get(s.stage, ())) for s in self.stages}
        return {slot: nodes[st][r] for (st, r), slot in self.slots().items()}

    def slot_stages(self) -> dict[int, int]:
        """Replica slot -> its stage (the slots beyond each stage's first)."""
        return {slot: st for (st, r), slot in self.slots().items() if r > 0}

    def slot_routes(self) -> dict[int, tuple[int, ...]]:
        """Replicated stage -> the slot running each micro-batch."""
        slots = self.slots()
        return {st: tuple(slots[(st, r)] for r in route) for st, route in self.routes.items()}

    def slot_shared(self, state: Mapping[str, torch.Tensor]) -> dict[int, dict[str, tuple[
            int, ...]]]:
        """slot -> {parameter -> the other slots holding it}: a replicated stage's trainable
        parameters with its other replicas, a tied one with every replica of every holder."""
        slots = self.slots()
        count = {s.stage: 1 + len(self.replicas.get(s.stage, ())) for s in self.stages}
        out: dict[int, dict[str, tuple[int, ...]]] = {}
        for sp in self.stages:
            st = sp.stage
            tied = self.shared.get(st, {})
            names = trainable_params(sp.partition, state) if count[st] > 1 else list(tied)
            for r in range(count[st]):
                mine: dict[str, tuple[int, ...]] = {}
                for name in names:
                    holders = [slots[(st, r2)] for r2 in range(count[st]) if r2 != r]
                    for s2 in tied.get(name, ()):
                        holders += [slots[(s2, r2)] for r2 in range(count[s2])]
                    if holders:
                        mine[name] = tuple(sorted(holders))
                out[slots[(st, r)]] = mine
        return out

    def edges(self) -> list[EdgeRoute]:
        """Every cut edge between stages, with its machines and density."""
        nodes = self.stage_nodes
        out: list[EdgeRoute] = []
        for s in self.stages:
            for e in s.partition.outputs:
                if e.dst == SINK:
                    continue
                out.append(EdgeRoute(
                    edge=e.id, src_partition=e.src, dst_partition=e.dst, src_node=nodes[e.src],
                    dst_node=nodes[e.dst], density=self.densities.get(e.id, 1.0),
                    encoding=self.encodings.get(e.id, "raw"),
                ))
        return out


def layout_job(
    job_id: str,
    graph: ir.Graph,
    state: Mapping[str, torch.Tensor],
    op_nodes: Mapping[str, str],
    *,
    densities: Mapping[str, float] | None = None,
    density: float | None = None,
    exact: tuple[str, ...] = (),
    int8: bool = False,
    encoding: EdgeEncoding = "raw",
    encodings: Mapping[str, EdgeEncoding] | None = None,
    replicas: Mapping[str, Sequence[str]] | None = None,
    routes: Mapping[str, Sequence[int]] | None = None,
) -> JobLayout:
    """Cut `graph` by the plan's op -> machine map; one stage per machine, in pipeline order.

    `replicas`: a stage's machine (as in `op_nodes`) -> the other machines that run the same
    partition; `routes`: that machine -> which of them (0: itself, then `replicas` in order)
    runs each micro-batch of an iteration.

    `densities` (edge id `<value>-><dst stage>` -> density) comes from the planner's AdaTopK;
    `density` instead forces one density on every float cut edge except `exact` ones;
    `encoding` (`int8`: "int8") sends every float cut edge except `exact` ones so encoded (no
    top-k with it); `encodings` (edge id -> encoding) comes from the planner's per-link
    codec choice, beside its `densities` (an edge in both is refused).
    """
    if int8:
        encoding = "int8"
    if encoding != "raw" and (density is not None or densities or encodings):
        raise LayoutError(f"{encoding} cut edges are never top-k: give no densities or "
                          f"per-edge encodings with encoding={encoding!r}")
    tensor_nodes = [n.id for n in graph.nodes if any(m.is_tensor for m in n.outputs)]
    missing = [n for n in tensor_nodes if n not in op_nodes]
    if missing:
        raise LayoutError(f"the plan assigns no machine to op {missing[0]!r} "
                          f"({len(missing)} ops unassigned)")
    machines: dict[str, int] = {}
    for n in graph.nodes:
        if n.id in op_nodes:
            machines.setdefault(op_nodes[n.id], len(machines))
    first = partition(graph, {k: machines[v] for k, v in op_nodes.items()})
    # Renumber so that partition id == position in the pipeline (a topological order).
    order = {p.id: i for i, p in enumerate(first)}
    node_of = {machines[m]: m for m in machines}
    parts = partition(graph, {k: order[machines[v]] for k, v in op_nodes.items()})
    stages = tuple(StagePlan(p.id, node_of[first[p.id].id], p) for p in parts)
    for s in stages:
        assert s.partition.id == s.stage
    stage_of = {p.id: p.id for p in parts}
    shared = shared_params(parts, stage_of, state)
    if densities is None:
        densities = cut_densities(parts, density, exact)
    known = {e.id for p in parts for e in p.outputs if e.dst != SINK}
    unknown = set(densities) - known
    if unknown:
        raise LayoutError(f"densities for edges that cross no cut: {sorted(unknown)[:3]}")
    for eid, d in densities.items():
        if not 0.0 < d <= 1.0:
            raise LayoutError(f"edge {eid!r}: density {d} not in (0, 1]")
    names = [i.name for i in graph.inputs]
    targets = next((n for n in ("targets", "labels") if n in names), None)
    data = [n for n in names if n != targets]
    if not data or not graph.outputs:
        raise LayoutError(f"a job graph takes its data inputs (+ targets) and returns the "
                          f"loss; inputs {names}")
    for p in parts:
        for e in p.inputs:
            if e.src == SOURCE and e.value not in names:
                raise LayoutError(f"partition {p.id} reads unknown graph input {e.value!r}")
    if encoding != "raw":
        encs: dict[str, EdgeEncoding] = dict.fromkeys(compressible_edges(parts, exact), encoding)
    else:
        encs = dict(encodings or {})
        unknown = set(encs) - known
        if unknown:
            raise LayoutError(f"encodings for edges that cross no cut: {sorted(unknown)[:3]}")
        both = set(encs) & set(densities)
        if both:
            raise LayoutError(f"edge {sorted(both)[0]!r} is both top-k and quantized")
        bad = {e: v for e, v in encs.items() if v not in EDGE_ENCODINGS}
        if bad:
            raise LayoutError(f"edge encodings {bad} are not among {list(EDGE_ENCODINGS)}")
    stage_of_node = {s.node_id: s.stage for s in stages}
    reps: dict[int, tuple[str, ...]] = {}
    rts: dict[int, tuple[int, ...]] = {}
    taken = set(stage_of_node)
    for node, extra in (replicas or {}).items():
        if node not in stage_of_node:
            raise LayoutError(f"replicas of {node!r}, which runs no stage")
        for x in extra:
            if x in taken:
                raise LayoutError(f"machine {x!r} is in two places of the layout")
            taken.add(x)
        if extra:
            reps[stage_of_node[node]] = tuple(extra)
    for node, route in (routes or {}).items():
        st = stage_of_node.get(node)
        if st is None or st not in reps:
            raise LayoutError(f"a route for {node!r}, which runs no replicated stage")
        count = 1 + len(reps[st])
        if any(not 0 <= x < count for x in route):
            raise LayoutError(f"the route of stage {st} names a machine beyond its {count}")
        rts[st] = tuple(int(x) for x in route)
    missing_route = sorted(set(reps) - set(rts))
    if missing_route:
        raise LayoutError(f"stage {missing_route[0]} has replicas but no route")
    if len({len(r) for r in rts.values()}) > 1:
        raise LayoutError("the routes of the replicated stages name different micro-batch counts")
    return JobLayout(job_id, graph, stages, dict(densities), shared, data[0], targets,
                     graph.outputs[0].name, encs, reps, rts)


@dataclass(frozen=True)
class Corpus:
    """A job's data as the submitting machine read it: its content hash (`digest`,
    `fusiond.train.data.dataset_digest`) and, unless it is the default corpus (`default`: each
    stage reads its own standard library and checks the hash), the arrays to ship (`arrays`:
    a token stream, rows, images; `tokens` alone, the older form, is the token stream)."""

    digest: str
    default: bool
    tokens: torch.Tensor | None = None
    arrays: Mapping[str, torch.Tensor] | None = None

    def shipped(self) -> dict[str, torch.Tensor] | None:
        """The arrays the data stages get (None: they read their own)."""
        if self.arrays is not None:
            return dict(self.arrays)
        return None if self.tokens is None else {"tokens": self.tokens}


def _shipped_data(spec: JobSpec) -> dict[str, torch.Tensor] | None:
    """The job's data read here as tensors to ship, unless it is the default corpus (the
    standard library every machine has) or synthetic: the stages that read data get them in
    their Assign (in-process drivers, where here is the submitting machine)."""
    d = spec.data
    if d.kind == "images" or is_default_corpus(d):
        return None
    return {k: torch.from_numpy(v) for k, v in compact_arrays(load_arrays(d)).items()}


def assign_messages(
    layout: JobLayout,
    spec: JobSpec,
    state: Mapping[str, torch.Tensor],
    *,
    term: int,
    plan_version: int,
    addresses: Mapping[str, Address],
    corpus: Corpus | None = None,
    recv_timeout_s: float | None = None,
    first_step: int = 0,
) -> dict[str, tuple[Assign, bytes]]:
    """`assign_parts` with each payload joined into one bytes object (for callers that hand
    it to a `StageHost` in the same process)."""
    parts = assign_parts(layout, spec, state, term=term, plan_version=plan_version,
                         addresses=addresses, corpus=corpus, recv_timeout_s=recv_timeout_s,
                         first_step=first_step)
    return {n: (msg, b"".join(payload)) for n, (msg, payload) in parts.items()}


def assign_parts(
    layout: JobLayout,
    spec: JobSpec,
    state: Mapping[str, torch.Tensor],
    *,
    term: int,
    plan_version: int,
    addresses: Mapping[str, Address],
    corpus: Corpus | None = None,
    recv_timeout_s: float | None = None,
    first_step: int = 0,
) -> dict[str, tuple[Assign, tuple[bytes | memoryview, ...]]]:
    """Per machine, its Assign and the payload (its partition's weights, safetensors; plus the
    data arrays under `DATA_PREFIX + name` for the stages that read data, unless it is the
    default corpus or synthetic) as a gather list that references `state`'s own tensors
    (`fusiond.graph.state_to_parts`): the scheduler holds no copy of the weights per machine
    (measured: two whole-model replicas of a 19 MB model cost the lead 92 MiB serialised),
    and must not modify `state` until the payloads are written.

    `corpus`: what the submitter read (a job submitted to a daemon); None reads a non-default
    corpus here (in-process drivers, where here is the submitting machine). `recv_timeout_s`:
    the stages' bound on one wait for inputs (`job_config`); `first_step`: where this attempt
    starts. Each Assign gets a request id of its own (`next_request_id`)."""
    nodes = layout.slot_nodes
    absent = [n for n in nodes.values() if n not in addresses]
    if absent:
        raise LayoutError(f"no address for machine {absent[0]!r}")
    routes_by_slot = layout.slot_routes()
    if routes_by_slot and any(len(r) != spec.batch.micro_batches
                              for r in routes_by_slot.values()):
        raise LayoutError(f"the layout's routes do not name the job's "
                          f"{spec.batch.micro_batches} micro-batches")
    sizes = layout.micro_batch_sizes
    if sizes and (len(sizes) != spec.batch.micro_batches or min(sizes) < 1
                  or sum(sizes) != spec.batch.size):
        raise LayoutError(f"the layout's micro-batch sizes {list(sizes)[:8]} are not the job's "
                          f"{spec.batch.micro_batches} micro-batches of {spec.batch.size} "
                          "samples in all")
    slot_of = {n: slot for slot, n in nodes.items()}
    config = job_config(spec, stage_nodes=nodes, shared=layout.slot_shared(state),
                        input_name=layout.input_name, targets_name=layout.targets_name,
                        loss_name=layout.loss_name,
                        corpus_digest="" if corpus is None else corpus.digest,
                        default_corpus=corpus is not None and corpus.default,
                        recv_timeout_s=recv_timeout_s, first_step=first_step,
                        slot_stages=layout.slot_stages(), routes=routes_by_slot,
                        grad_rank=layout.grad_rank,
                        grad_warmup_steps=min(spec.compression.grad_warmup_steps,
                                              spec.steps),
                        recompute_slots=[slot for slot, n in nodes.items()
                                         if n in layout.recompute],
                        offload_slots=[slot for slot, n in nodes.items()
                                       if n in layout.offload],
                        checkpoint_blocks={slot: layout.checkpoint_blocks[n]
                                           for slot, n in nodes.items()
                                           if layout.checkpoint_blocks.get(n)},
                        offload_param_slots=[slot for slot, n in nodes.items()
                                             if n in layout.offload_params],
                        slot_devices={slot: layout.devices[n] for slot, n in nodes.items()
                                      if layout.devices.get(n, "cpu") != "cpu"},
                        grad_buckets={slot: layout.grad_buckets[n] for slot, n in nodes.items()
                                      if n in layout.grad_buckets},
                        in_flight={s.stage: layout.in_flight[s.node_id] for s in layout.stages
                                   if s.node_id in layout.in_flight},
                        grad_groups={s.stage: [[slot_of[m] for m in g]
                                               for g in layout.grad_groups[s.node_id]]
                                     for s in layout.stages if s.node_id in layout.grad_groups},
                        grad_two_level=[s.stage for s in layout.stages
                                        if s.node_id in layout.grad_groups
                                        and s.node_id in layout.grad_two_level],
                        micro_batch_sizes=layout.micro_batch_sizes)
    routes = layout.edges()
    job_nodes = {n: tuple(addresses[n]) for n in nodes.values()}
    shipped = _shipped_data(spec) if corpus is None else corpus.shipped()
    by_stage = {s.stage: s for s in layout.stages}
    out: dict[str, tuple[Assign, tuple[bytes | memoryview, ...]]] = {}
    for (stage, _r), slot in sorted(layout.slots().items()):
        s = by_stage[stage]
        mine = tuple(r for r in routes if s.stage in (r.src_partition, r.dst_partition))
        weights = {k: state[k] for k in s.partition.param_names if k in state}
        if shipped is not None and any(e.src == SOURCE for e in s.partition.inputs):
            weights.update({DATA_PREFIX + k: v for k, v in shipped.items()})
        msg = Assign(
            request_id=next_request_id(), term=term, job_id=layout.job_id,
            plan_version=plan_version, partition=slot, graph=ir.dumps(s.partition.graph),
            edges=mine, nodes=dict(job_nodes), config=config,  # type: ignore[arg-type]
        )
        out[nodes[slot]] = (msg, tuple(state_to_parts(weights)))
    return out
