"""The submitter role of the job service: the jobs submitted here that the scheduler elsewhere
coordinates (`RemoteJob` records), from the forward to their end.

A submission goes to the elected scheduler (`JobSubmit` over the peer network, `forward`)
when this daemon is not the scheduler; without a scheduler (no quorum yet) it waits for one
(`SCHEDULER_WAIT_S`), then is refused. The scheduler streams `JobUpdate`s back (the status,
and every step record since the last update, each saying which record it follows: a gap is
asked for again with `JobQuery.through`) and sends the outputs (`JobOutput`), which this daemon
stores durably in its own store and acknowledges; a checkpoint becomes the one a failover
resumes from once the history holds every step before it. The job is done only once the model
and metrics.json are stored here; what could not be stored is fetched again (`JobFetch`, from
`fusionctl fetch ID`) from the scheduler holding it.

When the scheduler dies, gives the job back (it lost its lease) or no longer knows it, the job
is resubmitted under its id to the next scheduler, from the last checkpoint sent here
(`_failover`), up to `job.max_restarts` times; a scheduler that stays silent about a job is
asked (`JobQuery`, `_watch`) and fails it after `FAILOVER_WAIT_S`.

`Submissions` holds this role's records and tasks; `JobService` (fusiond/jobs/service.py)
routes it the submitter-side messages and keeps the step histories on disk; when this daemon
is the scheduler it hands jobs to the scheduler role (`Scheduling.submit`,
fusiond/jobs/scheduling.py). `SubmitterHost` names the little it needs from the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fusiond.errors import FusionError, LocalError
from fusiond.graph import state_to_bytes
from fusiond.jobs.history import StepHistory, metrics_summary
from fusiond.jobs.outputs import CHECKPOINT, METRICS, MODEL, OutputStore, is_output_name, reason
from fusiond.jobs.planning import JobRefused
from fusiond.jobs.records import FINAL, LOG_LINES, JobRecord, RemoteJob
from fusiond.jobs.submit import restore_job, resume_state
from fusiond.jobs.upload import Upload, encode_upload
from fusiond.jobs.worker import Leadership, LeadershipFn, SendFn
from fusiond.tasks import TaskSet, raise_if_cancelling
from fusiond.train.spec import JobSpec
from protocol.messages import (
    JobCancel,
    JobFetch,
    JobOutput,
    JobOutputAck,
    JobQuery,
    JobQueryReply,
    JobSubmit,
    JobSubmitReply,
    JobUpdate,
)

__all__ = ["NotScheduler", "RunHere", "Submissions", "SubmitterHost"]

if TYPE_CHECKING:  # the cluster's view type, for annotations only
    from fusiond.cluster import ClusterView

log = logging.getLogger("fusiond.jobs")

UPDATE_S = 0.5
"""How often the scheduler sends a remote submitter the job's status (`Scheduling._push`)."""
SUBMIT_TIMEOUT_S = 300.0
"""How long a forwarded submission waits for the scheduler's answer (planning a big model)."""
VIEW_RECHECK_S = 0.25
"""A wait for a scheduler wakes on every change of the cluster's view (`on_view`: at once,
where it polled every 0.1 s), and re-reads the view at least this often besides (a lease
that lapses without a change the cluster reports; a view handed in without a callback)."""
FORWARD_CHECK_S = 0.5
"""How often a submission forwarded to a scheduler checks that it is still the scheduler."""
FETCH_TIMEOUT_S = 600.0
"""How long `fusionctl fetch` waits for held outputs to be stored again."""
FAILOVER_WAIT_S = 120.0
"""How long a submitting daemon waits for a new scheduler after the old one died (or gave the
job back), and the longest it lets a scheduler stay silent about a job before failing it."""
SCHEDULER_WAIT_S = 30.0
"""How long a submission waits for the cluster to have a scheduler (an election after a start
or a failure) before it is refused: a daemon that is not the scheduler never coordinates."""
STALE_UPDATE_S = 20 * UPDATE_S
"""A remote job whose scheduler sent nothing about it (JobUpdate, JobOutput) for this long is
asked about (`JobQuery`, on the CONTROL lane: it does not wait behind outputs)."""
QUERY_TIMEOUT_S = 5.0
"""How long a `JobQuery` waits for its answer before it is asked again."""
RESEND_ASK_S = 1.0
"""A submitter asks its scheduler to send missing step records again at most this often."""


