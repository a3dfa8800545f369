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
daemon is not the scheduler; the scheduler runs the coordinator, streams `JobUpdate`s back
(the status, and every step record since the last update) and sends the outputs
(`JobOutput`), which the submitting daemon stores durably and acknowledges (`JobOutputAck`):
the job is done only once the model is stored there. If it cannot be (a full disk), the
job ends failed saying why, and the scheduler keeps the weights in memory until the submitter
asks for them again (`JobFetch`, from `fusionctl fetch ID`). Without a scheduler (no quorum
yet) a submission waits for one (`SCHEDULER_WAIT_S`), then is refused: only the scheduler of the
current term, holding its lease (the view's leader is itself, with a quorum), plans, re-plans or
re-adapts a job. A scheduler that loses its quorum stops at once: its attempts are cancelled and
each job is handed back to its submitter, which resubmits it to the next scheduler
(`_failover`), as when the scheduler dies. A submitter that stops hearing from its scheduler
asks it (`JobQuery`) and fails over, or fails the job, when the scheduler no longer knows it.
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
from collections import deque
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
)
from fusiond.jobs.opsets import (
    MemberOpSets,
    OpSetService,
    refuse_stages,
    refuse_unrunnable,
    software_line,
)
from fusiond.jobs.outputs import (
    CHECKPOINT,
    KEEP_JOBS,
    METRICS,
    MODEL,
    OutputStore,
    checkpoint_name,
    is_output_name,
)
from fusiond.jobs.planning import (
    JobRefused,
    cluster_for_planner,
    layout_from_plan,
    plan_job,
    readapted_densities,
)
from fusiond.jobs.records import LOG_LINES, JobRecord, RemoteJob, steps_done
from fusiond.jobs.runner import EXCLUDE_FOR_S as EXCLUDE_FOR_S  # (read by tests as service's)
from fusiond.jobs.runner import decide_restart, derived_timeouts, released_exclusions
from fusiond.jobs.submit import (
    check_capacity,
    check_finite,
    is_default_corpus,
    memory_estimate,
    restore_job,
    resume_state,
)
from fusiond.jobs.upload import Upload, decode_upload, encode_upload, read_upload
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

__all__ = ["JobService", "cluster_for_planner"]

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
FETCH_TIMEOUT_S = 600.0
"""How long `fusionctl fetch` waits for held outputs to be stored again."""
UPDATE_S = 0.5
"""How often the scheduler sends a remote submitter the job's status."""
SUBMIT_TIMEOUT_S = 300.0
"""How long a forwarded submission waits for the scheduler's answer (planning a big model)."""
VIEW_RECHECK_S = 0.25
"""A wait for a scheduler wakes on every change of the cluster's view (`on_view`: at once,
where it polled every 0.1 s), and re-reads the view at least this often besides (a lease
that lapses without a change the cluster reports; a view handed in without a callback)."""
FORWARD_CHECK_S = 0.5
"""How often a submission forwarded to a scheduler checks that it is still the scheduler."""
FINAL = ("done", "failed", "cancelled")
REMOTE_SEND_S = 10.0
"""Bound on one status update to a remote submitter."""
REMOTE_OUTPUTS_S = 600.0
"""Bound on sending a job's outputs back to its submitter."""
PLAN_EPOCH = 1024
"""A job's first plan version at a scheduler is `term * PLAN_EPOCH + 1`, and each restart adds
one (`max_restarts` <= 100): versions grow across restarts and across schedulers, so a stage's
newer Assign supersedes a stale one and stale tensors are told apart by version alone."""
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
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}-[0-9a-f]{6}")


class NotScheduler(JobRefused):
    """This daemon is not (or no longer) the scheduler holding the lease: ask the next one."""


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


