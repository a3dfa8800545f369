"""From a captured graph to stage programs: capture a job's model, cut it, build each stage.

`capture_job(spec)` runs where the job is submitted (it calls the user's model factory).
`stage_programs(graph, partitions, state, densities)` turns `fusiond.graph` partitions into
`StageProgram`s for `StageExecutor`: stage i is `partitions[i]` (partition() returns them in a
topological order, which is the pipeline order), edges are keyed by `Edge.id`, the graph's
first input is the batch's `inputs` and its `targets` input the batch's targets, and parameters
held by several partitions (tied weights) are listed as shared so their gradients are summed.
`stage_program(part, ...)` builds one stage, which is what a daemon does with its Assign.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from fusiond.graph import (
    SINK,
    SOURCE,
    CapturedModel,
    GraphProgram,
    Partition,
    build_program,
    capture,
)
from fusiond.train.codec import EdgeEncoding
from fusiond.train.data import Batch, DataSource, make_source
from fusiond.train.model import Feed, build_model, feed_for, loss_fn
from fusiond.train.segments import SegmentPlan, SegmentRunner
from fusiond.train.spec import JobSpec
from fusiond.train.stage import EdgeSpec, StageError, StageProgram
from protocol import ir

__all__ = [
    "build_stage_module",
    "capture_job",
    "capture_job_feed",
    "compressible_edges",
    "cut_densities",
    "data_inputs",
    "graph_data_names",
    "random_seeder",
    "shared_params",
    "stage_program",
    "stage_programs",
    "trainable_params",
]


def build_stage_module(graph: ir.Graph, state: Mapping[str, torch.Tensor], *,
                       copy: bool = True, device: torch.device | str | None = None
                       ) -> GraphProgram:
    """Build a partition's sub-graph into a module that does not depend on input strides.

    A received tensor is always contiguous, but the graph was traced with the producer's
    strides: a `view` that was valid on, say, a transposed activation can fail on its contiguous
    copy (seen on Hugging Face GPT-2). `reshape` is the same op wherever the view is valid and
    copies where it is not, so every `aten.view` becomes `aten.reshape` (same values, same
    gradients). `device`: where its weights live and it computes (`build_program`).
    """
    module = build_program(graph, state, copy=copy, device=device)
    changed = False
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        module.recompile()
    return module


def capture_job(spec: JobSpec, source: DataSource | None = None
                ) -> tuple[torch.nn.Module, CapturedModel]:
    """Build the job's model (seeded by `spec.seed`) and capture it with its loss.

    The example batch is a real micro-batch from the job's data (at least 2 samples: torch.export
    specialises a batch dimension of 1); the batch dimension stays dynamic. The batch's fields
    reach the model by keyword where its forward names them (`resolve_feed`), and the graph's
    inputs carry the fields' names (`input_ids`, `attention_mask`, ..., `labels`); a model fed
    by position has the inputs `input` and `targets`.
    """
    model, captured, _ = capture_job_feed(spec, source)
    return model, captured


def capture_job_feed(spec: JobSpec, source: DataSource | None = None,
                     model: torch.nn.Module | None = None
                     ) -> tuple[torch.nn.Module, CapturedModel, Feed]:
    """`capture_job`, and the `Feed` it captured the model with (`model`: the job's model,
    already built by `build_model`; built here when None)."""
    if model is None:
        model = build_model(spec.model, seed=spec.seed)
    model.train()
    if source is None:
        source = make_source(spec.data, spec.seed)
    batch: Batch = source.batch(0, max(2, spec.batch.micro_batch_size))
    feed = feed_for(model, batch, spec)
    captured = capture(model, feed.example(batch), targets=batch.targets,
                       loss=loss_fn(spec.loss),
                       targets_name=feed.target if feed.by_keyword else "targets")
    return model, captured, feed


def data_inputs(graph_inputs: Collection[str], edge_values: Collection[str],
                input_name: str, targets_name: str | None) -> dict[str, str]:
    """batch key -> graph input, for the graph inputs a partition reads from the data (every
    input that no edge feeds): the main input is the batch's "inputs", the labels its
    "targets", any other input the batch field of its own name (`attention_mask`, ...)."""
    out: dict[str, str] = {}
    for name in graph_inputs:
        if name in edge_values:
            continue
        key = "inputs" if name == input_name else "targets" if name == targets_name else name
        out[key] = name
    return out


def graph_data_names(graph: ir.Graph) -> tuple[str, str | None]:
    """(main input, labels) of a job graph: its first input and its `targets` or `labels`."""
    names = [i.name for i in graph.inputs]
    targets = next((n for n in ("targets", "labels") if n in names), None)
    inputs = [n for n in names if n != targets]
    if not inputs:
        raise StageError(f"a job's graph takes at least one data input, got {names}")
    return inputs[0], targets


def random_seeder(module: GraphProgram, seed: int) -> Callable[[int, int], None] | None:
    """What keys `module`'s random ops to (job seed, step, micro-batch) before each forward
    (None: it has none), so a job's dropout masks are a function of its seed."""
    state = module.random
    if state is None:
        return None

    def seed_random(step: int, micro: int) -> None:
        state.set(seed, step, micro)
    return seed_random


def trainable_params(p: Partition, state: Mapping[str, torch.Tensor]) -> list[str]:
    """The partition's trainable floating-point parameters (what an optimizer steps)."""
    out: list[str] = []
    for name in p.param_names:
        t = state.get(name)
        if t is None or not t.is_floating_point():
            continue
        spec = p.graph.param_map.get(name)
        if spec is None or spec.kind is not ir.ParamKind.PARAMETER or not spec.requires_grad:
            continue
        out.append(name)
    return out


