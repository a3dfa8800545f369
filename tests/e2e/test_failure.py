"""A stage daemon killed mid-job (SIGKILL).

- With `max_restarts = 0`: the job fails within 30 s with the first-failure report naming that
  machine and its stage, and the other daemons free their stages and stay healthy.
- By default: the scheduler re-plans the job on the two survivors and resumes it from its last
  checkpoint; the job ends done, every step once in its history, the model written.
- The scheduler itself killed: the submitting daemon resubmits the job to the new scheduler
  from the last checkpoint; metrics.json holds every step of the job exactly once (the steps
  before the failover too).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other, start_cluster
from tests.e2e.test_jobs import GPT2, _write

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(180)]


def _submit_until(c: Cluster, node: Any, job: Path, stages: int, step: int,
                  capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Submit `job` through `node` (detached, `stages` machines); return its summary once the
    job has done `step` steps."""
    rc, res, err = ctl(node, "submit", str(job), "--stages", str(stages), "--detach", "--json",
                       capsys=capsys)
    assert rc == 0, err
    job_id = res["job_id"]

    def stepping() -> tuple[bool, str]:
        d = node.api("GET", f"/v1/jobs/{job_id}?history=0")
        return d["step"] >= step, f"{d['state']} at step {d['step']}"

    c.wait_for(stepping, 90.0, f"job {job_id} at step {step}")
    return dict(res)


def _wait_ended(c: Cluster, node: Any, job_id: str, timeout: float) -> float:
    """Wait until the job is no longer running; the seconds it took."""
    def ended() -> tuple[bool, str]:
        d = node.api("GET", f"/v1/jobs/{job_id}?history=0")
        return d["state"] != "running", f"{d['state']} at step {d['step']}"

    return c.wait_for(ended, timeout, f"job {job_id} ending")


