"""Planner -> layout -> job: the plan's cut runs on the plan's machines and matches eager; a
job that fits no machine's memory is refused before anything starts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.inproc import inproc_cluster
from fusiond.jobs.planning import layout_from_plan, plan_job
from fusiond.plan import Cluster, MachineProfile, PlanError
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer
from fusiond.train.model import build_model, loss_fn

pytestmark = pytest.mark.slow


def _machines(memory: float) -> list[MachineProfile]:
    return [MachineProfile(id=f"node{i}", flops={"other": 5e9}, mem_bw=5e9, op_overhead_s=2e-5,
                           memory_bytes=memory) for i in range(3)]


async def test_planned_job_matches_eager(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=5)
    cluster = Cluster.build(_machines(8e9), [[1.25e9] * 3] * 3)  # 10 Gbit/s: no compression
    plan = plan_job(spec, cap, cluster)
    layout = layout_from_plan("planned", cap.graph, cap.state, plan, spec)
    assert [s.node_id for s in layout.stages] == plan.machine_of_stage()
    assert len(layout.stages) >= 2 and not layout.densities
    losses: list[float] = []
    async with inproc_cluster(3) as nodes:
        sched = nodes["node0"]
        c = JobCoordinator(send=sched.send_fn(), spec=spec, captured=cap, layout=layout,
                           addresses={n: x.net.address for n, x in nodes.items()}, term=1,
                           on_step=lambda m: losses.append(m.loss))
        sched.coordinators.append(c)
        out = await asyncio.wait_for(c.run(), 120)
    assert out.ok, out.failure
    rt = ReferenceTrainer(build_model(spec.model, seed=spec.seed), loss_fn(spec.loss),
                          spec.optimizer, data=make_source(spec.data, spec.seed),
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          total_steps=spec.steps)
    for got, exp in zip(losses, rt.train(0, spec.steps), strict=True):
        assert got == pytest.approx(exp, rel=1e-4)


def test_job_larger_than_the_cluster_is_refused(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    cluster = Cluster.build(_machines(64e3), [[1.25e9] * 3] * 3)  # 64 kB each
    with pytest.raises(PlanError, match="fits the machines' memory"):
        plan_job(spec, cap, cluster)
