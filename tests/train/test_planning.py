"""Planner -> layout -> job: the plan's cut runs on the plan's machines and matches eager; a
job that fits no machine's memory is refused before anything starts."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from fusiond.harness.inproc import inproc_cluster
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.planning import layout_from_plan, plan_job
from fusiond.plan import Cluster, MachineProfile, PlanError
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer
from fusiond.train.model import build_model, loss_fn

pytestmark = pytest.mark.slow


def _machines(memory: float) -> list[MachineProfile]:
    return [MachineProfile(id=f"node{i}", flops={"other": 5e9}, mem_bw=5e9, op_overhead_s=2e-5,
                           memory_bytes=memory) for i in range(3)]


def _assert_eager_losses(spec: Any, losses: list[float]) -> None:
    """The job's per-step losses are eager single-process training's (rel 1e-4)."""
    rt = ReferenceTrainer(build_model(spec.model, seed=spec.seed), loss_fn(spec.loss),
                          spec.optimizer, data=make_source(spec.data, spec.seed),
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          total_steps=spec.steps)
    for got, exp in zip(losses, rt.train(0, spec.steps), strict=True):
        assert got == pytest.approx(exp, rel=1e-4)


def _plan_that_fits_only_with(spec: Any, without: Any, cap: Any,
                              memories: tuple[float, ...]) -> Any:
    """The plan of `spec` on three machines of the first size in `memories` where `without`
    (the same job lacking a memory option) cannot be planned and `spec` can; None if none."""
    for memory in memories:
        cluster = Cluster.build(_machines(memory), [[1.25e9] * 3] * 3)
        try:
            plan_job(without, cap, cluster)
            continue
        except PlanError:
            pass
        try:
            return plan_job(spec, cap, cluster)
        except PlanError:
            continue
    return None


async def _run(spec: Any, cap: Any, layout: Any, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """Run `layout` on 3 in-process nodes, node0 scheduling: (its outcome, its last status)."""
    async with inproc_cluster(3) as nodes:
        sched = nodes["node0"]
        c = JobCoordinator(send=sched.send_fn(), spec=spec, captured=cap, layout=layout,
                           addresses={n: x.net.address for n, x in nodes.items()}, term=1, **kw)
        sched.coordinators.append(c)
        out = await asyncio.wait_for(c.run(), 120)
        return out, c.status()


async def test_planned_job_matches_eager(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=5)
    cluster = Cluster.build(_machines(8e9), [[1.25e9] * 3] * 3)  # 10 Gbit/s: no compression
    plan = plan_job(spec, cap, cluster)
    layout = layout_from_plan("planned", cap.graph, cap.state, plan, spec)
    assert [s.node_id for s in layout.stages] == plan.machine_of_stage()
    assert len(layout.stages) >= 2 and not layout.densities
    losses: list[float] = []
    out, _ = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    _assert_eager_losses(spec, losses)


def test_job_larger_than_the_cluster_is_refused(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    cluster = Cluster.build(_machines(64e3), [[1.25e9] * 3] * 3)  # 64 kB each
    with pytest.raises(PlanError, match="fits the machines' memory"):
        plan_job(spec, cap, cluster)


def _int8(spec):  # type: ignore[no-untyped-def]
    return replace(spec, compression=replace(spec.compression, codec="int8", adatopk=False))


async def test_planned_int8_job_trains_with_quarter_size_cuts(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """`compression.codec = "int8"`: the planner costs the cuts int8, every float cut edge goes
    int8 both ways through the real Assign path (peer links on loopback), and it trains."""
    spec, cap = captured_tiny
    spec = _int8(replace(spec, steps=6))
    cluster = Cluster.build(_machines(8e9), [[1.25e9] * 3] * 3)
    plan = plan_job(spec, cap, cluster)
    assert plan.method == "op-fence+int8" and not plan.densities
    layout = layout_from_plan("int8", cap.graph, cap.state, plan, spec)
    assert len(layout.stages) >= 2 and not layout.densities
    routes = layout.edges()
    floats = {e.id for s in layout.stages for e in s.partition.outputs
              if e.meta.is_float and e.id in {r.edge for r in routes}}
    assert floats and layout.int8_edges == floats
    assert {r.edge: r.encoding for r in routes} == {
        r.edge: "int8" if r.edge in floats else "raw" for r in routes}
    assert all(r.density == 1.0 for r in routes)
    losses: list[float] = []
    out, status = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    rt = ReferenceTrainer(build_model(spec.model, seed=spec.seed), loss_fn(spec.loss),
                          spec.optimizer, data=make_source(spec.data, spec.seed),
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          total_steps=spec.steps)
    want = rt.train(0, spec.steps)
    assert losses[-1] < losses[0]
    for got, exp in zip(losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-3)
    assert losses != pytest.approx(want, rel=1e-7)  # quantized, not exact
    quantized = [e for e in status["edges"] if e["edge"] in floats]
    assert quantized and all(e["encoding"] == "int8" for e in quantized)
    for e in quantized:
        for way in ("forward", "backward"):
            dense = e["dense_bytes"][way]
            assert 0.2 * dense < e["wire_bytes"][way] < 0.30 * dense, (e, way)  # lz4 may help


def test_an_assign_with_a_bad_or_top_k_int8_edge_is_refused(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    from fusiond.errors import RemoteError
    from fusiond.graph import contiguous_assignment
    from fusiond.jobs.assign import LayoutError, assign_messages, layout_job
    from fusiond.train.remote import decode_assign, program_from_assignment

    spec, cap = captured_tiny
    names = ["a", "b"]
    ops = {op: names[p] for op, p in contiguous_assignment(cap.graph, 2).items()}
    layout = layout_job("j", cap.graph, cap.state, ops, int8=True)
    assert layout.int8_edges
    with pytest.raises(LayoutError, match="int8"):
        layout_job("j", cap.graph, cap.state, ops, int8=True, density=0.1)
    msgs = assign_messages(layout, _int8(spec), cap.state, term=1, plan_version=1,
                           addresses={"a": ("127.0.0.1", 1), "b": ("127.0.0.1", 2)})
    msg, payload = msgs["a"]
    sa = decode_assign(msg, payload)
    prog = program_from_assignment(sa)
    assert {e.edge_id for e in prog.out_edges if e.encoding == "int8"} == set(layout.int8_edges)
    edge = next(r for r in msg.edges if r.encoding == "int8")
    for bad, why in ((replace(edge, encoding="fp4"), "encoding 'fp4' is not one of"),
                     (replace(edge, density=0.5), "is int8 and top-k")):
        tampered = replace(msg, edges=tuple(bad if r is edge else r for r in msg.edges))
        with pytest.raises(RemoteError, match=why) as ei:
            decode_assign(tampered, payload)
        assert edge.edge in str(ei.value)


async def test_checkpoints_are_gathered_off_the_event_loop(  # type: ignore[no-untyped-def]
        captured_tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage sends its partition's state at a checkpoint step; decoding and gathering
    them into the whole model (a model's worth of bytes) runs in a worker thread, not on the
    scheduler's event loop, as do the final results; a checkpoint is the whole model (one
    copy of a tied weight, as the final model)."""
    import threading

    from fusiond.jobs import coordinator

    spec, cap = captured_tiny
    spec = replace(spec, steps=5, checkpoint_interval=2)  # after steps 1 and 3; 4 ends it
    cluster = Cluster.build(_machines(8e9), [[1.25e9] * 3] * 3)
    layout = layout_from_plan("ckpt", cap.graph, cap.state, plan_job(spec, cap, cluster), spec)
    assert len(layout.stages) >= 2
    on_loop: list[bool] = []
    real = coordinator._gather

    def spy(graph, parts):  # type: ignore[no-untyped-def]
        on_loop.append(threading.current_thread() is threading.main_thread())
        return real(graph, parts)

    monkeypatch.setattr(coordinator, "_gather", spy)
    got: list[tuple[int, set[str]]] = []
    out, _ = await _run(spec, cap, layout,
                        on_checkpoint=lambda step, state: got.append((step, set(state))))
    assert out.ok, out.failure
    assert [step for step, _ in got] == [1, 3]
    assert out.state is not None  # each checkpoint holds what the final model holds
    assert all(names == set(out.state) for _, names in got)
    assert len(on_loop) == 3 and not any(on_loop), on_loop  # two checkpoints, the results