def test_killing_a_stage_daemon_fails_the_job_with_a_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="fzk"))
    c = start_cluster(root)
    try:
        node0, _ = leader_and_other(c)  # the scheduler: stages 1 and 2 run elsewhere
        job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 100000\nmax_restarts = 0"))
        res = _submit_until(c, node0, job, 3, 3, capsys)
        job_id = res["job_id"]
        victim_id = next(s["node"] for s in res["stages"] if s["stage"] == 2)
        victim = next(n for n in c.nodes if c.node_id(n) == victim_id)
        assert victim is not node0
        victim.kill()
        t0 = time.monotonic()
        took = _wait_ended(c, node0, job_id, 30.0)
        d = node0.api("GET", f"/v1/jobs/{job_id}?history=0")
        assert d["state"] == "failed"
        report = d["outcome"]["failure"]
        assert report.startswith(f"job failed on {victim_id} (stage 2, step "), report
        assert took < 30.0 and time.monotonic() - t0 < 30.0
        rc, shown, err = ctl(node0, "job", job_id, "--json", capsys=capsys)
        assert rc == 0 and shown["status"]["failure"] == report, err
        survivors = [n for n in c.nodes if n is not victim]

        def freed() -> tuple[bool, str]:
            for n in survivors:
                if n.status(2.0) is None:
                    return False, f"node{n.index} does not answer"
                if n.api("GET", "/v1/jobs")["stages"]:
                    return False, f"node{n.index} still hosts a stage"
            return True, "freed"

        c.wait_for(freed, 15.0, "the survivors freeing their stages")
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_job_survives_a_stage_daemon_killed_mid_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="fzr"))
    c = start_cluster(root)
    try:
        node0, _ = leader_and_other(c)
        steps = 60
        job = _write(tmp_path, GPT2.replace("steps = 20",
                                            f"steps = {steps}\ncheckpoint_interval = 5"))
        res = _submit_until(c, node0, job, 3, 12, capsys)  # past its second checkpoint
        job_id = res["job_id"]
        victim_id = next(s["node"] for s in res["stages"] if s["stage"] == 1)
        victim = next(n for n in c.nodes if c.node_id(n) == victim_id)
        assert victim is not node0
        victim.kill()
        _wait_ended(c, node0, job_id, 150.0)
        d = node0.api("GET", f"/v1/jobs/{job_id}?history={steps + 10}")
        lines = node0.api("GET", f"/v1/jobs/{job_id}/logs")["lines"]
        assert d["state"] == "done", (d["outcome"], lines[-10:])
        assert d["outcome"]["restarts"] == 1
        assert d["outcome"]["steps"] == steps
        assert [h["step"] for h in d["history"]] == list(range(steps))
        restart = next(x for x in lines if "restart 1/" in x)
        assert "from the checkpoint after step" in restart and victim_id in restart, restart
        survivors = {c.node_id(n) for n in c.nodes if n is not victim}
        assert set(d["outcome"]["stages"].values()) <= survivors
        # Resumed from the checkpoint's weights, not from scratch: the loss right after the
        # restart is near the one before it, not back at the first step's. (The optimizer's
        # moments start afresh, so it is not bit-exact.)
        losses = [h["loss"] for h in d["history"]]
        first = int(restart.split("after step ")[1].split()[0])
        shown = f"resumed at {first}: " + " ".join(f"{x:.3f}" for x in losses)
        assert abs(losses[first] - losses[first - 1]) < 0.5 * (losses[0] - losses[first - 1]), \
            shown
        out = tmp_path / "out"
        rc, _, err = ctl(node0, "fetch", job_id, "--json", capsys=capsys)
        assert rc == 0, err
        assert (out / "model.safetensors").exists() and (out / "metrics.json").exists()
        metrics = json.loads((out / "metrics.json").read_text())
        assert [s["step"] for s in metrics["steps"]] == list(range(steps))
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_job_survives_its_scheduler_killed_mid_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon that took the submission resubmits the job, under the same id, to the
    scheduler the survivors elect (or runs it itself if that is this daemon), from the last
    checkpoint the dead scheduler sent it; `fusionctl` following the job sees it end done, and
    metrics.json holds every one of its steps exactly once."""

    root = Path(tempfile.mkdtemp(prefix="fzs"))
    c = start_cluster(root)
    try:
        lead, submitter = leader_and_other(c)
        steps = 60
        job = _write(tmp_path, GPT2.replace("steps = 20",
                                            f"steps = {steps}\ncheckpoint_interval = 5"))
        lead_id = c.node_id(lead)
        res = _submit_until(c, submitter, job, 3, 12, capsys)  # past its second checkpoint
        job_id = res["job_id"]
        assert res["scheduler"] == lead_id
        out = tmp_path / "out"
        stored = submitter.api("GET", f"/v1/jobs/{job_id}/outputs")["files"]
        assert "checkpoint-10.safetensors" in {f["name"] for f in stored}, stored
        before = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")["steps_recorded"]
        lead.kill()
        _wait_ended(c, submitter, job_id, 150.0)
        # the third member (which took nothing) sees the job too, from the new scheduler's
        # records: they survived the failover
        third = next(n for n in c.nodes if n is not lead and n is not submitter)
        rc, d3, err = ctl(third, "job", job_id, "--json", capsys=capsys)
        assert rc == 0 and d3["state"] == "done", err
        assert d3.get("via_scheduler", c.node_id(third)) != lead_id
        rc, d, err = ctl(submitter, "job", job_id, "--json", capsys=capsys)
        assert rc == 0, err
        lines = submitter.api("GET", f"/v1/jobs/{job_id}/logs")["lines"]
        assert d["state"] == "done", (d.get("outcome"), lines[-10:])
        assert any("declared it dead" in x for x in lines), lines
        assert d["scheduler"] != lead_id
        resumed = next(x for x in lines if "resubmitted to the new scheduler" in x
                       or "this daemon is the new scheduler" in x)
        assert "checkpoint-" in resumed, lines  # from a checkpoint, not from step 0
        rc, _, err = ctl(submitter, "fetch", job_id, "--json", capsys=capsys)
        assert rc == 0, err
        metrics = json.loads((out / "metrics.json").read_text())
        # every step once: the ones before the failover (kept by the submitting daemon, which
        # had `before` of them when the scheduler died) and the resumed attempt's after them
        assert [s["step"] for s in metrics["steps"]] == list(range(steps)), (before, resumed)
        assert metrics["summary"]["steps"] == steps and before >= 12
        assert (out / "model.safetensors").exists()
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_job_records_outlive_a_daemon_restart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon that took a submission keeps its jobs' records in its state dir: after a
    restart `jobs`, `job ID` and `logs ID` still answer; a job its SIGKILL interrupted reads
    failed, with the command that resumes it."""
    root = Path(tempfile.mkdtemp(prefix="fzh"))
    c = start_cluster(root)
    try:
        node, _ = leader_and_other(c)  # the scheduler: it coordinates what it takes
        short = _write(tmp_path, GPT2.replace("steps = 20", "steps = 3"), "short.toml")
        rc, done, err = ctl(node, "submit", str(short), "--stages", "2", "--json",
                            capsys=capsys)
        assert rc == 0 and done["state"] == "done", err
        (tmp_path / "long").mkdir()  # its own output: the first job's is not overwritten
        long = _write(tmp_path / "long", GPT2.replace("steps = 20",
                                                      "steps = 100000\nmax_restarts = 0"))
        long_id = _submit_until(c, node, long, 2, 2, capsys)["job_id"]
        time.sleep(0.3)  # step records are written as they arrive: give the write a moment
        node.kill()
        c.start([node])
        c.wait_up([node])
        rc, listed, err = ctl(node, "jobs", "--json", capsys=capsys)
        assert rc == 0, err
        states = {j["job_id"]: j["state"] for j in listed["jobs"]}
        assert states == {done["job_id"]: "done", long_id: "failed"}, states
        rc, shown, err = ctl(node, "job", done["job_id"], "--json", capsys=capsys)
        assert rc == 0 and shown["outcome"]["ok"] and shown["outputs"]["model.safetensors"], err
        assert [h["step"] for h in shown["history"]] == [0, 1, 2]
        shown = node.api("GET", f"/v1/jobs/{long_id}?history=100000")
        steps = [h["step"] for h in shown["history"]]  # the steps it made, kept on disk
        assert steps == list(range(len(steps))) and len(steps) >= 1, steps
        rc, logs, err = ctl(node, "logs", long_id, "--json", capsys=capsys)
        assert rc == 0, err
        assert "stopped while the job ran" in logs["lines"][-2]
        assert logs["lines"][-1].startswith(f"resume it: fusionctl fetch {long_id}, then "
                                            "fusionctl submit JOB.toml --resume ")
        rc, res, err = ctl(node, "cancel", long_id, "--json", capsys=capsys)
        assert rc == 0 and res["cancelled"] is False, err
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
