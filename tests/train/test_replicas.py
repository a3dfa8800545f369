"""Stages on several replicas (data parallelism inside a pipeline): the same losses and weights
as eager training on the global batch, and every replica bit-identical after every step."""

from __future__ import annotations

import pytest
import torch

from fusiond.models.gpt2 import GPT, gpt2, lm_loss
from fusiond.train.data import TextWindows
from fusiond.train.local import ReferenceTrainer, ReplicatedResult, run_replicated
from fusiond.train.schedule import Phase, replica_slots, replica_tasks
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import (
    PacketKind,
    StageConfig,
    StageError,
    StageExecutor,
    StageProgram,
)

from .gpt_stages import merged_state, three_stages

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

STEPS = 20
BATCH = 16
MICRO = 8


def _data_parallel(n: int) -> tuple[GPT, list[list[StageProgram]], list[list[int]]]:
    """GPT-2 tiny (seed 0) as one stage on `n` replicas, micro-batches dealt round-robin:
    the model, the programs and the routes `run_replicated` takes."""
    from .gpt_stages import one_stage

    torch.manual_seed(0)
    g = gpt2("tiny")
    return g, [[one_stage(g) for _ in range(n)]], [[m % n for m in range(MICRO)]]


def _reference(g: torch.nn.Module, opt: OptimizerSpec, data: TextWindows
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    rt = ReferenceTrainer(ref, lm_loss, opt, data=data, batch_size=BATCH, micro_batches=MICRO,
                          total_steps=STEPS)
    return rt.train(0, STEPS), ref.state_dict()


async def test_two_replicas_by_three_stages_with_unequal_shares_match_eager(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """2 replicas x 3 stages, shares 5:3, 2:6 and 6:2 of 8 micro-batches (replicas of unequal
    speeds), micro-batches crossing between replicas from stage to stage: losses and final
    weights as eager training on the whole batch, within 1e-5 (weights: atol); the replicas of a
    stage, and the tied weight's four copies, bit-identical."""
    torch.manual_seed(0)
    g = gpt2("tiny")
    programs = [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)]
    routes = [[0, 1, 0, 0, 1, 0, 1, 0],   # 5:3
              [1, 1, 0, 1, 1, 1, 0, 1],   # 2:6
              [0, 0, 0, 1, 0, 0, 1, 0]]   # 6:2
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=MICRO, optimizer=adamw, steps=STEPS)
    want, want_state = _reference(g, adamw, small_text)
    assert len(res.losses) == STEPS
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5)
    assert res.losses[-1] < res.losses[0]
    slots = res.slots
    for s in range(3):
        a, b = res.states[slots[(s, 0)]], res.states[slots[(s, 1)]]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)
    got_state = merged_state([programs[0][0], programs[1][0], programs[2][0]])
    for k, v in want_state.items():
        # atol 1e-5: Adam divides each element's step by its own gradient scale, so a
        # near-zero element's summation-order noise grows to ~2e-6 in 20 steps (measured on
        # CI's machine; 0.2 % of one step's update), as between eager and the plain pipeline
        torch.testing.assert_close(got_state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    ties = [res.states[slots[(0, r)]]["tied"] for r in (0, 1)]
    ties += [res.states[slots[(2, r)]]["tied"] for r in (0, 1)]
    assert all(torch.equal(ties[0], t) for t in ties[1:])


@pytest.mark.parametrize("stages", [1, 3])
async def test_micro_batches_of_their_own_sizes_train_as_the_global_batch(
        stages: int, small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """Replicas taking micro-batches of their own sizes (`Plan.micro_batch_sizes`: 16
    samples as 5 + 4 + 4 on the fast replica and 3 on the slow one), one stage or three:
    losses and weights as eager training on the whole batch at once, within 1e-5; each
    micro-batch's loss counts by its size, so the step is the batch's mean."""
    from .gpt_stages import one_stage

    torch.manual_seed(0)
    g = gpt2("tiny")
    if stages == 1:
        programs = [[one_stage(g), one_stage(g)]]
    else:
        programs = [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)]
    routes = [[0, 1, 0, 0]] * stages
    sizes = (5, 3, 4, 4)
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=len(sizes), optimizer=adamw, steps=STEPS,
                               micro_batch_sizes=sizes)
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    rt = ReferenceTrainer(ref, lm_loss, adamw, data=small_text, batch_size=BATCH,
                          micro_batches=1, total_steps=STEPS)
    want = rt.train(0, STEPS)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5)
    got_state = (dict(programs[0][0].module.state_dict()) if stages == 1
                 else merged_state([row[0] for row in programs]))
    for k, v in ref.state_dict().items():
        if k in got_state:
            torch.testing.assert_close(got_state[k], v, rtol=1e-5, atol=1e-5, msg=k)
    for s in range(stages):
        a, b = res.states[res.slots[(s, 0)]], res.states[res.slots[(s, 1)]]
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)


