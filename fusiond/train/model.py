"""Build the model and its objective a job spec names (on the submitting machine only).

`build_model` imports `module:function` and calls it with `[model.config]`: user code runs here,
where the job is submitted, and nowhere else (the cluster receives the captured IR).

`resolve_feed` decides how a batch's named tensors reach the model: by keyword, every field
its `forward` names (`input_ids`, `attention_mask`, `token_type_ids`, `decoder_input_ids`,
`pixel_values`, ...; or the fields `[model] inputs` lists), so a Hugging Face model needs no
adapter and its weights keep their own names; or, for a model whose forward names none of
them (`forward(x)`), the main input by position. `labels` never reach the model: the
objective (`loss_fn`) compares them with its output.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusiond.train.spec import JobSpecError, LossSpec, ModelSpec

__all__ = ["Feed", "LossFn", "WithLoss", "build_model", "loss_fn", "output_tensor",
           "resolve_feed"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]

POSITIONAL_NAMES = ("input", "targets")
"""Graph input names of a model fed by position: its input, then the labels."""


def build_model(spec: ModelSpec, *, seed: int | None = None) -> nn.Module:
    """Import and call the model factory; a failure is a `JobSpecError` naming the field.

    With `seed`, `torch.manual_seed(seed)` runs first so the initial weights are reproducible.
    """
    where = "model.zoo" if spec.zoo is not None else "model.factory"
    mod_name, _, fn_name = spec.target.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise JobSpecError(where, f"cannot import {mod_name!r}: {e}") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise JobSpecError(where, f"{mod_name!r} has no callable {fn_name!r}")
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = fn(**spec.config)
    except Exception as e:
        raise JobSpecError("model.config", f"{spec.target}(**config) failed: {e!r}") from e
    if not isinstance(model, nn.Module):
        raise JobSpecError(where, f"{spec.target} returned {type(model).__name__}, not nn.Module")
    return model


@dataclass(frozen=True)
class Feed:
    """How a batch reaches the model: `keywords` (field names, passed by keyword, the main
    input first) or, when empty, `primary` by position. `target` names the labels field."""

    keywords: tuple[str, ...]
    primary: str
    target: str = "labels"

    @property
    def by_keyword(self) -> bool:
        return bool(self.keywords)

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """The captured graph's input names: the keywords then `labels`, or `input`,
        `targets` for a model fed by position."""
        if self.keywords:
            return (*self.keywords, self.target)
        return POSITIONAL_NAMES

    def example(self, batch: Any) -> Sequence[torch.Tensor] | dict[str, torch.Tensor]:
        """What `fusiond.graph.capture` takes as the model's example inputs."""
        if self.keywords:
            return {k: batch[k] for k in self.keywords}
        return [batch[self.primary]]

    def call(self, model: nn.Module, batch: Any) -> Any:
        """`model`'s output on `batch` (a `fusiond.train.data.Batch` or a mapping)."""
        if self.keywords:
            return model(**{k: batch[k] for k in self.keywords})
        return model(batch[self.primary])


