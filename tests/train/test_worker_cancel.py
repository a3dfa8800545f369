"""JobWorker and the lanes: Assign rides BULK, JobCancel CONTROL, so a cancel can arrive first.

A worker must not build (and keep) a stage for a plan version it already saw cancelled: the
scheduler gave up on it and waits for no Ready, so the stage would be a zombie holding memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from fusiond.graph import contiguous_assignment
from fusiond.jobs.assign import assign_messages, layout_job
from fusiond.jobs.worker import CANCELLED_MEMORY, JobWorker
from protocol.messages import Assign, JobCancel, Message, Ready

pytestmark = pytest.mark.slow  # captures GPT-2 tiny once per session


def _assign(captured_tiny: Any, version: int, job_id: str = "job-c") -> Assign:
    spec, cap = captured_tiny
    cut = contiguous_assignment(cap.graph, 2)
    names = ["w0", "w1"]
    layout = layout_job(job_id, cap.graph, cap.state, {op: names[p] for op, p in cut.items()})
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=version,
                           addresses={"w0": ("127.0.0.1", 1), "w1": ("127.0.0.1", 2)})
    msg, payload = msgs["w1"]
    return dataclasses.replace(msg, payload=memoryview(payload))


def _worker() -> tuple[JobWorker, list[Message]]:
    sent: list[Message] = []

    async def send(peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        sent.append(msg)

    return JobWorker(node_id="w1", send=send), sent


async def test_assign_overtaken_by_its_cancel_builds_no_stage(captured_tiny: Any) -> None:
    worker, sent = _worker()
    await worker.start()
    try:
        # v1's JobCancel (CONTROL) arrives before v1's Assign (BULK): the Assign is dropped.
        await worker.handle("sched", JobCancel(job_id="job-c", reason="a stage refused",
                                               plan_version=1))
        assert await worker.handle("sched", _assign(captured_tiny, 1))
        assert worker.jobs() == {}
        assert not any(isinstance(m, Ready) for m in sent)
        # The restarted job's next plan version is assigned normally.
        await worker.handle("sched", _assign(captured_tiny, 2))
        assert set(worker.jobs()) == {"job-c"}
        assert [type(m) for m in sent] == [Ready]
        # A late cancel of the old version does not stop the new one...
        await worker.handle("sched", JobCancel(job_id="job-c", plan_version=1))
        assert set(worker.jobs()) == {"job-c"}
        # ... its own does.
        await worker.handle("sched", JobCancel(job_id="job-c", plan_version=2))
        assert worker.jobs() == {}
    finally:
        await worker.close()


async def test_unversioned_cancel_still_stops_whatever_runs(captured_tiny: Any) -> None:
    worker, _ = _worker()
    await worker.start()
    try:
        await worker.handle("sched", _assign(captured_tiny, 3))
        assert set(worker.jobs()) == {"job-c"}
        await worker.handle("sched", JobCancel(job_id="job-c"))  # an older scheduler's cancel
        assert worker.jobs() == {}
        # ... and remembers the version it stopped: a duplicate Assign of it is dropped.
        await worker.handle("sched", _assign(captured_tiny, 3))
        assert worker.jobs() == {}
    finally:
        await worker.close()


async def test_cancel_while_the_stage_is_being_built_drops_it(captured_tiny: Any) -> None:
    worker, sent = _worker()
    await worker.start()
    try:
        building = asyncio.create_task(worker.handle("sched", _assign(captured_tiny, 4)))
        await asyncio.sleep(0)  # the partition is being built in a thread now
        await worker.handle("sched", JobCancel(job_id="job-c", plan_version=4))
        await building
        assert worker.jobs() == {}
        assert not any(isinstance(m, Ready) for m in sent)
    finally:
        await worker.close()


async def test_cancelled_versions_are_bounded() -> None:
    worker, _ = _worker()
    for i in range(CANCELLED_MEMORY + 10):
        await worker.handle("sched", JobCancel(job_id=f"j{i}", plan_version=1))
    assert len(worker._cancelled) == CANCELLED_MEMORY
    assert "j0" not in worker._cancelled and f"j{CANCELLED_MEMORY + 9}" in worker._cancelled
