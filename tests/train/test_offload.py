"""Optimizer state on disk (issue 17's disk tier): the same updates as in memory, bit for bit;
no memory held by the state between steps; the files gone at the end; a full disk refused at
the start with a clear error, not a crash mid-step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench.memory import mapped_kib
from fusiond.models.gpt2 import gpt2
from fusiond.train.data import TextWindows
from fusiond.train.local import run_pipeline
from fusiond.train.offload import DiskOptimizerState, OffloadError, state_bytes
from fusiond.train.optim import make_optimizer
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import StageConfig, StageExecutor
from tests.fullfs import small_fs

from .gpt_stages import merged_state, three_stages


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
async def test_the_updates_are_the_in_memory_ones_bit_for_bit(
        kind: str, small_text: TextWindows, adamw: OptimizerSpec, tmp_path: Path) -> None:
    opt = adamw if kind == "adamw" else replace(adamw, kind="sgd", momentum=0.9,
                                                weight_decay=0.01)
    states = []
    losses = []
    seen_files: list[int] = []
    execs: list[StageExecutor] = []
    for offload in (None, tmp_path / "opt"):
        torch.manual_seed(0)
        progs = three_stages(gpt2("tiny"))
        execs.clear()

        def on_step(m: object, offload: Path | None = offload) -> None:
            if offload is not None:
                seen_files.append(len(list(offload.rglob("*.f32"))))
                # between steps the state holds no pages of this process
                assert mapped_kib(str(offload)) == 0

        res = await run_pipeline(progs, data=small_text, batch_size=8, micro_batches=4,
                                 optimizer=opt, steps=6, config=StageConfig(offload_dir=offload),
                                 on_step=on_step, on_executors=execs.extend)
        states.append(merged_state(progs))
        losses.append(res.losses)
    assert losses[0] == losses[1]
    for k, v in states[0].items():
        assert torch.equal(v, states[1][k]), k
    per = 2 if kind == "adamw" else 1  # moments, or a momentum buffer, per parameter tensor
    n_tensors = sum(len(list(p.module.parameters())) for p in three_stages(gpt2("tiny")))
    assert seen_files and all(n == per * n_tensors for n in seen_files[1:])
    assert not list((tmp_path / "opt").rglob("*.f32"))  # closed: removed


def test_state_bytes_and_refusals(tmp_path: Path, adamw: OptimizerSpec) -> None:
    lin = torch.nn.Linear(64, 32)
    opt = make_optimizer(adamw, lin.parameters())
    assert state_bytes(opt) == 2 * (64 * 32 + 32) * 4
    st = DiskOptimizerState(opt, tmp_path / "s")
    assert st.nbytes == state_bytes(opt)
    (lin.weight.sum() + lin.bias.sum()).backward()
    opt.step()
    assert mapped_kib(str(tmp_path / "s")) > 0  # the step paged the state in ...
    st.release()
    assert mapped_kib(str(tmp_path / "s")) == 0  # ... and the release dropped it
    assert float(opt.state[lin.weight]["exp_avg"].abs().sum()) > 0  # read back from the file
    st.close()
    st.close()  # idempotent
    assert not list((tmp_path / "s").iterdir())
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(OffloadError, match="float32"):
        DiskOptimizerState(make_optimizer(adamw, half.parameters()), tmp_path / "h")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OffloadError, match="cannot keep the optimizer state in"):
        DiskOptimizerState(make_optimizer(adamw, lin.parameters()), blocker / "under")


def test_a_full_disk_is_refused_up_front(adamw: OptimizerSpec) -> None:
    big = torch.nn.Linear(1024, 1024)  # 8 MiB of AdamW state
    with small_fs(2 << 20) as fs:
        with pytest.raises(OffloadError, match="free disk space there"):
            DiskOptimizerState(make_optimizer(adamw, big.parameters()), fs / "opt")
        assert not list((fs / "opt").glob("*.f32"))  # what was made is removed


def test_write_behind_is_bounded_and_its_failure_is_raised(
        tmp_path: Path, adamw: OptimizerSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's write-back runs on the writer thread while the next chunk steps, at most
    `WRITE_BEHIND_CHUNKS` of them pending (the next one waits for the oldest), and a
    write-back that fails is raised by `drain`, naming the directory, not lost."""
    import threading

    from fusiond.train import offload as offload_mod

    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(4)]
    opt = make_optimizer(adamw, params)
    disk = DiskOptimizerState(opt, tmp_path / "state")
    gate = threading.Event()
    written: list[int] = []
    real = DiskOptimizerState._write_back

    def slow(maps: list[object]) -> None:
        gate.wait(10)
        real(maps)  # type: ignore[arg-type]
        written.append(len(maps))

    monkeypatch.setattr(DiskOptimizerState, "_write_back", staticmethod(slow))
    try:
        for p in params[:offload_mod.WRITE_BEHIND_CHUNKS]:
            disk.release_behind([p])  # queued, not waited for
        third = threading.Thread(target=disk.release_behind, args=([params[-1]],))
        third.start()
        third.join(0.3)
        assert third.is_alive() and not written  # the bound holds it back
        gate.set()
        third.join(10)
        assert not third.is_alive()
        disk.drain()
        assert written == [2] * (offload_mod.WRITE_BEHIND_CHUNKS + 1)  # two moments each

        def broken(maps: list[object]) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(DiskOptimizerState, "_write_back", staticmethod(broken))
        disk.release_behind([params[0]])
        with pytest.raises(OffloadError, match=r"write the optimizer state back to .*state"):
            disk.drain()
        disk.drain()  # reported once
    finally:
        disk.close()
    assert not list((tmp_path / "state").glob("*.f32"))
