"""The submitter role (`fusiond.jobs.submission.Submissions`) on its own, with an in-memory
send, view and host: a forward followed to its end, a gap in the scheduler's updates asked
for again, a dead scheduler's job failed over (or failed without a restart left), and a
checkpoint resumed from only once the history covers it. (With a whole JobService:
tests/train/test_service.py; real daemons: tests/e2e/test_authority.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusiond.jobs.outputs import OutputStore
from fusiond.jobs.records import RemoteJob
from fusiond.jobs.submission import Submissions, SubmitterHost, promote_checkpoint
from fusiond.jobs.upload import Upload, decode_upload
from protocol.messages import JobQuery, JobSubmit, JobSubmitReply, JobUpdate, Message


class View(SimpleNamespace):
    def __init__(self, ids: Sequence[str], leader: str | None, term: int = 1) -> None:
        super().__init__(members=[SimpleNamespace(node_id=n, state="alive") for n in ids],
                         leader=leader, term=term, has_quorum=True)


class Fake:
    """The peer network (schedulers answer submissions at once) and the job service's host."""

    def __init__(self, tmp: Path, view: View) -> None:
        self.view = view
        self.sent: list[tuple[str, Message, Sequence[Any]]] = []
        self.calls: list[tuple[str, str]] = []
        self.term = 7
        self.subs = Submissions(
            node_id="me", send=self.send, view=lambda: self.view,
            leadership=lambda: SimpleNamespace(leader=self.view.leader, term=self.view.term,
                                               has_quorum=True),  # type: ignore[arg-type]
            store=OutputStore(tmp / "outputs"), host=SubmitterHost(
                run_here=self.run_here, local_record=lambda _: None,
                persist=lambda j: self.calls.append(("persist", j)),
                steps_arrived=lambda j: self.calls.append(("steps", j)),
                tracked=lambda j: self.calls.append(("tracked", j)),
                ended=lambda j: self.calls.append(("ended", j))))

    async def send(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        self.sent.append((peer, msg, payload))
        if isinstance(msg, JobSubmit):
            meta = decode_upload(bytes(payload[0])).meta
            reply = JobSubmitReply(request_id=msg.request_id, ok=True, summary={
                "job_id": meta.get("job_id", "j-abcdef"), "stages": [{"stage": 0}],
                "plan": "p", "term": self.term})
            asyncio.get_running_loop().call_soon(self.subs.on_submit_reply, peer, reply)

    async def run_here(self, upload: Upload, *, dry_run: bool = False,
                       owner_uid: int | None = None) -> dict[str, Any]:
        raise AssertionError("this daemon is never the scheduler here")

    def to(self, peer: str, kind: type[Message]) -> list[Message]:
        return [m for p, m, _ in self.sent if p == peer and isinstance(m, kind)]


UPLOAD = Upload({"toml": "", "base": "/", "out_base": "/"}, b"graph", b"state")
SPEC = SimpleNamespace(output=Path("/out"), name="j", steps=10, max_restarts=1)


def _steps(steps: range) -> tuple[dict[str, Any], ...]:
    return tuple({"step": s, "loss": 1.0} for s in steps)


async def test_a_forwarded_job_is_followed_and_a_gap_in_its_updates_asked_for(
        tmp_path: Path) -> None:
    f = Fake(tmp_path, View(["me", "m0"], leader="m0"))
    try:
        summary = await f.subs.submit(UPLOAD, SPEC, owner_uid=1000)  # type: ignore[arg-type]
        assert summary["scheduler"] == "m0"
        r = f.subs.records["j-abcdef"]
        assert (r.scheduler, r.term, r.owner_uid, r.state) == ("m0", 7, 1000, "running")
        assert f.calls == [("persist", "j-abcdef"), ("tracked", "j-abcdef")]

        f.subs.on_update("m0", JobUpdate(job_id=r.job_id, steps=_steps(range(3)), after=-1))
        f.subs.on_update("m9", JobUpdate(job_id=r.job_id, steps=_steps(range(3, 5)), after=2))
        assert [int(h["step"]) for h in r.history] == [0, 1, 2]  # not from its scheduler
        f.subs.on_update("m0", JobUpdate(job_id=r.job_id, steps=_steps(range(6, 8)), after=5,
                                         status={"state": "done"}))
        await asyncio.sleep(0.05)
        assert [int(h["step"]) for h in r.history] == [0, 1, 2] and r.state == "running"
        asks = f.to("m0", JobQuery)
        assert len(asks) == 1 and asks[0].through == 2  # type: ignore[attr-defined]

        f.subs.on_update("m0", JobUpdate(job_id=r.job_id, steps=_steps(range(3, 8)), after=2,
                                         status={"state": "failed", "outcome": {
                                             "ok": False, "failure": "a stage died"}}))
        await asyncio.wait_for(r.ended.wait(), 5)
        assert r.state == "failed" and len(r.history) == 8
        assert ("ended", r.job_id) in f.calls
        assert (tmp_path / "outputs" / r.job_id / "metrics.json").exists()
    finally:
        await f.subs.close()
        await f.subs.close()  # idempotent


async def test_a_dead_schedulers_job_fails_over_or_fails_without_a_restart_left(
        tmp_path: Path) -> None:
    f = Fake(tmp_path, View(["me", "m0", "m2"], leader="m0"))
    try:
        left = RemoteJob("a-abcdef", "m0", Path("/out"), {"state": "running"},
                         upload=UPLOAD, max_restarts=1, term=1, stream_through=4)
        spent = RemoteJob("b-abcdef", "m0", Path("/out"), {"state": "running"},
                          upload=UPLOAD, max_restarts=1, restarts=1, term=1)
        f.subs.records.update({r.job_id: r for r in (left, spent)})
        f.view = View(["me", "m2"], leader="m2", term=2)
        f.term = 9
        f.subs.on_view({"m0": "dead"})
        assert spent.state == "failed" and ("ended", spent.job_id) in f.calls
        assert "declared it dead" in spent.status["outcome"]["failure"]
        for _ in range(100):
            if not left.failing_over:
                break
            await asyncio.sleep(0.05)
        assert (left.scheduler, left.term, left.restarts) == ("m2", 9, 1)
        assert left.stream_through == -1 and left.state == "running"
        (peer, _, payload), = [s for s in f.sent if isinstance(s[1], JobSubmit)]
        meta = decode_upload(bytes(payload[0])).meta
        assert peer == "m2" and meta["job_id"] == left.job_id and meta["restarts"] == 1
    finally:
        await f.subs.close()


def test_a_checkpoint_is_resumed_from_only_once_the_history_covers_it() -> None:
    r = RemoteJob("c-abcdef", "m0", Path("/out"), {})
    for s in range(4):
        r.history.add({"step": s})
    r.pending_checkpoint = (5, Path("/store/checkpoint-6.safetensors"))
    promote_checkpoint(r)
    assert r.checkpoint is None  # steps 4 and 5 are not here yet
    r.history.add({"step": 4})
    r.history.add({"step": 5})
    promote_checkpoint(r)
    assert r.checkpoint == Path("/store/checkpoint-6.safetensors")
    assert r.pending_checkpoint is None


@pytest.mark.parametrize("closed", [False, True])
async def test_close_cancels_the_watch_and_refuses_new_tasks(tmp_path: Path,
                                                             closed: bool) -> None:
    f = Fake(tmp_path, View(["me", "m0"], leader="m0"))
    await f.subs.submit(UPLOAD, SPEC)  # type: ignore[arg-type]
    tasks = set(f.subs._tasks)
    assert any(t.get_name().startswith("watch") for t in tasks)
    await f.subs.close()
    assert all(t.done() for t in tasks) and not f.subs._tasks
    if closed:  # a hand-back after close starts nothing
        r = RemoteJob("d-abcdef", "me", Path("/out"), {"state": "running"}, upload=UPLOAD)
        f.subs.take_back(r, "stepped down")
        assert not f.subs._tasks
