"""The scheduler's side of starting a job: lay the graph out on machines, build the Assigns.

Pure functions (no I/O): the daemon's scheduler calls

1. `layout_job(job_id, graph, state, op_nodes, densities=...)` with the plan's op -> machine
   assignment (`fusiond.plan.Plan.assignment`) and per-edge densities (or `int8=True`: every
   float cut edge int8 block-quantized), which cuts the graph
   (`fusiond.graph.partition`) and numbers the partitions in pipeline order (partition id ==
   stage number: stage 0 reads the data, every edge goes from a lower to a higher stage);
2. `assign_messages(layout, spec, state, term=..., plan_version=..., addresses=...)`, which
   returns per machine the `Assign` message and its payload (the partition's initial weights as
   safetensors bytes), to send on the CONTROL lane; each machine answers Ready or Error.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.graph import SINK, SOURCE, Partition, partition, state_to_bytes
from fusiond.train.data import text_tokens
from fusiond.train.programs import compressible_edges, cut_densities, shared_params
from fusiond.train.remote import DATA_TOKENS_KEY, job_config
from fusiond.train.spec import JobSpec, default_text_path
from protocol import ir
from protocol.messages import Address, Assign, EdgeRoute

__all__ = ["JobLayout", "LayoutError", "StagePlan", "assign_messages", "layout_job",
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
    int8_edges: frozenset[str] = frozenset()
    """Edge ids that travel int8 block-quantized both ways (never also in `densities`)."""

    @property
    def stage_nodes(self) -> dict[int, str]:
        """stage -> machine."""
        return {s.stage: s.node_id for s in self.stages}

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
                    encoding="int8" if e.id in self.int8_edges else "raw",
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
) -> JobLayout:
    """Cut `graph` by the plan's op -> machine map; one stage per machine, in pipeline order.

    `densities` (edge id `<value>-><dst stage>` -> density) comes from the planner's AdaTopK;
    `density` instead forces one density on every float cut edge except `exact` ones; `int8`
    sends every float cut edge except `exact` ones int8 block-quantized (no top-k with it).
    """
    if int8 and (density is not None or densities):
        raise LayoutError("int8 cut edges are never top-k: give no densities with int8")
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
    targets = "targets" if "targets" in names else None
    data = [n for n in names if n != targets]
    if len(data) != 1 or not graph.outputs:
        raise LayoutError(f"a job graph takes one data input (+ targets) and returns the loss; "
                          f"inputs {names}")
    for p in parts:
        for e in p.inputs:
            if e.src == SOURCE and e.value not in names:
                raise LayoutError(f"partition {p.id} reads unknown graph input {e.value!r}")
    int8_edges = frozenset(compressible_edges(parts, exact)) if int8 else frozenset()
    return JobLayout(job_id, graph, stages, dict(densities), shared, data[0], targets,
                     graph.outputs[0].name, int8_edges)


@dataclass(frozen=True)
class Corpus:
    """A text job's corpus as the submitting machine read it: its content hash (`digest`,
    `fusiond.train.data.corpus_digest`) and, unless it is the default corpus (`default`: each
    stage reads its own standard library and checks the hash), the token ids to ship."""

    digest: str
    default: bool
    tokens: torch.Tensor | None = None


def _shipped_tokens(spec: JobSpec) -> torch.Tensor | None:
    """The corpus as a compact tensor, when the job's text is not the default corpus (the
    standard library every machine has): the stages that read data get it in their Assign."""
    d = spec.data
    if d.kind != "text" or d.path is None or d.path.resolve() == default_text_path().resolve():
        return None
    tokens = text_tokens(d)
    dtype = np.uint8 if tokens.size and int(tokens.max()) < 256 else np.int32
    return torch.from_numpy(tokens.astype(dtype))


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
    """Per machine, its Assign and the payload (its partition's weights, safetensors; plus the
    corpus tokens under `DATA_TOKENS_KEY` for stages that read data of a non-default corpus).

    `corpus`: what the submitter read (a job submitted to a daemon); None reads a non-default
    corpus here (in-process drivers, where here is the submitting machine). `recv_timeout_s`:
    the stages' bound on one wait for inputs (`job_config`); `first_step`: where this attempt
    starts. Each Assign gets a request id of its own (`next_request_id`)."""
    nodes = layout.stage_nodes
    absent = [n for n in nodes.values() if n not in addresses]
    if absent:
        raise LayoutError(f"no address for machine {absent[0]!r}")
    config = job_config(spec, stage_nodes=nodes, shared=layout.shared,
                        input_name=layout.input_name, targets_name=layout.targets_name,
                        loss_name=layout.loss_name,
                        corpus_digest="" if corpus is None else corpus.digest,
                        default_corpus=corpus is not None and corpus.default,
                        recv_timeout_s=recv_timeout_s, first_step=first_step)
    routes = layout.edges()
    job_nodes = {n: tuple(addresses[n]) for n in nodes.values()}
    shipped = _shipped_tokens(spec) if corpus is None else corpus.tokens
    out: dict[str, tuple[Assign, bytes]] = {}
    for s in layout.stages:
        mine = tuple(r for r in routes if s.stage in (r.src_partition, r.dst_partition))
        weights = {k: state[k] for k in s.partition.param_names if k in state}
        if shipped is not None and any(e.src == SOURCE for e in s.partition.inputs):
            weights[DATA_TOKENS_KEY] = shipped
        msg = Assign(
            request_id=next_request_id(), term=term, job_id=layout.job_id,
            plan_version=plan_version, partition=s.stage, graph=ir.dumps(s.partition.graph),
            edges=mine, nodes=dict(job_nodes), config=config,  # type: ignore[arg-type]
        )
        out[s.node_id] = (msg, state_to_bytes(weights))
    return out
