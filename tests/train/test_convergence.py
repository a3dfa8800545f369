"""Top-k at density 0.1 on every cut edge converges close to the uncompressed pipeline."""

from __future__ import annotations

import pytest
import torch

from fusiond.models.gpt2 import gpt2
from fusiond.train.data import TextWindows
from fusiond.train.local import run_pipeline
from fusiond.train.spec import OptimizerSpec, default_text_path

from .gpt_stages import three_stages

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

STEPS = 200


@pytest.mark.slow
async def test_topk_0p1_within_5_percent_after_200_steps() -> None:
    # GPT-2 tiny with 3 blocks, one per stage (cuts between blocks: only the residual stream
    # crosses), batch 16 x 64 bytes of the stdlib. Measured gap 0.7-1.8 % (seeds 0, 1).
    # The stock 2-block tiny cannot be cut in 3 without a cut right after the embedding or right
    # before the LM head; there the gap is 4-7 % (see the report in docs/jobs.md).
    data = TextWindows(default_text_path(), seq_len=64, seed=1)
    opt = OptimizerSpec(kind="adamw", lr=2e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8,
                        momentum=0.0, schedule="cosine", warmup_steps=10, min_lr=1e-4)
    final: dict[float | None, float] = {}
    wire: dict[float | None, int] = {}
    for density in (None, 0.1):
        torch.manual_seed(0)
        model = gpt2("tiny", n_layer=3)
        res = await run_pipeline(three_stages(model, density, first_blocks=1, last_blocks=1),
                                 data=data, batch_size=16, micro_batches=4, optimizer=opt,
                                 steps=STEPS)
        assert len(res.losses) == STEPS
        final[density] = sum(res.losses[-20:]) / 20  # mean of the last 20 steps: less noise
        wire[density] = res.metrics[-1].wire_bytes
    assert final[None] < 3.2  # it learned (starts at ~5.5 = ln 256)
    assert final[0.1] <= 1.05 * final[None], final
    assert wire[0.1] < 0.2 * wire[None]
