"""The planner's side of optimizer-state offload (`JobSettings.offload`): a stage whose state
would not fit its machine may keep its optimizer state on disk; the evaluator then counts no
memory for it and charges reading and writing it once per step at the disk's rate; it picks,
per stage, the cheapest of recompute, offload and both that fits, and nothing where the plain
stage fits; OP-Fence finds the cuts that fit only so."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from fusiond.graph.capture import capture
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.plan import plan_opfence
from fusiond.plan.estimator import cost_graph_from_ir
from fusiond.plan.model import (
    DEFAULT_DISK_BYTES_PER_S,
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    PlanError,
)
from fusiond.plan.pipeline import GraphArrays, StageReport, StageSpec, _stage_static, evaluate


@pytest.fixture(scope="module")
def graph() -> CostGraph:
    torch.manual_seed(0)
    model = gpt2("tiny")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    cm = capture(model, [x], targets=x, loss=lm_loss,
                 dynamic=[{0: "batch", 1: "seq"}, {0: "batch", 1: "seq"}])
    return cost_graph_from_ir(cm.graph, {"batch": 2, "seq": 16},
                              optimizer_state_factor=2.0)


def _machine(name: str, memory_bytes: float, disk: float = 0.0) -> MachineProfile:
    return MachineProfile(name, {"matmul": 1e10, "other": 1e10}, 1e10, 1e-5, memory_bytes,
                          disk_bytes_per_s=disk)


SETTINGS = JobSettings(micro_batch_size=2, num_micro_batches=4)


def test_a_stage_whose_optimizer_state_does_not_fit_keeps_it_on_disk(graph: CostGraph) -> None:
    one = [StageSpec(0, 0, len(graph.ops))]
    roomy = evaluate(GraphArrays(graph, Cluster.build([_machine("m0", 1e9)], np.zeros((1, 1))),
                                 SETTINGS), one).stages[0]
    assert not roomy.offload and not roomy.recompute
    opt = float(sum(o.opt_state_bytes for o in graph.ops))
    assert opt > 0
    # room for everything but the optimizer state (and less than recomputing would save)
    tight = (roomy.memory_bytes - 0.6 * opt) / SETTINGS.memory_fraction
    for offload in (False, True):
        cl = Cluster.build([_machine("m0", tight, disk=1e8)], np.zeros((1, 1)))
        a = GraphArrays(graph, cl, replace(SETTINGS, offload=offload))
        ev = evaluate(a, one)
        s = ev.stages[0]
        if not offload:
            assert ev.over_memory == ("m0",) and not s.offload
            continue
        assert ev.memory_ok and s.offload and not s.recompute
        # the stage's own optimizer state (tied weights once) no longer counts
        _, stage_opt, _ = _stage_static(graph, 0, len(graph.ops))
        assert s.memory_bytes == pytest.approx(roomy.memory_bytes - stage_opt)
        # the state read and written once per step at 100 MB/s, in the optimizer's time
        base = evaluate(GraphArrays(graph, Cluster.build([_machine("m0", 1e9)],
                                                          np.zeros((1, 1))), SETTINGS), one)
        assert ev.optimizer_s == pytest.approx(base.optimizer_s + 2 * stage_opt / 1e8)
        assert ev.iteration_s > base.iteration_s


def test_the_cheaper_of_recompute_and_offload_wins(graph: CostGraph) -> None:
    n = len(graph.ops)
    cut = [StageSpec(0, 0, n // 2), StageSpec(1, n // 2, n)]  # stage 0: 2 in flight
    settings = replace(SETTINGS, recompute=True, offload=True)

    def first(cap: float, disk: float) -> StageReport:
        cl = Cluster.build([_machine("m0", cap, disk), _machine("m1", 1e9)],
                           np.full((2, 2), 1e9))
        return evaluate(GraphArrays(graph, cl, settings), cut).stages[0]

    base = first(1e9, 0.0)
    assert base.inflight == 2 and not base.offload and not base.recompute
    _, opt, _ = _stage_static(graph, 0, n // 2)
    a = GraphArrays(graph, Cluster.build([_machine("m0", 1e9)], np.zeros((1, 1))), settings)
    rc_saves = float(a.saved[0:n // 2].sum()) - 2 * float(a.in_bytes[0])
    assert opt > 0 and rc_saves > 0
    # short of half the smaller saving: either one alone fits
    cap = (base.memory_bytes - 0.5 * min(opt, rc_saves)) / SETTINGS.memory_fraction
    fast_disk, slow_disk = first(cap, 1e13), first(cap, 1e3)
    assert fast_disk.offload and not fast_disk.recompute
    # a slow disk: recomputing (the whole stage, or the blocks that free enough) instead
    assert (slow_disk.recompute or slow_disk.checkpoint_blocks) and not slow_disk.offload
    # an unmeasured disk counts at the default rate
    assert _machine("x", 1.0).disk_rate_bytes_per_s == DEFAULT_DISK_BYTES_PER_S


def test_opfence_plans_what_fits_only_offloading(graph: CostGraph) -> None:
    static = float(sum(2 * o.param_bytes + o.opt_state_bytes for o in graph.ops))
    opt = float(sum(o.opt_state_bytes for o in graph.ops))
    # three machines with a third of the static state each (tied weights counted per user,
    # so it is generous) less a tenth of the optimizer state: no cut fits, even recomputing,
    # unless stages keep their optimizer state on disk (with 15 % less, not even then)
    memory = (static - 0.1 * opt) / 3 / SETTINGS.memory_fraction
    cl = Cluster.build([_machine(f"m{i}", memory) for i in range(3)], np.full((3, 3), 1e9))
    with pytest.raises(PlanError):
        plan_opfence(graph, cl, replace(SETTINGS, recompute=True))
    plan = plan_opfence(graph, cl, replace(SETTINGS, recompute=True, offload=True))
    ev = plan.evaluation
    assert ev.memory_ok and any(r.offload for r in ev.stages)
    assert all(r.memory_bytes <= r.memory_cap for r in ev.stages)
    text = __import__("fusiond.plan", fromlist=["render_plan"]).render_plan(plan)
    assert "offload" in text
