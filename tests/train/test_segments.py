"""Per-block checkpointing and weights on disk (issue 17's mechanisms): a stage run segment by
segment, any segments checkpointed, with or without its weights, gradients and optimizer state
in memory-mapped files, trains bit for bit as the plain stage does; a checkpointed forward
keeps less; a segment that updates a buffer is never run twice."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fusiond.graph import contiguous_assignment, partition
from fusiond.train.data import TextWindows
from fusiond.train.local import PipelineResult, run_pipeline
from fusiond.train.offload import step_in_chunks, trim_heap
from fusiond.train.optim import make_optimizer
from fusiond.train.programs import graph_data_names, stage_program, stage_programs
from fusiond.train.segments import SegmentPlan, SegmentRunner
from fusiond.train.stage import StageConfig, StageProgram
from protocol import ir

from .test_recompute import ADAMW, ConvNet

pytestmark = [pytest.mark.compute_only]  # in one process: no daemon, no socket


def _programs(cap: Any, stages: int, flags: Any = None) -> list[StageProgram]:
    """`cap` cut in `stages`, each stage segmented at its blocks with `flags(i, n)` saying
    whether segment i of n is checkpointed (None: not segmented)."""
    g = cap.graph
    parts = partition(g, contiguous_assignment(g, stages))
    if flags is None:
        return stage_programs(g, parts, {k: v.clone() for k, v in cap.state.items()})
    plain = stage_programs(g, parts, {k: v.clone() for k, v in cap.state.items()})
    main, targets = graph_data_names(g)
    stage_of = {p.id: i for i, p in enumerate(parts)}
    out = []
    for p, ref in zip(parts, plain, strict=True):
        starts = ir.block_starts(p.graph)
        plan = SegmentPlan(tuple(starts), tuple(flags(i, len(starts)) for i in range(len(starts))))
        out.append(stage_program(p, {k: v.clone() for k, v in cap.state.items()},
                                 stage_of=stage_of, input_name=main, targets_name=targets,
                                 shared=ref.shared, segments=plan))
    return out


async def _train(progs: Sequence[StageProgram], data: Any, config: StageConfig | None = None,
                 steps: int = 3) -> PipelineResult:
    return await run_pipeline(progs, data=data, batch_size=8, micro_batches=2, optimizer=ADAMW,
                              steps=steps, config=config)


def _same(a: PipelineResult, b: PipelineResult) -> None:
    assert a.losses == b.losses
    for stage in a.states:
        for name, t in a.states[stage].items():
            assert torch.equal(t, b.states[stage][name]), (stage, name)


@pytest.mark.parametrize("stages", [1, 2])
async def test_segments_are_exact_whichever_are_checkpointed(
        captured_tiny: Any, small_text: TextWindows, stages: int) -> None:
    _, cap = captured_tiny
    plain = await _train(_programs(cap, stages), small_text)
    for flags in (lambda i, n: False, lambda i, n: True, lambda i, n: i % 2 == 1):
        progs = _programs(cap, stages, flags)
        assert all(p.segments is not None and len(p.segments.modules) > 1 for p in progs)
        _same(plain, await _train(progs, small_text))


async def test_weights_and_state_on_disk_are_exact(captured_tiny: Any,
                                                   small_text: TextWindows,
                                                   tmp_path: Path) -> None:
    _, cap = captured_tiny
    plain = await _train(_programs(cap, 1), small_text)
    seen: list[int] = []
    for flags in (None, lambda i, n: i % 2 == 0):
        progs = _programs(cap, 1, flags)
        config = StageConfig(offload_dir=tmp_path / "off", offload_params=True)

        def on_step(_: object) -> None:
            seen.append(len(list((tmp_path / "off").rglob("*.f32"))))

        res = await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=2,
                                 optimizer=ADAMW, steps=3, config=config, on_step=on_step)
        _same(plain, res)
        assert not list((tmp_path / "off").rglob("*.f32"))  # closed: the files are gone
    n_tensors = len(list(_programs(cap, 1)[0].module.parameters()))
    assert seen and all(n == 2 * n_tensors + 2 for n in seen)  # moments, weights, grads


def test_a_checkpointed_forward_keeps_less(captured_tiny: Any,
                                           small_text: TextWindows) -> None:
    _, cap = captured_tiny
    batch = small_text.batch(0, 4)

    def saved_bytes(prog: StageProgram) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
            return t

        params = {p.untyped_storage().data_ptr() for p in prog.module.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            prog.run({k: batch[k] for k in prog.data_inputs})
        return sum(v for k, v in seen.items() if k not in params)

    plain = saved_bytes(_programs(cap, 1)[0])
    every = saved_bytes(_programs(cap, 1, lambda i, n: True)[0])
    assert every < plain / 3


async def test_a_segment_updating_a_buffer_is_never_run_twice() -> None:
    from fusiond.graph import capture
    from fusiond.train.data import SyntheticImages

    torch.manual_seed(0)
    data = SyntheticImages(image_size=8, channels=3, num_classes=4, seed=1)
    b = data.batch(0, 2)
    cap = capture(ConvNet().train(), [b.inputs], targets=b.targets,
                  loss=torch.nn.functional.cross_entropy,
                  dynamic=[{0: "batch"}, {0: "batch"}])
    progs = _programs(cap, 1, lambda i, n: True)
    runner = progs[0].segments
    assert isinstance(runner, SegmentRunner)
    updates = [bool(p.graph.buffer_updates) for p in runner.parts]
    assert any(updates) and not any(r and u for r, u in zip(runner.recompute, updates,
                                                            strict=True))
    _same(await _train(_programs(cap, 1), data), await _train(progs, data))


def test_chunked_update_and_heap_trim() -> None:
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    opts = [make_optimizer(ADAMW, n.parameters()) for n in nets]
    x = torch.randn(5, 8)
    for _ in range(3):
        for n in nets:
            n(x).pow(2).sum().backward()
        opts[0].step()
        ps = list(nets[1].parameters())
        released: list[int] = []

        def after(chunk: list[torch.Tensor], into: list[int] = released) -> None:
            into.append(len(chunk))

        step_in_chunks(opts[1], [ps[:1], ps[1:3]], after)
        assert released == [1, 3]  # the last chunk takes the parameters no chunk named
        assert len(opts[1].param_groups[0]["params"]) == 4  # restored
        for o in opts:
            o.zero_grad()
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b)
    assert trim_heap() in (True, False)


async def test_a_transformers_llama_is_exact_segmented_and_on_disk(
        small_text: TextWindows, tmp_path: Path) -> None:
    """The same on a model from HF transformers (a tiny Llama: rotary embeddings, grouped
    attention, RMSNorm): its decoder layers are its blocks."""
    from bench.compress import TINY_LLAMA
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import default_text_path, parse_job

    spec = parse_job(
        '[job]\nname = "llama"\nsteps = 3\n[model]\nzoo = "hf"\n[model.config]\n'
        'architecture = "LlamaForCausalLM"\n'
        + "".join(f"{k} = {v}\n" for k, v in TINY_LLAMA.items())
        + "[data]\nseq_len = 32\n[batch]\nsize = 8\nmicro_batches = 2\n",
        base=default_text_path())
    _, cap = capture_job(spec)
    keys = {ir.block_key(cap.graph.nodes[i].module_path) for i in ir.block_starts(cap.graph)}
    assert {"model.layers.0", "model.layers.1"} <= keys
    for stages in (1, 2):
        plain = await _train(_programs(cap, stages), small_text)
        _same(plain, await _train(_programs(cap, stages, lambda i, n: i % 2 == 0), small_text))
        on_disk = StageConfig(offload_dir=tmp_path / f"off{stages}", offload_params=True)
        _same(plain, await _train(_programs(cap, stages, lambda i, n: True), small_text,
                                  on_disk))
