"""Captured GPT-2 tiny, cut by fusiond.graph: in-process pipeline and 3 loopback daemons' worth
of peer networks give the single-process losses and weights; the result loads strictly."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import msgpack
import pytest
import torch

from fusiond.errors import RemoteError
from fusiond.graph import contiguous_assignment, partition
from fusiond.jobs.assign import assign_messages, layout_job
from fusiond.jobs.results import gather_state, load_model_state, save_model, write_metrics
from fusiond.net.transport import NetConfig, PeerNetwork
from fusiond.train.data import make_source
from fusiond.train.local import PipelineResult, ReferenceTrainer, run_pipeline
from fusiond.train.model import build_model, loss_fn
from fusiond.train.programs import stage_programs
from fusiond.train.remote import StageHost
from fusiond.train.stage import StepReport
from protocol.errors import RemoteProtocolError
from protocol.frames import Frame, FrameDecoder, encode_frame, frame_bytes
from protocol.messages import (
    Assign,
    EdgeFigures,
    Message,
    StageStep,
    decode_message,
    encode_message,
)

pytestmark = pytest.mark.slow


def _reference(spec):  # type: ignore[no-untyped-def]
    model = build_model(spec.model, seed=spec.seed)
    rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                          data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                          micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
    return rt.train(0, spec.steps), model


def _check_timelines(res: PipelineResult, micro_batches: int) -> None:
    """Every stage's task timeline holds its schedule, each task after its inputs and the one
    before it; it crosses the wire (StageStep.figures) intact, and bounded."""
    every = sorted([f"F{m}" for m in range(micro_batches)]
                   + [f"B{m}" for m in range(micro_batches)])
    for stage, reps in res.reports.items():
        for rep in reps:
            assert sorted(t.task for t in rep.timeline) == every
            prev_end = 0.0
            for t in rep.timeline:
                assert 0 <= t.ready_s <= t.start_s <= t.end_s <= rep.wall_s
                assert t.start_s >= prev_end and t.wait_s >= 0
                prev_end = t.end_s
            assert rep.wait_s == pytest.approx(sum(t.wait_s for t in rep.timeline))
            for t in rep.timeline:  # the breakdown: parts of the task's own time
                assert t.kernel_s > 0 and t.cpu_s > 0 and t.codec_s >= 0 and t.send_s >= 0
                assert t.kernel_s + t.codec_s <= t.end_s - t.start_s + 1e-6
                assert t.overhead_s >= t.dispatch_s >= 0
            assert 0 <= rep.wait_s <= rep.wall_s and rep.start_mono is not None
            back = StepReport.from_figures(stage, rep.step, rep.to_figures())
            assert back.timeline == [
                dataclasses.replace(t, ready_s=round(t.ready_s, 6), start_s=round(t.start_s, 6),
                                    end_s=round(t.end_s, 6), wait_s=round(t.wait_s, 6),
                                    cpu_s=round(t.cpu_s, 6), kernel_s=round(t.kernel_s, 6),
                                    codec_s=round(t.codec_s, 6), send_s=round(t.send_s, 6))
                for t in rep.timeline]
    # Off the wire, the StageStep schema bounds and types the figures before a report exists.
    rep0 = next(iter(res.reports.values()))[0]
    wire = StageStep("j", 1, 0, 0, figures=rep0.to_figures()).to_wire()
    assert decode_message(_frame(StageStep, wire)).figures == rep0.to_figures()
    # the replicas' reduction figures travel too (bench/wan.py names the reduction's miss)
    rep1 = dataclasses.replace(rep0, buckets_early=3, reduce_exposed_s=0.25, reduce_cpu_s=0.125)
    back1 = StepReport.from_figures(0, 0, rep1.to_figures())
    assert (back1.buckets_early, back1.reduce_exposed_s, back1.reduce_cpu_s) == (3, 0.25, 0.125)

    def bad(**figures: object) -> None:
        header = {**wire, "figures": {**wire["figures"], **figures}}
        with pytest.raises(RemoteProtocolError, match=r"StageStep\.figures"):
            decode_message(_frame(StageStep, header))

    bad(timeline=[["F0", 0, 0, 0, 0]] * 5000)
    for rows in ([["F0", "x", 0, 0, 0]], [["F0", 0.1]], 7, [["F" * 100, 0, 0, 0, 0]]):
        bad(timeline=rows)
    bad(wait_s="x")
    bad(costs=[[0.0, 0.0, 0.0, 0.0]] * 5000)
    bad(costs=[[0.0, "x", 0.0, 0.0]])
    bad(buckets_early="x")
    bad(reduce_exposed_s="x")
    bad(reduce_cpu_s="x")
    bad(edges=[{"edge": "e", "kind": "forward", "peer": "one", "wire_bytes": 1,
                "dense_bytes": 0}])
    # A stage that measures no breakdown (an older one) sends no costs: zeros, same timeline.
    old = StepReport.from_figures(0, 0, dataclasses.replace(rep0.to_figures(), costs=()))
    assert [t.task for t in old.timeline] == [t.task for t in rep0.timeline]
    assert all(t.kernel_s == t.cpu_s == 0.0 for t in old.timeline)
    # ... and the reader checks the ranges, naming the field.
    for odd, what in ((dict(wait_s=-1.0), "wait_s"), (dict(wall_s=float("nan")), "wall_s"),
                      (dict(edges=(EdgeFigures("e", "sideways", 1, 0, 0),)), "bad edge kind"),
                      (dict(edges=(EdgeFigures("e", "forward", 1, -1, 0),)), "negative"),
                      (dict(edges=(EdgeFigures("e", "forward", 1, 1, 1, 1.5),)), "density"),
                      (dict(costs=((0.0, 0.0, 0.0, 0.0),)), "costs has 1 rows"),
                      (dict(reduce_exposed_s=float("inf")), "reduce_exposed_s"),
                      (dict(reduce_cpu_s=-0.5), "reduce_cpu_s"),
                      (dict(buckets_early=-1), "buckets_early is -1"),
                      (dict(buckets_early=10**9), "buckets_early"),
                      (dict(costs=((0.0, -1.0, 0.0, 0.0),) * len(rep0.timeline)),
                       "not a duration")):
        with pytest.raises(RemoteError, match=rf"StageStep\.figures from stage 0: .*{what}"):
            StepReport.from_figures(0, 0, dataclasses.replace(rep0.to_figures(), **odd))


def _frame(cls: type[Message], header: object) -> Frame:
    raw = msgpack.packb(header, use_bin_type=True)
    [frame] = FrameDecoder().feed(frame_bytes(encode_frame(cls.TYPE_ID, raw)))
    return frame


async def test_captured_partitions_match_eager(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 3))
    progs = stage_programs(cap.graph, parts, cap.state)
    assert sum(1 for p in progs if p.shared) == 2  # the tied embedding / LM head
    res = await run_pipeline(progs, data=make_source(spec.data, spec.seed),
                             batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                             optimizer=spec.optimizer, steps=spec.steps)
    want, ref = _reference(spec)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    _check_timelines(res, spec.batch.micro_batches)
    state = gather_state(cap.graph, res.states.values())
    fresh = build_model(spec.model)
    fresh.load_state_dict(state, strict=True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)


def _wire_roundtrip(msg: Assign, payload: bytes) -> Message:
    dec = FrameDecoder()
    frames = dec.feed(b"".join(bytes(x) for x in encode_message(msg, [payload])))
    assert len(frames) == 1
    return decode_message(frames[0])


async def test_a_step_reports_a_bounded_timeline(captured_tiny, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """However many micro-batches a step has, its report carries at most MAX_TIMELINE task
    timings (it travels in one StageStep); the waiting time still counts every task."""
    import fusiond.train.stage as stage_mod

    spec, cap = captured_tiny
    monkeypatch.setattr(stage_mod, "MAX_TIMELINE", 3)
    progs = stage_programs(cap.graph, partition(cap.graph, contiguous_assignment(cap.graph, 2)),
                           cap.state)
    res = await run_pipeline(progs, data=make_source(spec.data, spec.seed),
                             batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                             optimizer=spec.optimizer, steps=1)
    for reps in res.reports.values():
        assert len(reps[0].timeline) == 3 < 2 * spec.batch.micro_batches
        assert reps[0].wait_s >= sum(t.wait_s for t in reps[0].timeline)


async def test_three_peers_on_loopback_match_eager(captured_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    names = ["n0", "n1", "n2"]
    hosts: dict[str, StageHost] = {}

    def handler_for(me: str):  # type: ignore[no-untyped-def]
        async def handler(peer: str, msg: Message) -> None:
            hosts[me].on_message(peer, msg)
        return handler

    cfg = NetConfig(connect_timeout_s=5, handshake_timeout_s=5)
    nets = {n: PeerNetwork(node_id=n, cluster_id="test", listen=("127.0.0.1", 0), tls=None,
                           handler=handler_for(n), config=cfg) for n in names}
    async with contextlib.AsyncExitStack() as stack:
        for net in nets.values():
            await net.start()
            stack.push_async_callback(net.close)
        addresses = {n: net.address for n, net in nets.items()}
        for a in nets.values():
            for n, addr in addresses.items():
                a.add_peer_address(n, addr)
        # the scheduler's side: the plan put contiguous thirds of the graph on n0, n1, n2
        thirds = contiguous_assignment(cap.graph, 3)
        op_nodes = {op: names[p] for op, p in thirds.items()}
        layout = layout_job("job-1", cap.graph, cap.state, op_nodes)
        assigns = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                                  addresses=addresses)
        assert set(assigns) == set(names)
        for n, (msg, payload) in assigns.items():
            got = _wire_roundtrip(msg, payload)
            assert isinstance(got, Assign)
            hosts[n] = StageHost(got, got.payload, nets[n])
            stack.push_async_callback(hosts[n].close)
            await hosts[n].start()
        reports: dict[int, list[StepReport]] = {}
        results = await asyncio.wait_for(
            asyncio.gather(*(hosts[n].run() for n in names)), timeout=120
        )
        for n, reps in zip(names, results, strict=True):
            reports[hosts[n].assignment.stage] = reps
        losses = [r.loss for r in reports[2]]
        want, ref = _reference(spec)
        for got_l, exp in zip(losses, want, strict=True):
            assert got_l == pytest.approx(exp, rel=1e-4)
        state = gather_state(cap.graph, [h.state_dict() for h in hosts.values()])
        path = save_model(tmp_path / "model.safetensors", state)
        fresh = build_model(spec.model)
        fresh.load_state_dict(load_model_state(path), strict=True)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)
        sent = sum(s.bytes_sent for net in nets.values() for s in net.stats().values())
        wire = sum(e.wire_bytes for reps in reports.values() for r in reps for e in r.edges)
        assert sent >= wire > 0  # the payloads really crossed the sockets
        m = write_metrics(tmp_path / "metrics.json", [{"step": i, "loss": x}
                                                      for i, x in enumerate(losses)])
        assert m.read_text().count('"loss"') == spec.steps


OTHER_MODELS = {
    "resnet18": """
