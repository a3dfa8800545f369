"""Shared captures for the graph tests: each model captured once per test session."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fusiond.graph import CapturedModel, capture
from fusiond.models.dag import FanOutNet
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.models.resnet import classification_loss, resnet18


@dataclass
class Case:
    """A model, its capture, its loss, and a batch of a different size than the capture's."""

    model: nn.Module
    captured: CapturedModel
    loss: Callable[..., torch.Tensor]
    batch: tuple[torch.Tensor, ...]  # inputs..., targets

    def eager(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss and gradients (by name, tied names included) of the eager model on `batch`."""
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(self.model(*self.batch[:-1]), self.batch[-1])
        loss.backward()
        grads = {
            n: p.grad.clone()
            for n, p in self.model.named_parameters(remove_duplicate=False)
            if p.grad is not None
        }
        self.model.zero_grad(set_to_none=True)
        return loss.detach(), grads


@functools.cache
def case(name: str) -> Case:
    torch.manual_seed(1234)
    if name == "gpt2":
        m: nn.Module = gpt2("tiny")
        x = torch.randint(0, 256, (2, 8))
        c = capture(
            m,
            (x,),
            targets=torch.randint(0, 256, (2, 8)),
            loss=lm_loss,
            dynamic=[{0: "batch", 1: "seq"}] * 2,
            dim_max={"seq": 64},
        )
        batch = (torch.randint(0, 256, (3, 12)), torch.randint(0, 256, (3, 12)))
        return Case(m, c, lm_loss, batch)
    if name == "hf_gpt2":
        import pytest

        pytest.importorskip("transformers")  # an optional dependency
        from fusiond.models.hf import hf_gpt2, hf_lm_loss, hf_small_config

        m = hf_gpt2(**hf_small_config())
        m.train()
        x = torch.randint(0, 128, (2, 8))
        c = capture(
            m,
            (x,),
            targets=torch.randint(0, 128, (2, 8)),
            loss=hf_lm_loss,
            dynamic=[{0: "batch", 1: "seq"}] * 2,
            dim_max={"seq": 64},
        )
        batch = (torch.randint(0, 128, (3, 10)), torch.randint(0, 128, (3, 10)))
        return Case(m, c, hf_lm_loss, batch)
    if name == "resnet18":
        m = resnet18(num_classes=10, width=8)
        m.train()
        c = capture(
            m,
            (torch.randn(2, 3, 32, 32),),
            targets=torch.randint(0, 10, (2,)),
            loss=classification_loss,
        )
        # Batch statistics depend on the batch: the captured state must be the pre-forward one.
        batch = (torch.randn(3, 3, 32, 32), torch.randint(0, 10, (3,)))
        return Case(m, c, classification_loss, batch)
    if name == "fanout":
        m = FanOutNet()
        c = capture(
            m, (torch.randn(4, 16),), targets=torch.randint(0, 5, (4,)), loss=classification_loss
        )
        batch = (torch.randn(5, 16), torch.randint(0, 5, (5,)))
        return Case(m, c, classification_loss, batch)
    raise KeyError(name)


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """|got - want| <= rel * max(|want|) elementwise (relative to the tensor's scale)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= rel * max(scale, 1e-12), f"{what}: max error {err:.3g} vs scale {scale:.3g}"
