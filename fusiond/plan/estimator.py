"""Workload estimator: the OP-DAG IR -> the planner's `CostGraph` (analytic FLOPs and bytes).

Per node, at concrete symbol values (batch, sequence, ...): forward/backward FLOPs, memory
traffic, trainable parameter and optimizer-state bytes, activations saved for backward and the
size of every output. Common ATen ops have analytic rules (matmul/linear, convolution,
attention, norms, softmax, embedding, elementwise, reductions, views); any other op gets a
conservative fallback (it reads all inputs, writes all outputs, 2 FLOPs per output element,
saves its inputs). Per-sample fields are the totals at the given batch divided by the batch.

Graph inputs (data, targets) are not edges: every partition that reads one is fed by the local
data source (`fusiond.graph.partition.SOURCE`), so they cost no link traffic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fusiond.plan.model import CostGraph, OpCost, PlanError, TensorEdge
from protocol import ir

_MATMUL = "matmul"
_CONV = "conv"
_ATTENTION = "attention"
_OTHER = "other"

#: ops that only reinterpret memory (or compute sizes): no FLOPs, no traffic
_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "slice", "select", "split", "split_with_sizes", "unbind", "alias", "detach",
    "as_strided", "sym_size", "sym_numel", "sym_stride", "lift_fresh_copy", "unflatten",
    "flatten", "chunk", "narrow", "view_as", "expand_as", "squeeze_", "unsqueeze_",
})  # fmt: skip
#: elementwise ops whose backward needs their inputs (nonlinear or multiplicative)
_SAVES_INPUTS = frozenset({
    "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "pow", "exp", "log", "sqrt",
    "rsqrt", "hardtanh", "leaky_relu", "elu", "erf", "sin", "cos", "threshold", "clamp",
    "abs", "maximum", "minimum", "where", "mean", "native_dropout", "dropout",
})  # fmt: skip
#: FLOPs per element of elementwise ops (transcendentals are dearer)
_EW_FLOPS = {"gelu": 16.0, "silu": 8.0, "tanh": 8.0, "sigmoid": 8.0, "exp": 8.0, "log": 8.0,
             "erf": 8.0, "pow": 8.0, "sqrt": 4.0, "rsqrt": 4.0, "div": 2.0}
NORM_FLOPS_PER_ELEMENT = (8.0, 16.0)
"""Forward and backward FLOPs per element of a normalisation (layer, batch, group, RMS norm)."""
SOFTMAX_FLOPS_PER_ELEMENT = (5.0, 4.0)
"""Forward and backward FLOPs per element of a (log-)softmax."""


def elementwise_flops_per_element(name: str) -> tuple[float, float]:
    """Forward and backward FLOPs per output element of the elementwise op `name` (`gelu`,
    `silu`, `add`, ...): the rule the estimator charges, and the calibration times
    (`fusiond.profile.calibrate`), so the two agree on what a FLOP of class "other" is."""
    per = _EW_FLOPS.get(name, 1.0)
    return per, 2 * per


def attention_flops(lead: int, q_len: int, kv_len: int, head_dim: int,
                    value_dim: int) -> tuple[float, float]:
    """Forward and backward FLOPs of scaled dot-product attention over `lead` (batch x heads)
    independent heads: the two products and the softmax; backward recomputes the scores."""
    scores = float(lead * q_len * kv_len)
    f = 2.0 * scores * head_dim + 2.0 * scores * value_dim + 5.0 * scores
    return f, 2.5 * f


_NO_GRAD = frozenset({"ne", "eq", "lt", "le", "gt", "ge", "arange", "full", "zeros", "ones",
                      "scalar_tensor", "empty", "argmax", "argmin", "logical_not", "logical_and",
                      "sym_size", "randint", "bitwise_not"})


def _short(op: str) -> str:
    """`aten.mm.default` -> `mm`; `sym.add` -> `sym.add`."""
    parts = op.split(".")
    return parts[1] if parts[0] == "aten" and len(parts) >= 2 else op


@dataclass
class _Cost:
    cls: str
    ff: float
    bf: float
    fb: float
    bb: float
    saved: float
    fl: float
    bl: float


def _prod(xs: Iterable[int]) -> int:
    return math.prod(xs)


def _node_cost(
    node: ir.Node,
    ins: list[tuple[tuple[int, ...], int, bool]],
    outs: list[tuple[tuple[int, ...], int]],
    grad: bool,
) -> _Cost:
    """Totals for one node. `ins`: (shape, bytes, is_tensor_float) of tensor inputs (params
    included); `outs`: (shape, bytes) of outputs."""
    name = _short(node.op)
    out_bytes = float(sum(b for _, b in outs))
    out_numel = float(sum(_prod(s) for s, _ in outs))
    in_bytes = float(sum(b for _, b, _ in ins))
    act_in = float(sum(b for _, b, f in ins if f))
    bl = 1.0 if grad else 0.0
    if node.op.startswith("sym.") or name in _VIEWS:
        return _Cost(_OTHER, 0, 0, 0, 0, 0, 1.0, bl)
    shapes = [s for s, _, _ in ins]
    if name in ("linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "addbmm"):
        if name in ("addmm", "baddbmm", "addbmm"):
            inner = shapes[1][-1] if len(shapes) > 1 and shapes[1] else 1
        else:
            inner = shapes[0][-1] if shapes and shapes[0] else 1
        f = 2.0 * out_numel * inner
        x = float(ins[0][1]) if name != "addmm" else float(ins[1][1])
        return _Cost(_MATMUL, f, 2 * f if grad else 0, in_bytes + out_bytes,
                     2 * (in_bytes + out_bytes), x, 1.0, 2 * bl)
    if name in ("convolution", "conv2d", "conv1d", "conv3d", "_convolution"):
        w = shapes[1] if len(shapes) > 1 else (1,)
        groups = node.args[8] if len(node.args) > 8 and isinstance(node.args[8], int) else 1
        per_out = (w[1] if len(w) > 1 else 1) * _prod(w[2:])
        f = 2.0 * out_numel * per_out
        del groups  # weight shape already holds Cin/groups
        return _Cost(_CONV, f, 2 * f if grad else 0, in_bytes + out_bytes,
                     2 * (in_bytes + out_bytes), float(ins[0][1]), 1.0, 2 * bl)
    if name in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention_for_cpu"):
        qs, ks = shapes[0], shapes[1]
        vs = shapes[2] if len(shapes) > 2 else ks
        lead = _prod(qs[:-2])
        L, E, S, Ev = qs[-2], qs[-1], ks[-2], vs[-1]
        scores = float(lead * L * S)
        f, fb = attention_flops(lead, L, S, E, Ev)
        # the CPU kernel materialises the score matrix in blocks; backward recomputes it.
        # Its own class: small per-head products run far below a big matmul's rate.
        return _Cost(_ATTENTION, f, fb if grad else 0, in_bytes + out_bytes + 8 * scores,
                     2 * (in_bytes + out_bytes) + 16 * scores,
                     act_in + out_bytes + 4.0 * lead * L, 1.0, bl * 3)
    if name in ("native_layer_norm", "layer_norm", "native_batch_norm",
                "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
                "_native_batch_norm_legit_no_training", "native_group_norm", "group_norm",
                "rms_norm", "_fused_rms_norm"):
        n = float(_prod(shapes[0])) if shapes else out_numel
        b0 = float(ins[0][1]) if ins else out_bytes
        nf, nb = NORM_FLOPS_PER_ELEMENT
        return _Cost(_OTHER, nf * n, nb * n if grad else 0, 2 * b0 + out_bytes,
                     4 * b0 + out_bytes, b0 + (out_bytes - b0 if out_bytes > b0 else 0),
                     1.0, 2 * bl)
    if name in ("_softmax", "softmax", "_log_softmax", "log_softmax"):
        sf, sb = SOFTMAX_FLOPS_PER_ELEMENT
        return _Cost(_OTHER, sf * out_numel, sb * out_numel if grad else 0, in_bytes + out_bytes,
                     3 * out_bytes, out_bytes, 1.0, bl)
    if name in ("embedding", "embedding_bag"):
        idx = float(ins[1][1]) if len(ins) > 1 else 0.0
        return _Cost(_OTHER, out_numel, out_numel if grad else 0, out_bytes + idx,
                     2 * out_bytes + idx, idx, 1.0, 2 * bl)
    if name in ("sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "prod",
                "norm", "linalg_vector_norm", "logsumexp", "any", "all"):
        n = float(_prod(shapes[0])) if shapes else out_numel
        saved = float(ins[0][1]) if name in ("amax", "amin", "max", "min", "norm", "prod",
                                             "linalg_vector_norm", "logsumexp", "var",
                                             "std") and ins else 0.0
        return _Cost(_OTHER, n, n if grad else 0, in_bytes + out_bytes, in_bytes + out_bytes,
                     saved, 1.0, bl)
    if name in ("gather", "index", "index_select", "nll_loss_forward", "nll_loss",
                "take_along_dim"):
        idx = float(sum(b for _, b, f in ins if not f))
        return _Cost(_OTHER, out_numel, out_numel if grad else 0, 2 * out_bytes + idx,
                     in_bytes + out_bytes, idx, 1.0, 2 * bl)
    if name in ("max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d", "max_pool2d",
                "_adaptive_avg_pool2d"):
        n = float(_prod(shapes[0])) if shapes else out_numel
        return _Cost(_OTHER, n, n if grad else 0, in_bytes + out_bytes, 2 * in_bytes,
                     out_bytes if "max" in name else 0.0, 1.0, bl)
    if name in ("add", "sub", "mul", "div", "neg", "gelu", "relu", "silu", "tanh", "sigmoid",
                "exp", "log", "sqrt", "rsqrt", "pow", "where", "clone", "_to_copy", "copy",
                "hardtanh", "leaky_relu", "elu", "erf", "threshold", "clamp", "abs", "maximum",
                "minimum", "native_dropout", "dropout", "ne", "eq", "lt", "le", "gt", "ge",
                "scalar_tensor", "full", "zeros", "ones", "arange", "fill", "masked_fill",
                "logical_not", "cat", "stack", "contiguous", "sin", "cos", "rsub", "zeros_like",
                "ones_like", "full_like", "empty", "new_zeros", "new_ones", "new_empty",
                "bitwise_not", "triu", "tril"):
        per, per_b = elementwise_flops_per_element(name)
        saved = act_in if name in _SAVES_INPUTS else 0.0
        return _Cost(_OTHER, per * out_numel, per_b * out_numel if grad else 0,
                     in_bytes + out_bytes, 2 * in_bytes + out_bytes if grad else 0, saved,
                     1.0, bl)
    # conservative fallback: unknown op reads everything, writes everything, saves its inputs
    return _Cost(_OTHER, 2 * out_numel, 4 * out_numel if grad else 0, in_bytes + out_bytes,
                 2 * (in_bytes + out_bytes) if grad else 0, act_in, 1.0, 2 * bl)


def batch_symbol(graph: ir.Graph) -> str | None:
    """The symbol of the batch dimension: axis 0 of the first input when that is a name."""
    if graph.inputs:
        shape = graph.inputs[0].meta.shape
        if shape and isinstance(shape[0], str) and shape[0].isidentifier():
            return shape[0]
    return None


def cost_graph_from_ir(
    graph: ir.Graph,
    symbols: Mapping[str, int] | None = None,
    *,
    exact_edges: Iterable[str] = (),
    optimizer_state_factor: float = 2.0,
    name: str = "",
) -> CostGraph:
    """Estimate every node of `graph` at `symbols` (default: the graph's example values).

    `symbols` must give the batch symbol (see `batch_symbol`) the micro-batch size the costs are
    evaluated at; per-sample fields are totals / batch. `exact_edges`: value keys
    (`Ref.key`, e.g. `"linear_3:0"`) never to compress. `optimizer_state_factor`: optimizer
    state per trainable parameter byte (Adam in fp32: 2).
    """
    env = dict(graph.symbols)
    env.update(symbols or {})
    bsym = batch_symbol(graph)
    batch = float(env[bsym]) if bsym and bsym in env else 1.0
    if batch <= 0:
        raise PlanError(f"batch symbol {bsym!r} must be > 0")
    exact = set(exact_edges)
    index = {n.id: i for i, n in enumerate(graph.nodes)}
    pmap = graph.param_map

    def meta_shape(m: ir.TensorMeta) -> tuple[int, ...]:
        try:
            return ir.eval_shape(m.shape, env)
        except Exception as e:  # a symbol without a value: name it
            raise PlanError(f"cannot evaluate shape {m.shape} with symbols {env}: {e}") from e

    # requires-grad propagation, so the estimator knows where backward runs
    needs_grad: dict[str, bool] = {}
    ops: list[OpCost] = []
    consumers: dict[tuple[int, int], list[int]] = {}
    for i, node in enumerate(graph.nodes):
        ins: list[tuple[tuple[int, ...], int, bool]] = []
        g = False
        for r in node.refs():
            if r.kind is ir.RefKind.NODE:
                g = g or needs_grad.get(r.key, False)
                consumers.setdefault((index[r.name], r.index), [])
                lst = consumers[(index[r.name], r.index)]
                if not lst or lst[-1] != i:
                    lst.append(i)
            elif r.kind is ir.RefKind.PARAM:
                spec = pmap.get(r.name)
                g = g or bool(spec and spec.kind is ir.ParamKind.PARAMETER and spec.requires_grad)
            m = graph.meta_of(r)
            if m.is_tensor:
                shp = meta_shape(m)
                is_act = r.kind in (ir.RefKind.NODE, ir.RefKind.INPUT) and m.is_float
                ins.append((shp, _prod(shp) * ir.DTYPE_BYTES[m.dtype], is_act))
        short = _short(node.op)
        if short in _NO_GRAD or node.op.startswith("sym."):
            g = False
        outs = [(meta_shape(m), _prod(meta_shape(m)) * ir.DTYPE_BYTES[m.dtype])
                for m in node.outputs if m.is_tensor]
        for j, m in enumerate(node.outputs):
            needs_grad[f"{node.id}:{j}"] = g and m.is_float
        c = _node_cost(node, ins, outs, g)
        pbytes = 0.0
        trainable: list[str] = []
        for p in node.params:
            spec = pmap.get(p)
            if spec and spec.kind is ir.ParamKind.PARAMETER and spec.requires_grad:
                pbytes += float(_prod(meta_shape(spec.meta)) * ir.DTYPE_BYTES[spec.meta.dtype])
                trainable.append(p)
        ops.append(OpCost(
            name=node.id,
            op=node.op,
            op_class=c.cls,
            fwd_flops=c.ff / batch,
            bwd_flops=c.bf / batch,
            fwd_bytes=c.fb / batch,
            bwd_bytes=c.bb / batch,
            param_bytes=pbytes,
            opt_state_bytes=pbytes * optimizer_state_factor,
            saved_bytes=c.saved / batch if g else 0.0,
            out_bytes=float(sum(b for _, b in outs)) / batch,
            fwd_launches=c.fl,
            # and backward accumulates each trainable parameter's gradient (AccumulateGrad)
            bwd_launches=c.bl + len(trainable) if g else 0.0,
            params=tuple(trainable),
        ))
    sizes: dict[str, float] = {}
    for spec in graph.params:
        if spec.kind is ir.ParamKind.PARAMETER and spec.requires_grad:
            sizes[spec.name] = float(_prod(meta_shape(spec.meta)) * ir.DTYPE_BYTES[spec.meta.dtype])
    tensors: list[TensorEdge] = []
    for (src, j), dsts in sorted(consumers.items()):
        m = graph.nodes[src].outputs[j]
        key = f"{graph.nodes[src].id}:{j}"
        shape = meta_shape(m) if m.is_tensor else ()
        numel = float(_prod(shape)) if m.is_tensor else 1.0
        nb = numel * ir.DTYPE_BYTES[m.dtype]
        tensors.append(TensorEdge(
            name=key,
            src=src,
            dsts=tuple(dsts),
            nbytes=nb / batch,
            numel=numel / batch,
            grad=needs_grad.get(key, False),
            compressible=m.is_float and m.is_tensor and key not in exact,
            last_dim=float(shape[-1]) if len(shape) >= 2 else 0.0,
        ))
    return CostGraph(tuple(ops), tuple(tensors), name=name or graph.meta.get("model", "graph"),
                     param_sizes=sizes, block_starts=tuple(ir.block_starts(graph)))
