"""The body of a job upload (`fusionctl submit` -> its daemon's local API).

One binary document, so the weights never pass through JSON: the magic line ``FUSIONJOB1\\n``,
then three sections, each an 8-byte big-endian length and its bytes: a JSON object (the job
file's text and where it came from, plus submit options), the IR (`protocol.ir.dumps`), the
initial weights (safetensors), and optionally a fourth: the job's text corpus as token ids
(safetensors, one tensor `tokens`), which `fusionctl` adds when the corpus is not the default
one: it reads the data as the user (`fusiond.jobs.submit.corpus_for_upload`); the daemon never
opens a path named in a job. The daemon spools the body to a file in its state dir as it
arrives (bounded by `api.max_upload_bytes`), reads the sections back from it (`read_upload`),
checks every option in the meta section (`check_meta`) and validates each section
(`restore_job`: no pickle, no user code).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusiond.errors import LocalError

__all__ = ["MAGIC", "Upload", "UploadError", "check_meta", "decode_upload", "encode_upload",
           "read_upload"]

MAGIC = b"FUSIONJOB1\n"
_LEN = struct.Struct(">Q")
MAX_META_BYTES = 1 << 20
"""The JSON section holds a job file and a few options: a megabyte is plenty."""
_SECTIONS = ("meta", "graph", "weights", "data")
_DIGEST = re.compile(r"[0-9a-f]{1,128}")
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}-[0-9a-f]{6}")


class UploadError(LocalError):
    """The upload is malformed; the message says which part."""


@dataclass(frozen=True)
class Upload:
    """A decoded upload: `meta` (toml, base, out_base, and options), IR bytes, weights bytes,
    and the shipped corpus (safetensors bytes; empty when the stages read it themselves)."""

    meta: dict[str, Any]
    graph_bytes: bytes
    state_bytes: bytes
    data_bytes: bytes = b""


def encode_upload(meta: Mapping[str, Any], graph_bytes: bytes, state_bytes: bytes,
                  data_bytes: bytes = b"") -> bytes:
    """The upload as one bytes object (what the client sends); `data_bytes` (the corpus) only
    when not empty."""
    head = json.dumps(dict(meta)).encode()
    parts = [MAGIC]
    for blob in (head, graph_bytes, state_bytes, *((data_bytes,) if data_bytes else ())):
        parts += [_LEN.pack(len(blob)), blob]
    return b"".join(parts)


def decode_upload(data: bytes | memoryview) -> Upload:
    """Split and check an upload; `UploadError` names what is wrong."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise UploadError("not a job upload (bad magic): use `fusionctl submit`")
    pos = len(MAGIC)
    blobs: list[bytes] = []
    for name in _SECTIONS:
        if name == "data" and pos == len(view):
            break  # the optional corpus section
        if pos + _LEN.size > len(view):
            raise UploadError(f"upload truncated before its {name} section")
        (n,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if name == "meta" and n > MAX_META_BYTES:
            raise UploadError(f"upload meta section is {n} bytes (limit {MAX_META_BYTES})")
        if pos + n > len(view):
            raise UploadError(f"upload truncated in its {name} section ({n} bytes announced)")
        blobs.append(bytes(view[pos: pos + n]))
        pos += n
    if pos != len(view):
        raise UploadError(f"{len(view) - pos} bytes after the last section of the upload")
    return Upload(_meta(blobs[0]), blobs[1], blobs[2], blobs[3] if len(blobs) > 3 else b"")


def _meta(blob: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(blob)
    except ValueError as e:
        raise UploadError(f"upload meta section is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise UploadError("upload meta section must be a JSON object")
    for key in ("toml", "base", "out_base"):
        if not isinstance(meta.get(key), str):
            raise UploadError(f"upload meta.{key} must be a string")
    check_meta(meta)
    return meta


def read_upload(path: str | Path) -> Upload:
    """Read and check an upload spooled to `path` (each section read once, no other copy);
    `UploadError` names what is wrong."""
    blobs: list[bytes] = []
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        if f.read(len(MAGIC)) != MAGIC:
            raise UploadError("not a job upload (bad magic): use `fusionctl submit`")
        pos = len(MAGIC)
        for name in _SECTIONS:
            if name == "data" and pos == size:
                break
            head = f.read(_LEN.size)
            if len(head) < _LEN.size:
                raise UploadError(f"upload truncated before its {name} section")
            (n,) = _LEN.unpack(head)
            pos += _LEN.size
            if name == "meta" and n > MAX_META_BYTES:
                raise UploadError(f"upload meta section is {n} bytes (limit {MAX_META_BYTES})")
            if pos + n > size:
                raise UploadError(f"upload truncated in its {name} section ({n} bytes "
                                  "announced)")
            blobs.append(f.read(n))
            pos += n
        if pos != size:
            raise UploadError(f"{size - pos} bytes after the last section of the upload")
    return Upload(_meta(blobs[0]), blobs[1], blobs[2], blobs[3] if len(blobs) > 3 else b"")


def _int(meta: Mapping[str, Any], key: str, lo: int, hi: int) -> None:
    v = meta.get(key)
    if v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise UploadError(f"upload meta.{key} must be an integer in [{lo}, {hi}], got {v!r}")


def check_meta(meta: Mapping[str, Any]) -> None:
    """Every option of an upload's meta section has its type and range (`UploadError` naming
    the field): `steps` 1..1e9, `stages` 1..1024, `replicas` 1..1024, `first_step` >= 0,
    `restarts` 0..100, `data_digest` hex, `data_default` bool, `job_id` a job id."""
    _int(meta, "steps", 1, 10**9)
    _int(meta, "stages", 1, 1024)
    _int(meta, "replicas", 1, 1024)
    _int(meta, "first_step", 0, 10**9)
    _int(meta, "restarts", 0, 100)
    digest = meta.get("data_digest")
    if digest is not None and not (isinstance(digest, str) and (digest == "" or
                                                                _DIGEST.fullmatch(digest))):
        raise UploadError(f"upload meta.data_digest must be a hex string, got {digest!r}")
    if meta.get("data_default") is not None and not isinstance(meta["data_default"], bool):
        raise UploadError("upload meta.data_default must be true or false")
    job_id = meta.get("job_id")
    if job_id is not None and not (isinstance(job_id, str) and _JOB_ID.fullmatch(job_id)):
        raise UploadError(f"upload meta.job_id {job_id!r} is not a job id")
    for k, v in meta.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise UploadError(f"upload meta.{k} must be finite, got {v!r}")