def test_micro_batch_sizes_that_do_not_make_the_batch_are_refused(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    from fusiond.train.local import MemoryLinks

    from .gpt_stages import one_stage

    torch.manual_seed(0)
    g = gpt2("tiny")
    with pytest.raises(StageError, match="micro-batch sizes"):
        StageExecutor(stage=0, program=one_stage(g), link=MemoryLinks().link(0), tasks=[],
                      micro_batches=4, optimizer=adamw, total_steps=1, data=small_text,
                      batch_size=BATCH, micro_batch_sizes=(5, 3, 4, 3))


def test_replica_slots_and_tasks() -> None:
    assert replica_slots([2, 1, 3]) == {(0, 0): 0, (0, 1): 3, (1, 0): 1, (2, 0): 2,
                                        (2, 1): 4, (2, 2): 5}
    tasks = replica_tasks("1f1b", 0, 3, [1, 4, 6])
    assert [t.micro for t in tasks if t.phase is Phase.F] == [1, 4, 6]
    assert [t.micro for t in tasks if t.phase is Phase.B] == [1, 4, 6]
    assert replica_tasks("1f1b", 1, 3, []) == []


def test_an_executor_refuses_tasks_its_route_gives_another_replica(
        adamw: OptimizerSpec) -> None:
    from fusiond.train.local import MemoryLinks

    g = gpt2("tiny")
    prog = three_stages(g)[1]
    with pytest.raises(StageError, match="another replica"):
        StageExecutor(stage=1, program=prog, link=MemoryLinks().link(1),
                      tasks=replica_tasks("1f1b", 1, 3, [0, 1]), micro_batches=2,
                      optimizer=adamw, total_steps=1, slot=1, routes={1: [1, 4]})


async def test_low_rank_reduction_keeps_replicas_identical_and_feeds_back_what_it_drops(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """Rank-2 factors with error feedback: every replica applies the same gradient (the
    weights stay bit-identical), the matrices travel as two rounds of factors (a few percent
    of their bytes), vectors dense, and what a replica's factors left out waits in its error."""
    torch.manual_seed(0)
    g = gpt2("tiny")
    programs = [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)]
    routes = [[m % 2 for m in range(MICRO)]] * 3
    seen: list[StageExecutor] = []
    import fusiond.train.local as local

    real = local.StageExecutor

    def spy(*a: object, **kw: object) -> StageExecutor:
        ex = real(*a, **kw)  # type: ignore[arg-type]
        seen.append(ex)
        return ex

    local.StageExecutor = spy  # type: ignore[misc, assignment]
    try:
        res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                                   micro_batches=MICRO, optimizer=adamw, steps=3, grad_rank=2)
        dense = await run_replicated(
            [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)],
            routes, data=small_text, batch_size=BATCH, micro_batches=MICRO, optimizer=adamw,
            steps=3)
    finally:
        local.StageExecutor = real  # type: ignore[misc]
    for s in range(3):
        a, b = res.states[res.slots[(s, 0)]], res.states[res.slots[(s, 1)]]
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)
    ex = next(e for e in seen if e.stage == 1 and e.slot == 1 and e.grad_rank == 2)
    assert ex._lowrank_names and ex._lowrank_names < set(ex.program.shared)
    grads = [st for (edge, kind), st in ex._stats.items() if kind is PacketKind.PARAM_GRAD]
    wire = sum(st.wire_bytes for st in grads)
    full = sum(p.numel() * 4 for n, p in ex._params.items() if n in ex.program.shared)
    assert wire < 0.5 * full, (wire, full)
    # two rounds (P factors with the dense vectors, then Q factors) of its one bucket (a
    # tiny stage's gradients are under a bucket's least size)
    assert {st.edge for st in grads} == {"#b0", "#b0q"} and len(grads) == 2
    assert ex._lowrank is not None
    for name in ex._lowrank_names:
        err = ex._lowrank.error(name)
        assert err is not None and float(err.abs().sum()) > 0, name
    # it trains: the compressed run's losses follow the dense run's
    assert all(x == x for x in res.losses)  # finite
    assert res.losses[0] == pytest.approx(dense.losses[0], rel=1e-6)  # before any update
    assert abs(res.losses[-1] - dense.losses[-1]) < 0.05 * dense.losses[-1]


