"""A real daemon gives the memory of a large job upload back (resident set size, /proc):

- refused on its Content-Length (over `api.max_upload_bytes`): 413 before it is read;
- sent chunked (no length) past the limit: 413 as soon as it passes, and its memory returned
  (the old API grew a bytearray on the heap, and `tune_allocator`'s 512 MiB trim threshold kept
  it resident: +257 MiB measured);
- a 512 MiB upload that is accepted (a dry-run plan, as `fusionctl plan` sends it): spooled to
  a file, read back once, and the heap trimmed after the answer.
"""

from __future__ import annotations

import contextlib
import http.client
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from tests.daemon.harness import Cluster

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(300)]

SLACK_MIB = 64.0
"""What a daemon may keep after a large request (allocator slack, caches of a first plan)."""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _settled_rss(pid: int) -> float:
    """RSS once it stopped moving (the daemon trims shortly after its answer)."""
    last = _rss_mib(pid)
    for _ in range(20):
        time.sleep(0.25)
        now = _rss_mib(pid)
        if abs(now - last) < 1.0:
            return now
        last = now
    return last


def _post(sock: str, path: str, body: bytes, chunked: bool = False) -> tuple[int, bytes]:
    class Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            self.sock = s

    c = Unix("localhost", timeout=300)
    headers = {"Content-Type": "application/octet-stream"}
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if chunked:
            view = memoryview(body)
            c.request("POST", path, headers=headers, encode_chunked=True,
                      body=(view[i: i + (1 << 20)] for i in range(0, len(view), 1 << 20)))
        else:
            c.request("POST", path, body=body, headers=headers)
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, out


def _big_upload(tmp_path: Path) -> bytes:
    """What `fusionctl plan` sends for a job with 512 MiB of weights: its own `_prepare` on a
    small job, the weights grown by one 512 MiB tensor (the daemon checks only that every
    parameter is there)."""
    import argparse

    import torch

    from fusionctl.jobs import _prepare
    from fusiond.graph import state_to_bytes
    from fusiond.jobs.upload import decode_upload, encode_upload

    job = tmp_path / "big.toml"
    job.write_text('[job]\nname = "big"\nsteps = 2\n[model]\nzoo = "gpt2"\n'
                   'config = { size = "tiny" }\n[data]\nseq_len = 16\n')
    ns = argparse.Namespace(cmd="plan", job=str(job), json=True, stages=None, replicas=None,
                            steps=None,
                            resume=None, force=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = _prepare(ns)
    assert prepared is not None
    up = decode_upload(prepared[0])
    from fusiond.graph import state_from_bytes

    state = state_from_bytes(up.state_bytes)
    state["junk"] = torch.ones(128 << 20)  # 512 MiB of float32
    return encode_upload(up.meta, up.graph_bytes, state_to_bytes(state), up.data_bytes)


def test_large_uploads_give_their_memory_back(tmp_path: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="fzm"))
    c = Cluster(root, 1, {"api": {"max_upload_bytes": 600 << 20}, "job_memory_gib": 4.0})
    try:
        c.start()
        c.wait_up()
        node = c.nodes[0]
        assert node.pid is not None
        body = _big_upload(tmp_path)
        assert len(body) > 512 << 20
        time.sleep(1.0)
        base = _settled_rss(node.pid)
        figures = [f"baseline {base:.0f} MiB"]
        over = body + b"\0" * (100 << 20)  # 612 MiB: over the limit
        for label, data, chunked, want in (
                ("612 MiB with Content-Length", over, False, 413),
                ("612 MiB chunked", over, True, 413),
                ("512 MiB dry-run plan, accepted", body, False, 200)):
            status, answer = _post(node.socket, "/v1/jobs?dry_run=1", data, chunked)
            assert status == want, (label, answer[:300])
            rss = _settled_rss(node.pid)
            figures.append(f"{label}: HTTP {status}, RSS {rss:.0f} MiB ({rss - base:+.0f})")
            assert rss - base < SLACK_MIB, "\n".join(figures)
        assert list((node.state_dir / "uploads").iterdir()) == []  # no spool left behind
        print("\n".join(figures))
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
