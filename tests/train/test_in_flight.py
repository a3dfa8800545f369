"""More micro-batches in flight than 1F1B's own (the plan's answer to a slow link's round
trip): the same losses and weights as the default schedule, and the Assign carries the counts,
bounded and checked for the deadlock they could cause."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fusiond.errors import FusionError
from fusiond.graph import contiguous_assignment, partition
from fusiond.train.local import run_pipeline
from fusiond.train.programs import stage_programs
from fusiond.train.spec import OptimizerSpec


def _adamw() -> OptimizerSpec:
    return OptimizerSpec(kind="adamw", lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8,
                         momentum=0.0, schedule="constant", warmup_steps=0, min_lr=0.0)


@pytest.mark.compute_only
@pytest.mark.parametrize("in_flight", [{0: 4}, {0: 4, 1: 4, 2: 2}, {0: 3, 1: 3}])
async def test_more_in_flight_trains_as_1f1b_does(captured_tiny: Any, small_text: Any,
                                                  in_flight: dict[int, int]) -> None:
    """Each micro-batch's gradients are accumulated in the same order on every stage (a
    stage's backwards still run in micro-batch order), so the step is bit-identical."""
    _, cap = captured_tiny

    async def train(counts: dict[int, int] | None) -> Any:
        progs = stage_programs(cap.graph, partition(cap.graph, contiguous_assignment(
            cap.graph, 3)), cap.state)
        return await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=4,
                                  optimizer=_adamw(), steps=3, in_flight=counts)

    plain = await train(None)
    more = await train(in_flight)
    assert more.losses == plain.losses
    for s, state in more.states.items():
        for k, v in state.items():
            assert torch.equal(v, plain.states[s][k]), k


@pytest.mark.compute_only
def test_the_assign_carries_the_plans_counts_and_refuses_a_deadlock(captured_tiny: Any) -> None:
    from fusiond.jobs.assign import assign_messages, layout_job
    from fusiond.train.remote import decode_assign
    from fusiond.train.spec import parse_job

    _, cap = captured_tiny
    spec = parse_job('[job]\nname = "f"\nsteps = 2\n[model]\nzoo = "gpt2"\n'
                     'config = { size = "tiny" }\n[batch]\nsize = 8\nmicro_batch_size = 2\n'
                     '[data]\nseq_len = 64\n')
    cut = contiguous_assignment(cap.graph, 3)
    names = ("a", "b", "c")
    layout = layout_job("j", cap.graph, cap.state, {op: names[s] for op, s in cut.items()})
    layout = dataclasses.replace(layout, in_flight={"a": 4})
    addresses = {n: ("127.0.0.1", i + 1) for i, n in enumerate(names)}
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses=addresses)
    (ma, pa), (mb, pb) = msgs["a"], msgs["b"]
    assert ma.config is not None and ma.config.in_flight == {"0": 4}
    assert decode_assign(ma, pa).in_flight == 4
    assert decode_assign(mb, pb).in_flight == 0  # stage 1 keeps 1F1B's own
    assert mb.config is not None
    for value, why in (({"0": 0}, r"in_flight\[0\]: 0 is not a number of micro-batches"),
                       ({"0": 5}, r"in_flight\[0\]: 5 is not"),
                       ({"7": 2}, "in_flight: '7' is not a stage"),
                       # stage 1 above stage 0 (1F1B's 3): the pipeline would deadlock
                       ({"1": 4}, "stage 1 keeps 4 micro-batches in flight, more than "
                                  "stage 0's 3")):
        bad = dataclasses.replace(mb, config=dataclasses.replace(mb.config, in_flight=value))
        with pytest.raises(FusionError, match=why):
            decode_assign(bad, pb)


@pytest.mark.slow
async def test_a_planned_count_reaches_its_stage_and_the_job_trains_as_one_process(
        captured_tiny: Any) -> None:
    """Two machines behind a 50 ms round trip, neither able to hold the model alone: the plan
    keeps more micro-batches in flight on stage 0 than 1F1B's own, the layout carries the
    count through the Assign to that stage's daemon (TLS, in-process daemons), and the job's
    losses are single-process training's."""
    import numpy as np

    from fusiond.jobs.planning import layout_from_plan, plan_job
    from fusiond.plan import Cluster, MachineProfile

    from .reference import run_on_inproc_daemons, spec_losses

    spec, cap = captured_tiny
    spec = dataclasses.replace(spec, steps=3,
                               batch=dataclasses.replace(spec.batch, size=16, micro_batches=8))
    probe = plan_job(spec, cap, Cluster.build(
        [MachineProfile("n0", {"matmul": 1e9, "other": 1e9}, 1e9, 1e-6, 1e12)], [[0.0]]))
    whole = probe.evaluation.stages[0].memory_bytes
    # each machine holds about 70 % of what the model needs alone: two stages, each with
    # room for far more micro-batches in flight than 1F1B's two
    k = 2
    cluster = Cluster.build(
        [MachineProfile(f"n{i}", {"matmul": 1e9, "other": 1e9}, 1e9, 1e-6,
                        0.7 * whole / 0.9) for i in range(k)],
        np.full((k, k), 1.25e9), np.full((k, k), 0.05))
    plan = plan_job(spec, cap, cluster)
    assert len(plan.stages) == 2, plan.stages
    counts = [r.inflight for r in plan.evaluation.stages]
    assert counts[0] > 2, counts
    layout = layout_from_plan("job-f", cap.graph, cap.state, plan, spec)
    first = plan.evaluation.stages[0].machine_id
    assert dict(layout.in_flight) == {first: counts[0]}
    out, losses = await run_on_inproc_daemons(spec, cap, layout, k)
    assert out.ok, out.failure
    want = spec_losses(spec)
    assert len(losses) == spec.steps
    for got, w in zip(losses, want, strict=True):
        assert got == pytest.approx(w, rel=1e-5)
