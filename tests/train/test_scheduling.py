"""The scheduler role (`fusiond.jobs.scheduling.Scheduling`) on its own, with an in-memory
send, view and host: a daemon without the lease refuses a job before anything runs, the step
records go back to the submitter in order in bounded updates (a failed send rewinds, so none is
lost), a fetch is answered only for the job's own submitter, a minority hands its jobs back
while a majority lets the running attempt finish, and at most `MAX_HELD_JOBS` jobs hold
weights. (With a whole JobService: tests/train/test_service.py; real daemons:
tests/e2e/test_authority.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fusiond.errors import LocalError
from fusiond.jobs import scheduling
from fusiond.jobs.history import StepHistory
from fusiond.jobs.outputs import OutputStore
from fusiond.jobs.scheduling import SchedulerHost, Scheduling
from fusiond.jobs.submission import NotScheduler
from fusiond.jobs.upload import Upload
from protocol.messages import JobFetch, JobOutputAck, JobUpdate, Message


class Fake:
    """The peer network (a send that records, or fails while `fail` says why) and the job
    service's host."""

    def __init__(self, tmp: Path) -> None:
        self.sent: list[tuple[str, Message, Sequence[Any]]] = []
        self.fail: str = ""
        self.calls: list[tuple[str, str]] = []
        self.lead = SimpleNamespace(leader="me", term=3, has_quorum=True)
        self.sch = Scheduling(
            node_id="me", send=self.send, view=lambda: SimpleNamespace(members=[]),
            leadership=lambda: self.lead, store=OutputStore(tmp / "outputs"), op_sets=None,
            ready_timeout_s=120.0, failure_grace_s=2.0, host=SchedulerHost(
                job_view=lambda j, h: {"job_id": j, "state": "running", "history": h},
                persist=lambda j: self.calls.append(("persist", j)),
                steps_arrived=lambda j: self.calls.append(("steps", j)),
                tracked=lambda j: self.calls.append(("tracked", j)),
                ended=lambda j: self.calls.append(("ended", j)),
                take_back=lambda r, why: self.calls.append(("take_back", r.job_id))))

    async def send(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        if self.fail:
            raise LocalError(self.fail)
        self.sent.append((peer, msg, payload))

    def updates(self) -> list[JobUpdate]:
        return [m for _, m, _ in self.sent if isinstance(m, JobUpdate)]


class Coord:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    async def cancel(self, why: str = "") -> None:
        self.cancelled.append(why)


def record(job_id: str = "j-000001", submitter: str = "m1", **kw: Any) -> Any:
    """What the scheduler role reads of a `JobRecord` (a plain namespace: no model here)."""
    history = StepHistory()
    lines: list[str] = []
    fields: dict[str, Any] = dict(
        job_id=job_id, submitter=submitter, state="running", history=history,
        update_cursor=history.cursor(), update_lock=asyncio.Lock(), logs=lines,
        log=lines.append, coord=Coord(), layout=SimpleNamespace(stage_nodes={}, slot_nodes={}),
        cancel_requested=False, handed_back="", stale_lease=-1, held=None, submitted_at=0.0,
        task=None)
    return SimpleNamespace(**(fields | kw))


async def test_a_daemon_without_the_lease_refuses_a_job_before_anything_runs(
        tmp_path: Path) -> None:
    f = Fake(tmp_path)
    f.lead = SimpleNamespace(leader="m2", term=3, has_quorum=True)
    with pytest.raises(NotScheduler, match="the scheduler is m2"):
        await f.sch.submit(Upload({}, b"", b""), submitter="m1")
    f.lead = SimpleNamespace(leader="me", term=4, has_quorum=False)
    with pytest.raises(NotScheduler, match="lost its quorum"):
        await f.sch.submit(Upload({}, b"", b""))
    assert f.sch.records == {} and f.sent == [] and f.calls == []
    await f.sch.close()


async def test_updates_carry_every_step_in_order_and_a_failed_send_rewinds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduling, "MAX_UPDATE_STEPS", 2)
    f = Fake(tmp_path)
    rec = record()
    for s in range(5):
        rec.history.add({"step": s, "loss": float("nan") if s == 1 else 1.0 / (s + 1)})
    await f.sch._send_update(rec)
    ups = f.updates()
    assert [(u.after, [r["step"] for r in u.steps]) for u in ups] == [
        (-1, [0, 1]), (1, [2, 3]), (3, [4])]
    assert [bool(u.status) for u in ups] == [False, False, True]  # the status rides last
    assert ups[0].steps[1]["loss"] is None  # non-finite floats go as null
    assert all(p == "m1" for p, _, _ in f.sent)
    rec.history.add({"step": 5})
    f.fail = "dial failed"
    await f.sch._send_update(rec)  # logged, not raised: the next update sends it again
    assert rec.update_cursor.through == 4
    f.fail = ""
    f.sent.clear()
    await f.sch._send_update(rec)
    assert [(u.after, [r["step"] for r in u.steps]) for u in f.updates()] == [(4, [5])]
    await f.sch.close()


