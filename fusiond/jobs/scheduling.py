"""The scheduler role of the job service: the jobs this daemon coordinates (`JobRecord`s),
submitted here or forwarded by another daemon, from the plan to their end.

As the scheduler (the view's leader is this daemon, with a quorum: `_not_leading`), it takes a
job to run here (`submit`): restores it (IR + weights, validated again), refuses it if the
cluster's memory cannot hold it (`check_capacity`), plans it on the live cluster view
(`plan_job`: the members' gossiped profiles and the measured link matrix) or cuts it over a
requested number of machines (`_layout`), and runs a `JobCoordinator` for each attempt
(`_run_attempts`). A failed attempt is planned again on the machines left, from the last
checkpoint (`_restart`; `fusiond.jobs.runner` decides whether and without whom), and a planned
job's AdaTopK densities follow the measured links (`_readapt`).

A job forwarded by another daemon (its submitter) gets its status and every step record since
the last update streamed back (`JobUpdate`, `_push`), its checkpoints and model sent
(`JobOutput`, acknowledged by `JobOutputAck`); weights the submitter could not store stay
here, in memory (`_hold`), until it asks again (`JobFetch`). A job submitted here has its
outputs stored in this daemon's own store (`_store_outputs`). A scheduler that loses its lease
stops at once: each attempt is cancelled and its job handed back (`_hand_back`) to its
submitter, or to this daemon's own failover (`Submissions.take_back`).

`Scheduling` holds this role's records and tasks; `JobService` (fusiond/jobs/service.py) routes
it the scheduler-side messages, offers the others to its running coordinators, keeps the step
histories and records on disk and answers the API (`SchedulerHost` names the little it needs
from the service).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fusiond.errors import FusionError, LocalError
from fusiond.graph import CapturedModel, contiguous_assignment, state_from_bytes, state_to_bytes
from fusiond.jobs.assign import Corpus, JobLayout, layout_job
from fusiond.jobs.coordinator import JobCoordinator, JobOutcome
from fusiond.jobs.history import finite_records, metrics_summary
from fusiond.jobs.metrics import JobStats
from fusiond.jobs.opsets import (
    MemberOpSets,
    OpSetService,
    refuse_stages,
    refuse_unrunnable,
    software_line,
)
from fusiond.jobs.outputs import METRICS, MODEL, OutputStore, checkpoint_name, reason
from fusiond.jobs.planning import (
    JobRefused,
    cluster_for_planner,
    layout_codecs,
    layout_from_plan,
    plan_job,
    readapted_codecs,
    readapted_densities,
    reserve_for_scheduler,
    scheduler_reserve_bytes,
)
from fusiond.jobs.records import FINAL, JobRecord, RemoteJob, steps_done
from fusiond.jobs.runner import decide_restart, derived_timeouts, released_exclusions
from fusiond.jobs.submission import UPDATE_S, NotScheduler
from fusiond.jobs.submit import (
    check_capacity,
    check_finite,
    is_default_corpus,
    memory_estimate,
    restore_job,
)
from fusiond.jobs.upload import Upload, decode_upload
from fusiond.jobs.worker import LeadershipFn, SendFn
from fusiond.plan import Cluster, Plan
from fusiond.plan.render import plan_summary, render_plan
from fusiond.tasks import TaskSet
from fusiond.train.data import DataError, check_arrays
from fusiond.train.local import StepMetrics
from fusiond.train.spec import JobSpec
from protocol.messages import (
    Address,
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

__all__ = ["MAX_UPDATE_STEPS", "SchedulerHost", "Scheduling", "checked_data", "member_ops"]

if TYPE_CHECKING:  # the cluster's view type, for annotations only
    from fusiond.cluster import ClusterView

log = logging.getLogger("fusiond.jobs")

MAX_UPDATE_STEPS = 500
"""Step records one `JobUpdate` carries at most (more follow in further updates)."""
MAX_UPDATE_STEP_BYTES = 4 << 20
"""About this much JSON of step records at most in one `JobUpdate` (its header is bounded)."""
MAX_HELD_JOBS = 4
"""Jobs whose final weights this daemon holds in memory because they could not be stored
(a full disk); the oldest is dropped, with a log line, to hold a newer one."""
REMOTE_SEND_S = 10.0
"""Bound on one status update to a remote submitter."""
REMOTE_OUTPUTS_S = 600.0
"""Bound on sending a job's outputs back to its submitter."""
PLAN_EPOCH = 1024
"""A job's first plan version at a scheduler is `term * PLAN_EPOCH + 1`, and each restart adds
one (`max_restarts` <= 100): versions grow across restarts and across schedulers, so a stage's
newer Assign supersedes a stale one and stale tensors are told apart by version alone."""
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}-[0-9a-f]{6}")


def _incarnation(view: ClusterView | None, node_id: str) -> int | None:
    """`node_id`'s incarnation in `view` (None: not a member, or no view)."""
    for m in view.members if view is not None else ():
        if m.node_id == node_id:
            return m.incarnation
    return None


def _corpus(upload: Upload) -> Corpus | None:
    """The data the submitter read (`corpus_for_upload`, in fusionctl), or None for a job
    without data to read (synthetic images; `checked_data` refused a job lacking its data)."""
    digest = upload.meta.get("data_digest")
    if not isinstance(digest, str) or not digest:
        return None
    arrays = None
    if upload.data_bytes:
        try:
            tensors = state_from_bytes(upload.data_bytes)
        except Exception as e:
            raise JobRefused(f"the upload's data section is not a safetensors file: {e}") \
                from None
        try:
            check_arrays({k: v.numpy() for k, v in tensors.items()}, "the upload's data section")
        except DataError as e:
            raise JobRefused(str(e)) from None
        if not tensors:
            raise JobRefused("the upload's data section holds no arrays")
        arrays = tensors
    default = upload.meta.get("data_default") is True and arrays is None
    if not default and arrays is None:
        raise JobRefused("the upload names a corpus but does not carry it (no data section): "
                         "submit with `fusionctl submit`, which reads the data as you")
    return Corpus(digest, default, arrays=arrays)


