"""Refusals say what, where and what to do (issue 20): the construct, the module path (inside
library code too) and the line, and nothing of torch's own output reaches the terminal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusiond.graph import CaptureError, UnsupportedOpError, capture


def _loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (out.float() * 0).sum() + t.float().sum() * 0 + out.float().mean()


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.emb(x))[0]


class _Branchy(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # data-dependent: one graph cannot hold both branches
            return h * 2
        return h


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = _Branchy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.lin(x))


class _OwnForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(10, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.w, max_norm=1.0)  # renormalises the weight in forward


def test_a_recurrent_layer_over_a_dynamic_length_names_the_layer(
        capfd: pytest.CaptureFixture[str]) -> None:
    x = torch.randint(0, 50, (2, 6))
    with pytest.raises(CaptureError) as ei:
        capture(_Recurrent(), [x], targets=x, loss=_loss,
                dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
    msg = str(ei.value)
    assert "_Recurrent" in msg and "'rnn' (LSTM)" in msg
    assert "static sequence length" in msg
    assert "TORCH_LOGS" not in msg and "draft_export" not in msg  # torch's debugging advice
    out, err = capfd.readouterr()
    assert err == "" and out == ""  # no partial graph, no warnings on the terminal


def test_a_failure_inside_a_submodule_names_its_path_and_line(
        capfd: pytest.CaptureFixture[str]) -> None:
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError) as ei:
        capture(_Outer(), [x], targets=x, loss=_loss)
    msg = str(ei.value)
    assert "(in module 'block')" in msg
    assert "test_capture_errors.py" in msg and "if h.sum() > 0" in msg
    assert "torch.where" in msg  # what to do
    assert capfd.readouterr().err == ""  # torch.export prints its partial graph otherwise


def test_an_error_inside_library_code_keeps_its_location() -> None:
    """A bare T5 given no decoder inputs raises inside transformers: the message names the
    module that raised and the library line (capture used to skip site-packages frames)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                num_heads=4, use_cache=False)
    model = transformers.T5ForConditionalGeneration(cfg)
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(CaptureError) as ei:
        capture(model, {"input_ids": ids}, targets=ids, loss=_loss, targets_name="labels")
    msg = str(ei.value)
    assert "(in module 'decoder')" in msg
    assert "transformers/models/t5/modeling_t5.py:" in msg


def test_an_unsupported_op_in_the_models_own_forward_names_it_and_the_line(
        capfd: pytest.CaptureFixture[str]) -> None:
    x = torch.randint(0, 10, (2, 3))
    with pytest.raises(UnsupportedOpError) as ei:
        capture(_OwnForward(), [x], targets=x, loss=_loss)
    msg = str(ei.value)
    assert "aten.embedding_renorm" in msg
    assert "_OwnForward (the model's own forward)" in msg
    assert "test_capture_errors.py" in msg and "F.embedding(x, self.w, max_norm=1.0)" in msg
    assert "docs/ir.md" in msg
    assert capfd.readouterr().err == ""
