"""The OP-DAG intermediate representation: a model as a graph of ATen operators, as a wire format.

Pure data and (de)serialisation: no torch here (protocol/ stays sans-IO and torch-free). The
capture side (`fusiond.graph.capture`) builds a `Graph` from `torch.export`; the run side
(`fusiond.graph.partition`) builds runnable modules from it. See docs/ir.md.

Contracts:
- `Graph.nodes` is in topological order; every `Ref` of kind `node` points to an earlier node.
- An op is named `aten.<name>.<overload>` (or `sym.<name>` for Python arithmetic on symbolic
  sizes); whether a daemon can run it is decided by its op registry, not here.
- Shapes hold ints or symbolic-expression strings over `Graph.symbols` (e.g. `"s0*s1"`);
  `eval_shape(shape, symbols)` evaluates them.
- `loads(dumps(g)) == g` for every valid graph; `loads` rejects a wrong format or version,
  corruption (xxh64 checksum), bad types and dangling references with `RemoteProtocolError`
  naming what was wrong, and sizes over `Limits` with `LimitExceeded`.
"""

from __future__ import annotations

import ast
import enum
import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import xxhash

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

IR_VERSION = 1
"""Version of the IR schema written by `dumps`; `loads` accepts exactly this version."""
META_TORCH = "torch"
"""`Graph.meta` key: the torch version that captured the graph (`torch.__version__`)."""
META_PYTHON = "python"
"""`Graph.meta` key: the Python version that captured the graph."""
IR_FORMAT = "fusion-ir"
"""Format tag in the envelope, so a random msgpack blob is not mistaken for a graph."""

TENSOR_DTYPES: frozenset[str] = frozenset(
    {
        "float64", "float32", "float16", "bfloat16",
        "int64", "int32", "int16", "int8", "uint8", "bool",
        "complex64", "complex128",
        "float8_e4m3fn", "float8_e5m2",
    }
)  # fmt: skip
"""dtype names of tensors (torch's names without the `torch.` prefix)."""
SYM_DTYPES: frozenset[str] = frozenset({"symint", "symfloat", "symbool"})
"""dtype names of scalar (possibly symbolic) Python values an op may produce, e.g. a size."""
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "symint": 8, "symfloat": 8, "symbool": 1,
}  # fmt: skip
"""Bytes per element; a symbolic scalar crosses a cut as one 8-byte (or 1-byte) value."""

LAYOUTS: frozenset[str] = frozenset({"strided", "sparse_coo", "sparse_csr", "_mkldnn"})
MEMORY_FORMATS: frozenset[str] = frozenset(
    {"contiguous_format", "channels_last", "channels_last_3d", "preserve_format"}
)

Dim: TypeAlias = int | str
"""One entry of a shape: a concrete size or a symbolic expression over `Graph.symbols`."""


# --------------------------------------------------------------------------------------------
# Symbolic expressions