def checked_data(upload: Upload, spec: JobSpec) -> Upload:
    """The upload with its data accounted for, or `JobRefused`. The daemon never reads a
    job's `data.path` (nor its tokenizer file) on a user's behalf: `fusionctl` reads the data
    as the user and sends it (the upload's data section). Only the default corpus (this
    Python's own standard library, the same public files on every machine) is read by each
    data stage itself and checked against the submitter's hash; synthetic images need none."""
    meta = upload.meta
    if spec.data.kind == "images":
        if upload.data_bytes:
            raise JobRefused("the upload carries data, but the job's images are synthetic")
        return upload
    default = is_default_corpus(spec)
    if "data_digest" not in meta:
        what = ("the default corpus" if default else f"data.path {spec.data.path}")
        raise JobRefused(
            f"this upload has no data section (nor the hash of {what}): the daemon never reads "
            "a path on a user's behalf; submit with `fusionctl submit` (or `fusionctl "
            "plan`), which reads the data as you and sends it")
    if not isinstance(meta.get("data_digest"), str) or not meta["data_digest"]:
        raise JobRefused("the upload's data_digest is empty: submit with `fusionctl submit`")
    if default != (meta.get("data_default") is True):
        raise JobRefused("the upload's data_default flag does not match its data.path (only "
                         "the default corpus, the standard library, is read by the stages)")
    if not default and not upload.data_bytes:
        raise JobRefused(f"this upload has no data section for data.path {spec.data.path}: "
                         "submit with `fusionctl submit`, which reads the data as you")
    if default and upload.data_bytes:
        raise JobRefused("the upload ships a corpus for the default data (the standard "
                         "library): leave it out, every stage reads its own")
    return upload


