"""The submitting side of a job (what `fusionctl submit` runs before talking to its daemon).

`prepare_job(path)` loads and validates the job file, builds the model (the only place user
code runs), captures it with its loss, and returns the IR and initial weights as bytes for the
daemon. Every refusal is a `FusionError` with a clear message, raised before anything starts:
a bad field (`JobSpecError` naming it), an unknown model or a factory that fails, data that does
not exist or is too short, a model torch.export cannot capture or that uses an op the registry
does not run (naming the op). `check_capacity` refuses a job that cannot fit the cluster's
memory at all, before the planner looks for a cut.

`resume_state(captured, path)` reads a checkpoint (or a finished model) written by an earlier
run of the same job, checks it against the captured graph, and gives the weights and the step
to start from (`fusionctl submit --resume`).

`corpus_for_upload(spec)` runs in fusionctl, as the user (no daemon reads a path a job
names): the corpus's content hash, and the corpus itself (token ids) unless it is the default
one, which every stage reads from its own Python's standard library and checks against the
hash.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.graph import CapturedModel, state_from_bytes, state_to_bytes
from fusiond.train.data import corpus_digest, make_source, text_tokens
from fusiond.train.programs import capture_job
from fusiond.train.spec import JobSpec, default_text_path, load_job, parse_job
from protocol import ir

__all__ = [
    "CapacityError",
    "PreparedJob",
    "check_capacity",
    "corpus_for_upload",
    "memory_estimate",
    "prepare_job",
    "restore_job",
    "resume_state",
]


class CapacityError(LocalError):
    """The job cannot fit the cluster's memory; the message gives both sizes."""


@dataclass(frozen=True)
class PreparedJob:
    """A validated, captured job, ready to hand to the daemon.

    What crosses to the daemon: `toml_text`, `base` (the job file's directory, for its relative
    data paths) and `out_base` (the submitter's cwd), `graph_bytes` (IR) and `state_bytes`
    (safetensors); `restore_job` rebuilds the spec and the captured model from them.
    """

    spec: JobSpec
    captured: CapturedModel
    graph_bytes: bytes
    state_bytes: bytes
    prepare_s: float
    toml_text: str = ""
    base: str = ""
    out_base: str = ""

    @property
    def tokens_per_sample(self) -> int:
        """Tokens in one sample (text jobs), else 0."""
        return self.spec.data.seq_len if self.spec.data.kind == "text" else 0


def prepare_job(path: str | Path) -> PreparedJob:
    """Validate, build, capture; raise a `FusionError` naming what is wrong."""
    t0 = time.perf_counter()
    spec = load_job(path)
    make_source(spec.data, spec.seed)  # data exists and is long enough (DataError otherwise)
    _, captured = capture_job(spec)
    p = Path(path).resolve()
    return PreparedJob(spec, captured, ir.dumps(captured.graph), captured.state_bytes(),
                       time.perf_counter() - t0, p.read_text(encoding="utf-8"), str(p.parent),
                       str(Path.cwd()))