_SYM_FUNCS: dict[str, Callable[..., int]] = {
    "Max": max,
    "Min": min,
    "max": max,
    "min": min,
    "FloorDiv": lambda a, b: a // b,
    "CeilDiv": lambda a, b: -(-a // b),
    "Mod": lambda a, b: a % b,
    "PythonMod": lambda a, b: a % b,
    "floor": math.floor,
    "ceiling": math.ceil,
    "ceil": math.ceil,
    "Abs": abs,
}


MAX_SYM_EXPR_CHARS = 512
"""Longest symbolic expression accepted (bounds parse and evaluation depth)."""


def _pow(base: int, exp: int, expr: str) -> int:
    # A size is never astronomically large: refuse what would be a denial of service.
    if not 0 <= exp <= 64 or abs(base) > 1 << 32:
        raise LocalProtocolError(f"symbolic expression {expr!r}: power {base}**{exp} refused")
    return int(base**exp)


def _compile_node(node: ast.AST, expr: str) -> Callable[[Mapping[str, int]], int]:
    """Compile one node of a symbolic expression to a closure; reject anything not arithmetic."""
    if isinstance(node, ast.Expression):
        return _compile_node(node.body, expr)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
        return lambda env: value
    if isinstance(node, ast.Name):
        name = node.id

        def lookup(env: Mapping[str, int]) -> int:
            try:
                return env[name]
            except KeyError:
                raise LocalProtocolError(
                    f"symbolic expression {expr!r} uses {name!r}, which has no value"
                ) from None

        return lookup
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _compile_node(node.operand, expr)
        if isinstance(node.op, ast.USub):
            return lambda env: -inner(env)
        return inner
    if isinstance(node, ast.BinOp):
        lhs = _compile_node(node.left, expr)
        rhs = _compile_node(node.right, expr)
        op = node.op
        if isinstance(op, ast.Add):
            return lambda env: lhs(env) + rhs(env)
        if isinstance(op, ast.Sub):
            return lambda env: lhs(env) - rhs(env)
        if isinstance(op, ast.Mult):
            return lambda env: lhs(env) * rhs(env)
        if isinstance(op, ast.FloorDiv):
            return lambda env: lhs(env) // rhs(env)
        if isinstance(op, ast.Mod):
            return lambda env: lhs(env) % rhs(env)
        if isinstance(op, ast.Pow):
            return lambda env: _pow(lhs(env), rhs(env), expr)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in _SYM_FUNCS
        and not node.keywords
    ):
        fn = _SYM_FUNCS[node.func.id]
        parts = [_compile_node(a, expr) for a in node.args]
        return lambda env: int(fn(*(p(env) for p in parts)))
    raise LocalProtocolError(f"symbolic expression {expr!r}: unsupported syntax {ast.dump(node)}")


@functools.lru_cache(maxsize=4096)
def compile_sym(expr: str) -> Callable[[Mapping[str, int]], int]:
    """Compile a symbolic size expression (`"2*s0"`, `"((s1 - 1)//2) + 1"`, `"Max(1, s0)"`).

    Only integer arithmetic (+ - * // % **), names and Max/Min/FloorDiv/CeilDiv/Mod are allowed:
    the expression comes from the wire and is never passed to `eval`.
    """
    if len(expr) > MAX_SYM_EXPR_CHARS:
        raise LocalProtocolError(f"symbolic expression of {len(expr)} characters is too long")
    try:
        tree = ast.parse(expr, mode="eval")
        return _compile_node(tree, expr)
    except SyntaxError as e:
        raise LocalProtocolError(f"symbolic expression {expr!r} does not parse: {e.msg}") from e
    except (RecursionError, MemoryError):
        raise LocalProtocolError(f"symbolic expression {expr[:40]!r}... nests too deeply") from None