def _wire(steps: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Step records as msgpack-safe maps (str keys, non-finite floats as null)."""
    return [json.loads(json.dumps(r, default=str, allow_nan=False))
            for r in finite_records(steps)]


def _safetensors_bytes(state: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str]) -> bytes:
    """A state dict as safetensors bytes (tied entries as separate copies)."""
    import safetensors.torch

    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    return bytes(safetensors.torch.save(tensors, metadata=dict(metadata)))


def _stages_table(layout: JobLayout, densities: Mapping[str, float]) -> str:
    lines = [f"{'stage':>5}  {'machine':<40}{'ops':>6}  {'params':>10}  device"]
    for s in layout.stages:
        lines.append(f"{s.stage:>5}  {s.node_id:<40}{len(s.partition.node_ids):>6}  "
                     f"{len(s.partition.param_names):>10}  "
                     f"{layout.devices.get(s.node_id, 'cpu')}")
        route = layout.routes.get(s.stage, ())
        for r, node in enumerate(layout.replicas.get(s.stage, ()), start=1):
            lines.append(f"{'+':>5}  {node:<40}{'':>6}  {'':>10}  "
                         f"{layout.devices.get(node, 'cpu')}  replica: "
                         f"{route.count(r)} of {len(route)} micro-batches")
    if densities:
        lines.append("top-k edges: " + ", ".join(f"{e} {d:g}" for e, d in densities.items()))
    if layout.encodings:
        lines.append("quantized edges: " + ", ".join(f"{e} {v}" for e, v in
                                                     sorted(layout.encodings.items())))
    return "\n".join(lines)


@dataclass(frozen=True)
class SchedulerHost:
    """What the scheduler role needs from the job service, and nothing else."""

    job_view: Callable[[str, int], dict[str, Any]]
    """What `fusionctl job ID` shows of a job (with its newest `history` step records): the
    status a submitter is sent."""
    persist: Callable[[str], None]
    """Write the record of a job submitted (or coordinated) here to the state dir."""
    steps_arrived: Callable[[str], None]
    """New step records of a job are to be written."""
    tracked: Callable[[str], None]
    """A job submitted here runs here: its step records are kept on disk from now on."""
    ended: Callable[[str], None]
    """A job submitted here and coordinated here ended: retire its record once its steps are
    saved, and prune the store."""
    take_back: Callable[[RemoteJob, str], None]
    """A job submitted here that this daemon, its scheduler, gave up: the submitter role fails
    it over to the next scheduler (`Submissions.take_back`)."""


async def member_ops(op_sets: OpSetService | None, view: Any) -> MemberOpSets:
    """The alive members' op sets (fetching the lists of digests not seen before; none known
    without an `OpSetService`: every member counts as running every op)."""
    if op_sets is None:
        return MemberOpSets()
    return await op_sets.resolve(view)


class Scheduling:
    """The jobs coordinated here (one per daemon, owned by its `JobService`). `send` is the
    service's peer send, `view()` the cluster's view (None while not in a cluster),
    `leadership()` who schedules in it, `store` where the outputs of the jobs submitted here
    go, `op_sets` the members' op sets; `ready_timeout_s` and `failure_grace_s` bound each
    attempt's coordinator; `host` the rest (`SchedulerHost`)."""

    def __init__(self, *, node_id: str, send: SendFn, view: Callable[[], ClusterView | None],
                 leadership: LeadershipFn, store: OutputStore, op_sets: OpSetService | None,
                 ready_timeout_s: float, failure_grace_s: float, host: SchedulerHost) -> None:
        self.node_id = node_id
        self._send = send
        self._view = view
        self._leadership = leadership
        self._store = store
        self._op_sets = op_sets
        self.ready_timeout_s = ready_timeout_s
        self.failure_grace_s = failure_grace_s
        self._host = host
        self.records: dict[str, JobRecord] = {}
        self.stats = JobStats()
        """Outcomes, restarts and step times of the jobs coordinated here (/metrics)."""
        """The jobs coordinated here (submitted here, or for another daemon)."""
        self._acks: dict[str, asyncio.Future[JobOutputAck]] = {}
        self._tasks = TaskSet("job task")
        self._closing = False
        """Set when close begins: no attempt restarts, and no ended job is retired."""
        self._closed = False
        """Set once the coordinators had their time to stop: nothing more is spawned."""

    # -- service ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Nothing to start: its tasks come with the jobs."""

    async def ready(self) -> None:
        """Ready once started."""

    async def close(self) -> None:
        """Stop the jobs coordinated here (their stages get JobCancel): one submitted here is
        cancelled, another daemon's goes back to it for the next scheduler (a hand-back); the
        attempts get 10 s to end, then they and this role's tasks are cancelled and awaited.
        Idempotent."""
        if self._closing:
            return
        self._closing = True
        for rec in list(self.records.values()):
            if rec.task is not None and not rec.task.done():
                if rec.submitter:
                    # Not ours to cancel: a scheduler's clean stop (a restart, an upgrade)
                    # used to end its submitters' jobs `cancelled` (the chaos check).
                    why = f"the scheduler {self.node_id} is stopping"
                    rec.handed_back = rec.handed_back or why
                    rec.log(f"{why}: the job goes back to its submitter {rec.submitter} for "
                            "the next scheduler")
                    await rec.coord.cancel(why)
                else:
                    rec.cancel_requested = True
                    await rec.coord.cancel("the submitting daemon is stopping")
        tasks = [r.task for r in self.records.values() if r.task is not None
                 and not r.task.done()]
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10.0)
        self._closed = True
        await self._tasks.close(*tasks)

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        self._tasks.spawn(coro, name)  # after close: closed unstarted

    def coordinators(self) -> Iterable[JobCoordinator]:
        """Running coordinators (the Prometheus JobCollector reads these; the service offers
        them the messages of their attempts)."""
        return [r.coord for r in self.records.values() if r.state == "running"]

    async def member_ops(self, view: Any) -> MemberOpSets:
        """The alive members' op sets (`member_ops`)."""
        return await member_ops(self._op_sets, view)

    # -- messages from submitters -------------------------------------------------------------

    def on_submit(self, peer: str, msg: JobSubmit) -> None:
        """A submission forwarded by `peer`: planned and started, and answered, off the
        dispatch."""
        self._spawn(self._on_remote_submit(peer, msg), f"submit from {peer}")

    def on_output_ack(self, peer: str, msg: JobOutputAck) -> bool:
        """The submitter's ack of a model shipped from here; False if it answers none."""
        ack = self._acks.get(msg.request_id)
        if ack is None:
            return False
        if not ack.done():
            ack.set_result(msg)
        return True

    async def on_fetch(self, peer: str, msg: JobFetch) -> None:
        """The submitter asks again for the weights it could not store."""
        rec = self.records.get(msg.job_id)
        if rec is not None and rec.submitter and peer == rec.submitter:
            self._spawn(self._resend_held(rec, msg.request_id), f"resend {msg.job_id}")
        else:
            await self._send(peer, JobOutputAck(
                job_id=msg.job_id, request_id=msg.request_id, ok=False,
                message=f"{self.node_id} coordinates no job {msg.job_id} for {peer}"), ())

    def on_query(self, peer: str, msg: JobQuery) -> None:
        """A submitter asks about a job (and for what it missed)."""
        self._spawn(self._answer_query(peer, msg), f"query {msg.job_id}")

    def on_cancel(self, peer: str, msg: JobCancel) -> bool:
        """The submitter's cancel; False for any other JobCancel (a stage's: the worker's)."""
        rec = self.records.get(msg.job_id)
        if rec is not None and rec.submitter and peer == rec.submitter:
            self._spawn(self._cancel_by_id(msg.job_id), f"cancel {msg.job_id}")
            return True
        return False

    async def _cancel_by_id(self, job_id: str) -> None:
        rec = self.records.get(job_id)
        if rec is not None:
            await self.cancel(rec)

    # -- the API's commands on a job coordinated here -----------------------------------------

    async def cancel(self, r: JobRecord) -> dict[str, Any]:
        """`fusionctl cancel ID` (or its submitter's `JobCancel`): stop every stage, and wait
        (15 s at most) for the job to end."""
        job_id = r.job_id
        if r.state != "running":
            return {"job_id": job_id, "state": r.state, "cancelled": False}
        r.cancel_requested = True
        r.log("cancel requested")
        await r.coord.cancel()
        if r.task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(r.task), 15.0)
        return {"job_id": job_id, "state": r.state, "cancelled": True}

    async def fetch(self, got: JobRecord) -> None:
        """`fusionctl fetch ID` of a job submitted here and coordinated here: store again what
        could not be stored (the held weights, metrics.json from its history); `LocalError`
        saying why when it still cannot."""
        if got.submitter or not got.unstored or got.state not in FINAL:
            return
        summary = {**(got.outcome or {})}
        if got.storage_failed:
            summary |= {"ok": True, "failure": None, "held_by": None}
        why = await self._store_outputs(got, summary, got.held)
        if why is not None:
            raise LocalError(why)
        if got.storage_failed:
            got.storage_failed = False
            got.state = "done"
            got.outcome = {**(got.outcome or {}), "ok": True, "failure": None,
                           "held_by": None}
        got.log("the outputs are stored now (fusionctl fetch)")
        self._host.persist(got.job_id)

    # -- leadership ---------------------------------------------------------------------------

    def _not_leading(self) -> str | None:
        """Why this daemon may not schedule now; None while it holds the scheduler's lease
        (its view's leader is itself, with a quorum). Checked before every planning decision:
        a minority never schedules."""
        lead = self._leadership()
        if lead is None:
            return "this daemon is not in a cluster"
        if lead.leader != self.node_id:
            return (f"this daemon is not the scheduler (term {lead.term}, the scheduler is "
                    f"{lead.leader or 'none: no quorum or an election under way'})")
        if not lead.has_quorum:
            return f"this daemon lost its quorum (term {lead.term})"
        return None

    def _hand_back(self, rec: JobRecord, why: str) -> None:
        """Stop scheduling `rec` at once (this daemon lost the lease): cancel its attempt (the
        stages are told to stop) and, once it has ended, give the job back to its submitter
        (`_handed_back`), which resubmits it to the next scheduler."""
        if rec.handed_back or rec.state != "running":
            return
        rec.handed_back = why
        rec.log(f"{why}: this daemon stops scheduling the job; its attempt is cancelled and "
                "the job goes back to "
                + (f"its submitter {rec.submitter}" if rec.submitter else "this daemon's "
                   "failover") + " for the next scheduler")
        self._spawn(rec.coord.cancel(f"the scheduler {self.node_id} stepped down: {why}"),
                    f"hand back {rec.job_id}")

    async def _handed_back(self, rec: JobRecord) -> None:
        """`rec`'s attempt ended after `_hand_back`: tell the submitter (it fails the job over),
        or, when the job was submitted here, fail it over from here."""
        rec.state = "handed_back"
        rec.outcome = {"ok": False, "failure": f"handed back: {rec.handed_back}",
                       "restarts": rec.restarts}
        if rec.submitter:
            st = json.loads(json.dumps(self._host.job_view(rec.job_id, 1), default=str))
            st["lines"] = list(rec.logs)
            try:
                async with asyncio.timeout(REMOTE_SEND_S):
                    await self._send(rec.submitter, JobUpdate(job_id=rec.job_id, status=st,
                                                              handed_back=rec.handed_back), ())
            except (LocalError, OSError, TimeoutError) as e:  # it asks, or sees us gone
                log.info("job %s: hand-back to %s not sent: %s", rec.job_id, rec.submitter, e)
            return
        if rec.upload is None:
            return
        upload = rec.upload
        if rec.checkpoint is not None and rec.coord.captured is not None:  # resume there
            step, ckpt = rec.checkpoint
            state = {k: ckpt.get(k, v) for k, v in rec.coord.captured.state.items()}
            blob = await asyncio.to_thread(state_to_bytes, state)
            upload = Upload({**upload.meta, "first_step": step + 1}, upload.graph_bytes, blob,
                            upload.data_bytes)
        status = json.loads(json.dumps(self._host.job_view(rec.job_id, 1), default=str))
        # The step history and the stored outputs stay this daemon's: the next scheduler's
        # attempt redoes the steps after the checkpoint and they replace the ones recorded.
        r = RemoteJob(rec.job_id, self.node_id, rec.spec.output, {**status, "state": "running"},
                    upload=upload, max_restarts=rec.spec.max_restarts, restarts=rec.restarts,
                    term=rec.term, failing_over=True, notes=list(rec.logs),
                    owner_uid=rec.owner_uid, history=rec.history,
                    unstored=dict(rec.unstored), submitted_at=rec.submitted_at)
        self.records.pop(rec.job_id, None)
        self._host.take_back(r, f"this daemon, its scheduler, gave the job up: "
                                      f"{rec.handed_back}")

    def on_view(self, gone: Mapping[str, str]) -> None:
        """Membership changed (`gone`: the members now dead or left, with that state): a stage
        machine gone fails its job's attempt, a submitter gone cancels its job (nowhere to
        write the outputs), and a daemon that no longer holds the lease hands its jobs back
        (a minority) or decides nothing more for them (a majority is still there)."""
        for rec in self.records.values():
            if rec.state != "running":
                continue
            if rec.submitter in gone:  # nowhere to write the outputs: stop, free the stages
                rec.cancel_requested = True
                self._spawn(rec.coord.cancel(f"the submitting daemon {rec.submitter} is "
                                             f"{gone[rec.submitter]}"), f"orphan {rec.job_id}")
                continue
            for node in rec.layout.slot_nodes.values():
                if node in gone:
                    rec.coord.node_failed(node, f"the membership layer declared {node} "
                                                f"{gone[node]} (daemon stopped or unreachable)")
        running = [r for r in self.records.values() if r.state == "running"
                   and not r.cancel_requested and not r.handed_back]
        lost = self._not_leading() if running else None
        if lost is None:
            return
        lead = self._leadership()
        if lead is None or not lead.has_quorum:
            # A minority (or a daemon cut off) has no working scheduler: stop at once.
            for rec in running:
                self._hand_back(rec, lost)
            return
        for rec in running:  # (a majority is still there: see docs/jobs.md, "Who schedules")
            if rec.stale_lease != lead.term:
                rec.stale_lease = lead.term
                rec.log(f"{lost}: this daemon decides nothing more for the job (no restart, "
                        "re-plan or re-adaptation); the running attempt, among a majority, goes "
                        "on to its end, and a failure hands the job back to the next scheduler")

    # -- taking a job to run here -------------------------------------------------------------

    async def _on_remote_submit(self, peer: str, msg: JobSubmit) -> None:
        """A submission forwarded by `peer`: plan and start it; answer either way."""
        try:
            summary = await self.submit(decode_upload(bytes(msg.payload)), dry_run=msg.dry_run,
                                        submitter=peer)
            reply = JobSubmitReply(request_id=msg.request_id, ok=True,
                                   summary=json.loads(json.dumps(summary)))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reply = JobSubmitReply(request_id=msg.request_id, ok=False, message=str(e),
                                   code="not_scheduler" if isinstance(e, NotScheduler) else "")
        await self._send(peer, reply, ())

    # -- what goes back to the submitter ------------------------------------------------------

    async def _answer_query(self, peer: str, msg: JobQuery) -> None:
        rec = self.records.get(msg.job_id)
        known = rec is not None and rec.submitter == peer
        reply = JobQueryReply(job_id=msg.job_id, known=known,
                              state=rec.state if rec is not None and known else "")
        if rec is not None and known and msg.through >= -1 and rec.state != "handed_back":
            # It lacks records after `through` (or the final update): send them again.
            rec.update_cursor.through = min(rec.update_cursor.through, msg.through)
            self._spawn(self._send_update(rec), f"resend {rec.job_id}")
        try:
            async with asyncio.timeout(REMOTE_SEND_S):
                await self._send(peer, reply, ())
        except (LocalError, OSError, TimeoutError) as e:
            log.info("job %s: query answer to %s not sent: %s", msg.job_id, peer, e)

    async def _push(self, rec: JobRecord) -> None:
        """Send a remote submitter the job's status every UPDATE_S until it ends."""
        while rec.state == "running":
            await self._send_update(rec)
            await asyncio.sleep(UPDATE_S)

    async def _send_update(self, rec: JobRecord) -> None:
        """The job's status and the step records the submitter has not had yet (in as many
        updates as they take; the status rides on the last). One at a time per job, and a
        failed send rewinds: the submitter gets every record (again) with the next one."""
        async with rec.update_lock:
            start = rec.update_cursor.through
            try:
                await self._send_update_locked(rec)
            except (LocalError, OSError, TimeoutError) as e:
                rec.update_cursor.through = min(rec.update_cursor.through, start)
                log.info("job %s: update to %s not sent: %s", rec.job_id, rec.submitter, e)

    async def _send_update_locked(self, rec: JobRecord) -> None:
        async def send(msg: JobUpdate) -> None:
            async with asyncio.timeout(REMOTE_SEND_S):  # a dead submitter must not stall us
                await self._send(rec.submitter, msg, ())

        # Each update says which record its own follow (`after`): one lost on the way (a
        # failed dial drops what was queued, and a send only queues) shows as a gap, and the
        # submitter asks for the records again (`JobQuery.through`, `_answer_query`).
        after = rec.update_cursor.through
        steps = rec.history.take(rec.update_cursor, MAX_UPDATE_STEPS, MAX_UPDATE_STEP_BYTES)
        while True:
            nxt_after = rec.update_cursor.through
            nxt = rec.history.take(rec.update_cursor, MAX_UPDATE_STEPS, MAX_UPDATE_STEP_BYTES)
            if not nxt:
                break
            await send(JobUpdate(job_id=rec.job_id, steps=tuple(_wire(steps)), after=after))
            steps, after = nxt, nxt_after
        st = json.loads(json.dumps(self._host.job_view(rec.job_id, 1), default=str))
        st["lines"] = list(rec.logs)
        await send(JobUpdate(job_id=rec.job_id, status=st, steps=tuple(_wire(steps)),
                             after=after))

    async def _checkpoint_out(self, rec: JobRecord, step: int,
                              state: dict[str, torch.Tensor]) -> None:
        """A whole-model checkpoint: into the store (a job submitted here), or to the
        submitter, right behind the step records it follows."""
        name = checkpoint_name(step)
        if not rec.submitter:
            try:
                await asyncio.to_thread(self._store.put_model, rec.job_id, name, state,
                                        {"step": str(step), "job_id": rec.job_id})
            except (OSError, LocalError) as e:
                rec.unstored[name] = reason(e)
                rec.log(f"checkpoint {name} NOT stored in {self._store.job_dir(rec.job_id)}: "
                        f"{reason(e)} (the job goes on; it resumes from an earlier one)")
                return
            rec.unstored.pop(name, None)
            rec.log(f"checkpoint {name} stored")
            return
        blob = await asyncio.to_thread(_safetensors_bytes, state,
                                       {"step": str(step), "job_id": rec.job_id})
        await self._send_update(rec)  # the steps it follows go first (same lane)
        try:
            async with asyncio.timeout(REMOTE_OUTPUTS_S):
                await self._send(rec.submitter, JobOutput(job_id=rec.job_id, name=name), (blob,))
        except (LocalError, OSError, TimeoutError) as e:
            rec.log(f"checkpoint {name} not sent to {rec.submitter}: {reason(e)}")
            return
        rec.log(f"checkpoint {name} sent to {rec.submitter}")

    # -- planning and starting a job -----------------------------------------------------------

    async def submit(self, upload: Upload, *, dry_run: bool = False,
                     submitter: str = "", owner_uid: int | None = None) -> dict[str, Any]:
        """Plan (and unless `dry_run`, start) a job; `JobRefused`/`FusionError` if it cannot
        run, before anything starts; `NotScheduler` unless this daemon holds the scheduler's
        lease. `owner_uid`: the user who submitted it here."""
        why = self._not_leading()
        if why is not None:
            raise NotScheduler(f"{why}: only the scheduler plans jobs")
        meta = upload.meta
        spec, captured = await asyncio.to_thread(
            restore_job, meta["toml"], meta["base"], meta["out_base"], upload.graph_bytes,
            upload.state_bytes, check_paths=False)  # never a user's path: data came with it
        upload = await asyncio.to_thread(checked_data, upload, spec)
        try:  # never trust the client: NaN weights train to NaN on every stage
            await asyncio.to_thread(check_finite, captured.state, "the submitted weights")
        except LocalError as e:
            raise JobRefused(str(e)) from None
        corpus = await asyncio.to_thread(_corpus, upload)
        steps = meta.get("steps")
        if steps is not None:
            if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
                raise JobRefused(f"steps must be an integer >= 1, got {steps!r}")
            spec = replace(spec, steps=steps)
        stages = meta.get("stages")
        if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool)
                                   or stages < 1):
            raise JobRefused(f"stages must be an integer >= 1, got {stages!r}")
        replicas = meta.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1 or (
                replicas > 1 and stages is None):
            raise JobRefused(f"replicas must be an integer >= 1, with stages, got {replicas!r}")
        first = meta.get("first_step", 0)
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < spec.steps:
            raise JobRefused(f"first_step must be an integer in [0, {spec.steps}) (the job's "
                             f"steps), got {first!r}")
        view = self._view()
        if view is None:
            raise JobRefused("this daemon is not in a cluster: `fusionctl init` or `join` first")
        sets = await self.member_ops(view)
        left_out = "".join(f"; {m} was left out: {w}" for m, w in sorted(sets.unknown.items()))
        try:
            cluster, addresses, memory = cluster_for_planner(
                view, exclude=sets.unknown, op_sets=sets.ops, device=spec.device,
                precision=spec.precision)
        except JobRefused as e:
            raise JobRefused(f"{e}{left_out}") from None
        why = refuse_unrunnable(captured.graph, sets, cluster.ids())
        if why is not None:
            raise JobRefused(why + left_out)
        check_capacity(captured, spec, memory)
        cluster = reserve_for_scheduler(cluster, self.node_id, scheduler_reserve_bytes(captured))
        job_id = meta.get("job_id") or f"{spec.name}-{secrets.token_hex(3)}"
        taken = self.records.get(job_id) if isinstance(job_id, str) else None
        # A job whose attempt here ended comes back under its id from its own submitter (the
        # authority on the job): after a hand-back, or after the submitter failed it over
        # elsewhere and cancelled the attempt here (the chaos check: this daemon, frozen as
        # its scheduler, thawed, was cancelled, then was elected and refused the job).
        ended_here = taken is not None and (
            taken.state == "handed_back"
            or (taken.state in FINAL and taken.submitter and taken.submitter == submitter))
        if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id) or (
                taken is not None and not ended_here):
            raise JobRefused(f"job id {job_id!r} is malformed or already in use here")
        used = meta.get("restarts", 0)
        if not isinstance(used, int) or isinstance(used, bool) or not 0 <= used <= 100:
            raise JobRefused(f"restarts must be an integer in [0, 100], got {used!r}")
        layout, plan, plan_text = await self._layout(job_id, spec, captured, captured.state,
                                                     cluster, memory, stages, replicas)
        why = self._not_leading()  # planning took a while: still ours to start?
        if why is not None:
            raise NotScheduler(f"{why}: only the scheduler starts jobs")
        term = view.term if view is not None else 0
        summary = {
            "job_id": job_id, "name": spec.name, "steps": spec.steps,
            "stages": [{"stage": s.stage, "node": s.node_id,
                        "device": layout.devices.get(s.node_id, "cpu")} for s in layout.stages],
            "densities": dict(layout.densities), "plan": plan_text,
            # the planner's decisions as data (None for a `--stages` cut): stages with machine
            # ids and op ranges, links in bytes/s as the planner saw them
            "plan_summary": plan_summary(plan) if plan is not None else None,
            "output": str(spec.output),
        }
        summary["term"] = term  # (a submitter takes a handed-back job's next turn by it)
        if dry_run:
            return summary
        tps = spec.data.seq_len if spec.data.is_text else 0
        rec_box: list[JobRecord] = []

        def on_step(m: StepMetrics) -> None:
            self._on_step(rec_box[0], m)

        def on_checkpoint(step: int, state: dict[str, torch.Tensor]) -> None:
            r = rec_box[0]
            r.checkpoint = (step, state)
            r.checkpoint_step, r.checkpoint_at = step, time.time()
            self._spawn(self._checkpoint_out(r, step, state), f"checkpoint {r.job_id}")

        if self._closing:  # planning outlived the start of close, which would not await it
            raise NotScheduler(f"{self.node_id} is stopping: the job goes to the next scheduler")
        coord = self._coordinator(spec, captured, layout, plan, cluster, addresses, term=term,
                                  plan_version=term * PLAN_EPOCH + 1, first_step=first,
                                  tokens_per_sample=tps, on_step=on_step,
                                  on_checkpoint=on_checkpoint, corpus=corpus)
        ready_s, recv_s = coord.ready_timeout_s, coord.recv_timeout_s
        rec = JobRecord(job_id, spec, layout, coord, plan_text, time.time(), tps,
                      submitter=submitter if submitter != self.node_id else "", plan=plan,
                      stages=stages, replicas=replicas, first_step=first, restarts=used,
                      term=term,
                      owner_uid=None if submitter and submitter != self.node_id else owner_uid)
        if rec.submitter:
            rec.update_cursor = rec.history.cursor()
        else:
            rec.upload = upload  # to fail the job over from here if this daemon steps down
        rec_box.append(rec)
        self.records[job_id] = rec
        rec.log(f"submitted: {spec.steps} steps"
                + (f" from step {first} (resumed)" if first else "")
                + f" on {len(layout.stages)} stages ("
                + ", ".join(f"{s.stage}:{s.node_id}" for s in layout.stages) + ")")
        rec.log(software_line(captured.graph, sets))
        rec.log(f"timeouts from the measured links: Ready within {ready_s:.0f}s; a stage waits "
                + ("its own bound" if recv_s is None else f"at least {recv_s:.0f}s")
                + " for its inputs")
        rec.task = asyncio.create_task(self._run(rec), name=f"job {job_id}")
        self._host.persist(job_id)
        if rec.submitter:
            self._spawn(self._push(rec), f"updates {job_id}")
        else:
            self._host.tracked(job_id)
        c = spec.compression
        if plan is not None and c.compress and c.readapt_interval_s > 0:
            self._spawn(self._readapt(rec, c.readapt_interval_s), f"readapt {job_id}")
        return summary

    def _coordinator(self, spec: JobSpec, captured: CapturedModel, layout: JobLayout,
                     plan: Plan | None, cluster: Cluster, addresses: Mapping[str, Address], *,
                     term: int, plan_version: int, first_step: int, tokens_per_sample: int,
                     on_step: Callable[[StepMetrics], Any] | None,
                     on_checkpoint: Callable[[int, dict[str, torch.Tensor]], Any] | None,
                     corpus: Corpus | None) -> JobCoordinator:
        """The coordinator of one attempt of a job (the first, from `submit`, and each restart,
        from `_restart`): `captured`'s state is what its Assigns ship, and its Ready and input
        timeouts come from the measured links (`derived_timeouts`)."""
        ready_s, recv_s = derived_timeouts(layout, captured.state, plan, cluster, self.node_id,
                                           self.ready_timeout_s)
        return JobCoordinator(
            send=self._send, spec=spec, captured=captured, layout=layout, addresses=addresses,
            term=term, plan_version=plan_version, first_step=first_step,
            ready_timeout_s=ready_s, failure_grace_s=self.failure_grace_s,
            tokens_per_sample=tokens_per_sample, on_step=on_step, on_checkpoint=on_checkpoint,
            corpus=corpus, recv_timeout_s=recv_s)

    async def _layout(self, job_id: str, spec: JobSpec, captured: CapturedModel,
                      state: Mapping[str, torch.Tensor], cluster: Cluster,
                      memory: Mapping[str, int], stages: int | None, replicas: int = 1,
                      ) -> tuple[JobLayout, Plan | None, str]:
        """Cut the job over `stages` machines of `cluster` (this node first), each stage on
        `replicas` machines, or plan it on `cluster` (OP-Fence); the stages start from
        `state`. `JobRefused` if it cannot run."""
        if stages is not None:
            ids = ([self.node_id] if self.node_id in cluster.ids() else []) \
                + [n for n in cluster.ids() if n != self.node_id]
            if stages * replicas > len(ids):
                raise JobRefused(f"{stages} stages x {replicas} replicas asked, the cluster has "
                                 f"{len(ids)} alive members")
            micro = spec.batch.micro_batches
            if replicas > micro:
                raise JobRefused(f"{replicas} replicas per stage need at least as many "
                                 f"micro-batches; the job has {micro} (batch.micro_batches)")
            cut = contiguous_assignment(captured.graph, stages)
            op_nodes = {op: ids[p] for op, p in cut.items()}
            extra = {ids[p]: ids[stages + p * (replicas - 1): stages + (p + 1) * (replicas - 1)]
                     for p in range(stages)} if replicas > 1 else {}
            # the micro-batches dealt in turn: machines of one speed on loopback
            routes = {ids[p]: [m % replicas for m in range(micro)]
                      for p in range(stages)} if replicas > 1 else {}
            layout = await asyncio.to_thread(
                functools.partial(layout_job, replicas=extra, routes=routes),
                job_id, captured.graph, state, op_nodes,
                density=spec.compression.density, exact=spec.compression.exact_edges,
                encoding=spec.compression.edge_encoding)
            # each machine's stage on the device the job's policy picks there (its GPU)
            layout = replace(layout, devices={
                m.id: m.device for m in cluster.machines
                if m.device != "cpu" and m.id in layout.slot_nodes.values()})
            parts = {s.stage: s.partition.node_ids for s in layout.stages}
            slot_stage = {**{s.stage: s.stage for s in layout.stages}, **layout.slot_stages()}
            why = refuse_stages(captured.graph, {slot: (node, parts[slot_stage[slot]])
                                                 for slot, node in layout.slot_nodes.items()},
                                self._sets_of(cluster), stages)
            if why is not None:
                raise JobRefused(why)
            text = (f"contiguous cut over {stages} machines (--stages); need at least "
                    f"{memory_estimate(captured, spec) / 2**20:.1f} MiB\n"
                    + _stages_table(layout, layout.densities))
            return layout, None, text
        plan = await asyncio.to_thread(plan_job, spec, captured, cluster)
        layout = await asyncio.to_thread(layout_from_plan, job_id, captured.graph, state, plan,
                                         spec)
        return layout, plan, render_plan(plan) + "\n" + _stages_table(layout, layout.densities)

    def _sets_of(self, cluster: Cluster) -> MemberOpSets:
        """The op sets the planner's `cluster` was built with, with the members' profiles."""
        view = self._view()
        profiles = {m.node_id: m.profile for m in (view.members if view else ())}
        return MemberOpSets({m.id: m.ops for m in cluster.machines}, {}, profiles)

    # -- running its attempts ------------------------------------------------------------------

    async def _readapt(self, rec: JobRecord, interval_s: float) -> None:
        """AdaTopK re-adaptation while `rec` runs: every `interval_s`, densities for the plan's
        cut under the links as measured now; changed ones go to the sending stages. Follows
        the job across restarts (a new plan, a new cut)."""
        layout = rec.layout
        current = dict(layout.densities)
        edges = [e.edge for e in layout.edges()]
        while rec.state == "running":
            await asyncio.sleep(interval_s)
            if rec.state != "running" or rec.coord.status()["state"] != "running":
                continue
            plan = rec.plan
            if rec.layout is not layout:
                layout = rec.layout
                rec.codecs = None
                current = dict(layout.densities)
                edges = [e.edge for e in layout.edges()]
            view = self._view()
            if view is None or plan is None or self._not_leading() is not None:
                continue  # a daemon without the lease decides nothing (it hands the job back)
            try:
                cluster, _, _ = cluster_for_planner(view, device=rec.spec.device,
                                                    precision=rec.spec.precision)
                if rec.spec.compression.choice:
                    await self._readapt_codecs(rec, plan, cluster)
                    continue
                new = await asyncio.to_thread(readapted_densities, plan, cluster, current, edges)
                if new is None:
                    continue
                await rec.coord.set_densities(new)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the job goes on with the densities it has
                rec.log(f"re-adaptation skipped: {type(e).__name__}: {e}")
                continue
            rec.log("AdaTopK re-adapted to the measured links: " + ", ".join(
                f"{k} {current.get(k, 1.0):.3g}->{v:.3g}" for k, v in sorted(new.items())
                if v != current.get(k, 1.0)))
            current = {k: v for k, v in new.items() if v < 1.0}

    async def _readapt_codecs(self, rec: JobRecord, plan: Plan, cluster: Cluster) -> None:
        """One turn of the per-link codec choice's re-adaptation: the codecs in force are the
        coordinator's (its layout's, as last changed), the new ones go to the senders."""
        current = rec.codecs if rec.codecs is not None else layout_codecs(rec.layout)
        new = await asyncio.to_thread(readapted_codecs, plan, cluster, current)
        if new is None:
            return
        await rec.coord.set_codecs(new)
        rec.log("codecs re-adapted to the measured links: " + ", ".join(
            f"{k} {current[k].label}->{v.label}" for k, v in sorted(new.items())
            if v != current[k]))
        rec.codecs = new

    def _on_step(self, rec: JobRecord, m: StepMetrics) -> None:
        self.stats.step(m.wall_s)
        d = m.as_dict()
        if rec.first_loss is None and m.loss is not None:
            rec.first_loss = m.loss
        rec.history.add(d)
        self._host.steps_arrived(rec.job_id)
        every = max(1, rec.spec.steps // 20)
        if (m.step + 1) % every == 0 or m.step + 1 == rec.spec.steps:
            rate = d.get("tokens_per_s") or d.get("samples_per_s") or 0.0
            rec.log(f"step {m.step + 1}/{rec.spec.steps} loss "
                    f"{'-' if m.loss is None else f'{m.loss:.4f}'} {rate:.0f} "
                    f"{'tokens' if d.get('tokens_per_s') else 'samples'}/s busy "
                    + " ".join(f"{v:.2f}" for _, v in sorted(m.stage_busy.items()))
                    + f" wire {m.wire_bytes} B/step")

    async def _run(self, rec: JobRecord) -> None:
        try:
            await self._run_attempts(rec)
        finally:  # also when the daemon stops (cancelled): the record says how it ended
            self._host.persist(rec.job_id)
            if rec.state in FINAL:
                self.stats.ended(rec.job_id, rec.state, rec.coord.status())
                self._release(rec)
            if not rec.submitter and not self._closing:
                self._host.ended(rec.job_id)

    @staticmethod
    def _release(rec: JobRecord) -> None:
        """A job that ended keeps its record (while it has outputs to fetch, or coordinated
        for another daemon) but not what only a run needs: the captured model, the corpus,
        the partitions' results, the last checkpoint, the upload. Each of them is a model's
        worth of bytes, and a long-lived daemon used to keep all of them for every job."""
        rec.coord.release()
        rec.checkpoint = None
        rec.upload = None
        if rec.plan is not None:  # its decisions stay on view as data, not the arrays
            rec.plan_data = dict(plan_summary(rec.plan))
        rec.plan = None

    async def _run_attempts(self, rec: JobRecord) -> None:
        outcome: JobOutcome | None = None
        try:
            while True:
                outcome = await rec.coord.run()
                if not await self._restart(rec, outcome):
                    break
        except asyncio.CancelledError:
            rec.state = "cancelled"
            raise
        except Exception as e:  # a bug: the job fails, the daemon stays up
            log.exception("job %s: coordinator crashed", rec.job_id)
            rec.state = "failed"
            rec.outcome = {"ok": False, "failure": f"scheduler error: {type(e).__name__}: {e}"}
            rec.log(rec.outcome["failure"])
            if rec.submitter:  # it must hear the job ended, or it shows it running forever
                await self._send_update(rec)
            return
        if rec.handed_back:
            await self._handed_back(rec)
            return
        if rec.restarts:
            outcome.metrics = [*rec.earlier, *outcome.metrics]
            outcome.wall_s = time.time() - rec.submitted_at
        if rec.submitter:
            unstored = await self._send_outputs(rec, outcome)
        else:
            unstored = await self._store_outputs(
                rec, outcome.summary() | {"restarts": rec.restarts},
                outcome.state if outcome.ok else None)
        rec.outcome = outcome.summary() | {"restarts": rec.restarts}
        if unstored is not None:
            rec.log(unstored)
            if outcome.ok:
                outcome.ok = False
                rec.storage_failed = True
                rec.outcome |= {"ok": False, "failure": unstored,
                                "held_by": self.node_id if rec.held is not None else None}
        if outcome.ok:
            rec.state = "done"
            rec.log(f"done in {outcome.wall_s:.1f}s; outputs "
                    + (f"stored in {self._store.job_dir(rec.job_id)} (`fusionctl fetch "
                       f"{rec.job_id}`)" if not rec.submitter else f"sent to {rec.submitter}"))
        else:
            if rec.cancel_requested:
                rec.state = "cancelled"
                rec.log(f"cancelled after {steps_done(rec)} of {rec.spec.steps} steps; every "
                        "stage was told to stop and free its partition")
            else:
                rec.state = "failed"
                if unstored is None:
                    rec.log(f"failed: {outcome.failure}")
        if rec.submitter:
            await self._send_update(rec)  # the final status, behind the outputs (both BULK)

    async def _restart(self, rec: JobRecord, outcome: JobOutcome) -> bool:
        """After a failed attempt: when a stage machine other than this one failed and
        `max_restarts` allows, plan the job again on the machines still alive (the failed ones
        left out) and start it from the last checkpoint (step 0 without one). True when a new
        attempt is ready in `rec.coord`; False to end the job with `outcome`."""
        decision = decide_restart(
            outcome.ok, outcome.failure, self_node=self.node_id, restarts=rec.restarts,
            max_restarts=rec.spec.max_restarts, cancel_requested=rec.cancel_requested,
            closed=self._closing, handed_back=rec.handed_back,
            not_leading=None if rec.handed_back else self._not_leading())
        if decision.hand_back is not None:
            rec.handed_back = decision.hand_back
        if decision.log is not None:
            rec.log(decision.log)
        if not decision.restart:
            return False
        view = self._view()
        now = time.monotonic()
        for m in decision.exclude:
            rec.excluded[m] = (_incarnation(view, m), now, decision.refused)
        try:
            if view is None:
                raise JobRefused("this daemon left the cluster")
            excluded = self._excluded_now(rec, view, now)
            sets = await self.member_ops(view)
            cluster, addresses, memory = cluster_for_planner(
                view, exclude=excluded | set(sets.unknown), op_sets=sets.ops,
                device=rec.spec.device, precision=rec.spec.precision)
            old = rec.coord
            captured = old.captured
            if captured is None:  # released: the job had ended
                raise JobRefused("the job's model was released when it ended")
            cluster = reserve_for_scheduler(cluster, self.node_id,
                                            scheduler_reserve_bytes(captured))
            first, state = rec.first_step, captured.state
            if rec.checkpoint is not None:
                step, ckpt = rec.checkpoint
                first = step + 1
                state = {k: ckpt.get(k, v) for k, v in captured.state.items()}
            check_capacity(captured, rec.spec, memory)
            stages = None if rec.stages is None else min(rec.stages, len(cluster.ids()))
            replicas = 1 if stages is None else max(1, min(rec.replicas,
                                                           len(cluster.ids()) // stages))
            version = old.plan_version + 1
            layout, plan, text = await self._layout(rec.job_id, rec.spec, captured, state,
                                                    cluster, memory, stages, replicas)
            captured = replace(captured, state=state)  # what the new Assigns ship
        except (FusionError, ValueError) as e:
            rec.log(f"cannot restart the job: {e}")
            return False
        rec.restarts += 1
        self.stats.restarted()
        rec.earlier = [m for m in [*rec.earlier, *outcome.metrics] if m.step < first]
        rec.history.truncate_from(first)  # the new attempt redoes them
        rec.layout, rec.plan, rec.plan_text = layout, plan, text
        rec.coord = self._coordinator(rec.spec, captured, layout, plan, cluster, addresses,
                                      term=rec.term, plan_version=version, first_step=first,
                                      tokens_per_sample=old.tokens_per_sample,
                                      on_step=old.on_step, on_checkpoint=old.on_checkpoint,
                                      corpus=old.corpus)
        rec.log(f"restart {rec.restarts}/{rec.spec.max_restarts}: "
                + (f"from step {first} (no checkpoint yet)" if rec.checkpoint is None else
                   f"from the checkpoint after step {first}")
                + f" on {len(layout.stages)} stages ("
                + ", ".join(f"{s.stage}:{s.node_id}" for s in layout.stages)
                + (f"), without {', '.join(sorted(excluded))}" if excluded else ")"))
        return True

    @staticmethod
    def _excluded_now(rec: JobRecord, view: Any, now: float) -> set[str]:
        """The machines `rec`'s next attempt is planned without (`released_exclusions` says
        which of those that failed it are planned again, logged here)."""
        for node, why in released_exclusions(rec.excluded, lambda n: _incarnation(view, n),
                                             now).items():
            del rec.excluded[node]
            rec.log(f"{node} planned again: {why}")
        return set(rec.excluded)

    # -- outputs -------------------------------------------------------------------------------

    def _hold(self, rec: JobRecord, state: dict[str, torch.Tensor]) -> None:
        """Keep the final weights of `rec` in memory (they could not be stored); at most
        `MAX_HELD_JOBS` jobs hold weights, the oldest lets go."""
        rec.held = state
        holding = sorted((r for r in self.records.values() if r.held is not None),
                         key=lambda r: r.submitted_at)
        for old in holding[: max(0, len(holding) - MAX_HELD_JOBS)]:
            old.held = None
            old.log(f"the held weights of this job are dropped: {MAX_HELD_JOBS} newer jobs "
                    "hold theirs")

    async def _store_outputs(self, rec: JobRecord, summary: Mapping[str, Any],
                             state: dict[str, torch.Tensor] | None) -> str | None:
        """Store a job submitted here: the model (`state`: a job that trained to the end) and
        metrics.json from its full history (with `summary`, the outcome), durably. None when
        all is stored, else why not (the weights are then held in memory for `fusionctl
        fetch`)."""
        where = self._store.job_dir(rec.job_id)
        failures: list[str] = []
        if state is not None:
            try:
                await asyncio.to_thread(self._store.put_model, rec.job_id, MODEL, state,
                                        {"job_id": rec.job_id})
                rec.unstored.pop(MODEL, None)
                rec.held = None
            except (OSError, LocalError) as e:
                rec.unstored[MODEL] = reason(e)
                failures.append(f"{MODEL}: {reason(e)}")
                self._hold(rec, state)
        try:
            await asyncio.to_thread(self._store.put_metrics, rec.job_id, list(rec.history),
                                    metrics_summary(rec.history, summary, rec.submitted_at))
            rec.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            rec.unstored[METRICS] = reason(e)
            failures.append(f"{METRICS}: {reason(e)}")
        if not failures:
            return None
        held_note = ("the daemon holds the weights in memory until it stops; "
                     if rec.held is not None else "")
        return (f"the outputs could not be stored in {where} ({'; '.join(failures)}); "
                f"{held_note}free space there, then `fusionctl fetch {rec.job_id}`")

    async def _ship(self, rec: JobRecord, state: dict[str, torch.Tensor]) -> JobOutputAck:
        """Send the model to the submitter and wait until it says it stored it (or not)."""
        blob = await asyncio.to_thread(_safetensors_bytes, state, {"job_id": rec.job_id})
        rid = secrets.token_hex(8)
        fut: asyncio.Future[JobOutputAck] = asyncio.get_running_loop().create_future()
        self._acks[rid] = fut
        try:
            async with asyncio.timeout(REMOTE_OUTPUTS_S):
                await self._send(rec.submitter, JobOutput(job_id=rec.job_id, name=MODEL,
                                                          request_id=rid), (blob,))
                return await fut
        except (LocalError, OSError, TimeoutError) as e:
            why = (f"no answer within {REMOTE_OUTPUTS_S:g}s" if isinstance(e, TimeoutError)
                   else reason(e))
            return JobOutputAck(job_id=rec.job_id, request_id=rid, ok=False, message=why)
        finally:
            self._acks.pop(rid, None)

    async def _send_outputs(self, rec: JobRecord, outcome: JobOutcome) -> str | None:
        """A job coordinated for another daemon: send it the model and wait for its ack (it
        writes metrics.json itself, from the history it kept). None when stored; else why not,
        and the weights stay here, in memory, for a `JobFetch`."""
        if not outcome.ok or outcome.state is None:
            return None
        ack = await self._ship(rec, outcome.state)
        if ack.ok:
            return None
        self._hold(rec, outcome.state)
        return (f"the model could not be stored on the submitting machine {rec.submitter} "
                f"({ack.message}); the scheduler {self.node_id} holds the weights in memory "
                f"until it stops: free space there, then `fusionctl fetch {rec.job_id}`")

    async def _resend_held(self, rec: JobRecord, request_id: str) -> None:
        """The submitter asks again for the weights it could not store (`JobFetch`)."""
        if rec.held is None:
            ack = JobOutputAck(job_id=rec.job_id, request_id=request_id, ok=False,
                               message=f"the scheduler {self.node_id} does not hold the "
                                       f"weights of job {rec.job_id} (any more)")
        else:
            got = await self._ship(rec, rec.held)
            ack = JobOutputAck(job_id=rec.job_id, request_id=request_id, ok=got.ok,
                               message=got.message)
            if got.ok:
                rec.held = None
                rec.state = "done"
                rec.outcome = {**(rec.outcome or {}), "ok": True, "failure": None,
                               "held_by": None}
                rec.log(f"the model is stored on {rec.submitter} now (fetched again)")
        with contextlib.suppress(LocalError, OSError):
            await self._send(rec.submitter, ack, ())

