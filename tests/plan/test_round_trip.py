"""1F1B's round trips in the cost model: a stage keeps min(M, S - i) micro-batches in flight,
so on a link whose round trip is longer than that many of its tasks it waits, whatever the
bottleneck (measured on the emulated WAN: stage 0 of a 2-stage GPT-2 over a 47.5 Mbit/s,
30 ms link waited 0.2 s of every 0.85 s step, and the model without this term predicted 0.65 s).
The plan raises a stage's count where its memory holds the extra micro-batches."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.plan import Cluster, CostGraph, JobSettings, OpCost, StageSpec, TensorEdge, evaluate
from fusiond.plan.model import MachineProfile
from fusiond.plan.pipeline import GraphArrays, latency_rest_s, round_trip_s

pytestmark = pytest.mark.compute_only

SAVED_BYTES = 1e8
"""Per op and micro-batch (micro-batch size 1): what one more micro-batch in flight holds."""


def _graph(n: int = 4) -> CostGraph:
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e10, bwd_flops=2e10, saved_bytes=SAVED_BYTES)
                for i in range(n))
    ts = tuple(TensorEdge(f"t{i}", i, (i + 1,), 1e5, 1e5 / 4) for i in range(n - 1))
    return CostGraph(ops, ts)


def _cluster(k: int, rtt_s: float, mem: float) -> Cluster:
    machines = [MachineProfile(f"m{i}", {"matmul": 1e12, "other": 1e12}, 1e12, 0.0, mem)
                for i in range(k)]
    return Cluster.build(machines, [[1e9] * k for _ in range(k)],
                         [[0.0 if i == j else rtt_s for j in range(k)] for i in range(k)])


def test_the_round_trip_and_its_bound() -> None:
    # stages of busy 1, 2, 3 with hops of 0.5 and 0.25 between them
    assert round_trip_s([1.0, 2.0, 3.0], [0.5, 0.25]) == [6.75, 5.25, 3.0]
    # 8 micro-batches, 2 in flight, round trip 10, a task pair of 1: after the first, 3 more
    # full round trips and one more task pair
    assert latency_rest_s(8, 2, 10.0, 1.0) == pytest.approx(3 * 10.0 + 1.0)
    assert latency_rest_s(2, 2, 10.0, 1.0) == 0.0  # all in flight at once: the fill's
    assert latency_rest_s(1, 1, 10.0, 1.0) == 0.0


def test_a_long_round_trip_bounds_the_iteration_where_memory_holds_no_more() -> None:
    g = _graph()
    # two ops per stage: 2 x 1e8 saved per micro-batch; room for 1F1B's own 2 and no more
    s = JobSettings(micro_batch_size=1, num_micro_batches=8, memory_fraction=1.0)
    cut = [StageSpec(0, 0, 2), StageSpec(1, 2, 4)]
    tight = evaluate(GraphArrays(g, _cluster(2, 0.5, 2 * 2 * SAVED_BYTES + 5e6), s), cut)
    assert [r.inflight for r in tight.stages] == [2, 1]
    busy = [r.busy_s for r in tight.stages]
    trip = tight.fill_s  # a chain's fill is stage 0's round trip
    assert trip == pytest.approx(round_trip_s(busy, [tight.fill_s - sum(busy)])[0])
    want = latency_rest_s(8, 2, trip, busy[0])
    assert want > 7 * max(busy)  # the round trip binds, not the compute
    assert tight.iteration_s == pytest.approx(
        want + tight.fill_s + tight.optimizer_s + tight.sync_s)
    assert tight.bottleneck.startswith("round trip from m0 (2 micro-batches in flight)")

    # with the memory for them, stage 0 keeps enough in flight to cover the round trip
    roomy = evaluate(GraphArrays(g, _cluster(2, 0.5, 1e12), s), cut)
    w = roomy.stages[0].inflight
    assert w > 2 and latency_rest_s(8, w, trip, busy[0]) <= 7 * max(busy) + 1e-12
    assert latency_rest_s(8, w - 1, trip, busy[0]) > 7 * max(busy)  # the least that does
    assert roomy.stages[0].memory_bytes == pytest.approx(
        tight.stages[0].memory_bytes + (w - 2) * 2 * SAVED_BYTES)
    assert roomy.iteration_s < 0.6 * tight.iteration_s
    assert roomy.bottleneck.startswith("compute")
    # GPipe holds every micro-batch anyway: no round-trip bound, no raise
    gp = evaluate(GraphArrays(g, _cluster(2, 0.5, 1e12),
                              JobSettings(micro_batch_size=1, num_micro_batches=8,
                                          schedule="gpipe")), cut)
    assert [r.inflight for r in gp.stages] == [8, 8]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 4), st.sampled_from([2, 4, 8, 16]), st.floats(0.0, 2.0),
       st.floats(1.0, 40.0))
def test_the_counts_never_grow_down_the_pipeline_and_fit(stages: int, micro: int,
                                                          rtt_s: float, mem_units: float
                                                          ) -> None:
    """Whatever the links and memory: each count within [1F1B's own, M], never above an
    earlier stage's (the schedule would deadlock), and every raised stage still fits."""
    g = _graph(2 * stages)
    s = JobSettings(micro_batch_size=1, num_micro_batches=micro, memory_fraction=1.0)
    cut = [StageSpec(i, 2 * i, 2 * i + 2) for i in range(stages)]
    ev = evaluate(GraphArrays(g, _cluster(stages, rtt_s, mem_units * SAVED_BYTES), s), cut)
    counts = [r.inflight for r in ev.stages]
    for i, (r, c) in enumerate(zip(ev.stages, counts, strict=True)):
        assert min(micro, stages - i) <= c <= micro
        if c > min(micro, stages - i):
            assert r.memory_bytes <= r.memory_cap
    assert all(a >= b for a, b in itertools.pairwise(counts))


def test_the_plan_shows_the_raised_count(capsys: pytest.CaptureFixture[str]) -> None:
    """`fusionctl plan` (the daemon's text and the CLI's table) says where a stage runs
    more forwards ahead than 1F1B's own, and the layout sends it to that stage's daemon."""
    from fusionctl.render import render_plan as table
    from fusiond.plan import plan_summary, render_plan
    from fusiond.plan.fence import plan_from_stages

    s = JobSettings(micro_batch_size=1, num_micro_batches=8, memory_fraction=1.0)
    plan = plan_from_stages(_graph(), _cluster(2, 0.5, 1e12), s,
                            [StageSpec(0, 0, 2), StageSpec(1, 2, 4)])
    assert "  8 in flight" in render_plan(plan)
    summary = plan_summary(plan)
    assert [x["in_flight"] for x in summary["stages"]] == [8, 1]
    table({"plan_summary": summary})
    out = capsys.readouterr().out
    assert " F8" in out and "Fk: k micro-batches in flight" in out
