"""The live held-out curve (issue 19's dashboard): the scheduler scores the whole model on the
job's held-out split every `job.eval_interval` steps (and at checkpoints) from the captured
graph alone, and the figure lands in that step's record (`held_out_loss`), which reaches the
submitter and the dashboard like any step record, in step order."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from fusiond.jobs import service
from fusiond.jobs.service import JobService
from fusiond.train.data import make_source
from fusiond.train.evaluate import graph_heldout_loss, heldout_loss
from fusiond.train.programs import capture_job
from fusiond.train.spec import default_text_path, parse_job
from tests.train.conftest import CAPTURED_JOB
from tests.train.test_service import JOB, Net, View, upload, wait


async def _history(tmp_path: Any, steps: int, job_lines: str,
                   seen: list[int] | None = None) -> list[dict[str, Any]]:
    """Every step record of a one-stage job (`job_lines` added to its [job] table) that m0
    schedules for m1, in memory, once all `steps` are in (`seen`: how many there were at
    each poll on the way)."""
    from fusiond.jobs.submit import prepare_job

    p = tmp_path / "job.toml"
    p.write_text(JOB.format(steps=steps, out=tmp_path / "out",
                            data=default_text_path() / "json")
                 .replace("[model]", job_lines + "\n[model]"))
    job = prepare_job(p)
    net = Net()
    view = View(["m0"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(job, stages=1)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        def done() -> bool:
            if seen is not None:
                seen.append(len(rec.history))
            return len(rec.history) == steps

        await wait(done, 120, f"{steps} steps")
        return [dict(r) for r in rec.history]
    finally:
        await svc.close()


def test_the_graph_evaluator_gives_the_eager_evaluators_figure() -> None:
    """The captured graph with a model's weights scores what the model itself scores (GPT-2
    tiny, no dropout), on the same held-out windows."""
    spec = parse_job(CAPTURED_JOB, base=default_text_path())
    model, captured = capture_job(spec)
    source = make_source(spec.data, spec.seed)
    with torch.no_grad():
        for p in model.parameters():  # weights that are not the initial ones
            p.add_(0.01 * torch.randn_like(p))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {name: state.get(name, captured.state[name]) for name in captured.state}
    # every held-out window: the eager evaluator scores them all
    everything = sum(b.size for b in source.heldout_batches(16))
    before = {k: v.clone() for k, v in state.items()}
    got = graph_heldout_loss(captured.graph, state, spec, source, max_examples=everything)
    assert all(torch.equal(v, before[k]) for k, v in state.items())  # read, not written
    want = heldout_loss(model, spec, source=source)
    assert got == pytest.approx(want, rel=1e-5)
    bounded = graph_heldout_loss(captured.graph, state, spec, source, max_examples=16)
    assert bounded != pytest.approx(got, rel=1e-9)  # the bound is honoured: fewer windows
    assert 2.0 < bounded < 8.0


@pytest.mark.slow
async def test_the_scheduler_puts_the_heldout_loss_in_the_step_records(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A job with eval_interval = 3 over 8 steps: steps 3 and 6 carry held-out losses (a
    checkpoint at 4 too: checkpoint_interval = 4), every other step none, the records arrive
    in order and each once, and the figures fall as the model trains. The scheduler's log
    holds each logged step once (issue 19: its coordinator used to log it again)."""
    import logging

    with caplog.at_level(logging.INFO, logger="fusiond"):
        history = await _history(tmp_path, 8, "eval_interval = 3\ncheckpoint_interval = 4")
    for n in range(1, 9):
        lines = [r.getMessage() for r in caplog.records if f"step {n}/8 loss" in r.getMessage()]
        assert len(lines) == 1, lines
    assert "busy" in lines[0]
    assert [r["step"] for r in history] == list(range(8))
    held = {r["step"] + 1: r["held_out_loss"] for r in history if "held_out_loss" in r}
    assert sorted(held) == [3, 4, 6], held
    assert all(2.0 < v < 8.0 for v in held.values())
    assert held[6] < held[3]


