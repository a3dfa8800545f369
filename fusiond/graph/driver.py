"""Remote-autodiff execution of a partitioned graph, in one process.

`StageRunner` is the per-partition unit the training executor distributes: forward takes the
received tensors, makes each a fresh leaf that requires grad (float tensors only), runs the
partition with local autograd and keeps what backward needs (per micro-batch key); backward
takes the gradients of its outgoing values (already summed over fan-out), runs local autograd,
and returns the gradients of its incoming values. Parameter gradients accumulate in `.grad`.

`Driver` runs all partitions of a graph that way, in the partitions' topological order, with
optional top-k edges, and sums the gradients of parameters held by several partitions (tied
weights): the invariant is that, uncompressed, it equals the unpartitioned model.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fusiond.graph import wire
from fusiond.graph.errors import ExecutionError
from fusiond.graph.partition import SINK, SOURCE, Partition, partition
from fusiond.graph.program import GraphProgram, torch_dtype
from protocol import ir


@dataclass
class _Stash:
    leaves: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


class StageRunner:
    """Runs one partition with remote-autodiff semantics.

    Values are named as in `Partition.graph` (incoming/outgoing `Edge.value`). Several forwards
    may be outstanding (pipelining): each is stashed under its `key` until its backward.
    """

    def __init__(self, part: Partition, module: GraphProgram) -> None:
        self.partition = part
        self.module = module
        self._loss_names = frozenset(part.loss_outputs)
        self._stash: dict[Hashable, _Stash] = {}

    def forward(
        self, inputs: Mapping[str, torch.Tensor], key: Hashable = 0
    ) -> dict[str, torch.Tensor]:
        """Run forward; returns every output value by name (detached copies are the caller's
        job when sending). Incoming float tensors become leaves requiring grad."""
        if key in self._stash:
            raise ExecutionError(f"partition {self.partition.id}: forward {key!r} already ran")
        leaves: dict[str, torch.Tensor] = {}
        args: list[torch.Tensor] = []
        for name in self.module.input_names:
            t = inputs.get(name)
            if t is None:
                raise ExecutionError(
                    f"partition {self.partition.id}: input {name!r} missing (have {sorted(inputs)})"
                )
            if t.is_floating_point() or t.is_complex():
                t = t.detach().requires_grad_(True)
                leaves[name] = t
            args.append(t)
        outs = self.module(*args)
        outputs = dict(zip(self.module.output_names, outs, strict=True))
        if torch.is_grad_enabled():
            self._stash[key] = _Stash(leaves, outputs)
        return outputs

    def backward(
        self,
        grads: Mapping[str, torch.Tensor | None],
        key: Hashable = 0,
        *,
        loss_scale: float = 1.0,
    ) -> dict[str, torch.Tensor | None]:
        """Backpropagate the gradients of this partition's outgoing values (the loss gets
        `loss_scale`, e.g. 1/M for M micro-batches, unless given); return the gradients of
        its incoming float values (None where no gradient flowed)."""
        st = self._stash.pop(key, None)
        if st is None:
            raise ExecutionError(f"partition {self.partition.id}: no forward {key!r} to backward")
        roots: list[torch.Tensor] = []
        gts: list[torch.Tensor] = []
        for name, out in st.outputs.items():
            g = grads.get(name)
            if g is None and name in self._loss_names:
                g = torch.full_like(out, loss_scale)
            if g is None or not out.requires_grad:
                continue
            if g.shape != out.shape:
                raise ExecutionError(
                    f"partition {self.partition.id}: gradient of {name!r} has shape "
                    f"{tuple(g.shape)}, the value {tuple(out.shape)}"
                )
            roots.append(out)
            gts.append(g.to(out.dtype))
        if roots:
            torch.autograd.backward(roots, gts)
        return {name: leaf.grad for name, leaf in st.leaves.items()}

    def discard(self, key: Hashable) -> None:
        """Drop a stashed forward (a failed micro-batch)."""
        self._stash.pop(key, None)


@dataclass
class EdgeTraffic:
    """Bytes a top-k edge moved in the last step: forward payload and backward payload."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    dense_bytes: int = 0


