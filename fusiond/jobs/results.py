"""Finishing a job: gather the stages' weights into one state dict; write model and metrics.

`gather_state(graph, states)` merges every stage's state (graph names are the model's own
state-dict names) and adds the aliases of tied parameters, keeping exactly the entries of the
original module's `state_dict()` (parameters and persistent buffers; lifted constants and
non-persistent buffers left out), so `model.load_state_dict(result, strict=True)` works.
`save_model` writes it as safetensors (never pickle); `write_metrics` the history as JSON;
both durably (`fusiond.durable`). `fusiond.jobs.outputs.OutputStore` keeps a daemon's copies.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from fusiond.durable import atomic_path, write_bytes
from fusiond.errors import LocalError
from protocol import ir

__all__ = ["gather_state", "load_model_state", "metrics_document", "save_model",
           "write_metrics"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values, NaN included (NaN != NaN would make the identical copies of
    a diverged run's tied weight look different, and crash the gathering)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return False
    return torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def gather_state(graph: ir.Graph, states: Iterable[Mapping[str, torch.Tensor]]
                 ) -> dict[str, torch.Tensor]:
    """One state dict under the model's names from the stages' states.

    A tied parameter held by several stages must be identical in each (they exchange gradients
    every step); a difference means the copies diverged, which is a `LocalError`.
    """
    keep = {
        p.name for p in graph.params
        if p.kind is ir.ParamKind.PARAMETER or (p.kind is ir.ParamKind.BUFFER and p.persistent)
    }
    out: dict[str, torch.Tensor] = {}
    for st in states:
        for k, v in st.items():
            if k not in keep:
                continue
            if k in out and not _same(out[k], v):
                raise LocalError(f"the copies of tied parameter {k!r} differ between stages")
            out[k] = v.detach().cpu()
    missing = keep - set(out)
    if missing:
        raise LocalError(f"no stage returned {sorted(missing)[:3]} ({len(missing)} missing)")
    for alias, canon in graph.aliases.items():
        if canon in out:
            out[alias] = out[canon]
    return out


def save_model(path: str | Path, state: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str] | None = None, mode: int = 0o644) -> Path:
    """Write `state` as safetensors (tied entries stored as separate copies), durably
    (`fusiond.durable`: temporary file, fsync, rename, fsync of the directory; the temporary
    file removed on any failure). `mode` before the umask (the daemon's store uses 0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    with atomic_path(p, mode) as tmp:
        try:
            safetensors.torch.save_file(tensors, str(tmp), metadata=dict(metadata or {}))
        except safetensors.SafetensorError as e:  # its I/O errors as the OSError they are
            m = re.search(r"os error (\d+)", str(e))
            if m is None:
                raise LocalError(f"cannot write {p}: {e}") from e
            code = int(m.group(1))
            raise OSError(code, os.strerror(code), str(p)) from e
    return p


def load_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a model written by `save_model`."""
    return dict(safetensors.torch.load_file(str(path)))


def _clean(v: Any) -> Any:
    # JSON has no NaN/Infinity: a diverged loss is written as null rather than invalid JSON.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def metrics_document(history: Sequence[Mapping[str, Any]],
                     summary: Mapping[str, Any] | None = None) -> bytes:
    """`{"summary": ..., "steps": [...]}` as JSON bytes (non-finite floats as null)."""
    doc = {"summary": _clean(dict(summary or {})), "steps": _clean([dict(h) for h in history])}
    return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()


def write_metrics(path: str | Path, history: Sequence[Mapping[str, Any]],
                  summary: Mapping[str, Any] | None = None, mode: int = 0o644) -> Path:
    """Write `{"summary": ..., "steps": [...]}` as JSON, durably."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes(p, metrics_document(history, summary), mode)
