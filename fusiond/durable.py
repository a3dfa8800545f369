"""Durable file writes: the one helper every output, checkpoint, record and download goes through.

A file is written to a temporary name in its own directory (``.<name>.<random>.tmp``, created
exclusively), flushed and fsync'ed, renamed over the final name, and the directory is fsync'ed,
so after a crash or power loss the path holds either the old file or the complete new one,
never a torn one. On ANY failure (a full disk, a permission error, a bad writer, Ctrl-C) the
temporary file is removed and the error propagates: nothing ``.tmp`` is left behind.

Pure standard library and no upward import: the daemon (`fusiond.jobs.results`,
`fusiond.jobs.history`) and the client (`fusionctl`, writing downloaded outputs as the user)
both use it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = ["TMP_SUFFIX", "atomic_file", "atomic_path", "fsync_dir", "is_temp", "remove_temps",
           "write_bytes", "write_chunks"]

TMP_SUFFIX = ".tmp"


def is_temp(name: str) -> bool:
    """Whether `name` is one of our temporary names (``.<name>.<hex>.tmp``)."""
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    """fsync a directory (so a rename or a new entry in it is durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def _unlink_quietly(p: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(p)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], mode: int = 0o600) -> Iterator[BinaryIO]:
    """Open a temporary file next to `path` for writing; on a clean exit make it `path`
    durably (fsync file, rename, fsync dir). The file is created with `mode` (minus the
    umask). The parent directory must exist."""
    final = Path(path)
    tmp = _temp_name(final)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int = 0o600) -> Iterator[Path]:
    """For writers that want a file name (e.g. safetensors' `save_file`): yields a temporary
    path next to `path` (created empty with `mode`) that the caller writes; on a clean exit it
    is fsync'ed and renamed to `path` (then the directory fsync'ed); on any failure removed."""
    final = Path(path)
    tmp = _temp_name(final)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode))
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    fsync_dir(final.parent)


def write_bytes(path: str | os.PathLike[str], data: bytes | bytearray | memoryview,
                mode: int = 0o600) -> Path:
    """Write `data` at `path` durably (see `atomic_file`)."""
    with atomic_file(path, mode) as f:
        f.write(data)
    return Path(path)


def write_chunks(path: str | os.PathLike[str], chunks: Iterable[bytes], mode: int = 0o600
                 ) -> int:
    """Write the chunks at `path` durably; the number of bytes written."""
    n = 0
    with atomic_file(path, mode) as f:
        for c in chunks:
            f.write(c)
            n += len(c)
    return n


def remove_temps(root: Path, recursive: bool = True) -> list[Path]:
    """Delete our temporary files under `root` (left by a process that was killed mid-write:
    a clean failure removes its own); the paths removed."""
    if not root.is_dir():
        return []
    found = root.rglob(".*" + TMP_SUFFIX) if recursive else root.glob(".*" + TMP_SUFFIX)
    gone = []
    for p in found:
        if p.is_file() and is_temp(p.name):
            _unlink_quietly(p)
            gone.append(p)
    return gone
