"""Optimizers and learning-rate schedules built from an `OptimizerSpec`.

Every partition builds its optimizer over its own parameters with the same spec. AdamW and SGD
update each parameter independently of the others, so a partitioned model steps exactly like the
whole model as long as every parameter sees the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from fusiond.train.spec import OptimizerSpec

__all__ = ["lr_at", "make_optimizer", "set_lr"]


def lr_at(spec: OptimizerSpec, step: int, total_steps: int) -> float:
    """The learning rate of `step` (0-based): linear warm-up, then constant or cosine decay."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    if spec.schedule == "constant":
        return spec.lr
    span = max(1, total_steps - spec.warmup_steps)
    progress = min(1.0, (step - spec.warmup_steps) / span)
    return spec.min_lr + 0.5 * (spec.lr - spec.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(
    spec: OptimizerSpec, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer named by `spec` over `params` (foreach off: identical math everywhere)."""
    plist = list(params)
    if spec.kind == "adamw":
        return torch.optim.AdamW(
            plist, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
            foreach=False,
        )
    return torch.optim.SGD(
        plist, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay, foreach=False
    )


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in opt.param_groups:
        group["lr"] = lr
