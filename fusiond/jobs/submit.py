"""The submitting side of a job (what `fusionctl submit` runs before talking to its daemon).

`prepare_job(path)` loads and validates the job file, builds the model (the only place user
code runs), captures it with its loss, and returns the IR and initial weights as bytes for the
daemon. Every refusal is a `FusionError` with a clear message, raised before anything starts:
a bad field (`JobSpecError` naming it), an unknown model or a factory that fails, data that does
not exist or is too short, a model torch.export cannot capture or that uses an op the registry
does not run (naming the op), data the model cannot take (`check_data_fits`: token ids past its
vocabulary, a sequence longer than its context, labels past its classes; found by running one
micro-batch of the job's own data forward here). `check_capacity` refuses a job that cannot fit
the cluster's memory at all, before the planner looks for a cut.

`resume_state(captured, path)` reads a checkpoint (or a finished model) written by an earlier
run of the same job, checks it against the captured graph, and gives the weights and the step
to start from (`fusionctl submit --resume`); a checkpoint holding NaN or Inf is refused
(`check_finite`, which the daemon runs again on every submitted state).

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
from typing import Any

import numpy as np
import torch

from fusiond.errors import LocalError
from fusiond.graph import CapturedModel, state_from_bytes, state_to_bytes
from fusiond.train.data import (
    Batch,
    DataSource,
    TextWindows,
    compact_arrays,
    dataset_digest,
    load_arrays,
    make_source,
)
from fusiond.train.data import is_default_corpus as data_is_default_corpus
from fusiond.train.model import Feed, build_model, feed_for
from fusiond.train.programs import capture_job_feed
from fusiond.train.spec import JobSpec, load_job, parse_job
from protocol import ir

__all__ = [
    "CapacityError",
    "DataFitError",
    "ObjectiveError",
    "PreparedJob",
    "check_capacity",
    "check_data_fits",
    "check_finite",
    "check_objective",
    "corpus_for_upload",
    "memory_estimate",
    "prepare_job",
    "restore_job",
    "resume_state",
]


class CapacityError(LocalError):
    """The job cannot fit the cluster's memory; the message gives both sizes."""


class DataFitError(LocalError):
    """The job's data does not fit its model (token ids, sequence length, classes); the message
    names both numbers. The job would fail at its first step on any machine."""


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
        return self.spec.data.seq_len if self.spec.data.is_text else 0


def prepare_job(path: str | Path) -> PreparedJob:
    """Validate, build, capture, and run one micro-batch of the job's data through the model
    (`check_data_fits`, `check_objective`); raise a `FusionError` naming what is wrong."""
    t0 = time.perf_counter()
    spec = load_job(path)
    source = make_source(spec.data, spec.seed)  # data exists and is long enough (DataError)
    # the eager checks first: a model that does not fit its data or objective is refused
    # saying so, not with what torch.export makes of the loss failing inside it
    model = build_model(spec.model, seed=spec.seed)
    model.train()
    feed = feed_for(model, source.batch(0, max(2, spec.batch.micro_batch_size)), spec)
    check_data_fits(spec, model, source, feed)
    check_objective(spec, model, source, feed)
    model, captured, feed = capture_job_feed(spec, source, model=model)
    p = Path(path).resolve()
    return PreparedJob(spec, captured, ir.dumps(captured.graph), captured.state_bytes(),
                       time.perf_counter() - t0, p.read_text(encoding="utf-8"), str(p.parent),
                       str(Path.cwd()))


