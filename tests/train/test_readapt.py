"""AdaTopK re-adaptation during a job: the scheduler's decision (which densities to send) from a
plan and the links as measured now, and the service loop that sends them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fusiond.jobs.planning import readapted_codecs, readapted_densities
from fusiond.plan import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    Plan,
    StageSpec,
    TensorEdge,
    plan_from_stages,
)
from fusiond.train.codec import EdgeCodec
from protocol.messages import NodeProfile

EDGES = ["b->1", "ids->1"]  # the cut's edges as the layout names them


def _plan(bw: float, choice: bool = False) -> tuple[Plan, Cluster]:
    """Two machines, one cut carrying a float activation `b` (4 MB) and int ids (exact);
    60 ms of compute per micro-batch per stage."""
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e10, bwd_flops=2e10) for i in range(4))
    ts = (TensorEdge("a", 0, (1,), 4e6, 1e6), TensorEdge("b", 1, (2,), 4e6, 1e6),
          TensorEdge("ids", 1, (2,), 1e5, 1.25e4, grad=False, compressible=False),
          TensorEdge("c", 2, (3,), 4e6, 1e6))
    ms = [MachineProfile(f"m{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    cl = Cluster.build(ms, np.array([[np.inf, bw], [bw, np.inf]]))
    st = JobSettings(micro_batch_size=1, num_micro_batches=8, density_floor=0.05,
                     codec_choice=choice)
    return plan_from_stages(CostGraph(ops, ts), cl, st, [StageSpec(0, 0, 2), StageSpec(1, 2, 4)],
                            compress=True), cl


def _bw(cl: Cluster, bw: float) -> Cluster:
    return cl.with_bandwidth(np.array([[np.inf, bw], [bw, np.inf]]))


def test_a_link_that_slows_down_gets_compressed_and_back() -> None:
    plan, cl = _plan(1e9)  # fast link: the plan keeps every edge exact
    assert plan.edge_densities() == {}
    assert readapted_densities(plan, cl, {}, EDGES) is None  # nothing changed: nothing sent
    slow = readapted_densities(plan, _bw(cl, 2e7), {}, EDGES)  # 200 ms > 60 ms compute
    assert slow is not None and set(slow) == set(EDGES)
    assert 0.05 <= slow["b->1"] < 0.5 and slow["ids->1"] == 1.0  # non-float stays exact
    current = {k: v for k, v in slow.items() if v < 1}
    # Measurement noise (1 %) moves the density by less than the tolerance: nothing sent.
    assert readapted_densities(plan, _bw(cl, 2.02e7), current, EDGES) is None
    # Slower still: a lower density; fast again: every edge back to exact.
    slower = readapted_densities(plan, _bw(cl, 5e6), current, EDGES)
    assert slower is not None and slower["b->1"] < current["b->1"]
    back = readapted_densities(plan, _bw(cl, 1e9), current, EDGES)
    assert back == {"b->1": 1.0, "ids->1": 1.0}


def test_changed_membership_is_not_readapted() -> None:
    plan, _ = _plan(1e9)
    ms = [MachineProfile(f"x{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    other = Cluster.build(ms, np.array([[np.inf, 1e6], [1e6, np.inf]]))
    assert readapted_densities(plan, other, {}, EDGES) is None


@pytest.mark.parametrize("tolerance", [0.01, 0.5])
def test_tolerance_is_relative(tolerance: float) -> None:
    plan, cl = _plan(1e9)
    d = readapted_densities(plan, _bw(cl, 2e7), {}, EDGES)
    assert d is not None
    near = {"b->1": d["b->1"] * 1.2}  # 20 % off the fresh figure
    got = readapted_densities(plan, _bw(cl, 2e7), near, EDGES, tolerance=tolerance)
    assert (got is None) == (tolerance > 0.2)


def _service_on_two_members(bits_per_s: float) -> tuple[
        Any, Any, dict[tuple[str, str], tuple[float, float]]]:
    """A scheduler's JobService (m0, leading) whose cluster view has two alive members and
    the link m0 -> m1 measured at `bits_per_s` (the view's unit); nothing goes on the wire.
    Returns (the service, the view, its links to change)."""
    from types import SimpleNamespace

    from fusiond.jobs.service import JobService

    links: dict[tuple[str, str], tuple[float, float]] = {("m0", "m1"): (bits_per_s, 0.0)}
    members = [SimpleNamespace(node_id=f"m{i}", state="alive", address=("127.0.0.1", 1),
                               profile=NodeProfile(gflops=1000.0, memory_bytes=10**12))
               for i in range(2)]
    view = SimpleNamespace(members=members, links=links, leader="m0", term=1, has_quorum=True)

    async def send_raw(peer: str, msg: object, payload: object = ()) -> None:
        raise AssertionError("nothing goes on the wire here")

    return JobService(node_id="m0", send_raw=send_raw, view=lambda: view), view, links


class _Coord:
    def __init__(self) -> None:
        self.sent: list[dict[str, float]] = []

    def status(self) -> dict[str, str]:
        return {"state": "running"}

    async def set_densities(self, densities: dict[str, float]) -> None:
        self.sent.append(dict(densities))


async def test_service_sends_densities_when_the_measured_link_slows() -> None:
    """The scheduler's loop reads the cluster view's link matrix and sends JobDensities
    (through `JobCoordinator.set_densities`) only when the measurement moved the densities."""
    import asyncio
    from types import SimpleNamespace


    plan, _ = _plan(1e9)
    # the view's links are gossiped in bits per second: 8e9 bit/s is the plan's 1e9 bytes/s
    svc, view, links = _service_on_two_members(8e9)
    coord = _Coord()
    lines: list[str] = []
    layout = SimpleNamespace(densities={}, edges=lambda: [SimpleNamespace(edge=e) for e in EDGES])
    spec = SimpleNamespace(compression=SimpleNamespace(choice=False), device="auto",
                           precision="fp32")
    rec = SimpleNamespace(state="running", coord=coord, layout=layout, plan=plan,
                          log=lines.append, spec=spec)
    task = asyncio.create_task(svc.scheduling._readapt(rec, 0.01))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0.1)
        assert coord.sent == []  # fast link as planned: nothing to send
        links[("m0", "m1")] = (1.6e8, 0.0)  # the prober measured 160 Mbit/s = 2e7 bytes/s
        for _ in range(200):
            if coord.sent:
                break
            await asyncio.sleep(0.01)
        assert len(coord.sent) == 1 and coord.sent[0]["b->1"] < 0.5
        assert "b->1 1->" in lines[-1]
        await asyncio.sleep(0.1)
        assert len(coord.sent) == 1  # same measurement: not sent again
        view.leader = None  # this daemon lost the scheduler's lease: it decides nothing
        links[("m0", "m1")] = (1e9, 0.0)
        await asyncio.sleep(0.2)
        assert len(coord.sent) == 1
        view.leader = "m0"
        for _ in range(200):
            if len(coord.sent) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(coord.sent) == 2  # the lease again: the fast link re-adapted
    finally:
        rec.state = "done"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_the_codec_choice_readapts_over_codecs() -> None:
    plan, cl = _plan(1e12, choice=True)
    assert plan.edge_encodings() == {} and plan.edge_densities() == {}
    exact = {e: EdgeCodec() for e in EDGES}
    assert readapted_codecs(plan, cl, exact) is None  # nothing changed: nothing sent
    # 4 MB at 1 GB/s = 4 ms, within the 60 ms of compute: bf16 saves 4 ms of the 548 ms
    # iteration (fill: forward and back), int8 2 ms more (under 0.5 %): the less lossy bf16
    bf16 = readapted_codecs(plan, _bw(cl, 1e9), exact)
    assert bf16 == {"b->1": EdgeCodec("bf16"), "ids->1": EdgeCodec()}
    assert readapted_codecs(plan, _bw(cl, 1.01e9), bf16) is None  # noise: the same codec
    int8 = readapted_codecs(plan, _bw(cl, 2.5e7), bf16)  # 160 ms: the bottleneck
    assert int8 is not None and int8["b->1"] == EdgeCodec("int8")
    assert readapted_codecs(plan, _bw(cl, 1e12), int8) == exact
    ms = [MachineProfile(f"x{i}", {"other": 1e12}, 1e12, 0.0, 1e12) for i in range(2)]
    other = Cluster.build(ms, np.array([[np.inf, 1e6], [1e6, np.inf]]))
    assert readapted_codecs(plan, other, exact) is None  # new machines: a re-plan


def test_edge_codecs_are_validated() -> None:
    assert EdgeCodec("raw", 0.25).label == "top-k 0.25" and EdgeCodec("int4").label == "int4"
    with pytest.raises(ValueError, match="never also top-k"):
        EdgeCodec("int8", 0.5)
    with pytest.raises(ValueError, match="not in"):
        EdgeCodec("raw", 1.5)
    with pytest.raises(ValueError, match="is not one of"):
        EdgeCodec("fp8")  # type: ignore[arg-type]


async def test_service_sends_codecs_when_the_measured_link_slows() -> None:
    """With `codec = "auto"` the loop re-adapts the codecs (`JobCoordinator.set_codecs`)."""
    import asyncio
    from types import SimpleNamespace


    plan, _ = _plan(1e12, choice=True)
    svc, _, links = _service_on_two_members(8e12)
    sent: list[dict[str, EdgeCodec]] = []

    class Coord(_Coord):
        async def set_codecs(self, codecs: dict[str, EdgeCodec]) -> None:
            sent.append(dict(codecs))

    lines: list[str] = []
    layout = SimpleNamespace(densities={}, encodings={},
                             edges=lambda: [SimpleNamespace(edge=e) for e in EDGES])
    spec = SimpleNamespace(compression=SimpleNamespace(choice=True), device="auto",
                           precision="fp32")
    rec = SimpleNamespace(state="running", coord=Coord(), layout=layout, plan=plan,
                          log=lines.append, spec=spec, codecs=None)
    task = asyncio.create_task(svc.scheduling._readapt(rec, 0.01))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(0.1)
        assert sent == []
        links[("m0", "m1")] = (2e8, 0.0)  # 200 Mbit/s = 2.5e7 bytes/s: int8
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        assert sent and sent[0]["b->1"] == EdgeCodec("int8")
        assert "b->1 raw->int8" in lines[-1]
        await asyncio.sleep(0.1)
        assert len(sent) == 1  # the same measurement: not sent again
    finally:
        rec.state = "done"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
