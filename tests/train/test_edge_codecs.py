"""Quantized cut edges (bf16, int8, int4) in the stage runtime: the backward of a compressed
edge is the exact gradient of the compressed forward, passed back through the same codec; the
receiver answers as each forward came, so a sender may switch codecs at any micro-batch."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn

from fusiond.models.gpt2 import gpt2
from fusiond.train import codec
from fusiond.train.data import Batch, TextWindows
from fusiond.train.local import run_pipeline
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import EdgeSpec, StageError, StageExecutor, StageProgram, _grad_seed

from .gpt_stages import three_stages

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

SGD = OptimizerSpec(kind="sgd", lr=1.0, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                    momentum=0.0, schedule="constant", warmup_steps=0, min_lr=0.0)


class _Regression:
    def batch(self, step: int, size: int) -> Batch:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(size, 16, generator=g)
        return Batch(x, x.flip(1))


def _two_stages(w0: nn.Linear, w1: nn.Linear, encoding: codec.EdgeEncoding
                ) -> list[StageProgram]:
    e = EdgeSpec("y", 0, 1, encoding=encoding)

    def run0(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": w0(i["inputs"])}

    def run1(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": ((w1(i["y"]) - i["targets"]) ** 2).mean()}

    return [StageProgram(w0, run0, (), (e,), ("inputs",)),
            StageProgram(w1, run1, (e,), (), ("targets",), True)]


def _roundtrip(t: torch.Tensor, encoding: codec.EdgeEncoding, **kw: int | bool) -> torch.Tensor:
    out = codec.decode_dense(codec.encode_edge(t, encoding, **kw).payload)  # type: ignore[arg-type]
    return out.float()


@pytest.mark.parametrize("encoding", ["raw", "bf16", "int8", "int4", "lowrank"])
async def test_the_backward_is_the_exact_gradient_of_the_compressed_forward(
        encoding: codec.EdgeEncoding) -> None:
    torch.manual_seed(0)
    w0, w1 = nn.Linear(16, 16), nn.Linear(16, 16)
    r0, r1 = nn.Linear(16, 16), nn.Linear(16, 16)
    r0.load_state_dict(w0.state_dict())
    r1.load_state_dict(w1.state_dict())
    res = await run_pipeline(_two_stages(w0, w1, encoding), data=_Regression(), batch_size=8,
                             micro_batches=1, optimizer=SGD, steps=1)
    # the reference: the receiver computes on the decoded activation; the gradient it takes
    # there goes back through the codec (stochastic rounding drawn from the task's seed) and
    # is back-propagated from the sender's output
    b = _Regression().batch(0, 8)
    y = r0(b.inputs)
    seed = _grad_seed(0, 0, "y")
    if encoding == "lowrank":  # P Q^T, rank 16 / 8 = 2; the answer G Q, bf16, times Q^T
        enc, q = codec.encode_lowrank(y.detach(), seed=seed)
        assert q.shape == (16, 2)
        y_dec = codec.decode_edge(enc.payload).tensor.float().requires_grad_(True)
    else:
        y_dec = _roundtrip(y.detach(), encoding).requires_grad_(True)
    loss = ((r1(y_dec) - b.targets) ** 2).mean()
    loss.backward()
    assert y_dec.grad is not None
    if encoding == "lowrank":
        gq = codec.project(y_dec.grad, q).to(torch.bfloat16).float()
        g_sent = codec.unproject(gq, q, y.shape)
    else:
        g_sent = _roundtrip(y_dec.grad, encoding, stochastic=True, seed=seed)
    y.backward(g_sent)
    assert res.losses == [pytest.approx(loss.item(), rel=1e-6)]
    for got, ref in ((w0, r0), (w1, r1)):
        for (name, p), q in zip(got.named_parameters(), ref.parameters(), strict=True):
            assert q.grad is not None
            torch.testing.assert_close(p.detach(), (q - q.grad).detach(), rtol=1e-6, atol=1e-6,
                                       msg=name)
    if encoding != "raw":  # and the codec did change what crossed
        exact = ((r1(y.detach()) - b.targets) ** 2).mean()
        assert exact.item() != loss.item()


@pytest.mark.parametrize(("encoding", "share", "back"), [
    ("bf16", (0.49, 0.52), (0.49, 0.52)),
    ("int4", (0.125, 0.145), (0.125, 0.145)),
    # rank 32 / 8 = 4 of the 2 x 32 tokens x 32 features: P in bf16 (1/16 of the bytes) and
    # Q (32 x 4 float32, another 1/16 here); back G Q in bf16 (1/16), plus the headers
    ("lowrank", (0.13, 0.14), (0.07, 0.08)),
])
async def test_quantized_edges_send_their_bytes_and_train(
        encoding: codec.EdgeEncoding, share: tuple[float, float], back: tuple[float, float],
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    torch.manual_seed(0)
    res = await run_pipeline(three_stages(gpt2("tiny"), encoding=encoding), data=small_text,
                             batch_size=8, micro_batches=4, optimizer=adamw, steps=8)
    for e in res.metrics[-1].edges:
        assert e.density is None
        lo, hi = share
        assert lo * e.forward_dense < e.forward_wire < hi * e.forward_dense
        lo, hi = back
        assert lo * e.backward_dense < e.backward_wire < hi * e.backward_dense
    assert res.losses[-1] < res.losses[0] - 0.2


async def test_a_sender_switches_codecs_and_the_receiver_follows(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """Re-adaptation: the sender changes an edge's codec every other step (raw -> int4 ->
    top-k 0.25 -> int8); the receiver answers each forward in its own codec, with no
    notice."""
    torch.manual_seed(0)
    execs: list[StageExecutor] = []
    switches = {0: ("int4", None), 2: ("raw", 0.25), 4: ("int8", None)}
    wires: list[float] = []

    def on_step(m: object) -> None:
        edge = next(e for e in m.edges if e.edge == "h0")  # type: ignore[attr-defined]
        wires.append(edge.forward_wire / edge.forward_dense)
        if m.step in switches:  # type: ignore[attr-defined]
            enc, d = switches[m.step]  # type: ignore[attr-defined]
            execs[0].set_codec("h0", enc, d)  # type: ignore[arg-type]

    res = await run_pipeline(three_stages(gpt2("tiny")), data=small_text, batch_size=8,
                             micro_batches=4, optimizer=adamw, steps=9, on_step=on_step,
                             on_executors=execs.extend)
    assert len(res.losses) == 9

    def kind(share: float) -> str:  # fp32; int4 0.13; top-k 0.25: fp16 values + bitmap 0.16
        return ("raw" if share > 0.99 else "int8" if 0.24 < share < 0.27
                else "top-k" if 0.15 < share < 0.18 else "int4" if 0.12 < share < 0.15
                else f"? {share:.3f}")

    # a switch takes effect at the next forward, so a step may mix two codecs (left out
    # here); each codec holds two steps, so each is seen whole, in order
    kinds = [k for k in map(kind, wires) if not k.startswith("?")]
    seen = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert seen == ["raw", "int4", "top-k", "int8"], wires
    assert execs[0].encodings["h0"] == "int8" and execs[0].densities["h0"] is None
    with pytest.raises(StageError, match="cannot also be top-k"):
        execs[0].set_codec("h0", "int4", 0.1)
    with pytest.raises(StageError, match="is not one of"):
        execs[0].set_codec("h0", "fp8", None)  # type: ignore[arg-type]