async def test_a_fetch_is_answered_only_for_the_jobs_own_submitter(tmp_path: Path) -> None:
    f = Fake(tmp_path)
    rec = record()
    rec.state = "failed"
    f.sch.records[rec.job_id] = rec
    await f.sch.on_fetch("m9", JobFetch(job_id=rec.job_id, request_id="r1"))
    peer, ack, _ = f.sent[-1]
    assert peer == "m9" and isinstance(ack, JobOutputAck) and not ack.ok
    assert "coordinates no job" in ack.message
    await f.sch.on_fetch("m1", JobFetch(job_id=rec.job_id, request_id="r2"))
    for _ in range(100):  # (answered from a task of its own)
        if len(f.sent) == 2:
            break
        await asyncio.sleep(0.01)
    peer, ack, _ = f.sent[-1]
    assert peer == "m1" and isinstance(ack, JobOutputAck) and not ack.ok
    assert ack.request_id == "r2" and "does not hold the weights" in ack.message
    await f.sch.close()


async def test_a_minority_hands_its_jobs_back_and_a_majority_lets_the_attempt_finish(
        tmp_path: Path) -> None:
    f = Fake(tmp_path)
    a, b = record("a-000001"), record("b-000001", submitter="")
    f.sch.records.update({a.job_id: a, b.job_id: b})
    f.lead = SimpleNamespace(leader="m2", term=4, has_quorum=True)  # a majority elected m2
    f.sch.on_view({})
    f.sch.on_view({})
    assert a.handed_back == "" and a.stale_lease == 4 and b.stale_lease == 4
    assert sum("decides nothing more" in line for line in a.logs) == 1  # once per term
    f.lead = SimpleNamespace(leader=None, term=4, has_quorum=False)  # cut off: a minority
    f.sch.on_view({})
    await asyncio.sleep(0.05)
    assert "lost its quorum" not in a.handed_back and a.handed_back.startswith(
        "this daemon is not the scheduler")
    assert b.handed_back == a.handed_back
    assert a.coord.cancelled and "stepped down" in a.coord.cancelled[0]
    assert "its submitter m1" in a.logs[-1] and "this daemon's failover" in b.logs[-1]
    await f.sch.close()


async def test_a_submitter_gone_cancels_its_job(tmp_path: Path) -> None:
    f = Fake(tmp_path)
    rec = record()
    f.sch.records[rec.job_id] = rec
    f.sch.on_view({"m1": "dead"})
    await asyncio.sleep(0.05)
    assert rec.cancel_requested and rec.coord.cancelled == ["the submitting daemon m1 is dead"]
    await f.sch.close()


async def test_at_most_max_held_jobs_hold_weights(tmp_path: Path) -> None:
    f = Fake(tmp_path)
    recs = [record(f"j{i}-00000{i}", submitted_at=float(i)) for i in range(6)]
    for r in recs:
        f.sch.records[r.job_id] = r
        f.sch._hold(r, {"w": torch.zeros(1)})
    held = [r.held is not None for r in recs]
    assert held == [False] * (6 - scheduling.MAX_HELD_JOBS) + [True] * scheduling.MAX_HELD_JOBS
    assert "dropped" in recs[0].logs[-1]
    await f.sch.close()


async def test_close_is_idempotent_and_nothing_spawns_after(tmp_path: Path) -> None:
    f = Fake(tmp_path)
    await f.sch.close()
    await f.sch.close()
    rec = record()
    f.sch.records[rec.job_id] = rec
    f.sch.on_view({"m1": "dead"})  # would spawn a cancel: refused once closed
    await asyncio.sleep(0.01)
    assert rec.coord.cancelled == [] and not f.sch._tasks
