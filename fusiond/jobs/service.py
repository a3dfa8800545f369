"""The daemon's job service: hosts stages (JobWorker) and runs the jobs submitted here, by role.

Every daemon runs one `JobService` once its peer network is up. It

- hosts the stages the scheduler of a job assigns to this node (`JobWorker`);
- takes submissions from the local API (`submit_upload`): validates the job file and the data
  it carries, refuses at once a graph no live member can run, then hands it to the submitter
  role (`fusiond.jobs.submission.Submissions`), which forwards it to the elected scheduler
  (`JobSubmit`) and follows it there, or, this daemon being the scheduler, to the scheduler
  role (`fusiond.jobs.scheduling.Scheduling`), which plans it and runs its attempts (restarts,
  re-adaptation, updates and outputs back to the submitter, the hand-back when it loses the
  lease);
- routes the peer messages of the job protocol by type (`_handlers`): the submitter-side ones
  to `Submissions`, the scheduler-side ones to `Scheduling`, the rest to the running
  coordinators, then the worker; and membership changes to both roles (`on_view`);
- keeps what both roles share on disk: each job's record and step history in the state dir
  (`JobHistory`; step records fsync'ed at most `STEPS_FSYNC_S` apart), the outputs of the jobs
  submitted here (model.safetensors, metrics.json from the job's full step history, the newest
  checkpoints) in its own store, `<state_dir>/outputs/` (`fusiond.jobs.outputs.OutputStore`),
  from where `fusionctl` downloads them and writes them at the job's output path as the user:
  the daemon never reads or writes a path named in a job; and retires an ended job's record to
  the past ones (`_retire`), pruning the store;
- answers the API (`jobs`, `job`, `logs`, `outputs`, and `cancel`/`fetch`, handed to the role
  that holds the job); each job records the uid that submitted it (`owner_uid`), and the API
  lets only that user and the daemon's operator at it.

Its lifecycle orders the roles: `start` loads the past records and sweeps the store, then
starts the roles and the worker; `close` stops new failovers, closes the scheduler role (its
running attempts handed back or cancelled), its own persistence tasks, the submitter role,
writes the last step records, and closes the worker. Each role gets a frozen host of callables
(`SubmitterHost`, `SchedulerHost`), never the service itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusiond.errors import LocalError
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.history import HISTORY_KEPT, RECORDS_KEPT, JobHistory, StepHistory
from fusiond.jobs.opsets import OpSetService, refuse_unrunnable
from fusiond.jobs.outputs import KEEP_JOBS, OutputStore
from fusiond.jobs.planning import JobRefused, cluster_for_planner
from fusiond.jobs.records import FINAL, JobRecord, RemoteJob
from fusiond.jobs.runner import EXCLUDE_FOR_S as EXCLUDE_FOR_S  # (read by tests as service's)
from fusiond.jobs.scheduling import SchedulerHost, Scheduling, checked_data, member_ops
from fusiond.jobs.submission import NotScheduler, Submissions, SubmitterHost
from fusiond.jobs.upload import Upload, decode_upload, read_upload
from fusiond.jobs.views import (
    jobs_view,
    logs_view,
    output_dir_of,
    outputs_brief,
    outputs_view,
    owner_of,
    past_view,
    record_view,
    remote_view,
)
from fusiond.jobs.worker import (
    JobWorker,
    Leadership,
    LeadershipFn,
    SendFn,
    SendNowFn,
    local_send_now,
    local_sender,
)
from fusiond.tasks import TaskSet, raise_if_cancelling
from fusiond.train.spec import parse_job
from fusiond.train.stage import StageConfig
from protocol import ir
from protocol.messages import (
    MAX_JOBS_ANSWER_HISTORY,
    JobCancel,
    JobFetch,
    JobOutput,
    JobOutputAck,
    JobQuery,
    JobQueryReply,
    JobsAnswer,
    JobsQuery,
    JobSubmit,
    JobSubmitReply,
    JobUpdate,
    Message,
)

__all__ = ["JobService", "NotScheduler", "cluster_for_planner"]

if TYPE_CHECKING:  # the cluster's view type, for annotations only
    from fusiond.cluster import ClusterView

log = logging.getLogger("fusiond.jobs")

def _finite(recs: list[dict[str, Any]]) -> list[Any]:
    """JSON-safe maps for the wire (str keys, non-finite floats as null)."""
    from fusiond.jobs.history import finite_records

    return [json.loads(json.dumps(r, default=str, allow_nan=False))
            for r in finite_records(recs)]


ASK_TIMEOUT_S = 10.0
"""How long `ask_scheduler` waits for the scheduler's `JobsAnswer`."""
STEPS_FSYNC_S = 1.0
"""The submitting daemon appends a running job's step records to disk as they arrive, and
fsyncs them at most this far apart (a kill loses none; a power loss at most this much)."""

