"""The registry covers what torch.export emits for the modules of torch.nn (issue 20).

`test_registry_covers_torch_nn` walks samples of torch.nn's modules (and the functional
forms models call: `F.normalize`, `Tensor.norm`, `torch.var_mean`, `torch.polar`) with small
inputs, in training mode (and in eval mode where it differs), through fusion's own capture
path (torch.export, then `run_decompositions` as `capture` lowers it). Every op the lowered
graph calls must be in the registry, except the ops in `NOT_YET`, each with the reason it is
not there yet. The test fails on a gap not in `NOT_YET`, and on an entry of `NOT_YET` that is
supported now or that the walk no longer meets, so the list only shrinks. The samples torch
itself cannot capture are in `NOT_CAPTURED` (why), and the walk asserts they still fail.

`test_walk_samples_every_torch_nn_module` (fast, no capture) keeps the walk exhaustive: every
public `nn.Module` class of torch.nn is built by some sample or listed in `NOT_WALKED` with the
reason, so a module a new torch adds fails it until it is sampled or listed.

Each deterministic capture is also run as a `GraphProgram` on the registry and compared with
eager PyTorch: the same loss and the same gradients (parameters and inputs) to 1e-6.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusiond.graph import (
    CapturedModel,
    CaptureError,
    UnsupportedOpError,
    build_program,
    capture,
    state_from_bytes,
)
from fusiond.graph.capture import _DROPPED_CHECKS, export_program
from fusiond.graph.registry import EXTRA_OPS, is_supported, op_name, sym_op_name
from protocol import ir

NOT_YET: dict[str, str] = {
    "aten.embedding_renorm.default": (
        "Embedding/EmbeddingBag(max_norm=...) renormalises the weight in place in forward: a "
        "parameter mutation inside the step, which the IR does not express (capture refuses "
        "mutated parameters) and which would race with the optimizer across stages"
    ),
}
"""Ops torch.export emits for torch.nn modules that the registry does not run yet -> why."""

RANDOM_IN_TRAINING = frozenset({
    "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
    "RReLU",
})
"""Modules whose training-mode output is random: captured and listed, not compared to eager
(their programs draw from generators seeded per micro-batch: tests/graph/test_random_ops.py)."""

WRONG_IN_TORCH: dict[str, str] = {
    "MultiLabelMarginLoss": (
        "torch 2.13's core-ATen decomposition of multilabel_margin_loss_forward gives another "
        "loss than eager (e.g. 2.478 vs 1.691): the exported program agrees with eager, "
        "run_decompositions does not; fusion runs what the lowering gives, so the capture is "
        "wrong. The walk asserts it is still wrong, so the entry goes once torch fixes it"
    ),
}
"""Modules whose lowered graph runs but differs from eager, through torch's own lowering."""

RANDOM_ALWAYS = frozenset({"FractionalMaxPool2d", "FractionalMaxPool3d"})
"""Modules random in both modes (FractionalMaxPool2d/3d draw their pooling regions with
`aten.rand`, which a program runs on a generator seeded per micro-batch, `program.RANDOM_OPS`,
not on eager's global one); their `F.fractional_max_pool*d(samples)` forms are compared."""

NOT_CAPTURED: dict[str, tuple[str, str]] = {
    "CTCLoss": (
        "DynamicOutputShapeException: aten._ctc_loss",
        "torch.export cannot trace aten._ctc_loss: its fake kernel gives an output shape that "
        "depends on the data (DynamicOutputShapeException), the lengths given as tensors or as "
        "ints; torch's to fix"
    ),
    "GaussianNLLLoss": (
        "GuardOnDataDependentSymNode",
        "F.gaussian_nll_loss checks `torch.any(var < 0)` in Python before it computes: a "
        "branch on a tensor's values, which one graph cannot hold. A constant float `var` "
        "skips the check: GaussianNLLLoss(float var) is walked"
    ),
    "AdaptiveLogSoftmaxWithLoss": (
        "GuardOnDataDependentSymNode",
        "its forward gathers each cluster's rows with `nonzero` and skips a cluster without "
        "rows (`if row_indices.numel() == 0`): a branch on the targets' values, which one "
        "graph cannot hold"
    ),
    "CrossMapLRN2d": (
        "specialized it to be a constant",
        "a legacy autograd.Function whose forward resizes tensors in place (`resize_as_`) "
        "and loops in Python: that fixes the batch size, and with a static batch torch's "
        "lowering fails on the resized tensors (a cpu tensor given meta storage). "
        "LocalResponseNorm is the traceable cross-channel normalisation (walked)"
    ),
}
"""Samples that torch.export or torch's lowering refuses (a `CaptureError`: no op of ours is
missing) -> (what the refusal says, why). The walk asserts each still fails so, and an entry
goes once torch captures it."""

_LAZY_REASON = (
    "becomes {} (walked) on its first forward, which creates its parameters from the input's "
    "shape; before that, capture refuses it, saying to run the model once first "
    "(tests/graph/test_capture_errors.py)"
)

