"""The daemon's job service: hosts stages (JobWorker) and runs the jobs submitted here.

Every daemon runs one `JobService` once its peer network is up. It

- hosts the stages the scheduler of a job assigns to this node (`JobWorker`);
- takes submissions from the local API (`submit`): restores the job (IR + weights, validated
  again), refuses it if the cluster's memory cannot hold it (`check_capacity`), plans it on the
  live cluster view (`plan_job`: the members' gossiped profiles and the measured link matrix)
  or cuts it over a requested number of machines, and runs a `JobCoordinator` for it;
- keeps the outputs of the jobs submitted here (model.safetensors, metrics.json from the
  job's full step history, the newest checkpoints) in its own store, `<state_dir>/outputs/`
  (`fusiond.jobs.outputs.OutputStore`), from where `fusionctl` downloads them and writes them
  at the job's output path as the user: the daemon never reads or writes a path named in a job;
- re-adapts a planned job's AdaTopK densities to the measured links every
  `compression.readapt_interval_s` (`_readapt`);
- fails a job's attempt when a stage machine is declared dead (`node_failed`) or a stage
  fails, then restarts it on the machines left, from its last checkpoint (`_restart`, up to
  `job.max_restarts` times);
- answers the API's read commands (`jobs`, `job`, `logs`, `outputs`) and `cancel`; each job
  records the uid that submitted it (`owner_uid`), and the API lets only that user and the
  daemon's operator at it.

A submission goes to the elected scheduler (`JobSubmit` over the peer network) when this
daemon is not the scheduler: that submitter role (forward, follow the job's `JobUpdate`s and
`JobOutput`s, fail it over) is `fusiond.jobs.submission.Submissions`, to which this service
routes the submitter-side messages. As the scheduler, this service runs the coordinator,
streams `JobUpdate`s back to the submitter (the status, and every step record since the last
update) and sends the outputs (`JobOutput`), which the submitting daemon stores durably and
acknowledges (`JobOutputAck`): the job is done only once the model is stored there. If it
cannot be (a full disk), the job ends failed saying why, and the scheduler keeps the weights in
memory until the submitter asks for them again (`JobFetch`, from `fusionctl fetch ID`). Only
the scheduler of the current term, holding its lease (the view's leader is itself, with a
quorum), plans, re-plans or re-adapts a job. A scheduler that loses its quorum stops at once:
its attempts are cancelled and each job is handed back to its submitter, which resubmits it to
the next scheduler, as when the scheduler dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fusiond.errors import FusionError, LocalError
from fusiond.graph import CapturedModel, contiguous_assignment, state_from_bytes, state_to_bytes
from fusiond.jobs.assign import Corpus, JobLayout, layout_job
from fusiond.jobs.coordinator import JobCoordinator, JobOutcome
from fusiond.jobs.history import (
    HISTORY_KEPT,
    RECORDS_KEPT,
    JobHistory,
    StepHistory,
    finite_records,
    metrics_summary,
)
from fusiond.jobs.opsets import (
    MemberOpSets,
    OpSetService,
    refuse_stages,
    refuse_unrunnable,
    software_line,
)
from fusiond.jobs.outputs import (
    KEEP_JOBS,
    METRICS,
    MODEL,
    OutputStore,
    checkpoint_name,
    reason,
)
from fusiond.jobs.planning import (
    JobRefused,
    cluster_for_planner,
    layout_from_plan,
    plan_job,
    readapted_densities,
)
from fusiond.jobs.records import FINAL, JobRecord, RemoteJob, steps_done
from fusiond.jobs.runner import EXCLUDE_FOR_S as EXCLUDE_FOR_S  # (read by tests as service's)
from fusiond.jobs.runner import decide_restart, derived_timeouts, released_exclusions
from fusiond.jobs.submission import UPDATE_S, NotScheduler, Submissions, SubmitterHost
from fusiond.jobs.submit import (
    check_capacity,
    check_finite,
    is_default_corpus,
    memory_estimate,
    restore_job,
)
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
from fusiond.jobs.worker import JobWorker, Leadership, LeadershipFn, SendFn, local_sender
from fusiond.plan import Cluster, Plan
from fusiond.plan.render import plan_summary, render_plan
from fusiond.tasks import cancel_and_wait, raise_if_cancelling
from fusiond.train.local import StepMetrics
from fusiond.train.spec import JobSpec, parse_job
from fusiond.train.stage import StageConfig
from protocol import ir
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
    Message,
)

__all__ = ["JobService", "NotScheduler", "cluster_for_planner"]

log = logging.getLogger("fusiond.jobs")

MAX_UPDATE_STEPS = 500
"""Step records one `JobUpdate` carries at most (more follow in further updates)."""
MAX_UPDATE_STEP_BYTES = 4 << 20
"""About this much JSON of step records at most in one `JobUpdate` (its header is bounded)."""
STEPS_FSYNC_S = 1.0
"""The submitting daemon appends a running job's step records to disk as they arrive, and
fsyncs them at most this far apart (a kill loses none; a power loss at most this much)."""
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


_Record = JobRecord  # (the names tests know them by)
_Remote = RemoteJob


def _incarnation(view: Any, node_id: str) -> int | None:
    """`node_id`'s incarnation in `view` (None: not a member, or not said)."""
    for m in getattr(view, "members", ()) or ():
        if m.node_id == node_id:
            inc = getattr(m, "incarnation", None)
            return inc if isinstance(inc, int) else None
    return None


