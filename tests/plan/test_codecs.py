"""The per-link codec choice (AdaTopK's successor): which codecs a budget admits, which one each
slow link gets, how the plan costs it, and re-adaptation over the codec choice."""

from __future__ import annotations

import numpy as np
import pytest

from fusiond.plan import Cluster, CostGraph, JobSettings, MachineProfile, StageSpec, evaluate
from fusiond.plan.accuracy import (
    DEFAULT_ACCURACY_BUDGET,
    MEASURED_GAP,
    admissible,
    ladder,
    most_compressing,
)
from fusiond.plan.adatopk import readapt
from fusiond.plan.codecs import choose_codecs
from fusiond.plan.fence import plan_from_stages, plan_opfence
from fusiond.plan.model import (
    EDGE_ENCODINGS,
    OpCost,
    PlanError,
    TensorEdge,
    encoded_wire_bytes,
    wire_bytes,
)
from fusiond.plan.pipeline import GraphArrays


def _setup(bw01: float, budget: float = DEFAULT_ACCURACY_BUDGET,
           exact: frozenset[str] = frozenset()) -> tuple[GraphArrays, list[StageSpec]]:
    """Two machines, 4 ops of 30 ms each (60 ms per stage per micro-batch); one 4 MB float
    tensor and a small integer one cross the cut."""
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e10, bwd_flops=2e10) for i in range(4))
    ts = (
        TensorEdge("a", 0, (1,), 4e6, 1e6),
        TensorEdge("b", 1, (2,), 4e6, 1e6),          # crosses the cut
        TensorEdge("ids", 1, (2,), 1e5, 1.25e4, grad=False, compressible=False),
        TensorEdge("c", 2, (3,), 4e6, 1e6),
    )
    g = CostGraph(ops, ts)
    ms = [MachineProfile(f"m{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    cl = Cluster.build(ms, np.array([[np.inf, bw01], [bw01, np.inf]]))
    st = JobSettings(micro_batch_size=1, num_micro_batches=8, codec_choice=True,
                     accuracy_budget=budget, exact_edges=exact)
    return GraphArrays(g, cl, st), [StageSpec(0, 0, 2), StageSpec(1, 2, 4)]


def test_the_budget_admits_what_was_measured_within_it() -> None:
    one = ladder(0.01)
    assert [c.label for c in one] == ["raw", "bf16", "int8"]  # each measured at ~0 %
    assert [c.label for c in ladder(0.02)] == ["raw", "bf16", "int8", "int4", "top-k 0.5"]
    assert [c.label for c in ladder(0.05)] == ["raw", "bf16", "int8", "int4", "top-k 0.5",
                                               "lowrank"]
    assert [c.gap for c in ladder(0.2)] == sorted(c.gap for c in ladder(0.2))
    assert most_compressing(0.01).label == "int8" and most_compressing(0.02).label == "int4"
    assert most_compressing(0.2).label == "lowrank"  # 0.25 bytes per element (its P)
    assert "top-k 0.1" not in [c.label for c in ladder(0.2, density_floor=0.2)]
    assert admissible("int8", None, 0.01) and not admissible("int4", None, 0.01)
    assert not admissible("int2", None, 0.5)  # never measured: never admitted
    assert ("raw", None) in MEASURED_GAP and MEASURED_GAP[("raw", None)] == 0.0
    with pytest.raises(PlanError, match="budget"):
        ladder(1.5)


def test_each_slow_link_gets_the_least_lossy_codec_that_suffices() -> None:
    # 4 MB over 100 MB/s = 40 ms < 60 ms of compute: nothing to do
    arrays, stages = _setup(1e8)
    ch = choose_codecs(arrays, stages)
    assert ch.densities == {} and ch.encodings == {}
    # 4 MB at 50 MB/s = 80 ms: bf16 (2 MB, 40 ms) suffices
    arrays, stages = _setup(5e7)
    ch = choose_codecs(arrays, stages)
    assert ch.encodings == {("b", 1): "bf16"} and ch.labels == {(0, 1): "bf16"}
    ev = evaluate(arrays, stages, ch.densities, ch.encodings)
    assert ev.bottleneck.startswith("compute")
    assert ev.links[0].fwd_bytes == pytest.approx(1e5 + 2e6)  # the integer edge stays exact
    # at 25 MB/s bf16 is 80 ms: int8 (1.016 MB, 41 ms)
    arrays, stages = _setup(2.5e7)
    assert choose_codecs(arrays, stages).encodings == {("b", 1): "int8"}


def test_a_hopeless_link_gets_the_most_compressing_admitted_codec() -> None:
    arrays, stages = _setup(1e6)  # 1 MB/s: nothing within 1 % brings it under 60 ms
    ch = choose_codecs(arrays, stages)
    assert ch.encodings == {("b", 1): "int8"}
    ev = evaluate(arrays, stages, ch.densities, ch.encodings)
    assert ev.bottleneck.startswith("link")
    # a looser budget buys the bytes it admits: int4 at 2 %, top-k 0.1 at 20 % (low-rank
    # does not apply to this tensor: no last axis to factor, so it would send it raw)
    assert choose_codecs(*_setup(1e6, 0.02)).encodings == {("b", 1): "int4"}
    loose = choose_codecs(*_setup(1e6, 0.2))
    assert loose.densities == {("b", 1): 0.1} and loose.encodings == {}
    # a zero budget admits only what cost nothing measurable
    assert choose_codecs(*_setup(1e6, 0.0)).encodings == {("b", 1): "int8"}


def test_the_refinement_also_cuts_the_fill() -> None:
    """A link within the bottleneck still adds its time to the fill (one micro-batch through
    every stage and link): with `refine`, each link gets the least lossy admitted codec within
    0.5 % of its fastest choice."""
    arrays, stages = _setup(5e7)  # bf16 brings the link to 40 ms < 60 ms ...
    assert choose_codecs(arrays, stages).encodings == {("b", 1): "bf16"}
    refined = choose_codecs(arrays, stages, refine=True)  # ... int8's 20 ms shortens the fill
    assert refined.encodings == {("b", 1): "int8"} and refined.labels == {(0, 1): "int8"}
    it = {enc: evaluate(arrays, stages, {}, {("b", 1): enc}).iteration_s  # type: ignore[misc]
          for enc in ("bf16", "int8")}
    assert it["int8"] < it["bf16"] * (1 - 0.005)
    arrays, stages = _setup(1e8)  # 40 ms: int8 would save 30 ms of fill, 5 % of the iteration
    assert choose_codecs(arrays, stages).encodings == {}
    assert choose_codecs(arrays, stages, refine=True).encodings == {("b", 1): "int8"}
    arrays, stages = _setup(1e12)  # nothing worth a codec
    assert choose_codecs(arrays, stages, refine=True).encodings == {}


def test_exact_edges_stay_exact() -> None:
    arrays, stages = _setup(1e6, exact=frozenset({"b"}))
    ch = choose_codecs(arrays, stages)
    assert ch.encodings == {} and ch.densities == {}


def test_the_byte_model_of_each_encoding() -> None:
    n = 1 << 20
    assert encoded_wire_bytes(n, "raw") == 4 * n
    assert encoded_wire_bytes(n, "bf16") == 2 * n
    assert encoded_wire_bytes(n, "int8") == n + 4 * n // 256
    assert encoded_wire_bytes(n, "int4") == n // 2 + 4 * n // 256
    # a bf16 tensor gains nothing from bf16, and never costs more than raw
    assert encoded_wire_bytes(n, "bf16", itemsize=2.0) == 2 * n
    assert encoded_wire_bytes(3, "int4", itemsize=2.0) == 6
    t = TensorEdge("b", 1, (2,), 4e6, 1e6)
    st = JobSettings()
    for enc in EDGE_ENCODINGS:
        f, b = wire_bytes(t, 2, 1.0, st, enc)
        assert f == b == encoded_wire_bytes(2e6, enc)
    ids = TensorEdge("ids", 1, (2,), 1e5, 1.25e4, grad=False, compressible=False)
    assert wire_bytes(ids, 1, 1.0, st, "int4") == (1e5, 0.0)
    # low-rank over 128 features keeps rank 16: P (rows x 16, bf16) + Q (128 x 16, fp32)
    # forward, G Q (rows x 16, bf16) back; a tensor without a last axis to factor goes raw
    act = TensorEdge("h", 1, (2,), 64 * 128 * 4, 64 * 128, last_dim=128)
    f, b = wire_bytes(act, 4, 1.0, st, "lowrank")
    assert f == 256 * 16 * 2 + 128 * 16 * 4 and b == 256 * 16 * 2
    assert encoded_wire_bytes(1000, "lowrank") == 4000  # unknown last axis
    flat = TensorEdge("v", 1, (2,), 4e3, 1e3)
    assert wire_bytes(flat, 1, 1.0, st, "lowrank") == (4e3, 4e3)


def test_the_planner_plans_with_the_choice_and_readapts() -> None:
    arrays, stages = _setup(2.5e7)
    g, cl, st = arrays.graph, arrays.cluster, arrays.settings
    plan = plan_from_stages(g, cl, st, stages, compress=True)
    assert plan.edge_encodings() == {"b->1": "int8"} and plan.edge_densities() == {}
    assert plan.gain > 1.5
    # much faster links need nothing (a free codec would save under 0.5 % of the iteration)
    fast = cl.with_bandwidth(np.array([[np.inf, 1e12], [1e12, np.inf]]))
    r = readapt(plan, fast)
    assert r.encodings == {} and r.densities == {}
    # OP-Fence's own search names its method and costs the cut as it will travel
    p = plan_opfence(g, cl, st, compress=True)
    assert p.method == "op-fence+codecs"
    if len(p.stages) == 2:
        assert p.encodings
    with pytest.raises(PlanError, match="codec_choice"):
        JobSettings(codec_choice=True, edge_encoding="int8")