async def test_low_rank_starts_after_the_dense_warm_up_steps(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """With grad_warmup_steps = 2 of 3 steps, the last step's reduction travels as factors;
    with 3 of 3 every step is dense and no holder ever compressed."""
    torch.manual_seed(0)
    g = gpt2("tiny")
    routes = [[m % 2 for m in range(MICRO)]] * 3
    import fusiond.train.local as local

    real = local.StageExecutor
    for warmup, compressed in ((2, True), (3, False)):
        seen: list[StageExecutor] = []

        def spy(*a: object, _seen: list[StageExecutor] = seen, **kw: object) -> StageExecutor:
            ex = real(*a, **kw)  # type: ignore[arg-type]
            _seen.append(ex)
            return ex

        local.StageExecutor = spy  # type: ignore[misc, assignment]
        try:
            await run_replicated(
                [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)],
                routes, data=small_text, batch_size=BATCH, micro_batches=MICRO,
                optimizer=adamw, steps=3, grad_rank=2, grad_warmup_steps=warmup)
        finally:
            local.StageExecutor = real  # type: ignore[misc]
        ex = next(e for e in seen if e.stage == 1 and e.slot == 1)
        last = {st.edge for (_, kind), st in ex._stats.items() if kind is PacketKind.PARAM_GRAD}
        assert ("#b0q" in last) is compressed, (warmup, last)  # the Q round: only low-rank
        assert ex._lowrank is not None
        assert all((ex._lowrank.error(n) is not None) is compressed for n in ex._lowrank_names)