NOT_WALKED: dict[str, str] = {
    "Module": "the base class of every module: what runs is a subclass's forward",
    "Container": "deprecated base class (FutureWarning) with no forward: it only holds modules",
    "ModuleDict": "a container with no forward: a model calls what it holds, which is walked",
    "ParameterList": "holds parameters, has no forward: the ops that read them are walked",
    "ParameterDict": "holds parameters, has no forward: the ops that read them are walked",
    "RNNBase": "the base of RNN/LSTM/GRU (walked), which only set its `mode`",
    "RNNCellBase": "the base of RNNCell/LSTMCell/GRUCell (walked), with no forward of its own",
    "NLLLoss2d": "deprecated subclass of NLLLoss adding no code (NLLLoss(2d) is walked)",
    "DataParallel": (
        "a runtime wrapper, not a layer: it replicates the module it wraps over the local "
        "GPUs each forward; fusion splits the graph itself, so capture the wrapped `.module`"
    ),
    **{name: _LAZY_REASON.format(getattr(nn, name).cls_to_become.__name__) for name in (
        "LazyLinear", "LazyConv1d", "LazyConv2d", "LazyConv3d", "LazyConvTranspose1d",
        "LazyConvTranspose2d", "LazyConvTranspose3d", "LazyBatchNorm1d", "LazyBatchNorm2d",
        "LazyBatchNorm3d", "LazyInstanceNorm1d", "LazyInstanceNorm2d", "LazyInstanceNorm3d",
    )},
}
"""Public torch.nn module classes no sample builds -> why (`test_walk_samples_every_torch_nn_
module` fails on any other class, and on an entry a sample builds or torch no longer has)."""


class _Fn(nn.Module):
    """A functional form as a module (`F.normalize`, `Tensor.norm`, ...)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)


class _First(nn.Module):
    """A module returning a tuple (RNNs, attention): its first output."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.m(*args)
        first: torch.Tensor = out[0] if isinstance(out, tuple) else out
        return first


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.m(x, x, x)[0]
        return out


class _Unpool(nn.Module):
    """MaxPool<n>d(return_indices=True) then MaxUnpool<n>d: the unpooling needs the indices."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.pool = getattr(nn, f"MaxPool{n}d")(2, return_indices=True)
        self.unpool = getattr(nn, f"MaxUnpool{n}d")(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, idx = self.pool(x)
        out: torch.Tensor = self.unpool(y, idx)
        return out


class _GaussianFixedVar(nn.Module):
    """GaussianNLLLoss with a constant float variance (a tensor one: `NOT_CAPTURED`)."""

    def __init__(self) -> None:
        super().__init__()
        self.m = nn.GaussianNLLLoss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.m(x, target, 0.5)
        return out


def _transformer_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2)


def _transformer_decoder() -> nn.Module:
    return nn.TransformerDecoder(
        nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 2)


def _frozen_bag() -> nn.Module:
    """A frozen EmbeddingBag (pretrained vectors, requires_grad=False) before a trained layer:
    it lowers to `_embedding_bag_forward_only`."""
    bag = nn.EmbeddingBag(10, 4, mode="mean")
    bag.weight.requires_grad_(False)
    return nn.Sequential(bag, nn.Linear(4, 3))


class _EmbeddingBagOffsets(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = nn.EmbeddingBag(10, 4, mode="mean")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.m(idx, torch.tensor([0, 3]))
        return out


def _sq_loss(out: torch.Tensor) -> torch.Tensor:
    """The scalar a sample is trained on: a sum of squares (its gradient is not constant)."""
    return out.float().pow(2).sum()


class _Scalar(nn.Module):
    """forward(*inputs) -> a scalar loss of the module's output (capture takes no loss fn)."""

    def __init__(self, m: nn.Module) -> None:
        super().__init__()
        self.m = m

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return _sq_loss(self.m(*args))


@dataclass(frozen=True)
class Sample:
    name: str
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    grad_inputs: int | None = None
    """How many leading inputs get gradients (None: every float input; a loss's targets: no)."""
    static: bool = False
    """Capture with every dim static: the module's op fixes the batch size (its shape function
    reads it), so a dynamic batch is refused."""

    def dynamic(self, n_inputs: int) -> list[None] | None:
        """`capture`'s `dynamic` for this sample's `n_inputs` inputs (None: the default, a
        dynamic batch)."""
        return [None] * n_inputs if self.static else None


def _r(*shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(*shape),)


def _r2(a: Sequence[int], b: Sequence[int]) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randn(*a), torch.randn(*b))


def _idx(*shape: int) -> Callable[[], tuple[torch.Tensor, ...]]:
    return lambda: (torch.randint(0, 10, shape),)


