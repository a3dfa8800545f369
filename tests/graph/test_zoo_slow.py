"""The real zoo sizes: GPT-2 small and ResNet-50, captured and run in 4 partitions (slow)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from fusiond.graph import Driver, capture, contiguous_assignment, interleaved_assignment
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.models.resnet import classification_loss, resnet50
from tests.graph.models import assert_close_rel

pytestmark = pytest.mark.slow


def _check(
    model: torch.nn.Module,
    cap_args: Mapping[str, Any],
    batch: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., torch.Tensor],
) -> None:
    c = capture(model, **cap_args)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    g = c.graph
    for asg in (contiguous_assignment(g, 4, by="params"), interleaved_assignment(g, 4)):
        d = Driver(g, asg, c.state)
        assert_close_rel(d.forward_backward(list(batch))["loss"], loss.detach(), "loss")
        got = d.named_grads()
        for n, p in model.named_parameters():
            assert p.grad is not None
            assert_close_rel(got[n], p.grad, n)


def test_gpt2_small() -> None:
    torch.manual_seed(0)
    m = gpt2("small")
    m.train()
    v = m.config.vocab_size
    x, y = torch.randint(0, v, (2, 16)), torch.randint(0, v, (2, 16))
    _check(
        m,
        {
            "example_inputs": (x,),
            "targets": y,
            "loss": lm_loss,
            "dynamic": [{0: "batch", 1: "seq"}] * 2,
            "dim_max": {"seq": 1024},
        },
        (torch.randint(0, v, (3, 24)), torch.randint(0, v, (3, 24))),
        lm_loss,
    )


def test_resnet50() -> None:
    torch.manual_seed(0)
    m = resnet50(num_classes=10, width=8)
    m.train()
    _check(
        m,
        {
            "example_inputs": (torch.randn(2, 3, 64, 64),),
            "targets": torch.randint(0, 10, (2,)),
            "loss": classification_loss,
        },
        (torch.randn(3, 3, 64, 64), torch.randint(0, 10, (3,))),
        classification_loss,
    )
