"""A small filesystem that fills up: a tmpfs of a few MiB mounted (as root) on a directory for
the length of a test, and unmounted after, also when the test fails. Without root, or where
mounting is not allowed, the test is skipped with the reason."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_fs_at(where: Path, size_bytes: int, mode: int = 0o755) -> Iterator[Path]:
    """Mount a tmpfs of `size_bytes` on the existing directory `where` (hiding what is there)
    and unmount it at exit."""
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a small tmpfs: needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode={mode:o}",
                          "tmpfs", str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield where
    finally:
        for _ in range(50):
            done = subprocess.run(["umount", str(where)], capture_output=True, text=True)
            if done.returncode == 0:
                break
            time.sleep(0.2)


@contextlib.contextmanager
def small_fs(size_bytes: int, prefix: str = "fzfull") -> Iterator[Path]:
    """A freshly mounted tmpfs of `size_bytes` (mode 0755), unmounted and removed at exit."""
    if os.geteuid() != 0:
        pytest.skip("a full-disk test mounts a small tmpfs: needs root")
    where = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with small_fs_at(where, size_bytes):
            yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """Fill the filesystem of `directory` until at most `leave_bytes` are free; the filler
    file (delete it to make room again)."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        chunk = b"\0" * (1 << 16)
        while True:
            free = shutil.disk_usage(directory).free
            if free <= leave_bytes:
                break
            try:
                f.write(chunk[: max(1, min(len(chunk), free - leave_bytes))])
                f.flush()
            except OSError:
                break
    return filler


def temp_files(root: Path) -> list[Path]:
    """Every temporary-looking file under `root` (ours are `.<name>.<hex>.tmp`)."""
    return [p for p in root.rglob("*") if p.is_file() and (p.name.endswith(".tmp")
                                                           or ".tmp" in p.name)]