_ACTIVATIONS: tuple[Callable[[], nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.ELU, nn.SELU,
    nn.CELU, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh,
    nn.Hardshrink, nn.Softshrink, lambda: nn.Threshold(0.1, 0.0), nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.Tanh, nn.Sigmoid, nn.GLU, nn.LogSigmoid, lambda: nn.Softmax(-1),
    lambda: nn.LogSoftmax(-1), lambda: nn.Softmin(-1),
)


def _samples() -> list[Sample]:
    s = [
        Sample("Linear", lambda: nn.Linear(4, 3), _r(2, 4)),
        Sample("Bilinear", lambda: nn.Bilinear(4, 5, 3), _r2((2, 4), (2, 5))),
        Sample("Conv1d", lambda: nn.Conv1d(2, 3, 3), _r(2, 2, 8)),
        Sample("Conv2d", lambda: nn.Conv2d(2, 3, 3, padding=1), _r(2, 2, 6, 6)),
        Sample("Conv3d", lambda: nn.Conv3d(2, 3, 3), _r(2, 2, 5, 5, 5)),
        Sample("ConvTranspose1d", lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), _r(2, 2, 6)),
        Sample("ConvTranspose2d", lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), _r(2, 2, 5, 5)),
        Sample("ConvTranspose3d", lambda: nn.ConvTranspose3d(2, 3, 3), _r(2, 2, 3, 3, 3)),
    ]
    for make in _ACTIVATIONS:
        s.append(Sample(type(make()).__name__, make, _r(2, 6)))
    s.extend([
        Sample("GELU(tanh)", lambda: nn.GELU("tanh"), _r(2, 6)),
        Sample("Softmax2d", nn.Softmax2d, _r(2, 3, 4, 4)),
        Sample("BatchNorm1d", lambda: nn.BatchNorm1d(4), _r(3, 4)),
        Sample("BatchNorm2d", lambda: nn.BatchNorm2d(4), _r(3, 4, 3, 3)),
        Sample("BatchNorm3d", lambda: nn.BatchNorm3d(2), _r(2, 2, 3, 3, 3)),
        Sample("LayerNorm", lambda: nn.LayerNorm(4), _r(2, 3, 4)),
        Sample("GroupNorm", lambda: nn.GroupNorm(2, 4), _r(2, 4, 3)),
        Sample("InstanceNorm1d", lambda: nn.InstanceNorm1d(4, affine=True), _r(2, 4, 5)),
        Sample("InstanceNorm2d", lambda: nn.InstanceNorm2d(4, track_running_stats=True),
               _r(2, 4, 3, 3)),
        Sample("InstanceNorm3d", lambda: nn.InstanceNorm3d(2), _r(2, 2, 3, 3, 3)),
        Sample("LocalResponseNorm", lambda: nn.LocalResponseNorm(2), _r(2, 4, 3, 3)),
        Sample("CrossMapLRN2d", lambda: nn.CrossMapLRN2d(3), _r(2, 4, 3, 3)),
        # Without a process group (as capture runs) its forward is BatchNorm's; with one it
        # all-reduces the batch statistics across ranks in training, which a stage does not.
        Sample("SyncBatchNorm(no process group)", lambda: nn.SyncBatchNorm(4), _r(3, 4)),
        Sample("Dropout", lambda: nn.Dropout(0.3), _r(2, 6)),
        Sample("Dropout1d", lambda: nn.Dropout1d(0.3), _r(2, 3, 6)),
        Sample("Dropout2d", lambda: nn.Dropout2d(0.3), _r(2, 3, 4, 4)),
        Sample("Dropout3d", lambda: nn.Dropout3d(0.3), _r(2, 3, 2, 2, 2)),
        Sample("AlphaDropout", lambda: nn.AlphaDropout(0.3), _r(2, 6)),
        Sample("FeatureAlphaDropout", lambda: nn.FeatureAlphaDropout(0.3), _r(2, 3, 4)),
        Sample("MaxPool1d", lambda: nn.MaxPool1d(2), _r(2, 2, 8)),
        Sample("MaxPool2d", lambda: nn.MaxPool2d(2), _r(2, 2, 6, 6)),
        Sample("MaxPool3d", lambda: nn.MaxPool3d(2), _r(2, 2, 4, 4, 4)),
        Sample("AvgPool1d", lambda: nn.AvgPool1d(2), _r(2, 2, 8)),
        Sample("AvgPool2d", lambda: nn.AvgPool2d(2), _r(2, 2, 6, 6)),
        Sample("AvgPool3d", lambda: nn.AvgPool3d(2), _r(2, 2, 4, 4, 4)),
        Sample("AdaptiveAvgPool1d", lambda: nn.AdaptiveAvgPool1d(3), _r(2, 2, 8)),
        Sample("AdaptiveAvgPool2d", lambda: nn.AdaptiveAvgPool2d((2, 3)), _r(2, 2, 6, 6)),
        Sample("AdaptiveAvgPool3d", lambda: nn.AdaptiveAvgPool3d(2), _r(2, 2, 4, 4, 4)),
        Sample("AdaptiveMaxPool1d", lambda: nn.AdaptiveMaxPool1d(3), _r(2, 2, 8)),
        Sample("AdaptiveMaxPool2d", lambda: nn.AdaptiveMaxPool2d(2), _r(2, 2, 6, 6)),
        Sample("AdaptiveMaxPool3d", lambda: nn.AdaptiveMaxPool3d(2), _r(2, 2, 4, 4, 4)),
        Sample("FractionalMaxPool2d", lambda: nn.FractionalMaxPool2d(2, output_size=3),
               _r(2, 2, 6, 6)),
        Sample("F.fractional_max_pool2d(samples)",  # its regions given: deterministic
               lambda: _Fn(lambda a, r: F.fractional_max_pool2d(
                   a, 2, output_size=3, _random_samples=r)),
               lambda: (torch.randn(2, 2, 6, 6), torch.rand(2, 2, 2)), grad_inputs=1),
        Sample("FractionalMaxPool3d", lambda: nn.FractionalMaxPool3d(2, output_size=3),
               _r(2, 2, 6, 6, 6), static=True),
        Sample("F.fractional_max_pool3d(samples)",
               lambda: _Fn(lambda a, r: F.fractional_max_pool3d(
                   a, 2, output_size=3, _random_samples=r)),
               lambda: (torch.randn(2, 2, 6, 6, 6), torch.rand(2, 2, 3)), grad_inputs=1,
               static=True),
        Sample("LPPool1d", lambda: nn.LPPool1d(2, 2), _r(2, 2, 8)),
        Sample("LPPool2d", lambda: nn.LPPool2d(2, 2), _r(2, 2, 6, 6)),
        Sample("LPPool3d", lambda: nn.LPPool3d(2, 2), _r(2, 2, 4, 4, 4)),
        Sample("MaxUnpool1d", lambda: _Unpool(1), _r(2, 2, 8)),
        Sample("MaxUnpool2d", lambda: _Unpool(2), _r(2, 2, 6, 6)),
        Sample("MaxUnpool3d", lambda: _Unpool(3), _r(2, 2, 4, 4, 4)),
        Sample("Upsample(nearest)", lambda: nn.Upsample(scale_factor=2), _r(2, 2, 3, 3)),
        Sample("Upsample(bilinear)", lambda: nn.Upsample(scale_factor=2, mode="bilinear"),
               _r(2, 2, 3, 3)),
        Sample("Upsample(bicubic)", lambda: nn.Upsample(scale_factor=2, mode="bicubic"),
               _r(2, 2, 3, 3)),
        Sample("Upsample(linear)", lambda: nn.Upsample(scale_factor=2, mode="linear"),
               _r(2, 2, 3)),
        Sample("UpsamplingNearest2d", lambda: nn.UpsamplingNearest2d(scale_factor=2),
               _r(2, 2, 3, 3)),
        Sample("UpsamplingBilinear2d", lambda: nn.UpsamplingBilinear2d(scale_factor=2),
               _r(2, 2, 3, 3)),
        Sample("PixelShuffle", lambda: nn.PixelShuffle(2), _r(2, 8, 3, 3)),
        Sample("PixelUnshuffle", lambda: nn.PixelUnshuffle(2), _r(2, 2, 4, 4)),
        Sample("ChannelShuffle", lambda: nn.ChannelShuffle(2), _r(2, 4, 3, 3)),
        Sample("ZeroPad1d", lambda: nn.ZeroPad1d(1), _r(2, 2, 3)),
        Sample("ZeroPad2d", lambda: nn.ZeroPad2d(1), _r(2, 2, 3, 3)),
        Sample("ZeroPad3d", lambda: nn.ZeroPad3d(1), _r(2, 2, 3, 3, 3)),
        Sample("ConstantPad1d", lambda: nn.ConstantPad1d(1, 0.5), _r(2, 2, 3)),
        Sample("ConstantPad2d", lambda: nn.ConstantPad2d((1, 0, 2, 1), 0.5), _r(2, 2, 3, 3)),
        Sample("ConstantPad3d", lambda: nn.ConstantPad3d(1, 0.5), _r(2, 2, 3, 3, 3)),
        Sample("ReflectionPad1d", lambda: nn.ReflectionPad1d(1), _r(2, 2, 3)),
        Sample("ReflectionPad2d", lambda: nn.ReflectionPad2d(1), _r(2, 2, 3, 3)),
        Sample("ReflectionPad3d", lambda: nn.ReflectionPad3d(1), _r(2, 2, 3, 3, 3)),
        Sample("ReplicationPad1d", lambda: nn.ReplicationPad1d(1), _r(2, 2, 3)),
        Sample("ReplicationPad2d", lambda: nn.ReplicationPad2d(1), _r(2, 2, 3, 3)),
        Sample("ReplicationPad3d", lambda: nn.ReplicationPad3d(1), _r(2, 2, 3, 3, 3)),
        Sample("CircularPad1d", lambda: nn.CircularPad1d(1), _r(2, 2, 3)),
        Sample("CircularPad2d", lambda: nn.CircularPad2d(1), _r(2, 2, 3, 3)),
        Sample("CircularPad3d", lambda: nn.CircularPad3d(1), _r(2, 2, 3, 3, 3)),
        Sample("Conv2d(circular)", lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"),
               _r(2, 2, 5, 5)),
        Sample("Fold", lambda: nn.Fold((4, 4), 2), _r(2, 8, 9)),
        Sample("Unfold", lambda: nn.Unfold(2), _r(2, 2, 4, 4)),
        Sample("Flatten", nn.Flatten, _r(2, 3, 4)),
        Sample("Unflatten", lambda: nn.Unflatten(1, (2, 3)), _r(2, 6)),
        Sample("Identity", nn.Identity, _r(2, 3)),
        Sample("Embedding", lambda: nn.Embedding(10, 4), _idx(2, 5)),
        Sample("EmbeddingBag(mean)", lambda: nn.EmbeddingBag(10, 4, mode="mean"), _idx(2, 5)),
        Sample("EmbeddingBag(sum)", lambda: nn.EmbeddingBag(10, 4, mode="sum"), _idx(2, 5)),
        Sample("EmbeddingBag(max)", lambda: nn.EmbeddingBag(10, 4, mode="max"), _idx(2, 5)),
        Sample("EmbeddingBag(offsets)", _EmbeddingBagOffsets, _idx(6)),
        Sample("EmbeddingBag(frozen)", _frozen_bag, _idx(2, 5)),
        Sample("Embedding(max_norm)", lambda: nn.Embedding(10, 4, max_norm=1.0), _idx(2, 5)),
        Sample("MultiheadAttention", _SelfAttention, _r(2, 3, 4)),
        Sample("TransformerEncoderLayer",
               lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
               _r(2, 3, 4)),
        Sample("TransformerDecoderLayer",
               lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True),
               _r2((2, 3, 4), (2, 4, 4))),
        Sample("TransformerEncoder", _transformer_encoder, _r(2, 3, 4)),
        Sample("TransformerDecoder", _transformer_decoder, _r2((2, 3, 4), (2, 4, 4))),
        Sample("Transformer",
               lambda: nn.Transformer(4, 2, 1, 1, 8, dropout=0.0, batch_first=True),
               _r2((2, 3, 4), (2, 4, 4))),
        Sample("RNN", lambda: _First(nn.RNN(4, 3, batch_first=True)), _r(2, 5, 4)),
        Sample("LSTM", lambda: _First(nn.LSTM(4, 3, batch_first=True)), _r(2, 5, 4)),
        Sample("GRU", lambda: _First(nn.GRU(4, 3, batch_first=True)), _r(2, 5, 4)),
        Sample("RNNCell", lambda: nn.RNNCell(4, 3), _r(2, 4)),
        Sample("LSTMCell", lambda: _First(nn.LSTMCell(4, 3)), _r(2, 4)),
        Sample("GRUCell", lambda: nn.GRUCell(4, 3), _r(2, 4)),
        Sample("CosineSimilarity", nn.CosineSimilarity, _r2((2, 6), (2, 6))),
        Sample("PairwiseDistance", nn.PairwiseDistance, _r2((2, 6), (2, 6))),
        Sample("F.normalize", lambda: _Fn(lambda a: F.normalize(a, dim=-1)), _r(2, 6)),
        Sample("Tensor.norm", lambda: _Fn(lambda a: a.norm(dim=-1)), _r(2, 6)),
        Sample("torch.var_mean", lambda: _Fn(lambda a: torch.var_mean(a, dim=-1)[0]), _r(2, 6)),
        Sample("torch.polar",
               lambda: _Fn(lambda a: torch.view_as_real(torch.polar(a.abs(), a)).sum(-1)),
               _r(2, 6)),
        Sample("torch.empty_permuted",
               lambda: _Fn(lambda a: a + torch.empty_permuted(a.shape, (1, 0)).fill_(1.0)),
               _r(2, 6)),
    ])
    s.extend(_losses())
    if hasattr(nn, "RMSNorm"):
        s.append(Sample("RMSNorm", lambda: nn.RMSNorm(4), _r(2, 3, 4)))
    return s