def sym_names(expr: str) -> set[str]:
    """The symbol names an expression uses (function names excluded)."""
    tree = ast.parse(expr, mode="eval")
    funcs = {
        n.func.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - funcs


def eval_dim(dim: Dim, symbols: Mapping[str, int]) -> int:
    """The concrete value of one shape entry for the given symbol values."""
    if isinstance(dim, int):
        return dim
    try:
        return compile_sym(dim)(symbols)
    except RecursionError:
        raise LocalProtocolError(f"symbolic expression {dim[:40]!r}... nests too deeply") from None
    except ZeroDivisionError:
        raise LocalProtocolError(f"symbolic expression {dim!r} divides by zero") from None


def eval_shape(shape: Iterable[Dim], symbols: Mapping[str, int]) -> tuple[int, ...]:
    """The concrete shape for the given symbol values (e.g. `Graph.symbols`, or a real batch)."""
    return tuple(eval_dim(d, symbols) for d in shape)


# --------------------------------------------------------------------------------------------
# Schema


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """The shape and dtype of one value: a tensor, or a scalar (dtype `symint` etc., shape ())."""

    shape: tuple[Dim, ...]
    dtype: str

    @property
    def is_tensor(self) -> bool:
        """False for symbolic scalars (sizes computed from other tensors' shapes)."""
        return self.dtype in TENSOR_DTYPES

    @property
    def is_float(self) -> bool:
        """True when a gradient can flow through this value."""
        return self.dtype in (
            "float64",
            "float32",
            "float16",
            "bfloat16",
            "complex64",
            "complex128",
        )

    def numel(self, symbols: Mapping[str, int]) -> int:
        """Element count for the given symbol values."""
        return math.prod(eval_shape(self.shape, symbols))

    def nbytes(self, symbols: Mapping[str, int]) -> int:
        """Dense size in bytes for the given symbol values."""
        return self.numel(symbols) * DTYPE_BYTES[self.dtype]


class RefKind(enum.StrEnum):
    """What a `Ref` points to."""

    NODE = "node"
    INPUT = "input"
    PARAM = "param"
    BUFFER = "buffer"
    CONSTANT = "constant"


@dataclass(frozen=True, slots=True)
class Ref:
    """A value: output `index` of node `name`, or the graph input / parameter / buffer / constant
    `name` (index 0)."""

    kind: RefKind
    name: str
    index: int = 0

    @property
    def key(self) -> str:
        """A stable string name of the value, unique in the graph (edge names use it)."""
        if self.kind is RefKind.NODE:
            return f"{self.name}:{self.index}"
        return f"{self.kind.value}:{self.name}"


@dataclass(frozen=True, slots=True)
class DType:
    """A `torch.dtype` literal argument (e.g. the `dtype=` of `aten.full`)."""

    name: str


@dataclass(frozen=True, slots=True)
class Device:
    """A `torch.device` literal argument, e.g. `"cpu"`; runners may remap it to their device."""

    name: str


@dataclass(frozen=True, slots=True)
class Layout:
    """A `torch.layout` literal argument, e.g. `"strided"`."""

    name: str


@dataclass(frozen=True, slots=True)
class MemoryFormat:
    """A `torch.memory_format` literal argument, e.g. `"contiguous_format"`."""

    name: str


Arg: TypeAlias = (
    bool
    | int
    | float
    | str
    | Ref
    | DType
    | Device
    | Layout
    | MemoryFormat
    | tuple["Arg", ...]
    | None
)
"""An op argument: a literal, a reference to a value, or a tuple of those (ATen lists)."""


@dataclass(frozen=True, slots=True)
class Node:
    """One operator application.

    `params` names the parameters, buffers and constants the node reads (they belong to it).
    `module_path` is where in the user's model the op came from (e.g. `transformer.h.0.attn`),
    for error messages and for planners that want to cut at module boundaries.
    """

    id: str
    op: str
    args: tuple[Arg, ...]
    kwargs: Mapping[str, Arg]
    outputs: tuple[TensorMeta, ...]
    params: tuple[str, ...] = ()
    module_path: str = ""

    def refs(self) -> list[Ref]:
        """Every value this node reads, in argument order (with repeats)."""
        out: list[Ref] = []
        for a in (*self.args, *self.kwargs.values()):
            _collect_refs(a, out)
        return out


def _collect_refs(a: Arg, out: list[Ref]) -> None:
    if isinstance(a, Ref):
        out.append(a)
    elif isinstance(a, tuple):
        for x in a:
            _collect_refs(x, out)


class ParamKind(enum.StrEnum):
    """How a named tensor of the model's state is held."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A parameter, buffer or lifted constant of the model, by its original state-dict name."""

    name: str
    kind: ParamKind
    meta: TensorMeta
    requires_grad: bool = True
    persistent: bool = True


@dataclass(frozen=True, slots=True)
class InputSpec:
    """A graph input (data or targets), in call order."""

    name: str
    meta: TensorMeta


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """A graph output (the loss first), by the value it returns."""

    name: str
    ref: Ref


@dataclass(frozen=True)
class Graph:
    """A captured model: inputs, state, nodes in topological order, outputs.

    `aliases` maps a tied parameter's other names to the name the graph uses (GPT-2's
    `transformer.wte.weight` -> `lm_head.weight`). `buffer_updates` maps a buffer to the value
    that replaces it after each forward (BatchNorm running statistics). `symbols` holds example
    values of the dynamic dims; `symbol_ranges` their [min, max] (max None = unbounded).
    `meta` is free-form text; capture writes `model` (the class), `META_TORCH` and
    `META_PYTHON` (what captured it), partition adds `partition`.
    """

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    params: tuple[ParamSpec, ...]
    nodes: tuple[Node, ...]
    symbols: Mapping[str, int] = field(default_factory=dict)
    symbol_ranges: Mapping[str, tuple[int, int | None]] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    buffer_updates: Mapping[str, Ref] = field(default_factory=dict)
    meta: Mapping[str, str] = field(default_factory=dict)
    version: int = IR_VERSION

    @property
    def captured_with(self) -> tuple[str | None, str | None]:
        """(torch version, Python version) that captured the graph; None where not recorded
        (a graph from a build before the Python version was recorded)."""
        return self.meta.get(META_TORCH), self.meta.get(META_PYTHON)

    @functools.cached_property
    def node_map(self) -> dict[str, Node]:
        """Nodes by id."""
        return {n.id: n for n in self.nodes}

    @functools.cached_property
    def param_map(self) -> dict[str, ParamSpec]:
        """Parameters, buffers and constants by name."""
        return {p.name: p for p in self.params}

    @functools.cached_property
    def consumers(self) -> dict[str, list[str]]:
        """For each node id, the ids of the nodes that read any of its outputs (in order)."""
        out: dict[str, list[str]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            seen: set[str] = set()
            for r in n.refs():
                if r.kind is RefKind.NODE and r.name not in seen:
                    seen.add(r.name)
                    out[r.name].append(n.id)
        return out

    def meta_of(self, ref: Ref) -> TensorMeta:
        """The shape and dtype of the value `ref` points to."""
        if ref.kind is RefKind.NODE:
            return self.node_map[ref.name].outputs[ref.index]
        if ref.kind is RefKind.INPUT:
            for i in self.inputs:
                if i.name == ref.name:
                    return i.meta
            raise KeyError(ref.name)
        return self.param_map[ref.name].meta

    def shape_of(self, ref: Ref, symbols: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """Concrete shape of a value for `symbols` (default: the example values)."""
        return eval_shape(self.meta_of(ref).shape, self.symbols if symbols is None else symbols)


# --------------------------------------------------------------------------------------------
# Encoding


def _enc_meta(m: TensorMeta) -> list[Any]:
    return [list(m.shape), m.dtype]


def _enc_arg(a: Arg) -> Any:
    if a is None or isinstance(a, bool | int | float | str):
        return a
    if isinstance(a, Ref):
        return {"ref": [a.kind.value, a.name, a.index]}
    if isinstance(a, DType):
        return {"dtype": a.name}
    if isinstance(a, Device):
        return {"device": a.name}
    if isinstance(a, Layout):
        return {"layout": a.name}
    if isinstance(a, MemoryFormat):
        return {"memory_format": a.name}
    if isinstance(a, tuple):
        return [_enc_arg(x) for x in a]
    raise LocalProtocolError(f"cannot encode IR argument of type {type(a).__name__}: {a!r}")


def _enc_graph(g: Graph) -> dict[str, Any]:
    return {
        "inputs": [[i.name, _enc_meta(i.meta)] for i in g.inputs],
        "outputs": [[o.name, _enc_arg(o.ref)] for o in g.outputs],
        "params": [
            [p.name, p.kind.value, _enc_meta(p.meta), p.requires_grad, p.persistent]
            for p in g.params
        ],
        "nodes": [
            [
                n.id,
                n.op,
                [_enc_arg(a) for a in n.args],
                {k: _enc_arg(v) for k, v in n.kwargs.items()},
                [_enc_meta(m) for m in n.outputs],
                list(n.params),
                n.module_path,
            ]
            for n in g.nodes
        ],
        "symbols": dict(g.symbols),
        "symbol_ranges": {k: list(v) for k, v in g.symbol_ranges.items()},
        "aliases": dict(g.aliases),
        "buffer_updates": {k: _enc_arg(v) for k, v in g.buffer_updates.items()},
        "meta": dict(g.meta),
    }


def dumps(graph: Graph) -> bytes:
    """Serialise a graph: a msgpack envelope `[format, version, body, xxh64(body)]`.

    Deterministic for a given graph. Raises `LocalProtocolError` for a graph with values the
    schema cannot hold (it does not re-validate references: `validate` does).
    """
    if graph.version != IR_VERSION:
        raise LocalProtocolError(f"cannot write IR version {graph.version}; this is {IR_VERSION}")
    try:
        body = msgpack.packb(_enc_graph(graph), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise LocalProtocolError(f"IR graph cannot be encoded: {e}") from e
    digest = xxhash.xxh64_digest(body)
    out: bytes = msgpack.packb([IR_FORMAT, IR_VERSION, body, digest], use_bin_type=True)
    return out


class _Reader:
    """Typed access to decoded msgpack with errors that name the field path."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    def fail(self, path: str, what: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"IR field {path}: {what}")

    def as_list(self, v: Any, path: str) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(path, f"expected a list, got {type(v).__name__}")
        self.limits.check(f"IR field {path} item count", len(v), self.limits.max_list_items)
        return v

    def as_dict(self, v: Any, path: str) -> dict[Any, Any]:
        if not isinstance(v, dict):
            raise self.fail(path, f"expected a map, got {type(v).__name__}")
        self.limits.check(f"IR field {path} item count", len(v), self.limits.max_list_items)
        return v

    def as_str(self, v: Any, path: str) -> str:
        if not isinstance(v, str):
            raise self.fail(path, f"expected a string, got {type(v).__name__}")
        self.limits.check(f"IR field {path} length", len(v.encode()), self.limits.max_string_bytes)
        return v

    def as_int(self, v: Any, path: str) -> int:
        if type(v) is not int:
            raise self.fail(path, f"expected an integer, got {type(v).__name__}")
        return v

    def as_bool(self, v: Any, path: str) -> bool:
        if type(v) is not bool:
            raise self.fail(path, f"expected a boolean, got {type(v).__name__}")
        return v

    def as_tuple(self, v: Any, n: int, path: str) -> list[Any]:
        lst = self.as_list(v, path)
        if len(lst) != n:
            raise self.fail(path, f"expected {n} entries, got {len(lst)}")
        return lst

    def dim(self, v: Any, path: str) -> Dim:
        if type(v) is int:
            if v < 0:
                raise self.fail(path, f"negative size {v}")
            return v
        s = self.as_str(v, path)
        try:
            compile_sym(s)
        except LocalProtocolError as e:
            raise self.fail(path, str(e)) from None
        return s

    def meta(self, v: Any, path: str) -> TensorMeta:
        shape, dtype = self.as_tuple(v, 2, path)
        dims = self.as_list(shape, path + ".shape")
        self.limits.check(f"IR field {path} rank", len(dims), self.limits.max_tensor_rank)
        dt = self.as_str(dtype, path + ".dtype")
        if dt not in TENSOR_DTYPES and dt not in SYM_DTYPES:
            raise self.fail(path + ".dtype", f"unknown dtype {dt!r}")
        if dt in SYM_DTYPES and dims:
            raise self.fail(path + ".shape", f"a {dt} value has no shape, got {dims}")
        return TensorMeta(tuple(self.dim(d, f"{path}.shape[{i}]") for i, d in enumerate(dims)), dt)

    def ref(self, v: Any, path: str) -> Ref:
        kind, name, index = self.as_tuple(v, 3, path)
        k = self.as_str(kind, path + ".kind")
        try:
            rk = RefKind(k)
        except ValueError:
            raise self.fail(path + ".kind", f"unknown reference kind {k!r}") from None
        idx = self.as_int(index, path + ".index")
        if idx < 0:
            raise self.fail(path + ".index", f"negative output index {idx}")
        return Ref(rk, self.as_str(name, path + ".name"), idx)

    def arg(self, v: Any, path: str, depth: int = 0) -> Arg:
        if depth > 8:
            raise self.fail(path, "arguments nested too deeply")
        if v is None or isinstance(v, bool | int | float):
            return v
        if isinstance(v, str):
            return self.as_str(v, path)
        if isinstance(v, list):
            return tuple(
                self.arg(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(self.as_list(v, path))
            )
        if isinstance(v, dict) and len(v) == 1:
            ((tag, val),) = v.items()
            if tag == "ref":
                return self.ref(val, path)
            if tag == "dtype":
                s = self.as_str(val, path)
                if s not in TENSOR_DTYPES:
                    raise self.fail(path, f"unknown dtype {s!r}")
                return DType(s)
            if tag == "device":
                return Device(self.as_str(val, path))
            if tag == "layout":
                s = self.as_str(val, path)
                if s not in LAYOUTS:
                    raise self.fail(path, f"unknown layout {s!r}")
                return Layout(s)
            if tag == "memory_format":
                s = self.as_str(val, path)
                if s not in MEMORY_FORMATS:
                    raise self.fail(path, f"unknown memory format {s!r}")
                return MemoryFormat(s)
        raise self.fail(path, f"not a valid argument: {v!r:.80}")


def _dec_graph(body: Any, limits: Limits) -> Graph:
    r = _Reader(limits)
    top = r.as_dict(body, "graph")
    need = (
        "inputs",
        "outputs",
        "params",
        "nodes",
        "symbols",
        "symbol_ranges",
        "aliases",
        "buffer_updates",
        "meta",
    )
    for k in need:
        if k not in top:
            raise r.fail(k, "missing")
    inputs = tuple(
        InputSpec(r.as_str(name, f"inputs[{i}].name"), r.meta(m, f"inputs[{i}].meta"))
        for i, (name, m) in enumerate(
            r.as_tuple(x, 2, f"inputs[{i}]")
            for i, x in enumerate(r.as_list(top["inputs"], "inputs"))
        )
    )
    outputs = []
    for i, x in enumerate(r.as_list(top["outputs"], "outputs")):
        name, ref = r.as_tuple(x, 2, f"outputs[{i}]")
        a = r.arg(ref, f"outputs[{i}].ref")
        if not isinstance(a, Ref):
            raise r.fail(f"outputs[{i}].ref", "expected a reference")
        outputs.append(OutputSpec(r.as_str(name, f"outputs[{i}].name"), a))
    params = []
    for i, x in enumerate(r.as_list(top["params"], "params")):
        name, kind, meta, rg, pers = r.as_tuple(x, 5, f"params[{i}]")
        ks = r.as_str(kind, f"params[{i}].kind")
        try:
            pk = ParamKind(ks)
        except ValueError:
            raise r.fail(f"params[{i}].kind", f"unknown kind {ks!r}") from None
        params.append(
            ParamSpec(
                r.as_str(name, f"params[{i}].name"),
                pk,
                r.meta(meta, f"params[{i}].meta"),
                r.as_bool(rg, f"params[{i}].requires_grad"),
                r.as_bool(pers, f"params[{i}].persistent"),
            )
        )
    nodes = []
    for i, x in enumerate(r.as_list(top["nodes"], "nodes")):
        nid, op, args, kwargs, outs, ps, mp = r.as_tuple(x, 7, f"nodes[{i}]")
        p = f"nodes[{i}]"
        nodes.append(
            Node(
                id=r.as_str(nid, p + ".id"),
                op=r.as_str(op, p + ".op"),
                args=tuple(r.arg(a, f"{p}.args[{j}]") for j, a in enumerate(r.as_list(args, p))),
                kwargs={
                    r.as_str(k, f"{p}.kwargs"): r.arg(v, f"{p}.kwargs.{k}")
                    for k, v in r.as_dict(kwargs, p + ".kwargs").items()
                },
                outputs=tuple(
                    r.meta(m, f"{p}.outputs[{j}]") for j, m in enumerate(r.as_list(outs, p))
                ),
                params=tuple(r.as_str(s, f"{p}.params") for s in r.as_list(ps, p + ".params")),
                module_path=r.as_str(mp, p + ".module_path"),
            )
        )
    symbols = {
        r.as_str(k, "symbols"): r.as_int(v, f"symbols.{k}")
        for k, v in r.as_dict(top["symbols"], "symbols").items()
    }
    ranges: dict[str, tuple[int, int | None]] = {}
    for k, v in r.as_dict(top["symbol_ranges"], "symbol_ranges").items():
        lo, hi = r.as_tuple(v, 2, f"symbol_ranges.{k}")
        ranges[r.as_str(k, "symbol_ranges")] = (
            r.as_int(lo, f"symbol_ranges.{k}[0]"),
            None if hi is None else r.as_int(hi, f"symbol_ranges.{k}[1]"),
        )
    aliases = {
        r.as_str(k, "aliases"): r.as_str(v, f"aliases.{k}")
        for k, v in r.as_dict(top["aliases"], "aliases").items()
    }
    updates = {}
    for k, v in r.as_dict(top["buffer_updates"], "buffer_updates").items():
        a = r.arg(v, f"buffer_updates.{k}")
        if not isinstance(a, Ref):
            raise r.fail(f"buffer_updates.{k}", "expected a reference")
        updates[r.as_str(k, "buffer_updates")] = a
    meta = {
        r.as_str(k, "meta"): r.as_str(v, f"meta.{k}")
        for k, v in r.as_dict(top["meta"], "meta").items()
    }
    return Graph(
        inputs=inputs,
        outputs=tuple(outputs),
        params=tuple(params),
        nodes=tuple(nodes),
        symbols=symbols,
        symbol_ranges=ranges,
        aliases=aliases,
        buffer_updates=updates,
        meta=meta,
    )


def block_key(module_path: str) -> str:
    """The block a node of `module_path` belongs to: the path up to its first numbered
    component (``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``), else its first two
    components (``transformer.wte``): a model's repeated blocks are blocks, the rest grouped
    by top-level module. The unit of the memory planner's per-block decisions."""
    parts = [p for p in module_path.split(".") if p]
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:2])


def block_starts(graph: Graph) -> list[int]:
    """Positions in `graph.nodes` where a block begins (0 first): where the `block_key` of a
    tensor-producing node differs from the previous such node's. Size arithmetic and nodes of
    no module (an add of two embeddings) never start a block; they stay with the one before."""
    starts: list[int] = [0] if graph.nodes else []
    prev: str | None = None
    for i, n in enumerate(graph.nodes):
        if not n.module_path or not any(m.is_tensor for m in n.outputs):
            continue
        key = block_key(n.module_path)
        if prev is not None and key != prev:
            starts.append(i)
        prev = key
    return starts


def validate(graph: Graph) -> None:
    """Check the graph's internal consistency; raise `RemoteProtocolError` naming the problem.

    Node ids unique; every reference resolves (node refs to an earlier node and an existing
    output index); `params` of a node are declared; aliases point to declared parameters;
    symbols used in shapes have example values.
    """

    def fail(msg: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"invalid IR graph: {msg}")

    input_names = {i.name for i in graph.inputs}
    if len(input_names) != len(graph.inputs):
        raise fail("duplicate input names")
    pmap: dict[str, ParamSpec] = {}
    for p in graph.params:
        if p.name in pmap:
            raise fail(f"duplicate parameter {p.name!r}")
        pmap[p.name] = p
    kind_of = {
        ParamKind.PARAMETER: RefKind.PARAM,
        ParamKind.BUFFER: RefKind.BUFFER,
        ParamKind.CONSTANT: RefKind.CONSTANT,
    }
    seen: dict[str, Node] = {}

    def check_ref(ref: Ref, where: str) -> None:
        if ref.kind is RefKind.NODE:
            src = seen.get(ref.name)
            if src is None:
                raise fail(f"{where} reads node {ref.name!r}, which is not an earlier node")
            if ref.index >= len(src.outputs):
                raise fail(
                    f"{where} reads output {ref.index} of {ref.name!r}, which has "
                    f"{len(src.outputs)}"
                )
        elif ref.kind is RefKind.INPUT:
            if ref.name not in input_names:
                raise fail(f"{where} reads unknown input {ref.name!r}")
        else:
            p = pmap.get(ref.name)
            if p is None or kind_of[p.kind] is not ref.kind:
                raise fail(f"{where} reads unknown {ref.kind.value} {ref.name!r}")

    names: set[str] = set(graph.symbols)
    for n in graph.nodes:
        if n.id in seen:
            raise fail(f"duplicate node id {n.id!r}")
        if not n.outputs:
            raise fail(f"node {n.id!r} ({n.op}) has no outputs")
        for r in n.refs():
            check_ref(r, f"node {n.id!r} ({n.op})")
        for pn in n.params:
            if pn not in pmap:
                raise fail(f"node {n.id!r} names unknown parameter {pn!r}")
        for m in n.outputs:
            for d in m.shape:
                if isinstance(d, str) and not sym_names(d) <= names:
                    raise fail(f"node {n.id!r}: shape entry {d!r} uses an unknown symbol")
        seen[n.id] = n
    for o in graph.outputs:
        check_ref(o.ref, f"output {o.name!r}")
    for a, c in graph.aliases.items():
        if c not in pmap:
            raise fail(f"alias {a!r} points to unknown parameter {c!r}")
    for b, ref in graph.buffer_updates.items():
        if b not in pmap or pmap[b].kind is not ParamKind.BUFFER:
            raise fail(f"buffer update for unknown buffer {b!r}")
        check_ref(ref, f"buffer update of {b!r}")


def loads(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Graph:
    """Parse and validate a graph written by `dumps`.

    Raises `RemoteProtocolError` for a foreign format, a different IR version (naming both),
    a checksum mismatch (corruption), bad field types or dangling references, and
    `LimitExceeded` when the encoding is larger than `limits.max_header_bytes`.
    """
    limits.check("IR size in bytes", len(data), limits.max_header_bytes)
    try:
        env = msgpack.unpackb(
            bytes(data),
            use_list=True,
            raw=False,
            strict_map_key=True,
            max_bin_len=limits.max_header_bytes,
            max_str_len=limits.max_string_bytes,
            max_array_len=limits.max_list_items,
            max_map_len=limits.max_list_items,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RemoteProtocolError(f"IR is not a valid msgpack envelope: {e}") from e
    if not isinstance(env, list) or len(env) != 4 or env[0] != IR_FORMAT:
        raise RemoteProtocolError(f"not a {IR_FORMAT} document (bad envelope)")
    _, version, body, digest = env
    if version != IR_VERSION:
        raise RemoteProtocolError(
            f"IR version {version!r} is not supported; this build reads version {IR_VERSION}"
        )
    if not isinstance(body, bytes) or not isinstance(digest, bytes):
        raise RemoteProtocolError("IR envelope: body and checksum must be bytes")
    if xxhash.xxh64_digest(body) != digest:
        raise RemoteProtocolError("IR checksum mismatch: the graph is corrupted")
    try:
        raw = msgpack.unpackb(
            body,
            use_list=True,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_string_bytes,
            max_array_len=limits.max_list_items,
            max_map_len=limits.max_list_items,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise RemoteProtocolError(f"IR body is not valid msgpack: {e}") from e
    graph = _dec_graph(raw, limits)
    validate(graph)
    return graph


__all__ = [
    "DTYPE_BYTES",
    "IR_FORMAT",
    "IR_VERSION",
    "META_PYTHON",
    "META_TORCH",
    "SYM_DTYPES",
    "TENSOR_DTYPES",
    "Arg",
    "DType",
    "Device",
    "Dim",
    "Graph",
    "InputSpec",
    "Layout",
    "MemoryFormat",
    "Node",
    "OutputSpec",
    "ParamKind",
    "ParamSpec",
    "Ref",
    "RefKind",
    "TensorMeta",
    "block_key",
    "block_starts",
    "compile_sym",
    "dumps",
    "eval_dim",
    "eval_shape",
    "loads",
    "sym_names",
    "validate",
]
