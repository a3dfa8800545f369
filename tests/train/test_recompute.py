"""Activation checkpointing of a stage (`StageConfig.recompute`, issue 17's first mechanism):
a forward keeps only its inputs, the backward runs it again with autograd. Exact: the same
losses, updates and buffers as the plain run, bit for bit, with dropout (its draws keyed to
the step and micro-batch), BatchNorm (its running statistics updated once per forward, not
twice) and top-k cut edges (the backward's values at the forward's indices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusiond.graph import capture, contiguous_assignment, mutated_buffers, partition
from fusiond.train.data import SyntheticImages
from fusiond.train.local import PipelineResult, run_pipeline
from fusiond.train.programs import cut_densities, stage_programs
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import StageConfig, StageProgram

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

ADAMW = OptimizerSpec(kind="adamw", lr=3e-3, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8,
                      momentum=0.0, schedule="constant", warmup_steps=0, min_lr=0.0)


class ConvNet(nn.Module):
    """BatchNorm (buffers a forward updates) and dropout (random draws) in every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 8 * 8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.relu(self.b1(self.c1(x))))
        x = self.drop(F.relu(self.b2(self.c2(x))))
        return self.head(x.flatten(1))


def _programs(cap: Any, stages: int, densities: dict[str, float] | None = None
              ) -> Sequence[StageProgram]:
    parts = partition(cap.graph, contiguous_assignment(cap.graph, stages))
    return stage_programs(cap.graph, parts, {k: v.clone() for k, v in cap.state.items()},
                          densities=densities)


async def _train(progs: Sequence[StageProgram], data: Any, recompute: bool, *, batch: int,
                 steps: int = 4) -> PipelineResult:
    return await run_pipeline(progs, data=data, batch_size=batch, micro_batches=4,
                              optimizer=ADAMW, steps=steps,
                              config=StageConfig(recompute=recompute))


def _same(a: PipelineResult, b: PipelineResult) -> None:
    assert a.losses == b.losses  # bit for bit
    assert a.states.keys() == b.states.keys()
    for stage in a.states:
        for name, t in a.states[stage].items():
            assert torch.equal(t, b.states[stage][name]), (stage, name)


async def test_recompute_is_exact_with_dropout_and_batchnorm() -> None:
    torch.manual_seed(0)
    model = ConvNet().train()
    data = SyntheticImages(image_size=8, channels=3, num_classes=4, seed=1)
    b = data.batch(0, 2)
    cap = capture(model, [b.inputs], targets=b.targets, loss=F.cross_entropy,
                  dynamic=[{0: "batch"}, {0: "batch"}])
    progs = _programs(cap, 3)
    assert any(mutated_buffers(p.module) for p in progs)  # running statistics to keep once
    assert any(p.seed_random is not None for p in progs)  # dropout's draws to repeat
    plain = await _train(progs, data, False, batch=8)
    again = await _train(_programs(cap, 3), data, True, batch=8)
    _same(plain, again)
    assert plain.losses[-1] < plain.losses[0]


async def test_recompute_is_exact_on_gpt2_with_topk_edges(captured_tiny: Any,
                                                          small_text: Any) -> None:
    _, cap = captured_tiny
    cut = cut_densities(partition(cap.graph, contiguous_assignment(cap.graph, 3)), 0.3)
    assert cut  # every float cut edge travels top-k
    plain = await _train(_programs(cap, 3, cut), small_text, False, batch=8, steps=3)
    again = await _train(_programs(cap, 3, cut), small_text, True, batch=8, steps=3)
    _same(plain, again)


def test_a_recomputed_forward_keeps_only_its_inputs(captured_tiny: Any) -> None:
    """What a recomputed task holds between its forward and its backward: its inputs, and no
    output (so none of the activations behind them)."""
    import asyncio

    from fusiond.train.data import TextWindows
    from fusiond.train.spec import default_text_path

    _, cap = captured_tiny
    prog = _programs(cap, 1)[0]
    data = TextWindows(default_text_path() / "json", seq_len=32, seed=1)
    held: list[Any] = []

    async def run(recompute: bool) -> None:
        from fusiond.train import stage as stage_mod

        real = stage_mod.StageExecutor._forward

        def spy(self: Any, *a: Any, **k: Any) -> Any:
            ctx, packets = real(self, *a, **k)
            held.append((recompute, dict(ctx.outputs), ctx.inputs, ctx.loss))
            return ctx, packets

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(stage_mod.StageExecutor, "_forward", spy)
            await _train([prog], data, recompute, batch=4, steps=1)

    asyncio.run(run(True))
    for recompute, outputs, inputs, loss in held:
        assert recompute and outputs == {} and inputs is not None and "inputs" in inputs
        assert loss is not None and not loss.requires_grad  # the loss, reported, no graph