def _p(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) * 0.8 + 0.1  # probabilities, away from 0 and 1


def _cls(n: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, n, shape)


def _multilabel_margin_inputs() -> tuple[torch.Tensor, ...]:
    """Fixed inputs on which torch's lowering of multilabel_margin_loss is wrong (see
    `WRONG_IN_TORCH`)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, 5, generator=gen), torch.randint(-1, 5, (3, 5), generator=gen)


def _ctc_inputs() -> tuple[torch.Tensor, ...]:
    """CTC's log-probabilities (time, batch, classes), targets and their lengths."""
    return (torch.randn(6, 2, 5).log_softmax(2), torch.randint(1, 5, (2, 3)),
            torch.tensor([6, 5]), torch.tensor([3, 2]))


def _L(name: str, make: Callable[[], nn.Module], inputs: Callable[[], tuple[torch.Tensor, ...]],
       grad_inputs: int = 1) -> Sample:
    """A loss: its leading `grad_inputs` inputs get gradients, its targets do not."""
    return Sample(name, make, inputs, grad_inputs)


def _losses() -> list[Sample]:
    """The loss modules (the graph holds the loss: `capture` exports model and loss as one)."""
    return [
        _L("MSELoss", nn.MSELoss, _r2((2, 6), (2, 6))),
        _L("L1Loss", nn.L1Loss, _r2((2, 6), (2, 6))),
        _L("SmoothL1Loss", nn.SmoothL1Loss, _r2((2, 6), (2, 6))),
        _L("HuberLoss", nn.HuberLoss, _r2((2, 6), (2, 6))),
        _L("BCELoss", nn.BCELoss, lambda: (_p(2, 6), _p(2, 6))),
        _L("BCEWithLogitsLoss", nn.BCEWithLogitsLoss, lambda: (torch.randn(2, 6), _p(2, 6))),
        _L("SoftMarginLoss", nn.SoftMarginLoss,
               lambda: (torch.randn(2, 6), torch.randn(2, 6).sign())),
        _L("KLDivLoss", lambda: nn.KLDivLoss(reduction="batchmean"),
               lambda: (torch.randn(2, 6).log_softmax(-1), _p(2, 6))),
        _L("PoissonNLLLoss", nn.PoissonNLLLoss, lambda: (torch.randn(2, 6), _p(2, 6))),
        _L("MultiLabelSoftMarginLoss", nn.MultiLabelSoftMarginLoss,
               lambda: (torch.randn(2, 6), _cls(2, 2, 6).float())),
        _L("CosineEmbeddingLoss", nn.CosineEmbeddingLoss,
               lambda: (torch.randn(2, 6), torch.randn(2, 6), torch.tensor([1.0, -1.0])), 2),
        _L("CrossEntropyLoss", lambda: nn.CrossEntropyLoss(label_smoothing=0.1),
               lambda: (torch.randn(3, 5), _cls(5, 3))),
        _L("CrossEntropyLoss(probs)", nn.CrossEntropyLoss,
               lambda: (torch.randn(3, 5), torch.randn(3, 5).softmax(-1))),
        _L("NLLLoss", nn.NLLLoss, lambda: (torch.randn(3, 5).log_softmax(-1), _cls(5, 3))),
        _L("NLLLoss(2d)", nn.NLLLoss,
               lambda: (torch.randn(2, 5, 3, 3).log_softmax(1), _cls(5, 2, 3, 3))),
        _L("MarginRankingLoss", nn.MarginRankingLoss,
               lambda: (torch.randn(3), torch.randn(3), torch.tensor([1.0, -1.0, 1.0])), 2),
        _L("HingeEmbeddingLoss", nn.HingeEmbeddingLoss,
               lambda: (torch.randn(3, 4), torch.randn(3, 4).sign())),
        _L("MultiMarginLoss", nn.MultiMarginLoss, lambda: (torch.randn(3, 5), _cls(5, 3))),
        _L("MultiLabelMarginLoss", nn.MultiLabelMarginLoss, _multilabel_margin_inputs),
        _L("TripletMarginLoss", nn.TripletMarginLoss,
               lambda: (torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)), 3),
        _L("TripletMarginWithDistanceLoss", nn.TripletMarginWithDistanceLoss,
               lambda: (torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)), 3),
        _L("GaussianNLLLoss(float var)", _GaussianFixedVar, _r2((2, 6), (2, 6))),
        _L("GaussianNLLLoss", nn.GaussianNLLLoss,
               lambda: (torch.randn(2, 6), torch.randn(2, 6), _p(2, 6)), 3),
        _L("LinearCrossEntropyLoss", lambda: nn.LinearCrossEntropyLoss(4, 5),
               lambda: (torch.randn(3, 4), _cls(5, 3))),
        _L("CTCLoss", nn.CTCLoss, _ctc_inputs),
        _L("AdaptiveLogSoftmaxWithLoss",
               lambda: _First(nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4, 8], div_value=2.0)),
               lambda: (torch.randn(4, 8), torch.tensor([0, 5, 9, 2]))),
    ]