class Driver:
    """Runs a partitioned model forward and backward in one process.

    `topk` maps a value name (an `Edge.value`) to a density: every edge of that value travels
    top-k (forward TOPK, backward VALUES, through `protocol.tensors`). `value_dtype` is the
    precision of the kept values ("fp32" keeps density 1.0 exact).
    """

    def __init__(
        self,
        graph: ir.Graph,
        assignment: Mapping[str, int],
        state: Mapping[str, torch.Tensor],
        *,
        topk: Mapping[str, float] | None = None,
        value_dtype: str = "fp32",
        device: torch.device | str | None = None,
    ) -> None:
        self.graph = graph
        self.partitions = partition(graph, assignment)
        self.runners = [StageRunner(p, p.build(state, device=device)) for p in self.partitions]
        self.topk = dict(topk or {})
        values = {e.value for p in self.partitions for e in p.outputs}
        unknown = set(self.topk) - values
        if unknown:
            raise ExecutionError(f"top-k for values that cross no cut: {sorted(unknown)[:5]}")
        self.value_dtype = value_dtype
        self.traffic: dict[str, EdgeTraffic] = {}

    def forward_backward(
        self, inputs: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """One forward and backward over all partitions; returns the graph outputs (the loss,
        detached). Parameter gradients accumulate in each partition module's `.grad`."""
        if not isinstance(inputs, Mapping):
            inputs = {i.name: t for i, t in zip(self.graph.inputs, inputs, strict=True)}
        inbox: list[dict[str, torch.Tensor]] = [{} for _ in self.runners]
        pos = {p.id: i for i, p in enumerate(self.partitions)}
        sent_idx: dict[tuple[str, int], np.ndarray] = {}
        results: dict[str, torch.Tensor] = {}
        self.traffic = {}
        for i, r in enumerate(self.runners):
            p = self.partitions[i]
            feed = dict(inbox[i])
            for e in p.inputs:
                if e.src == SOURCE:
                    feed[e.value] = inputs[e.value]
            outs = r.forward(feed)
            for e in p.outputs:
                t = outs[e.value]
                if e.dst == SINK:
                    results[e.value] = t.detach()
                    continue
                if e.value in self.topk and t.is_floating_point():
                    sent = wire.topk_forward(t, self.topk[e.value], self.value_dtype)
                    recv, idx = wire.topk_receive(sent.payload, t.dtype)
                    sent_idx[(e.value, e.dst)] = sent.indices
                    if not np.array_equal(idx, sent.indices):
                        raise ExecutionError(f"top-k edge {e.id}: receiver indices differ")
                    tr = self.traffic.setdefault(e.id, EdgeTraffic())
                    tr.forward_bytes += len(sent.payload)
                    tr.dense_bytes += t.numel() * t.element_size()
                    inbox[pos[e.dst]][e.value] = recv
                else:
                    # What the wire delivers: a contiguous copy (strides are not sent).
                    inbox[pos[e.dst]][e.value] = t.detach().contiguous()
        # Backward in reverse order; grads of a value from several destinations are summed.
        gbox: list[dict[str, torch.Tensor]] = [{} for _ in self.runners]
        for i in range(len(self.runners) - 1, -1, -1):
            p = self.partitions[i]
            in_grads = self.runners[i].backward(gbox[i])
            for e in p.inputs:
                if e.src == SOURCE:
                    continue
                g = in_grads.get(e.value)
                if g is None:
                    continue
                if (e.value, p.id) in sent_idx:
                    idx = sent_idx[(e.value, p.id)]
                    payload = wire.values_backward(g, idx, self.value_dtype)
                    self.traffic[e.id].backward_bytes += len(payload)
                    g = wire.values_receive(payload, idx, g.dtype)
                box = gbox[pos[e.src]]
                box[e.value] = box[e.value] + g if e.value in box else g
        return results

    def modules(self) -> list[GraphProgram]:
        """The partition modules, in execution order."""
        return [r.module for r in self.runners]

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        """Every parameter of every partition (tied parameters once per holder)."""
        for m in self.modules():
            yield from m.parameters()

    def zero_grad(self) -> None:
        """Clear parameter gradients in every partition."""
        for m in self.modules():
            m.zero_grad(set_to_none=True)

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Gradients by the model's own parameter names (aliases of tied weights included),
        summed over the partitions that hold a parameter."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules():
            for name, prm in m.named_parameters():
                if prm.grad is None:
                    continue
                out[name] = out[name] + prm.grad if name in out else prm.grad.clone()
        for alias, canon in self.graph.aliases.items():
            if canon in out:
                out[alias] = out[canon]
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The merged state of all partitions under the model's names (aliases included)."""
        out: dict[str, torch.Tensor] = {}
        for m in self.modules():
            out.update(m.state_dict())
        for alias, canon in self.graph.aliases.items():
            if canon in out:
                out[alias] = out[canon]
        return out


def input_dtype(graph: ir.Graph, name: str) -> torch.dtype:
    """The torch dtype of graph input `name` (for building batches)."""
    for i in graph.inputs:
        if i.name == name:
            return torch_dtype(i.meta.dtype)
    raise ExecutionError(f"graph has no input {name!r}")
