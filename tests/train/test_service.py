"""The job service's scheduling decisions, with an in-memory cluster view and network: only the
scheduler holding its lease schedules; a submission waits (bounded) for one; a scheduler that
loses its lease hands its jobs back; a scheduler's bug, or a job it lost, reaches the
submitter. (Real daemons: tests/e2e/test_authority.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from fusiond.jobs import service, submission
from fusiond.jobs.scheduling import Scheduling
from fusiond.jobs.service import JobService, NotScheduler
from protocol.messages import (
    JobQuery,
    JobQueryReply,
    JobSubmit,
    JobSubmitReply,
    JobUpdate,
    Message,
    NodeProfile,
)

pytestmark = pytest.mark.slow

JOB = """
[job]
name = "svc"
steps = {steps}
output = "{out}"
[model]
zoo = "gpt2"
config = {{ size = "tiny" }}
[data]
path = "{data}"
seq_len = 16
[batch]
size = 4
micro_batches = 2
[compression]
adatopk = false
"""


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fusiond.jobs.submit import prepare_job
    from fusiond.train.spec import default_text_path

    tmp = tmp_path_factory.mktemp("svc")
    p = tmp / "job.toml"
    p.write_text(JOB.format(steps=100_000, out=tmp / "out", data=default_text_path() / "json"))
    return prepare_job(p)


def upload(job: Any, **meta: Any) -> bytes:
    """What `fusionctl submit` sends: the job, and the corpus it read as the user."""
    from fusiond.jobs.submit import corpus_for_upload
    from fusiond.jobs.upload import encode_upload

    digest, corpus = corpus_for_upload(job.spec)
    return encode_upload({"toml": job.toml_text, "base": job.base, "out_base": job.out_base,
                          "data_digest": digest, "data_default": bool(digest) and not corpus,
                          **meta}, job.graph_bytes, job.state_bytes, corpus)


def member(node_id: str) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, state="alive", address=("127.0.0.1", 1),
                           profile=NodeProfile(gflops=100.0, memory_bytes=10**10))


class View(SimpleNamespace):
    """What the service reads of a `ClusterView`."""

    def __init__(self, ids: Sequence[str], leader: str | None, term: int = 1,
                 has_quorum: bool = True) -> None:
        super().__init__(members=[member(n) for n in ids], links={}, leader=leader, term=term,
                         has_quorum=has_quorum)

    def quorum_advice(self) -> str | None:
        return None if self.has_quorum else "no quorum: 1 of 3 voters alive, 2 needed"


class Net:
    """The peer network: records what is sent; `reply` answers it (as the peer would)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []
        self.svc: JobService | None = None
        self.reply: Any = None

    async def send(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        self.sent.append((peer, msg))
        if self.reply is not None:
            got = self.reply(peer, msg)
            if got is not None and self.svc is not None:
                asyncio.get_running_loop().call_soon(
                    lambda: asyncio.ensure_future(self.svc.dispatch(peer, got)))  # type: ignore[union-attr]

    def kinds(self, peer: str | None = None) -> list[str]:
        return [type(m).__name__ for p, m in self.sent if peer is None or p == peer]


async def wait(cond: Any, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s} s")


@contextlib.asynccontextmanager
async def _scheduling_for_m1(prepared: Any) -> AsyncIterator[
        tuple[Net, View, JobService, service._Record]]:
    """This daemon, m0, schedules a job m1 submitted (m0, m1, m2; m0 leads), past its first
    step: (the network, the view, the service, the job's record); the service closes after."""
    net = Net()
    view = View(["m0", "m1", "m2"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=1)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        await wait(lambda: bool(rec.history), 60, "the first step")
        yield net, view, svc, rec
    finally:
        await svc.close()


async def test_a_submission_without_a_scheduler_waits_for_one(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No scheduler (no quorum): the submission waits `SCHEDULER_WAIT_S`, then is refused with
    the cluster's advice, and nothing was planned or sent (this daemon used to coordinate the
    job itself). Once a scheduler is elected during the wait, it goes there: here this daemon
    (a one-node cluster elects itself), which runs it on its own stage."""
    monkeypatch.setattr(submission, "SCHEDULER_WAIT_S", 0.6)
    net = Net()
    view = View(["m0", "m1", "m2"], leader=None, has_quorum=False)
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    try:
        with pytest.raises(NotScheduler, match=r"no scheduler: no quorum: 1 of 3 voters alive, "
                                               r"2 needed; waited 0.6s"):
            await svc.submit_upload(upload(prepared, stages=1, steps=2))
        assert net.sent == [] and svc.jobs()["jobs"] == [] and not svc.worker.jobs()

        async def elected() -> None:
            await asyncio.sleep(0.2)
            view.leader, view.has_quorum = "m0", True

        task = asyncio.create_task(elected())
        summary = await svc.submit_upload(upload(prepared, stages=1, steps=2))
        await task
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record) and summary["term"] == 1
        await asyncio.wait_for(asyncio.shield(rec.task), 60)  # type: ignore[arg-type]
        assert rec.state == "done", rec.outcome
        assert net.sent == []  # one stage, here: nothing crossed the network
    finally:
        await svc.close()


async def test_a_scheduler_that_loses_its_lease_hands_the_job_back(prepared: Any) -> None:
    """The scheduler of a job submitted by m1 loses its quorum (3 of 5 gone, or cut off): at
    once its attempt is cancelled (its stage freed), nothing is re-planned, and m1 gets the job
    back (`JobUpdate.handed_back`) to resubmit it to the next scheduler."""
    async with _scheduling_for_m1(prepared) as (net, view, svc, rec):
        assert svc.worker.jobs()
        view.leader, view.has_quorum = None, False  # a minority now
        svc.on_view(view)
        await asyncio.wait_for(asyncio.shield(rec.task), 20)  # type: ignore[arg-type]
        assert rec.state == "handed_back", rec.state
        assert not svc.worker.jobs()
        back = [m for p, m in net.sent if p == "m1" and isinstance(m, JobUpdate)
                and m.handed_back]
        assert len(back) == 1 and "not the scheduler" in back[0].handed_back, net.kinds("m1")
        assert not any("restart" in x for x in rec.logs), list(rec.logs)
        # and a stale submission is refused, saying who to ask
        with pytest.raises(NotScheduler, match="not the scheduler"):
            await svc.submit(service.decode_upload(upload(prepared, stages=1)), submitter="m1")


async def test_a_scheduler_that_lost_the_lease_among_a_majority_decides_nothing_more(
        prepared: Any) -> None:
    """Another member leads now, and this daemon still sees a majority: its running attempt
    goes on (no other scheduler knows the job, and no minority is scheduling), but it decides
    nothing more: the attempt's failure is handed back instead of restarted here."""
    async with _scheduling_for_m1(prepared) as (net, view, svc, rec):
        view.leader, view.term = "m2", 2  # a lease that lapsed under load, say
        svc.on_view(view)
        at = len(rec.history)
        await wait(lambda: len(rec.history) > at + 2, 30, "more steps")
        assert rec.state == "running" and svc.worker.jobs()
        assert sum("decides nothing more" in x for x in rec.logs) == 1
        svc.on_view(view)
        assert sum("decides nothing more" in x for x in rec.logs) == 1  # (noted once a term)
        rec.coord.node_failed("m0", "a test: its stage machine failed")
        await asyncio.wait_for(asyncio.shield(rec.task), 20)  # type: ignore[arg-type]
        assert rec.state == "handed_back" and rec.restarts == 0, list(rec.logs)
        assert any(isinstance(m, JobUpdate) and m.handed_back for _, m in net.sent)


async def test_a_scheduler_bug_ends_the_job_on_its_submitter(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception in the scheduler's own code (a bug) fails the job with its reason, and the
    submitter hears it (it used to show the job running forever)."""

    async def crash(self: Any) -> None:
        raise RuntimeError("a scheduler bug")

    monkeypatch.setattr(service.JobCoordinator, "run", crash)
    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=1)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        await asyncio.wait_for(asyncio.shield(rec.task), 20)  # type: ignore[union-attr,arg-type]
        final = [m for p, m in net.sent if p == "m1" and isinstance(m, JobUpdate)
                 and m.status.get("state") == "failed"]
        assert final, net.kinds("m1")
        assert "scheduler error: RuntimeError: a scheduler bug" in str(final[-1].status)
    finally:
        await svc.close()


def _scheduler(net: Net, *, knows: bool | None) -> Any:
    """m0 as the scheduler, seen from the submitter m1: it takes every submission; asked about
    the job it answers unknown (`knows` False), running (True) or nothing (None)."""
    seen: list[str] = []

    def reply(peer: str, msg: Message) -> Message | None:
        if isinstance(msg, JobSubmit):
            seen.append(msg.request_id)
            return JobSubmitReply(request_id=msg.request_id, ok=True, summary={
                "job_id": "svc-abcdef", "stages": [{"stage": 0, "node": "m0"}], "plan": "",
                "term": 1})
        if isinstance(msg, JobQuery) and knows is not None:
            return JobQueryReply(job_id=msg.job_id, known=knows,
                                 state="running" if knows else "")
        return None

    net.reply = reply
    return seen


@pytest.mark.parametrize("first_step", [0, 3])
async def test_a_submitter_whose_scheduler_lost_the_job_resubmits_it(
        prepared: Any, monkeypatch: pytest.MonkeyPatch, first_step: int) -> None:
    """The scheduler stays alive (it restarted faster than the failure detector) but no longer
    has the job: its updates stop; the submitter asks, hears "unknown", and resubmits the job
    (the scheduler may be the same node: it lost the job) within the failover bound. Without a
    checkpoint it starts where the job started, and the log says that step (a job submitted
    with --resume read "from step 0")."""
    monkeypatch.setattr(submission, "STALE_UPDATE_S", 0.5)
    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m1", send_raw=net.send, view=lambda: view)
    net.svc = svc
    submits = _scheduler(net, knows=False)
    await svc.start()
    try:
        meta = {"first_step": first_step} if first_step else {}
        summary = await svc.submit_upload(upload(prepared, stages=1, **meta))
        r = svc.get(summary["job_id"])
        assert isinstance(r, service._Remote)
        # The fake scheduler sees the resubmission before its reply reaches the submitter:
        # wait for the submitter to have taken the reply, not only for the request to be sent.
        await wait(lambda: len(submits) == 2 and r.restarts == 1, 10, "the resubmission")
        assert "JobQuery" in net.kinds("m0")
        assert r.restarts == 1 and r.state == "running"
        lines = svc.logs(r.job_id)["lines"]
        assert any("no longer knows the job" in x for x in lines), lines
        assert any(f"resubmitted to the new scheduler m0 from step {first_step}, where it "
                   "started" in x for x in lines), lines
    finally:
        await svc.close()


async def test_a_silent_scheduler_fails_the_job_within_the_failover_bound(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler alive in the membership view that neither sends updates nor answers: the
    job fails after `FAILOVER_WAIT_S` of silence, naming it; one that answers "running" keeps
    the job (its updates are only late)."""
    monkeypatch.setattr(submission, "STALE_UPDATE_S", 0.5)
    monkeypatch.setattr(submission, "QUERY_TIMEOUT_S", 0.3)
    monkeypatch.setattr(submission, "FAILOVER_WAIT_S", 2.0)
    for knows in (None, True):
        net = Net()
        view = View(["m0", "m1"], leader="m0")
        svc = JobService(node_id="m1", send_raw=net.send, view=lambda v=view: v)
        net.svc = svc
        _scheduler(net, knows=knows)
        await svc.start()
        try:
            summary = await svc.submit_upload(upload(prepared, stages=1))
            r = svc.get(summary["job_id"])
            assert isinstance(r, service._Remote)
            await asyncio.sleep(4.0)
            if knows is None:
                assert r.state == "failed", r.status
                failure = r.status["outcome"]["failure"]
                assert failure.startswith("the scheduler m0 sent nothing about the job for "), \
                    failure
                assert "does not answer status queries" in failure
            else:
                assert r.state == "running" and net.kinds("m0").count("JobQuery") >= 2
        finally:
            await svc.close()



async def test_a_job_handed_back_waits_for_a_scheduler_and_can_be_cancelled(
        prepared: Any) -> None:
    """The scheduler gives the job back (it lost its lease): the submitter waits for the next
    scheduler (a newer term: the same node counts again only then) and resubmits there; a
    user's cancel meanwhile ends the job and nothing is resubmitted."""
    for cancel in (False, True):
        net = Net()
        view = View(["m0", "m1", "m2"], leader="m0", term=1)
        svc = JobService(node_id="m1", send_raw=net.send, view=lambda v=view: v)
        net.svc = svc
        submits = _scheduler(net, knows=True)
        await svc.start()
        try:
            summary = await svc.submit_upload(upload(prepared, stages=1))
            r = svc.get(summary["job_id"])
            assert isinstance(r, service._Remote) and r.term == 1
            view.leader, view.has_quorum = None, False
            await svc.dispatch("m0", JobUpdate(job_id=r.job_id, status={"state": "running"},
                                               handed_back="m0 lost its quorum"))
            assert r.failing_over and r.state == "running"
            if cancel:
                res = await svc.cancel(r.job_id)
                assert res == {"job_id": r.job_id, "state": "cancelled", "cancelled": True}
            view.leader, view.has_quorum = "m0", True  # the same term: not yet
            await asyncio.sleep(0.5)
            assert len(submits) == 1
            view.term = 2  # m0 elected again, in a newer term
            if cancel:
                await asyncio.sleep(0.5)
                assert len(submits) == 1 and r.state == "cancelled"
            else:
                await wait(lambda r=r: r.restarts == 1, 10, "the resubmission in the new term")
                assert len(submits) == 2 and r.state == "running" and r.restarts == 1
        finally:
            await svc.close()


def _recs(steps: range) -> tuple[dict[str, Any], ...]:
    return tuple({"step": s, "loss": 5.0 - 0.01 * s, "wall_s": 0.1} for s in steps)


async def test_a_submitter_that_lost_an_update_asks_for_its_records_again(
        prepared: Any) -> None:
    """The chaos check's finding: a scheduler's send only queues, and a failed dial drops what
    was queued, so an update can be lost while the next arrives. Taken as is, the job's step
    history (metrics.json) had a hole, and a final update that came after a lost one ended the
    job `done` with steps missing. Each update says which step its records follow (`after`):
    the submitter takes nothing after a gap, asks (`JobQuery.through`, the last step it holds)
    and takes the records sent again."""
    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m1", send_raw=net.send, view=lambda: view)
    net.svc = svc
    _scheduler(net, knows=True)
    await svc.start()
    try:
        summary = await svc.submit_upload(upload(prepared, stages=1, steps=8))
        r = svc.get(summary["job_id"])
        assert isinstance(r, service._Remote)
        await svc.dispatch("m0", JobUpdate(job_id=r.job_id, steps=_recs(range(0, 3)), after=-1))
        assert r.history.steps() == [0, 1, 2]
        # the update of steps 3..5 is lost; the final one (6, 7 and "done") arrives
        done = {"state": "done", "step": 8, "outcome": {"ok": True}}
        await svc.dispatch("m0", JobUpdate(job_id=r.job_id, steps=_recs(range(6, 8)),
                                           status=done, after=5))
        assert r.history.steps() == [0, 1, 2], "records after a gap were taken"
        assert not r.finishing and r.state == "running", "a final update after a gap ended it"
        await wait(lambda: any(isinstance(m, JobQuery) and m.through == 2
                               for p, m in net.sent if p == "m0"), 5, "the ask to resend")
        # the scheduler sends everything after step 2 again, with the status
        await svc.dispatch("m0", JobUpdate(job_id=r.job_id, steps=_recs(range(3, 8)),
                                           status=done, after=2))
        assert r.history.steps() == list(range(8))
        assert r.finishing or r.state == "done"
        # an update whose records follow ones already held (a resend crossing an update) is
        # taken, each step once
        assert r.stream_through == 7
    finally:
        await svc.close()


async def test_a_scheduler_sends_the_records_after_what_its_submitter_holds_again(
        prepared: Any) -> None:
    """The scheduler's side: every update names the step its records follow, the chain of
    updates has no gap, and a `JobQuery.through` from the submitter rewinds the stream to
    that step: the next update carries the records after it again, and the status."""
    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=1)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        await wait(lambda: len(rec.history) >= 3, 60, "three steps")
        await wait(lambda: sum(len(m.steps) for p, m in net.sent
                               if isinstance(m, JobUpdate)) >= 3, 10, "updates of 3 steps")
        updates = [m for p, m in net.sent if p == "m1" and isinstance(m, JobUpdate)]
        held = -1
        for m in updates:  # the submitter could take each one: no gap
            assert m.after == held, (m.after, held)
            if m.steps:
                held = int(m.steps[-1]["step"])
        assert held >= 2
        net.sent.clear()
        await svc.dispatch("m1", JobQuery(job_id=rec.job_id, through=0))
        await wait(lambda: any(isinstance(m, JobUpdate) and m.status for p, m in net.sent
                               if p == "m1"), 10, "the records again")
        again = [m for p, m in net.sent if p == "m1" and isinstance(m, JobUpdate)]
        assert again[0].after == 0 and again[0].steps[0]["step"] == 1, again[0]
        assert any(isinstance(m, JobQueryReply) and m.known for _, m in net.sent)
        # a plain status query (an older submitter: through -2) rewinds nothing
        net.sent.clear()
        await svc.dispatch("m1", JobQuery(job_id=rec.job_id))
        await wait(lambda: any(isinstance(m, JobQueryReply) for _, m in net.sent), 10, "reply")
        await asyncio.sleep(0.3)
        assert all(m.after >= held for _, m in net.sent if isinstance(m, JobUpdate))
    finally:
        await svc.close()


def test_a_machine_that_failed_a_job_is_planned_again_once_it_restarted_or_later() -> None:
    """The chaos check's finding: a job's attempts were planned without every machine that had
    ever failed it, for the job's whole life. Under a nemesis that kills, freezes and cuts off
    a minority at a time, every other machine had failed once within minutes: the job ran on
    ever fewer stages, and the next failure (now of the scheduler's own machine) ended it. A
    machine is planned again once it restarted (a new incarnation), or `EXCLUDE_FOR_S` after
    its failure unless it refused its partition (that lasts until it restarts)."""
    lines: list[str] = []
    rec = SimpleNamespace(excluded={}, log=lines.append)
    view = View(["m0", "m1", "m2", "m3"], leader="m0")
    for i, m in enumerate(view.members):
        m.incarnation = 100 + i
    t0 = 1000.0
    rec.excluded = {"m1": (101, t0, False), "m2": (102, t0, False), "m3": (103, t0, True)}
    assert Scheduling._excluded_now(rec, view, t0 + 1) == {"m1", "m2", "m3"}  # type: ignore[arg-type]
    view.members[1].incarnation = 201  # m1 restarted
    assert Scheduling._excluded_now(rec, view, t0 + 2) == {"m2", "m3"}  # type: ignore[arg-type]
    assert lines == ["m1 planned again: it restarted since it failed"]
    late = t0 + service.EXCLUDE_FOR_S
    assert Scheduling._excluded_now(rec, view, late) == {"m3"}  # type: ignore[arg-type]
    assert lines[-1] == f"m2 planned again: {service.EXCLUDE_FOR_S:g}s since it failed"
    view.members[3].incarnation = 203  # the machine that refused restarted (new torch, say)
    assert Scheduling._excluded_now(rec, view, late) == set()  # type: ignore[arg-type]


@pytest.mark.parametrize("cause", [
    "m0: stage 0, step 3, B0: no backward on edge 'add_93:0->1' within 15s",
    "m0: stage 0, step 3, F1: op aten.mm.default raised: out of memory",
])
async def test_a_stage_of_the_scheduler_that_only_waited_for_an_input_restarts_the_job(
        prepared: Any, monkeypatch: pytest.MonkeyPatch, cause: str) -> None:
    """The chaos check's finding: a tensor lost when a dial failed stalls the pipeline; the
    scheduler's own stage timed out first (its report is local, its neighbours' come over the
    network), and since a failure of the scheduler's machine ends the job, the job failed for
    good while every machine was up. A stage that only waited too long for an input is a
    victim (its machine is alive): the attempt restarts, blaming none. Any other failure of
    the scheduler's machine still ends the job."""
    from fusiond.jobs.coordinator import FailureReport, JobOutcome

    calls: list[int] = []
    real_run = service.JobCoordinator.run

    async def run(self: Any) -> Any:
        calls.append(self.plan_version)
        if len(calls) == 1:
            return JobOutcome(self.job_id, False, [], None,
                              FailureReport("m0", 0, 3, cause), 0.1, dict(self.stage_nodes))
        return await real_run(self)

    monkeypatch.setattr(service.JobCoordinator, "run", run)
    net = Net()
    view = View(["m0"], leader="m0")  # (the restart plans the stage here again)
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=1, steps=3)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        if "no backward" in cause:  # (done waits for m1 to store the model: steps suffice)
            await wait(lambda: len(rec.history) == 3 or rec.state != "running", 30,
                       f"the restarted attempt's steps: {list(rec.logs)}")
            assert rec.state == "running" and rec.restarts == 1, (rec.state, list(rec.logs))
            assert len(calls) == 2 and "m0" not in rec.excluded
        else:
            await asyncio.wait_for(asyncio.shield(rec.task), 20)  # type: ignore[arg-type]
            assert rec.state == "failed" and rec.restarts == 0 and len(calls) == 1
    finally:
        await svc.close()


async def test_a_forwarded_submission_goes_to_the_next_scheduler_when_the_first_never_answers(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chaos check's finding: a failover forwarded the job to the scheduler of the moment,
    which was replaced 2 s later (the submission, or its answer, lost); the submitting daemon
    waited the whole `SUBMIT_TIMEOUT_S` (300 s) for that answer, then failed the job. Once
    another scheduler is elected the submission goes there."""
    monkeypatch.setattr(submission, "SUBMIT_TIMEOUT_S", 30.0)
    net = Net()
    view = View(["m0", "m1", "m2"], leader="m0")
    svc = JobService(node_id="m1", send_raw=net.send, view=lambda: view)
    net.svc = svc
    asked: list[str] = []

    def reply(peer: str, msg: Message) -> Message | None:
        if isinstance(msg, JobSubmit):
            asked.append(peer)
            if peer == "m0":  # lost, or m0 went down before it answered
                asyncio.get_running_loop().call_later(0.5, setattr, view, "leader", "m2")
                return None
            return JobSubmitReply(request_id=msg.request_id, ok=True, summary={
                "job_id": "svc-abcdef", "stages": [{"stage": 0, "node": peer}], "plan": "",
                "term": 2})
        return None

    net.reply = reply
    await svc.start()
    try:
        t0 = asyncio.get_running_loop().time()
        summary = await asyncio.wait_for(svc.submit_upload(upload(prepared, stages=1)), 25)
        took = asyncio.get_running_loop().time() - t0
        assert asked == ["m0", "m2"] and summary["scheduler"] == "m2", (asked, summary)
        assert took < 10, took
        r = svc.get(summary["job_id"])
        assert isinstance(r, service._Remote) and r.scheduler == "m2"
    finally:
        await svc.close()


async def test_a_scheduler_whose_assign_a_member_refuses_as_stale_hands_the_job_back(
        prepared: Any) -> None:
    """The chaos check's finding: a scheduler frozen for 3 s came back still taking itself for
    the scheduler of its old term while the others had elected another (term 4); it restarted
    its job's attempt, the members refused its Assigns (`not_scheduler`: its term is stale),
    and that ended the job failed. Such a refusal blames no machine and hands the job back to
    its submitter, which resubmits it to the scheduler of the new term."""
    from protocol.messages import Assign, Error

    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc

    def reply(peer: str, msg: Message) -> Message | None:
        if isinstance(msg, Assign):
            return Error(code="not_scheduler", request_id=msg.request_id, job_id=msg.job_id,
                         plan_version=msg.plan_version,
                         message=f"{peer}: Assign refused: its term 1 is stale (the cluster "
                                 "is at term 4)")
        return None

    net.reply = reply
    await svc.start()
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=2)),
                                   submitter="m2")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        assert {s["node"] for s in summary["stages"]} == {"m0", "m1"}
        await asyncio.wait_for(asyncio.shield(rec.task), 30)  # type: ignore[arg-type]
        assert rec.state == "handed_back", (rec.state, list(rec.logs))
        back = [m for p, m in net.sent if p == "m2" and isinstance(m, JobUpdate)
                and m.handed_back]
        assert len(back) == 1 and "term 1 is stale" in back[0].handed_back, net.kinds("m2")
        assert not svc.worker.jobs()
    finally:
        await svc.close()


async def test_a_scheduler_that_stops_hands_another_daemons_job_back(prepared: Any) -> None:
    """The chaos check's finding: a scheduler stopped cleanly (SIGTERM, a restart) 3 s after a
    failover gave it a job; it cancelled every job it coordinated as if it had submitted
    them, and the submitter's job ended `cancelled` (fusionctl exit 6) though nobody cancelled
    it. Another daemon's job goes back to it for the next scheduler."""
    net = Net()
    view = View(["m0", "m1"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    net.svc = svc
    await svc.start()
    closed = False
    try:
        summary = await svc.submit(service.decode_upload(upload(prepared, stages=1)),
                                   submitter="m1")
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        await wait(lambda: bool(rec.history), 60, "the first step")
        await svc.close()
        closed = True
        to_m1 = [m for p, m in net.sent if p == "m1" and isinstance(m, JobUpdate)]
        back = [m for m in to_m1 if m.handed_back]
        assert len(back) == 1 and "the scheduler m0 is stopping" in back[0].handed_back, \
            [(m.handed_back, m.status.get("state")) for m in to_m1 if m.status]
        assert not any(m.status.get("state") == "cancelled" for m in to_m1)
        assert rec.state == "handed_back" and not svc.worker.jobs()
    finally:
        if not closed:
            await svc.close()


async def test_a_wait_for_a_scheduler_wakes_on_the_views_change(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A submission waiting for a scheduler is woken by the cluster's change callback
    (`on_view`) at once instead of polling the view ten times a second: with the periodic
    re-read pushed out to 30 s, the election 1.5 s in still starts the job at once, and the
    view was read a few times, not 15 (the old loop polled it every 0.1 s)."""
    monkeypatch.setattr(submission, "SCHEDULER_WAIT_S", 60.0)
    monkeypatch.setattr(submission, "VIEW_RECHECK_S", 30.0, raising=False)
    net = Net()
    view = View(["m0"], leader=None, has_quorum=False)
    reads = 0

    def read() -> View:
        nonlocal reads
        reads += 1
        return view

    svc = JobService(node_id="m0", send_raw=net.send, view=read)
    net.svc = svc
    await svc.start()
    waiting = 0
    try:
        async def elected() -> None:
            nonlocal waiting
            await asyncio.sleep(1.5)
            waiting = reads - before  # while it waited for a scheduler
            view.leader, view.has_quorum = "m0", True
            svc.on_view(view)

        before = reads
        task = asyncio.create_task(elected())
        t0 = asyncio.get_running_loop().time()
        summary = await asyncio.wait_for(svc.submit_upload(upload(prepared, stages=1,
                                                                  steps=2)), 10)
        took = asyncio.get_running_loop().time() - t0
        await task
        assert took < 2.5 and summary["term"] == 1
        assert waiting <= 4, f"the view was read {waiting} times in 1.5 s of waiting"
        rec = svc.get(summary["job_id"])
        assert isinstance(rec, service._Record)
        await asyncio.wait_for(asyncio.shield(rec.task), 60)  # type: ignore[arg-type]
    finally:
        await svc.close()


async def test_a_job_cancelled_here_comes_back_from_its_submitter_under_its_id(
        prepared: Any) -> None:
    """The chaos check: this daemon scheduled m1's job, was frozen, m1 failed the job over to
    another scheduler and cancelled the attempt here; later this daemon was elected again and
    m1 resubmitted the job to it under its id: it was refused as "already in use here", and
    the job failed. A job whose attempt here ended comes back from its own submitter; another
    daemon may still not take its id."""
    from protocol.messages import JobCancel

    async with _scheduling_for_m1(prepared) as (_net, _view, svc, rec):
        job_id = rec.job_id
        await svc.dispatch("m1", JobCancel(job_id=job_id, reason="failed over elsewhere"))
        await asyncio.wait_for(asyncio.shield(rec.task), 20)  # type: ignore[arg-type]
        assert rec.state == "cancelled", rec.state
        with pytest.raises(service.JobRefused, match="already in use here"):
            await svc.submit(service.decode_upload(upload(prepared, stages=1, job_id=job_id)),
                             submitter="m2")
        again = await svc.submit(service.decode_upload(upload(prepared, stages=1,
                                                              job_id=job_id)), submitter="m1")
        assert again["job_id"] == job_id
        took = svc.get(job_id)
        assert isinstance(took, service._Record) and took is not rec
        assert took.state == "running" and took.submitter == "m1"


async def test_a_submission_still_planning_when_the_daemon_stops_is_refused_not_leaked(
        prepared: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Close began while a submission was still planning (in a thread, seconds for a big
    model): the attempt it would start after close gathered the running ones would never be
    awaited. It is refused instead, as by a daemon that is not the scheduler (the submitter
    asks the next one), and nothing runs or is recorded here."""
    planning, release = asyncio.Event(), asyncio.Event()
    real = Scheduling._layout

    async def slow_layout(self: Scheduling, *a: Any, **kw: Any) -> Any:
        planning.set()
        await release.wait()
        return await real(self, *a, **kw)

    monkeypatch.setattr(Scheduling, "_layout", slow_layout)
    net = Net()
    view = View(["m0", "m1", "m2"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view)
    await svc.start()
    sub = asyncio.create_task(svc.submit(service.decode_upload(upload(prepared, stages=1)),
                                         submitter="m1"))
    await asyncio.wait_for(planning.wait(), 30)
    closing = asyncio.create_task(svc.close())
    await asyncio.sleep(0.1)
    release.set()
    with pytest.raises(NotScheduler, match="m0 is stopping"):
        await asyncio.wait_for(sub, 30)
    await asyncio.wait_for(closing, 30)
    assert svc.scheduling.records == {} and not svc.worker.jobs()
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("job ")] == []