_Record = JobRecord  # (the names tests know them by)
_Remote = RemoteJob


class JobService:
    """One per daemon (a service). `send_raw(peer, msg, payload)` is the peer network's send;
    `view()` the cluster's current view (None while not in a cluster); `leadership()` who
    schedules in it (by default read from `view()`), which both the stages hosted here (whose
    Assign to take) and the scheduling here (whether this daemon holds the lease) follow."""

    def __init__(self, *, node_id: str, send_raw: SendFn,
                 view: Callable[[], ClusterView | None],
                 stage_config: StageConfig | None = None, ready_timeout_s: float = 120.0,
                 failure_grace_s: float = 2.0, state_dir: Path | None = None,
                 op_sets: OpSetService | None = None,
                 leadership: LeadershipFn | None = None,
                 send_now_raw: SendNowFn | None = None) -> None:
        self.node_id = node_id
        self.op_sets = op_sets
        """The members' op sets (None: every member counts as running every op)."""
        self._history = JobHistory(state_dir / "jobs") if state_dir is not None else None
        self._past: dict[str, dict[str, Any]] = {}
        """Records of jobs submitted here before this daemon's start (`JobHistory`)."""
        self._scratch: Path | None = None
        if state_dir is None:  # in-process tests: a private store, removed at close
            self._scratch = Path(tempfile.mkdtemp(prefix="fusion-outputs-"))
        self.store = OutputStore((state_dir or self._scratch or Path()) / "outputs")
        """The outputs of the jobs submitted here (`fusiond.jobs.outputs`)."""
        self._steps_locks: dict[str, asyncio.Lock] = {}
        self._steps_new: dict[str, asyncio.Event] = {}
        """Set when a job submitted here has new step records to write."""
        self._fetches: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.view = view
        self.send: SendFn = local_sender(node_id, send_raw, self.dispatch)
        self.leadership: LeadershipFn = leadership or (lambda: Leadership.of(self.view()))
        self.worker = JobWorker(
            node_id=node_id, send=self.send, stage_config=stage_config,
            leadership=self.leadership,
            send_now=None if send_now_raw is None else local_send_now(node_id, send_now_raw),
            offload_root=None if state_dir is None else state_dir / "offload")
        self._tasks = TaskSet("job task")
        self._closed = False
        self.scheduling = Scheduling(
            node_id=node_id, send=self.send, view=self.view, leadership=self.leadership,
            store=self.store, op_sets=op_sets, ready_timeout_s=ready_timeout_s,
            failure_grace_s=failure_grace_s, host=SchedulerHost(
                job_view=self._job_view, persist=self._persist,
                steps_arrived=self._steps_arrived, tracked=self._track_steps,
                ended=self._ended_here, take_back=self._take_back))
        """The scheduler role: the jobs coordinated here."""
        self.submissions = Submissions(
            node_id=node_id, send=self.send, view=self.view, leadership=self.leadership,
            store=self.store, host=SubmitterHost(
                run_here=self.scheduling.submit, local_record=self._jobs.get,
                persist=self._persist,
                steps_arrived=self._steps_arrived, tracked=self._track_steps,
                ended=self._submitted_ended))
        """The submitter role: the jobs submitted here and coordinated elsewhere."""
        self._by_type = self._handlers()
        self._asked: dict[int, asyncio.Future[JobsAnswer]] = {}
        """`JobsQuery`s sent to the scheduler, by request id, waiting for their answer."""
        self._next_ask = secrets.randbits(62)

    @property
    def _jobs(self) -> dict[str, JobRecord]:
        """The jobs coordinated here (`Scheduling.records`)."""
        return self.scheduling.records

    @property
    def _remote(self) -> Mapping[str, RemoteJob]:
        """The jobs submitted here and coordinated elsewhere (`Submissions.records`)."""
        return self.submissions.records

    # -- service ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._history is not None:
            self._past = await asyncio.to_thread(self._history.load)
        await asyncio.to_thread(self.store.sweep)
        await self.scheduling.start()
        await self.submissions.start()
        await self.worker.start()

    async def ready(self) -> None:
        await self.scheduling.ready()
        await self.submissions.ready()
        await self.worker.ready()

    async def close(self) -> None:
        """Stop the jobs coordinated here (their stages get JobCancel): one submitted here is
        cancelled, another daemon's goes back to it for the next scheduler (a hand-back); then
        the stages hosted here. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.submissions.closing()  # no failover starts from now on
        await self.scheduling.close()  # its jobs stopped (handed back or cancelled)
        await self._tasks.close()
        await self.submissions.close()
        for job_id in [*self._jobs, *self._remote]:  # what arrived since the last flush
            with contextlib.suppress(Exception):
                await self._save_steps(job_id)
        await self.worker.close()
        if self._scratch is not None:
            await asyncio.to_thread(shutil.rmtree, self._scratch, True)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.spawn(coro, name)

    def _persist(self, job_id: str) -> None:
        """Write the record of a job submitted here (running or ended) to the state dir (its
        step history goes to the steps file: `_save_steps`)."""
        if self._history is None:
            return
        try:
            rec = self._jobs.get(job_id)
            if rec is not None and not rec.submitter:
                record = self.job(job_id, history=0) | {"lines": list(rec.logs)}
            elif (r := self._remote.get(job_id)) is not None:
                record = self._remote_view(r, 0) | {"lines": self.logs(job_id)["lines"]}
            else:
                return
            self._history.save(job_id, json.loads(json.dumps(record, default=str)))
        except (OSError, ValueError) as e:  # the job goes on; only its record is missing
            log.warning("job %s: record not written: %s", job_id, e)

    def _own_history(self, job_id: str) -> StepHistory | None:
        """The step history this daemon keeps for a job submitted here."""
        rec = self._jobs.get(job_id)
        if rec is not None and not rec.submitter:
            return rec.history
        r = self._remote.get(job_id)
        return r.history if r is not None else None

    async def _save_steps(self, job_id: str, fsync: bool = True) -> None:
        """Append a job's new step records to its steps file (off the event loop, one write at
        a time per job)."""
        hist = self._own_history(job_id)
        if self._history is None or hist is None:
            return
        lock = self._steps_locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            try:
                await asyncio.to_thread(self._history.save_steps, job_id, hist, fsync)
            except (OSError, ValueError) as e:
                log.warning("job %s: step history not written: %s", job_id, e)

    def _steps_arrived(self, job_id: str) -> None:
        ev = self._steps_new.get(job_id)
        if ev is not None:
            ev.set()

    async def _keep_steps(self, job_id: str) -> None:
        """While a job submitted here runs, write its step records as they arrive (fsync'ed
        at most `STEPS_FSYNC_S` apart)."""
        ev = self._steps_new.setdefault(job_id, asyncio.Event())
        synced = time.monotonic()
        try:
            while True:
                hist = self._own_history(job_id)
                st = self._jobs.get(job_id) or self._remote.get(job_id)
                if hist is None or st is None or st.state in FINAL:
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(STEPS_FSYNC_S):
                        await ev.wait()
                raise_if_cancelling()  # a cancel landing as the deadline expires
                ev.clear()
                now = time.monotonic()
                sync = now - synced >= STEPS_FSYNC_S
                await self._save_steps(job_id, fsync=sync)
                if sync:
                    synced = now
        finally:
            self._steps_new.pop(job_id, None)
        await self._save_steps(job_id)

    def _prune_outputs(self) -> None:
        """Keep the outputs of the running jobs and of the newest `KEEP_JOBS` ended ones."""
        if self._closed:
            return
        ended: list[tuple[float, str]] = []
        keep: set[str] = set()
        for j, r in self._jobs.items():
            if r.state == "running" or r.held is not None:
                keep.add(j)
            elif not r.submitter:
                ended.append((r.submitted_at, j))
        for j, rr in self._remote.items():
            if rr.state in FINAL:
                ended.append((rr.submitted_at, j))
            else:
                keep.add(j)
        for j, p in self._past.items():
            if j not in keep:
                ended.append((float(p.get("submitted_at") or 0.0), j))
        keep |= {j for _, j in sorted(ended, reverse=True)[:KEEP_JOBS]}

        def prune() -> None:
            for j in self.store.prune(keep):
                log.info("job %s: outputs removed from the store (it keeps the newest %d "
                         "jobs' outputs)", j, KEEP_JOBS)

        self._spawn(asyncio.to_thread(prune), "prune outputs")

    def _track_steps(self, job_id: str) -> None:
        """A job submitted here is forwarded: keep its step records on disk as they come."""
        self._spawn(self._keep_steps(job_id), f"steps {job_id}")

    def _ended_here(self, job_id: str) -> None:
        """A job submitted here and coordinated here ended (`Scheduling`): its record leaves
        memory once its steps are saved (`_retire`)."""
        if self._closed:  # (close() writes what is left itself)
            return
        self._spawn(self._retire_when_saved(job_id), f"steps {job_id}")
        self._prune_outputs()

    def _take_back(self, r: RemoteJob, why: str) -> None:
        """This daemon, as its scheduler, gave up a job submitted here (`Scheduling`): the
        submitter role fails it over to the next scheduler."""
        self.submissions.take_back(r, why)

    def _job_view(self, job_id: str, history: int) -> dict[str, Any]:
        return self.job(job_id, history=history)

    def _submitted_ended(self, job_id: str) -> None:
        """A job submitted here and coordinated elsewhere ended (`Submissions`)."""
        self._persist(job_id)
        if not self._closed:  # (close() writes what is left itself)
            self._spawn(self._retire_when_saved(job_id), f"steps {job_id}")
        self._prune_outputs()

    def coordinators(self) -> Iterable[JobCoordinator]:
        """Running coordinators (the Prometheus JobCollector reads these)."""
        return self.scheduling.coordinators()

    # -- messages -----------------------------------------------------------------------------

    def _handlers(self) -> dict[type[Message], Callable[[str, Any], Awaitable[bool]]]:
        """The submission protocol's messages, by type (`dispatch`): each handler answers
        whether it took the message (False: the coordinators and the worker are offered it)."""
        return {JobSubmit: self._on_submit_msg, JobSubmitReply: self._on_submit_reply,
                JobUpdate: self._on_update_msg, JobOutput: self._on_output_msg,
                JobOutputAck: self._on_output_ack, JobFetch: self._on_fetch_msg,
                JobQuery: self._on_query_msg, JobQueryReply: self._on_query_reply,
                JobCancel: self._on_cancel_msg, JobsQuery: self._on_jobs_query,
                JobsAnswer: self._on_jobs_answer}

    async def dispatch(self, peer: str, msg: Message) -> bool:
        """Offer a peer message to the submission protocol (by its type), the running
        coordinators here, then the worker."""
        handler = self._by_type.get(type(msg))
        if handler is not None and await handler(peer, msg):
            return True
        for rec in [r for r in self._jobs.values() if r.state == "running"]:
            # Only the running attempt of a running job takes messages: a finished record
            # must never swallow another job's (or attempt's) replies.
            if await rec.coord.handle(peer, msg):
                return True
        return await self.worker.handle(peer, msg)

    async def _on_submit_msg(self, peer: str, msg: JobSubmit) -> bool:
        self.scheduling.on_submit(peer, msg)
        return True

    async def _on_submit_reply(self, peer: str, msg: JobSubmitReply) -> bool:
        self.submissions.on_submit_reply(peer, msg)
        return True

    async def _on_update_msg(self, peer: str, msg: JobUpdate) -> bool:
        self.submissions.on_update(peer, msg)
        return True

    async def _on_output_msg(self, peer: str, msg: JobOutput) -> bool:
        await self.submissions.on_output(peer, msg)
        return True

    async def _on_output_ack(self, peer: str, msg: JobOutputAck) -> bool:
        """The submitter's ack of a model shipped from here, or (`Submissions`) a scheduler's
        answer to a `JobFetch` sent from here."""
        if not self.scheduling.on_output_ack(peer, msg):
            self.submissions.on_output_ack(peer, msg)
        return True

    async def _on_fetch_msg(self, peer: str, msg: JobFetch) -> bool:
        await self.scheduling.on_fetch(peer, msg)
        return True

    async def _on_query_msg(self, peer: str, msg: JobQuery) -> bool:
        self.scheduling.on_query(peer, msg)
        return True

    async def _on_query_reply(self, peer: str, msg: JobQueryReply) -> bool:
        self.submissions.on_query_reply(peer, msg)
        return True

    async def _on_jobs_query(self, peer: str, msg: JobsQuery) -> bool:
        """A member asks this daemon, as the scheduler, about its jobs (or cancels one):
        `fusionctl jobs`, `job`, `logs`, `cancel` on a member that did not take the job."""
        self._spawn(self._answer_jobs(peer, msg), f"jobs query from {peer}")
        return True

    def _submitter_of(self, job_id: str) -> str:
        rec = self._jobs.get(job_id)
        return rec.submitter if rec is not None and rec.submitter else self.node_id

    async def _answer_jobs(self, peer: str, msg: JobsQuery) -> None:
        """From everything this daemon knows: the jobs it coordinates for any member, and
        those submitted here (one it ran itself as the new scheduler after a failover, and
        retired once it ended, included)."""
        rec = self._jobs.get(msg.job_id) if msg.job_id else None
        if not msg.job_id:
            view = self.jobs()
            briefs = [{k: v for k, v in j.items() if k != "owner_uid"}
                      | {"submitter": j.get("submitter") or self.node_id}
                      for j in [*view["jobs"], *view["coordinating"]]
                      if j.get("state") != "handed_back"]
            answer = JobsAnswer(request_id=msg.request_id, jobs=tuple(_finite(briefs)))
        elif not self.knows(msg.job_id) or (rec is not None and rec.state == "handed_back"):
            answer = JobsAnswer(request_id=msg.request_id, known=False)
        else:
            job_id = msg.job_id
            if msg.cancel:
                if rec is not None and rec.state == "running":
                    rec.log(f"cancel requested by {peer}")
                with contextlib.suppress(LocalError, KeyError):
                    await self.cancel(job_id)
            n = max(0, min(int(msg.history), MAX_JOBS_ANSWER_HISTORY))
            shown = {k: v for k, v in self.job(job_id, n).items() if k != "owner_uid"}
            shown |= {"submitter": self._submitter_of(job_id),
                      "lines": self.logs(job_id)["lines"]}
            [job] = _finite([shown])
            answer = JobsAnswer(request_id=msg.request_id, job=job)
        try:
            async with asyncio.timeout(ASK_TIMEOUT_S):
                await self.send(peer, answer, ())
        except (LocalError, OSError, TimeoutError) as e:
            log.info("jobs answer to %s not sent: %s", peer, e)

    async def _on_jobs_answer(self, peer: str, msg: JobsAnswer) -> bool:
        fut = self._asked.get(msg.request_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        return True

    async def ask_scheduler(self, job_id: str = "", history: int = 0, *, cancel: bool = False,
                            timeout_s: float = ASK_TIMEOUT_S) -> tuple[str, JobsAnswer]:
        """(the scheduler, its answer) about the jobs it coordinates, or one of them
        (`JobsQuery`): `fusionctl jobs`, `job`, `logs`, `cancel` from a member that did not
        take the job's submission. `LocalError` when there is no scheduler or it does not
        answer in `timeout_s`."""
        lead = self.leadership()
        if lead is None or lead.leader is None:
            raise LocalError("there is no scheduler to ask (no quorum, or an election is on): "
                             "`fusionctl status` says why")
        self._next_ask = (self._next_ask + 1) % (1 << 63)
        rid = self._next_ask
        fut: asyncio.Future[JobsAnswer] = asyncio.get_running_loop().create_future()
        self._asked[rid] = fut
        try:
            async with asyncio.timeout(timeout_s):
                await self.send(lead.leader, JobsQuery(request_id=rid, job_id=job_id,
                                                       history=history, cancel=cancel), ())
                return lead.leader, await fut
        except TimeoutError:
            raise LocalError(f"the scheduler {lead.leader} did not answer within "
                             f"{timeout_s:g} s") from None
        finally:
            self._asked.pop(rid, None)

    async def _on_cancel_msg(self, peer: str, msg: JobCancel) -> bool:
        """The submitter's cancel; any other JobCancel is a stage's (the worker's)."""
        return self.scheduling.on_cancel(peer, msg)

    def on_view(self, view: Any) -> None:
        """Membership changed: a stage machine declared dead (or gone) fails its job; a dead
        scheduler fails the jobs it coordinated for us; whatever waits for a scheduler looks
        again."""
        gone = {m.node_id: m.state for m in view.members if m.state in ("dead", "left")}
        self.submissions.on_view(gone)
        self.scheduling.on_view(gone)

    # -- submit -------------------------------------------------------------------------------

    async def submit_upload(self, data: bytes | Path, *, dry_run: bool = False,
                            owner_uid: int | None = None) -> dict[str, Any]:
        """The API's entry (`data`: the upload, or the file the API spooled it to): hand it to
        the elected scheduler, or run it here when this daemon is the scheduler; with none
        yet, wait for one (`Submissions.submit`). `owner_uid`: the calling user (None: the
        daemon's operator)."""
        upload = await asyncio.to_thread(read_upload, data) if isinstance(data, Path) \
            else decode_upload(data)
        # Validate what we can here: a bad job file is refused without a round trip. The
        # daemon never touches a path the job names (check_paths=False): the data was read,
        # and is sent, by fusionctl as the user.
        spec = await asyncio.to_thread(parse_job, upload.meta["toml"], base=Path(
            upload.meta["base"]), out_base=Path(upload.meta["out_base"]), check_paths=False)
        upload = await asyncio.to_thread(checked_data, upload, spec)
        await self._check_ops_here(upload)
        return await self.submissions.submit(upload, spec, dry_run=dry_run, owner_uid=owner_uid)

    async def _check_ops_here(self, upload: Upload) -> None:
        """`JobRefused` when no member alive in this daemon's view runs some op of the
        upload's graph: said at once, before waiting for (or without) a scheduler, which checks
        again with its own view."""
        view = self.view()
        if view is None or self.op_sets is None:
            return
        try:
            graph = await asyncio.to_thread(ir.loads, upload.graph_bytes)
        except Exception:  # the scheduler refuses a bad graph with its own reason
            return
        sets = await member_ops(self.op_sets, view)
        alive = [m.node_id for m in view.members if m.state == "alive"
                 and m.node_id not in sets.unknown]
        why = refuse_unrunnable(graph, sets, alive) if alive else None
        if why is not None:
            raise JobRefused(why)

    async def submit(self, upload: Upload, *, dry_run: bool = False,
                     submitter: str = "", owner_uid: int | None = None) -> dict[str, Any]:
        """Plan (and unless `dry_run`, start) a job here, this daemon being the scheduler
        (`Scheduling.submit`); `submitter`: the daemon that forwarded it ("" for here)."""
        return await self.scheduling.submit(upload, dry_run=dry_run, submitter=submitter,
                                            owner_uid=owner_uid)

    # -- retention ----------------------------------------------------------------------------

    async def _retire_when_saved(self, job_id: str) -> None:
        await self._save_steps(job_id)
        self._retire(job_id)

    def _retire(self, job_id: str) -> None:
        """A job submitted here that ended with nothing left to fetch leaves this run's
        memory: its record (as a restart reads it back, the newest `HISTORY_KEPT` steps with
        it) joins the past ones, and the live record with its coordinator goes, so 50 jobs
        leave no more behind than one (tests/train/test_retention.py). The oldest past records
        beyond what the state dir keeps are forgotten, here and on disk."""
        if self._closed:
            return
        rec = self._jobs.get(job_id)
        r = self._remote.get(job_id)
        record: dict[str, Any]
        if rec is not None:
            if (rec.submitter or r is not None or rec.state not in FINAL
                    or rec.held is not None or rec.unstored or rec.storage_failed):
                return
            record = self.job(job_id, history=0) | {"lines": list(rec.logs)}
            hist = rec.history.tail(HISTORY_KEPT)
            del self._jobs[job_id]
        elif r is not None:
            if (r.state not in FINAL or r.unstored or r.storage_failed or r.finishing
                    or r.failing_over):
                return
            record = self._remote_view(r, 0) | {"lines": self.logs(job_id)["lines"]}
            hist = r.history.tail(HISTORY_KEPT)
            self.submissions.forget(job_id)
        else:
            return
        past = json.loads(json.dumps(record, default=str))
        past["history"] = json.loads(json.dumps(hist, default=str))
        self._past[job_id] = past
        self._steps_locks.pop(job_id, None)
        fetch = self._fetches.get(job_id)
        if fetch is not None and fetch.done():
            del self._fetches[job_id]
        keep = self._history.keep if self._history is not None else RECORDS_KEPT
        if len(self._past) > keep:
            oldest = sorted(self._past, key=lambda j: float(
                self._past[j].get("submitted_at") or 0.0))[:len(self._past) - keep]
            for j in oldest:
                del self._past[j]
            if self._history is not None:
                history = self._history

                def forget() -> None:
                    for j in oldest:
                        history.remove(j)

                self._spawn(asyncio.to_thread(forget), "forget past jobs")

    # -- API ----------------------------------------------------------------------------------

    def jobs(self) -> dict[str, Any]:
        """Jobs submitted here (before this daemon's start too) and stages hosted here."""
        return jobs_view(self.node_id, self._jobs, self._remote, self._past, self.worker.jobs())

    def get(self, job_id: str) -> JobRecord | RemoteJob:
        """The job submitted here (or coordinated here); KeyError if unknown."""
        # A job this daemon took over from a dead scheduler is in both for a moment.
        rec: JobRecord | RemoteJob | None = self._jobs.get(job_id) or self._remote.get(job_id)
        if rec is None:
            raise KeyError(job_id)
        return rec

    def job(self, job_id: str, history: int = 20) -> dict[str, Any]:
        """Everything `fusionctl job ID` shows."""
        past = self._past_only(job_id)
        if past is not None:
            return past_view(past, history)
        got = self.get(job_id)
        if isinstance(got, RemoteJob):
            return self._remote_view(got, history)
        return record_view(got, history, scheduler=self.node_id,
                           outputs=self._outputs_brief(job_id) if not got.submitter else {},
                           now=time.time())

    def _outputs_brief(self, job_id: str) -> dict[str, dict[str, Any]]:
        """name -> {size_bytes, sha256} of the job's stored outputs."""
        return outputs_brief(self.store.files(job_id))

    def _remote_view(self, r: RemoteJob, history: int) -> dict[str, Any]:
        return remote_view(r, history, self._outputs_brief(r.job_id))

    def owner(self, job_id: str) -> int | None:
        """The uid that submitted `job_id` here (None: only the operator may see it)."""
        return owner_of(self._jobs.get(job_id) or self._remote.get(job_id),
                        self._past.get(job_id))

    def output_dir(self, job_id: str) -> str | None:
        """The job's `output` path as the submitter's job file resolved it (where fusionctl
        writes the outputs)."""
        return output_dir_of(self._jobs.get(job_id) or self._remote.get(job_id),
                             self._past.get(job_id))

    def outputs(self, job_id: str) -> dict[str, Any]:
        """What `GET /v1/jobs/ID/outputs` answers: the stored files (name, size, sha256) and
        what could not be stored (and who holds it)."""
        return outputs_view(job_id, self._jobs.get(job_id) or self._remote.get(job_id),
                            self._past.get(job_id, {}), node_id=self.node_id,
                            output=self.output_dir(job_id), files=self.store.files(job_id))

    def output_file(self, job_id: str, name: str) -> tuple[Path, str] | None:
        """(path in the store, sha256) of one stored output, or None."""
        path = self.store.path(job_id, name)
        if path is None:
            return None
        f = next((f for f in self.store.files(job_id) if f.name == name), None)
        return (path, f.sha256) if f is not None else None

    async def fetch(self, job_id: str) -> dict[str, Any]:
        """Store again what could not be stored (held weights, metrics.json from the kept
        history; from the scheduler that holds them for a forwarded job), then `outputs`.
        `LocalError` saying why when it still cannot."""
        task = self._fetches.get(job_id)
        if task is None or task.done():
            task = asyncio.create_task(self._fetch(job_id), name=f"fetch {job_id}")
            self._fetches[job_id] = task
        return await asyncio.shield(task)

    async def _fetch(self, job_id: str) -> dict[str, Any]:
        got = self._jobs.get(job_id) or self._remote.get(job_id)
        if isinstance(got, JobRecord):
            await self.scheduling.fetch(got)
        elif isinstance(got, RemoteJob) and got.state in FINAL and got.unstored:
            await self.submissions.fetch(got)
        return self.outputs(job_id)

    def knows(self, job_id: str) -> bool:
        """Whether `job_id` was submitted (or is coordinated) here, in this run or before."""
        return job_id in self._jobs or job_id in self._remote or job_id in self._past

    def _past_only(self, job_id: str) -> dict[str, Any] | None:
        """The persisted record of `job_id` if it is not a job of this daemon's run."""
        if job_id in self._jobs or job_id in self._remote:
            return None
        return self._past.get(job_id)

    def logs(self, job_id: str) -> dict[str, Any]:
        past = self._past_only(job_id)
        return logs_view(job_id, self.get(job_id) if past is None else None, past)

    async def cancel(self, job_id: str) -> dict[str, Any]:
        past = self._past_only(job_id)
        if past is not None:
            return {"job_id": job_id, "state": past.get("state"), "cancelled": False}
        got = self.get(job_id)
        if isinstance(got, RemoteJob):
            return await self.submissions.cancel(got)
        return await self.scheduling.cancel(got)