def resume_state(captured: CapturedModel, path: str | Path
                 ) -> tuple[dict[str, torch.Tensor], int]:
    """(weights, first step) to resume `captured`'s job from the file at `path`: a
    `checkpoint-N.safetensors` resumes at step N (its metadata says which step it follows); a
    finished `model.safetensors` (no step) starts a new run at step 0 from its weights.
    `LocalError` naming the first tensor that is missing, unknown, or of another shape or dtype
    (a checkpoint of another model or config), or an unreadable file."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except (OSError, SafetensorError) as e:
        raise LocalError(f"cannot read {p} as safetensors: {e}") from e
    graph = captured.graph
    known = set(captured.state) | set(graph.aliases)
    unknown = sorted(set(loaded) - known)
    if unknown:
        raise LocalError(f"{p}: tensor {unknown[0]!r} is not in this job's model "
                         f"({len(unknown)} unknown): a checkpoint of another model?")
    state = dict(captured.state)
    for prm in graph.params:
        keep = prm.kind is ir.ParamKind.PARAMETER or (
            prm.kind is ir.ParamKind.BUFFER and prm.persistent)
        if not keep:
            continue  # constants and non-persistent buffers come from the capture
        t = loaded.get(prm.name)
        if t is None:
            raise LocalError(f"{p} lacks {prm.name!r}: a checkpoint of another model?")
        want = captured.state[prm.name]
        if t.shape != want.shape or t.dtype != want.dtype:
            raise LocalError(f"{p}: {prm.name!r} is {t.dtype} {tuple(t.shape)}, this job's "
                             f"model has {want.dtype} {tuple(want.shape)}")
        state[prm.name] = t
    step = meta.get("step")
    if step is None:
        return state, 0
    try:
        first = int(step) + 1
    except ValueError as e:
        raise LocalError(f"{p}: metadata step {step!r} is not an integer") from e
    if first < 1:
        raise LocalError(f"{p}: metadata step {step!r} is negative")
    return state, first


def is_default_corpus(spec: JobSpec) -> bool:
    """Whether a text job reads the default corpus (this Python's standard library)."""
    d = spec.data
    return d.kind == "text" and d.path is not None and d.tokenizer == "bytes" \
        and d.path.resolve() == default_text_path().resolve()


def corpus_for_upload(spec: JobSpec) -> tuple[str, bytes]:
    """(content hash, corpus as safetensors bytes) of a text job's corpus, read here (fusionctl
    on the submitting machine, with the user's permissions); the bytes are empty for the
    default corpus (every stage has one of its own and checks its hash). ("", b"") for image
    jobs."""
    if spec.data.kind != "text":
        return "", b""
    tokens = text_tokens(spec.data)
    digest = corpus_digest(tokens)
    if is_default_corpus(spec):
        return digest, b""
    compact = tokens.astype(np.uint8 if tokens.size and int(tokens.max()) < 256 else np.int32)
    return digest, state_to_bytes({"tokens": torch.from_numpy(compact)})


def restore_job(toml_text: str, base: str, out_base: str, graph_bytes: bytes,
                state_bytes: bytes, *, check_paths: bool = True) -> tuple[JobSpec, CapturedModel]:
    """The daemon's side of a submission: the spec and the captured model, validated again
    (the IR by `protocol.ir.loads`, the weights by safetensors; no pickle, no user code).
    `check_paths=False` when the corpus came with the upload (the data need not exist here)."""
    spec = parse_job(toml_text, base=Path(base), out_base=Path(out_base),
                     check_paths=check_paths)
    graph = ir.loads(graph_bytes)
    state = state_from_bytes(state_bytes)
    missing = [p.name for p in graph.params if p.name not in state]
    if missing:
        raise LocalError(f"submitted weights lack {missing[:3]} ({len(missing)} missing)")
    return spec, CapturedModel(graph, state)


def memory_estimate(captured: CapturedModel, spec: JobSpec) -> int:
    """A lower bound of the job's memory, in bytes: parameters, their gradients and the
    optimizer state (AdamW: two moments; SGD with momentum: one), summed over the cluster."""
    params = sum(
        t.numel() * t.element_size() for k, t in captured.state.items()
        if (p := captured.graph.param_map.get(k)) is not None
        and p.kind is ir.ParamKind.PARAMETER and p.requires_grad
    )
    others = sum(t.numel() * t.element_size() for t in captured.state.values()) - params
    opt_copies = 2 if spec.optimizer.kind == "adamw" else (1 if spec.optimizer.momentum else 0)
    return int(params * (2 + opt_copies) + others)


def check_capacity(captured: CapturedModel, spec: JobSpec,
                   free_bytes: Mapping[str, int]) -> None:
    """Refuse a job whose parameters, gradients and optimizer state alone exceed the cluster's
    free memory (`free_bytes`: node -> bytes it offers). The planner refines this per machine."""
    need = memory_estimate(captured, spec)
    have = sum(free_bytes.values())
    if need > have:
        raise CapacityError(
            f"job {spec.name!r} needs at least {need / 2**30:.2f} GiB for parameters, gradients "
            f"and optimizer state; the cluster's {len(free_bytes)} machines offer "
            f"{have / 2**30:.2f} GiB"
        )
