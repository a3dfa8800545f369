"""A job's per-step history, and job records that outlive the daemon (`<state_dir>/jobs/`).

`StepHistory` is the per-step history of one job, in step order, each step once: a record for a
step already present supersedes it and every later one (a restarted attempt, or an attempt a
new scheduler resumed after a failover, redoes the steps after its checkpoint). Consumers that
forward it (the scheduler's `JobUpdate`s) read it through a `Cursor`, so they send each record
once and resend after such a rewind. It is bounded: past `MAX_STEPS` records the older half is
thinned (every other record dropped; the first step and the newest `MAX_STEPS // 2` stay whole),
and `thinned` counts what was dropped (metrics.json says so).

`JobHistory` keeps, per job submitted to this daemon, `<job id>.json` (status, outcome,
outputs, owner, log lines; written when the job starts and ends) and `<job id>.steps.jsonl`
(every step record, one JSON object a line, appended as the records arrive, fsync'ed at most
a second apart; rewritten atomically after a rewind or a thinning). At start it reads them back, so
`fusionctl jobs`, `job ID` and `logs ID` still answer after a restart; a record still "running"
belonged to a job the stop killed, and is marked failed with the command that resumes it.

Contract: the record file is written atomically (`fusiond.durable`); a file that does not parse,
is too large, or lacks the fields below is skipped with a warning, never fatal; a torn last line
of a steps file (a kill mid-append) is dropped with a warning; at most `keep` records stay (the
oldest by submission time go first, with their steps).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusiond.durable import atomic_file, remove_temps, write_bytes

__all__ = [
    "HISTORY_KEPT",
    "MAX_RECORD_BYTES",
    "MAX_STEPS",
    "MAX_STEPS_FILE_BYTES",
    "RECORDS_KEPT",
    "Cursor",
    "JobHistory",
    "StepHistory",
    "finite_records",
    "metrics_summary",
]

log = logging.getLogger("fusiond.jobs")

MAX_RECORD_BYTES = 8 << 20
"""A record larger than this on disk is not read back."""
MAX_STEPS = 100_000
"""Step records kept per job, in memory and on disk, before the older half is thinned."""
MAX_STEPS_FILE_BYTES = 256 << 20
"""A steps file larger than this is read only up to this size (the rest is reported lost)."""
RECORDS_KEPT = 200
"""Records of past jobs kept (on disk, and in a daemon's memory: the oldest go first)."""
HISTORY_KEPT = 1000
"""Step records of a past job (one from before this daemon's start) kept in memory for
`fusionctl job ID` (the newest); the whole history is in its steps file and metrics.json."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,80}")


@dataclass
class Cursor:
    """How far a consumer has read a `StepHistory` (the last step it took)."""

    through: int = -1


def _step_of(rec: Mapping[str, Any]) -> int:
    s = rec.get("step")
    if not isinstance(s, int) or isinstance(s, bool) or s < 0:
        raise ValueError(f"a step record needs a non-negative integer step, got {s!r}")
    return s


class StepHistory:
    """The step records of one job, ordered by step, each step once (see the module doc)."""

    def __init__(self, records: Iterable[Mapping[str, Any]] = (), cap: int = MAX_STEPS,
                 thinned: int = 0) -> None:
        self.cap = max(4, cap)
        self.thinned = thinned
        self._recs: list[dict[str, Any]] = []
        self._steps: list[int] = []
        self._cursors: list[Cursor] = []
        self._saved = 0
        """Records [0, _saved) are in the steps file as they are here."""
        self._rewrite = False
        """The file differs from `_recs[:_saved]` (a rewind or thinning): rewrite it whole."""
        for r in records:
            self.add(r)
        self._saved = 0
        self._rewrite = True

    def __len__(self) -> int:
        return len(self._recs)

    def __bool__(self) -> bool:
        return bool(self._recs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(list(self._recs))

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._recs[i]

    def tail(self, n: int) -> list[dict[str, Any]]:
        return list(self._recs[-n:]) if n > 0 else []

    def steps(self) -> list[int]:
        return list(self._steps)

    def add(self, rec: Mapping[str, Any]) -> None:
        """Append a step record; one for a step already present replaces it and every later
        one. ValueError for a record without a valid step."""
        s = _step_of(rec)
        if self._steps and s <= self._steps[-1]:
            self.truncate_from(s)
        self._recs.append(dict(rec))
        self._steps.append(s)
        if len(self._recs) > self.cap:
            self._thin()

    def extend(self, recs: Iterable[Mapping[str, Any]]) -> None:
        for r in recs:
            self.add(r)

    def truncate_from(self, step: int) -> None:
        """Drop every record of `step` and later (an attempt that resumes at `step`)."""
        i = bisect.bisect_left(self._steps, step)
        if i == len(self._recs):
            return
        del self._recs[i:]
        del self._steps[i:]
        for c in self._cursors:
            c.through = min(c.through, step - 1)
        if i < self._saved:
            self._saved = i
            self._rewrite = True

    def _thin(self) -> None:
        keep_whole = self.cap // 2
        old = len(self._recs) - keep_whole
        kept = list(range(0, old, 2))  # the first stays
        dropped = old - len(kept)
        idx = kept + list(range(old, len(self._recs)))
        self._recs = [self._recs[i] for i in idx]
        self._steps = [self._steps[i] for i in idx]
        self.thinned += dropped
        self._saved = 0
        self._rewrite = True
        log.info("step history thinned: %d older records dropped (%d in all)", dropped,
                 self.thinned)

    # -- consumers -----------------------------------------------------------------------------

    def cursor(self) -> Cursor:
        c = Cursor()
        self._cursors.append(c)
        return c

    def take(self, cursor: Cursor, limit: int, max_bytes: int | None = None
             ) -> list[dict[str, Any]]:
        """Up to `limit` records after `cursor` (and at most about `max_bytes` of JSON),
        oldest first; the cursor moves past them."""
        i = bisect.bisect_right(self._steps, cursor.through)
        out: list[dict[str, Any]] = []
        size = 0
        for rec in self._recs[i: i + max(0, limit)]:
            if max_bytes is not None:
                size += len(json.dumps(rec, default=str))
                if out and size > max_bytes:
                    break
            out.append(rec)
        if out:
            cursor.through = int(out[-1]["step"])
        return out

    # -- persistence (JobHistory.save_steps) ---------------------------------------------------

    def unsaved(self) -> tuple[bool, list[dict[str, Any]]]:
        """(rewrite the whole file?, the records to write: all of them, or the new ones)."""
        if self._rewrite:
            return True, list(self._recs)
        return False, list(self._recs[self._saved:])

    def saved(self, rewrote: bool, count: int) -> None:
        """`count` records of what `unsaved` returned are on disk."""
        if rewrote:
            self._rewrite = False
            self._saved = count
        else:
            self._saved += count


class JobHistory:
    """The persisted job records of one daemon (`root` = `<state_dir>/jobs`)."""

    def __init__(self, root: Path, keep: int = RECORDS_KEPT) -> None:
        self.root = root
        self.keep = keep

    def _path(self, job_id: str, suffix: str) -> Path:
        if not _NAME.fullmatch(job_id):
            raise ValueError(f"job id {job_id!r} cannot name a file")
        return self.root / f"{job_id}{suffix}"

    def save(self, job_id: str, record: Mapping[str, Any]) -> None:
        """Write `record` (JSON-ready: `job_id`, `state`, `submitted_at`, ...) for `job_id`.
        Its step history goes to the steps file (`save_steps`), not here. OSError propagates
        (the caller logs it; the job itself is unaffected)."""
        path = self._path(job_id, ".json")
        rec = {k: v for k, v in record.items() if k != "history"}
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_bytes(path, json.dumps(rec, default=str).encode(), 0o600)

    def save_steps(self, job_id: str, history: StepHistory, fsync: bool = True) -> int:
        """Append the records of `history` not yet on disk (or rewrite the file after a rewind
        or a thinning; that is always fsync'ed), fsync'ed unless `fsync` is False (then they
        survive a kill of the process, not a power loss); the records written. Call from one
        thread at a time per job."""
        path = self._path(job_id, ".steps.jsonl")
        rewrite, recs = history.unsaved()
        if not recs and not rewrite:
            return 0
        lines = b"".join(json.dumps(r, default=str, allow_nan=False).encode() + b"\n"
                         for r in finite_records(recs))
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if rewrite:
            with atomic_file(path, 0o600) as f:
                f.write(lines)
        else:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    lines = b"\n" + lines  # after a torn line (a kill mid-append)
                try:
                    view = memoryview(lines)
                    while view:
                        view = view[os.write(fd, view):]
                    if fsync:
                        os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, size)  # never leave a torn line behind
                    raise
            finally:
                os.close(fd)
        history.saved(rewrite, len(recs))
        return len(recs)

    def steps(self, job_id: str, tail: int | None = None) -> list[dict[str, Any]]:
        """The step records of `job_id` from its steps file (the newest `tail` if given)."""
        try:
            path = self._path(job_id, ".steps.jsonl")
        except ValueError:
            return []
        out: deque[dict[str, Any]] = deque(maxlen=tail)
        try:
            with path.open("rb") as f:
                read = 0
                for n, line in enumerate(f, 1):
                    read += len(line)
                    if read > MAX_STEPS_FILE_BYTES:
                        log.warning("job %s: steps file past %d bytes; the rest is not read",
                                    job_id, MAX_STEPS_FILE_BYTES)
                        break
                    try:
                        rec = json.loads(line)
                        _step_of(rec)
                    except ValueError:
                        log.warning("job %s: steps file line %d skipped (torn or damaged)",
                                    job_id, n)
                        continue
                    out.append(rec)
        except FileNotFoundError:
            return []
        except OSError as e:
            log.warning("job %s: steps file unreadable: %s", job_id, e)
            return []
        return list(out)

    def load(self) -> dict[str, dict[str, Any]]:
        """Every readable record, by job id, each with the newest `HISTORY_KEPT` steps under
        `history`; records of jobs that were running when the daemon stopped are marked failed
        (and rewritten); the oldest beyond `keep` are deleted."""
        out: dict[str, dict[str, Any]] = {}
        if not self.root.is_dir():
            return out
        for p in remove_temps(self.root, recursive=False):
            log.info("removed a partial write left by a stopped daemon: %s", p)
        for path in sorted(self.root.glob("*.json")):
            rec = self._read(path)
            if rec is not None:
                out[str(rec["job_id"])] = rec
        for job_id, rec in out.items():
            if rec.get("state") == "running":
                rec["state"] = "failed"
                why = ("the daemon stopped while the job ran (found at start "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC)")
                rec["outcome"] = {**(rec.get("outcome") or {}), "ok": False, "failure": why}
                hint = (f"resume it: fusionctl fetch {job_id}, then fusionctl submit JOB.toml "
                        f"--resume {rec.get('output', '<output>')}/checkpoint-N.safetensors")
                rec["lines"] = [*rec.get("lines", []), why, hint]
                try:
                    self.save(job_id, rec)
                except OSError as e:
                    log.warning("job record %s not updated: %s", job_id, e)
        excess = sorted(out.values(), key=lambda r: float(r.get("submitted_at") or 0.0))
        for rec in excess[: max(0, len(out) - self.keep)]:
            job_id = str(rec["job_id"])
            out.pop(job_id, None)
            self.remove(job_id)
        for job_id, rec in out.items():
            embedded = rec.get("history")  # a record from before the steps file
            rec["history"] = self.steps(job_id, HISTORY_KEPT) or (
                embedded[-HISTORY_KEPT:] if isinstance(embedded, list) else [])
        return out

    def remove(self, job_id: str) -> None:
        for suffix in (".json", ".steps.jsonl"):
            try:
                self._path(job_id, suffix).unlink()
            except FileNotFoundError:
                pass
            except (OSError, ValueError) as e:
                log.warning("old job record %s not removed: %s", job_id, e)

    def _read(self, path: Path) -> dict[str, Any] | None:
        try:
            if path.stat().st_size > MAX_RECORD_BYTES:
                raise ValueError(f"larger than {MAX_RECORD_BYTES} bytes")
            rec = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
            job_id = rec.get("job_id")
            if not isinstance(job_id, str) or path.stem != job_id:
                raise ValueError("its job_id does not match its file name")
            if not isinstance(rec.get("state"), str):
                raise ValueError("no state")
            for key, typ in (("lines", list), ("history", list), ("outputs", dict)):
                if key in rec and not isinstance(rec[key], typ):
                    raise ValueError(f"{key} is not a {typ.__name__}")
            owner = rec.get("owner_uid")
            if owner is not None and (not isinstance(owner, int) or isinstance(owner, bool)):
                raise ValueError("owner_uid is not an integer")
        except (OSError, ValueError) as e:
            log.warning("job record %s skipped: %s", path, e)
            return None
        return rec


def metrics_summary(history: StepHistory, outcome: Mapping[str, Any],
                    submitted_at: float) -> dict[str, Any]:
    """metrics.json's summary: the outcome, with the figures of the full history."""
    losses = [h.get("loss") for h in history if h.get("loss") is not None]
    return {**outcome, "steps": len(history), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "first_step": int(history[0]["step"]) if history else None,
            "last_step": int(history[-1]["step"]) if history else None,
            "thinned_steps": history.thinned,
            "wall_s": outcome.get("wall_s", time.time() - submitted_at)}


def finite_records(recs: Iterable[Mapping[str, Any]]) -> Iterator[Any]:
    """Records with non-finite floats as null (JSON has no NaN)."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    for r in recs:
        yield clean(r)
