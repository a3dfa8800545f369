"""What a daemon keeps of each job it knows in this run: `JobRecord`, a job coordinated here
(submitted here, or for another submitting daemon), and `RemoteJob`, a job submitted here and
coordinated by the scheduler elsewhere. Plain records: the scheduler role (`Scheduling`,
fusiond/jobs/scheduling.py) and the submitter role (`Submissions`, fusiond/jobs/submission.py)
change them, `JobService` (fusiond/jobs/service.py) persists and retires them,
`fusiond.jobs.views` renders them for the API.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusiond.jobs.assign import JobLayout
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.history import Cursor, StepHistory
from fusiond.jobs.upload import Upload
from fusiond.plan import Plan
from fusiond.train.codec import EdgeCodec
from fusiond.train.local import StepMetrics
from fusiond.train.spec import JobSpec
from protocol.messages import JobQueryReply

__all__ = ["FINAL", "LOG_LINES", "JobRecord", "RemoteJob", "steps_done"]

log = logging.getLogger("fusiond.jobs")

LOG_LINES = 500
"""Log lines kept per job (`fusionctl logs`)."""
FINAL = ("done", "failed", "cancelled")
"""The states a job ends in."""


@dataclass
class RemoteJob:
    """A job submitted here and coordinated by the scheduler elsewhere: its last status, and
    what this daemon keeps of it (the full step history, the outputs in its store)."""

    job_id: str
    scheduler: str
    output: Path
    status: dict[str, Any]
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    upload: Upload | None = None
    """What was forwarded (kept to resubmit if the scheduler dies)."""
    max_restarts: int = 0
    restarts: int = 0
    checkpoint: Path | None = None
    """The last checkpoint the scheduler sent here (a resubmission resumes from it)."""
    failing_over: bool = False
    notes: list[str] = field(default_factory=list)
    """This daemon's own log lines for the job (failover, outputs), before the scheduler's."""
    owner_uid: int | None = None
    """The user who submitted it (None: the daemon's operator only)."""
    history: StepHistory = field(default_factory=StepHistory)
    """Every step record the schedulers sent (survives failovers; persisted)."""
    pending_checkpoint: tuple[int, Path] | None = None
    """A checkpoint stored before the history covered the steps it follows (promoted to
    `checkpoint` once it does, so a failover resumes without a gap in the history)."""
    unstored: dict[str, str] = field(default_factory=dict)
    """Output name -> why it could not be stored here."""
    held_by: str | None = None
    """The scheduler holding the weights this daemon could not store (`fusionctl fetch`)."""
    finishing: bool = False
    """The final update arrived; metrics.json is being stored (the state stays running)."""
    storage_failed: bool = False
    """It trained to the end but its outputs could not be stored: done once they are."""
    submitted_at: float = field(default_factory=time.time)
    term: int = 0
    """The scheduler's term when it took the job: after it gave the job back, it may take a
    resubmission only in a newer term."""
    heard: float = field(default_factory=time.monotonic)
    """When the scheduler last said something about the job (monotonic clock)."""
    query: asyncio.Future[JobQueryReply] | None = None
    stream_through: int = -1
    """The last step of the records taken from the current scheduler's updates (-1: none
    yet): an update whose records follow a later one (`JobUpdate.after`) comes after a lost
    one, and the records are asked for again."""
    resend_asked: float = -math.inf
    """When this daemon last asked the scheduler to send records again (monotonic clock)."""

    @property
    def state(self) -> str:
        return str(self.status.get("state", "running"))

    def note(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S', time.gmtime())} {text}")
        log.info("job %s: %s", self.job_id, text)


@dataclass
class JobRecord:
    job_id: str
    spec: JobSpec
    layout: JobLayout
    coord: JobCoordinator
    plan_text: str
    submitted_at: float
    tokens_per_sample: int
    state: str = "running"
    task: asyncio.Task[None] | None = None
    cancel_requested: bool = False
    history: StepHistory = field(default_factory=StepHistory)
    logs: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    outcome: dict[str, Any] | None = None
    first_loss: float | None = None
    submitter: str = ""
    """The daemon that took the submission; its outputs go there (empty: this one)."""
    plan: Plan | None = None
    """The planner's plan (None for a `--stages` cut): AdaTopK re-adapts on its cut."""
    stages: int | None = None
    """The `--stages` count asked for (None: planned)."""
    replicas: int = 1
    """The `--replicas` count asked for with `--stages` (machines per stage)."""
    first_step: int = 0
    """The step the job started at (> 0: resumed from a checkpoint with `--resume`)."""
    restarts: int = 0
    checkpoint: tuple[int, dict[str, torch.Tensor]] | None = None
    """The last whole-model checkpoint: (step, state after that step), to resume from."""
    plan_data: dict[str, Any] | None = None
    """`plan_summary` of the last plan, kept once the plan itself is released (job ended)."""
    checkpoint_step: int | None = None
    """The step of the last checkpoint (kept after `checkpoint` is released at the end)."""
    checkpoint_at: float | None = None
    """When it arrived (Unix time): the dashboard shows its age."""
    excluded: dict[str, tuple[int | None, float, bool]] = field(default_factory=dict)
    """Machines that failed this job -> (their incarnation then, when (monotonic clock),
    whether they refused their partition): later attempts are planned without them until they
    restarted (a new incarnation) or, for a machine that failed rather than refused,
    `EXCLUDE_FOR_S` passed (`_excluded_now`)."""
    earlier: list[StepMetrics] = field(default_factory=list)
    """Metrics of the steps earlier attempts made and the current one resumed from."""
    owner_uid: int | None = None
    codecs: dict[str, EdgeCodec] | None = None
    """The cut edges' codecs as the per-link choice last re-adapted them (None: the
    layout's own)."""
    """The user who submitted it here (None: the daemon's operator only; always None for a
    job coordinated for another submitting daemon)."""
    update_cursor: Cursor = field(default_factory=Cursor)
    """How far the step history went to the remote submitter (registered on `history` when
    the job has one: `history.cursor()`)."""
    held: dict[str, torch.Tensor] | None = None
    """The final weights, kept in memory because they could not be stored (here, or on the
    submitter); `fusionctl fetch` (or the submitter's `JobFetch`) stores them again."""
    unstored: dict[str, str] = field(default_factory=dict)
    """Output name -> why it could not be stored (a job submitted here)."""
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    storage_failed: bool = False
    """It trained to the end but its outputs could not be stored: done once they are."""
    upload: Upload | None = None
    """What was submitted here (a job of this daemon's own submitter, kept to fail it over)."""
    term: int = 0
    """The term this daemon scheduled the job in."""
    handed_back: str = ""
    """Why this daemon gave the job up (it lost the scheduler's lease); empty while it runs."""
    stale_lease: int = -1
    """The term in which this daemon last noted it is no longer the scheduler (logged once)."""

    def log(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        self.logs.append(f"{stamp} {text}")
        log.info("job %s: %s", self.job_id, text)


def steps_done(r: JobRecord) -> int:
    """Steps of the job done so far (a resumed job counts the steps before it started)."""
    return int(r.history[-1]["step"]) + 1 if r.history else r.first_step