def _forward_params(model: nn.Module) -> tuple[set[str], bool]:
    """The parameter names of `model.forward`, and whether it takes `*args` positionally."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # pragma: no cover - a builtin forward
        return set(), True
    named = {n for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())


def resolve_feed(model: nn.Module, fields: Sequence[str], primary: str, *, target: str = "labels",
                 explicit: Sequence[str] | None = None, objective: str = "") -> Feed:
    """The `Feed` of `model` for a batch with `fields` (main input `primary`).

    `explicit` (`[model] inputs`): exactly those fields by keyword. Otherwise every field
    but the labels that `model.forward` names as a parameter goes by keyword (the main input
    first), or, when it names none, the main input by position. `JobSpecError` when a field
    the job needs cannot reach the model (a seq2seq job whose model takes no
    `decoder_input_ids`), or `explicit` names a field the data has not."""
    available = [f for f in fields if f != target]
    if explicit is not None:
        missing = [f for f in explicit if f not in available]
        if missing:
            raise JobSpecError("model.inputs", f"the data gives no {missing[0]!r}; its fields "
                               f"are {available}")
        keys = [primary, *(f for f in explicit if f != primary)] if primary in explicit \
            else list(explicit)
        return Feed(tuple(keys), primary, target)
    named, _ = _forward_params(model)
    keys = [f for f in available if f in named]
    if primary in keys:
        keys = [primary, *(k for k in keys if k != primary)]
    name = type(model).__name__
    if "decoder_input_ids" in named and "decoder_input_ids" not in keys:
        raise JobSpecError(
            "loss.kind", f"{name} is an encoder-decoder (its forward takes decoder_input_ids) "
            f"and loss.kind = {objective!r} gives its decoder no inputs: train it with "
            "loss.kind = 'seq2seq_lm' and a data.target_column (the data path then makes the "
            "decoder's inputs from the targets)")
    if objective == "seq2seq_lm" and "decoder_input_ids" not in keys:
        raise JobSpecError(
            "loss.kind", f"'seq2seq_lm' feeds the decoder its shifted targets "
            f"(decoder_input_ids), and {name}.forward takes no such argument: use an "
            "encoder-decoder model (e.g. transformers' T5ForConditionalGeneration) or list the "
            "model's inputs in model.inputs")
    if keys and primary not in keys:
        raise JobSpecError("model.inputs", f"{name}.forward takes {keys} by name but not the "
                           f"data's main input {primary!r}; list the inputs in model.inputs")
    return Feed(tuple(keys), primary, target)


def output_tensor(out: Any) -> torch.Tensor:
    """The prediction in a model's output: a tensor, a Hugging Face output's `.logits`, or the
    first element of a tuple."""
    t = out.logits if hasattr(out, "logits") else out
    if isinstance(t, (tuple, list)) and t and isinstance(t[0], torch.Tensor):
        t = t[0]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"model output is {type(out).__name__}, not a tensor, a tuple or an "
                        "output with .logits")
    return t


def _cross_entropy(ignore_index: int) -> LossFn:
    def ce(out: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = output_tensor(out)
        if logits.ndim > 2 and tuple(logits.shape[:-1]) == tuple(labels.shape):
            # per position (B, T, V) against (B, T): language models, token classification
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index)
    return ce


def _mse(out: Any, labels: torch.Tensor) -> torch.Tensor:
    pred = output_tensor(out)
    if pred.shape != labels.shape and pred.numel() == labels.numel():
        pred = pred.reshape(labels.shape)  # (B, 1) against (B,)
    return F.mse_loss(pred, labels)


def loss_fn(spec: LossSpec) -> LossFn:
    """The objective `(model output, labels) -> scalar mean loss`: cross-entropy over the last
    axis for every LM objective and classification (positions labelled `ignore_index` count for
    nothing), mean squared error for regression."""
    if spec.kind == "regression":
        return _mse
    return _cross_entropy(spec.ignore_index)


class WithLoss(nn.Module):
    """`forward(inputs, targets) -> loss`: the model and its loss as one module (eager reference).

    `on(batch)` is the same for a named batch through its `feed`.
    `self.model.state_dict()` is the bare model's state dict (what a job's result holds).
    """

    def __init__(self, model: nn.Module, loss: LossFn, feed: Feed | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss = loss
        self.feed = feed

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.loss(self.model(inputs), targets)
        return out

    def on(self, batch: Any) -> torch.Tensor:
        """The loss of `batch` (a `fusiond.train.data.Batch`)."""
        if self.feed is None:
            loss: torch.Tensor = self(batch["inputs"], batch["targets"])
            return loss
        out: torch.Tensor = self.loss(self.feed.call(self.model, batch), batch["targets"])
        return out


def feed_for(model: nn.Module, batch: Any, spec: Any) -> Feed:
    """`resolve_feed` for a job spec and one of its batches."""
    fields: Mapping[str, Any] = batch.fields
    return resolve_feed(model, list(fields), batch.primary, target=batch.target,
                        explicit=spec.model.inputs, objective=spec.loss.kind)
