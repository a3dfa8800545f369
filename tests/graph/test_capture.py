"""Capture: names, dynamic dims, the registry, clear errors, weights without pickle."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fusiond.graph import (
    CaptureError,
    UnsupportedOpError,
    build_program,
    capture,
    state_from_bytes,
    state_to_bytes,
    state_to_parts,
    state_views,
)
from fusiond.graph.registry import is_supported, resolve
from protocol import ir
from tests.graph.models import case
from tests.graph.test_ir import small_graph


def test_gpt2_capture_names_dims_and_ops() -> None:
    c = case("gpt2")
    g = c.captured.graph
    assert g.symbols == {"batch": 2, "seq": 8}
    assert g.symbol_ranges["seq"] == (1, 64)
    assert [i.name for i in g.inputs] == ["input", "targets"]
    assert g.inputs[0].meta == ir.TensorMeta(("batch", "seq"), "int64")
    assert g.aliases == {"transformer.wte.weight": "lm_head.weight"}
    assert all(is_supported(n.op) for n in g.nodes)
    lin = [n for n in g.nodes if n.op == "aten.linear.default"]
    assert any(n.module_path == "transformer.h.0.attn.c_attn" for n in lin)
    assert "transformer.h.0.attn.c_attn.weight" in lin[0].params or any(
        "c_attn.weight" in p for n in lin for p in n.params
    )
    out = g.meta_of(g.outputs[0].ref)
    assert out == ir.TensorMeta((), "float32")
    # Every parameter of the model is in the state under its own (or its tied) name.
    names = {n for n, _ in c.model.named_parameters(remove_duplicate=False)}
    assert names == set(g.param_map) | set(g.aliases)


def test_state_round_trips_through_safetensors() -> None:
    c = case("resnet18").captured
    back = state_from_bytes(state_to_bytes(c.state))
    assert back.keys() == c.state.keys()
    assert all(torch.equal(back[k], v) for k, v in c.state.items())
    # a snapshot's private copies go out as buffers of their own bytes, in the same layout
    snap = {k: v.detach().clone() for k, v in c.state.items()}
    parts = state_to_parts(snap)
    assert any(isinstance(p, memoryview) for p in parts)
    back = state_from_bytes(b"".join(parts))
    assert back.keys() == c.state.keys()
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in c.state.items())


def test_state_parts_hold_every_dtype_and_shape_safetensors_reads() -> None:
    """Every dtype a state may hold, 0-d and empty tensors and a non-contiguous view: joined,
    the parts are what safetensors itself loads."""
    import safetensors.torch

    state = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(4).to(torch.bfloat16),
        "f16": torch.randn(2, 2).half(), "f64": torch.randn(3).double(),
        "i64": torch.tensor(7), "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i8": torch.tensor([-3, 4], dtype=torch.int8), "u8": torch.tensor([255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4),
        "view": torch.randn(4, 6).t(),
    }
    blob = b"".join(state_to_parts(state))
    for back in (state_from_bytes(blob), safetensors.torch.load(blob), state_views(blob),
                 state_views(bytearray(blob)), state_views(safetensors.torch.save(
                     {k: v.contiguous() for k, v in state.items()}))):
        assert back.keys() == state.keys()
        for k, v in state.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape
            assert torch.equal(back[k], v), k


def test_state_views_share_the_bytes_they_read() -> None:
    """An Assign's weights decode as views of its payload: no copy until the module's own."""
    state = {"w": torch.randn(64, 32), "b": torch.randn(32)}
    buf = bytearray(b"".join(state_to_parts(state)))
    views = state_views(buf)
    assert all(torch.equal(views[k], v) for k, v in state.items())
    addr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert all(addr <= t.data_ptr() < addr + len(buf) for t in views.values())


def _st(entry: object, data: int) -> bytes:
    """A safetensors blob of one entry `a` (as given) and `data` zero bytes."""
    raw = json.dumps({"a": entry}).encode()
    return len(raw).to_bytes(8, "little") + raw + b"\0" * data


@pytest.mark.parametrize(("blob", "why"), [
    (b"\x01", "no header length"),
    ((10**9).to_bytes(8, "little") + b"{}", "does not fit"),
    (b"\x03\x00\x00\x00\x00\x00\x00\x00[1]", "not a JSON object"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{x", "not JSON"),
    (_st({"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}, 4), "is not one of"),
    (_st({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, 4), "do not hold"),
    (_st({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, 4), "non-negative"),
    (_st({"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}, 4), "non-negative"),
    (_st({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, 8), "gap or an overlap"),
    (_st({"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, 8), "no entry holds"),
    (_st([1], 0), "not an object"),
])
def test_state_views_refuse_a_bad_header_by_name(blob: bytes, why: str) -> None:
    with pytest.raises(CaptureError, match=why):
        state_views(blob)


_ENTRY = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "X", 3]),
    "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), st.just("3")),
    "data_offsets": st.lists(st.integers(-4, 40), min_size=0, max_size=3),
})


@given(st.one_of(st.binary(max_size=64),
                 st.builds(lambda h, n: (lambda raw: len(raw).to_bytes(8, "little") + raw
                                         + b"\1" * n)(json.dumps(h).encode()),
                           st.dictionaries(st.text(max_size=3), _ENTRY, max_size=3),
                           st.integers(0, 48))))
def test_state_views_of_any_bytes_load_whole_or_raise_capture_error(blob: bytes) -> None:
    """Whatever the bytes, a state whose tensors hold exactly the data, or CaptureError."""
    with contextlib.suppress(CaptureError):
        views = state_views(blob)
        n = int.from_bytes(blob[:8], "little")
        assert sum(t.numel() * t.element_size() for t in views.values()) == len(blob) - 8 - n


def test_hand_built_graph_runs() -> None:
    g = small_graph()
    state = {
        "lin.weight": torch.randn(3, 4),
        "lin.bias": torch.randn(3),
        "bn.count": torch.tensor(5),
    }
    prog = build_program(g, state)
    x = torch.randn(6, 4)
    (loss,) = prog(x)
    y = torch.nn.functional.linear(x, state["lin.weight"], state["lin.bias"])[:, 1:]
    want = torch.nn.functional.gelu(y, approximate="tanh").sum()
    torch.testing.assert_close(loss, want)
    assert int(prog.get_buffer("bn.count")) == 6  # the buffer update ran


@torch.library.custom_op("fusiontest::double", mutates_args=())
def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.odd = OddBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.odd(self.body(x))
        return out


class OddBlock(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.fusiontest.double(x)  # type: ignore[no-any-return]


def test_op_outside_registry_names_op_and_module() -> None:
    with pytest.raises(UnsupportedOpError, match=r"fusiontest\.double\.default.*'odd'"):
        capture(WithCustomOp(), (torch.randn(2, 4),))
    with pytest.raises(UnsupportedOpError, match=r"aten\.fill_"):
        resolve("aten.fill_.Scalar")  # mutating ops are never runnable from an IR


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:  # Python control flow on a tensor value: not exportable
            return y * 2
        return y


def test_non_exportable_module_is_a_clear_error() -> None:
    with pytest.raises(CaptureError, match=r"cannot export DataDependent.*") as ei:
        capture(DataDependent(), (torch.randn(2, 4),))
    msg = str(ei.value)
    assert "data-dependent" in msg.lower() or "guard" in msg.lower()
    assert "test_capture.py:" in msg and "if y.sum() > 0:" in msg  # names the construct


def test_bad_dynamic_spec_is_refused() -> None:
    with pytest.raises(CaptureError, match="dynamic has 1 entries for 2 inputs"):
        capture(
            nn.Linear(4, 2),
            (torch.randn(2, 4),),
            targets=torch.randn(2, 2),
            loss=nn.functional.mse_loss,
            dynamic=[{0: "batch"}],
        )


class ReturnsLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.lin(x), y)


def test_model_that_returns_its_loss() -> None:
    m = ReturnsLoss()
    c = capture(m, (torch.randn(3, 4), torch.randn(3, 2)))
    assert [i.name for i in c.graph.inputs] == ["input0", "input1"]
    assert c.graph.inputs[1].meta.shape == ("batch", 2)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    (loss,) = build_program(c.graph, c.state)(x, y)
    torch.testing.assert_close(loss, m(x, y))
