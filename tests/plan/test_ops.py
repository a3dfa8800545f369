"""OP-Fence with machines that cannot run every op (another torch, or ops an operator disabled):
no stage lands on a machine that lacks one of its ops, the plan is still near the optimum of
the plans that respect that, and a graph with an op no machine runs is refused naming it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fusiond.plan import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    PlanError,
    StageSpec,
    TensorEdge,
    evaluate,
    plan_from_stages,
    plan_opfence,
    render_plan,
)
from fusiond.plan.pipeline import GraphArrays, Plan
from tests.plan.synth import exhaustive, random_instance, restrict


def _graph(ops: list[str], flops: float = 1e10) -> CostGraph:
    costs = tuple(OpCost(f"n{i}", op=op, fwd_flops=flops, bwd_flops=2 * flops)
                  for i, op in enumerate(ops))
    ts = tuple(TensorEdge(f"t{i}", i, (i + 1,), 1e5, 2.5e4) for i in range(len(ops) - 1))
    return CostGraph(costs, ts, name="g")


def _machines(k: int, ops: dict[int, frozenset[str]] | None = None,
              speed: dict[int, float] | None = None) -> list[MachineProfile]:
    """`k` machines; `ops[i]`: the ops machine i runs (absent: all); `speed[i]`: its FLOP/s."""
    ops, speed = ops or {}, speed or {}
    return [MachineProfile(f"m{i}", {"other": speed.get(i, 1e12)}, 1e12, 0.0, 1e12,
                           ops=ops.get(i)) for i in range(k)]


def _violations(plan: Plan) -> list[str]:
    """Stages whose machine lacks one of their ops (checked here, not by the planner)."""
    out = []
    ops = plan.arrays.graph.ops
    for s in plan.stages:
        m = plan.arrays.cluster.machines[s.machine]
        out += [f"{m.id}: {ops[i].op}" for i in range(s.start, s.stop) if not m.runs(ops[i].op)]
    return out


ALL = frozenset({"aten.linear.default", "aten.gelu.default", "aten.add.Tensor"})


def test_the_fastest_machine_gets_no_stage_with_an_op_it_lacks() -> None:
    """m0 is 10x faster than the others: unconstrained, the whole graph goes there; without
    gelu it runs only the parts between the gelus, and the gelus run elsewhere."""
    ops = ["aten.linear.default", "aten.add.Tensor"] * 4 + ["aten.gelu.default"] \
        + ["aten.linear.default", "aten.add.Tensor"] * 4
    g = _graph(ops)
    bw = np.full((3, 3), 1e10)
    free = plan_opfence(g, Cluster.build(_machines(3, speed={0: 1e13}), bw), JobSettings())
    m0 = [s for s in free.stages if s.machine == 0]
    assert m0 and any(g.ops[i].op == "aten.gelu.default"
                      for s in m0 for i in range(s.start, s.stop))  # what the test guards
    runs = {0: ALL - {"aten.gelu.default"}}
    plan = plan_opfence(g, Cluster.build(_machines(3, runs, {0: 1e13}), bw), JobSettings())
    assert _violations(plan) == []
    assert plan.evaluation.feasible
    assert any(s.machine == 0 for s in plan.stages)  # still used, for what it can run
    assert "m0 cannot run aten.gelu.default" in render_plan(plan)


def test_a_machine_lacking_an_op_of_every_stage_is_left_idle_with_the_reason() -> None:
    g = _graph(["aten.linear.default"] * 6)
    cl = Cluster.build(_machines(3, {1: ALL - {"aten.linear.default"}}), np.full((3, 3), 1e10))
    plan = plan_opfence(g, cl, JobSettings())
    assert all(s.machine != 1 for s in plan.stages)
    assert "cannot run op aten.linear.default" in plan.idle["m1"]


def test_an_op_no_machine_runs_is_refused_naming_it_and_the_machines() -> None:
    g = _graph(["aten.linear.default", "aten.gelu.default", "aten.add.Tensor"])
    runs = {i: ALL - {"aten.gelu.default"} for i in range(2)}
    with pytest.raises(PlanError, match=r"no machine .* runs op 'aten.gelu.default'.*m0, m1"):
        plan_opfence(g, Cluster.build(_machines(2, runs), np.full((2, 2), 1e10)),
                     JobSettings())


def test_an_order_no_pipeline_can_place_is_refused() -> None:
    """a only on m0, b only on m1, then a again: m0 would need two stages."""
    g = _graph(["aten.linear.default", "aten.gelu.default", "aten.linear.default"])
    runs = {0: frozenset({"aten.linear.default"}), 1: frozenset({"aten.gelu.default"})}
    with pytest.raises(PlanError, match="runs every op"):
        plan_opfence(g, Cluster.build(_machines(2, runs), np.full((2, 2), 1e10)),
                     JobSettings())


def test_the_evaluator_reports_a_stage_its_machine_cannot_run() -> None:
    g = _graph(["aten.linear.default", "aten.gelu.default"])
    cl = Cluster.build(_machines(2, {1: frozenset({"aten.linear.default"})}),
                       np.full((2, 2), 1e10))
    ev = evaluate(GraphArrays(g, cl, JobSettings()), [StageSpec(0, 0, 1), StageSpec(1, 1, 2)])
    assert ev.unrunnable == ("m1: aten.gelu.default",) and not ev.feasible and ev.memory_ok
    given = plan_from_stages(g, cl, JobSettings(), [StageSpec(1, 0, 2)])
    assert "CANNOT RUN: m1: aten.gelu.default" in render_plan(given)


def test_machine_ops_survive_to_dict_and_scaling() -> None:
    from fusiond.plan import scale_machine

    m = _machines(1, {0: frozenset({"aten.add.Tensor"})})[0]
    assert MachineProfile.from_dict(m.to_dict()).ops == m.ops
    assert MachineProfile.from_dict(_machines(1)[0].to_dict()).ops is None
    assert scale_machine(m, parallel=0.5, serial=0.5).ops == m.ops
    assert m.runs("aten.add.Tensor") and not m.runs("aten.gelu.default") and m.runs("")


@pytest.mark.slow
def test_quality_with_op_restrictions_against_exhaustive_search() -> None:
    """Random instances whose machines each lack a random subset of 4 op kinds: never a stage
    on a machine lacking one of its ops; infeasible only when the oracle is too; within 5 %
    of the oracle's optimum (over the plans that respect the restrictions) in >= 90 %."""
    rng = np.random.default_rng(4242)
    good = total = refused = 0
    worst = 1.0
    for _ in range(80):
        inst = restrict(random_instance(rng, max_machines=5, max_ops=10), rng)
        opt, _ = exhaustive(inst)
        try:
            plan = plan_opfence(inst.graph, inst.cluster, inst.settings)
        except PlanError:
            refused += 1
            assert not math.isfinite(opt), "a feasible instance was refused"
            continue
        assert _violations(plan) == []
        assert plan.evaluation.feasible
        assert math.isfinite(opt) and plan.iteration_s >= opt * (1 - 1e-9)
        total += 1
        worst = max(worst, plan.iteration_s / opt)
        good += plan.iteration_s / opt <= 1.05
    assert total >= 40 and refused >= 1  # both kinds occur
    print(f"restricted: {good}/{total} within 5 %, worst {worst:.3f}, {refused} refused")
    assert good / total >= 0.9, f"{good}/{total} within 5 %, worst {worst:.3f}"


def test_large_graphs_respect_restrictions_at_candidate_cuts() -> None:
    """Past `max_cuts` ops the DP cuts only at candidate positions: the positions where a
    machine starts or stops running the ops are candidates, so a restricted machine still
    gets a stage of what it can run."""
    ops = (["aten.linear.default"] * 300 + ["aten.gelu.default"]
           + ["aten.linear.default"] * 300)
    g = _graph(ops, flops=1e8)
    runs = {0: ALL - {"aten.linear.default"}}  # m0 runs only the gelu
    cl = Cluster.build(_machines(3, runs, {0: 1e13}), np.full((3, 3), 1e10))
    plan = plan_opfence(g, cl, JobSettings(), max_cuts=64)
    assert _violations(plan) == []
    assert [(s.start, s.stop) for s in plan.stages if s.machine == 0] in ([], [(300, 301)])