def _lowered_ops(model: nn.Module, inputs: Sequence[torch.Tensor],
                 dynamic: Sequence[None] | None = None) -> set[str]:
    """Every op the graph capture lowers `model` to (asserts capture drops left out)."""
    ep, _, _ = export_program(model, inputs, None, None, dynamic, {}, {})
    out: set[str] = set()
    for n in ep.graph_module.graph.nodes:
        if n.op != "call_function" or n.target.__name__ == "getitem":
            continue
        if isinstance(n.target, torch._ops.OpOverload):
            name = op_name(n.target)
            if not name.startswith(_DROPPED_CHECKS):
                out.add(name)
        else:
            out.add(sym_op_name(n.target) or str(n.target))
    return out


def _eager_vs_program(
    name: str, model: nn.Module, inputs: Sequence[torch.Tensor], grad_inputs: int | None = None,
    *, captured: tuple[nn.Module, CapturedModel] | None = None,
    dynamic: Sequence[None] | None = None,
) -> None:
    """Capture `model` (`dynamic` as `capture` takes it), run the IR as a `GraphProgram`: loss
    and gradients equal eager's. `captured`: (a copy of `model` taken before capturing it, the
    capture), to not capture twice."""
    if captured is None:
        eager = copy.deepcopy(model)  # capture snapshots state; eager steps must not leak in
        c = capture(model, inputs, dynamic=dynamic)
    else:
        eager, c = captured
    # What a daemon receives: the IR as bytes and the state as safetensors.
    prog = build_program(ir.loads(ir.dumps(c.graph)), state_from_bytes(c.state_bytes()))
    n_grad = len(inputs) if grad_inputs is None else grad_inputs
    x_e = [t.clone().requires_grad_(t.is_floating_point() and i < n_grad)
           for i, t in enumerate(inputs)]
    x_p = [t.clone().requires_grad_(t.is_floating_point() and i < n_grad)
           for i, t in enumerate(inputs)]
    loss_e = eager(*x_e)
    (loss_p,) = prog(*x_p)
    loss_e.backward()
    loss_p.backward()
    tol = {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(loss_p, loss_e.detach(), **tol, msg=lambda m: f"{name}: {m}")
    grads = dict(eager.named_parameters())
    for n, p in prog.named_parameters():
        want = grads[n].grad
        if not grads[n].requires_grad:  # a frozen parameter: no gradient on either side
            assert p.grad is None and want is None and not p.requires_grad, f"{name}: {n}"
            continue
        assert p.grad is not None and want is not None, f"{name}: {n} has no gradient"
        torch.testing.assert_close(p.grad, want, **tol, msg=lambda m, n=n: f"{name}.{n}: {m}")
    for i, (a, b) in enumerate(zip(x_p, x_e, strict=True)):
        if b.grad is not None:
            assert a.grad is not None, f"{name}: input {i} has no gradient"
            torch.testing.assert_close(a.grad, b.grad, **tol, msg=lambda m: f"{name}: {m}")


_MODE_DEPENDENT: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
    nn.modules.dropout._DropoutNd, nn.RReLU, nn.MultiheadAttention,
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.modules.rnn.RNNBase,
)
"""Modules whose forward reads `self.training` (directly or through F.*(training=...)): walked in
eval mode too (running statistics, no dropout, attention fast paths)."""