def _corpus(upload: Upload) -> Corpus | None:
    """The corpus the submitter read (`corpus_for_upload`, in fusionctl), or None for a job
    without text (`_checked_data` refused a text job without one)."""
    digest = upload.meta.get("data_digest")
    if not isinstance(digest, str) or not digest:
        return None
    tokens = None
    if upload.data_bytes:
        try:
            tokens = state_from_bytes(upload.data_bytes).get("tokens")
        except Exception as e:
            raise JobRefused(f"the upload's corpus section is not a safetensors file: {e}") \
                from None
        if tokens is None or tokens.ndim != 1 or tokens.dtype not in (torch.uint8, torch.int32):
            raise JobRefused("the upload's corpus section must hold one 1-D uint8/int32 "
                             "tensor `tokens`")
    default = upload.meta.get("data_default") is True and tokens is None
    if not default and tokens is None:
        raise JobRefused("the upload names a corpus but does not carry it (no data section): "
                         "submit with `fusionctl submit`, which reads the data as you")
    return Corpus(digest, default, tokens)


def _checked_data(upload: Upload, spec: JobSpec) -> Upload:
    """The upload with its corpus accounted for, or `JobRefused`. The daemon never reads a
    job's `data.path` (nor its tokenizer file) on a user's behalf: `fusionctl` reads the data
    as the user and sends it (the upload's data section). Only the default corpus (this
    Python's own standard library, the same public files on every machine) is read by each
    data stage itself and checked against the submitter's hash."""
    meta = upload.meta
    if spec.data.kind != "text":
        if upload.data_bytes:
            raise JobRefused("the upload carries a corpus, but the job's data is not text")
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
    lines = [f"{'stage':>5}  {'machine':<40}{'ops':>6}  {'params':>10}"]
    for s in layout.stages:
        lines.append(f"{s.stage:>5}  {s.node_id:<40}{len(s.partition.node_ids):>6}  "
                     f"{len(s.partition.param_names):>10}")
    if densities:
        lines.append("top-k edges: " + ", ".join(f"{e} {d:g}" for e, d in densities.items()))
    if layout.int8_edges:
        lines.append("int8 edges: " + ", ".join(sorted(layout.int8_edges)))
    return "\n".join(lines)


