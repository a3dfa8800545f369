"""Job records that outlive the daemon: one JSON file per job in `<state_dir>/jobs/`.

A daemon writes a job's record when the job starts (state "running") and again when it ends
(its last status, outcome, outputs, log lines and a bounded tail of its step history). At
start it reads them back, so `fusionctl jobs`, `job ID` and `logs ID` still answer after a
restart; a record still "running" belonged to a job the stop killed, and is marked failed with
the command that resumes it from its last checkpoint.

Contract: every file is written atomically (temporary file, then rename); a file that does not
parse, is too large, or lacks the fields below is skipped with a warning, never fatal; at most
`keep` records stay (the oldest by submission time go first).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

__all__ = ["HISTORY_KEPT", "MAX_RECORD_BYTES", "JobHistory"]

log = logging.getLogger("fusiond.jobs")

MAX_RECORD_BYTES = 8 << 20
"""A record larger than this on disk is not read back (history is bounded when written)."""
HISTORY_KEPT = 1000
"""Step records kept in a persisted job record (the newest)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,80}")


class JobHistory:
    """The persisted job records of one daemon (`root` = `<state_dir>/jobs`)."""

    def __init__(self, root: Path, keep: int = 200) -> None:
        self.root = root
        self.keep = keep

    def save(self, job_id: str, record: dict[str, Any]) -> None:
        """Write `record` (JSON-ready: `job_id`, `state`, `submitted_at`, ...) for `job_id`.
        OSError propagates (the caller logs it; the job itself is unaffected)."""
        if not _NAME.fullmatch(job_id):
            raise ValueError(f"job id {job_id!r} cannot name a file")
        rec = dict(record)
        hist = rec.get("history")
        if isinstance(hist, list) and len(hist) > HISTORY_KEPT:
            rec["history"] = hist[-HISTORY_KEPT:]
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.root / f"{job_id}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(rec, default=str), encoding="utf-8")
        os.replace(tmp, path)

    def load(self) -> dict[str, dict[str, Any]]:
        """Every readable record, by job id; records of jobs that were running when the daemon
        stopped are marked failed (and rewritten); the oldest beyond `keep` are deleted."""
        out: dict[str, dict[str, Any]] = {}
        if not self.root.is_dir():
            return out
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
                hint = (f"resume it: fusionctl submit JOB.toml --resume "
                        f"{rec.get('output', '<output>')}/checkpoint-N.safetensors")
                rec["lines"] = [*rec.get("lines", []), why, hint]
                try:
                    self.save(job_id, rec)
                except OSError as e:
                    log.warning("job record %s not updated: %s", job_id, e)
        excess = sorted(out.values(), key=lambda r: float(r.get("submitted_at") or 0.0))
        for rec in excess[: max(0, len(out) - self.keep)]:
            job_id = str(rec["job_id"])
            out.pop(job_id, None)
            try:
                (self.root / f"{job_id}.json").unlink()
            except OSError as e:
                log.warning("old job record %s not removed: %s", job_id, e)
        return out

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
        except (OSError, ValueError) as e:
            log.warning("job record %s skipped: %s", path, e)
            return None
        return rec
