"""The in-process pipeline against eager training: same losses, same weights; failures named."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.train.data import TextWindows
from fusiond.train.local import MemoryLinks, ReferenceTrainer, run_pipeline
from fusiond.train.schedule import one_f_one_b
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import (
    RUN_AHEAD_STEPS,
    EdgeSpec,
    PacketKind,
    StageError,
    StageExecutor,
    StageProgram,
)

from .gpt_stages import merged_state, three_stages

STEPS = 20


def _reference(g: nn.Module, opt: OptimizerSpec, data: TextWindows, steps: int,
               micro: int = 4) -> tuple[list[float], Mapping[str, torch.Tensor]]:
    ref = gpt2("tiny")
    ref.load_state_dict(g.state_dict())
    rt = ReferenceTrainer(ref, lm_loss, opt, data=data, batch_size=8, micro_batches=micro,
                          total_steps=steps)
    return rt.train(0, steps), ref.state_dict()


@pytest.mark.parametrize("pipeline", ["1f1b", "gpipe"])
async def test_three_stages_match_eager(
    pipeline: str, small_text: TextWindows, adamw: OptimizerSpec
) -> None:
    torch.manual_seed(0)
    g = gpt2("tiny")
    progs = three_stages(g)
    steps = STEPS if pipeline == "1f1b" else 5
    res = await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=4,
                             optimizer=adamw, steps=steps, pipeline=pipeline,
                             tokens_per_sample=32)
    want, want_state = _reference(g, adamw, small_text, steps)
    assert len(res.losses) == steps
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    assert res.losses[-1] < res.losses[0]
    got_state = merged_state(progs)
    for k, v in want_state.items():
        torch.testing.assert_close(got_state[k], v, rtol=1e-4, atol=1e-5, msg=k)
    # the tied weight's two copies stayed identical
    assert torch.equal(got_state["transformer.wte.weight"], got_state["lm_head.weight"])
    m = res.metrics[-1]
    assert set(m.stage_busy) == {0, 1, 2} and all(0 < b <= 1 for b in m.stage_busy.values())
    # uncompressed: every edge moves its dense bytes (plus small headers) both ways
    assert {e.edge for e in m.edges} == {"h0", "h1"}
    for e in m.edges:
        assert e.forward_dense == e.backward_dense == 8 * 32 * 32 * 4  # batch, seq, embd, fp32
        assert e.forward_dense <= e.forward_wire < e.forward_dense * 1.05
    assert m.shared_bytes > 0
    assert m.as_dict()["tokens_per_s"] > 0


async def test_topk_edges_compress_and_train(small_text: TextWindows,
                                             adamw: OptimizerSpec) -> None:
    torch.manual_seed(0)
    g = gpt2("tiny")
    res = await run_pipeline(three_stages(g, density=0.1), data=small_text, batch_size=8,
                             micro_batches=4, optimizer=adamw, steps=8)
    m = res.metrics[-1]
    for e in m.edges:
        assert e.density == 0.1
        # fp16 values + indices for 10 %: well under a quarter of the dense bytes
        assert e.forward_wire < 0.25 * e.forward_dense
        assert e.backward_wire < 0.25 * e.backward_dense
    assert res.losses[-1] < res.losses[0]


async def test_int8_edges_quantize_both_ways_and_train(small_text: TextWindows,
                                                      adamw: OptimizerSpec) -> None:
    torch.manual_seed(0)
    g = gpt2("tiny")

    steps = 8
    execs: list[StageExecutor] = []
    res = await run_pipeline(three_stages(g, encoding="int8"), data=small_text, batch_size=8,
                             micro_batches=4, optimizer=adamw, steps=steps,
                             on_executors=execs.extend)
    want, _ = _reference(g, adamw, small_text, steps)
    m = res.metrics[-1]
    assert {e.edge for e in m.edges} == {"h0", "h1"}
    # 1 byte per element + a float32 scale per 256: (1 + 4/256) / 4 = 0.2539 of fp32, plus a
    # 96-byte descriptor per tensor (1.2 % of these 2 x 32 x 32 micro-batches), both ways; lz4
    # may shave a little more off the int8 bytes (0.22-0.24 seen on bench/wan.py's GPT-2 mini)
    for e in m.edges:
        assert e.density is None
        assert e.forward_dense == e.backward_dense == 8 * 32 * 32 * 4
        assert 0.2 * e.forward_dense < e.forward_wire < 0.27 * e.forward_dense
        assert 0.2 * e.backward_dense < e.backward_wire < 0.27 * e.backward_dense
    # it trains, with the exact run's losses (measured: within 2e-5 relative; the scales of
    # 256 elements keep every element within absmax/254 of its value)
    assert res.losses[-1] < res.losses[0] - 0.2
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-3)
    assert res.losses[0] != pytest.approx(want[0], rel=1e-7)  # ... but the edges quantized
    with pytest.raises(StageError, match="travels int8"):  # AdaTopK re-adaptation cannot
        execs[0].set_density("h0", 0.1)                      # turn an int8 edge top-k


def _edge_program(fail_at: int | None = None) -> list[StageProgram]:
    """Two stages: y = w0 * x -> edge -> loss = mean((w1 * y - t)^2)."""
    w0, w1 = nn.Linear(4, 4), nn.Linear(4, 4)
    e = EdgeSpec("y", 0, 1)
    calls = [0]

    def run0(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls[0] += 1
        if fail_at is not None and calls[0] == fail_at:
            raise RuntimeError("boom")
        return {"y": w0(i["inputs"])}

    def run1(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": ((w1(i["y"]) - i["targets"]) ** 2).mean()}

    return [
        StageProgram(w0, run0, (), (e,), ("inputs",)),
        StageProgram(w1, run1, (e,), (), ("targets",), True),
    ]


class _Regression:
    def batch(self, step: int, size: int):  # type: ignore[no-untyped-def]
        from fusiond.train.data import Batch

        g = torch.Generator().manual_seed(step)
        x = torch.randn(size, 4, generator=g)
        return Batch(x, x.flip(1))


async def test_task_failure_names_stage_and_step(adamw: OptimizerSpec) -> None:
    # Repeated: the failure races packets in flight to the other stage, whose cancellation
    # must never be lost (it once was, through asyncio.wait_for, leaving it waiting 120 s).
    for _ in range(15):
        with pytest.raises(ExceptionGroup) as ei:
            async with asyncio.timeout(10):
                await run_pipeline(_edge_program(fail_at=6), data=_Regression(), batch_size=4,
                                   micro_batches=2, optimizer=adamw, steps=5)
        errs = [e for e in ei.value.exceptions if isinstance(e, StageError)]
        assert any("stage 0, step 2, F1" in str(e) and "boom" in str(e) for e in errs), errs


async def test_a_non_finite_activation_on_an_int8_edge_fails_as_the_jobs_fault(
        adamw: OptimizerSpec) -> None:
    """int8 cannot scale inf or nan (a raw edge would carry it on): the job fails naming the
    stage and step, and blames no machine (the model diverged)."""
    from fusiond.train.stage import FAULT_JOB

    w0, w1 = nn.Linear(4, 4), nn.Linear(4, 4)
    e = EdgeSpec("y", 0, 1, encoding="int8")

    def run0(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": w0(i["inputs"]) * float("inf")}

    def run1(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": ((w1(i["y"]) - i["targets"]) ** 2).mean()}

    progs = [StageProgram(w0, run0, (), (e,), ("inputs",)),
             StageProgram(w1, run1, (e,), (), ("targets",), True)]
    with pytest.raises(ExceptionGroup) as ei:
        async with asyncio.timeout(10):
            await run_pipeline(progs, data=_Regression(), batch_size=4, micro_batches=2,
                               optimizer=adamw, steps=2)
    errs = [x for x in ei.value.exceptions if isinstance(x, StageError)]
    assert any("stage 0, step 0, F0" in str(x) and "finite" in str(x) and x.fault == FAULT_JOB
               for x in errs), errs
    with pytest.raises(StageError, match="cannot also be top-k"):
        EdgeSpec("y", 0, 1, 0.1, encoding="int8")


def _lone_stage1(adamw: OptimizerSpec, steps: int, recv_timeout_s: float
                 ) -> tuple[Any, Any]:
    """Stage 1 of the edge program with no stage 0 running: its first input never comes."""
    from fusiond.train.local import MemoryLinks
    from fusiond.train.schedule import one_f_one_b
    from fusiond.train.stage import StageConfig, StageExecutor

    hub = MemoryLinks()
    ex = StageExecutor(stage=1, program=_edge_program()[1], link=hub.link(1),
                       tasks=one_f_one_b(2, 2)[1], micro_batches=2, optimizer=adamw,
                       total_steps=steps, data=_Regression(), batch_size=4,
                       config=StageConfig(recv_timeout_s=recv_timeout_s))
    return ex, hub


async def test_missing_input_times_out_naming_the_edge(adamw: OptimizerSpec) -> None:
    ex, hub = _lone_stage1(adamw, 1, 0.2)
    await ex.start()
    try:
        with pytest.raises(StageError, match=r"stage 1, step 0, F0: no forward on edge 'y'"):
            await ex.run_step(0)
    finally:
        await ex.close()
        await hub.close()


async def test_a_cancelled_step_stops_the_compute_thread_at_once(adamw: OptimizerSpec) -> None:
    """The step runs on the compute thread, which waits for its inputs there: cancelling the
    step (a cancelled job) and closing the stage end that wait at once, not at the receive
    timeout, and a later step refuses to run."""
    import time

    ex, hub = _lone_stage1(adamw, 2, 60.0)
    await ex.start()
    try:
        step = asyncio.create_task(ex.run_step(0))
        await asyncio.sleep(0.2)  # the thread waits for F0's input
        t0 = time.monotonic()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        with pytest.raises(StageError, match="cancelled"):
            await ex.run_step(1)
    finally:
        await ex.close()
        await hub.close()
    assert time.monotonic() - t0 < 5.0  # close waited for the thread: it had stopped


async def test_a_full_send_queue_holds_the_compute_thread_until_the_link_takes_more(
        adamw: OptimizerSpec) -> None:
    """Backpressure: with `send_queue` packets queued or being sent, the compute thread waits
    before producing more (a slow link slows the stage, memory stays bounded); when the link
    takes them it goes on; a failure while it waits ends the wait with that failure."""
    from fusiond.train.schedule import gpipe
    from fusiond.train.stage import Packet, StageConfig, StageExecutor

    class Stalled:  # a link that takes nothing until opened
        def __init__(self) -> None:
            self.open = asyncio.Event()
            self.sent: list[Packet] = []

        async def send(self, packet: Packet) -> None:
            await self.open.wait()
            self.sent.append(packet)

    micro = 4
    link = Stalled()
    prog = _edge_program()[0]
    runs = [0]
    inner = prog.run

    def counted(i: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        runs[0] += 1
        return inner(i)

    prog.run = counted

    def stage0(program: StageProgram, recv_timeout_s: float, send_queue: int) -> StageExecutor:
        return StageExecutor(stage=0, program=program, link=link,
                             tasks=gpipe(2, micro)[0], micro_batches=micro, optimizer=adamw,
                             total_steps=2, data=_Regression(), batch_size=8,
                             config=StageConfig(recv_timeout_s=recv_timeout_s,
                                                send_queue=send_queue))

    ex = stage0(prog, 0.5, 2)
    await ex.start()
    try:
        step = asyncio.create_task(ex.run_step(0))
        await asyncio.sleep(0.3)
        # F0 is with the link, F1 queued: F2 ran and waits for room, F3 has not run
        assert not step.done() and link.sent == [] and runs[0] == 3
        link.open.set()
        # the forwards go out; then B0's gradient never comes: the receive timeout
        with pytest.raises(StageError, match="no backward on edge 'y'"):
            await step
        assert [p.micro for p in link.sent] == list(range(micro))
    finally:
        await ex.close()

    link = Stalled()
    ex = stage0(_edge_program()[0], 60.0, 1)
    await ex.start()
    try:
        step = asyncio.create_task(ex.run_step(0))
        await asyncio.sleep(0.3)
        ex.fail(StageError("stage 1 died"))
        with pytest.raises(StageError, match="stage 1 died"):
            await asyncio.wait_for(step, 5.0)
        # F0 is still with the stalled link: waiting for it to drain ends with the failure
        with pytest.raises(StageError, match="stage 1 died"):
            await asyncio.wait_for(ex.flush(), 5.0)
    finally:
        await ex.close()


async def test_deliver_rejects_unexpected_packets(adamw: OptimizerSpec) -> None:
    from fusiond.errors import RemoteError
    from fusiond.train.local import MemoryLinks
    from fusiond.train.schedule import one_f_one_b
    from fusiond.train.stage import Packet, StageExecutor

    progs = _edge_program()
    hub = MemoryLinks()
    ex = StageExecutor(stage=1, program=progs[1], link=hub.link(1), tasks=one_f_one_b(2, 2)[1],
                       micro_batches=2, optimizer=adamw, total_steps=1, data=_Regression(),
                       batch_size=4)
    ok = Packet(PacketKind.FORWARD, 0, 0, "y", 0, 1, b"")
    ex.deliver(ok)
    bad = [
        Packet(PacketKind.FORWARD, 0, 0, "y", 0, 2, b""),  # not for this stage
        Packet(PacketKind.FORWARD, 5, 0, "y", 0, 1, b""),  # a step far ahead
        Packet(PacketKind.FORWARD, 0, 7, "y", 0, 1, b""),  # no such micro-batch
        Packet(PacketKind.FORWARD, 0, 1, "zz", 0, 1, b""),  # unknown edge
        Packet(PacketKind.BACKWARD, 0, 0, "y", 0, 1, b""),  # stage 1 sends no edge
        ok,  # duplicate
    ]
    for p in bad:
        with pytest.raises(RemoteError):
            ex.deliver(p)
    await ex.close()


async def test_density_changes_mid_run_without_telling_the_receiver(
    small_text: TextWindows, adamw: OptimizerSpec
) -> None:

    torch.manual_seed(0)
    g = gpt2("tiny")
    execs: list[StageExecutor] = []

    def adapt(m: Any) -> None:
        if m.step == 2:  # AdaTopK re-adaptation: only the senders are told
            for ex in execs:
                for edge in ex.densities:
                    ex.set_density(edge, 0.1)

    res = await run_pipeline(three_stages(g), data=small_text, batch_size=8, micro_batches=4,
                             optimizer=adamw, steps=6, on_step=adapt, on_executors=execs.extend)
    want, _ = _reference(g, adamw, small_text, 6)
    # steps 0-2 ran dense: exactly the reference; step 3 on compressed, cheaper and still sane
    for got, exp in zip(res.losses[:3], want[:3], strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    dense, sparse = res.metrics[2], res.metrics[4]
    assert all(e.density is None for e in dense.edges)
    assert all(e.density == 0.1 for e in sparse.edges)
    assert sparse.wire_bytes < 0.25 * dense.wire_bytes
    assert all(abs(x) < 10 for x in res.losses)
    with pytest.raises(StageError, match="sends no edge"):
        execs[2].set_density("h0", 0.5)


async def test_tensors_ahead_of_their_step_wait_within_bounds(adamw: OptimizerSpec) -> None:
    """A neighbour that starts a step before this stage does (a resumed attempt whose JobStart
    came late, say) is not refused: its tensors wait, in a bounded inbox. Past the bound the
    attempt fails, saying so, instead of silently dropping what arrived."""
    from fusiond.errors import RemoteError
    from fusiond.train.local import MemoryLinks
    from fusiond.train.schedule import one_f_one_b
    from fusiond.train.stage import Packet, StageConfig, StageExecutor

    progs = _edge_program()
    hub = MemoryLinks()
    ex = StageExecutor(stage=1, program=progs[1], link=hub.link(1), tasks=one_f_one_b(2, 2)[1],
                       micro_batches=2, optimizer=adamw, total_steps=100, data=_Regression(),
                       batch_size=4, first_step=60, config=StageConfig(inbox_slack=0))
    try:
        assert ex.current_step == 60  # from the Assign on, not 0 until the JobStart
        # one step's inputs: 2 micro-batches on edge "y", so 2 x 2 packets may wait
        for step, micro in ((60, 0), (60, 1), (61, 0), (61, 1)):
            ex.deliver(Packet(PacketKind.FORWARD, step, micro, "y", 0, 1, b"x" * 10))
        with pytest.raises(RemoteError, match="at step 60 got forward for step 59"):
            ex.deliver(Packet(PacketKind.FORWARD, 59, 0, "y", 0, 1, b""))  # stale: refused
        ex.deliver(Packet(PacketKind.FORWARD, 62, 0, "y", 0, 1, b"x"))  # one too many
        with pytest.raises(StageError, match=r"5 packets \(41 bytes\) arrived ahead of their "
                                             r"tasks, more than the bound \(4 packets"):
            await ex.run_step(60)
    finally:
        await ex.close()
    ex2 = StageExecutor(stage=1, program=progs[1], link=hub.link(1),
                        tasks=one_f_one_b(2, 2)[1], micro_batches=2, optimizer=adamw,
                        total_steps=100, data=_Regression(), batch_size=4,
                        config=StageConfig(inbox_bytes=15))
    try:
        ex2.deliver(Packet(PacketKind.FORWARD, 0, 0, "y", 0, 1, b"x" * 10))
        ex2.deliver(Packet(PacketKind.FORWARD, 0, 1, "y", 0, 1, b"x" * 10))
        with pytest.raises(StageError, match=r"20 bytes\) arrived ahead"):
            await ex2.run_step(0)
    finally:
        await ex2.close()
        await hub.close()


def test_a_stage_failure_says_whose_fault_it_is() -> None:
    """The job's own computation raising (an index past an embedding, a shape) is the job's
    fault; a timeout, a peer's bad bytes and running out of memory are the machine's."""
    from fusiond.errors import RemoteError
    from fusiond.train.stage import FAULT_JOB, FAULT_MACHINE, fault_of
    from protocol.errors import RemoteProtocolError

    job = [IndexError("index out of range in self"), RuntimeError("shape '[2, 3]' is invalid"),
           ValueError("bad"), StageError("module produced no output", fault=FAULT_JOB)]
    machine = [StageError("no forward on edge 'y' within 5s"), MemoryError(),
               RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't "
                            "allocate memory: you tried to allocate 1 bytes"),
               torch.OutOfMemoryError("CUDA out of memory"), RemoteError("peer gone"),
               RemoteProtocolError("bad frame"), ConnectionResetError()]
    assert [fault_of(e) for e in job] == [FAULT_JOB] * len(job)
    assert [fault_of(e) for e in machine] == [FAULT_MACHINE] * len(machine)


def _one_stage(adamw: OptimizerSpec, steps: int) -> Any:
    """A whole model in one stage (data in, loss out): no packets, only steps."""
    w = nn.Linear(4, 4)

    def run(i: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"loss": ((w(i["inputs"]) - i["targets"]) ** 2).mean()}

    prog = StageProgram(w, run, (), (), ("inputs", "targets"), True)
    return StageExecutor(stage=0, program=prog, link=MemoryLinks().link(0),
                         tasks=one_f_one_b(1, 2)[0], micro_batches=2, optimizer=adamw,
                         total_steps=steps, data=_Regression(), batch_size=4), w


async def test_steps_run_ahead_of_their_reports_within_bounds(adamw: OptimizerSpec) -> None:
    """The compute thread does not wait for a step's report to be handled before the next
    step, up to RUN_AHEAD_STEPS; a step that holds waits, and its callback sees the weights
    that step left."""
    ex, w = _one_stage(adamw, 8)
    gate = asyncio.Event()
    seen: list[tuple[int, int]] = []  # (report's step, the step the thread had reached)
    weights: dict[int, torch.Tensor] = {}

    async def on_step(rep: Any) -> None:
        if rep.step == 0:
            await gate.wait()
        if rep.step == 5:
            weights[5] = w.weight.detach().clone()
            await asyncio.sleep(0.2)  # the thread must not step on meanwhile
            assert torch.equal(w.weight, weights[5])
        seen.append((rep.step, ex.current_step))

    await ex.start()
    try:
        run = asyncio.create_task(ex.run(0, 8, on_step, hold=lambda s: s == 5))
        await asyncio.sleep(0.5)
        # step 0's report is stuck: the thread ran steps 1 and 2 and waits before step 3
        assert not run.done() and ex.current_step == RUN_AHEAD_STEPS
        gate.set()
        reports = await asyncio.wait_for(run, 10)
    finally:
        await ex.close()
    assert [r.step for r in reports] == list(range(8))
    assert [s for s, _ in seen] == list(range(8))
    # step 5 held: its callback ran before step 6 began
    assert dict(seen)[5] == 5
    # the weights after step 5 were what the callback saw; training went on after it
    assert not torch.equal(w.weight, weights[5])


async def test_a_failing_step_callback_stops_the_stage(adamw: OptimizerSpec) -> None:
    ex, _ = _one_stage(adamw, 50)

    def on_step(rep: Any) -> None:
        if rep.step == 3:
            raise RuntimeError("report lost")

    await ex.start()
    try:
        with pytest.raises(RuntimeError, match="report lost"):
            await asyncio.wait_for(ex.run(0, 50, on_step, hold=lambda s: False), 10)
        # the thread stopped within its run-ahead bound, and the stage stays failed
        assert ex.current_step <= 3 + RUN_AHEAD_STEPS + 1
        with pytest.raises(RuntimeError, match="report lost"):
            await ex.run_step(ex.current_step + 1)
    finally:
        await ex.close()


async def test_a_snapshot_is_the_state_its_step_left_while_the_thread_runs_on(
        adamw: OptimizerSpec) -> None:
    """A snapshot step's report carries a copy of the weights that step left, taken before
    the next step, although the thread does not wait for the callback (it reads the copy
    after later steps have changed the live weights)."""
    async def weights_after_5(snap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(7)
        ex, w = _one_stage(adamw, 8)
        got: list[torch.Tensor] = []

        async def on_step(rep: Any) -> None:
            if rep.step == 5:
                if snap:
                    await asyncio.sleep(0.3)  # the thread runs steps 6 and 7 meanwhile
                    got.append(rep.state["weight"])
                else:
                    got.append(w.weight.detach().clone())

        await ex.start()
        try:
            if snap:
                await ex.run(0, 8, on_step, hold=lambda s: False, snapshot=lambda s: s == 5)
            else:
                await ex.run(0, 8, on_step)  # every step held: the live weights are step 5's
        finally:
            await ex.close()
        return got[0], w.weight.detach().clone()

    held, end_held = await weights_after_5(False)
    copied, end_copied = await weights_after_5(True)
    assert torch.equal(held, copied)
    assert torch.equal(end_held, end_copied) and not torch.equal(copied, end_copied)


async def test_a_cancelled_run_leaves_no_unretrieved_error(
        adamw: OptimizerSpec, caplog: pytest.LogCaptureFixture) -> None:
    """Cancelling `run` stops the compute thread through the stage's failure; that failure
    must not surface later as asyncio's "Future exception was never retrieved" (logged from
    a finalizer at some later collection)."""
    import gc

    ex = StageExecutor(stage=1, program=_edge_program()[1], link=MemoryLinks().link(1),
                       tasks=one_f_one_b(2, 2)[1], micro_batches=2, optimizer=adamw,
                       total_steps=3, data=_Regression(), batch_size=4)
    await ex.start()
    try:
        run = asyncio.create_task(ex.run(0, 3))
        await asyncio.sleep(0.2)  # waiting for F0's input, which never comes
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    finally:
        await ex.close()
    await asyncio.sleep(0.1)  # the thread's failure lands on its future
    with caplog.at_level("ERROR", logger="asyncio"):
        gc.collect()
    assert "never retrieved" not in caplog.text
