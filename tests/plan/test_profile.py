"""Machine profiles (calibration, the gossiped dict) and the reference topologies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusiond.plan import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    PlanError,
    TensorEdge,
    cluster_from_topology,
    fence_groups,
)

TOPOLOGIES = Path(__file__).resolve().parents[2] / "bench" / "topologies"


def test_calibrate_measures_positive_rates() -> None:
    pytest.importorskip("torch")
    from fusiond.profile.calibrate import calibrate

    p = calibrate("here", scale=0.1, repeats=1)
    assert p.id == "here"
    for cls in ("matmul", "conv", "attention", "other"):
        assert cls in p.flops and 1e6 < p.rate(cls) < 1e16
    assert 1e6 < p.mem_bw < 1e14
    assert 0 < p.op_overhead_s < 1e-2
    assert p.memory_bytes > 2**20
    assert MachineProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_profile_dict_errors_name_the_field() -> None:
    good = MachineProfile("a", {"matmul": 1e9}, 1e9, 1e-6, 1e9).to_dict()
    bad = dict(good)
    del bad["mem_bw"]
    with pytest.raises(PlanError, match="mem_bw"):
        MachineProfile.from_dict(bad)
    with pytest.raises(PlanError, match="flops"):
        MachineProfile("a", {"matmul": -1.0}, 1e9, 1e-6, 1e9)
    # an unknown op class falls back to "other", else the slowest known class
    p = MachineProfile("a", {"matmul": 4e9, "other": 1e9}, 1e9, 0.0, 1e9)
    assert p.rate("conv") == 1e9


@pytest.mark.parametrize("path", sorted(TOPOLOGIES.glob("*.json")), ids=lambda p: p.stem)
def test_reference_topologies(path: Path) -> None:
    cluster, group = cluster_from_topology(json.loads(path.read_text()))
    assert len(cluster) == 48
    assert len(set(group)) == 6
    off = cluster.bandwidth_bytes_per_s[~np.eye(48, dtype=bool)] * 8 / 1e6
    assert off.min() >= 8 - 1e-9 and off.max() <= 10000 + 1e-9
    assert len({m.kind for m in cluster.machines}) >= 2
    # the fences find the sites (campus: its two 1 Gbit/s labs, joined at 1 Gbit/s, are one)
    assert 5 <= len(fence_groups(cluster)) <= 6
    assert all(math.isfinite(x) for x in cluster.rtt_s.ravel())


def test_topology_errors_name_the_field() -> None:
    with pytest.raises(PlanError, match="kinds"):
        cluster_from_topology({"name": "x", "groups": []})


def test_planner_is_pure() -> None:
    """fusiond.plan pulls in no I/O or torch (calibration, which runs torch, is
    fusiond.profile.calibrate)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, json, fusiond.plan\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m.split(".")[0] in ("torch", "asyncio", "socket", "aiohttp")]
    assert not bad, f"fusiond.plan imported {bad[:5]}"


_BASE = MachineProfile("m", {"matmul": 4e10, "conv": 2e10, "other": 1e9}, mem_bw=2e10,
                       op_overhead_s=1e-5, memory_bytes=2**30, kind="cpu:1t")


@given(st.floats(min_value=0.05, max_value=64))
def test_stage_compute_is_work_over_the_speed_at_the_cpu_share(cores: float) -> None:
    """A host on a quota of `cores` (one thread) computes every op min(1, cores) times slower:
    rates, memory bandwidth and the dispatch cost all follow the share."""
    from fusiond.plan.model import op_times
    from fusiond.profile.calibrate import at_allowance
    from tests.plan.synth import random_instance

    g = random_instance(np.random.default_rng(3)).graph
    slow = at_allowance(_BASE, 1, cores)
    share = min(1.0, cores)
    assert op_times(g, slow, 4) == pytest.approx(op_times(g, _BASE, 4) / share, rel=1e-9)
    # more threads than cores: the quota binds, not the thread count
    many = at_allowance(_BASE, 8, cores)
    assert many.rate("matmul") == pytest.approx(_BASE.rate("matmul") * min(8.0, cores))
    assert many.op_overhead_s == pytest.approx(_BASE.op_overhead_s / share)