class NotScheduler(JobRefused):
    """This daemon is not (or no longer) the scheduler holding the lease: ask the next one."""


class RunHere(Protocol):
    """The scheduler role on this daemon (`Scheduling.submit`): plan (and unless `dry_run`,
    start) the job here; its summary, or `NotScheduler` unless this daemon holds the lease."""

    def __call__(self, upload: Upload, *, dry_run: bool = False,
                 owner_uid: int | None = None) -> Awaitable[dict[str, Any]]: ...


@dataclass(frozen=True)
class SubmitterHost:
    """What the submitter role needs from the job service, and nothing else."""

    run_here: RunHere
    """Run a job here, this daemon being the scheduler (a submission, or a failover)."""
    local_record: Callable[[str], JobRecord | None]
    """The record of a job coordinated here (a failover this daemon took runs as one)."""
    persist: Callable[[str], None]
    """Write the record of a job submitted here to the state dir."""
    steps_arrived: Callable[[str], None]
    """New step records of a job submitted here are to be written."""
    tracked: Callable[[str], None]
    """A forwarded job is followed from now on (its step records are kept on disk)."""
    ended: Callable[[str], None]
    """A job submitted here ended (its record, its step history, the store's pruning)."""


def adopt(r: RemoteJob, took: JobRecord) -> None:
    """This daemon became the scheduler of a job submitted here: its record keeps the steps
    done before the failover (the new attempt appends to them) and the outputs."""
    took.history = StepHistory([h for h in r.history if int(h["step"]) < took.first_step]
                               + list(took.history))
    took.submitted_at = r.submitted_at
    losses = [h.get("loss") for h in took.history if h.get("loss") is not None]
    took.first_loss = losses[0] if losses else took.first_loss


def resume_bytes(upload: Upload, checkpoint: Path) -> tuple[bytes, int]:
    """The upload's weights replaced by `checkpoint`'s (checked), and the step to start
    (blocking: run it in a thread)."""
    meta = upload.meta
    _, captured = restore_job(meta["toml"], meta["base"], meta["out_base"],
                              upload.graph_bytes, upload.state_bytes, check_paths=False)
    state, first = resume_state(captured, checkpoint)
    return state_to_bytes(state), first


def promote_checkpoint(r: RemoteJob) -> None:
    """A stored checkpoint after step s becomes the one a failover resumes from once the
    history holds every step up to s (else the resumed history would have a gap)."""
    if r.pending_checkpoint is None:
        return
    step, path = r.pending_checkpoint
    if r.history and int(r.history[-1]["step"]) >= step:
        r.checkpoint = path
        r.pending_checkpoint = None


