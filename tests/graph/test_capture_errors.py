"""Refusals say what, where and what to do (issue 20): the construct, the module path (inside
library code too) and the line, and nothing of torch's own output reaches the terminal."""

from __future__ import annotations

import importlib
import os
from typing import Any

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


class _NativeNoise(nn.Module):
    """Writes to file descriptor 2 under Python's sys.stderr, as torch's C++ does, then raises
    in export (a data-dependent branch) or not."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        os.write(2, b"native noise on fd 2\n")
        h: torch.Tensor = self.lin(x)
        if self.fail and h.sum() > 0:
            return h * 2
        return h


class _Act(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.Hardswish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.act(self.lin(x))  # the line the lowering fails on
        return out


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
    assert "That line is library code: call the library so it takes another path" in msg
    assert "docs/ir.md" in msg  # what to do, where no specific hint applies


def test_what_native_code_writes_to_fd_2_stays_off_the_terminal(
        capfd: pytest.CaptureFixture[str]) -> None:
    """quiet_export redirects file descriptor 2 itself, not only sys.stderr: what C++ writes
    there is dropped when export fails, and written out after it succeeds."""
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError, match=r"torch\.where"):
        capture(_NativeNoise(fail=True), [x], targets=x, loss=_loss)
    out, err = capfd.readouterr()
    assert err == "" and out == ""
    capture(_NativeNoise(fail=False), [x], targets=x, loss=_loss)
    assert "native noise on fd 2" in capfd.readouterr().err
    os.write(2, b"after\n")  # fd 2 is restored
    assert capfd.readouterr().err == "after\n"


def test_a_lowering_failure_names_the_module_the_line_and_the_op(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """A failure in torch's lowering (run_decompositions) names the exported node's module,
    line and op, like an export failure, and says what to do."""
    mod = importlib.import_module("fusiond.graph.capture")
    default = mod._default_decompositions

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("decomposition broke")

    def table() -> Any:
        t = default()
        t[torch.ops.aten.hardswish.default] = broken
        return t

    monkeypatch.setattr(mod, "_default_decompositions", table)
    x = torch.randn(2, 4)
    with pytest.raises(CaptureError) as ei:
        capture(_Act(), [x], targets=x, loss=_loss)
    msg = str(ei.value)
    assert msg.startswith("lowering _Act to core ATen failed (in module 'act')")
    assert "test_capture_errors.py" in msg and "self.act(self.lin(x))" in msg
    assert "RuntimeError: decomposition broke" in msg
    assert "aten.hardswish.default failed: rewrite that line with other ops" in msg
    assert "While executing" not in msg and "tlparse" not in msg  # torch's debugging text
    assert capfd.readouterr().err == ""


def test_an_uninitialised_lazy_module_is_refused_naming_it() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU())
    x = torch.randn(2, 3)
    with pytest.raises(CaptureError, match=r"lazy module '0' \(LazyLinear\) creates its "
                                           r"parameters on the first forward.*run the model "
                                           r"once on a batch, then capture it"):
        capture(model, [x], targets=x, loss=_loss)
    model(x)  # materialised: it is a Linear now
    capture(model, [x], targets=x, loss=_loss)


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