class JobService:
    """One per daemon (a service). `send_raw(peer, msg, payload)` is the peer network's send;
    `view()` the cluster's current view (None while not in a cluster); `leadership()` who
    schedules in it (by default read from `view()`), which both the stages hosted here (whose
    Assign to take) and the scheduling here (whether this daemon holds the lease) follow."""

    def __init__(self, *, node_id: str, send_raw: SendFn, view: Callable[[], Any],
                 stage_config: StageConfig | None = None, ready_timeout_s: float = 120.0,
                 failure_grace_s: float = 2.0, state_dir: Path | None = None,
                 op_sets: OpSetService | None = None,
                 leadership: LeadershipFn | None = None) -> None:
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
        self._acks: dict[str, asyncio.Future[JobOutputAck]] = {}
        self._steps_locks: dict[str, asyncio.Lock] = {}
        self._steps_new: dict[str, asyncio.Event] = {}
        """Set when a job submitted here has new step records to write."""
        self._fetches: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.view = view
        self.ready_timeout_s = ready_timeout_s
        self.failure_grace_s = failure_grace_s
        self.send: SendFn = local_sender(node_id, send_raw, self.dispatch)
        self.leadership: LeadershipFn = leadership or (lambda: Leadership.of(self.view()))
        self.worker = JobWorker(node_id=node_id, send=self.send, stage_config=stage_config,
                                leadership=self.leadership)
        self._jobs: dict[str, JobRecord] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.submissions = Submissions(
            node_id=node_id, send=self.send, view=self.view, leadership=self.leadership,
            store=self.store, host=SubmitterHost(
                run_here=self.submit, local_record=self._jobs.get, persist=self._persist,
                steps_arrived=self._steps_arrived, tracked=self._track_steps,
                ended=self._submitted_ended))
        """The submitter role: the jobs submitted here and coordinated elsewhere."""
        self._by_type = self._handlers()

    @property
    def _remote(self) -> Mapping[str, RemoteJob]:
        """The jobs submitted here and coordinated elsewhere (`Submissions.records`)."""
        return self.submissions.records

    # -- service ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._history is not None:
            self._past = await asyncio.to_thread(self._history.load)
        await asyncio.to_thread(self.store.sweep)
        await self.submissions.start()
        await self.worker.start()

    async def ready(self) -> None:
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
        for rec in list(self._jobs.values()):
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
        tasks = [r.task for r in self._jobs.values() if r.task is not None and not r.task.done()]
        if tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10.0)
        await cancel_and_wait([t for t in [*tasks, *self._tasks] if not t.done()],
                              what="job task")
        await self.submissions.close()
        for job_id in [*self._jobs, *self._remote]:  # what arrived since the last flush
            with contextlib.suppress(Exception):
                await self._save_steps(job_id)
        await self.worker.close()
        if self._scratch is not None:
            await asyncio.to_thread(shutil.rmtree, self._scratch, True)

    def _spawn(self, coro: Any, name: str) -> None:
        t = asyncio.create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

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

    def _submitted_ended(self, job_id: str) -> None:
        """A job submitted here and coordinated elsewhere ended (`Submissions`)."""
        self._persist(job_id)
        if not self._closed:  # (close() writes what is left itself)
            self._spawn(self._retire_when_saved(job_id), f"steps {job_id}")
        self._prune_outputs()

    def coordinators(self) -> Iterable[JobCoordinator]:
        """Running coordinators (the Prometheus JobCollector reads these)."""
        return [r.coord for r in self._jobs.values() if r.state == "running"]

    # -- messages -----------------------------------------------------------------------------

    def _handlers(self) -> dict[type[Message], Callable[[str, Any], Awaitable[bool]]]:
        """The submission protocol's messages, by type (`dispatch`): each handler answers
        whether it took the message (False: the coordinators and the worker are offered it)."""
        return {JobSubmit: self._on_submit_msg, JobSubmitReply: self._on_submit_reply,
                JobUpdate: self._on_update_msg, JobOutput: self._on_output_msg,
                JobOutputAck: self._on_output_ack, JobFetch: self._on_fetch_msg,
                JobQuery: self._on_query_msg, JobQueryReply: self._on_query_reply,
                JobCancel: self._on_cancel_msg}

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
        self._spawn(self._on_remote_submit(peer, msg), f"submit from {peer}")
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
        ack = self._acks.get(msg.request_id)
        if ack is None:
            self.submissions.on_output_ack(peer, msg)
        elif not ack.done():
            ack.set_result(msg)
        return True

    async def _on_fetch_msg(self, peer: str, msg: JobFetch) -> bool:
        rec = self._jobs.get(msg.job_id)
        if rec is not None and rec.submitter and peer == rec.submitter:
            self._spawn(self._resend_held(rec, msg.request_id), f"resend {msg.job_id}")
        else:
            await self.send(peer, JobOutputAck(
                job_id=msg.job_id, request_id=msg.request_id, ok=False,
                message=f"{self.node_id} coordinates no job {msg.job_id} for {peer}"), ())
        return True

    async def _on_query_msg(self, peer: str, msg: JobQuery) -> bool:
        self._spawn(self._answer_query(peer, msg), f"query {msg.job_id}")
        return True

    async def _on_query_reply(self, peer: str, msg: JobQueryReply) -> bool:
        self.submissions.on_query_reply(peer, msg)
        return True

    async def _on_cancel_msg(self, peer: str, msg: JobCancel) -> bool:
        """The submitter's cancel; any other JobCancel is a stage's (the worker's)."""
        rec = self._jobs.get(msg.job_id)
        if rec is not None and rec.submitter and peer == rec.submitter:
            self._spawn(self.cancel(msg.job_id), f"cancel {msg.job_id}")
            return True
        return False

    def _not_leading(self) -> str | None:
        """Why this daemon may not schedule now; None while it holds the scheduler's lease
        (its view's leader is itself, with a quorum). Checked before every planning decision:
        a minority never schedules."""
        lead = self.leadership()
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
            st = json.loads(json.dumps(self.job(rec.job_id, history=1), default=str))
            st["lines"] = list(rec.logs)
            try:
                async with asyncio.timeout(REMOTE_SEND_S):
                    await self.send(rec.submitter, JobUpdate(job_id=rec.job_id, status=st,
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
        status = json.loads(json.dumps(self.job(rec.job_id, history=1), default=str))
        # The step history and the stored outputs stay this daemon's: the next scheduler's
        # attempt redoes the steps after the checkpoint and they replace the ones recorded.
        r = RemoteJob(rec.job_id, self.node_id, rec.spec.output, {**status, "state": "running"},
                    upload=upload, max_restarts=rec.spec.max_restarts, restarts=rec.restarts,
                    term=rec.term, failing_over=True, notes=list(rec.logs),
                    owner_uid=rec.owner_uid, history=rec.history,
                    unstored=dict(rec.unstored), submitted_at=rec.submitted_at)
        self._jobs.pop(rec.job_id, None)
        self.submissions.take_back(r, f"this daemon, its scheduler, gave the job up: "
                                      f"{rec.handed_back}")

    def on_view(self, view: Any) -> None:
        """Membership changed: a stage machine declared dead (or gone) fails its job; a dead
        scheduler fails the jobs it coordinated for us; whatever waits for a scheduler looks
        again."""
        gone = {m.node_id: m.state for m in view.members if m.state in ("dead", "left")}
        self.submissions.on_view(gone)
        for rec in self._jobs.values():
            if rec.state != "running":
                continue
            if rec.submitter in gone:  # nowhere to write the outputs: stop, free the stages
                rec.cancel_requested = True
                self._spawn(rec.coord.cancel(f"the submitting daemon {rec.submitter} is "
                                             f"{gone[rec.submitter]}"), f"orphan {rec.job_id}")
                continue
            for node in rec.layout.stage_nodes.values():
                if node in gone:
                    rec.coord.node_failed(node, f"the membership layer declared {node} "
                                                f"{gone[node]} (daemon stopped or unreachable)")
        running = [r for r in self._jobs.values() if r.state == "running"
                   and not r.cancel_requested and not r.handed_back]
        lost = self._not_leading() if running else None
        if lost is None:
            return
        lead = self.leadership()
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
        upload = await asyncio.to_thread(_checked_data, upload, spec)
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
        sets = await self._member_ops(view)
        alive = [m.node_id for m in view.members if m.state == "alive"
                 and m.node_id not in sets.unknown]
        why = refuse_unrunnable(graph, sets, alive) if alive else None
        if why is not None:
            raise JobRefused(why)

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
        await self.send(peer, reply, ())

    async def _answer_query(self, peer: str, msg: JobQuery) -> None:
        rec = self._jobs.get(msg.job_id)
        known = rec is not None and rec.submitter == peer
        reply = JobQueryReply(job_id=msg.job_id, known=known,
                              state=rec.state if rec is not None and known else "")
        if rec is not None and known and msg.through >= -1 and rec.state != "handed_back":
            # It lacks records after `through` (or the final update): send them again.
            rec.update_cursor.through = min(rec.update_cursor.through, msg.through)
            self._spawn(self._send_update(rec), f"resend {rec.job_id}")
        try:
            async with asyncio.timeout(REMOTE_SEND_S):
                await self.send(peer, reply, ())
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
                await self.send(rec.submitter, msg, ())

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
        st = json.loads(json.dumps(self.job(rec.job_id, history=1), default=str))
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
                await asyncio.to_thread(self.store.put_model, rec.job_id, name, state,
                                        {"step": str(step), "job_id": rec.job_id})
            except (OSError, LocalError) as e:
                rec.unstored[name] = reason(e)
                rec.log(f"checkpoint {name} NOT stored in {self.store.job_dir(rec.job_id)}: "
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
                await self.send(rec.submitter, JobOutput(job_id=rec.job_id, name=name), (blob,))
        except (LocalError, OSError, TimeoutError) as e:
            rec.log(f"checkpoint {name} not sent to {rec.submitter}: {reason(e)}")
            return
        rec.log(f"checkpoint {name} sent to {rec.submitter}")

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
        upload = await asyncio.to_thread(_checked_data, upload, spec)
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
        first = meta.get("first_step", 0)
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < spec.steps:
            raise JobRefused(f"first_step must be an integer in [0, {spec.steps}) (the job's "
                             f"steps), got {first!r}")
        view = self.view()
        if view is None:
            raise JobRefused("this daemon is not in a cluster: `fusionctl init` or `join` first")
        sets = await self._member_ops(view)
        left_out = "".join(f"; {m} was left out: {w}" for m, w in sorted(sets.unknown.items()))
        try:
            cluster, addresses, memory = cluster_for_planner(view, exclude=sets.unknown,
                                                             op_sets=sets.ops)
        except JobRefused as e:
            raise JobRefused(f"{e}{left_out}") from None
        why = refuse_unrunnable(captured.graph, sets, cluster.ids())
        if why is not None:
            raise JobRefused(why + left_out)
        check_capacity(captured, spec, memory)
        job_id = meta.get("job_id") or f"{spec.name}-{secrets.token_hex(3)}"
        taken = self._jobs.get(job_id) if isinstance(job_id, str) else None
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
                                                     cluster, memory, stages)
        why = self._not_leading()  # planning took a while: still ours to start?
        if why is not None:
            raise NotScheduler(f"{why}: only the scheduler starts jobs")
        term = int(getattr(view, "term", 0))
        summary = {
            "job_id": job_id, "name": spec.name, "steps": spec.steps,
            "stages": [{"stage": s.stage, "node": s.node_id} for s in layout.stages],
            "densities": dict(layout.densities), "plan": plan_text,
            # the planner's decisions as data (None for a `--stages` cut): stages with machine
            # ids and op ranges, links in bytes/s as the planner saw them
            "plan_summary": plan_summary(plan) if plan is not None else None,
            "output": str(spec.output),
        }
        summary["term"] = term  # (a submitter takes a handed-back job's next turn by it)
        if dry_run:
            return summary
        tps = spec.data.seq_len if spec.data.kind == "text" else 0
        rec_box: list[JobRecord] = []

        def on_step(m: StepMetrics) -> None:
            self._on_step(rec_box[0], m)

        def on_checkpoint(step: int, state: dict[str, torch.Tensor]) -> None:
            r = rec_box[0]
            r.checkpoint = (step, state)
            self._spawn(self._checkpoint_out(r, step, state), f"checkpoint {r.job_id}")

        coord = self._coordinator(spec, captured, layout, plan, cluster, addresses, term=term,
                                  plan_version=term * PLAN_EPOCH + 1, first_step=first,
                                  tokens_per_sample=tps, on_step=on_step,
                                  on_checkpoint=on_checkpoint, corpus=corpus)
        ready_s, recv_s = coord.ready_timeout_s, coord.recv_timeout_s
        rec = JobRecord(job_id, spec, layout, coord, plan_text, time.time(), tps,
                      submitter=submitter if submitter != self.node_id else "", plan=plan,
                      stages=stages, first_step=first, restarts=used, term=term,
                      owner_uid=None if submitter and submitter != self.node_id else owner_uid)
        if rec.submitter:
            rec.update_cursor = rec.history.cursor()
        else:
            rec.upload = upload  # to fail the job over from here if this daemon steps down
        rec_box.append(rec)
        self._jobs[job_id] = rec
        rec.log(f"submitted: {spec.steps} steps"
                + (f" from step {first} (resumed)" if first else "")
                + f" on {len(layout.stages)} stages ("
                + ", ".join(f"{s.stage}:{s.node_id}" for s in layout.stages) + ")")
        rec.log(software_line(captured.graph, sets))
        rec.log(f"timeouts from the measured links: Ready within {ready_s:.0f}s; a stage waits "
                + ("its own bound" if recv_s is None else f"at least {recv_s:.0f}s")
                + " for its inputs")
        rec.task = asyncio.create_task(self._run(rec), name=f"job {job_id}")
        self._persist(job_id)
        if rec.submitter:
            self._spawn(self._push(rec), f"updates {job_id}")
        else:
            self._spawn(self._keep_steps(job_id), f"steps {job_id}")
        c = spec.compression
        if plan is not None and c.adatopk and c.density is None and c.readapt_interval_s > 0:
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
            send=self.send, spec=spec, captured=captured, layout=layout, addresses=addresses,
            term=term, plan_version=plan_version, first_step=first_step,
            ready_timeout_s=ready_s, failure_grace_s=self.failure_grace_s,
            tokens_per_sample=tokens_per_sample, on_step=on_step, on_checkpoint=on_checkpoint,
            corpus=corpus, recv_timeout_s=recv_s)

    async def _layout(self, job_id: str, spec: JobSpec, captured: CapturedModel,
                      state: Mapping[str, torch.Tensor], cluster: Cluster,
                      memory: Mapping[str, int], stages: int | None,
                      ) -> tuple[JobLayout, Plan | None, str]:
        """Cut the job over `stages` machines of `cluster` (this node first), or plan it on
        `cluster` (OP-Fence); the stages start from `state`. `JobRefused` if it cannot run."""
        if stages is not None:
            ids = ([self.node_id] if self.node_id in cluster.ids() else []) \
                + [n for n in cluster.ids() if n != self.node_id]
            if stages > len(ids):
                raise JobRefused(f"{stages} stages asked, the cluster has {len(ids)} alive "
                                 "members")
            cut = contiguous_assignment(captured.graph, stages)
            op_nodes = {op: ids[p] for op, p in cut.items()}
            layout = await asyncio.to_thread(
                layout_job, job_id, captured.graph, state, op_nodes,
                density=spec.compression.density, exact=spec.compression.exact_edges,
                int8=spec.compression.int8)
            why = refuse_stages(captured.graph, {s.stage: (s.node_id, s.partition.node_ids)
                                                 for s in layout.stages},
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

    async def _member_ops(self, view: Any) -> MemberOpSets:
        """The alive members' op sets (fetching the lists of digests not seen before)."""
        if self.op_sets is None:
            return MemberOpSets()
        return await self.op_sets.resolve(view)

    def _sets_of(self, cluster: Cluster) -> MemberOpSets:
        """The op sets the planner's `cluster` was built with, with the members' profiles."""
        view = self.view()
        profiles = {m.node_id: dict(m.profile or {}) for m in (view.members if view else ())}
        return MemberOpSets({m.id: m.ops for m in cluster.machines}, {}, profiles)

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
                current = dict(layout.densities)
                edges = [e.edge for e in layout.edges()]
            view = self.view()
            if view is None or plan is None or self._not_leading() is not None:
                continue  # a daemon without the lease decides nothing (it hands the job back)
            try:
                cluster, _, _ = cluster_for_planner(view)
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

    def _on_step(self, rec: JobRecord, m: StepMetrics) -> None:
        d = m.as_dict()
        if rec.first_loss is None and m.loss is not None:
            rec.first_loss = m.loss
        rec.history.add(d)
        self._steps_arrived(rec.job_id)
        every = max(1, rec.spec.steps // 20)
        if (m.step + 1) % every == 0 or m.step + 1 == rec.spec.steps:
            rate = d.get("tokens_per_s") or d.get("samples_per_s") or 0.0
            rec.log(f"step {m.step + 1}/{rec.spec.steps} loss "
                    f"{'-' if m.loss is None else f'{m.loss:.4f}'} {rate:.0f} "
                    f"{'tokens' if d.get('tokens_per_s') else 'samples'}/s wire "
                    f"{m.wire_bytes} B/step")

    async def _run(self, rec: JobRecord) -> None:
        try:
            await self._run_attempts(rec)
        finally:  # also when the daemon stops (cancelled): the record says how it ended
            self._persist(rec.job_id)
            if rec.state in FINAL:
                self._release(rec)
            if not rec.submitter and not self._closed:
                self._spawn(self._retire_when_saved(rec.job_id), f"steps {rec.job_id}")
                self._prune_outputs()

    @staticmethod
    def _release(rec: JobRecord) -> None:
        """A job that ended keeps its record (while it has outputs to fetch, or coordinated
        for another daemon) but not what only a run needs: the captured model, the corpus,
        the partitions' results, the last checkpoint, the upload. Each of them is a model's
        worth of bytes, and a long-lived daemon used to keep all of them for every job."""
        rec.coord.release()
        rec.checkpoint = None
        rec.upload = None
        rec.plan = None

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
                    + (f"stored in {self.store.job_dir(rec.job_id)} (`fusionctl fetch "
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
            closed=self._closed, handed_back=rec.handed_back,
            not_leading=None if rec.handed_back else self._not_leading())
        if decision.hand_back is not None:
            rec.handed_back = decision.hand_back
        if decision.log is not None:
            rec.log(decision.log)
        if not decision.restart:
            return False
        view = self.view()
        now = time.monotonic()
        for m in decision.exclude:
            rec.excluded[m] = (_incarnation(view, m), now, decision.refused)
        try:
            if view is None:
                raise JobRefused("this daemon left the cluster")
            excluded = self._excluded_now(rec, view, now)
            sets = await self._member_ops(view)
            cluster, addresses, memory = cluster_for_planner(
                view, exclude=excluded | set(sets.unknown), op_sets=sets.ops)
            old = rec.coord
            captured = old.captured
            if captured is None:  # released: the job had ended
                raise JobRefused("the job's model was released when it ended")
            first, state = rec.first_step, captured.state
            if rec.checkpoint is not None:
                step, ckpt = rec.checkpoint
                first = step + 1
                state = {k: ckpt.get(k, v) for k, v in captured.state.items()}
            check_capacity(captured, rec.spec, memory)
            stages = None if rec.stages is None else min(rec.stages, len(cluster.ids()))
            version = old.plan_version + 1
            layout, plan, text = await self._layout(rec.job_id, rec.spec, captured, state,
                                                    cluster, memory, stages)
            captured = replace(captured, state=state)  # what the new Assigns ship
        except (FusionError, ValueError) as e:
            rec.log(f"cannot restart the job: {e}")
            return False
        rec.restarts += 1
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

    def _hold(self, rec: JobRecord, state: dict[str, torch.Tensor]) -> None:
        """Keep the final weights of `rec` in memory (they could not be stored); at most
        `MAX_HELD_JOBS` jobs hold weights, the oldest lets go."""
        rec.held = state
        holding = sorted((r for r in self._jobs.values() if r.held is not None),
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
        where = self.store.job_dir(rec.job_id)
        failures: list[str] = []
        if state is not None:
            try:
                await asyncio.to_thread(self.store.put_model, rec.job_id, MODEL, state,
                                        {"job_id": rec.job_id})
                rec.unstored.pop(MODEL, None)
                rec.held = None
            except (OSError, LocalError) as e:
                rec.unstored[MODEL] = reason(e)
                failures.append(f"{MODEL}: {reason(e)}")
                self._hold(rec, state)
        try:
            await asyncio.to_thread(self.store.put_metrics, rec.job_id, list(rec.history),
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
                await self.send(rec.submitter, JobOutput(job_id=rec.job_id, name=MODEL,
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
            await self.send(rec.submitter, ack, ())

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
        if isinstance(got, JobRecord) and not got.submitter and got.unstored \
                and got.state in FINAL:
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
            self._persist(job_id)
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
        r = got
        if r.state != "running":
            return {"job_id": job_id, "state": r.state, "cancelled": False}
        r.cancel_requested = True
        r.log("cancel requested")
        await r.coord.cancel()
        if r.task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(r.task), 15.0)
        return {"job_id": job_id, "state": r.state, "cancelled": True}

