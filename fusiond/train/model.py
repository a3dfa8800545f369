"""Build the model and loss a job spec names (on the submitting machine only).

`build_model` imports `module:function` and calls it with `[model.config]`: user code runs here,
where the job is submitted, and nowhere else (the cluster receives the captured IR).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fusiond.train.spec import JobSpecError, LossSpec, ModelSpec

__all__ = ["LossFn", "WithLoss", "build_model", "loss_fn"]

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


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


def _logits(out: Any) -> torch.Tensor:
    # Hugging Face models return a ModelOutput with `.logits`; ours return the tensor.
    t = out.logits if hasattr(out, "logits") else out
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"model output is {type(out).__name__}, not a tensor or .logits")
    return t


def _lm_ce(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = _logits(out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _ce(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(out), targets)


def _mse(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(_logits(out), targets)


def loss_fn(spec: LossSpec) -> LossFn:
    """The loss function `(model output, targets) -> scalar mean loss`."""
    return {"lm_cross_entropy": _lm_ce, "cross_entropy": _ce, "mse": _mse}[spec.kind]


class WithLoss(nn.Module):
    """`forward(inputs, targets) -> loss`: the model and its loss as one module (eager reference).

    `self.model.state_dict()` is the bare model's state dict (what a job's result holds).
    """

    def __init__(self, model: nn.Module, loss: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.loss(self.model(inputs), targets)
        return out
