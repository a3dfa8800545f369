"""The op registry: IR op name -> torch callable, with an allowlist.

An IR names ops `aten.<name>.<overload>`; a daemon runs only ops in `supported_ops()`: the core
ATen opset (what `run_decompositions` lowers to), a few composite ops capture keeps whole
because they are faster than their decompositions (`KEPT_COMPOSITES`), the non-core ops common
modules still lower to (`EXTRA_OPS`), and Python arithmetic on symbolic sizes (`sym.*`).
Anything else is refused, so an IR cannot call arbitrary ATen ops
(file I/O, allocator control) on another machine.

What a node runs is its registry less the ops its operator disabled (`jobs.disabled_ops`):
`op_set(disabled)`, an `fusiond.opsets.OpSet` whose digest the node gossips. A stage checks its
partition against it when it is assigned (`check_ops`), naming the op it cannot run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fusiond.graph.errors import UnsupportedOpError
from fusiond.opsets import OpSet
from protocol import ir

KEPT_COMPOSITES: tuple[str, ...] = (
    "aten.linear.default",
    "aten.scaled_dot_product_attention.default",
)
"""Composite ops that capture does not decompose: their fused kernels (and fused backward)
are what eager PyTorch runs, so keeping them keeps the captured graph as fast as eager."""

EXTRA_OPS: tuple[str, ...] = (
    "aten._native_batch_norm_legit_functional.default",
    "aten._native_batch_norm_legit_no_training.default",
    "aten.alias.default",
    "aten.lift_fresh_copy.default",
    # What torch.nn modules lower to outside the core opset (tests/graph/test_nn_coverage.py
    # walks them): pure tensor math, no I/O, no allocator or RNG state.
    "aten._trilinear.default",  # nn.Bilinear
    "aten.adaptive_max_pool2d.default",  # nn.AdaptiveMaxPool1d/2d
    "aten.adaptive_max_pool3d.default",  # nn.AdaptiveMaxPool3d
    # Deterministic given their `random_samples` argument, which FractionalMaxPool2d/3d draw
    # with core aten.rand (seeded per micro-batch, program.RANDOM_OPS): the ops hold no RNG.
    "aten.fractional_max_pool2d.default",
    "aten.fractional_max_pool3d.default",  # its shape function fixes the batch: static only
    "aten.linalg_vector_norm.default",  # Tensor.norm, F.normalize, CosineSimilarity, ...
    "aten.var_mean.correction",  # torch.var_mean
    "aten.polar.default",  # torch.polar (complex)
    "aten.view_as_real.default",  # complex -> (..., 2) real view
    "aten.empty_permuted.default",  # allocation only, as core empty_strided (AlphaDropout,
    # CosineEmbeddingLoss, HingeEmbeddingLoss)
    "aten._embedding_bag_forward_only.default",  # a frozen EmbeddingBag (no weight gradient)
    # Random: a program runs them on generators seeded from the job (program.RANDOM_OPS)
    "aten.bernoulli.p",  # Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout, stochastic depth
    "aten.rrelu_with_noise_functional.default",  # RReLU (samples its slopes in training)
)
"""Non-core ATen ops that core decompositions still produce: BatchNorm in training mode, and
ops common torch.nn modules emit (each named after the module that needs it). The random ones
draw from generators a program seeds per micro-batch (`fusiond.graph.program.RANDOM_OPS`)."""

SYM_OPS: dict[str, Callable[..., Any]] = {
    "sym.add": operator.add,
    "sym.sub": operator.sub,
    "sym.mul": operator.mul,
    "sym.floordiv": operator.floordiv,
    "sym.truediv": operator.truediv,
    "sym.mod": operator.mod,
    "sym.neg": operator.neg,
    "sym.pow": operator.pow,
    "sym.eq": operator.eq,
    "sym.ne": operator.ne,
    "sym.lt": operator.lt,
    "sym.le": operator.le,
    "sym.gt": operator.gt,
    "sym.ge": operator.ge,
    "sym.max": torch.sym_max,
    "sym.min": torch.sym_min,
    "sym.float": torch.sym_float,
    "sym.int": torch.sym_int,
}
"""Python-level arithmetic on sizes (e.g. `batch * seq` for a view), by IR name."""

_PY_TO_SYM: dict[Any, str] = {fn: name for name, fn in SYM_OPS.items()}


def sym_op_name(fn: Any) -> str | None:
    """The IR name of a Python function used on symbolic sizes, or None if not supported."""
    try:
        return _PY_TO_SYM.get(fn)
    except TypeError:  # unhashable target
        return None


def op_name(op: torch._ops.OpOverload) -> str:
    """The IR name of an ATen overload: `aten.<name>.<overload>`."""
    return f"{op.namespace}.{op._opname}.{op._overloadname}"


@functools.cache
def supported_ops() -> frozenset[str]:
    """Every op name the registry can run."""
    names: set[str] = set(KEPT_COMPOSITES) | set(EXTRA_OPS) | set(SYM_OPS)
    for attr in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, attr, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():  # type: ignore[no-untyped-call]
            op = getattr(packet, ov)
            if torch.Tag.core in op.tags:
                names.add(op_name(op))
    # A few core-tagged ops mutate state or read files; an IR must be functional.
    return frozenset(n for n in names if not _is_mutating(n))


def _is_mutating(name: str) -> bool:
    parts = name.split(".")
    return (
        len(parts) == 3
        and parts[0] == "aten"
        and parts[1].endswith("_")
        and not parts[1].startswith("_")
    )


def is_supported(name: str) -> bool:
    """True if `name` is in the registry."""
    return name in supported_ops()


def op_set(disabled: Iterable[str] = ()) -> OpSet:
    """What this node runs: the registry less `disabled` (names the registry lacks are kept
    apart in `OpSet.unknown`: they disable nothing)."""
    return OpSet.build(supported_ops(), disabled)


def torch_version() -> str:
    """This process's torch version as pip installed it (e.g. `2.13.0`; what profiles gossip)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a torch not from pip
        return str(torch.__version__)


def check_ops(graph: ir.Graph, disabled: Iterable[str] = ()) -> None:
    """Refuse a graph (a stage's partition) with an op this node cannot run:
    `UnsupportedOpError` naming the first such op, its node and module, why (not in this
    torch's registry, or disabled by the operator) and the torch versions involved."""
    off = frozenset(disabled)
    ops = supported_ops()
    for n in graph.nodes:
        if n.op in ops and n.op not in off:
            continue
        captured = graph.meta.get("torch")
        here = f"torch {torch_version()}"
        if n.op in off:
            reason = (f"is disabled on this daemon by its operator (jobs.disabled_ops; it runs "
                      f"{here})")
        else:
            reason = f"is not in this daemon's op registry ({here})"
        if captured:
            reason += f"; the graph was captured with torch {captured}"
        raise UnsupportedOpError(n.op, n.module_path, n.id, reason)


@functools.cache
def resolve(name: str) -> Callable[..., Any]:
    """The callable for an IR op name; `UnsupportedOpError` if it is not in the registry."""
    if not is_supported(name):
        raise UnsupportedOpError(name)
    if name in SYM_OPS:
        return SYM_OPS[name]
    ns, opname, overload = name.split(".")
    try:
        fn: Callable[..., Any] = getattr(getattr(getattr(torch.ops, ns), opname), overload)
    except (AttributeError, RuntimeError) as e:  # pragma: no cover - a torch without the op
        raise UnsupportedOpError(name) from e
    return fn
