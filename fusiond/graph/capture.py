"""Capture an `nn.Module` and its loss as an OP-DAG `protocol.ir.Graph`, through torch.export.

`capture(model, example_inputs, targets=..., loss=...)` exports a wrapper whose forward returns
`loss(model(*inputs), targets)`, so the loss and the targets are part of the graph, lowers it to
core ATen (keeping `registry.KEPT_COMPOSITES` whole), and converts each FX node to an IR node.
torch.fx symbolic tracing is never used: it fails on common models (Hugging Face GPT-2).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import operator
import os
import platform
import re
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch import fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.nn.parameter import is_lazy

from fusiond.graph.errors import CaptureError, UnsupportedOpError
from fusiond.graph.registry import is_supported, op_name, sym_op_name
from protocol import ir

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

_DROPPED_CHECKS = (
    "aten._assert_tensor_metadata.",
    "aten._assert_scalar.",
    "aten._assert_async.",
    "aten.sym_constrain_range",
    "aten._functional_assert",
)
"""Assertion ops export inserts (dtype/shape checks of the trace); they produce nothing."""

_DYN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class CapturedModel:
    """A captured model: the IR graph and its initial state (name -> tensor, graph names).

    `state` holds every parameter, buffer and constant the graph reads, under the names in
    `graph.params` (tied parameters once, under the graph's name; `graph.aliases` has the rest).
    """

    graph: ir.Graph
    state: dict[str, torch.Tensor]
    capture_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def state_bytes(self) -> bytes:
        """The state as safetensors bytes (no pickle)."""
        return state_to_bytes(self.state)


def state_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise a state dict with safetensors (contiguous copies; tied storage is fine)."""
    return safetensors.torch.save({k: v.detach().contiguous().clone() for k, v in state.items()})


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def state_to_parts(state: Mapping[str, torch.Tensor]) -> list[bytes | memoryview]:
    """A state dict in the safetensors layout as buffers, without copying a tensor: the header
    (its length, then its JSON padded to 8 bytes), then each tensor's own bytes in order.
    Joined, they are a file `state_from_bytes` (or safetensors) reads. For tensors that are
    private contiguous CPU copies nobody writes to until the parts are written or sent (a
    stage's snapshot): serialising 21 MB of GPT-2 mini with safetensors took 25 ms of CPU
    holding the GIL, while the stage's next step waited for it on a 0.4-core host."""
    header: dict[str, Any] = {}
    parts: list[bytes | memoryview] = [b""]
    offset = 0
    for name in sorted(state):
        t = state[name].detach()
        code = _SAFETENSORS_DTYPES.get(t.dtype)
        if code is None:
            raise CaptureError(f"state {name!r}: dtype {t.dtype} has no safetensors form")
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.cpu().contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        if size:
            parts.append(t.reshape(-1).view(torch.uint8).numpy().data)
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    parts[0] = len(raw).to_bytes(8, "little") + raw
    return parts


def state_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    """Load a state dict written by `state_to_bytes`."""
    return dict(safetensors.torch.load(data))


_DTYPES_OF_CODE = {code: dt for dt, code in _SAFETENSORS_DTYPES.items()}

MAX_STATE_HEADER_BYTES = 64 << 20
"""The largest safetensors header `state_views` reads (safetensors' own bound is 100 MB)."""


def state_views(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The state dict in safetensors bytes as tensors that view `data` (no copy: a stage
    that copies the weights into its module at once needs no second copy of them; measured,
    `state_from_bytes` held two transient copies of a 19 MB stage's weights). The tensors
    keep `data` alive; over read-only bytes they are read-only, so the caller copies before
    it writes. The header is checked as safetensors checks it (`CaptureError` names what is
    wrong): its length, JSON, known dtypes, shapes that match their byte ranges, ranges in
    order inside the data, without gaps or overlaps."""
    mv = memoryview(data).cast("B")
    total = mv.nbytes
    if total < 8:
        raise CaptureError(f"safetensors data of {total} bytes has no header length")
    n = int.from_bytes(mv[:8], "little")
    if n > MAX_STATE_HEADER_BYTES or 8 + n > total:
        raise CaptureError(f"safetensors header of {n} bytes does not fit the limit "
                           f"({MAX_STATE_HEADER_BYTES}) or the {total} bytes given")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CaptureError(f"safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CaptureError("safetensors header is not a JSON object")
    base = 8 + n
    body = total - base
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise CaptureError(f"safetensors entry {name!r} is not an object")
        dtype = _DTYPES_OF_CODE.get(info.get("dtype"))  # type: ignore[arg-type]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if dtype is None:
            raise CaptureError(f"safetensors entry {name!r}: dtype {info.get('dtype')!r} is "
                               f"not one of {sorted(_DTYPES_OF_CODE)}")
        if (not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape)
                or not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)):
            raise CaptureError(f"safetensors entry {name!r}: shape {shape!r} or data_offsets "
                               f"{offsets!r} is not a list of non-negative ints")
        begin, end = offsets
        numel = math.prod(shape)
        if not 0 <= begin <= end <= body or end - begin != numel * dtype.itemsize:
            raise CaptureError(f"safetensors entry {name!r}: bytes [{begin}, {end}) do not hold "
                               f"{numel} x {dtype} inside the {body} bytes of data")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    at = 0
    for begin, end, name, _, _ in entries:
        if begin != at:
            raise CaptureError(f"safetensors entry {name!r} starts at byte {begin}, not {at}: "
                               "the data has a gap or an overlap")
        at = end
    if at != body:
        raise CaptureError(f"safetensors data has {body - at} bytes no entry holds")
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # read-only bytes: documented above
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for begin, end, name, dtype, shape in entries:
            if end == begin:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mv, dtype=torch.uint8, count=end - begin,
                                    offset=base + begin)
            out[name] = flat.view(dtype).reshape(shape)
    return out


class _LossWrapper(nn.Module):
    """forward(*inputs, targets) -> scalar loss; the user model lives at `.model`.

    With `keywords`, the inputs reach the model by those names (`model(input_ids=...,
    attention_mask=...)`), else by position."""

    def __init__(self, model: nn.Module, loss: LossFn | None, n_inputs: int,
                 keywords: Sequence[str] = ()) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.n_inputs = n_inputs
        self.keywords = tuple(keywords)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        inputs, rest = args[: self.n_inputs], args[self.n_inputs :]
        if self.keywords:
            out = self.model(**dict(zip(self.keywords, inputs, strict=True)))
        else:
            out = self.model(*inputs)
        if self.loss is None:
            if not isinstance(out, torch.Tensor):
                raise CaptureError("model must return the loss tensor when no loss is given")
            return out
        return self.loss(out, *rest)


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def _dim(d: Any, rename: Mapping[str, str]) -> ir.Dim:
    if isinstance(d, int):
        return d
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        if expr.is_number:
            return int(expr)
        return _rename(str(expr), rename)
    raise CaptureError(f"unexpected size entry {d!r}")


def _rename(expr: str, rename: Mapping[str, str]) -> str:
    if not rename:
        return expr
    return re.sub(r"\b[a-zA-Z_]\w*\b", lambda m: rename.get(m.group(0), m.group(0)), expr)


def _meta_of(val: Any, rename: Mapping[str, str], where: str) -> list[ir.TensorMeta]:
    if isinstance(val, torch.Tensor):
        return [ir.TensorMeta(tuple(_dim(d, rename) for d in val.shape), _dtype_name(val.dtype))]
    if isinstance(val, torch.SymInt | int) and not isinstance(val, bool):
        return [ir.TensorMeta((), "symint")]
    if isinstance(val, torch.SymFloat | float):
        return [ir.TensorMeta((), "symfloat")]
    if isinstance(val, torch.SymBool | bool):
        return [ir.TensorMeta((), "symbool")]
    if isinstance(val, list | tuple):
        out: list[ir.TensorMeta] = []
        for v in val:
            if v is None:  # an optional output (never read); keep positions aligned
                out.append(ir.TensorMeta((0,), "float32"))
            else:
                out.extend(_meta_of(v, rename, where))
        return out
    raise CaptureError(f"{where}: cannot describe output value {type(val).__name__}")


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        if "_empty_nn_module_stack" in str(key):
            continue
        path = str(value[0]) if isinstance(value, tuple) else str(value)
        path = path.removeprefix("L['self'].").removeprefix("model.")
        return "" if path == "model" else path
    return ""


def _frame_text(fr: traceback.FrameSummary, lib: bool) -> str:
    name = fr.filename
    if lib:
        name = re.split(r"(?:site|dist)-packages", name, maxsplit=1)[-1].lstrip("/\\")
    else:
        name = Path(name).name
    code = (fr.line or "").strip()
    return f" at {name}:{fr.lineno} in {fr.name}: `{code}`"


def _deepest_frame(e: BaseException) -> tuple[traceback.FrameSummary, bool] | None:
    """The deepest traceback frame of `e` in the user's code, or, when the error came from
    deeper inside a library (transformers, ...), the deepest frame there, with True for a
    library's; torch's and fusion's own frames are skipped."""
    torch_dir = str(Path(torch.__file__).parent)
    ours = str(Path(__file__).parent)
    stdlib = str(Path(traceback.__file__).parent)
    deepest: tuple[traceback.FrameSummary, bool] | None = None
    for fr in traceback.extract_tb(e.__traceback__):
        fn = fr.filename
        if fn.startswith((torch_dir, ours, stdlib)) or fn.startswith("<"):
            continue
        deepest = (fr, "site-packages" in fn or "dist-packages" in fn)
    return deepest


_NOISE = ("For more information", "TORCH_LOGS", "TORCHDYNAMO_", "docs.google.com",
          "draft_export", "If you suspect the guard", "For extended logs", "The error above",
          "consider using data-dependent friendly APIs", "Caused by: (_export", "tlparse")


def _hint(model: nn.Module, e: BaseException, text: str, lib: bool | None) -> str:
    """What the user can do about a torch.export failure: specific where we recognise it,
    else by where it raised (`lib`: in a library's code; None: no frame outside torch)."""
    if "specialized it to be a constant" in text or "Constraints violated" in text:
        rnns = [(n, type(m).__name__) for n, m in model.named_modules()
                if isinstance(m, nn.RNNBase)]
        if rnns:
            names = ", ".join(f"{n!r} ({c})" for n, c in rnns[:4])
            return (f". The recurrent layer {names} loops over the sequence, so torch.export "
                    "fixes its length: capture the model with a static sequence length (a fixed "
                    "data.seq_len and no dynamic 'seq' dim), or replace the layer")
        return (". The model fixes the size of a dim marked dynamic: capture it with that dim "
                "static")
    if "data-dependent" in text or "GuardOnDataDependent" in type(e).__name__:
        return (". A branch or a size depends on a tensor's values (.item(), int(t), "
                "bool(t), if t...), which one graph cannot hold: compute it with tensor ops "
                "(torch.where, masking) or torch.cond")
    if lib:
        return (". That line is library code: call the library so it takes another path (its "
                "inputs or config), or replace the module that runs it; docs/ir.md "
                "(\"What capture takes\") says what torch.export can trace")
    if lib is False:
        return (". Rewrite that line so torch.export can trace it; docs/ir.md (\"What capture "
                "takes\") says what it can")
    return (". torch.export failed inside torch, at no line of the model: docs/ir.md (\"What "
            "capture takes\") says what it can trace; simplify the model's forward until it "
            "exports")


def _torch_words(text: str) -> str:
    """torch's message without its debugging advice: its first distinct lines."""
    lines = list(dict.fromkeys(ln.rstrip() for ln in text.strip().splitlines()
                               if ln.strip() and not any(x in ln for x in _NOISE)))
    return "\n".join(lines[:6]).rstrip(". ")


def export_failure(model: nn.Module, e: BaseException, module_path: str = "") -> str:
    """The message of a torch.export failure: the model, the module that was running and the
    line (the user's, or a library's when it raised there), torch's own words without its
    debugging advice, and what to do."""
    head = _torch_words(str(e).split("The following call raised this error", 1)[0])
    deepest = _deepest_frame(e)
    where = "" if deepest is None else _frame_text(*deepest)
    lib = None if deepest is None else deepest[1]
    inside = f" (in module {module_path!r})" if module_path else ""
    return (f"torch.export cannot export {type(model).__name__}{inside}{where}: "
            f"{type(e).__name__}: {head}{_hint(model, e, str(e), lib)}")


def lowering_failure(model: nn.Module, e: BaseException,
                     exported: torch.export.ExportedProgram) -> str:
    """The message of a `run_decompositions` failure: the model, the module and line of the
    exported node torch was lowering (named in torch's message, looked up in `exported`),
    torch's own words, and what to do."""
    text, _, executing = str(e).partition("\n\nWhile executing ")
    found = re.match(r"%(\w+)", executing)
    node = None
    if found:
        node = next((n for n in exported.graph_module.graph.nodes
                     if n.name == found.group(1)), None)
    inside = where = op = ""
    if node is not None:
        path = _module_path(node)
        inside = f" (in module {path!r})" if path else ""
        where = _source_line(node)
        if isinstance(node.target, torch._ops.OpOverload):
            op = f" {op_name(node.target)}"
    line = "that line" if where else "the model"
    return (f"lowering {type(model).__name__} to core ATen failed{inside}{where}: "
            f"{type(e).__name__}: {_torch_words(text)}. torch.export traced {line}, but "
            f"torch's lowering of its op{op} failed: rewrite {line} with other ops, or "
            "capture with another torch version")


_STDERR_LOCK = threading.RLock()
"""Held while fd 2 points at an export's temporary file (see `quiet_export`)."""


def _flush_stderr() -> None:
    for stream in (sys.stderr, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(ValueError, OSError):  # closed
                stream.flush()


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Keep torch's own output off the user's terminal while exporting: the partial graph
    torch.export prints to stderr when it fails, what its C++ writes to file descriptor 2, its
    loggers' warnings, and the warnings it raises about the model. What was written to stderr
    (the model's own output) is written out after a successful export, dropped after a failed
    one.

    Not thread-safe beyond a lock: fd 2 belongs to the process, so while an export runs every
    thread's writes to it (log lines, native warnings) go to the temporary file too, shown
    after a successful export and dropped after a failed one. `_STDERR_LOCK` keeps two
    threads' exports from swapping fd 2 out of order (they run one at a time here); it is
    re-entrant, so a nested `quiet_export` in one thread redirects again. Capture runs where
    a job is submitted, not in a daemon's threads."""
    buf = io.StringIO()
    logger = logging.getLogger("torch")
    with _STDERR_LOCK, tempfile.TemporaryFile() as native:
        _flush_stderr()  # what was written before the export stays before it
        try:
            saved_fd: int | None = os.dup(2)
        except OSError:  # no fd 2 (a detached process): Python-level only
            saved_fd = None
        if saved_fd is not None:
            os.dup2(native.fileno(), 2)
        level = logger.level
        logger.setLevel(logging.CRITICAL)
        ok = False
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(buf):
                warnings.simplefilter("ignore")
                yield
            ok = True
        finally:
            if saved_fd is not None:
                _flush_stderr()  # Python's buffered writes to fd 2 go to the file, not after
                os.dup2(saved_fd, 2)
                os.close(saved_fd)
            logger.setLevel(level)
            if ok:
                native.seek(0)
                written = native.read().decode(errors="replace") + buf.getvalue()
                if written:
                    sys.stderr.write(written)


class _ModuleTrail:
    """Which submodule was running when export failed: forward pre-/post-hooks on every
    submodule keep the stack of the ones entered and not yet left."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.deepest = ""
        self._handles: list[Any] = []
        for name, mod in model.named_modules():
            if not name:
                continue
            self._handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self._handles.append(mod.register_forward_hook(self._leave(name)))

    def _enter(self, name: str) -> Callable[..., None]:
        def pre(*_: Any) -> None:
            self.stack.append(name)
        return pre

    def _leave(self, name: str) -> Callable[..., None]:
        def post(*_: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
        return post

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _default_decompositions() -> Any:
    table = torch.export.default_decompositions()
    for name in ("linear", "scaled_dot_product_attention"):
        op = getattr(torch.ops.aten, name).default
        if op in table:
            table.pop(op)  # type: ignore[no-untyped-call]
    return table


def export_program(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    targets: torch.Tensor | None,
    loss: LossFn | None,
    dynamic: Sequence[Mapping[int, str] | None] | None,
    dim_max: Mapping[str, int],
    dim_min: Mapping[str, int],
    targets_name: str = "targets",
) -> tuple[torch.export.ExportedProgram, list[str], list[Mapping[int, str] | None]]:
    """torch.export the loss wrapper and lower it to core ATen. A mapping of example inputs
    reaches the model by keyword, and names the graph's inputs.

    Returns the program, the input names and the dynamic spec per input."""
    keywords: tuple[str, ...] = ()
    lazy = [(n, type(m).__name__) for n, m in model.named_modules()
            if any(is_lazy(t) for t in (*m.parameters(False), *m.buffers(False)))]
    if lazy:
        which = ", ".join(f"{n!r} ({c})" if n else f"{c} (the model itself)"
                          for n, c in lazy[:4])
        raise CaptureError(
            f"cannot capture {type(model).__name__}: lazy module{'s' if len(lazy) > 1 else ''} "
            f"{which} create{'' if len(lazy) > 1 else 's'} {'their' if len(lazy) > 1 else 'its'} "
            "parameters on the first forward, from the input's shape: run the model once on a "
            "batch, then capture it")
    if isinstance(example_inputs, Mapping):
        keywords = tuple(example_inputs)
        for k in keywords:
            if not _DYN_NAME.match(k) or k == targets_name:
                raise CaptureError(f"input name {k!r} is not an identifier, or is the targets'")
        example_inputs = [example_inputs[k] for k in keywords]
    # Distinct tensors per input: export would merge two inputs that are the same tensor
    # (e.g. a language model's targets passed as its inputs) into one graph input.
    args = tuple(a.clone() for a in (*example_inputs, *(() if targets is None else (targets,))))
    if dynamic is None:
        dynamic = [{0: "batch"} for _ in args]
    if len(dynamic) != len(args):
        raise CaptureError(f"dynamic has {len(dynamic)} entries for {len(args)} inputs")
    dims: dict[str, Any] = {}
    specs: list[dict[int, Any] | None] = []
    for spec in dynamic:
        if not spec:
            specs.append(None)
            continue
        entry: dict[int, Any] = {}
        for axis, name in spec.items():
            if not _DYN_NAME.match(name):
                raise CaptureError(f"dynamic dim name {name!r} is not an identifier")
            if name not in dims:
                dims[name] = Dim(name, min=dim_min.get(name, 1), max=dim_max.get(name))
            entry[axis] = dims[name]
        specs.append(entry)
    wrapper = _LossWrapper(model, loss, len(example_inputs), keywords)
    wrapper.train(model.training)
    with quiet_export():
        trail = _ModuleTrail(model)
        try:
            ep = torch.export.export(wrapper, args, dynamic_shapes={"args": tuple(specs)},
                                     strict=False)
        except CaptureError:
            raise
        except Exception as e:  # torch raises many types; all mean "cannot export"
            path = trail.stack[-1] if trail.stack else ""
            raise CaptureError(export_failure(model, e, path)) from e
        finally:
            trail.close()
        try:
            lowered = ep.run_decompositions(_default_decompositions())
        except Exception as e:  # torch's decomposition of an op the export holds
            raise CaptureError(lowering_failure(model, e, ep)) from e
        ep = lowered
    names = [f"input{i}" for i in range(len(example_inputs))]
    if keywords:
        names = list(keywords)
    elif len(example_inputs) == 1:
        names = ["input"]
    if targets is not None:
        names.append(targets_name)
    return ep, names, list(dynamic)


def capture(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
    *,
    targets: torch.Tensor | None = None,
    loss: LossFn | None = None,
    dynamic: Sequence[Mapping[int, str] | None] | None = None,
    dim_max: Mapping[str, int] | None = None,
    dim_min: Mapping[str, int] | None = None,
    input_names: Sequence[str] | None = None,
    targets_name: str = "targets",
) -> CapturedModel:
    """Capture `loss(model(*example_inputs), targets)` as an IR graph plus initial state.

    `example_inputs` may be a mapping of named tensors: the model is then called with them by
    keyword (`model(input_ids=..., attention_mask=...)`, as Hugging Face models take them) and
    the graph's inputs carry those names, the targets `targets_name`.

    - `dynamic`: one entry per input (inputs, then targets): axis -> dim name; the same name on
      several inputs means the same size. Default: axis 0 of every input is `batch`. The graph's
      symbols are named after these dims (`Graph.symbols == {"batch": 2, ...}`).
    - `dim_max` / `dim_min`: bounds of named dims (e.g. a language model's `seq` <= block size).
      Example sizes must not be 0 or 1 on dynamic axes (torch.export specialises those).
    - The model is captured in its current train/eval mode; dropout and BatchNorm behave
      accordingly, and BatchNorm's running statistics become `Graph.buffer_updates`.

    Raises `CaptureError` naming the construct when torch.export fails, and
    `UnsupportedOpError` naming the op and module path when the registry cannot run an op.
    """
    t0 = time.perf_counter()
    ep, names, dyn = export_program(
        model, example_inputs, targets, loss, dynamic, dim_max or {}, dim_min or {},
        targets_name,
    )
    if isinstance(example_inputs, Mapping):
        example_inputs = list(example_inputs.values())
    if input_names is not None:
        if len(input_names) != len(names):
            raise CaptureError(f"input_names has {len(input_names)} names for {len(names)} inputs")
        names = list(input_names)
    args = [*example_inputs, *(() if targets is None else (targets,))]
    graph, state = _convert(ep, model, names, args, dyn)
    return CapturedModel(graph, state, capture_seconds=time.perf_counter() - t0)


def _convert(
    ep: torch.export.ExportedProgram,
    model: nn.Module,
    input_names: Sequence[str],
    example_args: Sequence[torch.Tensor],
    dynamic: Sequence[Mapping[int, str] | None],
) -> tuple[ir.Graph, dict[str, torch.Tensor]]:
    sig = ep.graph_signature
    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        raise CaptureError("exported program: placeholders do not match its signature")

    def strip(name: str) -> str:
        return name.removeprefix("model.")

    # Name dynamic symbols after the user's dims, via the user inputs' symbolic shapes.
    rename: dict[str, str] = {}
    symbols: dict[str, int] = {}
    user_ph = [
        (ph, spec)
        for ph, spec in zip(placeholders, sig.input_specs, strict=True)
        if spec.kind is InputKind.USER_INPUT
    ]
    if len(user_ph) != len(input_names):
        raise CaptureError("exported program: user inputs do not match example inputs")
    for (ph, _), arg in zip(user_ph, example_args, strict=True):
        for d, size in zip(ph.meta["val"].shape, arg.shape, strict=True):
            if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                sym = str(d.node.expr)
                symbols[sym] = int(size)
    for (ph, _), spec in zip(user_ph, dynamic, strict=True):
        for axis, dim_name in (spec or {}).items():
            d = ph.meta["val"].shape[axis]
            if isinstance(d, torch.SymInt) and d.node.expr.is_symbol:
                rename[str(d.node.expr)] = dim_name
    symbols = {rename.get(k, k): v for k, v in symbols.items()}
    ranges: dict[str, tuple[int, int | None]] = {}
    for sym, vr in ep.range_constraints.items():
        name = rename.get(str(sym), str(sym))
        if name in symbols:
            hi = vr.upper
            bounded = str(hi) not in ("int_oo", "oo", "-int_oo", "-oo")
            ranges[name] = (int(vr.lower), int(hi) if bounded else None)

    env: dict[fx.Node, ir.Arg] = {}
    inputs: list[ir.InputSpec] = []
    params: dict[str, ir.ParamSpec] = {}
    state: dict[str, torch.Tensor] = {}
    ep_state = ep.state_dict
    user_i = 0
    requires_grad = {strip(k): p.requires_grad for k, p in ep.named_parameters()}
    persistent_bufs = set(sig.buffers) - set(sig.non_persistent_buffers)
    for ph, spec in zip(placeholders, sig.input_specs, strict=True):
        val = ph.meta["val"]
        if spec.kind is InputKind.USER_INPUT:
            name = input_names[user_i]
            user_i += 1
            (meta,) = _meta_of(val, rename, f"input {name}")
            inputs.append(ir.InputSpec(name, meta))
            env[ph] = ir.Ref(ir.RefKind.INPUT, name)
            continue
        target = spec.target
        if target is None:
            raise CaptureError(f"input {ph.name} of kind {spec.kind} has no target")
        name = strip(target)
        (meta,) = _meta_of(val, rename, f"state {name}")
        if spec.kind is InputKind.PARAMETER:
            kind, rk = ir.ParamKind.PARAMETER, ir.RefKind.PARAM
            tensor = ep_state[target]
        elif spec.kind is InputKind.BUFFER:
            kind, rk = ir.ParamKind.BUFFER, ir.RefKind.BUFFER
            tensor = ep_state[target] if target in ep_state else ep.constants[target]
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            kind, rk = ir.ParamKind.CONSTANT, ir.RefKind.CONSTANT
            const = ep.constants.get(target)
            if not isinstance(const, torch.Tensor):
                raise CaptureError(
                    f"constant {target!r} is not a tensor (script objects are not supported)"
                )
            tensor = const
            name = "const." + name
        else:
            raise CaptureError(f"unsupported graph input kind {spec.kind} ({target})")
        params[name] = ir.ParamSpec(
            name,
            kind,
            meta,
            requires_grad=requires_grad.get(name, False)
            if kind is ir.ParamKind.PARAMETER
            else False,
            persistent=kind is not ir.ParamKind.BUFFER or target in persistent_bufs,
        )
        state[name] = tensor.detach().clone()  # a snapshot: later eager steps must not leak in
        env[ph] = ir.Ref(rk, name)

    nodes: list[ir.Node] = []
    used_params: set[str] = set()
    out_node = None
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out_node = n
            continue
        if n.op != "call_function":
            raise CaptureError(f"unsupported FX node kind {n.op} ({n.name})")
        path = _module_path(n)
        if n.target is operator.getitem:
            src, idx = n.args
            base = env[src]
            if not isinstance(base, ir.Ref) or base.kind is not ir.RefKind.NODE:
                raise CaptureError(f"getitem of a non-node value at {n.name} ({path})")
            env[n] = ir.Ref(ir.RefKind.NODE, base.name, int(idx))
            continue
        opn: str | None
        if isinstance(n.target, torch._ops.OpOverload):
            opn = op_name(n.target)
            if opn.startswith(_DROPPED_CHECKS) and not n.users:
                continue  # a runtime metadata/shape assertion: no value, nothing to run
        else:
            opn = sym_op_name(n.target)
            if opn is None:
                raise _unsupported(str(getattr(n.target, "__name__", n.target)), n, path, model)
        if not is_supported(opn):
            raise _unsupported(opn, n, path, model)
        args = tuple(_arg(a, env, n) for a in n.args)
        kwargs = {k: _arg(v, env, n) for k, v in n.kwargs.items()}
        outs = tuple(_meta_of(n.meta.get("val"), rename, f"node {n.name} ({opn})"))
        node = ir.Node(n.name, opn, args, kwargs, outs, (), path)
        ps = tuple(
            dict.fromkeys(
                r.name
                for r in node.refs()
                if r.kind in (ir.RefKind.PARAM, ir.RefKind.BUFFER, ir.RefKind.CONSTANT)
            )
        )
        used_params.update(ps)
        node = ir.Node(n.name, opn, args, kwargs, outs, ps, path)
        nodes.append(node)
        env[n] = ir.Ref(ir.RefKind.NODE, n.name, 0)
    if out_node is None:
        raise CaptureError("exported program has no output")

    outputs: list[ir.OutputSpec] = []
    updates: dict[str, ir.Ref] = {}
    (out_vals,) = out_node.args
    for val, spec in zip(out_vals, sig.output_specs, strict=True):
        ref = env.get(val) if isinstance(val, fx.Node) else None
        if not isinstance(ref, ir.Ref):
            raise CaptureError(f"graph output {spec.arg} is not a node value")
        if spec.kind is OutputKind.USER_OUTPUT:
            outputs.append(ir.OutputSpec("loss" if not outputs else f"output{len(outputs)}", ref))
        elif spec.kind is OutputKind.BUFFER_MUTATION:
            if spec.target is None:
                raise CaptureError("buffer mutation without a target")
            updates[strip(spec.target)] = ref
            used_params.add(strip(spec.target))
        else:
            raise CaptureError(
                f"unsupported graph output kind {spec.kind} "
                f"({spec.target}): parameters must not be mutated in forward"
            )

    aliases = _aliases(model, used_params)
    kept = {k: v for k, v in params.items() if k in used_params or k not in aliases}
    state = {k: v for k, v in state.items() if k in kept}
    graph = ir.Graph(
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        params=tuple(kept.values()),
        nodes=tuple(nodes),
        symbols=symbols,
        symbol_ranges=ranges,
        aliases=aliases,
        buffer_updates=updates,
        # what captured it: a stage on another torch names both versions when it refuses an op
        meta={"model": type(model).__name__, ir.META_TORCH: torch.__version__,
              ir.META_PYTHON: platform.python_version()},
    )
    try:
        ir.validate(graph)
    except Exception as e:
        raise CaptureError(f"captured graph is inconsistent: {e}") from e
    return graph, state


def _source_line(node: fx.Node) -> str:
    """` at file.py:LINE in fn: `code`` of the innermost frame of `node`'s stack trace outside
    torch and fusion (the model's line, or a library's), or ""."""
    trace = node.meta.get("stack_trace") or ""
    torch_dir = str(Path(torch.__file__).parent)
    ours = str(Path(__file__).parent)
    found = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    for filename, line, fn, code in reversed(found):
        if filename.startswith((torch_dir, ours)):
            continue
        lib = "site-packages" in filename
        name = filename.split("site-packages", 1)[1].lstrip("/\\") if lib \
            else Path(filename).name
        return f" at {name}:{line} in {fn}: `{code.strip()}`"
    return ""


def _unsupported(op: str, node: fx.Node, path: str, model: nn.Module) -> UnsupportedOpError:
    """The refusal of an op the registry lacks: the op, the module (the model's own forward
    when it is the top module's), the source line, and what to do."""
    module = path or f"{type(model).__name__} (the model's own forward)"
    where = _source_line(node)
    return UnsupportedOpError(
        op, module, node.name,
        f"is not in the fusion op registry{where}: rewrite that line with ops the registry "
        "runs (docs/ir.md lists them), or capture the model in the mode that avoids it")


def _arg(a: Any, env: Mapping[fx.Node, ir.Arg], node: fx.Node) -> ir.Arg:
    if isinstance(a, fx.Node):
        v = env.get(a)
        if v is None:
            raise CaptureError(f"node {node.name} reads {a.name}, which has no IR value")
        return v
    if a is None or isinstance(a, bool | int | float | str):
        return a
    if isinstance(a, list | tuple):
        return tuple(_arg(x, env, node) for x in a)
    if isinstance(a, torch.dtype):
        return ir.DType(_dtype_name(a))
    if isinstance(a, torch.device):
        return ir.Device(str(a))
    if isinstance(a, torch.layout):
        return ir.Layout(str(a).removeprefix("torch."))
    if isinstance(a, torch.memory_format):
        return ir.MemoryFormat(str(a).removeprefix("torch."))
    raise CaptureError(
        f"node {node.name} ({node.target}) has an argument of unsupported type "
        f"{type(a).__name__}: {a!r:.60}"
    )


def _aliases(model: nn.Module, used: set[str]) -> dict[str, str]:
    """Tied parameters/buffers: each name that shares a tensor with a used name -> that name."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for name, b in model.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), []).append(name)
    out: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        canon = next((n for n in names if n in used), names[0])
        for n in names:
            if n != canon:
                out[n] = canon
    return out


def describe(graph: ir.Graph) -> str:
    """A short human-readable summary (op counts), for logs and the benchmark."""
    counts: dict[str, int] = {}
    for n in graph.nodes:
        counts[n.op] = counts.get(n.op, 0) + 1
    buf = io.StringIO()
    buf.write(f"{len(graph.nodes)} nodes, {len(graph.params)} params, symbols {graph.symbols}\n")
    for op, c in sorted(counts.items(), key=lambda kv: -kv[1]):
        buf.write(f"  {c:5d} {op}\n")
    return buf.getvalue()
