"""Writing a job's outputs where the user asked, as the user (`fusionctl submit`, `fetch`).

The daemon keeps a job's outputs in its own store (`fusiond.jobs.outputs`) and never writes at
the job's `output` path: `fusionctl` downloads them (`GET /v1/jobs/ID/outputs/NAME`, streamed,
sha256-checked) and writes each durably with `fusiond.durable` (a temporary file in the same
directory, fsync, rename, fsync of the directory; the temporary file removed on any failure),
with this process's own permissions. A failure names the file and the cause, and says the
command that gets the outputs later.

Overwriting: a directory that already holds outputs of an earlier run (model.safetensors,
metrics.json, checkpoint-N.safetensors) is refused at submit unless `--force`, or unless the
job resumes from a checkpoint inside that very directory (`--resume DIR/checkpoint-N...`: the
resumed run continues that run). `fetch` skips a file that is already there with the same
content and refuses a different one unless `--force`.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusionctl.client import Client, DownloadError

__all__ = ["OutputWriter", "WriteFailure", "earlier_outputs", "output_problem"]

_EARLIER = re.compile(r"model\.safetensors|metrics\.json|checkpoint-\d+\.safetensors")


class WriteFailure(Exception):
    """An output could not be written here; the message names the path and the cause."""


def earlier_outputs(directory: Path) -> list[str]:
    """Names of output files of an earlier run in `directory`."""
    try:
        return sorted(p.name for p in directory.iterdir() if _EARLIER.fullmatch(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError:
        return []


def output_problem(directory: Path) -> str | None:
    """Why this process could not write outputs under `directory` (None: it can): the
    directory, or its nearest existing ancestor, must be a writable directory."""
    p = directory
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"{p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"{p}: permission denied (fusionctl writes the outputs as you, uid {os.getuid()})"
    return None


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(4 << 20):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


@dataclass
class OutputWriter:
    """Downloads a job's stored outputs into `directory` (made if missing)."""

    client: Client
    job_id: str
    directory: Path
    overwrite: bool = True
    """False (fetch without --force): refuse to replace a file with other content."""
    written: dict[str, str] = field(default_factory=dict)
    """name -> path of what this writer wrote (or found already there, identical)."""
    hashes: dict[str, str] = field(default_factory=dict)

    def write(self, files: list[dict[str, Any]], only_new: bool = False) -> list[str]:
        """Write each listed file (`{"name", "size_bytes", "sha256"}`); with `only_new`, skip
        those written before. The names written. WriteFailure on the first that fails."""
        from fusiond.durable import atomic_file

        done = []
        for f in files:
            name = str(f["name"])
            if "/" in name or name.startswith("."):
                raise WriteFailure(f"the daemon named an output {name!r}; refusing it")
            if only_new and self.hashes.get(name) == f.get("sha256"):
                continue
            dest = self.directory / name
            if dest.exists():
                if _sha256(dest) == f.get("sha256"):
                    self.written[name] = str(dest)
                    self.hashes[name] = str(f.get("sha256"))
                    continue
                if not self.overwrite:
                    raise WriteFailure(f"{dest} exists with other content; pass --force to "
                                       "replace it, or --output DIR to write elsewhere")
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                with atomic_file(dest, 0o666) as out:
                    self.client.download(f"/v1/jobs/{self.job_id}/outputs/{name}", out)
            except OSError as e:
                raise WriteFailure(f"could not write {dest}: {e.strerror or e}") from None
            except DownloadError as e:
                raise WriteFailure(f"could not download {name}: {e}") from None
            self.written[name] = str(dest)
            self.hashes[name] = str(f.get("sha256"))
            done.append(name)
        return done