def _modes(model: nn.Module) -> tuple[str, ...]:
    if any(isinstance(m, _MODE_DEPENDENT) for m in model.modules()):
        return ("train", "eval")
    return ("train",)


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~90 s alone; it shares the cores in the parallel phase
def test_registry_covers_torch_nn() -> None:
    torch.manual_seed(20)
    samples = _samples()
    seen: set[str] = set()
    gaps: dict[str, set[str]] = {}
    refused: dict[str, str] = {}
    compared = walked = 0
    for s in samples:
        for mode in _modes(s.make()):
            model = _Scalar(s.make()).train(mode == "train")
            inputs = s.inputs()
            walked += 1
            # One export per module: capture it, and only where capture refuses list the ops
            # it lowers to (what a gap is); a capture that succeeds holds only supported ops.
            eager = copy.deepcopy(model)  # capture snapshots state; eager steps must not leak
            try:
                c = capture(model, inputs, dynamic=s.dynamic(len(inputs)))
            except UnsupportedOpError:
                ops = _lowered_ops(model, inputs, s.dynamic(len(inputs)))
                seen |= ops
                missing = {o for o in ops if not is_supported(o)}
                assert missing, f"{s.name}({mode}): refused, yet every op it lowers to is supported"
                for o in missing:
                    gaps.setdefault(o, set()).add(f"{s.name}({mode})")
                continue
            except CaptureError as e:  # torch's export or lowering, not a gap of ours
                if s.name not in NOT_CAPTURED:
                    raise
                says = NOT_CAPTURED[s.name][0]
                assert says in str(e), f"{s.name}({mode}) is refused otherwise now: {e}"
                refused[s.name] = str(e)
                continue
            assert s.name not in NOT_CAPTURED, f"{s.name}({mode}) captures now: remove it"
            ops = {n.op for n in c.graph.nodes}
            seen |= ops
            assert all(is_supported(o) for o in ops), f"{s.name}({mode}): captured {ops}"
            done = (eager, c)
            if s.name in WRONG_IN_TORCH:
                with pytest.raises(AssertionError, match="not close"):  # still wrong: keep it
                    _eager_vs_program(f"{s.name}({mode})", model, inputs, s.grad_inputs,
                                      captured=done)
            elif s.name not in RANDOM_ALWAYS and not (
                mode == "train" and s.name in RANDOM_IN_TRAINING
            ):
                _eager_vs_program(f"{s.name}({mode})", model, inputs, s.grad_inputs,
                                  captured=done)
                compared += 1
    print(f"\ntorch.nn coverage: {len(samples)} modules, {walked} captures (train, and eval "
          f"where it differs), {len(seen)} distinct ops, {compared} equal to eager, "
          f"{len(refused)} refused by torch, gaps:")
    for op, where in sorted(gaps.items()):
        print(f"  {op}: {', '.join(sorted(where))}")
    for name, why in sorted(refused.items()):
        print(f"  refused {name}: {why.splitlines()[0][:160]}")
    unexpected = {o: sorted(w) for o, w in gaps.items() if o not in NOT_YET}
    assert not unexpected, f"ops the registry lacks (add them, or to NOT_YET: why): {unexpected}"
    now_supported = sorted(o for o in NOT_YET if is_supported(o))
    assert not now_supported, f"in NOT_YET but supported now: remove them {now_supported}"
    stale = sorted(set(NOT_YET) - set(gaps))
    assert not stale, f"in NOT_YET but no module emits them any more: remove them {stale}"
    unwalked = sorted(set(NOT_CAPTURED) - {s.name for s in samples})
    assert not unwalked, f"in NOT_CAPTURED but no sample has that name: {unwalked}"