async def test_a_stage_near_its_memory_limit_trims_and_trains_the_same(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    """Replicas whose process is past the high-water mark of its memory limit (a limit of one
    byte: always) trim the C heap after every backward and update: the same losses, bit for
    bit, as with no limit; and the exchange's gradients, sent without a bucket copy, leave
    the replicas bit-identical."""
    from fusiond.train.stage import StageConfig

    torch.manual_seed(0)
    g = gpt2("tiny")
    routes = [[0, 1, 0, 1, 0, 1, 0, 1]] * 3
    runs = []
    for limit in (None, 1.0):
        programs = [[p0, p1] for p0, p1 in zip(three_stages(g), three_stages(g), strict=True)]
        runs.append(await run_replicated(
            programs, routes, data=small_text, batch_size=BATCH, micro_batches=MICRO,
            optimizer=adamw, steps=3, config=StageConfig(memory_limit_bytes=limit)))
    assert runs[0].losses == runs[1].losses
    for res in runs:
        for s in range(3):
            a, b = res.states[res.slots[(s, 0)]], res.states[res.slots[(s, 1)]]
            assert all(torch.equal(a[k], b[k]) for k in a), s


async def test_four_data_parallel_replicas_sum_by_a_ring(small_text: TextWindows,
                                                          adamw: OptimizerSpec) -> None:
    """The whole of GPT-2 tiny on 4 replicas (pure data parallelism): their gradients are
    summed by a ring (reduce-scatter, all-gather), so each replica sends 2 (n - 1) / n of its
    gradient a step, not n - 1 copies; the losses are eager training's on the whole batch and
    the replicas end bit-identical."""
    from fusiond.train.stage import RING_MIN_HOLDERS

    assert RING_MIN_HOLDERS <= 4
    g, programs, routes = _data_parallel(4)
    steps = 6
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=MICRO, optimizer=adamw, steps=steps)
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    want = ReferenceTrainer(ref, lm_loss, adamw, data=small_text, batch_size=BATCH,
                            micro_batches=MICRO, total_steps=steps).train(0, steps)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5)
    states = [res.states[res.slots[(0, r)]] for r in range(4)]
    for k in states[0]:
        assert all(torch.equal(states[0][k], st[k]) for st in states[1:]), k
    grad_bytes = 4 * sum(p.numel() for p in g.parameters())
    for slot, reports in res.reports.items():
        sent = sum(st.wire_bytes for st in reports[-1].edges if st.kind == PacketKind.PARAM_GRAD)
        # 2 (n - 1) / n = 1.5 gradients' worth, and a header per chunk (the old exchange: 3)
        assert 1.5 * grad_bytes <= sent < 1.5 * grad_bytes + 6 * 512, (slot, sent, grad_bytes)


@pytest.mark.parametrize(("replicas", "rank"), [(2, None), (3, None), (3, 2)])
async def test_buckets_are_reduced_while_the_last_backward_runs(
        small_text: TextWindows, adamw: OptimizerSpec, monkeypatch: pytest.MonkeyPatch,
        replicas: int, rank: int | None) -> None:
    """Buckets of a few kB (instead of 1-25 MiB), so GPT-2 tiny's gradients make many: each
    replica sums the ones its last backward has finished while that backward goes on (by
    exchange for 2 replicas, by ring for 3; dense, or low-rank in two rounds per bucket), and
    the result is still eager training's on the whole batch (dense), the replicas
    bit-identical."""
    from fusiond.plan import model as plan_model

    from .gpt_stages import one_stage

    monkeypatch.setattr(plan_model, "BUCKET_MIN_BYTES", 4096)
    g, programs, routes = _data_parallel(replicas)
    steps = 4
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=MICRO, optimizer=adamw, steps=steps,
                               grad_rank=rank)
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    want = ReferenceTrainer(ref, lm_loss, adamw, data=small_text, batch_size=BATCH,
                            micro_batches=MICRO, total_steps=steps).train(0, steps)
    for got, exp in zip(res.losses, want, strict=True):
        if rank is None:
            assert got == pytest.approx(exp, rel=1e-5)
        else:
            assert got == pytest.approx(exp, rel=0.05)
    states = [res.states[res.slots[(0, r)]] for r in range(replicas)]
    for k in states[0]:
        assert all(torch.equal(states[0][k], st[k]) for st in states[1:]), k
    if rank is None:  # the plan's count instead of the split by size: about that many
        planned = await run_replicated(
            [[one_stage(g) for _ in range(replicas)]], routes, data=small_text,
            batch_size=BATCH, micro_batches=MICRO, optimizer=adamw, steps=1,
            config=StageConfig(grad_buckets=3))
        rounds = {st.edge.split("@")[0] for st in planned.reports[planned.slots[(0, 0)]][0].edges
                  if st.kind == PacketKind.PARAM_GRAD}
        assert rounds in ({"#b0", "#b1", "#b2"}, {"#b0", "#b1", "#b2", "#b3"}), rounds
    # buckets began before the last backward ended (autograd runs without the GIL, so the
    # reducer thread gets to them; in every step of every replica when this was written,
    # any one of them suffices here, whatever the machine's load)
    assert sum(r.buckets_early for reports in res.reports.values() for r in reports) > 0
    # and the reducer's own CPU is measured (what it takes from the backward's cores)
    assert all(r.reduce_cpu_s > 0 for reports in res.reports.values() for r in reports)
    for reports in res.reports.values():
        names = {st.edge.split("@")[0] for st in reports[-1].edges
                 if st.kind == PacketKind.PARAM_GRAD}
        assert len(names) > 4, names
        assert any(n.endswith("q") for n in names) is (rank is not None), names