def _probe_batch(spec: JobSpec, source: DataSource) -> Batch:
    """One micro-batch of the job's own data, step 0's, whose first sample is, for a token
    stream, the corpus's window around its largest token id (so the range check sees the worst
    case)."""
    batch = source.batch(0, max(1, spec.batch.micro_batch_size))
    if isinstance(source, TextWindows) and spec.data.objective == "causal_lm":
        tokens, t = source.tokens, source.seq_len
        top = int(np.argmax(tokens))
        start = min(max(0, top - t // 2), tokens.size - t - 1)
        win = torch.from_numpy(tokens[start:start + t + 1].copy())
        batch = batch.clone()
        batch.inputs[0], batch.targets[0] = win[:-1], win[1:]
    return batch


def check_data_fits(spec: JobSpec, model: torch.nn.Module, source: DataSource,
                    feed: Feed | None = None) -> None:
    """Run one micro-batch of the job's own data (`_probe_batch`) through `model` and its loss
    on this machine's CPU (eval mode, no gradients: nothing in the model changes). A token id
    past an embedding's rows, a sequence longer than the positions it holds, labels past the
    classes the model outputs, or any other error of the forward is a `DataFitError` naming
    both numbers: the job would fail at its first step on every machine."""
    from fusiond.train.model import loss_fn, output_tensor

    batch = _probe_batch(spec, source)
    if feed is None:
        feed = feed_for(model, batch, spec)
    inputs, targets = batch.inputs, batch.targets
    seen: list[tuple[str, int, int, bool]] = []  # embedding, rows, largest index, reads data

    def hook(name: str, rows: int) -> Any:
        def pre(_mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            idx = args[0] if args else None
            if isinstance(idx, torch.Tensor) and idx.numel() and not idx.is_floating_point():
                data = idx.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()
                seen.append((name, rows, int(idx.max()), data))
        return pre

    handles = [m.register_forward_pre_hook(hook(n, m.num_embeddings))
               for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    text = spec.data.is_text
    what = (f"{inputs.shape[0]} samples of data.seq_len={spec.data.seq_len} tokens, token ids "
            f"up to {int(inputs.max())}" if text else f"{inputs.shape[0]} samples")
    was_training = model.training
    model.eval()
    ignore = spec.loss.ignore_index
    try:
        with torch.no_grad():
            out = feed.call(model, batch)
            logits = output_tensor(out)
            _check_output_shape(spec, model, logits, targets)
            if spec.loss.kind != "regression" and logits.ndim >= 1:
                real = targets[targets != ignore]
                classes = int(logits.shape[-1])
                top = int(real.max()) if real.numel() else -1
                if top >= classes:
                    if text and spec.loss.kind != "classification":
                        hint = f"its output has {classes} logits (its vocabulary)"
                    elif spec.data.kind == "images":
                        hint = (f"data.num_classes = {spec.data.num_classes} while the model "
                                f"outputs {classes} classes")
                    else:
                        hint = (f"the data has at least {top + 1} classes while the model "
                                f"outputs {classes}")
                    raise DataFitError(
                        f"the data's {'token id' if text else 'label'} {top} is past what the "
                        f"model predicts: {hint}; give the model at least {top + 1} outputs or "
                        "change the data")
            loss_fn(spec.loss)(out, targets)
    except (DataFitError, ObjectiveError):
        raise
    except Exception as e:
        for name, rows, top, data in seen:
            if top < rows:
                continue
            if data:
                raise DataFitError(
                    f"the data has token id {top} (data.tokenizer = {spec.data.tokenizer!r}) but "
                    f"the model's embedding {name!r} holds {rows} tokens (ids 0..{rows - 1}): "
                    f"give the model a vocabulary of at least {top + 1} (e.g. model.config "
                    "vocab_size) or use a tokenizer with fewer ids") from None
            if text and top == spec.data.seq_len - 1:
                raise DataFitError(
                    f"data.seq_len = {spec.data.seq_len} is longer than the model's context: its "
                    f"embedding {name!r} holds {rows} positions; set data.seq_len <= {rows} or "
                    "give the model a longer context") from None
            raise DataFitError(f"the model's embedding {name!r} holds {rows} rows and got index "
                               f"{top} on one micro-batch of the job's data ({what})") from None
        raise DataFitError(f"the model fails on one micro-batch of the job's own data ({what}): "
                           f"{type(e).__name__}: {e}") from None
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


def _check_output_shape(spec: JobSpec, model: torch.nn.Module, out: torch.Tensor,
                        targets: torch.Tensor) -> None:
    """The model's output has the shape the objective scores: a prediction per token for the
    LM objectives, one per sample for classification, the labels' own shape for regression
    (mean squared error broadcasts silently otherwise). `ObjectiveError` saying which head
    the objective needs."""
    kind, name = spec.loss.kind, type(model).__name__
    shape, labels = tuple(out.shape), tuple(targets.shape)
    if kind in ("causal_lm", "masked_lm", "seq2seq_lm"):
        if out.ndim != targets.ndim + 1 or shape[:-1] != labels:
            raise ObjectiveError(
                f"loss.kind = {kind!r} predicts a token at every position (labels {labels}), "
                f"but {name} outputs {shape}: not one vocabulary of logits per position (a "
                "classification or regression head?); use a model with a language-model head, "
                "or loss.kind = 'classification' / 'regression' with per-sample labels")
    elif kind == "classification":
        if out.ndim != 2 or targets.ndim != 1 or shape[0] != labels[0]:
            per_token = out.ndim == 3
            raise ObjectiveError(
                f"loss.kind = 'classification' scores one prediction per sample (labels "
                f"{labels}), but {name} outputs {shape}"
                + (": logits for every token (a language-model head); use loss.kind = "
                   "'causal_lm' or 'masked_lm', or a model with a classification head (e.g. "
                   "a ...ForSequenceClassification class)" if per_token else
                   "; it needs (batch, classes)"))
    elif kind == "regression":
        same = shape == labels or (out.ndim == 2 and shape[1] == 1 and labels == shape[:1])
        if not same:
            raise ObjectiveError(
                f"loss.kind = 'regression' compares {name}'s output {shape} with the labels "
                f"{labels} element by element, and they differ in shape (mean squared error "
                "would broadcast them silently); give the model one output per target value "
                "(e.g. config num_labels = "
                + (f"{labels[1]}" if len(labels) == 2 else "1") + ")")


class ObjectiveError(LocalError):
    """The model cannot learn the job's objective as given (a bidirectional encoder on
    next-token prediction sees the token it must predict); the message says why and what to
    use instead."""


def check_objective(spec: JobSpec, model: torch.nn.Module, source: DataSource,
                    feed: Feed | None = None) -> None:
    """Refuse a model that would see its own targets: for next-token prediction (`causal_lm`)
    and the decoder of `seq2seq_lm`, the output at a position must not depend on the inputs
    after it. Checked on one sample of the job's data (eval mode, no gradients): the last
    input token is changed, and every earlier position's output must stay the same. And the
    converse for `masked_lm`, which predicts a masked token from both sides: a causal model,
    whose earlier outputs never move, cannot see the right-hand context it is scored on."""
    from fusiond.train.model import output_tensor

    kind = spec.loss.kind
    if kind not in ("causal_lm", "seq2seq_lm", "masked_lm"):
        return
    batch = source.batch(0, 1)
    if feed is None:
        feed = feed_for(model, batch, spec)
    field = "decoder_input_ids" if kind == "seq2seq_lm" else "input_ids"
    if field not in batch.fields or (feed.by_keyword and field not in feed.keywords):
        return
    if not feed.by_keyword and field != batch.primary:
        return
    ids = batch[field]
    if ids.ndim != 2 or ids.shape[1] < 2:
        return
    last = ids.shape[1] - 1
    if "attention_mask" in batch.fields and field == "input_ids":
        real = int(batch["attention_mask"][0].sum())
        last = max(1, real - 1)
    changed = batch.clone()
    changed.fields[field][0, last] = (ids[0, last] + 1) % max(2, int(ids.max()) + 2)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            a = output_tensor(feed.call(model, batch))
            b = output_tensor(feed.call(model, changed))
    except Exception:
        return  # check_data_fits reports a model that fails on the data
    finally:
        model.train(was_training)
    if a.ndim < 3 or a.shape[1] <= last:
        return
    causal = torch.allclose(a[0, :last], b[0, :last], rtol=1e-4, atol=1e-5)
    if kind == "masked_lm":
        if causal:
            raise ObjectiveError(
                f"loss.kind = 'masked_lm' predicts each masked token from the tokens on both "
                f"sides, but {type(model).__name__} is causal: no output before position "
                f"{last} changes when the token at position {last} changes, so it never sees "
                "the right-hand context; train it with loss.kind = 'causal_lm', or use a "
                "bidirectional encoder (e.g. BERT)")
        return
    if not causal:
        moved = int((a[0, :last] - b[0, :last]).abs().amax(dim=-1).argmax())
        name = type(model).__name__
        if kind == "causal_lm":
            raise ObjectiveError(
                f"loss.kind = 'causal_lm' predicts each next token, but {name} is not causal: "
                f"its output at position {moved} changes when the token at position {last} "
                "changes, so it sees the token it must predict (a bidirectional encoder such "
                "as BERT); train it with loss.kind = 'masked_lm', or use a causal (decoder) "
                "model")
        raise ObjectiveError(
            f"loss.kind = 'seq2seq_lm' predicts each next target token, but {name}'s decoder "
            f"output at position {moved} changes when decoder input {last} changes: its "
            "decoder sees the future targets; use a causal decoder")


def check_finite(state: Mapping[str, torch.Tensor], where: str) -> None:
    """`LocalError` naming the first floating tensor of `state` that holds NaN or Inf (a
    diverged run's weights train to NaN at once, and a scheduler must never run them)."""
    for name, t in state.items():
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            count, nans = int(bad.sum()), int(torch.isnan(t).sum())
            raise LocalError(f"{where}: tensor {name!r} holds {count} non-finite values of "
                             f"{t.numel()} ({nans} NaN, {count - nans} Inf): a checkpoint of a "
                             "diverged run? Resume from an earlier one")


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
    check_finite({k: state[k] for k in loaded if k in state}, str(p))
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
    return data_is_default_corpus(spec.data)


def corpus_for_upload(spec: JobSpec) -> tuple[str, bytes]:
    """(content hash, data as safetensors bytes) of a job's data, read here (fusionctl on the
    submitting machine, with the user's permissions): a token stream, rows or images
    (`fusiond.train.data.load_arrays`); the bytes are empty for the default corpus (every
    stage has one of its own and checks its hash). ("", b"") for synthetic images."""
    if spec.data.kind == "images":
        return "", b""
    arrays = compact_arrays(load_arrays(spec.data))
    digest = dataset_digest(arrays)
    if is_default_corpus(spec):
        return digest, b""
    return digest, state_to_bytes({k: torch.from_numpy(v) for k, v in arrays.items()})


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