def test_eval_interval_is_a_job_setting_on_the_wire() -> None:
    """`job.eval_interval` reaches every stage (AssignConfig.eval_interval): a stage sends its
    state after the steps of either interval, never after the last one."""
    from fusiond.train.remote import job_config

    spec = parse_job(CAPTURED_JOB.replace("seed = 3", "seed = 3\neval_interval = 5"),
                     base=default_text_path())
    cfg = job_config(spec, stage_nodes={0: "a"}, shared={}, input_name="input",
                     targets_name="targets", loss_name="loss")
    assert cfg.eval_interval == 5
    from fusiond.train.remote import StageAssignment

    sa: Any = replace(_assignment(), steps=20, checkpoint_interval=6, eval_interval=5)
    assert [s + 1 for s in range(20) if StageAssignment.sends_state(sa, s)] == [5, 6, 10, 12,
                                                                               15, 18]


def _assignment() -> Any:
    from fusiond.train.remote import StageAssignment

    spec = parse_job(CAPTURED_JOB, base=default_text_path())
    return StageAssignment(
        job_id="j", plan_version=1, stage=0, graph=None, state={},  # type: ignore[arg-type]
        edges=(), stages=1, stage_nodes={0: "a"}, steps=20, seed=0, checkpoint_interval=0,
        batch=spec.batch, optimizer=spec.optimizer, data=spec.data,
        per_row=True, input_name="input", targets_name="targets", loss_name="loss", shared={})


@pytest.mark.slow
async def test_a_failing_evaluation_is_logged_once_and_the_job_goes_on(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An evaluation that raises ends the job's evaluations, never the job: every step still
    arrives, in order, without a held-out figure, and the log says why once."""
    import logging

    from fusiond.jobs import coordinator

    def broken(*_: Any, **__: Any) -> float:
        raise RuntimeError("no evaluation today")

    monkeypatch.setattr(coordinator, "graph_heldout_loss", broken)
    with caplog.at_level(logging.WARNING, logger="fusiond"):
        history = await _history(tmp_path, 5, "eval_interval = 1")
    assert [r["step"] for r in history] == list(range(5))
    assert not any("held_out_loss" in r for r in history)
    warned = [r.getMessage() for r in caplog.records if "held-out evaluation" in r.getMessage()]
    assert len(warned) == 1 and "no evaluation today" in warned[0], warned


@pytest.mark.slow
async def test_steps_wait_for_a_figure_only_so_long(tmp_path: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation that never ends (a state that never came) holds the step records back
    at most MAX_HELD_STEPS: the live curve keeps moving while the job trains, instead of
    arriving all at once at its end."""
    import asyncio

    from fusiond.jobs import coordinator

    async def never(self: Any, step: int, state: Any) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(coordinator.JobCoordinator, "_evaluate", never)
    monkeypatch.setattr(coordinator, "MAX_HELD_STEPS", 4)
    monkeypatch.setattr(coordinator, "EVAL_END_WAIT_S", 0.1)
    seen: list[int] = []
    history = await _history(tmp_path, 40, "eval_interval = 1", seen)
    assert [r["step"] for r in history] == list(range(40))
    assert any(0 < n < 40 for n in seen), seen  # records arrived while it trained
    # ... and at most MAX_HELD_WAIT_S, however many steps that is
    monkeypatch.setattr(coordinator, "MAX_HELD_STEPS", 10**6)
    monkeypatch.setattr(coordinator, "MAX_HELD_WAIT_S", 0.0)
    seen.clear()
    (tmp_path / "again").mkdir()
    history = await _history(tmp_path / "again", 40, "eval_interval = 1", seen)
    assert [r["step"] for r in history] == list(range(40))
    assert any(0 < n < 40 for n in seen), seen
