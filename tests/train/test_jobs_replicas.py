"""A job the planner gives replicas, run by the scheduler's coordinator over loopback peer
links (TLS) on in-process daemons: machines of unequal speed get unequal shares of the
micro-batches, and the job trains as single-process training on the global batch."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from fusiond.harness.inproc import inproc_cluster
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.planning import layout_from_plan, plan_job
from fusiond.jobs.worker import local_sender
from fusiond.net.transport import NetConfig
from fusiond.plan import Cluster, MachineProfile
from protocol.messages import StageCheckpoint

from .reference import run_on_inproc_daemons, spec_losses

pytestmark = pytest.mark.slow


def _machine(name: str, flops: float) -> MachineProfile:
    return MachineProfile(name, {"matmul": flops, "other": flops}, mem_bw=flops,
                          op_overhead_s=1e-6, memory_bytes=8e9)


@pytest.mark.parametrize("grad_rank", [None, 2])
async def test_planned_replicas_of_unequal_speed_train_as_single_process(  # type: ignore[no-untyped-def]
        captured_tiny, grad_rank: int | None) -> None:
    """Dense: the losses of single-process training; with low-rank gradients (rank 2 forced
    on the layout, through the Assign to every stage over TLS): the job ends with every
    replica's weights identical (gathering the model refuses copies that diverged) and its
    losses near the dense run's. Checkpoints come from each stage's first replica alone (the
    others hold the same weights), and still hold the whole model."""
    spec, cap = captured_tiny
    spec = replace(spec, steps=6, checkpoint_interval=2,
                   batch=replace(spec.batch, size=16, micro_batches=8, replicas=True))
    # speeds 3 : 2 : 2, 10 Gbit/s and 2 ms between them: the planner runs the model on all
    # three, the fast one on twice the micro-batches (a pipeline pays the round trips)
    names = ["n0", "n1", "n2"]
    k = len(names)
    cluster = Cluster.build([_machine("n0", 3e9), _machine("n1", 2e9), _machine("n2", 2e9)],
                            np.full((k, k), 1.25e9), np.full((k, k), 2e-3))
    plan = plan_job(spec, cap, cluster)
    assert sum(len(s.machines) for s in plan.stages) == 3, plan.stages
    layout = layout_from_plan("job-r", cap.graph, cap.state, plan, spec)
    assert layout.replicas and layout.routes and layout.grad_rank is None
    # the plan's bucket count for each replicated stage's machines; 3 forced here, so the
    # Assign carries it and every replica splits its gradients the same way
    replicated = {m for s in plan.stages if s.replicas for m in s.machines}
    assert set(layout.grad_buckets) == {cluster.machines[m].id for m in replicated}
    layout = replace(layout, grad_rank=grad_rank,
                     grad_buckets={n: 3 for n in layout.grad_buckets})
    shares = {st: sorted(route.count(r) for r in set(route))
              for st, route in layout.routes.items()}
    assert any(len(set(s)) > 1 for s in shares.values()), shares  # unequal speeds, shares
    cfg = NetConfig(connect_timeout_s=2, handshake_timeout_s=2, backoff_max_s=0.5)
    async with inproc_cluster(k, net_config=cfg, prefix="n") as nodes:
        n0 = nodes["n0"]
        losses: list[float] = []
        checkpoints: dict[int, set[str]] = {}
        sent_by: list[int] = []
        send = local_sender("n0", n0.net.send, n0.dispatch)

        c = JobCoordinator(send=send, spec=spec, captured=cap, layout=layout,
                           addresses={n: x.net.address for n, x in nodes.items()}, term=1,
                           on_step=lambda m: losses.append(m.loss),
                           on_checkpoint=lambda step, state: checkpoints.setdefault(
                               step, set(state)))
        real = c.handle

        async def handle(peer: str, msg: Any) -> Any:
            if isinstance(msg, StageCheckpoint):
                sent_by.append(msg.partition)
            return await real(peer, msg)

        c.handle = handle  # type: ignore[method-assign]
        n0.coordinators.append(c)
        out = await asyncio.wait_for(c.run(), 120)
        assert out.ok, out.failure
        assert all(not n.worker.jobs() for n in nodes.values())
    assert sorted(checkpoints) == [1, 3]
    assert out.state is not None
    whole = set(out.state)  # the final state, gathered from every slot's
    assert all(names == whole for names in checkpoints.values()), (
        [sorted(whole ^ n) for n in checkpoints.values()])
    first_replicas = set(layout.slot_nodes) - set(layout.slot_stages())
    assert set(sent_by) == first_replicas and len(sent_by) == 2 * len(first_replicas), sent_by
    want = spec_losses(spec)
    assert len(losses) == spec.steps
    for got, w in zip(losses, want, strict=True):
        assert got == pytest.approx(w, rel=1e-5 if grad_rank is None else 2e-2)


async def test_a_two_level_reduction_reaches_the_stages_and_trains_as_single_process(  # type: ignore[no-untyped-def]
        captured_tiny) -> None:
    """Four replicas in two bandwidth groups of two, reduced two-level (the layout's
    `grad_groups` and `grad_two_level`, as the planner writes them where that scheme wins,
    through the Assign to every stage over TLS): each group's two shards summed by their
    owners and across the groups by a ring of each shard's owners. The job trains as
    single-process training does, and gathering the model finds every replica's weights
    identical."""
    spec, cap = captured_tiny
    spec = replace(spec, steps=3,
                   batch=replace(spec.batch, size=16, micro_batches=8, replicas=True))
    names = ["n0", "n1", "n2", "n3"]
    k = len(names)
    cluster = Cluster.build([_machine(n, 2e9) for n in names], np.full((k, k), 1.25e9),
                            np.full((k, k), 2e-3))
    plan = plan_job(spec, cap, cluster)
    layout = layout_from_plan("job-t", cap.graph, cap.state, plan, spec)
    full = [st for st, others in layout.replicas.items() if len(others) == k - 1]
    if not full:
        pytest.skip(f"the plan did not replicate one stage on all four: {plan.stages}")
    first = next(s.node_id for s in layout.stages if s.stage == full[0])
    rest = list(layout.replicas[full[0]])
    layout = replace(layout, grad_groups={first: ((first, rest[0]), (rest[1], rest[2]))},
                     grad_two_level=frozenset({first}))
    cfg = NetConfig(connect_timeout_s=2, handshake_timeout_s=2, backoff_max_s=0.5)
    async with inproc_cluster(k, net_config=cfg, prefix="n") as nodes:
        losses: list[float] = []
        rounds: set[str] = set()

        def seen(m: Any) -> None:
            losses.append(m.loss)
            rounds.update(st.edge for r in m.reports.values() for st in r.edges)

        n0 = nodes["n0"]
        c = JobCoordinator(send=local_sender("n0", n0.net.send, n0.dispatch), spec=spec,
                           captured=cap, layout=layout,
                           addresses={n: x.net.address for n, x in nodes.items()}, term=1,
                           on_step=seen)
        n0.coordinators.append(c)
        out = await asyncio.wait_for(c.run(), 120)
        assert out.ok, out.failure
    assert out.state is not None
    # the shards went to their owners and back (`_shard_tags`), not by one ring
    assert any("@t" in r for r in rounds), rounds
    for got, w in zip(losses, spec_losses(spec), strict=True):
        assert got == pytest.approx(w, rel=1e-5)


async def test_planned_micro_batches_of_their_own_sizes_train_as_single_process(  # type: ignore[no-untyped-def]
        captured_tiny) -> None:
    """Two machines 3 : 2 apart, four micro-batches of 4: whole ones give the fast machine 3
    and the slow one 1, so the slow one would idle; the planner deals the 16 samples out in
    micro-batches of their own sizes instead (`JobLayout.micro_batch_sizes`, through the
    Assign to both stages over TLS), each micro-batch's loss weighed by its size: the job
    trains as single-process training on the global batch."""
    spec, cap = captured_tiny
    spec = replace(spec, steps=3,
                   batch=replace(spec.batch, size=16, micro_batches=4, replicas=True))
    cluster = Cluster.build([_machine("n0", 3e9), _machine("n1", 2e9)],
                            np.full((2, 2), 1.25e9), np.full((2, 2), 2e-3))
    plan = plan_job(spec, cap, cluster)
    assert len(plan.stages) == 1 and plan.stages[0].replicas, plan.stages
    layout = layout_from_plan("job-s", cap.graph, cap.state, plan, spec)
    sizes = layout.micro_batch_sizes
    assert sum(sizes) == 16 and len(set(sizes)) > 1, sizes
    out, losses = await run_on_inproc_daemons(spec, cap, layout, 2)
    assert out.ok, out.failure
    assert out.state is not None  # gathering it found both replicas' weights identical
    for got, w in zip(losses, spec_losses(spec), strict=True):
        assert got == pytest.approx(w, rel=1e-5)
