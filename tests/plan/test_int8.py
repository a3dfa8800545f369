"""Int8 cut edges in the planner: costed at their wire size both ways, never also top-k."""

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
    adapt_densities,
    evaluate,
    plan_from_stages,
    plan_opfence,
)
from fusiond.plan.model import int8_wire_bytes, wire_bytes
from fusiond.plan.pipeline import GraphArrays

ACT = TensorEdge("b", 1, (2,), 4e6, 1e6)  # 1e6 fp32 elements per sample


def _instance(bw_bytes_per_s: float, *, int8: bool, exact: frozenset[str] = frozenset()
              ) -> tuple[CostGraph, Cluster, JobSettings]:
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e10, bwd_flops=2e10) for i in range(4))
    ts = (
        TensorEdge("a", 0, (1,), 4e6, 1e6),
        ACT,
        TensorEdge("ids", 1, (2,), 1e5, 1.25e4, grad=False, compressible=False),
        TensorEdge("c", 2, (3,), 4e6, 1e6),
    )
    ms = [MachineProfile(f"m{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    cl = Cluster.build(ms, np.array([[np.inf, bw_bytes_per_s], [bw_bytes_per_s, np.inf]]))
    st = JobSettings(micro_batch_size=1, num_micro_batches=8, exact_edges=exact,
                     edge_encoding="int8" if int8 else "raw")
    return CostGraph(ops, ts), cl, st


def test_an_int8_edge_costs_a_byte_per_element_and_a_scale_per_256_both_ways() -> None:
    st = JobSettings(edge_encoding="int8")
    for batch in (1, 3):
        n = batch * ACT.numel
        f, b = wire_bytes(ACT, batch, 1.0, st)
        assert f == b == n + 4 * math.ceil(n / 256) == int8_wire_bytes(n)
        assert f / (batch * ACT.nbytes) == pytest.approx((1 + 4 / 256) / 4, rel=1e-5)
    # a density does not turn an int8 edge into a top-k one
    assert wire_bytes(ACT, 1, 0.05, st) == wire_bytes(ACT, 1, 1.0, st)
    no_grad = TensorEdge("m", 0, (1,), 4e6, 1e6, grad=False)
    assert wire_bytes(no_grad, 1, 1.0, st) == (int8_wire_bytes(1e6), 0.0)
    # exact and non-float tensors stay dense
    ids = TensorEdge("ids", 0, (1,), 1e5, 1.25e4, grad=False, compressible=False)
    assert wire_bytes(ids, 2, 1.0, st) == (2e5, 0.0)
    marked = JobSettings(edge_encoding="int8", exact_edges=frozenset({"b"}))
    assert wire_bytes(ACT, 1, 1.0, marked) == (4e6, 4e6)
    # without int8: today's dense and top-k costs
    assert wire_bytes(ACT, 1, 1.0, JobSettings()) == (4e6, 4e6)


def test_the_evaluation_charges_int8_bytes_on_the_cut() -> None:
    g, cl, st = _instance(2e7, int8=True)
    stages = [StageSpec(0, 0, 2), StageSpec(1, 2, 4)]
    ev = evaluate(GraphArrays(g, cl, st), stages)
    (lk,) = ev.links
    assert lk.fwd_bytes == pytest.approx(int8_wire_bytes(1e6) + 1e5)  # b int8, ids exact
    assert lk.bwd_bytes == pytest.approx(int8_wire_bytes(1e6))
    assert lk.dense_fwd_bytes == pytest.approx(4e6 + 1e5)
    dense = evaluate(GraphArrays(*_instance(2e7, int8=False)), stages)
    assert ev.iteration_s < dense.iteration_s


def test_adatopk_does_not_apply_to_int8_edges() -> None:
    stages = [StageSpec(0, 0, 2), StageSpec(1, 2, 4)]
    slow = 1e5  # so slow that AdaTopK would compress to its floor
    assert adapt_densities(GraphArrays(*_instance(slow, int8=False)), stages)
    assert adapt_densities(GraphArrays(*_instance(slow, int8=True)), stages) == {}
    g, cl, st = _instance(slow, int8=True)
    with pytest.raises(PlanError, match="int8"):
        plan_opfence(g, cl, st, compress=True)
    with pytest.raises(PlanError, match="int8"):
        plan_from_stages(g, cl, st, stages, compress=True)


def test_int8_costing_changes_the_planners_choice() -> None:
    # 4 MB each way per micro-batch over 20 MB/s: dense, the split waits 200 ms per
    # micro-batch on the link and one machine alone is faster; int8 (1 MB) makes the split win
    dense = plan_opfence(*_instance(2e7, int8=False))
    q = plan_opfence(*_instance(2e7, int8=True))
    assert len(dense.stages) == 1
    assert len(q.stages) == 2 and q.method == "op-fence+int8" and q.densities == {}
    assert q.iteration_s < dense.iteration_s
    assert q.evaluation.links[0].fwd_bytes < 0.3 * q.evaluation.links[0].dense_fwd_bytes
