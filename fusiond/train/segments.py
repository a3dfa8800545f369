"""A stage's program cut into segments at block boundaries, each run plain or checkpointed.

The per-block half of AutoHete's memory planner (issue 17): a segment is a contiguous run of the
stage graph's nodes (a transformer block, the embedding, the head: `block_keys`). A checkpointed
segment keeps only its inputs in the forward and runs again in the backward
(`torch.utils.checkpoint`, non-reentrant), so a stage keeps one segment's activations plus
every segment's inputs instead of every activation; a plain segment keeps its activations.

Exact: the segments are the stage graph's own nodes, built over the stage module's own
parameter and buffer objects (one set of weights, one gradient per parameter), and a random
op's draws are keyed to (seed, step, micro-batch, node) (`fusiond.graph.RandomState`), so the
second forward draws what the first drew. A segment whose nodes update a buffer (BatchNorm's
running statistics) is never checkpointed: its second forward would update it twice.

`SegmentRunner.run(feed)` is `GraphProgram.run(feed)` for the same graph. Hooks
(`on_forward(i)` before segment i's forward, `on_backward(i)` once the gradient of segment i's
inputs is computed) let the parameter offload (`fusiond.train.offload.DiskParameters`) keep
only the segments near the one running in memory; `after_forward(i)` once segment i's forward
is done (the stage trims the C heap there after a checkpointed one: the intermediates it freed
would otherwise stay resident around the next segment's kept input).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusiond.graph import GraphProgram, partition
from fusiond.graph.program import build_program
from protocol import ir

__all__ = ["SegmentPlan", "SegmentRunner"]


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of a stage graph: `starts[i]` is the node position segment i begins at
    (`starts[0] == 0`, increasing), `recompute[i]` whether it is checkpointed."""

    starts: tuple[int, ...]
    recompute: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.starts or self.starts[0] != 0:
            raise ValueError("a segment plan starts at node 0")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False)):
            raise ValueError(f"segment starts {self.starts} are not increasing")
        if len(self.recompute) != len(self.starts):
            raise ValueError(f"{len(self.starts)} segments but {len(self.recompute)} flags")


def _rebind(seg: nn.Module, owner: nn.Module) -> None:
    """Make `seg`'s parameters and buffers the very objects `owner` holds under the same
    names (one set of weights, gradients accumulated in one place)."""
    params = dict(owner.named_parameters())
    buffers = dict(owner.named_buffers())
    for name, _ in list(seg.named_parameters()):
        *path, leaf = name.split(".")
        mod = seg.get_submodule(".".join(path)) if path else seg
        mod._parameters[leaf] = params[name]
    for name, _ in list(seg.named_buffers()):
        *path, leaf = name.split(".")
        mod = seg.get_submodule(".".join(path)) if path else seg
        mod._buffers[leaf] = buffers[name]


class SegmentRunner:
    """Runs `graph` (built as `owner`, a `GraphProgram` of the same graph) segment by
    segment per `plan` (see the module's docstring)."""

    def __init__(self, graph: ir.Graph, owner: GraphProgram, plan: SegmentPlan) -> None:
        n = len(graph.nodes)
        if plan.starts[-1] >= n:
            raise ValueError(f"segment start {plan.starts[-1]} is past the graph's {n} nodes")
        seg_of: dict[str, int] = {}
        bounds = [*plan.starts, n]
        for i in range(len(plan.starts)):
            for node in graph.nodes[bounds[i]:bounds[i + 1]]:
                if any(m.is_tensor for m in node.outputs):
                    seg_of[node.id] = i
        parts = partition(graph, seg_of)
        if [p.id for p in parts] != sorted(p.id for p in parts):
            raise ValueError("segments are not in the graph's order")
        state = dict(owner.state_dict(keep_vars=True))
        state.update(dict(owner.named_buffers()))
        self.parts = parts
        self.modules: list[GraphProgram] = []
        for p in parts:
            sub = build_program(p.graph, {k: v.detach() for k, v in state.items()}, copy=False)
            for node in sub.graph.nodes:  # as build_stage_module: strides-proof views
                if node.op == "call_function" and node.target is torch.ops.aten.view.default:
                    node.target = torch.ops.aten.reshape.default
            sub.recompile()
            _rebind(sub, owner)
            self.modules.append(sub)
        flags = dict(zip(range(len(plan.starts)), plan.recompute, strict=True))
        self.recompute = tuple(flags[p.id] and not p.graph.buffer_updates for p in parts)
        """Per segment (in `parts` order): checkpointed (a segment updating a buffer never)."""
        self.input_names = tuple(i.name for i in graph.inputs)
        self.output_refs = {o.name: o.ref for o in graph.outputs}
        self.owner = owner
        self.on_forward: Callable[[int], None] | None = None
        self.on_backward: Callable[[int], None] | None = None
        self.after_forward: Callable[[int], None] | None = None

    def param_names(self) -> list[list[str]]:
        """The parameter names each segment reads (a tied one in each that reads it)."""
        return [[n for n, _ in m.named_parameters()] for m in self.modules]

    def _hook_backward(self, i: int, tensors: Sequence[torch.Tensor]) -> None:
        if self.on_backward is None or not torch.is_grad_enabled():
            return
        for t in tensors:
            if t.requires_grad:
                cb = self.on_backward
                t.register_hook(  # type: ignore[no-untyped-call]
                    lambda g, i=i, cb=cb: (cb(i), g)[1])
                return

    def run(self, feed: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The whole graph's outputs by name, as `GraphProgram.run(feed)`."""
        if self.owner.random is not None:  # the stage keys the owner's draws: follow it
            for m in self.modules:
                if m.random is not None:
                    m.random.key = self.owner.random.key
        env: dict[str, torch.Tensor] = dict(feed)
        for i, (p, mod) in enumerate(zip(self.parts, self.modules, strict=True)):
            args = [env[e.value] for e in p.inputs]
            if self.on_forward is not None:
                self.on_forward(i)
            self._hook_backward(i, args)
            if self.recompute[i] and torch.is_grad_enabled():
                outs = checkpoint(mod, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                outs = mod(*args)
            for spec, v in zip(p.graph.outputs, outs, strict=True):
                env[spec.name] = v
            if self.after_forward is not None:
                self.after_forward(i)
        result: dict[str, torch.Tensor] = {}
        for name, ref in self.output_refs.items():
            result[name] = env[name] if name in env else env[ref.name]
        return result
