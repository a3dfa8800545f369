"""Issue 22's convergence check: GPT-2 tiny and a transformers Llama, cut where OP-Fence cuts
them on four-groups (one host per site, memory short enough that the model must be split),
trained 200 steps with the codecs the per-link choice gives their cut edges: the held-out loss
of the dense weights stays within 1 % of the same cut sent uncompressed, on each of 3 seeds.
The run is bench/compress.py's third table (`planned_run`)."""

from __future__ import annotations

import pytest

from bench.compress import PLANNED_MODELS, planned_run
from fusiond.plan.accuracy import DEFAULT_ACCURACY_BUDGET

pytestmark = [pytest.mark.slow, pytest.mark.compute_only]

STEPS = 200
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("model", sorted(PLANNED_MODELS))
async def test_the_planners_codecs_cost_under_1_percent_held_out(model: str) -> None:
    gaps = []
    for seed in SEEDS:
        dense, _ = await planned_run(model, seed, STEPS, encoded=False)
        got, codecs = await planned_run(model, seed, STEPS, encoded=True)
        assert codecs, "the plan should compress its slow links"
        gaps.append(got / dense - 1)
    assert max(gaps) <= DEFAULT_ACCURACY_BUDGET, gaps