def test_wall_clock_rates_cap_an_optimistic_thread_count() -> None:
    from fusiond.plan.model import slower_of
    from fusiond.profile.calibrate import at_allowance

    wall = MachineProfile("w", {"matmul": 6e10, "other": 5e9}, mem_bw=3e10,
                          op_overhead_s=2e-5, memory_bytes=1.0)
    got = at_allowance(_BASE, 2, 2.0, wall)  # perfect scaling would say 8e10 for matmul
    assert got.rate("matmul") == 6e10 and got.rate("other") == 2e9
    assert got.rate("conv") == 5e9  # wall has no conv: its "other" rate caps it
    assert got.mem_bw == 3e10 and got.op_overhead_s == 2e-5
    assert got.id == "m" and got.memory_bytes == 2**30
    assert slower_of(_BASE, _BASE) == _BASE


def test_cpu_share_must_be_positive() -> None:
    from fusiond.plan.model import scale_machine

    with pytest.raises(PlanError, match="CPU shares"):
        scale_machine(_BASE, parallel=0.0, serial=1.0)
    with pytest.raises(PlanError, match="CPU shares"):
        scale_machine(_BASE, parallel=1.0, serial=math.inf)


def test_calibration_is_per_cpu_second_then_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from fusiond.profile import calibrate as cal

    seen: list[bool | None] = []

    def fake_measure(machine_id: str = "local", **kw: object) -> MachineProfile:
        seen.append(kw.get("per_cpu_second"))  # type: ignore[arg-type]
        return MachineProfile(machine_id, dict(_BASE.flops), _BASE.mem_bw, _BASE.op_overhead_s,
                              _BASE.memory_bytes, kind="cpu:1t", wire_s_per_byte=1e-9)

    monkeypatch.setattr(cal, "measure", fake_measure)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    quarter = cal.calibrate("a", cpu_cores=0.25)
    assert seen == [True]  # one thread: no wall-clock measurement
    assert quarter.rate("matmul") == pytest.approx(_BASE.rate("matmul") * 0.25)
    assert quarter.wire_s_per_byte == pytest.approx(4e-9)
    assert quarter.kind == "cpu:1t@0.25c"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    seen.clear()
    cal.calibrate("a", cpu_cores=2.0)
    assert seen == [True, False]  # more threads: capped by a wall-clock measurement


@given(st.integers(min_value=0, max_value=10_000), st.floats(min_value=1e-10, max_value=1e-8),
       st.floats(min_value=1e-6, max_value=1e-3))