async def view_change(changed: asyncio.Event, timeout_s: float) -> None:
    """Until the cluster's view changes (`changed` is the event read before the view was),
    or `timeout_s`."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(max(0.0, timeout_s)):
            await changed.wait()
    raise_if_cancelling()


class Submissions:
    """The jobs submitted here and coordinated elsewhere (one per daemon, owned by its
    `JobService`). `send` is the service's peer send, `view()` the cluster's view (None while
    not in a cluster), `leadership()` who schedules in it, `store` where the outputs of the
    jobs submitted here go; `host` the rest (`SubmitterHost`)."""

    def __init__(self, *, node_id: str, send: SendFn, view: Callable[[], ClusterView | None],
                 leadership: LeadershipFn, store: OutputStore, host: SubmitterHost) -> None:
        self.node_id = node_id
        self._send = send
        self._view = view
        self._leadership = leadership
        self._store = store
        self._host = host
        self.records: dict[str, RemoteJob] = {}
        """The jobs submitted here, coordinated by a scheduler elsewhere (or failing over)."""
        self._pending: dict[str, asyncio.Future[JobSubmitReply]] = {}
        self._acks: dict[str, asyncio.Future[JobOutputAck]] = {}
        self._tasks = TaskSet("submitter task")
        self._closing = False
        self._closed = False
        self._view_changed = asyncio.Event()
        """Set (and replaced) on every change of the cluster's view: what waits for a
        scheduler wakes on it instead of polling."""

    # -- service ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to start: its tasks come with the jobs."""

    async def ready(self) -> None:
        """Ready once started."""

    def closing(self) -> None:
        """The daemon is stopping: no job fails over from now on (a dead scheduler's job
        fails at once), while the service stops the jobs it coordinates."""
        self._closing = True

    async def close(self) -> None:
        """Cancel and await this role's tasks (failovers, watches, finishes). Idempotent."""
        self._closing = True
        if self._closed:
            return
        self._closed = True
        await self._tasks.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.spawn(coro, name)  # after close: closed unstarted

    # -- records ------------------------------------------------------------------------------

    def forget(self, job_id: str) -> None:
        """The job's record leaves this run's memory (the service keeps its past record)."""
        self.records.pop(job_id, None)

    def _ended(self, r: RemoteJob) -> None:
        r.ended.set()
        self._host.ended(r.job_id)

    # -- submit -------------------------------------------------------------------------------

    async def submit(self, upload: Upload, spec: JobSpec, *, dry_run: bool = False,
                     owner_uid: int | None = None) -> dict[str, Any]:
        """Hand a validated upload (`spec`: its job file, parsed) to the elected scheduler, or
        run it here when this daemon is the scheduler; with none yet, wait for one
        (`SCHEDULER_WAIT_S`). A forwarded job (unless `dry_run`) is followed from then on
        (`_watch`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SCHEDULER_WAIT_S
        while True:
            leader = await self.await_scheduler(deadline)
            try:
                if leader == self.node_id:
                    return await self._host.run_here(upload, dry_run=dry_run,
                                                     owner_uid=owner_uid)
                summary = await self.forward(upload, leader, dry_run=dry_run)
                break
            except NotScheduler:  # it stepped down meanwhile: ask the next one, once the
                if loop.time() >= deadline:  # view has changed (our view may still name it)
                    raise
                await view_change(self._view_changed,
                                  min(VIEW_RECHECK_S, deadline - loop.time()))
        if not dry_run:
            job_id = str(summary["job_id"])
            r = RemoteJob(job_id, leader, spec.output, {
                "job_id": job_id, "name": spec.name, "state": "running", "steps": spec.steps,
                "step": 0, "loss": None, "first_loss": None, "stages": len(summary["stages"]),
                "output": str(spec.output), "plan": summary["plan"], "history": [],
                "status": {}, "lines": [], "outcome": None, "eta_s": None,
                "submitted_at": time.time()},
                upload=upload, max_restarts=spec.max_restarts, owner_uid=owner_uid,
                term=int(summary.get("term") or 0))
            self.records[job_id] = r
            self._host.persist(job_id)
            self._host.tracked(job_id)
            self._spawn(self._watch(r), f"watch {job_id}")
        return summary

    async def await_scheduler(self, deadline: float, *, not_before: tuple[str, int] | None
                              = None) -> str:
        """The scheduler of the cluster once there is one (the view's leader; this daemon only
        with a quorum), waiting until `deadline` (loop time); `not_before`: (a scheduler, its
        term) that gave a job up: it counts again only in a newer term. `NotScheduler` with the
        cluster's own advice when none came."""
        loop = asyncio.get_running_loop()
        while True:
            changed = self._view_changed  # before reading the view: no change slips between
            view = self._view()
            if view is None:
                raise JobRefused("this daemon is not in a cluster: `fusionctl init` or `join` "
                                 "first")
            lead = Leadership.of(view)
            assert lead is not None
            ok = lead.leader is not None and (lead.leader != self.node_id or lead.has_quorum)
            if ok and not_before is not None and lead.leader == not_before[0] \
                    and lead.term <= not_before[1]:
                ok = False
            if ok and lead.leader is not None:
                return lead.leader
            if loop.time() >= deadline:
                advice = view.quorum_advice() or f"no scheduler elected (term {lead.term})"
                raise NotScheduler(
                    f"no scheduler: {advice}; waited {SCHEDULER_WAIT_S:g}s. A minority of the "
                    "cluster never schedules: `fusionctl status` shows who is alive")
            await view_change(changed, min(VIEW_RECHECK_S, deadline - loop.time()))

    async def forward(self, upload: Upload, leader: str, *, dry_run: bool) -> dict[str, Any]:
        """Hand `upload` to the scheduler `leader`; its summary, or `JobRefused`."""
        data = encode_upload(upload.meta, upload.graph_bytes, upload.state_bytes,
                             upload.data_bytes)
        rid = secrets.token_hex(8)
        fut: asyncio.Future[JobSubmitReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._send(leader, JobSubmit(request_id=rid, dry_run=dry_run), (data,))
            async with asyncio.timeout(SUBMIT_TIMEOUT_S):
                while not fut.done():
                    # Another scheduler elected meanwhile: this one can no longer take the job
                    # (it decides nothing more), and its answer may never come (the
                    # submission, or the answer, lost to a failed dial): the caller asks the
                    # new one. A failover stalled here for SUBMIT_TIMEOUT_S, then failed.
                    await asyncio.wait({fut}, timeout=FORWARD_CHECK_S)
                    lead = self._leadership()
                    if not fut.done() and lead is not None and lead.leader is not None \
                            and lead.leader != leader:
                        raise NotScheduler(f"the scheduler {leader} did not answer the "
                                           f"submission before {lead.leader} was elected")
                reply = fut.result()
        except TimeoutError:
            raise JobRefused(f"the scheduler {leader} did not answer the submission within "
                             f"{SUBMIT_TIMEOUT_S:g}s") from None
        finally:
            self._pending.pop(rid, None)
        if not reply.ok:
            cls = NotScheduler if reply.code == "not_scheduler" else JobRefused
            raise cls(f"{reply.message} (refused by the scheduler {leader})")
        summary = dict(reply.summary)
        summary["scheduler"] = leader
        return summary

    # -- failover -----------------------------------------------------------------------------

    def on_view(self, gone: Mapping[str, str]) -> None:
        """The cluster's view changed (`gone`: the members dead or left, with their state):
        whatever waits for a scheduler looks again, and a dead scheduler's jobs fail over."""
        changed, self._view_changed = self._view_changed, asyncio.Event()
        changed.set()
        for r in list(self.records.values()):
            if r.state in FINAL or r.scheduler not in gone or r.failing_over:
                continue
            why = (f"job failed on {r.scheduler} (the scheduler): the membership layer "
                   f"declared it {gone[r.scheduler]}")
            if r.upload is not None and r.restarts < r.max_restarts and not self._closing:
                r.failing_over = True
                self._spawn(self._failover(r, why), f"failover {r.job_id}")
                continue
            r.status = {**r.status, "state": "failed",
                        "outcome": {"ok": False, "failure": why}}
            self._ended(r)

    def take_back(self, r: RemoteJob, why: str) -> None:
        """A job submitted here, scheduled here until this daemon gave it up (`r`: its record,
        failing over): resubmit it to the next scheduler and follow it there."""
        self.records[r.job_id] = r
        self._spawn(self._failover(r, why), f"failover {r.job_id}")
        self._spawn(self._watch(r), f"watch {r.job_id}")

    def _start_failover(self, r: RemoteJob, why: str, *, same_term_ok: bool = False) -> None:
        """Fail `r` over to the next scheduler, or fail it when it has no restart left."""
        if r.failing_over or r.state in FINAL:
            return
        if r.upload is not None and r.restarts < r.max_restarts and not self._closing:
            r.failing_over = True
            self._spawn(self._failover(r, why, same_term_ok=same_term_ok),
                        f"failover {r.job_id}")
            return
        r.status = {**r.status, "state": "failed", "outcome": {
            "ok": False, "failure": f"{why}; no restart left (job.max_restarts = "
                                    f"{r.max_restarts})"}}
        self._ended(r)

    async def _failover(self, r: RemoteJob, why: str, *, same_term_ok: bool = False) -> None:
        """The scheduler of a job submitted here died, gave the job back or lost it: once a
        scheduler is elected (another one, or the same in a newer term, or with
        `same_term_ok` the same one: it lost the job), submit the job to it again under the
        same id, from the last checkpoint it sent here (or from the start), or run it here if
        this daemon is the scheduler. On any refusal the job ends failed with both reasons."""
        assert r.upload is not None
        lines = r.notes
        lines += list(r.status.get("lines", []))  # the dead scheduler's, before they are gone
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        lines.append(f"{stamp} {why}; waiting for a new scheduler to resubmit the job")
        log.warning("job %s: %s; resubmitting once a new scheduler is elected", r.job_id, why)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FAILOVER_WAIT_S
        try:
            leader = await self.await_scheduler(
                deadline, not_before=None if same_term_ok else (r.scheduler, r.term))
            if r.state in FINAL:  # cancelled meanwhile
                return
            view = self._view()
            alive = sum(1 for m in view.members if m.state == "alive") if view is not None \
                else 1
            meta = {**r.upload.meta, "job_id": r.job_id, "restarts": r.restarts + 1}
            state_bytes = r.upload.state_bytes
            if r.checkpoint is not None:
                state_bytes, first = await asyncio.to_thread(resume_bytes, r.upload,
                                                             r.checkpoint)
                meta["first_step"] = first
            if isinstance(meta.get("stages"), int):
                meta["stages"] = max(1, min(meta["stages"], alive))
                if isinstance(meta.get("replicas"), int):
                    meta["replicas"] = max(1, min(meta["replicas"], alive // meta["stages"]))
            start = int(meta.get("first_step") or 0)
            # Where the resubmission starts: a checkpoint sent here, else where the job itself
            # started (a job submitted with --resume starts past step 0).
            whence = (f" from {r.checkpoint.name} (step {start})" if r.checkpoint is not None
                      else f" from step {start}, where it started (no checkpoint came yet)")
            upload = Upload(meta, r.upload.graph_bytes, state_bytes, r.upload.data_bytes)
            while True:
                try:
                    if leader == self.node_id:
                        summary = await self._host.run_here(upload, owner_uid=r.owner_uid)
                        self.records.pop(r.job_id, None)  # `get` finds the local record
                        took = self._host.local_record(r.job_id)
                        assert took is not None
                        took.upload = upload
                        adopt(r, took)
                        lines.append(f"{time.strftime('%H:%M:%S', time.gmtime())} this daemon "
                                     f"is the new scheduler: it runs the job{whence}")
                        took.logs = deque([*lines, *took.logs], maxlen=LOG_LINES)
                    else:
                        summary = await self.forward(upload, leader, dry_run=False)
                    break
                except NotScheduler:  # it stepped down meanwhile: the next one, in time
                    if loop.time() >= deadline:
                        raise
                    await view_change(self._view_changed,
                                      min(VIEW_RECHECK_S, deadline - loop.time()))
                    leader = await self.await_scheduler(deadline)
        except asyncio.CancelledError:
            raise
        except (FusionError, TimeoutError, OSError, ValueError) as e:
            cause = (f"no new scheduler within {FAILOVER_WAIT_S:g}s: {e}"
                     if isinstance(e, NotScheduler) else str(e))
            r.status = {**r.status, "state": "failed", "outcome": {
                "ok": False, "failure": f"{why}; resubmitting failed: {cause}"}}
            self._ended(r)
            return
        if r.state in FINAL:  # cancelled while it was being resubmitted: stop it there too
            rec = self._host.local_record(r.job_id)
            if rec is not None:
                rec.cancel_requested = True
                await rec.coord.cancel()
            else:
                await self._send(leader, JobCancel(job_id=r.job_id, reason="cancelled by the "
                                                   f"user on {self.node_id}"), ())
            return
        r.restarts += 1
        r.failing_over = False
        r.heard = time.monotonic()
        r.term = int(summary.get("term") or 0)
        if leader != self.node_id:
            r.scheduler = leader
            r.stream_through = -1  # its records are a new stream
            lines.append(f"{time.strftime('%H:%M:%S', time.gmtime())} resubmitted to the new "
                         f"scheduler {leader}{whence}")
            r.status = {**r.status, "lines": [], "stages": len(summary["stages"])}
        log.info("job %s resubmitted to %s", r.job_id, leader)

    # -- following the job --------------------------------------------------------------------

    def on_submit_reply(self, peer: str, msg: JobSubmitReply) -> None:
        fut = self._pending.get(msg.request_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def on_output_ack(self, peer: str, msg: JobOutputAck) -> bool:
        """The answer to a `JobFetch` sent from here; False if it answers none."""
        ack = self._acks.get(msg.request_id)
        if ack is None:
            return False
        if not ack.done():
            ack.set_result(msg)
        return True

    def on_query_reply(self, peer: str, msg: JobQueryReply) -> None:
        r = self.records.get(msg.job_id)
        if r is not None and peer == r.scheduler and r.query is not None \
                and not r.query.done():
            r.query.set_result(msg)

    def _heard(self, peer: str, job_id: str) -> None:
        r = self.records.get(job_id)
        if r is not None and peer == r.scheduler:
            r.heard = time.monotonic()

    def on_update(self, peer: str, msg: JobUpdate) -> None:
        """The scheduler's status of a job submitted here, and the step records since its
        last update (appended to this daemon's own history: it outlives schedulers)."""
        r = self.records.get(msg.job_id)
        if r is None or peer != r.scheduler or r.state in FINAL or r.finishing \
                or r.failing_over:
            return
        r.heard = time.monotonic()
        if msg.after > r.stream_through:
            # An update before this one was lost: its records are not ours yet, and neither
            # is this one's status (a final one must not end the job with steps missing).
            self._ask_resend(r, f"its updates after step {r.stream_through} are missing "
                                f"(this one follows step {msg.after})")
            return
        for rec in msg.steps:
            try:
                r.history.add(rec)
                r.stream_through = int(rec["step"])
            except ValueError as e:
                log.warning("job %s: step record from %s skipped: %s", r.job_id, peer, e)
        promote_checkpoint(r)
        if msg.steps:
            self._host.steps_arrived(r.job_id)
        if msg.handed_back:  # the scheduler lost its lease and gave the job up
            r.status = {**dict(msg.status), "state": "running"}
            self._start_failover(r, f"the scheduler {peer} gave the job up: {msg.handed_back}")
            return
        if not msg.status:
            return  # steps only (the status follows in the last of a batch)
        status = dict(msg.status)
        if str(status.get("state", "running")) in FINAL:
            r.finishing = True  # running until metrics.json is stored (`_finish`)
            r.status = {**status, "state": "running"}
            self._spawn(self._finish(r, status), f"finish {r.job_id}")
            return
        r.status = status

    def _ask_resend(self, r: RemoteJob, why: str) -> None:
        """Ask `r`'s scheduler for its step records after the last one taken, and the status
        (`JobQuery.through`; at most once every `RESEND_ASK_S`)."""
        now = time.monotonic()
        if now - r.resend_asked < RESEND_ASK_S:
            return
        r.resend_asked = now
        log.info("job %s: asking the scheduler %s to send again: %s", r.job_id, r.scheduler, why)

        async def ask() -> None:
            with contextlib.suppress(LocalError, OSError, TimeoutError):
                async with asyncio.timeout(QUERY_TIMEOUT_S):
                    await self._send(r.scheduler, JobQuery(job_id=r.job_id,
                                                           through=r.stream_through), ())

        self._spawn(ask(), f"resend {r.job_id}")

    async def on_output(self, peer: str, msg: JobOutput) -> None:
        """An output of a job submitted here, from its scheduler: store it durably in this
        daemon's output store and, when asked, acknowledge (the scheduler keeps the weights
        until then)."""
        self._heard(peer, msg.job_id)
        r = self.records.get(msg.job_id)
        name = msg.name
        if r is None or peer not in (r.scheduler, r.held_by):
            return
        ok, why = False, ""
        if not is_output_name(name) or name == METRICS:
            why = f"output name {name!r} refused"
            log.warning("job %s: %s (from %s)", msg.job_id, why, peer)
        else:
            try:
                await asyncio.to_thread(self._store.put_bytes, r.job_id, name, msg.payload)
                ok = True
            except (OSError, LocalError) as e:
                why = reason(e)
        if ok:
            r.unstored.pop(name, None)
            m = CHECKPOINT.fullmatch(name)
            if m:
                r.pending_checkpoint = (int(m.group(1)) - 1,
                                        self._store.job_dir(r.job_id) / name)
                promote_checkpoint(r)
        else:
            r.unstored[name] = why
            r.note(f"{name} not stored in {self._store.job_dir(r.job_id)}: {why}")
        if msg.request_id:
            await self._send(peer, JobOutputAck(job_id=r.job_id, request_id=msg.request_id,
                                                ok=ok, message=why), ())

    async def _finish(self, r: RemoteJob, status: dict[str, Any]) -> None:
        """The scheduler's final update: store metrics.json from this daemon's full history;
        the job is done only if the model and the metrics are stored here."""
        state = str(status["state"])
        outcome = dict(status.get("outcome") or {})
        held = outcome.get("held_by")
        if isinstance(held, str) and held:  # the scheduler kept the weights it could not ship
            r.held_by = held
            r.storage_failed = True
            r.unstored.setdefault(MODEL, "not stored")
        if state == "done" and MODEL not in {f.name for f in await asyncio.to_thread(
                self._store.files, r.job_id)}:
            why = r.unstored.get(MODEL, "it never arrived")
            r.unstored[MODEL] = why
            state = "failed"
            r.storage_failed = True
            outcome = {**outcome, "ok": False, "failure": (
                f"the model could not be stored on this machine ({why})")}
        try:
            await asyncio.to_thread(self._store.put_metrics, r.job_id, list(r.history),
                                    metrics_summary(r.history, outcome, r.submitted_at))
            r.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            r.unstored[METRICS] = reason(e)
            r.note(f"metrics.json not stored in {self._store.job_dir(r.job_id)}: {reason(e)}")
            if state == "done":
                state = "failed"
                r.storage_failed = True
                outcome = {**outcome, "ok": False, "failure": (
                    f"metrics.json could not be stored on this machine ({reason(e)}); the "
                    f"step history is kept: free space, then `fusionctl fetch {r.job_id}`")}
        r.status = {**status, "state": state, "outcome": outcome}
        if state == "failed" and outcome.get("failure"):
            r.note(f"failed: {outcome['failure']}")
        r.finishing = False
        self._ended(r)

    async def _watch(self, r: RemoteJob) -> None:
        """While `r` runs elsewhere: if its scheduler says nothing about it for
        `STALE_UPDATE_S`, ask (`JobQuery`); a scheduler that no longer knows the job (it
        restarted, or lost it) gets it failed over, and one that stays silent for
        `FAILOVER_WAIT_S` fails it, naming the scheduler. Within the failover bound either way."""
        while r.state not in FINAL and not self._closing and self.records.get(r.job_id) is r:
            await asyncio.sleep(min(1.0, STALE_UPDATE_S / 4))
            if r.failing_over or r.state in FINAL or r.scheduler == self.node_id:
                continue
            silent = time.monotonic() - r.heard
            if silent < STALE_UPDATE_S:
                continue
            reply = await self._query(r)
            if r.failing_over or r.state in FINAL:
                continue
            if reply is not None and reply.known and reply.state == "running":
                r.heard = time.monotonic()  # alive and running: its updates are delayed
                continue
            if reply is not None and (not reply.known or reply.state == "handed_back"):
                why = (f"the scheduler {r.scheduler} no longer knows the job (restarted, or "
                       "lost it)" if not reply.known else
                       f"the scheduler {r.scheduler} gave the job up")
                log.warning("job %s: %s", r.job_id, why)
                self._start_failover(r, why, same_term_ok=not reply.known)
                continue
            if silent >= FAILOVER_WAIT_S:
                ended = "" if reply is None else f" (it says the job is {reply.state})"
                r.status = {**r.status, "state": "failed", "outcome": {
                    "ok": False, "failure": f"the scheduler {r.scheduler} sent nothing about "
                    f"the job for {silent:.0f}s{ended} and "
                    + ("does not answer status queries" if reply is None else
                       "its final update never came")}}
                self._ended(r)

    async def _query(self, r: RemoteJob) -> JobQueryReply | None:
        """Ask `r`'s scheduler about the job; its answer, or None within `QUERY_TIMEOUT_S`."""
        fut: asyncio.Future[JobQueryReply] = asyncio.get_running_loop().create_future()
        r.query = fut
        try:
            async with asyncio.timeout(QUERY_TIMEOUT_S):
                # (through: what it sent that did not come, the final update included, comes
                # again)
                await self._send(r.scheduler, JobQuery(job_id=r.job_id,
                                                       through=r.stream_through), ())
                return await fut
        except (LocalError, OSError, TimeoutError) as e:
            log.info("job %s: no answer from the scheduler %s: %s", r.job_id, r.scheduler, e)
            return None
        finally:
            r.query = None

    # -- the API's commands on a forwarded job ------------------------------------------------

    async def cancel(self, r: RemoteJob) -> dict[str, Any]:
        """`fusionctl cancel ID` of a forwarded job: ask its scheduler (or, failing over,
        end it here)."""
        job_id = r.job_id
        if r.state in FINAL:
            return {"job_id": job_id, "state": r.state, "cancelled": False}
        if r.failing_over:  # no scheduler has it now: it is not resubmitted
            r.status = {**r.status, "state": "cancelled", "outcome": {
                "ok": False, "failure": f"cancelled by the user on {self.node_id} while "
                                        "failing over"}}
            self._ended(r)
            return {"job_id": job_id, "state": "cancelled", "cancelled": True}
        await self._send(r.scheduler, JobCancel(job_id=job_id, reason="cancelled by the "
                                                f"user on {self.node_id}"), ())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(r.ended.wait(), 20.0)
        return {"job_id": job_id, "state": r.state, "cancelled": r.state == "cancelled"}

    async def fetch(self, r: RemoteJob) -> None:
        """Ask the scheduler holding the model again (`JobFetch`), then store metrics.json;
        `LocalError` saying why when it still cannot."""
        if MODEL in r.unstored:
            holder = r.held_by or r.scheduler
            rid = secrets.token_hex(8)
            fut: asyncio.Future[JobOutputAck] = asyncio.get_running_loop().create_future()
            self._acks[rid] = fut
            try:
                await self._send(holder, JobFetch(job_id=r.job_id, request_id=rid), ())
                async with asyncio.timeout(FETCH_TIMEOUT_S):
                    ack = await fut
            except (LocalError, OSError) as e:
                raise LocalError(f"the scheduler {holder} holding the model of job {r.job_id} "
                                 f"cannot be reached: {reason(e)}") from None
            except TimeoutError:
                raise LocalError(f"the scheduler {holder} did not send the model of job "
                                 f"{r.job_id} within {FETCH_TIMEOUT_S:g}s") from None
            finally:
                self._acks.pop(rid, None)
            if not ack.ok:
                raise LocalError(f"the model of job {r.job_id} is still not stored: "
                                 f"{ack.message}")
            r.note(f"the model is stored now (fetched again from {holder})")
        outcome = dict(r.status.get("outcome") or {})
        if r.storage_failed:
            outcome |= {"ok": True, "failure": None, "held_by": None}
        try:
            await asyncio.to_thread(self._store.put_metrics, r.job_id, list(r.history),
                                    metrics_summary(r.history, outcome, r.submitted_at))
            r.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            r.unstored[METRICS] = reason(e)
            raise LocalError(f"metrics.json of job {r.job_id} is still not stored in "
                             f"{self._store.job_dir(r.job_id)}: {reason(e)}") from None
        r.unstored.pop(MODEL, None)
        r.held_by = None
        if r.storage_failed:
            r.storage_failed = False
            r.status = {**r.status, "state": "done", "outcome": {
                **outcome, "ok": True, "failure": None, "held_by": None}}
        self._host.persist(r.job_id)
