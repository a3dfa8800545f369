"""AdaTopK: densities bring slow links down to the compute bottleneck, within the floor."""

from __future__ import annotations

import numpy as np
import pytest

from fusiond.plan import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    StageSpec,
    TensorEdge,
    adapt_densities,
    evaluate,
    plan_from_stages,
    plan_opfence,
    readapt,
)
from fusiond.plan.model import topk_index_bytes
from fusiond.plan.pipeline import GraphArrays


def _setup(bw01: float, exact: frozenset[str] = frozenset(), floor: float = 0.05) -> tuple[
    GraphArrays, list[StageSpec]
]:
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e10, bwd_flops=2e10) for i in range(4))
    ts = (
        TensorEdge("a", 0, (1,), 4e6, 1e6),
        TensorEdge("b", 1, (2,), 4e6, 1e6),          # crosses the slow cut
        TensorEdge("ids", 1, (2,), 1e5, 1.25e4, grad=False, compressible=False),
        TensorEdge("c", 2, (3,), 4e6, 1e6),
    )
    g = CostGraph(ops, ts)
    ms = [MachineProfile(f"m{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    cl = Cluster.build(ms, np.array([[np.inf, bw01], [bw01, np.inf]]))
    st = JobSettings(micro_batch_size=1, num_micro_batches=8, density_floor=floor,
                     exact_edges=exact)
    return GraphArrays(g, cl, st), [StageSpec(0, 0, 2), StageSpec(1, 2, 4)]


def test_density_brings_link_to_compute_bottleneck() -> None:
    arrays, stages = _setup(1e8)  # 4 MB over 100 MB/s = 40 ms vs 60 ms compute: not needed
    assert adapt_densities(arrays, stages) == {}
    arrays, stages = _setup(2e7)  # 200 ms > 60 ms compute
    dens = adapt_densities(arrays, stages)
    assert set(dens) == {("b", 1)}
    d = dens[("b", 1)]
    assert 0.05 <= d < 1
    ev = evaluate(arrays, stages, dens)
    assert ev.bottleneck.startswith("compute")
    assert ev.links[0].time_s == pytest.approx(ev.compute_bottleneck_s, rel=1e-3)
    # wire cost: an fp16 value per kept element forward, and the kept positions
    assert ev.links[0].fwd_bytes == pytest.approx(1e5 + d * 1e6 * 2 + topk_index_bytes(1e6, d),
                                                  rel=1e-6)


def test_floor_and_exact_edges() -> None:
    arrays, stages = _setup(1e5)  # hopeless link: floor applies, link stays the bottleneck
    dens = adapt_densities(arrays, stages)
    assert dens == {("b", 1): 0.05}
    assert evaluate(arrays, stages, dens).bottleneck.startswith("link")
    arrays, stages = _setup(2e7, exact=frozenset({"b"}))
    assert adapt_densities(arrays, stages) == {}


def test_readapt_same_cut_and_recut_advice() -> None:
    arrays, stages = _setup(1e9)
    g, cl, st = arrays.graph, arrays.cluster, arrays.settings
    plan = plan_from_stages(g, cl, st, stages, compress=True)
    assert plan.densities == {}
    slow = cl.with_bandwidth(np.array([[np.inf, 2e7], [2e7, np.inf]]))
    res = readapt(plan, slow, replan=lambda a: plan_opfence(a.graph, a.cluster, a.settings,
                                                            compress=True))
    assert ("b", 1) in res.densities and res.densities[("b", 1)] < 1
    assert res.recut_iteration_s is not None
    terrible = cl.with_bandwidth(np.array([[np.inf, 1e3], [1e3, np.inf]]))
    res2 = readapt(plan, terrible, replan=lambda a: plan_opfence(a.graph, a.cluster,
                                                                 a.settings, compress=True))
    assert res2.recut_recommended  # one machine alone beats a 1 kB/s link
    assert "re-cut" in res2.reason


def test_compressed_plan_gain_reported() -> None:
    arrays, stages = _setup(2e7)
    plan = plan_from_stages(arrays.graph, arrays.cluster, arrays.settings, stages,
                            compress=True)
    assert plan.gain > 1.5
    assert plan.dense.iteration_s > plan.evaluation.iteration_s
