"""The submitting daemon's store of its jobs' outputs: `<state_dir>/outputs/<job id>/`.

The daemon never writes at a job's `output` path (that is the user's directory, and a daemon
running as root or under `ProtectHome=` must not write there on anyone's behalf). It keeps what
a job produces here, in a directory it owns (mode 0700, files 0600):

- `model.safetensors` (a job that ended done), `metrics.json` (every job that ran a step: the
  full per-step history and the outcome), `checkpoint-<steps done>.safetensors` (the newest
  `KEEP_CHECKPOINTS`; older ones are deleted as new ones arrive);
- `manifest.json`: name -> size and sha256 of every file, so a client can check what it
  downloaded (`GET /v1/jobs/ID/outputs/NAME` streams a file with its hash in a header).

`fusionctl submit` (following the job) and `fusionctl fetch ID` download them and write them at
the job's output path as the user. Every file here is written durably by `fusiond.durable` (a
temporary file in the same directory, fsync, rename, fsync of the directory; removed on any
failure), so a full disk leaves the previous state and no `.tmp` file. The store keeps the
outputs of the newest `KEEP_JOBS` jobs that ended (and of every running one); `prune` deletes
the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusiond.durable import fsync_dir, remove_temps, write_bytes
from fusiond.errors import LocalError
from fusiond.jobs.results import metrics_document, save_model

__all__ = ["CHECKPOINT", "KEEP_CHECKPOINTS", "KEEP_JOBS", "METRICS", "MODEL", "OutputStore",
           "StoredFile", "checkpoint_name", "is_output_name", "reason"]

log = logging.getLogger("fusiond.jobs")

MODEL = "model.safetensors"
METRICS = "metrics.json"
MANIFEST = "manifest.json"
CHECKPOINT = re.compile(r"checkpoint-(\d{1,12})\.safetensors")
KEEP_CHECKPOINTS = 3
"""Checkpoints kept per job in the daemon's store (the newest; `fusionctl submit` following the
job downloads each as it appears, so the user's directory has them all)."""
KEEP_JOBS = 10
"""Jobs whose outputs the store keeps after they ended (the newest by end of job)."""
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,80}")
HASH_CHUNK_BYTES = 4 << 20


def reason(e: BaseException) -> str:
    """An error in a few words for a log line or a failure ("[Errno 28] No space left on
    device: '/var/lib/fusion/outputs/x/.model...tmp'" -> "No space left on device")."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint taken after `step` (0-based): steps done + 1."""
    return f"checkpoint-{step + 1}.safetensors"


def is_output_name(name: str) -> bool:
    """Whether `name` is a file a job may have: model, metrics or a checkpoint."""
    return name in (MODEL, METRICS) or CHECKPOINT.fullmatch(name) is not None


@dataclass(frozen=True)
class StoredFile:
    """One file in the store."""

    name: str
    size_bytes: int
    sha256: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size_bytes": self.size_bytes, "sha256": self.sha256}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