def test_a_slow_sync_link_makes_replicas_reduce_their_gradients_low_rank() -> None:
    """Two replicas on a 20 Mbit/s link: the dense reduction would not hide behind the drain,
    so the planner sends the job's rank-4 factors (the floor: what rank 4 sends of the
    model's gradient) and every stage's Assign says so; on a fast link, or with
    compression.grad_rank = 0, gradients stay dense. A rank out of bounds is refused."""
    from fusiond.errors import RemoteError
    from fusiond.jobs.assign import assign_messages
    from fusiond.jobs.planning import grad_floor, job_settings
    from fusiond.train.programs import capture_job
    from fusiond.train.remote import decode_assign
    from fusiond.train.spec import parse_job

    text = """
[job]
name = "lowrank"
steps = 4
[model]
zoo = "gpt2"
config = { size = "tiny", vocab_size = 256 }
[data]
seq_len = 32
[batch]
size = 16
micro_batches = 4
replicas = true
"""
    spec = parse_job(text)
    _, cap = capture_job(spec)
    floor = grad_floor(spec, cap.graph)
    assert 0 < floor < 0.5 and job_settings(spec, cap.graph).grad_density_floor == floor
    assert job_settings(spec).grad_density_floor == 1.0  # no graph: dense

    def plan_on(mbit: float, s: Any = spec) -> Any:
        ms = [MachineProfile(id=f"node{i}", flops={"other": 2e9}, mem_bw=5e9,
                             op_overhead_s=2e-5, memory_bytes=8e9) for i in range(2)]
        cl = Cluster.build(ms, [[mbit * 1e6 / 8] * 2] * 2, [[0.001] * 2] * 2)
        return layout_from_plan("j", cap.graph, cap.state, plan_job(s, cap, cl), s)

    slow = plan_on(20)
    assert slow.replicas and slow.grad_rank == 4
    assert plan_on(1000).grad_rank is None
    dense_spec = parse_job(text + "[compression]\ngrad_rank = 0\n")
    assert plan_on(20, dense_spec).grad_rank is None
    msgs = assign_messages(slow, spec, cap.state, term=1, plan_version=1,
                           addresses={"node0": ("127.0.0.1", 1), "node1": ("127.0.0.1", 2)})
    for msg, payload in msgs.values():
        assert decode_assign(msg, payload).grad_rank == 4
    msg, payload = msgs["node1"]
    assert msg.config is not None
    for bad in (0, 65):
        tampered = replace(msg, config=replace(msg.config, grad_rank=bad))
        with pytest.raises(RemoteError, match="grad_rank"):
            decode_assign(tampered, payload)


