"""The planner's side of activation checkpointing (`JobSettings.recompute`): a stage whose
kept activations would not fit its machine may recompute them; the evaluator charges it its
inputs per micro-batch in flight plus one micro-batch's activations, and one more forward per
micro-batch; OP-Fence's searches find the cuts that fit only so, and never recompute a stage
that fits without."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fusiond.graph.capture import capture
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.plan import plan_opfence
from fusiond.plan.estimator import cost_graph_from_ir
from fusiond.plan.memory import stage_blocks
from fusiond.plan.model import Cluster, CostGraph, JobSettings, MachineProfile, PlanError
from fusiond.plan.pipeline import GraphArrays, StageSpec, evaluate


@pytest.fixture(scope="module")
def graph() -> CostGraph:
    torch.manual_seed(0)
    model = gpt2("tiny")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    cm = capture(model, [x], targets=x, loss=lm_loss,
                 dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
    return cost_graph_from_ir(cm.graph, {"batch": 8, "seq": 128})


def _cluster(memory_bytes: float, k: int = 3) -> Cluster:
    ms = [MachineProfile(f"m{i}", {"matmul": 1e10, "other": 1e10}, 1e10, 1e-5, memory_bytes)
          for i in range(k)]
    return Cluster.build(ms, np.full((k, k), 1e9))


SETTINGS = JobSettings(micro_batch_size=8, num_micro_batches=8)


def test_a_stage_that_does_not_fit_recomputes_at_the_cost_of_a_forward(graph: CostGraph
                                                                        ) -> None:
    n = len(graph.ops)
    cut = [StageSpec(0, 0, n // 2), StageSpec(1, n // 2, n)]
    roomy = evaluate(GraphArrays(graph, _cluster(1e9, 2), SETTINGS), cut)
    first = roomy.stages[0]
    assert first.inflight == 2 and not first.recompute
    # a machine that holds the first stage's weights and one micro-batch's activations, not two
    arrays = GraphArrays(graph, _cluster(1e9, 2), replace(SETTINGS, recompute=True))
    saved = float(arrays.saved[0:n // 2].sum())
    tight = (first.memory_bytes - 0.5 * saved) / SETTINGS.memory_fraction
    ms = [MachineProfile("m0", {"matmul": 1e10, "other": 1e10}, 1e10, 1e-5, tight),
          MachineProfile("m1", {"matmul": 1e10, "other": 1e10}, 1e10, 1e-5, 1e9)]
    for rc in (False, True):
        a = GraphArrays(graph, Cluster.build(ms, np.full((2, 2), 1e9)),
                        replace(SETTINGS, recompute=rc))
        ev = evaluate(a, cut)
        s0 = ev.stages[0]
        if not rc:
            assert ev.over_memory == ("m0",) and not s0.recompute
            continue
        # the whole stage, or (cheaper where it fits) some of its blocks, recomputes
        assert ev.memory_ok and (s0.recompute or s0.checkpoint_blocks)
        assert not ev.stages[1].recompute and not ev.stages[1].checkpoint_blocks
        assert s0.memory_bytes <= s0.memory_cap
        forward_s = float(a.prefix_f[0, n // 2] - a.prefix_f[0, 0])
        if s0.recompute:
            kept = 2 * float(a.in_bytes[0]) + saved
            assert s0.memory_bytes == pytest.approx(first.memory_bytes - 2 * saved + kept)
            assert s0.compute_s == pytest.approx(first.compute_s + forward_s)
        else:
            blocks, _ = stage_blocks(a, 0, 0, n // 2)
            again = sum(blocks[i].fwd_s for i in s0.checkpoint_blocks)
            assert 0 < again < forward_s
            assert s0.compute_s == pytest.approx(first.compute_s + again)
        assert ev.iteration_s > roomy.iteration_s


def test_opfence_plans_what_fits_only_recomputing_and_nothing_else_changes(graph: CostGraph
                                                                           ) -> None:
    on = replace(SETTINGS, recompute=True)
    roomy = _cluster(1e9)
    a, b = plan_opfence(graph, roomy, SETTINGS), plan_opfence(graph, roomy, on)
    assert [(s.machine, s.start, s.stop) for s in a.stages] == \
        [(s.machine, s.start, s.stop) for s in b.stages]
    assert not any(r.recompute for r in b.evaluation.stages)
    found = False
    for memory in np.geomspace(6e6, 2e6, 12):
        tight = _cluster(float(memory))
        try:
            plan_opfence(graph, tight, SETTINGS)
            continue
        except PlanError:
            pass
        try:
            plan = plan_opfence(graph, tight, on)
        except PlanError:
            break
        ev = plan.evaluation
        assert ev.memory_ok and any(r.recompute or r.checkpoint_blocks for r in ev.stages)
        assert all(r.memory_bytes <= r.memory_cap for r in ev.stages)
        found = True
    assert found, "no machine size where only recomputing fits"