[job]
steps = 4
seed = 1
[model]
zoo = "resnet18"
config = { num_classes = 10, width = 8 }
[data]
kind = "images"
image_size = 16
[loss]
kind = "cross_entropy"
[optimizer]
kind = "sgd"
lr = 0.05
momentum = 0.9
weight_decay = 5e-4
[batch]
size = 8
micro_batches = 2
pipeline = "gpipe"
""",
    "hf-gpt2": """
[job]
steps = 4
seed = 1
[model]
zoo = "hf-gpt2"
[model.config]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 256
n_positions = 64
resid_pdrop = 0.0
embd_pdrop = 0.0
attn_pdrop = 0.0
bos_token_id = 0
eos_token_id = 0
[data]
path = "json"
seq_len = 32
[batch]
size = 8
micro_batches = 4
""",
}


@pytest.mark.parametrize("name", sorted(OTHER_MODELS))
async def test_other_models_match_eager(name: str) -> None:
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import default_text_path, parse_job

    spec = parse_job(OTHER_MODELS[name], base=default_text_path())
    _, cap = capture_job(spec)
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 3))
    progs = stage_programs(cap.graph, parts, cap.state)
    res = await run_pipeline(progs, data=make_source(spec.data, spec.seed),
                             batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                             optimizer=spec.optimizer, steps=spec.steps,
                             pipeline=spec.batch.pipeline)
    want, ref = _reference(spec)
    for got, exp in zip(res.losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    _check_timelines(res, spec.batch.micro_batches)
    state = gather_state(cap.graph, res.states.values())
    build_model(spec.model).load_state_dict(state, strict=True)
    for k, v in ref.state_dict().items():  # BatchNorm running stats included
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
