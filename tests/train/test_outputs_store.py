"""Durable writes (`fusiond.durable`) and the daemon's output store (`fusiond.jobs.outputs`):
a write is all or nothing, leaves no temporary file on any failure (a full disk: a real tmpfs,
mounted for the test), and the store keeps the newest checkpoints, private to the daemon."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from fusiond.durable import atomic_file, remove_temps, write_bytes
from fusiond.jobs.outputs import KEEP_CHECKPOINTS, MODEL, OutputStore, checkpoint_name
from fusiond.jobs.results import load_model_state, save_model
from tests.fullfs import fill, small_fs, temp_files


def test_a_durable_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    write_bytes(p, b"old")
    with pytest.raises(RuntimeError), atomic_file(p) as f:
        f.write(b"new but")
        raise RuntimeError("the writer failed half-way")
    assert p.read_bytes() == b"old"
    assert temp_files(tmp_path) == []
    write_bytes(p, b"new", 0o600)
    assert p.read_bytes() == b"new" and stat.S_IMODE(p.stat().st_mode) == 0o600
    (tmp_path / ".f.bin.deadbeef.tmp").write_bytes(b"left by a kill")
    assert [q.name for q in remove_temps(tmp_path)] == [".f.bin.deadbeef.tmp"]


def test_a_full_disk_fails_the_write_and_leaves_no_temporary_file() -> None:
    with small_fs(2 << 20) as fs:
        state = {"w": torch.ones(1 << 20)}  # 4 MiB: does not fit
        with pytest.raises(OSError) as e:
            save_model(fs / "run" / "model.safetensors", state)
        assert e.value.errno == 28  # ENOSPC
        assert not (fs / "run" / "model.safetensors").exists()
        assert temp_files(fs) == [], temp_files(fs)
        write_bytes(fs / "small", b"x" * 1000)
        filler = fill(fs)
        with pytest.raises(OSError):
            write_bytes(fs / "small", b"y" * 100_000)
        assert (fs / "small").read_bytes() == b"x" * 1000  # the old file stands
        assert temp_files(fs) == []
        filler.unlink()
        write_bytes(fs / "small", b"y" * 100_000)
        assert (fs / "small").stat().st_size == 100_000


def test_the_store_keeps_the_newest_checkpoints_privately(tmp_path: Path) -> None:
    store = OutputStore(tmp_path / "outputs", keep_checkpoints=2)
    state = {"w": torch.arange(6.0)}
    for step in (4, 9, 14, 19):
        store.put_model("j-abc123", checkpoint_name(step), state, {"step": str(step)})
    store.put_model("j-abc123", MODEL, state)
    names = [f.name for f in store.files("j-abc123")]
    assert names == [MODEL, "checkpoint-15.safetensors", "checkpoint-20.safetensors"]
    d = store.job_dir("j-abc123")
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((d / n).stat().st_mode) == 0o600 for n in names)
    assert torch.equal(load_model_state(d / MODEL)["w"], state["w"])
    f = next(f for f in store.files("j-abc123") if f.name == MODEL)
    import hashlib

    assert f.sha256 == hashlib.sha256((d / MODEL).read_bytes()).hexdigest()
    assert store.newest_checkpoint("j-abc123") == d / "checkpoint-20.safetensors"
    assert store.path("j-abc123", "../../etc/passwd") is None
    assert store.path("j-abc123", "manifest.json") is None  # not an output
    with pytest.raises(Exception, match="not an output name"):
        store.put_bytes("j-abc123", "evil.sh", b"")
    store.put_bytes("j-def456", "metrics.json", b"{}")
    assert store.prune({"j-def456"}) == ["j-abc123"]
    assert store.job_ids() == ["j-def456"]
    assert KEEP_CHECKPOINTS >= 1 and os.path.isdir(tmp_path / "outputs")
