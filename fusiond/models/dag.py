"""A small model whose graph is not a chain, for partition tests.

The stem's output fans out to three branches and to a long residual that skips all of them;
branch `c` reads branch `a`; a boolean mask computed from the input (no gradient) is used
near the end; the head concatenates everything. Cut anywhere, values cross several cuts and
reach several partitions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FanOutNet(nn.Module):
    """(B, d_in) -> logits (B, n_classes) through a fan-out / fan-in DAG."""

    def __init__(self, d_in: int = 16, d: int = 32, n_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(d_in, d)
        self.a = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.b = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.c = nn.Linear(d, d)
        self.norm = nn.LayerNorm(3 * d)
        self.mix = nn.Linear(3 * d, d)
        self.head = nn.Linear(d, n_classes)
        self.gate = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[:, :1] > 0  # (B, 1) bool: an edge that carries no gradient
        h = F.relu(self.stem(x))
        a = self.a(h)
        b = self.b(h)
        c = self.c(h + a) * torch.sigmoid(self.gate)
        z = self.mix(self.norm(torch.cat([a, b, c], dim=-1)))
        z = torch.where(mask, z, 0.5 * z) + h  # the long residual from the stem
        out: torch.Tensor = self.head(F.relu(z) + a)
        return out
