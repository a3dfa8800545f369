"""What the local API shows of jobs (`fusionctl jobs`, `job ID`, `logs ID`, `outputs`), as pure
functions of the records (`fusiond.jobs.records`), the persisted past ones (plain dicts, as
`JobService._retire` wrote them) and the store's file list. `JobService` keeps the methods the
API calls (`jobs`, `job`, `logs`, `outputs`, `owner`, `output_dir`) and passes what they read.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fusiond.jobs.outputs import StoredFile
from fusiond.jobs.records import JobRecord, RemoteJob, steps_done
from fusiond.plan.render import plan_summary

__all__ = [
    "JOBS_KEYS",
    "jobs_view",
    "logs_view",
    "output_dir_of",
    "outputs_brief",
    "outputs_view",
    "owner_of",
    "past_view",
    "record_brief",
    "record_view",
    "remote_view",
]

JOBS_KEYS = ("job_id", "name", "state", "steps", "step", "loss", "first_loss", "stages",
             "submitted_at", "output", "scheduler", "owner_uid")
"""The fields of one job in `fusionctl jobs`."""


def record_brief(r: JobRecord, scheduler: str) -> dict[str, Any]:
    """One line of `fusionctl jobs` for a job coordinated here (by `scheduler`)."""
    last = r.history[-1] if r.history else {}
    return {"job_id": r.job_id, "name": r.spec.name, "state": r.state,
            "steps": r.spec.steps, "step": steps_done(r),
            "loss": last.get("loss"), "first_loss": r.first_loss,
            "stages": len(r.layout.stages), "submitted_at": r.submitted_at,
            "output": str(r.spec.output), "scheduler": scheduler,
            "owner_uid": r.owner_uid}


def outputs_brief(files: Iterable[StoredFile]) -> dict[str, dict[str, Any]]:
    """name -> {size_bytes, sha256} of a job's stored outputs."""
    return {f.name: {"size_bytes": f.size_bytes, "sha256": f.sha256} for f in files}


def remote_view(r: RemoteJob, history: int, outputs: Mapping[str, dict[str, Any]]
                ) -> dict[str, Any]:
    """A forwarded job as the scheduler reported it, with what this daemon keeps: its own
    full history (it outlives schedulers), its stored outputs (`outputs_brief`), its owner."""
    last = r.history[-1] if r.history else None
    losses = [h.get("loss") for h in r.history.tail(1 << 30) if h.get("loss") is not None] \
        if r.history and r.status.get("first_loss") is None else []
    return {**r.status, "scheduler": r.scheduler, "owner_uid": r.owner_uid,
            "step": int(last["step"]) + 1 if last is not None else r.status.get("step", 0),
            "loss": last.get("loss") if last is not None else r.status.get("loss"),
            "first_loss": r.status.get("first_loss") or (losses[0] if losses else None),
            "outputs": dict(outputs), "unstored": dict(r.unstored),
            "held_by": r.held_by, "history": r.history.tail(history),
            "steps_recorded": len(r.history), "submitted_at": r.submitted_at}


def record_view(r: JobRecord, history: int, *, scheduler: str,
                outputs: Mapping[str, dict[str, Any]], now: float) -> dict[str, Any]:
    """Everything `fusionctl job ID` shows of a job coordinated here, at `now` (wall clock):
    the last `history` step records, the ETA from the recent steps' wall time."""
    elapsed = now - r.submitted_at
    done = steps_done(r)
    eta = None
    if r.state == "running" and r.history:
        recent = list(r.history)[-20:]
        per_step = sum(float(h.get("wall_s") or 0.0) for h in recent) / len(recent)
        eta = per_step * (r.spec.steps - done)
    return {**record_brief(r, scheduler), **{"status": r.coord.status()}, "plan": r.plan_text,
            # the planner's decisions as data (None for a `--stages` cut), its predicted
            # iteration inside; restarts so far; the last whole-model checkpoint (the step
            # after which it was taken, and when it arrived: Unix time)
            "plan_summary": plan_summary(r.plan) if r.plan is not None else r.plan_data,
            "restarts": r.restarts,
            "checkpoint_step": r.checkpoint_step, "checkpoint_at": r.checkpoint_at,
            "elapsed_s": elapsed, "eta_s": eta, "outcome": r.outcome,
            "outputs": dict(outputs), "unstored": dict(r.unstored), "held": r.held is not None,
            "history": r.history.tail(history), "steps_recorded": len(r.history),
            "tokens_per_sample": r.tokens_per_sample}