class OutputStore:
    """The outputs of the jobs submitted to one daemon (`root` = `<state_dir>/outputs`).
    Thread-safe: writes run in worker threads (`asyncio.to_thread`)."""

    def __init__(self, root: Path, keep_checkpoints: int = KEEP_CHECKPOINTS,
                 keep_jobs: int = KEEP_JOBS) -> None:
        self.root = root
        self.keep_checkpoints = keep_checkpoints
        self.keep_jobs = keep_jobs
        self._lock = threading.Lock()

    # -- paths -------------------------------------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        if not _JOB_ID.fullmatch(job_id):
            raise LocalError(f"job id {job_id!r} cannot name a directory")
        return self.root / job_id

    def _ensure(self, job_id: str) -> Path:
        d = self.job_dir(job_id)
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not d.is_dir():
            d.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self.root)
        return d

    # -- writing -----------------------------------------------------------------------------

    def put_bytes(self, job_id: str, name: str, data: bytes | memoryview) -> StoredFile:
        """Store one output file durably; OSError (e.g. ENOSPC) leaves the previous state."""
        if not is_output_name(name):
            raise LocalError(f"{name!r} is not an output name (model.safetensors, metrics.json "
                             "or checkpoint-N.safetensors)")
        d = self._ensure(job_id)
        write_bytes(d / name, data, 0o600)
        return self._added(job_id, name, hashlib.sha256(data).hexdigest(), len(data))

    def put_model(self, job_id: str, name: str, state: Mapping[str, torch.Tensor],
                  metadata: Mapping[str, str] | None = None) -> StoredFile:
        """Store a model or checkpoint (safetensors) durably."""
        if name != MODEL and CHECKPOINT.fullmatch(name) is None:
            raise LocalError(f"{name!r} is not a model file name")
        d = self._ensure(job_id)
        p = save_model(d / name, state, metadata, mode=0o600)
        return self._added(job_id, name, _sha256(p), p.stat().st_size)

    def put_metrics(self, job_id: str, history: Sequence[Mapping[str, Any]],
                    summary: Mapping[str, Any]) -> StoredFile:
        return self.put_bytes(job_id, METRICS, metrics_document(history, summary))

    def _added(self, job_id: str, name: str, sha: str, size: int) -> StoredFile:
        f = StoredFile(name, size, sha)
        with self._lock:
            files = self._manifest(job_id)
            files[name] = f
            drop: list[str] = []
            if CHECKPOINT.fullmatch(name):
                ckpts = sorted((n for n in files if CHECKPOINT.fullmatch(n)),
                               key=lambda n: int(CHECKPOINT.fullmatch(n).group(1)))  # type: ignore[union-attr]
                drop = ckpts[: max(0, len(ckpts) - self.keep_checkpoints)]
            for n in drop:
                files.pop(n, None)
            try:
                self._write_manifest(job_id, files)
            except OSError as e:
                # The file itself is stored; without its manifest entry a later listing
                # hashes it again (see `files`).
                log.warning("job %s: manifest not updated after %s: %s", job_id, name, e)
            for n in drop:
                with contextlib.suppress(FileNotFoundError):
                    (self.job_dir(job_id) / n).unlink()
        return f

    def _manifest(self, job_id: str) -> dict[str, StoredFile]:
        p = self.job_dir(job_id) / MANIFEST
        try:
            raw = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = {}
        out: dict[str, StoredFile] = {}
        if isinstance(raw, dict):
            for name, v in raw.items():
                if (isinstance(name, str) and is_output_name(name) and isinstance(v, dict)
                        and isinstance(v.get("size_bytes"), int)
                        and isinstance(v.get("sha256"), str)):
                    out[name] = StoredFile(name, v["size_bytes"], v["sha256"])
        return out

    def _write_manifest(self, job_id: str, files: Mapping[str, StoredFile]) -> None:
        doc = {n: {"size_bytes": f.size_bytes, "sha256": f.sha256}
               for n, f in sorted(files.items())}
        write_bytes(self.job_dir(job_id) / MANIFEST, json.dumps(doc).encode(), 0o600)

    # -- reading -----------------------------------------------------------------------------

    def files(self, job_id: str) -> list[StoredFile]:
        """The job's stored outputs (model, metrics, checkpoints by step); a file present
        without a manifest entry (its manifest write failed) is hashed now."""
        try:
            d = self.job_dir(job_id)
        except LocalError:
            return []
        if not d.is_dir():
            return []
        with self._lock:
            known = self._manifest(job_id)
            out = []
            for p in d.iterdir():
                if not p.is_file() or not is_output_name(p.name):
                    continue
                f = known.get(p.name)
                size = p.stat().st_size
                if f is None or f.size_bytes != size:
                    f = StoredFile(p.name, size, _sha256(p))
                out.append(f)

        def order(f: StoredFile) -> tuple[int, int]:
            m = CHECKPOINT.fullmatch(f.name)
            return (1, int(m.group(1))) if m else (0 if f.name == MODEL else 2, 0)

        return sorted(out, key=order)

    def path(self, job_id: str, name: str) -> Path | None:
        """The stored file, or None."""
        if not is_output_name(name):
            return None
        try:
            p = self.job_dir(job_id) / name
        except LocalError:
            return None
        return p if p.is_file() else None

    def newest_checkpoint(self, job_id: str) -> Path | None:
        best: tuple[int, Path] | None = None
        for f in self.files(job_id):
            m = CHECKPOINT.fullmatch(f.name)
            if m and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), self.job_dir(job_id) / f.name)
        return None if best is None else best[1]

    # -- housekeeping ------------------------------------------------------------------------

    def remove(self, job_id: str) -> None:
        with self._lock:
            shutil.rmtree(self.job_dir(job_id), ignore_errors=True)

    def prune(self, keep: Iterable[str]) -> list[str]:
        """Delete the outputs of every job not in `keep` (the caller passes the running jobs
        and the newest `keep_jobs` ended ones); the job ids removed."""
        wanted = set(keep)
        gone: list[str] = []
        if not self.root.is_dir():
            return gone
        for d in self.root.iterdir():
            if d.is_dir() and d.name not in wanted and _JOB_ID.fullmatch(d.name):
                self.remove(d.name)
                gone.append(d.name)
        return gone

    def sweep(self) -> list[Path]:
        """At start: remove temporary files a killed daemon left mid-write."""
        gone = remove_temps(self.root)
        for p in gone:
            log.info("removed a partial write left by a stopped daemon: %s", p)
        return gone

    def job_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir() if d.is_dir())

