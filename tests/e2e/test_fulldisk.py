"""Work lost without a word, on real daemons and real full filesystems (small tmpfs mounts, made
and removed by the tests; root only):

- the output directory is full, and the job goes through a daemon that is not the scheduler:
  `fusionctl submit` does NOT say done with exit 0; it exits 7 naming the file and "No space
  left on device", and the command that writes the outputs later; nothing `.tmp` is left; once
  there is room, `fusionctl fetch ID` writes the model, metrics.json (every step) and the
  checkpoints;
- the submitting daemon's own state dir is full (its output store): the job ends failed saying
  why, nothing `.tmp` is left there, the scheduler (another daemon, or itself) keeps the
  weights, and once there is room `fusionctl fetch ID` stores and writes them, and the job
  reads done.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusionctl.local import merge
from fusiond.jobs.results import load_model_state
from fusiond.train.model import build_model
from fusiond.train.spec import load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import JOB_MEMORY_GIB, JOB_TIMERS, ctl, leader_and_other
from tests.e2e.test_jobs import GPT2, _write
from tests.fullfs import fill, small_fs, small_fs_at, temp_files

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_full_output_directory_is_an_error_and_the_outputs_can_be_fetched_later(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lead, other = leader_and_other(cluster3)
    steps = 12
    with small_fs(1 << 20) as fs:
        out = fs / "run"
        job = tmp_path / "job.toml"
        job.write_text(GPT2.replace("steps = 20", f"steps = {steps}\ncheckpoint_interval = 5")
                       .replace("{out}", str(out)))
        filler = fill(fs, leave_bytes=16 << 10)  # room for a directory, not for a model
        rc, res, err = ctl(other, "submit", str(job), "--stages", "3", "--json",
                           capsys=capsys)
        assert rc == 7, (rc, err[-3000:])
        job_id = res["job_id"]
        assert res["state"] == "done" and res["scheduler"] == cluster3.node_id(lead)
        assert "were NOT all written" in err and "No space left on device" in err, err
        assert f"{out}/" in err and f"fusionctl fetch {job_id}" in err, err
        assert temp_files(fs) == [], temp_files(fs)  # no .tmp, no 0-byte leftovers
        assert not out.exists() or list(out.iterdir()) == []
        # the daemon kept every output; with room again, fetch writes them here
        filler.unlink()
        rc, _, err = ctl(other, "fetch", job_id, "--json", capsys=capsys)
        assert rc == 0, err
        names = sorted(p.name for p in out.iterdir())
        assert names == ["checkpoint-10.safetensors", "checkpoint-5.safetensors",
                         "metrics.json", "model.safetensors"], names
        metrics = json.loads((out / "metrics.json").read_text())
        assert [s["step"] for s in metrics["steps"]] == list(range(steps))
        fresh = build_model(load_job(job).model)
        fresh.load_state_dict(load_model_state(out / "model.safetensors"), strict=True)
        assert temp_files(fs) == []
        # fetched again: identical files are left alone
        rc, again, err = ctl(other, "fetch", job_id, "--json", capsys=capsys)
        assert rc == 0 and again["new"] == [], err


@contextlib.contextmanager
def _cluster_on_small_state_dirs(root: Path, size_bytes: int
                                 ) -> Iterator[tuple[Cluster, dict[int, Path]]]:
    """Three daemons whose state dirs are each a small tmpfs (their credentials copied in),
    unmounted after they stopped."""
    c = Cluster(root, 3, {"job_memory_gib": JOB_MEMORY_GIB, "metrics": {"listen": ""},
                          "cluster": JOB_TIMERS})
    with contextlib.ExitStack() as stack:  # unwinds last in, first out
        mounts: dict[int, Path] = {}
        for node in reversed(c.nodes):
            keep = Path(tempfile.mkdtemp(prefix="fzcred"))
            stack.callback(shutil.rmtree, keep, True)
            shutil.copytree(node.state_dir, keep / "state")
            stack.enter_context(small_fs_at(node.state_dir, size_bytes, 0o700))
            for p in (keep / "state").iterdir():
                shutil.copy2(p, node.state_dir / p.name)
            mounts[node.index] = node.state_dir
        stack.callback(c.stop)  # the daemons stop before their state dirs are unmounted
        c.start(c.nodes[:1])
        c.wait_up(c.nodes[:1])
        addr = c.address(c.nodes[0])
        for node in c.nodes[1:]:
            node.settings = merge(node.settings, {"cluster": {"bootstrap": [addr]}})
        c.start(c.nodes[1:])
        c.wait_up()
        c.wait_agreement(timeout=30.0)
        yield c, mounts


def _run_while_full(c: Cluster, node: Any, state: Path, job: Path, steps: int,
                    capsys: pytest.CaptureFixture[str]) -> str:
    """Submit `job` through `node` (detached), fill `node`'s state dir once it runs, wait for
    the end; the job id. The state dir is left full (the filler is `state/filler`)."""
    rc, res, err = ctl(node, "submit", str(job), "--stages", "3", "--detach", "--json",
                       capsys=capsys)
    assert rc == 0, err
    job_id = str(res["job_id"])

    def stepping() -> tuple[bool, str]:
        d = node.api("GET", f"/v1/jobs/{job_id}?history=0")
        return d["step"] >= 2, f"{d['state']} at step {d['step']}"

    c.wait_for(stepping, 90.0, "the job running")
    fill(state, leave_bytes=4 << 10)

    def ended() -> tuple[bool, str]:
        d = node.api("GET", f"/v1/jobs/{job_id}?history=0")
        return d["state"] != "running", d["state"]

    c.wait_for(ended, 150.0, "the job ending")
    return job_id


def test_a_full_state_dir_fails_the_job_and_the_scheduler_keeps_the_weights(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="fzd"))
    try:
        with _cluster_on_small_state_dirs(root, 8 << 20) as (c, mounts):
            _full_state_dirs(c, mounts, tmp_path, capsys)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _full_state_dirs(c: Cluster, mounts: dict[int, Path], tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    if True:  # (kept indented: the body of the test above)
        lead, other = leader_and_other(c)
        steps = 30
        for who, node in (("forwarded", other), ("local", lead)):
            d = tmp_path / who
            d.mkdir()
            job = _write(d, GPT2.replace("steps = 20",
                                         f"steps = {steps}\ncheckpoint_interval = 10"))
            state = mounts[node.index]
            job_id = _run_while_full(c, node, state, job, steps, capsys)
            shown = node.api("GET", f"/v1/jobs/{job_id}?history=0")
            lines = node.api("GET", f"/v1/jobs/{job_id}/logs")["lines"]
            failure = shown["outcome"]["failure"]
            assert shown["state"] == "failed", (who, shown["outcome"], lines[-8:])
            assert "No space left on device" in failure, (who, failure)
            assert f"fusionctl fetch {job_id}" in failure, (who, failure)
            holder = c.node_id(lead)
            assert f"{holder} holds the weights" in failure or (
                who == "local" and "the daemon holds the weights" in failure), failure
            assert temp_files(state) == [], (who, temp_files(state))  # nothing half-written
            # room again: fetch stores them (from the scheduler that kept them), writes them
            (state / "filler").unlink()
            rc, _, err = ctl(node, "fetch", job_id, "--json", capsys=capsys)
            assert rc == 0, (who, err)
            out = d / "out"
            assert (out / "model.safetensors").exists(), sorted(out.iterdir())
            metrics = json.loads((out / "metrics.json").read_text())
            assert [s["step"] for s in metrics["steps"]] == list(range(steps)), who
            assert metrics["summary"]["ok"] is True
            fresh = build_model(load_job(job).model)
            fresh.load_state_dict(load_model_state(out / "model.safetensors"), strict=True)
            assert node.api("GET", f"/v1/jobs/{job_id}?history=0")["state"] == "done", who
            assert temp_files(state) == [], who