def past_view(past: Mapping[str, Any], history: int) -> dict[str, Any]:
    """`fusionctl job ID` of a job of an earlier run (its persisted record)."""
    hist = past.get("history") or []
    return {**past, "history": hist[-history:] if history else []}


def jobs_view(node_id: str, records: Mapping[str, JobRecord], remotes: Mapping[str, RemoteJob],
              past: Mapping[str, Mapping[str, Any]], stages: Mapping[str, Mapping[str, Any]]
              ) -> dict[str, Any]:
    """`fusionctl jobs`: the jobs submitted here (`past` ones of earlier runs first, oldest
    first, then this run's: coordinated here, then by a scheduler elsewhere), the jobs
    coordinated here for other submitters, and the stages hosted here (`stages`: job id ->
    the worker's view). `records`, `remotes`: by job id."""
    live = set(records) | set(remotes)
    old = sorted((p for j, p in past.items() if j not in live),
                 key=lambda p: float(p.get("submitted_at") or 0.0))
    return {
        "node_id": node_id,
        "jobs": [{k: p.get(k) for k in JOBS_KEYS} for p in old]
        + [record_brief(r, node_id) for r in records.values() if not r.submitter]
        + [{k: v for k, v in remote_view(r, 0, {}).items() if k in JOBS_KEYS}
           for r in remotes.values()],
        "coordinating": [record_brief(r, node_id) | {"submitter": r.submitter}
                         for r in records.values() if r.submitter],
        "stages": [{"job_id": j, **v} for j, v in stages.items()],
    }


def logs_view(job_id: str, got: JobRecord | RemoteJob | None,
              past: Mapping[str, Any] | None) -> dict[str, Any]:
    """`fusionctl logs ID`: a past job's kept lines, a forwarded job's (this daemon's notes,
    then the scheduler's), or a job coordinated here's. `got` or `past` is not None."""
    if past is not None:
        return {"job_id": job_id, "lines": list(past.get("lines") or [])}
    assert got is not None
    lines = ([*got.notes, *got.status.get("lines", [])] if isinstance(got, RemoteJob)
             else list(got.logs))
    return {"job_id": job_id, "lines": lines}


def owner_of(got: JobRecord | RemoteJob | None, past: Mapping[str, Any] | None) -> int | None:
    """The uid that submitted the job (None: only the operator may see it)."""
    if got is not None:
        return got.owner_uid
    v = past.get("owner_uid") if past is not None else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def output_dir_of(got: JobRecord | RemoteJob | None, past: Mapping[str, Any] | None
                  ) -> str | None:
    """The job's `output` path as the submitter's job file resolved it (where fusionctl
    writes the outputs)."""
    if isinstance(got, JobRecord):
        return str(got.spec.output)
    if isinstance(got, RemoteJob):
        return str(got.output)
    return None if past is None or past.get("output") is None else str(past["output"])


def outputs_view(job_id: str, got: JobRecord | RemoteJob | None, past: Mapping[str, Any],
                 *, node_id: str, output: str | None, files: Iterable[StoredFile]
                 ) -> dict[str, Any]:
    """What `GET /v1/jobs/ID/outputs` answers: the stored files (name, size, sha256) and what
    could not be stored (and who holds it: this daemon `node_id`, or the scheduler that
    coordinated a forwarded job)."""
    state = got.state if got is not None else str(past.get("state"))
    held = got.held is not None if isinstance(got, JobRecord) else False
    held_by = got.held_by if isinstance(got, RemoteJob) else (node_id if held else None)
    unstored = dict(got.unstored) if got is not None else {}
    return {"job_id": job_id, "state": state, "output": output,
            "files": [f.as_dict() for f in files], "unstored": unstored, "held_by": held_by}
