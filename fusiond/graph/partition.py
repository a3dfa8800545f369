"""Cut an IR graph into partitions: each a standalone sub-graph plus its boundary edges.

A partition's sub-graph is itself an `ir.Graph`: its inputs are the values it receives (named by
`Ref.key` of the producing value, e.g. `"addmm_3:0"`, or the graph input's own name such as
`"targets"`), its outputs the values it sends (same names) and the original graph outputs it
computes (e.g. `"loss"`). So a daemon gets exactly its sub-graph on the wire (`ir.dumps`) and
builds it with `build_program`; nothing else of the model is needed there.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fusiond.graph.errors import PartitionError
from fusiond.graph.program import GraphProgram, build_program
from protocol import ir

SOURCE = -1
"""`Edge.src` of a graph input: the data source (every partition may read the batch)."""
SINK = -1
"""`Edge.dst` of a graph output (the loss) leaving the model."""


@dataclass(frozen=True, slots=True)
class Edge:
    """One tensor crossing a cut: `value` produced in `src`, consumed in `dst`.

    A value consumed by several partitions has one edge per destination (it is sent to each;
    their gradients are summed by the producer). `value` is the sub-graph input/output name.
    """

    value: str
    src: int
    dst: int
    meta: ir.TensorMeta
    producer: ir.Ref | None = None
    """The value in the original graph: a node output, or the graph input (SOURCE edges)."""

    @property
    def id(self) -> str:
        """Unique edge id: `<value>-><dst>` (or `<value>->out` for a graph output)."""
        return f"{self.value}->{'out' if self.dst == SINK else self.dst}"

    @property
    def needs_grad(self) -> bool:
        """Whether a gradient flows back on this edge (float tensors only)."""
        return self.meta.is_float


@dataclass(frozen=True)
class Partition:
    """One partition: its nodes, its standalone sub-graph and its boundary.

    `inputs`: edges coming in (src = producing partition, or `SOURCE` for a graph input);
    `outputs`: edges going out (dst = consuming partition, or `SINK` for a graph output).
    `param_names`: parameters/buffers/constants it holds (graph names; tied parameters read by
    several partitions are held by each and their gradients must be summed).
    """

    id: int
    node_ids: tuple[str, ...]
    graph: ir.Graph
    inputs: tuple[Edge, ...]
    outputs: tuple[Edge, ...]
    param_names: tuple[str, ...]

    @property
    def loss_outputs(self) -> tuple[str, ...]:
        """Names of original graph outputs (the loss) this partition computes."""
        return tuple(e.value for e in self.outputs if e.dst == SINK)

    def build(
        self,
        state: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        copy: bool = True,
    ) -> GraphProgram:
        """A runnable module of this partition with its parameters from `state` (graph names)."""
        return build_program(self.graph, state, device=device, copy=copy)


def partition(graph: ir.Graph, assignment: Mapping[str, int]) -> list[Partition]:
    """Cut `graph` by `assignment` (node id -> partition id) into partitions, in a topological
    order of partitions (every edge goes from an earlier to a later partition).

    Nodes whose outputs are all symbolic scalars (size arithmetic) may be left out of
    `assignment`: each is placed with its first consumer. Raises `PartitionError` for an
    unassigned tensor node, an unknown node id, or a cycle between partitions (name the cycle).
    """
    unknown = set(assignment) - set(graph.node_map)
    if unknown:
        raise PartitionError(f"assignment names unknown nodes: {sorted(unknown)[:5]}")
    assign: dict[str, int] = dict(assignment)
    for n in reversed(graph.nodes):
        if n.id in assign:
            continue
        if all(not m.is_tensor for m in n.outputs):
            users = graph.consumers[n.id]
            placed = [assign[u] for u in users if u in assign]
            assign[n.id] = placed[0] if placed else min(assignment.values(), default=0)
        else:
            raise PartitionError(f"node {n.id!r} ({n.op}, {n.module_path!r}) is not assigned")
    pids = sorted(set(assign.values()))

    # Values crossing cuts: value key -> (producing partition, consumers).
    producer: dict[str, int] = {}
    for n in graph.nodes:
        producer[n.id] = assign[n.id]
    crossing: dict[str, dict[int, None]] = {}  # value key -> ordered set of dst partitions
    ref_of: dict[str, ir.Ref] = {}
    for n in graph.nodes:
        p = assign[n.id]
        for r in n.refs():
            if r.kind is ir.RefKind.NODE and producer[r.name] != p:
                crossing.setdefault(r.key, {})[p] = None
                ref_of[r.key] = r
    # Partition-level edges must form a DAG.
    succ: dict[int, set[int]] = {p: set() for p in pids}
    for key, dsts in crossing.items():
        src = producer[ref_of[key].name]
        succ[src].update(dsts)
    order = _topo(pids, succ)

    out: list[Partition] = []
    for p in order:
        out.append(_build_partition(graph, p, assign, producer, crossing, ref_of))
    return out


def _topo(pids: Sequence[int], succ: Mapping[int, set[int]]) -> list[int]:
    indeg = {p: 0 for p in pids}
    for s in succ.values():
        for d in s:
            indeg[d] += 1
    ready = sorted(p for p in pids if indeg[p] == 0)
    order: list[int] = []
    while ready:
        p = ready.pop(0)
        order.append(p)
        for d in sorted(succ[p]):
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
        ready.sort()
    if len(order) != len(pids):
        left = [p for p in pids if p not in order]
        raise PartitionError(
            f"partitions {left} depend on each other in a cycle; an assignment must let "
            "partitions run one after another (each value flows to a later partition)"
        )
    return order


def _build_partition(
    graph: ir.Graph,
    p: int,
    assign: Mapping[str, int],
    producer: Mapping[str, int],
    crossing: Mapping[str, Mapping[int, None]],
    ref_of: Mapping[str, ir.Ref],
) -> Partition:
    nodes = [n for n in graph.nodes if assign[n.id] == p]
    node_ids = {n.id for n in nodes}
    in_edges: list[Edge] = []
    sub_inputs: list[ir.InputSpec] = []
    seen_in: set[str] = set()

    def remap(a: ir.Arg) -> ir.Arg:
        if isinstance(a, ir.Ref):
            if a.kind is ir.RefKind.NODE and a.name not in node_ids:
                key = a.key
                if key not in seen_in:
                    seen_in.add(key)
                    meta = graph.meta_of(a)
                    in_edges.append(Edge(key, producer[a.name], p, meta, a))
                    sub_inputs.append(ir.InputSpec(key, meta))
                return ir.Ref(ir.RefKind.INPUT, key)
            if a.kind is ir.RefKind.INPUT and a.name not in seen_in:
                seen_in.add(a.name)
                meta = graph.meta_of(a)
                in_edges.append(Edge(a.name, SOURCE, p, meta, a))
                sub_inputs.append(ir.InputSpec(a.name, meta))
            return a
        if isinstance(a, tuple):
            return tuple(remap(x) for x in a)
        return a

    new_nodes: list[ir.Node] = []
    params: dict[str, None] = {}
    for n in nodes:
        args = tuple(remap(a) for a in n.args)
        kwargs = {k: remap(v) for k, v in n.kwargs.items()}
        new_nodes.append(ir.Node(n.id, n.op, args, kwargs, n.outputs, n.params, n.module_path))
        params.update(dict.fromkeys(n.params))
    # Graph inputs keep their order from the original graph (data first, targets last).
    order = {i.name: k for k, i in enumerate(graph.inputs)}
    pairs = sorted(
        zip(sub_inputs, in_edges, strict=True),
        key=lambda ie: (ie[1].src != SOURCE, order.get(ie[0].name, 0)),
    )
    sub_inputs = [a for a, _ in pairs]
    in_edges = [b for _, b in pairs]

    out_edges: list[Edge] = []
    sub_outputs: list[ir.OutputSpec] = []
    for key, dsts in crossing.items():
        r = ref_of[key]
        if r.name in node_ids:
            meta = graph.meta_of(r)
            sub_outputs.append(ir.OutputSpec(key, r))
            out_edges.extend(Edge(key, p, d, meta, r) for d in dsts)
    for o in graph.outputs:
        if o.ref.kind is ir.RefKind.NODE and o.ref.name in node_ids:
            sub_outputs.append(ir.OutputSpec(o.name, o.ref))
            out_edges.append(Edge(o.name, p, SINK, graph.meta_of(o.ref), o.ref))
    updates = {b: r for b, r in graph.buffer_updates.items() if r.name in node_ids}
    params.update(dict.fromkeys(updates))
    pmap = graph.param_map
    sub = ir.Graph(
        inputs=tuple(sub_inputs),
        outputs=tuple(sub_outputs),
        params=tuple(pmap[n] for n in params),
        nodes=tuple(new_nodes),
        symbols=dict(graph.symbols),
        symbol_ranges=dict(graph.symbol_ranges),
        aliases={a: c for a, c in graph.aliases.items() if c in params},
        buffer_updates=updates,
        meta={**graph.meta, "partition": str(p)},
    )
    ir.validate(sub)
    return Partition(
        p, tuple(node_ids_in_order(nodes)), sub, tuple(in_edges), tuple(out_edges), tuple(params)
    )


def node_ids_in_order(nodes: Sequence[ir.Node]) -> list[str]:
    """Node ids in graph order."""
    return [n.id for n in nodes]


# --------------------------------------------------------------------------------------------
# Assignments (helpers for tests, benchmarks and simple planners)


def contiguous_assignment(graph: ir.Graph, parts: int, *, by: str = "nodes") -> dict[str, int]:
    """Cut the node list into `parts` contiguous runs of (about) equal node count, or equal
    parameter count with `by="params"`. Partition ids follow graph order."""
    if parts < 1:
        raise PartitionError("parts must be >= 1")
    weights: list[float] = []
    pmap = graph.param_map
    for n in graph.nodes:
        if by == "params":
            w = 1.0 + sum(float(pmap[x].meta.numel(graph.symbols)) for x in n.params if x in pmap)
        else:
            w = 1.0
        weights.append(w)
    total = sum(weights)
    out: dict[str, int] = {}
    acc = 0.0
    for n, w in zip(graph.nodes, weights, strict=True):
        out[n.id] = min(parts - 1, int(acc / total * parts))
        acc += w
    return out


def interleaved_assignment(graph: ir.Graph, parts: int, *, seed: int = 0) -> dict[str, int]:
    """A scattered but runnable assignment, for tests: node by node, each op goes to a random
    partition between the latest partition of its inputs and its position's share of the graph
    (so partitions stay a DAG, but ops of one layer spread over several partitions, edges skip
    partitions and values fan out), then the ids are shuffled so they do not follow graph order.
    Every one of the `parts` ids is used (retrying other seeds if needed)."""
    if parts < 1:
        raise PartitionError("parts must be >= 1")
    total = len(graph.nodes)
    for attempt in range(64):
        rng = random.Random(seed * 1000 + attempt)
        rank: dict[str, int] = {}
        for i, n in enumerate(graph.nodes):
            lo = max((rank[r.name] for r in n.refs() if r.kind is ir.RefKind.NODE), default=0)
            base = i * parts // total
            rank[n.id] = rng.randint(lo, max(lo, base))
        if len(set(rank.values())) == parts:
            perm = list(range(parts))
            rng.shuffle(perm)
            return {k: perm[v] for k, v in rank.items()}
    raise PartitionError(f"could not spread {total} nodes over {parts} partitions")


def summary(parts: Sequence[Partition]) -> list[dict[str, Any]]:
    """One row per partition (ops, params, in/out edges) for logs and reports."""
    return [
        {
            "id": p.id,
            "nodes": len(p.node_ids),
            "params": len(p.param_names),
            "in": [e.id for e in p.inputs],
            "out": [e.id for e in p.outputs],
        }
        for p in parts
    ]