def test_a_stage_pays_for_every_byte_and_message_it_sends_or_receives(
        seed: int, per_byte: float, per_msg: float) -> None:
    from dataclasses import replace

    from fusiond.plan.pipeline import GraphArrays, StageSpec, evaluate
    from tests.plan.synth import random_instance

    inst = random_instance(np.random.default_rng(seed))
    n = len(inst.graph.ops)
    stages = [StageSpec(0, 0, n // 2), StageSpec(1, n // 2, n)]
    free = evaluate(GraphArrays(inst.graph, inst.cluster, inst.settings), stages)
    costly = replace(inst.cluster, machines=tuple(
        replace(m, wire_s_per_byte=per_byte, msg_s=per_msg) for m in inst.cluster.machines))
    ev = evaluate(GraphArrays(inst.graph, costly, inst.settings), stages)
    assert all(r.wire_cpu_s == 0 for r in free.stages)
    nbytes = sum(lk.fwd_bytes + lk.bwd_bytes for lk in ev.links)
    msgs = sum(lk.fwd_msgs + lk.bwd_msgs for lk in ev.links)
    assert msgs == sum(1 + (1 if t.grad else 0) for t in inst.graph.tensors
                       if t.src < n // 2 <= max(t.dsts))
    for r, f in zip(ev.stages, free.stages, strict=True):
        # both ends of the one cut pay for all of its traffic
        assert r.wire_cpu_s == pytest.approx(nbytes * per_byte + msgs * per_msg)
        assert r.compute_s == f.compute_s and r.busy_s == r.compute_s + r.wire_cpu_s
    assert ev.iteration_s >= free.iteration_s


@given(st.integers(min_value=0, max_value=10_000), st.floats(min_value=0.0, max_value=0.1),
       st.floats(min_value=0.0, max_value=0.1))
def test_every_hand_off_wakes_both_hosts_in_each_direction(
        seed: int, wake_a: float, wake_b: float) -> None:
    """Under a CFS quota a hand-off waits for the sender's and the receiver's next period:
    each hop between consecutive stages pays both hosts' `wake_s`, forward and backward. A
    stage's tasks run as one loop on its compute thread: no wake-up per task."""
    from dataclasses import replace

    from fusiond.plan.pipeline import GraphArrays, StageSpec, evaluate
    from tests.plan.synth import random_instance

    inst = random_instance(np.random.default_rng(seed))
    n = len(inst.graph.ops)
    if len(inst.cluster.machines) < 3 or n < 3:
        return
    stages = [StageSpec(0, 0, 1), StageSpec(1, 1, n - 1), StageSpec(2, n - 1, n)]
    free = evaluate(GraphArrays(inst.graph, inst.cluster, inst.settings), stages)
    wakes = [wake_a, wake_b] + [wake_a] * (len(inst.cluster.machines) - 2)
    slow = replace(inst.cluster, machines=tuple(
        replace(m, wake_s=w) for m, w in zip(inst.cluster.machines, wakes, strict=True)))
    ev = evaluate(GraphArrays(inst.graph, slow, inst.settings), stages)
    assert all(r.busy_s == pytest.approx(f.busy_s)
               for r, f in zip(ev.stages, free.stages, strict=True))
    hops = 2 * (wake_a + wake_b) + 2 * (wake_b + wake_a)
    assert ev.fill_s == pytest.approx(free.fill_s + hops)
    assert ev.bottleneck_s == pytest.approx(free.bottleneck_s)
    assert ev.iteration_s >= free.iteration_s + hops - 1e-12
    one = evaluate(GraphArrays(inst.graph, slow, inst.settings), [StageSpec(0, 0, n)])
    alone = evaluate(GraphArrays(inst.graph, inst.cluster, inst.settings), [StageSpec(0, 0, n)])
    assert one.fill_s == pytest.approx(alone.fill_s)  # no hand-off, no wake-up


def _tied_chain(holder_bw: float) -> tuple[CostGraph, Cluster, JobSettings]:
    """Three ops on three machines; ops 0 and 2 share the weight "w" (an embedding and its
    tied head); the consecutive links run at 1 GB/s, the holders' own link at `holder_bw`."""
    ops = (OpCost("emb", fwd_flops=1e9, bwd_flops=2e9, param_bytes=4e6, params=("w",)),
           OpCost("mid", fwd_flops=1e9, bwd_flops=2e9),
           OpCost("head", fwd_flops=1e9, bwd_flops=2e9, param_bytes=4e6, params=("w",)))
    ts = (TensorEdge("a", 0, (1,), 1e5, 1e5 / 4), TensorEdge("b", 1, (2,), 1e5, 1e5 / 4))
    machines = [MachineProfile(f"m{i}", {"other": 1e11}, 1e11, 0.0, 1e12) for i in range(3)]
    bw = [[math.inf, 1e9, holder_bw], [1e9, math.inf, 1e9], [holder_bw, 1e9, math.inf]]
    return CostGraph(ops, ts), Cluster.build(machines, bw), JobSettings(num_micro_batches=4)


def test_tied_weights_exchange_shows_only_beyond_the_next_forward() -> None:
    """The embedding's stage sends its gradient of the tied weight to the head's stage at the
    end of an iteration; the head needs it only before its next forward, which first runs
    through the stages in between. So a fast exchange costs nothing, and a slow one costs
    what it takes beyond that forward, one for one."""
    from fusiond.plan.pipeline import GraphArrays, StageSpec, evaluate

    stages = [StageSpec(0, 0, 1), StageSpec(1, 1, 2), StageSpec(2, 2, 3)]

    def sync(bw: float) -> float:
        return evaluate(GraphArrays(*_tied_chain(bw)), stages).sync_s

    assert sync(1e9) == 0.0  # 4 ms of transfer hides behind a 20 ms forward
    slow, slower = sync(1e6), sync(5e5)  # 4 s and 8 s
    assert 3.9 < slow < 4.0  # the forward ahead of the head is ~20 ms
    assert slower - slow == pytest.approx(4.0)
    # one stage holding both: nothing to exchange
    assert evaluate(GraphArrays(*_tied_chain(1e6)), [StageSpec(0, 0, 3)]).sync_s == 0.0


def test_wake_up_is_part_of_the_gossiped_machine() -> None:
    m = MachineProfile("x", {"other": 1e9}, 1e9, 0.0, 1e9, wake_s=0.008)
    assert MachineProfile.from_dict(m.to_dict()).wake_s == 0.008
    with pytest.raises(PlanError, match="wake_s"):
        MachineProfile("x", {"other": 1e9}, 1e9, 0.0, 1e9, wake_s=-1.0)
    legacy = {k: v for k, v in m.to_dict().items() if k != "wake_s"}
    assert MachineProfile.from_dict(legacy).wake_s == 0.0  # an older daemon's profile


def test_attention_has_its_own_rate_and_falls_back_to_matmul() -> None:
    """Attention is its own op class (its small per-head products run far below a big
    matmul's rate); a profile without it (an older daemon's) prices it as a matmul."""
    from fusiond.plan import cost_graph_from_ir
    from protocol import ir

    q = ir.TensorMeta((2, 4, 16, 8), "float32")
    r = ir.Ref(ir.RefKind.INPUT, "q")
    g = ir.Graph(inputs=(ir.InputSpec("q", q),),
                 outputs=(ir.OutputSpec("o", ir.Ref(ir.RefKind.NODE, "sdpa")),), params=(),
                 nodes=(ir.Node("sdpa", "aten.scaled_dot_product_attention.default",
                                (r, r, r), {}, (q,)),), symbols={})
    (op,) = cost_graph_from_ir(g, {}).ops
    assert op.op_class == "attention"
    old = MachineProfile("a", {"matmul": 4e9, "other": 1e9}, 1e9, 0.0, 1e9)
    assert old.rate("attention") == 4e9
    new = MachineProfile("a", {"matmul": 4e9, "attention": 2e9, "other": 1e9}, 1e9, 0.0, 1e9)
    assert new.rate("attention") == 2e9


def test_calibrated_rates_price_a_networks_nonlinear_ops() -> None:
    """The calibration of class "other" times the ops a network really runs between its
    matmuls (tanh GELU, norms, softmax), so the planner's time for a block of them is within
    2x of its measured CPU time. It used to time one large erf GELU, 3-7x faster per FLOP
    than these, and predicted such a block at a quarter of its time."""
    import time

    import torch

    from fusiond.graph.capture import capture
    from fusiond.plan import cost_graph_from_ir
    from fusiond.plan.estimator import batch_symbol
    from fusiond.plan.model import op_times
    from fusiond.profile.calibrate import calibrate

    class Between(torch.nn.Module):
        """The ops between a network's products, and no product: all of class "other"."""

        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = torch.nn.functional
            h = f.gelu(self.norm(x), approximate="tanh")
            return f.silu(f.softmax(h, -1) * h)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Between(512)
        rows = 128
        x = torch.randn(rows, 512)
        cm = capture(model, [x], targets=x, loss=lambda out, t: (out * t).sum())
        sym = batch_symbol(cm.graph)
        cg = cost_graph_from_ir(cm.graph, {sym: rows} if sym else {})
        assert {o.op_class for o in cg.ops} == {"other"}
        prof = calibrate("here", repeats=3, cpu_cores=1.0)
        predicted_s = float(op_times(cg, prof, rows if sym else 1).sum())

        def step() -> None:
            model.zero_grad()
            (model(x) * x).sum().backward()

        step()
        times = []
        for _ in range(7):
            t0 = time.thread_time()
            step()
            times.append(time.thread_time() - t0)
    finally:
        torch.set_num_threads(threads)
    measured_s = sorted(times)[len(times) // 2]
    assert 0.5 < predicted_s / measured_s < 2.0, (predicted_s, measured_s)


def test_a_products_rate_follows_its_size_between_the_two_calibrated_products() -> None:
    """With a rate at a small product beside the big one ("matmul_small"), a matmul-class op
    runs at the small rate up to the small product's size, at the big rate from the big one's
    on, linearly in between in the log of its FLOPs per call; a profile without it (an
    older daemon's, a topology file's) prices every product at the one "matmul" rate."""
    from fusiond.plan.model import (
        MATMUL_SHAPES,
        SMALL_MATMUL,
        TINY_MATMUL,
        matmul_flops_per_call,
        matmul_rates,
        op_times,
    )

    lo = matmul_flops_per_call(MATMUL_SHAPES[SMALL_MATMUL])
    hi = matmul_flops_per_call(MATMUL_SHAPES["matmul"])
    both = MachineProfile("a", {"matmul": 8e10, SMALL_MATMUL: 2e10, "other": 1e9}, 1e12, 0.0,
                          1e9)
    sizes = np.array([1.0, lo / 10, lo, math.sqrt(lo * hi), hi, hi * 10])
    got = matmul_rates(both, sizes)
    assert got.tolist() == pytest.approx([2e10, 2e10, 2e10, 5e10, 8e10, 8e10])
    assert np.all(np.diff(matmul_rates(both, np.geomspace(1, hi * 4, 50))) >= 0)
    old = MachineProfile("a", {"matmul": 8e10, "other": 1e9}, 1e12, 0.0, 1e9)
    assert matmul_rates(old, sizes).tolist() == [8e10] * len(sizes)
    assert old.rate(SMALL_MATMUL) == 8e10 and old.rate(TINY_MATMUL) == 8e10
    # a third, tinier product: piecewise between neighbours, the same above the small one
    tiny = matmul_flops_per_call(MATMUL_SHAPES[TINY_MATMUL])
    three = MachineProfile("a", {**both.flops, TINY_MATMUL: 5e9}, 1e12, 0.0, 1e9)
    got3 = matmul_rates(three, np.array([1.0, tiny, math.sqrt(tiny * lo), lo, hi]))
    assert got3.tolist() == pytest.approx([5e9, 5e9, 1.25e10, 2e10, 8e10])
    assert matmul_rates(three, sizes[2:]).tolist() == pytest.approx(got[2:].tolist())

    # in op_times: one linear op whose per-sample FLOPs make it the small product at batch 1
    per_sample = lo / 3  # forward; backward twice that
    g = CostGraph([OpCost("mm", op="mm", op_class="matmul", fwd_flops=per_sample,
                          bwd_flops=2 * per_sample, fwd_launches=0)], [])
    assert float(op_times(g, both, 1)[0]) == pytest.approx(lo / 2e10)
    assert float(op_times(g, old, 1)[0]) == pytest.approx(lo / 8e10)
    # a bigger micro-batch makes a bigger product: a faster rate per FLOP
    t4 = float(op_times(g, both, 4)[0])
    assert lo * 4 / 8e10 < t4 < lo * 4 / 2e10


@pytest.mark.timed
@pytest.mark.parametrize("width", [256, 32])
def test_the_calibration_prices_a_small_models_products_at_their_own_rate(width: int) -> None:
    """The products of a narrow transformer (256 tokens through a block of `width` features:
    the yardstick's GPT-2 and GPT-2 tiny at a micro-batch of 4 x 64) are predicted within 25 %
    of their measured CPU time. At the big product's rate alone they came out 14 % (256 wide)
    and about 50 % (32 wide) fast on an Intel Xeon, 1 thread. Timed: up to three tries, each
    calibrating and measuring back to back (a neighbour's load on a shared core moves both)."""
    import time

    import torch

    from fusiond.plan.model import matmul_rates
    from fusiond.profile.calibrate import calibrate

    f = torch.nn.functional

    def attempt() -> tuple[float, float]:
        prof = calibrate("here", repeats=5, cpu_cores=1.0)
        measured, predicted = 0.0, 0.0
        for k, n in ((width, 3 * width), (width, width), (width, 4 * width),
                     (4 * width, width)):
            x = torch.randn(256, k, requires_grad=True)
            w = torch.randn(n, k, requires_grad=True)
            go = torch.randn(256, n)
            for _ in range(3):
                f.linear(x, w).backward(go)
            times = []
            for _ in range(15):
                t0 = time.thread_time()
                f.linear(x, w).backward(go)
                times.append(time.thread_time() - t0)
            measured += sorted(times)[7]
            flops = 6.0 * 256 * k * n
            predicted += flops / float(matmul_rates(prof, np.array([flops]))[0])
        return predicted, measured

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tries = []
    try:
        for _ in range(3):
            predicted, measured = attempt()
            tries.append(f"predicted {predicted * 1e3:.3f} ms, measured {measured * 1e3:.3f} ms")
            if 0.75 < predicted / measured < 1.25:
                break
        else:
            raise AssertionError("; ".join(tries))
    finally:
        torch.set_num_threads(threads)
    print(tries[-1])