@pytest.mark.timed
@pytest.mark.parametrize("rank", [None, 2])
async def test_buckets_in_flight_pay_a_link_s_latency_about_once_per_round(
        small_text: TextWindows, adamw: OptimizerSpec, rank: int | None) -> None:
    """Two replicas, eight buckets, links of 100 ms one way: the reducer keeps every ready
    bucket in flight on its one thread, so the wait after the last backward is about one
    latency per round (one dense, two low-rank), not one per bucket and round (0.8 s dense,
    1.6 s low-rank, one after another). Sums unchanged: the replicas bit-identical, eager's
    losses where dense. SGD with momentum: with AdamW the two replicas, stepping at the same
    instant in one process, now and then (6 of 90 runs, one bucket at a time as well) came
    out apart in half of one tensor after identical gradients (docs/runtime.md)."""
    import dataclasses

    sgd = dataclasses.replace(adamw, kind="sgd", momentum=0.9, lr=0.05)
    latency_s = 0.1
    g, programs, routes = _data_parallel(2)
    steps = 3
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=MICRO, optimizer=sgd, steps=steps,
                               grad_rank=rank, config=StageConfig(grad_buckets=8),
                               latency_s=latency_s)
    states = [res.states[res.slots[(0, r)]] for r in range(2)]
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k
    if rank is None:
        ref = gpt2("tiny")
        ref.load_state_dict(g.state_dict())
        want = ReferenceTrainer(ref, lm_loss, sgd, data=small_text, batch_size=BATCH,
                                micro_batches=MICRO, total_steps=steps).train(0, steps)
        assert res.losses == pytest.approx(want, rel=1e-5)
    rounds = 1 if rank is None else 2
    for reports in res.reports.values():
        names = {st.edge.split("@")[0] for st in reports[-1].edges
                 if st.kind == PacketKind.PARAM_GRAD}
        assert len(names) >= 8 * rounds - 1, names  # (a bucket of vectors only: one round)
        exposed = sorted(r.reduce_exposed_s for r in reports)
        # a round's latency, queued packets' turns and the CPU: well under one per bucket
        assert exposed[len(exposed) // 2] < (rounds + 2.5) * latency_s, exposed


async def _train_in_groups(small_text: TextWindows, adamw: OptimizerSpec,
                           groups: tuple[tuple[int, ...], ...], rank: int | None,
                           two_level: bool) -> ReplicatedResult:
    """One GPT-2 tiny stage on one replica per slot of `groups`, reduced by the groups (with
    buckets small enough that several go during the last backward), 3 steps: eager
    training's losses (dense; low-rank near them), every replica's weights bit-identical.
    The run's result, for who sent what."""
    n = sum(len(g) for g in groups)
    g, programs, routes = _data_parallel(n)
    steps = 3
    res = await run_replicated(programs, routes, data=small_text, batch_size=BATCH,
                               micro_batches=MICRO, optimizer=adamw, steps=steps,
                               grad_rank=rank, grad_groups={0: groups},
                               grad_two_level=two_level)
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    want = ReferenceTrainer(ref, lm_loss, adamw, data=small_text, batch_size=BATCH,
                            micro_batches=MICRO, total_steps=steps).train(0, steps)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5 if rank is None else 0.05)
    states = [res.states[res.slots[(0, r)]] for r in range(n)]
    for k in states[0]:
        assert all(torch.equal(states[0][k], st[k]) for st in states[1:]), k
    return res


@pytest.mark.parametrize(("groups", "rank"), [(((0, 1), (2, 3)), None), (((0, 2, 4), (1, 3)), None),
                                              (((0, 1), (2,), (3, 4)), 2)])
