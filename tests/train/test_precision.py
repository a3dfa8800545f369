"""Mixed precision (issue 18's job setting, on the CPU here): a stage computing in bf16 runs
its forward under autocast with float32 weights and optimizer, its bf16 activations and their
gradients travel as bf16 (2 bytes an element, exactly), and a pipeline cut in 3 trains as the
same model in one stage does in bf16: the exactness invariant per precision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from fusiond.graph import contiguous_assignment, partition
from fusiond.train import codec
from fusiond.train.local import PipelineResult, run_pipeline
from fusiond.train.programs import cut_densities, stage_programs
from fusiond.train.stage import StageConfig, StageError, StageProgram

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock


def test_a_bf16_tensor_travels_as_its_own_16_bits() -> None:
    t = torch.randn(4, 33).to(torch.bfloat16)
    enc = codec.encode_dense(t)
    assert enc.nbytes < t.numel() * 2 + 200  # 2 bytes an element and a header
    back = codec.decode_dense(enc.payload)
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    got, idx = codec.decode_any(enc.payload)
    assert idx is None and got.dtype == torch.bfloat16 and torch.equal(got, t)
    f = torch.randn(3, 5)
    assert codec.decode_dense(codec.encode_dense(f).payload).dtype == torch.float32


def _programs(cap: Any, stages: int) -> Sequence[StageProgram]:
    parts = partition(cap.graph, contiguous_assignment(cap.graph, stages))
    return stage_programs(cap.graph, parts, {k: v.clone() for k, v in cap.state.items()})


async def _train(cap: Any, stages: int, data: Any, precision: str, steps: int = 3
                 ) -> PipelineResult:
    from tests.train.test_recompute import ADAMW

    return await run_pipeline(_programs(cap, stages), data=data, batch_size=8, micro_batches=4,
                              optimizer=ADAMW, steps=steps,
                              config=StageConfig(precision=precision))


async def test_bf16_cut_in_three_trains_as_one_stage_in_bf16(captured_tiny: Any,
                                                             small_text: Any) -> None:
    _, cap = captured_tiny
    whole = await _train(cap, 1, small_text, "bf16")
    cut = await _train(cap, 3, small_text, "bf16")
    for got, want in zip(cut.losses, whole.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    fp32 = await _train(cap, 1, small_text, "fp32")
    assert fp32.losses[0] != whole.losses[0]  # it did compute in bf16
    assert fp32.losses[0] == pytest.approx(whole.losses[0], rel=2e-2)
    for state in cut.states.values():  # the master weights stay float32
        assert all(v.dtype != torch.bfloat16 for v in state.values())
    _assert_half_the_bytes(cut, await _train(cap, 3, small_text, "fp32"))


def _wire(r: PipelineResult) -> dict[str, int]:
    """Bytes each cut edge carried, both ways, over the run."""
    out: dict[str, int] = {}
    for m in r.metrics:
        for e in m.edges:
            out[e.edge] = out.get(e.edge, 0) + e.forward_wire + e.backward_wire
    return out


def _assert_half_the_bytes(half_run: PipelineResult, fp32_run: PipelineResult) -> None:
    """A 16-bit activation travels in half the bytes float32 sends on the same cut edge; one
    autocast keeps in float32 (GPT-2's residual stream: float32 + 16-bit) stays float32."""
    half, full = _wire(half_run), _wire(fp32_run)
    ratios = {e: half[e] / full[e] for e in full if full[e] > 10_000}
    assert any(0.45 < r < 0.55 for r in ratios.values()), ratios
    assert all(r < 1.01 for r in ratios.values()), ratios


async def test_an_unknown_precision_is_refused(captured_tiny: Any, small_text: Any) -> None:
    _, cap = captured_tiny
    with pytest.raises(StageError, match="precision 'fp8' is not one of"):
        await _train(cap, 1, small_text, "fp8", steps=1)


async def _train16(cap: Any, stages: int, data: Any, steps: int, scale: float,
                   replicas: bool = False) -> tuple[PipelineResult, list[Any]]:
    """fp16 training, and the executors (their loss scales)."""
    from tests.train.test_recompute import ADAMW

    execs: list[Any] = []
    out = await run_pipeline(_programs(cap, stages), data=data, batch_size=8, micro_batches=4,
                             optimizer=ADAMW, steps=steps,
                             config=StageConfig(precision="fp16", loss_scale=scale),
                             on_executors=execs.extend)
    return out, execs


async def test_fp16_cut_in_three_trains_as_one_stage_in_fp16(captured_tiny: Any,
                                                             small_text: Any) -> None:
    """fp16 (autocast to float16, float32 weights and optimizer, a dynamic loss scale every
    stage agrees on): GPT-2 tiny cut in three computes what one fp16 stage does, step for
    step, and its fp16 activations travel in 2 bytes an element."""
    _, cap = captured_tiny
    whole, one = await _train16(cap, 1, small_text, 4, 2.0**16)
    cut, three = await _train16(cap, 3, small_text, 4, 2.0**16)
    for got, want in zip(cut.losses, whole.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    fp32 = await _train(cap, 1, small_text, "fp32", steps=1)
    assert fp32.losses[0] != whole.losses[0]  # it did compute in fp16
    assert fp32.losses[0] == pytest.approx(whole.losses[0], rel=1e-2)
    merged = {k: v for st in cut.states.values() for k, v in st.items()}
    for k, v in whole.states[0].items():
        # the master weights stay float32 (the weights themselves are compared through the
        # losses: AdamW moves a parameter whose gradient is a rounding error by lr either way)
        assert v.dtype == torch.float32 and merged[k].dtype == torch.float32
    assert all(ex.loss_scale.skipped == 0 for ex in (*one, *three))
    assert {ex.loss_scale.scale for ex in three} == {2.0**16}
    _assert_half_the_bytes(cut, await _train(cap, 3, small_text, "fp32", steps=4))


async def test_an_fp16_overflow_skips_the_step_on_every_stage_and_halves_the_scale(
        captured_tiny: Any, small_text: Any) -> None:
    """A loss scale too large for float16: the gradients overflow in the loss stage's
    backward (inf reaches the stages before it through the cut edges, not the stages after
    it); every stage agrees, drops the step (its weights untouched) and halves the scale,
    until one fits; then they all step, as one fp16 stage under the same scales does."""
    _, cap = captured_tiny
    cut, execs = await _train16(cap, 3, small_text, 3, 2.0**40)
    _, one = await _train16(cap, 1, small_text, 3, 2.0**40)
    assert [ex.loss_scale.skipped for ex in execs] == [3, 3, 3]
    assert one[0].loss_scale.skipped == 3
    assert {ex.loss_scale.scale for ex in execs} == {2.0**37}
    merged = {k: v for st in cut.states.values() for k, v in st.items()}
    for k, v in cap.state.items():  # three steps skipped: the weights as they started
        if k in merged:
            assert torch.equal(merged[k], v.float()), k
    recovering, execs = await _train16(cap, 3, small_text, 3, 2.0**17)
    ref, one = await _train16(cap, 1, small_text, 3, 2.0**17)
    assert [ex.loss_scale.skipped for ex in execs] == [one[0].loss_scale.skipped] * 3
    for got, want in zip(recovering.losses, ref.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-6)


async def test_fp16_in_four_stages_agrees_among_stages_that_share_nothing(
        captured_tiny: Any, small_text: Any) -> None:
    """Stages 1 and 3 of four share no edge and no parameter: the overflow round still
    reaches every slot (its queues are opened for every other slot of the job); an overflow
    on int8 cut edges (a quantizer refuses inf) skips the step as on raw edges, where it
    failed the job."""
    from tests.train.test_recompute import ADAMW

    _, cap = captured_tiny
    whole, _ = await _train16(cap, 1, small_text, 3, 2.0**16)
    four, execs = await _train16(cap, 4, small_text, 3, 2.0**16)
    for got, want in zip(four.losses, whole.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-6)
    parts = partition(cap.graph, contiguous_assignment(cap.graph, 3))
    progs = stage_programs(cap.graph, parts, {k: v.clone() for k, v in cap.state.items()},
                           int8_edges=list(cut_densities(parts, 1.0)))
    execs = []
    await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=4, optimizer=ADAMW,
                       steps=2, config=StageConfig(precision="fp16", loss_scale=2.0**40),
                       on_executors=execs.extend)
    assert [ex.loss_scale.skipped for ex in execs] == [2, 2, 2]


def test_the_loss_scale_moves_as_torchs_grad_scaler() -> None:
    from fusiond.train.stage import LossScale

    s = LossScale(scale=8.0, interval=3)
    s.update(True)
    assert s.scale == 4.0 and s.skipped == 1
    for _ in range(2):
        s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0 and s.good == 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
async def test_a_mixed_precision_job_reaches_its_stages_through_the_assign(
        captured_tiny: Any, small_text: Any, precision: str) -> None:
    """`job.precision` travels in every stage's Assign (AssignConfig.precision): a planned
    job on in-process daemons computes what one stage does in that precision (fp16: the
    stages agree on the loss scale over the daemons' links each step)."""
    from dataclasses import replace

    from fusiond.jobs.planning import layout_from_plan, plan_job
    from fusiond.plan import Cluster
    from fusiond.train.data import make_source
    from tests.train.test_planning import _machines, _run

    spec, cap = captured_tiny
    spec = replace(spec, steps=3, precision=precision)
    plan = plan_job(spec, cap, Cluster.build(_machines(8e9), [[1.25e9] * 3] * 3))
    layout = layout_from_plan(precision, cap.graph, cap.state, plan, spec)
    assert len(layout.stages) >= 2
    losses: list[float] = []
    out, _ = await _run(spec, cap, layout, on_step=lambda m: losses.append(m.loss))
    assert out.ok, out.failure
    from fusiond.train.local import run_pipeline as run_local

    ref = await run_local(_programs(cap, 1), data=make_source(spec.data, spec.seed),
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          optimizer=spec.optimizer, steps=spec.steps,
                          config=StageConfig(precision=precision))
    for got, want in zip(losses, ref.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)


def test_the_job_precision_setting_takes_fp16() -> None:
    from fusiond.train.spec import JobSpecError, parse_job

    head = '[job]\nsteps = 2\n[model]\nzoo = "gpt2"\n'
    for p in ("bf16", "fp16"):
        assert parse_job(head.replace("steps = 2", f'steps = 2\nprecision = "{p}"')).precision \
            == p
    with pytest.raises(JobSpecError, match=r"job\.precision"):
        parse_job(head.replace("steps = 2", 'steps = 2\nprecision = "fp8"'))