def shared_params(partitions: Sequence[Partition], stage_of: Mapping[int, int],
                  state: Mapping[str, torch.Tensor]) -> dict[int, dict[str, tuple[int, ...]]]:
    """stage -> {parameter name -> the other stages holding it}, for trainable parameters only."""
    holders: dict[str, list[int]] = {}
    for p in partitions:
        for name in trainable_params(p, state):
            holders.setdefault(name, []).append(stage_of[p.id])
    out: dict[int, dict[str, tuple[int, ...]]] = {stage_of[p.id]: {} for p in partitions}
    for name, stages in holders.items():
        if len(stages) > 1:
            for s in stages:
                out[s][name] = tuple(sorted(x for x in stages if x != s))
    return out


def compressible_edges(partitions: Sequence[Partition], exact: Sequence[str] = ()) -> list[str]:
    """The ids of every float cut edge, except edges (or values) named in `exact`."""
    return [e.id for p in partitions for e in p.outputs
            if e.dst != SINK and e.meta.is_float and e.id not in exact and e.value not in exact]


def cut_densities(partitions: Sequence[Partition], density: float | None,
                  exact: Sequence[str] = ()) -> dict[str, float]:
    """Edge id -> density for every float cut edge, except edges (or values) named in `exact`."""
    if density is None:
        return {}
    return dict.fromkeys(compressible_edges(partitions, exact), density)


def stage_program(
    part: Partition,
    state: Mapping[str, torch.Tensor],
    *,
    stage_of: Mapping[int, int],
    input_name: str,
    targets_name: str | None,
    densities: Mapping[str, float] | None = None,
    shared: Mapping[str, tuple[int, ...]] | None = None,
    per_row: bool = True,
    int8_edges: Collection[str] = (),
    seed: int = 0,
    encodings: Mapping[str, EdgeEncoding] | None = None,
    segments: SegmentPlan | None = None,
    copy: bool = True,
    device: torch.device | str | None = None,
) -> StageProgram:
    """Build one partition into a `StageProgram` (parameters copied from `state`); an edge in
    `encodings` travels so encoded both ways (`int8_edges`: int8), the others exact or top-k
    at their `densities`. With `segments`, the program runs segment by segment, the ones the
    plan says checkpointed (`fusiond.train.segments`). `copy=False` takes `state`'s tensors
    as the parameters (a caller that loaded them for this stage only). `device`: where its
    weights live (the executor's `StageConfig.device` must name the same)."""
    densities = densities or {}
    encodings = encodings or {}

    def edge(eid: str, src: int, dst: int) -> EdgeSpec:
        enc: EdgeEncoding = encodings.get(eid, "int8" if eid in int8_edges else "raw")
        return EdgeSpec(eid, src, dst, densities.get(eid), per_row, enc)

    module = build_stage_module(part.graph, state, copy=copy, device=device)
    runner = SegmentRunner(part.graph, module, segments) if segments is not None else None
    forward = runner.run if runner is not None else module.run
    stage = stage_of[part.id]
    in_edges: list[EdgeSpec] = []
    data_map: dict[str, str] = {}  # graph input name -> batch key
    for e in part.inputs:
        if e.src == SOURCE:
            data_map.update({v: k for k, v in data_inputs(
                [e.value], (), input_name, targets_name).items()})
            continue
        in_edges.append(edge(e.id, stage_of[e.src], stage))
    out_edges: list[EdgeSpec] = []
    loss_name: str | None = None
    for e in part.outputs:
        if e.dst == SINK:
            if loss_name is None:
                loss_name = e.value
            continue
        out_edges.append(edge(e.id, stage, stage_of[e.dst]))
    in_value = {e.id: e.value for e in part.inputs}
    out_value = {e.id: e.value for e in part.outputs}
    data_key = {v: k for k, v in data_map.items()}

    def run(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        feed: dict[str, torch.Tensor] = {}
        for key, t in inputs.items():
            if key in in_value:
                feed[in_value[key]] = t
            elif key in data_key:
                feed[data_key[key]] = t
        outs = forward(feed)
        result = {eid: outs[out_value[eid]] for eid in (e.edge_id for e in out_edges)}
        if loss_name is not None:
            result["loss"] = outs[loss_name]
        return result

    return StageProgram(
        module=module,
        run=run,
        in_edges=tuple(in_edges),
        out_edges=tuple(out_edges),
        data_inputs=tuple(sorted(set(data_map.values()))),
        has_loss=loss_name is not None,
        shared=dict(shared or {}),
        seed_random=random_seeder(module, seed),
        segments=runner,
    )


def stage_programs(
    graph: ir.Graph,
    partitions: Sequence[Partition],
    state: Mapping[str, torch.Tensor],
    *,
    densities: Mapping[str, float] | None = None,
    per_row: bool = True,
    int8_edges: Collection[str] = (),
    seed: int = 0,
    encodings: Mapping[str, EdgeEncoding] | None = None,
    device: torch.device | str | None = None,
) -> list[StageProgram]:
    """Every partition as a stage program; stage i is `partitions[i]` (edges in `encodings`
    travel so encoded, those in `int8_edges` int8), its weights on `device`."""
    stage_of = {p.id: i for i, p in enumerate(partitions)}
    shared = shared_params(partitions, stage_of, state)
    main, targets = graph_data_names(graph)
    return [
        stage_program(
            p, state, stage_of=stage_of, input_name=main, targets_name=targets,
            densities=densities, shared=shared[stage_of[p.id]], per_row=per_row,
            int8_edges=int8_edges, seed=seed, encodings=encodings, device=device,
        )
        for p in partitions
    ]