def _why(e: BaseException) -> str:
    """An error in a few words for a log line or a failure ("[Errno 28] No space left on
    device: '/var/lib/fusion/outputs/x/.model...tmp'" -> "No space left on device")."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


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
        self._remote: dict[str, RemoteJob] = {}
        self._pending: dict[str, asyncio.Future[JobSubmitReply]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._by_type = self._handlers()
        self._view_changed = asyncio.Event()
        """Set (and replaced) on every change of the cluster's view: what waits for a
        scheduler wakes on it instead of polling."""

    # -- service ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._history is not None:
            self._past = await asyncio.to_thread(self._history.load)
        await asyncio.to_thread(self.store.sweep)
        await self.worker.start()

    async def ready(self) -> None:
        await self.worker.ready()

    async def close(self) -> None:
        """Stop the jobs coordinated here (their stages get JobCancel): one submitted here is
        cancelled, another daemon's goes back to it for the next scheduler (a hand-back); then
        the stages hosted here. Idempotent."""
        if self._closed:
            return
        self._closed = True
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

    def _remote_ended(self, r: RemoteJob) -> None:
        r.ended.set()
        self._persist(r.job_id)
        if not self._closed:  # (close() writes what is left itself)
            self._spawn(self._retire_when_saved(r.job_id), f"steps {r.job_id}")
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
        fut = self._pending.get(msg.request_id)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        return True

    async def _on_update_msg(self, peer: str, msg: JobUpdate) -> bool:
        self._on_update(peer, msg)
        return True

    async def _on_output_msg(self, peer: str, msg: JobOutput) -> bool:
        self._heard(peer, msg.job_id)
        await self._on_output(peer, msg)
        return True

    async def _on_output_ack(self, peer: str, msg: JobOutputAck) -> bool:
        ack = self._acks.get(msg.request_id)
        if ack is not None and not ack.done():
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
        r = self._remote.get(msg.job_id)
        if r is not None and peer == r.scheduler and r.query is not None \
                and not r.query.done():
            r.query.set_result(msg)
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
        self._remote[rec.job_id] = r
        self._spawn(self._failover(r, f"this daemon, its scheduler, gave the job up: "
                                      f"{rec.handed_back}"), f"failover {rec.job_id}")
        self._spawn(self._watch(r), f"watch {rec.job_id}")

    def on_view(self, view: Any) -> None:
        """Membership changed: a stage machine declared dead (or gone) fails its job; a dead
        scheduler fails the jobs it coordinated for us; whatever waits for a scheduler looks
        again."""
        changed, self._view_changed = self._view_changed, asyncio.Event()
        changed.set()
        gone = {m.node_id: m.state for m in view.members if m.state in ("dead", "left")}
        for r in list(self._remote.values()):
            if r.state in FINAL or r.scheduler not in gone or r.failing_over:
                continue
            why = (f"job failed on {r.scheduler} (the scheduler): the membership layer "
                   f"declared it {gone[r.scheduler]}")
            if r.upload is not None and r.restarts < r.max_restarts and not self._closed:
                r.failing_over = True
                self._spawn(self._failover(r, why), f"failover {r.job_id}")
                continue
            r.status = {**r.status, "state": "failed",
                        "outcome": {"ok": False, "failure": why}}
            self._remote_ended(r)
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
        yet, wait for one (`SCHEDULER_WAIT_S`). `owner_uid`: the calling user (None: the
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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SCHEDULER_WAIT_S
        while True:
            leader = await self._await_scheduler(deadline)
            try:
                if leader == self.node_id:
                    return await self.submit(upload, dry_run=dry_run, owner_uid=owner_uid)
                summary = await self._forward(upload, leader, dry_run=dry_run)
                break
            except NotScheduler:  # it stepped down meanwhile: ask the next one, once the
                if loop.time() >= deadline:  # view has changed (our view may still name it)
                    raise
                await self._view_change(self._view_changed,
                                        min(VIEW_RECHECK_S, deadline - loop.time()))
        if not dry_run:
            job_id = str(summary["job_id"])
            self._remote[job_id] = RemoteJob(job_id, leader, spec.output, {
                "job_id": job_id, "name": spec.name, "state": "running", "steps": spec.steps,
                "step": 0, "loss": None, "first_loss": None, "stages": len(summary["stages"]),
                "output": str(spec.output), "plan": summary["plan"], "history": [],
                "status": {}, "lines": [], "outcome": None, "eta_s": None,
                "submitted_at": time.time()},
                upload=upload, max_restarts=spec.max_restarts, owner_uid=owner_uid,
                term=int(summary.get("term") or 0))
            self._persist(job_id)
            self._spawn(self._keep_steps(job_id), f"steps {job_id}")
            self._spawn(self._watch(self._remote[job_id]), f"watch {job_id}")
        return summary

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

    async def _await_scheduler(self, deadline: float, *, not_before: tuple[str, int] | None
                               = None) -> str:
        """The scheduler of the cluster once there is one (the view's leader; this daemon only
        with a quorum), waiting until `deadline` (loop time); `not_before`: (a scheduler, its
        term) that gave a job up: it counts again only in a newer term. `NotScheduler` with the
        cluster's own advice when none came."""
        loop = asyncio.get_running_loop()
        while True:
            changed = self._view_changed  # before reading the view: no change slips between
            view = self.view()
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
                advice = getattr(view, "quorum_advice", lambda: None)() \
                    or f"no scheduler elected (term {lead.term})"
                raise NotScheduler(
                    f"no scheduler: {advice}; waited {SCHEDULER_WAIT_S:g}s. A minority of the "
                    "cluster never schedules: `fusionctl status` shows who is alive")
            await self._view_change(changed, min(VIEW_RECHECK_S, deadline - loop.time()))

    @staticmethod
    async def _view_change(changed: asyncio.Event, timeout_s: float) -> None:
        """Until the cluster's view changes (`changed` is the event read before the view
        was), or `timeout_s`."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await changed.wait()
        raise_if_cancelling()
    async def _forward(self, upload: Upload, leader: str, *, dry_run: bool) -> dict[str, Any]:
        """Hand `upload` to the scheduler `leader`; its summary, or `JobRefused`."""
        data = encode_upload(upload.meta, upload.graph_bytes, upload.state_bytes,
                             upload.data_bytes)
        rid = secrets.token_hex(8)
        fut: asyncio.Future[JobSubmitReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self.send(leader, JobSubmit(request_id=rid, dry_run=dry_run), (data,))
            async with asyncio.timeout(SUBMIT_TIMEOUT_S):
                while not fut.done():
                    # Another scheduler elected meanwhile: this one can no longer take the job
                    # (it decides nothing more), and its answer may never come (the
                    # submission, or the answer, lost to a failed dial): the caller asks the
                    # new one. A failover stalled here for SUBMIT_TIMEOUT_S, then failed.
                    await asyncio.wait({fut}, timeout=FORWARD_CHECK_S)
                    lead = self.leadership()
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
            leader = await self._await_scheduler(
                deadline, not_before=None if same_term_ok else (r.scheduler, r.term))
            if r.state in FINAL:  # cancelled meanwhile
                return
            view = self.view()
            alive = sum(1 for m in view.members if m.state == "alive") if view is not None \
                else 1
            meta = {**r.upload.meta, "job_id": r.job_id, "restarts": r.restarts + 1}
            state_bytes = r.upload.state_bytes
            if r.checkpoint is not None:
                state_bytes, first = await asyncio.to_thread(self._resume_bytes, r.upload,
                                                             r.checkpoint)
                meta["first_step"] = first
            if isinstance(meta.get("stages"), int):
                meta["stages"] = max(1, min(meta["stages"], alive))
            start = int(meta.get("first_step") or 0)
            # Where the resubmission starts: a checkpoint sent here, else where the job itself
            # started (a job submitted with --resume starts past step 0).
            whence = (f" from {r.checkpoint.name} (step {start})" if r.checkpoint is not None
                      else f" from step {start}, where it started (no checkpoint came yet)")
            upload = Upload(meta, r.upload.graph_bytes, state_bytes, r.upload.data_bytes)
            while True:
                try:
                    if leader == self.node_id:
                        summary = await self.submit(upload, owner_uid=r.owner_uid)
                        self._remote.pop(r.job_id, None)  # `get` finds the local record
                        took = self._jobs[r.job_id]
                        took.upload = upload
                        self._adopt(r, took)
                        lines.append(f"{time.strftime('%H:%M:%S', time.gmtime())} this daemon "
                                     f"is the new scheduler: it runs the job{whence}")
                        took.logs = deque([*lines, *took.logs], maxlen=LOG_LINES)
                    else:
                        summary = await self._forward(upload, leader, dry_run=False)
                    break
                except NotScheduler:  # it stepped down meanwhile: the next one, in time
                    if loop.time() >= deadline:
                        raise
                    await self._view_change(self._view_changed,
                                            min(VIEW_RECHECK_S, deadline - loop.time()))
                    leader = await self._await_scheduler(deadline)
        except asyncio.CancelledError:
            raise
        except (FusionError, TimeoutError, OSError, ValueError) as e:
            cause = (f"no new scheduler within {FAILOVER_WAIT_S:g}s: {e}"
                     if isinstance(e, NotScheduler) else str(e))
            r.status = {**r.status, "state": "failed", "outcome": {
                "ok": False, "failure": f"{why}; resubmitting failed: {cause}"}}
            self._remote_ended(r)
            return
        if r.state in FINAL:  # cancelled while it was being resubmitted: stop it there too
            rec = self._jobs.get(r.job_id)
            if rec is not None:
                rec.cancel_requested = True
                await rec.coord.cancel()
            else:
                await self.send(leader, JobCancel(job_id=r.job_id, reason="cancelled by the "
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

    @staticmethod
    def _adopt(r: RemoteJob, took: JobRecord) -> None:
        """This daemon became the scheduler of a job submitted here: its record keeps the
        steps done before the failover (the new attempt appends to them) and the outputs."""
        took.history = StepHistory([h for h in r.history if int(h["step"]) < took.first_step]
                                   + list(took.history))
        took.submitted_at = r.submitted_at
        losses = [h.get("loss") for h in took.history if h.get("loss") is not None]
        took.first_loss = losses[0] if losses else took.first_loss

    @staticmethod
    def _resume_bytes(upload: Upload, checkpoint: Path) -> tuple[bytes, int]:
        """The upload's weights replaced by `checkpoint`'s (checked), and the step to start."""
        meta = upload.meta
        _, captured = restore_job(meta["toml"], meta["base"], meta["out_base"],
                                  upload.graph_bytes, upload.state_bytes, check_paths=False)
        state, first = resume_state(captured, checkpoint)
        return state_to_bytes(state), first

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

    def _heard(self, peer: str, job_id: str) -> None:
        r = self._remote.get(job_id)
        if r is not None and peer == r.scheduler:
            r.heard = time.monotonic()

    def _on_update(self, peer: str, msg: JobUpdate) -> None:
        """The scheduler's status of a job submitted here, and the step records since its
        last update (appended to this daemon's own history: it outlives schedulers)."""
        r = self._remote.get(msg.job_id)
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
        self._promote_checkpoint(r)
        if msg.steps:
            self._steps_arrived(r.job_id)
        if msg.handed_back:  # the scheduler lost its lease and gave the job up
            r.status = {**dict(msg.status), "state": "running"}
            self._start_failover(r, f"the scheduler {peer} gave the job up: {msg.handed_back}")
            return
        if not msg.status:
            return  # steps only (the status follows in the last of a batch)
        status = dict(msg.status)
        if str(status.get("state", "running")) in FINAL:
            r.finishing = True  # running until metrics.json is stored (`_finish_remote`)
            r.status = {**status, "state": "running"}
            self._spawn(self._finish_remote(r, status), f"finish {r.job_id}")
            return
        r.status = status

    def _ask_resend(self, r: RemoteJob, why: str) -> None:
        """Ask `r`'s scheduler for its step records after the last one taken, and the status
        (`JobQuery.through`; at most once a second)."""
        now = time.monotonic()
        if now - r.resend_asked < 1.0:
            return
        r.resend_asked = now
        log.info("job %s: asking the scheduler %s to send again: %s", r.job_id, r.scheduler, why)

        async def ask() -> None:
            with contextlib.suppress(LocalError, OSError, TimeoutError):
                async with asyncio.timeout(QUERY_TIMEOUT_S):
                    await self.send(r.scheduler, JobQuery(job_id=r.job_id,
                                                          through=r.stream_through), ())

        self._spawn(ask(), f"resend {r.job_id}")

    def _promote_checkpoint(self, r: RemoteJob) -> None:
        """A stored checkpoint after step s becomes the one a failover resumes from once the
        history holds every step up to s (else the resumed history would have a gap)."""
        if r.pending_checkpoint is None:
            return
        step, path = r.pending_checkpoint
        if r.history and int(r.history[-1]["step"]) >= step:
            r.checkpoint = path
            r.pending_checkpoint = None

    async def _finish_remote(self, r: RemoteJob, status: dict[str, Any]) -> None:
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
                self.store.files, r.job_id)}:
            why = r.unstored.get(MODEL, "it never arrived")
            r.unstored[MODEL] = why
            state = "failed"
            r.storage_failed = True
            outcome = {**outcome, "ok": False, "failure": (
                f"the model could not be stored on this machine ({why})")}
        try:
            await asyncio.to_thread(self.store.put_metrics, r.job_id, list(r.history),
                                    self._metrics_summary(r.history, outcome, r.submitted_at))
            r.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            r.unstored[METRICS] = _why(e)
            r.note(f"metrics.json not stored in {self.store.job_dir(r.job_id)}: {_why(e)}")
            if state == "done":
                state = "failed"
                r.storage_failed = True
                outcome = {**outcome, "ok": False, "failure": (
                    f"metrics.json could not be stored on this machine ({_why(e)}); the "
                    f"step history is kept: free space, then `fusionctl fetch {r.job_id}`")}
        r.status = {**status, "state": state, "outcome": outcome}
        if state == "failed" and outcome.get("failure"):
            r.note(f"failed: {outcome['failure']}")
        r.finishing = False
        self._remote_ended(r)

    @staticmethod
    def _metrics_summary(history: StepHistory, outcome: Mapping[str, Any],
                         submitted_at: float) -> dict[str, Any]:
        """metrics.json's summary: the outcome, with the figures of the full history."""
        losses = [h.get("loss") for h in history if h.get("loss") is not None]
        return {**outcome, "steps": len(history), "first_loss": losses[0] if losses else None,
                "final_loss": losses[-1] if losses else None,
                "first_step": int(history[0]["step"]) if history else None,
                "last_step": int(history[-1]["step"]) if history else None,
                "thinned_steps": history.thinned,
                "wall_s": outcome.get("wall_s", time.time() - submitted_at)}

    def _start_failover(self, r: RemoteJob, why: str, *, same_term_ok: bool = False) -> None:
        """Fail `r` over to the next scheduler, or fail it when it has no restart left."""
        if r.failing_over or r.state in FINAL:
            return
        if r.upload is not None and r.restarts < r.max_restarts and not self._closed:
            r.failing_over = True
            self._spawn(self._failover(r, why, same_term_ok=same_term_ok),
                        f"failover {r.job_id}")
            return
        r.status = {**r.status, "state": "failed", "outcome": {
            "ok": False, "failure": f"{why}; no restart left (job.max_restarts = "
                                    f"{r.max_restarts})"}}
        self._remote_ended(r)

    async def _watch(self, r: RemoteJob) -> None:
        """While `r` runs elsewhere: if its scheduler says nothing about it for
        `STALE_UPDATE_S`, ask (`JobQuery`); a scheduler that no longer knows the job (it
        restarted, or lost it) gets it failed over, and one that stays silent for
        `FAILOVER_WAIT_S` fails it, naming the scheduler. Within the failover bound either way."""
        while r.state not in FINAL and not self._closed and self._remote.get(r.job_id) is r:
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
                self._remote_ended(r)

    async def _query(self, r: RemoteJob) -> JobQueryReply | None:
        """Ask `r`'s scheduler about the job; its answer, or None within `QUERY_TIMEOUT_S`."""
        fut: asyncio.Future[JobQueryReply] = asyncio.get_running_loop().create_future()
        r.query = fut
        try:
            async with asyncio.timeout(QUERY_TIMEOUT_S):
                # (through: what it sent that did not come, the final update included, comes
                # again)
                await self.send(r.scheduler, JobQuery(job_id=r.job_id,
                                                      through=r.stream_through), ())
                return await fut
        except (LocalError, OSError, TimeoutError) as e:
            log.info("job %s: no answer from the scheduler %s: %s", r.job_id, r.scheduler, e)
            return None
        finally:
            r.query = None

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

    async def _on_output(self, peer: str, msg: JobOutput) -> None:
        """An output of a job submitted here, from its scheduler: store it durably in this
        daemon's output store and, when asked, acknowledge (the scheduler keeps the weights
        until then)."""
        r = self._remote.get(msg.job_id)
        name = msg.name
        if r is None or peer not in (r.scheduler, r.held_by):
            return
        ok, why = False, ""
        if not is_output_name(name) or name == METRICS:
            why = f"output name {name!r} refused"
            log.warning("job %s: %s (from %s)", msg.job_id, why, peer)
        else:
            try:
                await asyncio.to_thread(self.store.put_bytes, r.job_id, name, msg.payload)
                ok = True
            except (OSError, LocalError) as e:
                why = _why(e)
        if ok:
            r.unstored.pop(name, None)
            m = CHECKPOINT.fullmatch(name)
            if m:
                r.pending_checkpoint = (int(m.group(1)) - 1, self.store.job_dir(r.job_id) / name)
                self._promote_checkpoint(r)
        else:
            r.unstored[name] = why
            r.note(f"{name} not stored in {self.store.job_dir(r.job_id)}: {why}")
        if msg.request_id:
            await self.send(peer, JobOutputAck(job_id=r.job_id, request_id=msg.request_id,
                                               ok=ok, message=why), ())

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
                rec.unstored[name] = _why(e)
                rec.log(f"checkpoint {name} NOT stored in {self.store.job_dir(rec.job_id)}: "
                        f"{_why(e)} (the job goes on; it resumes from an earlier one)")
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
            rec.log(f"checkpoint {name} not sent to {rec.submitter}: {_why(e)}")
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
            del self._remote[job_id]
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
                rec.unstored[MODEL] = _why(e)
                failures.append(f"{MODEL}: {_why(e)}")
                self._hold(rec, state)
        try:
            await asyncio.to_thread(self.store.put_metrics, rec.job_id, list(rec.history),
                                    self._metrics_summary(rec.history, summary,
                                                          rec.submitted_at))
            rec.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            rec.unstored[METRICS] = _why(e)
            failures.append(f"{METRICS}: {_why(e)}")
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
                   else _why(e))
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
            await self._fetch_remote(got)
        return self.outputs(job_id)

    async def _fetch_remote(self, r: RemoteJob) -> None:
        """Ask the scheduler holding the model again (`JobFetch`), then store metrics.json."""
        if MODEL in r.unstored:
            holder = r.held_by or r.scheduler
            rid = secrets.token_hex(8)
            fut: asyncio.Future[JobOutputAck] = asyncio.get_running_loop().create_future()
            self._acks[rid] = fut
            try:
                await self.send(holder, JobFetch(job_id=r.job_id, request_id=rid), ())
                async with asyncio.timeout(FETCH_TIMEOUT_S):
                    ack = await fut
            except (LocalError, OSError) as e:
                raise LocalError(f"the scheduler {holder} holding the model of job {r.job_id} "
                                 f"cannot be reached: {_why(e)}") from None
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
            await asyncio.to_thread(self.store.put_metrics, r.job_id, list(r.history),
                                    self._metrics_summary(r.history, outcome, r.submitted_at))
            r.unstored.pop(METRICS, None)
        except (OSError, LocalError) as e:
            r.unstored[METRICS] = _why(e)
            raise LocalError(f"metrics.json of job {r.job_id} is still not stored in "
                             f"{self.store.job_dir(r.job_id)}: {_why(e)}") from None
        r.unstored.pop(MODEL, None)
        r.held_by = None
        if r.storage_failed:
            r.storage_failed = False
            r.status = {**r.status, "state": "done", "outcome": {
                **outcome, "ok": True, "failure": None, "held_by": None}}
        self._persist(r.job_id)

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
            if got.state in FINAL:
                return {"job_id": job_id, "state": got.state, "cancelled": False}
            if got.failing_over:  # no scheduler has it now: it is not resubmitted
                got.status = {**got.status, "state": "cancelled", "outcome": {
                    "ok": False, "failure": f"cancelled by the user on {self.node_id} while "
                                            "failing over"}}
                self._remote_ended(got)
                return {"job_id": job_id, "state": "cancelled", "cancelled": True}
            await self.send(got.scheduler, JobCancel(job_id=job_id, reason="cancelled by the "
                                                     f"user on {self.node_id}"), ())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got.ended.wait(), 20.0)
            return {"job_id": job_id, "state": got.state, "cancelled": got.state == "cancelled"}
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

