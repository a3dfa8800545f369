"""Build a runnable module from an IR graph (a whole model or one partition's sub-graph).

The IR is turned into a `torch.fx.Graph` node for node (no tracing of user code), so the
generated `forward` is straight-line Python calling ATen overloads: no per-call interpretation.
Parameters, buffers and constants become attributes of nested submodules under their original
names, so `module.state_dict()` keys are the model's own state-dict names.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn

from fusiond.graph.errors import ExecutionError, GraphError
from fusiond.graph.registry import resolve
from protocol import ir


def _as_int(t: torch.Tensor | int) -> int:
    """A symbolic size that crossed a cut as a 0-d tensor, back to a Python int."""
    return int(t)


def _as_tensor(v: int | float | bool) -> torch.Tensor:
    """A symbolic size leaving a partition travels as a 0-d int64 tensor (float64 for floats)."""
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    return torch.tensor(int(v), dtype=torch.int64)


def _update_buffer(buf: torch.Tensor, new: torch.Tensor) -> None:
    """Write a buffer's new value (BatchNorm running stats) in place, outside autograd.

    Through `.data`, as eager BatchNorm does: the forward may have saved the buffer for
    backward, and a version bump would make that backward fail; training-mode backward does
    not read running statistics."""
    buf.data.copy_(new.detach())


def _copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """`aten.copy` (the functional `copy_`: `src`'s values in `dst`'s shape, dtype and device)
    through differentiable ops. Eager autograd has no derivative for `aten.copy`, and the
    lowering emits it (circular padding: CircularPad1d/2d/3d, Conv with
    padding_mode="circular"), so training through it failed in backward. The gradient goes to
    `src` (summed over broadcast dims) and none to `dst`, whose values are overwritten."""
    del non_blocking  # a program runs its ops in stream order
    return src.to(dtype=dst.dtype, device=dst.device).expand_as(dst).clone()


RANDOM_OPS: frozenset[str] = frozenset({
    "aten.native_dropout.default",
    "aten.bernoulli.p",
    "aten.rand.default",
    "aten.randn.default",
    "aten.randperm.default",
    "aten.rrelu_with_noise_functional.default",
    "aten.scaled_dot_product_attention.default",
})
"""Registry ops that draw random numbers (dropout, stochastic depth, RReLU's slopes, SDPA's
attention dropout). A program runs each from a generator of its own, seeded per call by
`RandomState`: a run is reproducible from the job's seed, and the same however the graph is
cut (the key is the node's id, not the stage's)."""

_GLOBAL_RNG = threading.Lock()
"""Held while an op without a generator argument (SDPA's dropout) runs on the device's default
generator, seeded and restored around the call."""


class RandomState:
    """The key a program's random ops draw from: (seed, step, micro-batch), set before each
    forward (`set`). Each random op's generator is seeded by that key and the op's node id, so
    the masks of a micro-batch depend on nothing else: not on the partition, the machine, the
    thread, or what ran before."""

    def __init__(self) -> None:
        self.key = (0, 0, 0)

    def set(self, seed: int, step: int, micro: int) -> None:
        """Key the next forward's random ops to (`seed`, `step`, `micro`)."""
        self.key = (int(seed), int(step), int(micro))

    def seed_for(self, node: str) -> int:
        """The 63-bit seed of node `node` under the current key."""
        h = hashlib.blake2b(f"{self.key[0]}:{self.key[1]}:{self.key[2]}:{node}".encode(),
                            digest_size=8)
        return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

    def generator(self, node: str, device: torch.device) -> torch.Generator:
        """A generator on `device`, seeded for `node`."""
        g = torch.Generator(device=device)
        g.manual_seed(self.seed_for(node))
        return g


def _device_of(args: Any, kwargs: Mapping[str, Any]) -> torch.device:
    dev = kwargs.get("device")
    if isinstance(dev, torch.device):
        return dev
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _seeded(name: str, node: str, state: RandomState) -> Callable[..., Any]:
    """The callable a program runs for random op `name` at node `node`: the op on a generator
    seeded by `state` (ops without a generator argument through an overload that has one, or
    an equivalent)."""
    aten = torch.ops.aten

    def gen(args: Any, kwargs: Mapping[str, Any]) -> torch.Generator:
        return state.generator(node, _device_of(args, kwargs))

    fn: Callable[..., Any]
    if name == "aten.native_dropout.default":
        def fn(x: torch.Tensor, p: float, train: bool | None = True) -> Any:
            if train is False or p == 0.0:
                return x.clone(), torch.ones_like(x, dtype=torch.bool)
            if p >= 1.0:
                return x * 0.0, torch.zeros_like(x, dtype=torch.bool)
            keep = aten.bernoulli.p(torch.empty_like(x), 1.0 - p,
                                    generator=gen((x,), {})).to(torch.bool)
            return x * keep * (1.0 / (1.0 - p)), keep
    elif name in ("aten.rand.default", "aten.randn.default", "aten.randperm.default"):
        overload = getattr(aten, name.split(".")[1]).generator

        def fn(*args: Any, **kwargs: Any) -> Any:
            return overload(*args, generator=gen(args, kwargs), **kwargs)
    elif name == "aten.scaled_dot_product_attention.default":
        sdpa = aten.scaled_dot_product_attention.default

        def fn(*args: Any, **kwargs: Any) -> Any:
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if not p:
                return sdpa(*args, **kwargs)
            dev = _device_of(args, kwargs)
            with _GLOBAL_RNG:
                default = (torch.cuda.default_generators[dev.index or 0] if dev.type == "cuda"
                           else torch.default_generator)
                saved = default.get_state()
                default.manual_seed(state.seed_for(node))
                try:
                    return sdpa(*args, **kwargs)
                finally:
                    default.set_state(saved)
    elif name == "aten.rrelu_with_noise_functional.default":
        # RReLU from where/mul: torch 2.13's derivative of rrelu_with_noise_functional reads
        # its noise *input* (in a captured graph an uninitialised empty_like), not the slopes
        # it sampled, so autograd through the op itself gives garbage gradients
        def fn(x: torch.Tensor, noise: torch.Tensor, lower: float = 0.125,
               upper: float = 1.0 / 3.0, training: bool = False, generator: Any = None) -> Any:
            del generator  # ours
            if not training:
                return torch.where(x > 0, x, x * ((lower + upper) / 2.0)), noise.clone()
            slopes = torch.empty_like(x).uniform_(lower, upper, generator=gen((x,), {}))
            slopes = torch.where(x > 0, torch.ones_like(x), slopes)
            return x * slopes, slopes
    else:  # bernoulli.p: a generator keyword of its own
        op = resolve(name)

        def fn(*args: Any, **kwargs: Any) -> Any:
            return op(*args, **{**kwargs, "generator": gen(args, kwargs)})
    fn.__name__ = "seeded_" + name.split(".")[1]
    return fn


class GraphProgram(fx.GraphModule):
    """A partition (or whole graph) as an `nn.Module`.

    `forward(*values)` takes the graph's inputs in `input_names` order and returns a tuple in
    `output_names` order. Symbolic scalars enter and leave as 0-d tensors. `run(mapping)` is the
    same with names. Buffer updates (BatchNorm) are applied in place during forward.
    """

    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    random: RandomState | None
    """The key of the program's random ops (None: it has none)."""

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward by name; raises `ExecutionError` naming a missing input."""
        try:
            args = [inputs[n] for n in self.input_names]
        except KeyError as e:
            raise ExecutionError(
                f"partition input {e.args[0]!r} missing; expected {list(self.input_names)}"
            ) from None
        outs = self(*args)
        return dict(zip(self.output_names, outs, strict=True))


def _ensure_submodule(root: nn.Module, path: list[str]) -> nn.Module:
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ir.TENSOR_DTYPES if hasattr(torch, name)
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an IR dtype name."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise GraphError(f"IR dtype {name!r} has no torch dtype here") from None


def build_program(
    graph: ir.Graph,
    state: Mapping[str, torch.Tensor],
    *,
    device: torch.device | str | None = None,
    copy: bool = True,
) -> GraphProgram:
    """Build `graph` into a `GraphProgram` holding the graph's parameters from `state`.

    `state` must hold every name in `graph.params` (extra names are ignored). With `copy`
    (default) each tensor is cloned, so partitions never share storage. `device` moves state
    there and rewrites device literals in the IR (e.g. `arange(..., device="cpu")`).
    Raises `GraphError` for missing state or a shape/dtype mismatch, `UnsupportedOpError`
    for an op outside the registry.
    """
    dev = torch.device(device) if device is not None else None
    root = nn.Module()
    for spec in graph.params:
        if spec.name not in state:
            raise GraphError(f"state has no tensor for {spec.kind.value} {spec.name!r}")
        t = state[spec.name].detach()
        want = ir.eval_shape(spec.meta.shape, graph.symbols)
        if tuple(t.shape) != want or str(t.dtype).removeprefix("torch.") != spec.meta.dtype:
            raise GraphError(
                f"state tensor {spec.name!r} is {tuple(t.shape)} {t.dtype}, the graph wants "
                f"{want} {spec.meta.dtype}"
            )
        moved = t.to(dev) if dev is not None else t
        t = moved.clone() if copy and moved is t else moved  # `to` another device copies
        *path, leaf = spec.name.split(".")
        owner = _ensure_submodule(root, path)
        if spec.kind is ir.ParamKind.PARAMETER:
            owner.register_parameter(leaf, nn.Parameter(t, requires_grad=spec.requires_grad))
        else:
            owner.register_buffer(
                leaf, t, persistent=spec.kind is ir.ParamKind.BUFFER and spec.persistent
            )

    g = fx.Graph()
    values: dict[str, Any] = {}  # Ref.key -> fx node
    nodes_out: dict[str, int] = {}
    for inp in graph.inputs:
        ph = g.placeholder(_ident(inp.name))
        if not inp.meta.is_tensor:
            ph = g.call_function(_as_int, (ph,))
        values[ir.Ref(ir.RefKind.INPUT, inp.name).key] = ph

    def get(ref: ir.Ref) -> Any:
        key = ref.key
        v = values.get(key)
        if v is not None:
            return v
        if ref.kind in (ir.RefKind.PARAM, ir.RefKind.BUFFER, ir.RefKind.CONSTANT):
            v = g.get_attr(ref.name)
        elif ref.kind is ir.RefKind.NODE:
            base = values[ir.Ref(ir.RefKind.NODE, ref.name, -1).key]
            if nodes_out[ref.name] == 1:
                v = base
            else:
                v = g.call_function(operator.getitem, (base, ref.index))
        else:
            raise GraphError(f"graph reads unknown input {ref.name!r}")
        values[key] = v
        return v

    def conv(a: ir.Arg) -> Any:
        if isinstance(a, ir.Ref):
            return get(a)
        if isinstance(a, tuple):
            return [conv(x) for x in a]
        if isinstance(a, ir.DType):
            return torch_dtype(a.name)
        if isinstance(a, ir.Device):
            return dev if dev is not None else torch.device(a.name)
        if isinstance(a, ir.Layout):
            return getattr(torch, a.name)
        if isinstance(a, ir.MemoryFormat):
            return getattr(torch, a.name)
        return a

    random = RandomState() if any(n.op in RANDOM_OPS for n in graph.nodes) else None
    for node in graph.nodes:
        fn = resolve(node.op)
        if random is not None and node.op in RANDOM_OPS:
            fn = _seeded(node.op, node.id, random)
        elif fn is torch.ops.aten.view.default:
            # A received tensor is contiguous, but the graph was traced with the producer's
            # strides: a view that was valid there can be invalid here (x.T sent, then
            # x.T.T.view(-1)). reshape is view wherever view is valid and copies otherwise.
            fn = torch.ops.aten.reshape.default
        elif fn is torch.ops.aten.copy.default:
            fn = _copy
        args = tuple(conv(a) for a in node.args)
        kwargs = {k: conv(v) for k, v in node.kwargs.items()}
        # create_node dedups the name against fx's own (getitem_*, ...), keeping code readable.
        out = g.create_node("call_function", fn, args, kwargs, name=_ident(node.id))
        values[ir.Ref(ir.RefKind.NODE, node.id, -1).key] = out
        nodes_out[node.id] = len(node.outputs)

    for buf, ref in graph.buffer_updates.items():
        g.call_function(_update_buffer, (get(ir.Ref(ir.RefKind.BUFFER, buf)), get(ref)))

    results = []
    for o in graph.outputs:
        v = get(o.ref)
        if not graph.meta_of(o.ref).is_tensor:
            v = g.call_function(_as_tensor, (v,))
        results.append(v)
    g.output(tuple(results))
    g.lint()
    prog = GraphProgram(root, g, class_name="GraphProgram")
    prog.input_names = tuple(i.name for i in graph.inputs)
    prog.random = random
    prog.output_names = tuple(o.name for o in graph.outputs)
    return prog


def mutated_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers a forward of `module` updates in place (BatchNorm's running statistics):
    a `GraphProgram`'s, read from its graph; any other module's buffers, all of them (what a
    caller must save to run a forward twice with the effect of once)."""
    graph = getattr(module, "graph", None)
    if not isinstance(module, GraphProgram) or graph is None:
        return list(module.buffers())
    out: list[torch.Tensor] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _update_buffer:
            target = node.args[0]
            if isinstance(target, fx.Node) and target.op == "get_attr":
                buf = module.get_buffer(str(target.target))
                if all(buf is not b for b in out):
                    out.append(buf)
    return out


def _ident(name: str) -> str:
    out = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return out if out and not out[0].isdigit() else "v_" + out
