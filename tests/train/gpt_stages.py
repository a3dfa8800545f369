"""GPT-2 tiny cut by hand into pipeline stages, independent of graph capture.

Lets the stage executor be tested against eager training on its own. The tied embedding / LM-head
weight is held by the first and the last stage under one name, `tied`, as a captured graph
names a tied parameter once.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from fusiond.models.gpt2 import GPT
from fusiond.train.codec import EdgeEncoding
from fusiond.train.stage import EdgeSpec, StageProgram


class _First(nn.Module):
    def __init__(self, g: GPT, blocks: list[int]) -> None:
        super().__init__()
        self.tied = nn.Parameter(g.transformer.wte.weight.detach().clone())
        self.wpe = copy.deepcopy(g.transformer.wpe)
        self.h = nn.ModuleList(copy.deepcopy(g.transformer.h[i]) for i in blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1))
        x = F.embedding(idx, self.tied) + self.wpe(pos)
        for b in self.h:
            x = b(x)
        return x


class _Middle(nn.Module):
    def __init__(self, g: GPT, blocks: list[int]) -> None:
        super().__init__()
        self.h = nn.ModuleList(copy.deepcopy(g.transformer.h[i]) for i in blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        return x


class _Last(nn.Module):
    def __init__(self, g: GPT, blocks: list[int]) -> None:
        super().__init__()
        self.tied = nn.Parameter(g.lm_head.weight.detach().clone())
        self.h = nn.ModuleList(copy.deepcopy(g.transformer.h[i]) for i in blocks)
        self.ln_f = copy.deepcopy(g.transformer.ln_f)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.tied)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def three_stages(g: GPT, density: float | None = None, *, first_blocks: int = 1,
                 last_blocks: int = 0, encoding: EdgeEncoding = "raw") -> list[StageProgram]:
    """Stage 0: embeddings + the first `first_blocks` blocks; stage 1: the blocks between;
    stage 2: the last `last_blocks` blocks, ln_f, LM head and the loss. Both cut edges at
    `density` (top-k) or travelling as `encoding`."""
    n = g.config.n_layer
    cut = n - last_blocks
    first = _First(g, list(range(first_blocks)))
    mid = _Middle(g, list(range(first_blocks, cut)))
    last = _Last(g, list(range(cut, n)))
    e01 = EdgeSpec("h0", 0, 1, density, encoding=encoding)
    e12 = EdgeSpec("h1", 1, 2, density, encoding=encoding)

    def run0(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h0": first(i["inputs"])}

    def run1(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"h1": mid(i["h0"])}

    def run2(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": last(i["h1"], i["targets"])}

    return [
        StageProgram(first, run0, (), (e01,), ("inputs",), False, {"tied": (2,)}),
        StageProgram(mid, run1, (e01,), (e12,)),
        StageProgram(last, run2, (e12,), (), ("targets",), True, {"tied": (0,)}),
    ]


def one_stage(g: GPT) -> StageProgram:
    """The whole model (a copy of `g`'s weights) as one stage: data in, loss out."""
    model = copy.deepcopy(g)

    def run(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logits = model(i["inputs"])
        targets = i["targets"]
        return {"loss": F.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                        targets.reshape(-1))}

    return StageProgram(model, run, (), (), ("inputs", "targets"), True)


def merged_state(programs: list[StageProgram]) -> dict[str, torch.Tensor]:
    """The stages' parameters under the eager GPT's names (for comparing final weights)."""
    first, mid, last = (p.module for p in programs)
    out: dict[str, torch.Tensor] = {}
    out["transformer.wte.weight"] = first.tied.detach()
    out["lm_head.weight"] = last.tied.detach()
    out["transformer.wpe.weight"] = first.wpe.weight.detach()
    nfirst = len(first.h)
    for i, b in enumerate(first.h):
        for k, v in b.state_dict().items():
            out[f"transformer.h.{i}.{k}"] = v
    for i, b in enumerate(mid.h):
        for k, v in b.state_dict().items():
            out[f"transformer.h.{nfirst + i}.{k}"] = v
    for i, b in enumerate(last.h):
        for k, v in b.state_dict().items():
            out[f"transformer.h.{nfirst + len(mid.h) + i}.{k}"] = v
    for k, v in last.ln_f.state_dict().items():
        out[f"transformer.ln_f.{k}"] = v
    return out
