"""The body of a job upload (`fusionctl submit` -> its daemon's local API).

One binary document, so the weights never pass through JSON: the magic line ``FUSIONJOB1\\n``,
then three sections, each an 8-byte big-endian length and its bytes: a JSON object (the job
file's text and where it came from, plus submit options), the IR (`protocol.ir.dumps`), the
initial weights (safetensors), and optionally a fourth: the job's text corpus as token ids
(safetensors, one tensor `tokens`), which the submitting daemon adds when the corpus is not the
default one (`fusiond.jobs.submit.corpus_for_upload`). The daemon reads it as a stream, bounded by
`api.max_upload_bytes`, and validates each section (`restore_job`: no pickle, no user code).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fusiond.errors import LocalError

__all__ = ["MAGIC", "Upload", "UploadError", "decode_upload", "encode_upload"]

MAGIC = b"FUSIONJOB1\n"
_LEN = struct.Struct(">Q")
MAX_META_BYTES = 1 << 20
"""The JSON section holds a job file and a few options: a megabyte is plenty."""


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
    for name in ("meta", "graph", "weights", "data"):
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
    try:
        meta = json.loads(blobs[0])
    except ValueError as e:
        raise UploadError(f"upload meta section is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise UploadError("upload meta section must be a JSON object")
    for key in ("toml", "base", "out_base"):
        if not isinstance(meta.get(key), str):
            raise UploadError(f"upload meta.{key} must be a string")
    return Upload(meta, blobs[1], blobs[2], blobs[3] if len(blobs) > 3 else b"")