def _public_module_classes() -> dict[str, type[nn.Module]]:
    """torch.nn's public module classes by name: `torch.nn.modules.__all__` and what torch.nn
    itself exports (DataParallel)."""
    names = set(nn.modules.__all__) | {n for n in dir(nn) if not n.startswith("_")}
    out: dict[str, type[nn.Module]] = {}
    for name in sorted(names):
        cls = getattr(nn, name, None) or getattr(nn.modules, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            out[name] = cls
    return out


def test_walk_samples_every_torch_nn_module() -> None:
    """Every public torch.nn module class is built by a sample of the walk (as the module or
    inside it) or listed in `NOT_WALKED` with the reason; no entry there is walked or gone."""
    public = _public_module_classes()
    built = {type(m) for s in _samples() for m in s.make().modules()}
    walked = {name for name, cls in public.items() if cls in built}
    missing = sorted(set(public) - walked - set(NOT_WALKED))
    assert not missing, (f"torch.nn modules the walk never builds: sample them in _samples() "
                         f"(or list them in NOT_WALKED with why): {missing}")
    both = sorted(walked & set(NOT_WALKED))
    assert not both, f"in NOT_WALKED but a sample builds them: remove them {both}"
    gone = sorted(set(NOT_WALKED) - set(public))
    assert not gone, f"in NOT_WALKED but torch.nn has no such module class: remove them {gone}"
    for name, cls in public.items():  # a lazy module's eager class is walked
        eager = getattr(cls, "cls_to_become", None)
        if name.startswith("Lazy") and eager is not None:
            assert eager in built, f"{name} becomes {eager.__name__}, which no sample builds"


ADDED = (
    "aten._trilinear.default", "aten.adaptive_max_pool2d.default",
    "aten.linalg_vector_norm.default", "aten.var_mean.correction", "aten.polar.default",
    "aten.view_as_real.default", "aten.empty_permuted.default",
    "aten.adaptive_max_pool3d.default", "aten.fractional_max_pool2d.default",
    "aten.bernoulli.p", "aten.rrelu_with_noise_functional.default",
    "aten._embedding_bag_forward_only.default", "aten.fractional_max_pool3d.default",
)


def test_added_ops_are_in_the_registry() -> None:
    """The ops issue 20 adds (non-core ATen that torch.nn modules emit) are runnable."""
    assert set(ADDED) <= set(EXTRA_OPS)
    assert all(is_supported(o) for o in ADDED)
    assert not any(is_supported(o) for o in NOT_YET)


@pytest.mark.parametrize(
    "name",
    ["Bilinear", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "CosineSimilarity",
     "PairwiseDistance", "F.normalize", "Tensor.norm", "torch.var_mean", "torch.polar",
     "torch.empty_permuted", "AdaptiveMaxPool3d", "CosineEmbeddingLoss",
     "HingeEmbeddingLoss", "TripletMarginLoss", "CircularPad1d", "Conv2d(circular)",
     "F.fractional_max_pool2d(samples)", "F.fractional_max_pool3d(samples)"],
)
def test_added_op_round_trip(name: str) -> None:
    """Capture -> IR -> GraphProgram on the registry: loss and gradients equal eager's."""
    torch.manual_seed(7)
    (s,) = [s for s in _samples() if s.name == name]
    inputs = s.inputs()
    _eager_vs_program(name, _Scalar(s.make()).train(), inputs, s.grad_inputs,
                      dynamic=s.dynamic(len(inputs)))


def test_program_copy_matches_aten_copy_and_is_differentiable() -> None:
    """A program's `aten.copy` gives aten.copy's values (broadcast, dtype cast) and a gradient
    to its source, where eager autograd has no derivative for aten.copy."""
    from fusiond.graph.program import _copy

    dst = torch.zeros(2, 3, 4, dtype=torch.float64)
    src = torch.randn(3, 1, requires_grad=True)
    got = _copy(dst, src)
    want = torch.ops.aten.copy.default(dst, src.detach())
    assert got.dtype == want.dtype and torch.equal(got, want)
    got.sum().backward()
    assert src.grad is not None and torch.equal(src.grad, torch.full((3, 1), 8.0))
    with pytest.raises(RuntimeError, match="derivative for aten::copy is not implemented"):
        torch.ops.aten.copy.default(dst, src).sum().backward()


HF_ARCHITECTURES: dict[str, dict[str, object]] = {
    "LlamaForCausalLM": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             attention_dropout=0.1),
    "MistralForCausalLM": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, sliding_window=4, attention_dropout=0.1),
    "Qwen2ForCausalLM": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             attention_dropout=0.1),
    "GPTNeoXForCausalLM": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.1,
                               attention_dropout=0.1),
    "BertForMaskedLM": dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4),
    "ViTForImageClassification": dict(image_size=16, patch_size=4, hidden_size=32,
                                      intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_labels=3,
                                      hidden_dropout_prob=0.1),
    "T5ForConditionalGeneration": dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64,
                                       num_layers=2, num_heads=4, decoder_start_token_id=0),
}
"""Hugging Face architectures the registry must cover (issue 20's list; GPT-2 has its own
tests), as tiny configs built offline (their dropouts on: training-mode captures hold the
random ops)."""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("architecture", sorted(HF_ARCHITECTURES))
def test_registry_covers_hf_architectures(architecture: str, mode: str) -> None:
    """Each architecture captures in training mode (its dropouts on) and in eval mode (off)
    with its inputs by name (padded rows with their attention mask; encoder-decoders with
    decoder_input_ids) using registry ops only, and its program, rebuilt from the IR bytes,
    trains: a finite loss and a gradient for every parameter the loss reads."""
    transformers = pytest.importorskip("transformers")
    from fusiond.train.model import loss_fn
    from fusiond.train.spec import LossSpec

    cls = getattr(transformers, architecture)
    torch.manual_seed(3)
    config = cls.config_class(use_cache=False, **HF_ARCHITECTURES[architecture])
    model = cls(config).train(mode == "train")
    if architecture.startswith("ViT"):
        inputs: dict[str, torch.Tensor] = {"pixel_values": torch.randn(2, 3, 16, 16)}
        labels = torch.tensor([0, 2])
    else:
        ids = torch.randint(3, 120, (2, 8))
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[1, 5:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        labels = ids.clone()
        if architecture.startswith("T5"):
            inputs["decoder_input_ids"] = torch.randint(3, 120, (2, 6))
            labels = torch.randint(3, 120, (2, 6))
    c = capture(model, inputs, targets=labels, loss=loss_fn(LossSpec("causal_lm")),
                targets_name="labels")
    missing = sorted({n.op for n in c.graph.nodes if not is_supported(n.op)})
    assert not missing, f"{architecture}: ops the registry lacks: {missing}"
    graph = ir.loads(ir.dumps(c.graph))
    prog = build_program(graph, state_from_bytes(c.state_bytes()))
    if prog.random is not None:
        prog.random.set(1, 0, 0)
    (loss,) = prog(*inputs.values(), labels)
    assert torch.isfinite(loss)
    loss.backward()
    read = {p for n in graph.nodes for p in n.params}
    for name, p in prog.named_parameters():
        if name in read:
            assert p.grad is not None, f"{architecture}: no gradient for {name}"