async def test_a_job_that_fits_only_recomputing_is_planned_so_and_trains_exactly(
        captured_tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """On machines too small to keep a pipeline's in-flight activations, the planner has the
    stages that need it recompute them (batch.recompute, the default), the whole stage or
    some of its blocks, where it would refuse the job otherwise (batch.recompute = false);
    the layout's Assigns tell those stages, they recompute (a second forward per micro-batch)
    and the job trains as eager does."""
    from fusiond.train import segments as segments_mod
    from fusiond.train import stage as stage_mod

    spec, cap = captured_tiny
    spec = replace(spec, steps=4)
    off = replace(spec, batch=replace(spec.batch, recompute=False))
    # the first size only recomputing fits
    plan = _plan_that_fits_only_with(spec, off, cap, (8e5, 7e5, 6e5, 5e5, 4.5e5, 4e5))
    assert plan is not None, "no machine size where only recomputing fits"
    ev = plan.evaluation
    assert ev.memory_ok and any(r.recompute or r.checkpoint_blocks for r in ev.stages)
    assert all(r.memory_bytes <= r.memory_cap for r in ev.stages)
    layout = layout_from_plan("recompute", cap.graph, cap.state, plan, spec)
    assert layout.recompute == {r.machine_id for r in ev.stages if r.recompute}
    calls: list[int] = []
    real = stage_mod.StageExecutor._recompute

    def counted(self: Any, step: int, micro: int, ctx: Any) -> None:
        calls.append(self.stage)
        real(self, step, micro, ctx)

    blocks: list[int] = []  # per-block: each checkpointed block's forward, per micro-batch
    real_ckpt = segments_mod.checkpoint

    def ckpt(*a: Any, **k: Any) -> Any:
        blocks.append(1)
        return real_ckpt(*a, **k)

    monkeypatch.setattr(stage_mod.StageExecutor, "_recompute", counted)
    monkeypatch.setattr(segments_mod, "checkpoint", ckpt)
    losses: list[float] = []
    out, _ = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    runs = spec.steps * spec.batch.micro_batches
    recomputing = {r.index for r in ev.stages if r.recompute}
    assert set(calls) == recomputing
    assert len(calls) == len(recomputing) * runs
    assert len(blocks) == sum(len(r.checkpoint_blocks) for r in ev.stages) * runs
    _assert_eager_losses(spec, losses)


async def test_a_job_that_fits_only_offloading_is_planned_so_and_trains_exactly(
        captured_tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """On machines that hold a stage's weights, gradients and activations but not its AdamW
    state, the planner has the stages that need it keep that state on disk (batch.offload,
    the default) where it would refuse the job otherwise (batch.offload = false); the Assigns
    tell those stages, they map their state from files (and release it every step), and the
    job trains as eager does."""
    from fusiond.train import offload as offload_mod

    spec, cap = captured_tiny
    spec = replace(spec, steps=4)
    off = replace(spec, batch=replace(spec.batch, offload=False))
    # the first size only offloading fits
    plan = _plan_that_fits_only_with(spec, off, cap, (6e5, 5e5, 4.5e5, 4e5, 3.5e5, 3e5, 2.5e5))
    assert plan is not None, "no machine size where only offloading fits"
    ev = plan.evaluation
    assert ev.memory_ok and any(r.offload for r in ev.stages)
    layout = layout_from_plan("offload", cap.graph, cap.state, plan, spec)
    assert layout.offload == {r.machine_id for r in ev.stages if r.offload}
    dirs: list[Any] = []
    real = offload_mod.DiskOptimizerState.__init__

    def seen(self: Any, opt: Any, directory: Any) -> None:
        dirs.append(directory)
        real(self, opt, directory)

    monkeypatch.setattr(offload_mod.DiskOptimizerState, "__init__", seen)
    losses: list[float] = []
    out, _ = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    assert len(dirs) == len(layout.offload)
    assert all("offload" in str(d) and "v" in d.parent.name + d.name for d in dirs)
    assert all(not d.parent.exists() for d in dirs)  # removed when the stage closed
    _assert_eager_losses(spec, losses)


async def test_a_job_that_fits_only_with_its_weights_on_disk_trains_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On machines that cannot hold a stage's weights and gradients, the per-block memory
    planner (`fusiond.plan.memory`) puts them on disk too, about two blocks mapped at a time, and
    checkpoints the blocks whose activations would not fit: the plan says so, `fusionctl
    plan` shows it, the Assigns carry it to the stages, which run segment by segment with
    their weights in files, and the job trains as eager does."""
    from fusiond.plan import plan_summary, render_plan
    from fusiond.train import offload as offload_mod
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import default_text_path, parse_job

    from .conftest import CAPTURED_JOB

    # six blocks of width 64: enough blocks that three of them are less than the stage
    spec = parse_job(CAPTURED_JOB.replace('size = "tiny"', 'size = "tiny", n_layer = 6, '
                                          'n_embd = 64'), base=default_text_path())
    spec = replace(spec, steps=3)
    _, cap = capture_job(spec)
    plan = None
    for memory in (3e6, 2.5e6, 2e6, 1.8e6, 1.6e6):
        cluster = Cluster.build(_machines(memory), [[1.25e9] * 3] * 3)
        try:
            got = plan_job(spec, cap, cluster)
        except PlanError:
            break
        if any(r.offload_params for r in got.evaluation.stages):
            plan = got
            break
    assert plan is not None, "no machine size where the weights go to disk"
    # the same machines with too little free disk for a stage's files: no plan, and the
    # refusal says where the room would come from
    full = [replace(m, disk_free_bytes=2e5) for m in _machines(memory)]
    with pytest.raises(PlanError, match="disk any machine may give a stage's files"):
        plan_job(spec, cap, Cluster.build(full, [[1.25e9] * 3] * 3))
    roomy = [replace(m, disk_free_bytes=1e12) for m in _machines(memory)]
    assert any(r.offload_params for r in plan_job(
        spec, cap, Cluster.build(roomy, [[1.25e9] * 3] * 3)).evaluation.stages)
    ev = plan.evaluation
    assert ev.memory_ok and all(r.memory_bytes <= r.memory_cap for r in ev.stages)
    weights = {r.machine_id for r in ev.stages if r.offload_params}
    assert all(r.offload for r in ev.stages if r.offload_params)  # the state goes first
    assert "weights-on-disk" in render_plan(plan)
    assert any(s["offload_params"] for s in plan_summary(plan)["stages"])
    layout = layout_from_plan("weights", cap.graph, cap.state, plan, spec)
    assert layout.offload_params == weights
    from fusiond.errors import RemoteError
    from fusiond.jobs.assign import assign_messages
    from fusiond.train.remote import decode_assign

    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses={f"node{i}": ("127.0.0.1", i + 1) for i in range(3)})
    for node, (msg, payload) in msgs.items():
        sa = decode_assign(msg, payload)
        assert sa.offload_params == (node in weights) and sa.offload >= sa.offload_params
        assert sa.checkpoint_blocks == layout.checkpoint_blocks.get(node, ())
        assert msg.config is not None
        for bad, what in (({str(sa.stage): (999,)}, "not blocks of this partition"),
                          ({"77": (0,)}, "not a slot")):
            tampered = replace(msg, config=replace(msg.config, checkpoint_blocks=bad))
            with pytest.raises(RemoteError, match=what):
                decode_assign(tampered, payload)
    made: list[Any] = []
    real = offload_mod.DiskParameters.__init__

    def seen(self: Any, params: Any, groups: Any, directory: Any) -> None:
        made.append((len(groups), directory))
        real(self, params, groups, directory)

    monkeypatch.setattr(offload_mod.DiskParameters, "__init__", seen)
    losses: list[float] = []
    out, _ = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    assert len(made) == len(weights) and all(n > 1 for n, _ in made)  # by segment
    assert all(not d.exists() for _, d in made)
    _assert_eager_losses(spec, losses)


def test_a_stage_holds_its_weights_once(captured_tiny,  # type: ignore[no-untyped-def]
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights an Assign carries are decoded, copied into the stage's module, and the
    decoded tensors then freed: a stage host does not keep a second copy of its weights for
    the job's life (which, with its weights on disk, would be all of them in memory)."""
    import gc
    import weakref

    import torch

    from fusiond.graph import contiguous_assignment
    from fusiond.jobs.assign import assign_messages, layout_job
    from fusiond.train import remote as remote_mod

    spec, cap = captured_tiny
    names = ["a", "b"]
    ops = {op: names[p] for op, p in contiguous_assignment(cap.graph, 2).items()}
    layout = layout_job("j", cap.graph, cap.state, ops)
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses={"a": ("127.0.0.1", 1), "b": ("127.0.0.1", 2)})
    decoded: list[weakref.ref[torch.Tensor]] = []
    real = remote_mod.state_views

    def watched(data: bytes | memoryview) -> dict[str, torch.Tensor]:
        got = real(data)
        decoded.extend(weakref.ref(t) for t in got.values())
        return got

    monkeypatch.setattr(remote_mod, "state_views", watched)

    class _Net:
        async def send(self, *a: Any, **k: Any) -> None:
            return None

        def send_now(self, *a: Any, **k: Any) -> bool:
            return False

    msg, payload = msgs["a"]
    host = remote_mod.StageHost(msg, payload, _Net())  # type: ignore[arg-type]
    gc.collect()
    assert decoded and host.assignment.state == {}
    assert all(r() is None for r in decoded)  # only the module's copy is left
    params = dict(host.program.module.named_parameters())
    bad = [n for n, p in params.items() if n in cap.state and not torch.equal(p, cap.state[n])]
    assert params and not bad, bad


def test_the_schedulers_machine_is_planned_with_room_for_its_own_copies(  # type: ignore[no-untyped-def]
        captured_tiny) -> None:
    """The scheduler's machine offers jobs its free memory less two copies of the model's
    state (its own stage's Assign joined on local delivery, a checkpoint of every stage in
    flight); the other machines are as they were."""
    import numpy as np

    from fusiond.jobs.planning import reserve_for_scheduler, scheduler_reserve_bytes
    from fusiond.plan import Cluster, MachineProfile

    _, cap = captured_tiny
    state_bytes = sum(t.numel() * t.element_size() for t in cap.state.values())
    assert scheduler_reserve_bytes(cap) == 2 * state_bytes
    ms = [MachineProfile(n, {"other": 1e9}, mem_bw=1e9, op_overhead_s=1e-6, memory_bytes=m)
          for n, m in (("lead", 1e9), ("w", 1e9), ("tiny", 10.0))]
    c = Cluster.build(ms, np.full((3, 3), 1e8))
    got = reserve_for_scheduler(c, "lead", scheduler_reserve_bytes(cap))
    assert [m.memory_bytes for m in got.machines] == [1e9 - 2 * state_bytes, 1e9, 10.0]
    assert reserve_for_scheduler(c, "tiny", 1e6).machines[2].memory_bytes == 1.0
    assert reserve_for_scheduler(c, "elsewhere", 1e6) is c