async def test_replicas_in_bandwidth_groups_sum_hierarchically(
        small_text: TextWindows, adamw: OptimizerSpec, monkeypatch: pytest.MonkeyPatch,
        groups: tuple[tuple[int, ...], ...], rank: int | None) -> None:
    """The plan's "hierarchical" reduction (`StageConfig.grad_groups`): each group sums by its
    own ring, the groups' first replicas by theirs (the only traffic between groups: one
    gradient's worth each way per first replica, not 2 (n - 1) / n of it per ring step of
    everyone), and they send the total back inside their group. Eager training's losses
    (dense), replicas bit-identical, low-rank too (two rounds per bucket, each hierarchical),
    with buckets small enough that several go during the last backward."""
    from fusiond.plan import model as plan_model

    monkeypatch.setattr(plan_model, "BUCKET_MIN_BYTES", 8192)
    res = await _train_in_groups(small_text, adamw, groups, rank, two_level=False)
    # who sent to whom: only the groups' first replicas cross between groups
    group_of = {res.slots[(0, r)]: i for i, gr in enumerate(groups) for r in gr}
    firsts = {res.slots[(0, gr[0])] for gr in groups}
    for slot, reports in res.reports.items():
        for st in reports[-1].edges:
            if st.kind == PacketKind.PARAM_GRAD and st.wire_bytes and st.peer != slot:
                assert group_of[st.peer] == group_of[slot] or (
                    slot in firsts and st.peer in firsts), (slot, st.peer, st.edge)


@pytest.mark.parametrize(("groups", "rank"), [(((0, 1), (2, 3)), None),
                                              (((0, 2, 4), (1, 3)), None),
                                              (((0, 1, 2), (3, 4)), 2)])
async def test_replicas_in_bandwidth_groups_sum_two_level(
        small_text: TextWindows, adamw: OptimizerSpec, monkeypatch: pytest.MonkeyPatch,
        groups: tuple[tuple[int, ...], ...], rank: int | None) -> None:
    """The plan's "two-level" reduction (`StageConfig.grad_two_level`): the gradient in as
    many shards as the smallest group has replicas, each summed inside each group by its
    owner there, then across the groups by a ring of its owners, then sent back inside. A
    group larger than the smallest has replicas that own no shard. Eager training's losses
    (dense), replicas bit-identical, low-rank too; between groups only the shards' owners
    talk, each to the owners of its shard."""
    from fusiond.plan import model as plan_model

    monkeypatch.setattr(plan_model, "BUCKET_MIN_BYTES", 8192)
    res = await _train_in_groups(small_text, adamw, groups, rank, two_level=True)
    shards = min(len(gr) for gr in groups)
    group_of = {res.slots[(0, r)]: i for i, gr in enumerate(groups) for r in gr}
    shard_of = {res.slots[(0, r)]: j for gr in groups for j, r in enumerate(gr) if j < shards}
    crossed: set[int] = set()
    for slot, reports in res.reports.items():
        for st in reports[-1].edges:
            if st.kind == PacketKind.PARAM_GRAD and st.wire_bytes and st.peer != slot \
                    and group_of[st.peer] != group_of[slot]:
                crossed.add(slot)
                assert shard_of.get(slot) == shard_of.get(st.peer) is not None, \
                    (slot, st.peer, st.edge)
    assert crossed == set(shard_of)  # every shard's owners, not only the first slots


async def test_grad_groups_that_are_not_a_partition_are_refused(
        small_text: TextWindows, adamw: OptimizerSpec) -> None:
    from fusiond.train.stage import StageError

    from .gpt_stages import one_stage

    g = gpt2("tiny")
    with pytest.raises(StageError, match="are not two or more disjoint groups"):
        await run_replicated([[one_stage(g) for _ in range(3)]], [[m % 3 for m in range(MICRO)]],
                             data=small_text, batch_size=BATCH, micro_batches=MICRO,
                             optimizer=adamw, steps=1, grad_groups={0: ((0, 1), (1, 2))})
