"""Who may schedule and control a job, and who is to blame when it fails, on real daemons.

- A refusal of an Assign after the scheduler's first job fails that attempt at once, naming the
  node and its reason, and the job is re-planned without it (it used to be swallowed by the
  first job's record: a 120 s wait, then "failed on scheduler").
- The job's own error (a sequence longer than the model's context, from a client that skipped
  the submit-side check) fails the job once, blaming no machine, with no restart.
- A NaN checkpoint is refused by `fusionctl submit --resume` and, sent anyway, by the daemon.
- 3 of 5 daemons killed: the surviving old scheduler, without quorum, never re-plans the job; it
  hands it back; once an operator removes the dead, the survivors' scheduler finishes it.
- An isolated scheduler (test drop switch) cancels its attempt and never re-plans it onto
  itself; the majority's new scheduler finishes the job.
- A scheduler restarted faster than the failure detector (alive, but without the job): the
  submitter asks, hears the job is unknown, and resubmits it within the failover bound.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from fusiond.jobs.submission import FAILOVER_WAIT_S
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other, start_cluster
from tests.e2e.test_jobs import GPT2, _write

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(300)]


def _post(node: Any, body: bytes) -> dict[str, Any]:
    """POST an upload to `node`'s API as a client that skipped fusionctl's own checks would."""
    from fusionctl.client import Client, Endpoint

    return dict(Client(Endpoint(socket_path=node.socket), timeout=300.0).request(
        "POST", "/v1/jobs", raw=body))


def _upload(job: Path, *, check: bool = False, **meta: Any) -> tuple[Any, dict[str, Any]]:
    """(spec and captured model, upload meta) for `job`, captured here WITHOUT the submit-side
    data check (unless `check`): what an old or careless client sends."""
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import load_job

    spec = load_job(job)
    if check:
        from fusiond.jobs.submit import prepare_job

        captured = prepare_job(job).captured
    else:
        _, captured = capture_job(spec)
    from fusiond.jobs.submit import corpus_for_upload

    text = job.read_text()
    digest, corpus = corpus_for_upload(spec)
    _CORPORA[digest] = corpus
    return (spec, captured), {"toml": text, "base": str(job.parent), "out_base": str(Path.cwd()),
                              "data_digest": digest, "data_default": bool(digest) and not corpus,
                              **meta}


_CORPORA: dict[str, bytes] = {}  # corpus bytes by the digest `_upload` put in a meta


def _encode(captured: Any, meta: dict[str, Any], state_bytes: bytes | None = None,
            data: bytes | None = None) -> bytes:
    """The upload of `captured` with `meta`; its data section is `data`, or by default the
    corpus `_upload` read for the meta's digest (what fusionctl sends)."""
    from fusiond.graph import state_to_bytes
    from fusiond.jobs.upload import encode_upload
    from protocol import ir

    if data is None:
        data = _CORPORA.get(str(meta.get("data_digest", "")), b"")
    return encode_upload(meta, ir.dumps(captured.graph),
                         state_bytes if state_bytes is not None
                         else state_to_bytes(captured.state), data)


def _job(node: Any, job_id: str) -> dict[str, Any]:
    return dict(node.api("GET", f"/v1/jobs/{job_id}?history=0"))


def _lines(node: Any, job_id: str) -> list[str]:
    return list(node.api("GET", f"/v1/jobs/{job_id}/logs")["lines"])


def _ended(c: Cluster, node: Any, job_id: str, timeout: float) -> float:
    def ended() -> tuple[bool, str]:
        d = _job(node, job_id)
        return d["state"] != "running", f"{d['state']} at step {d['step']}"

    return c.wait_for(ended, timeout, f"job {job_id} ending")


def _at_step(c: Cluster, node: Any, job_id: str, step: int, timeout: float = 90.0) -> None:
    def stepping() -> tuple[bool, str]:
        d = _job(node, job_id)
        return d["step"] >= step, f"{d['state']} at step {d['step']}"

    c.wait_for(stepping, timeout, f"job {job_id} at step {step}")


def _scheduler_of(c: Cluster, submitter: Any, job_id: str) -> Any:
    """The daemon scheduling the job now (a lease can lapse on a loaded machine and the job
    move); never the submitter in these tests."""
    sched_id = _job(submitter, job_id)["scheduler"]
    sched = next(n for n in c.nodes if c.node_id(n) == sched_id)
    assert sched is not submitter, "the submitter became the job's scheduler"
    return sched


def _no_stage(c: Cluster, nodes: list[Any], job_id: str) -> tuple[bool, str]:
    for n in nodes:
        hosted = [s for s in n.api("GET", "/v1/jobs")["stages"] if s["job_id"] == job_id]
        if hosted:
            return False, f"node{n.index} hosts {hosted}"
    return True, "no stage"


def test_a_refusal_after_the_schedulers_first_job_fails_the_attempt_at_once(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fusiond.jobs.submit import corpus_for_upload

    lead, _ = leader_and_other(cluster3)
    first = _write(tmp_path, GPT2.replace("steps = 20", "steps = 3"), "first.toml")
    rc, res, err = ctl(lead, "submit", str(first), "--stages", "3", "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err  # the scheduler's request ids 1..3 used
    job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 3\nmax_restarts = 1"))
    (spec, captured), meta = _upload(job, stages=3)
    _, corpus = corpus_for_upload(spec)
    # the submitter's hash of its corpus is not what the data stages get: each of them refuses
    # its Assign, as a stage on another Python refuses the default corpus
    meta |= {"data_digest": "0" * 32, "data_default": False}
    t0 = time.monotonic()
    job_id = _post(lead, _encode(captured, meta, data=corpus))["job_id"]
    took = _ended(cluster3, lead, job_id, 60.0)
    d = lead.api("GET", f"/v1/jobs/{job_id}?history=0")
    lines = _lines(lead, job_id)
    assert d["state"] == "failed", (d["outcome"], lines)
    failure = d["outcome"]["failure"]
    assert failure.startswith("job failed on n") and "before the first step" in failure
    assert "refused its Assign (assign_failed)" in failure and "is not the submitter's" in failure
    restart = next(x for x in lines if "restart 1/1" in x)
    refuser = next(x for x in lines if "attempt 1 failed" in x)
    node = refuser.split("job failed on ")[1].split()[0]
    assert f"without {node}" in restart, (restart, refuser)
    assert took < 30 and time.monotonic() - t0 < 40, took  # not 120 s of waiting for Ready


def test_the_jobs_own_error_blames_no_machine(
        cluster3: Cluster, tmp_path: Path) -> None:
    job = _write(tmp_path, GPT2.replace("seq_len = 32", "seq_len = 128"))  # context is 64
    (_, captured), meta = _upload(job, stages=3)  # a client that skips the submit-side check
    lead, _ = leader_and_other(cluster3)
    job_id = _post(lead, _encode(captured, meta))["job_id"]
    _ended(cluster3, lead, job_id, 60.0)
    d = lead.api("GET", f"/v1/jobs/{job_id}?history=0")
    lines = _lines(lead, job_id)
    assert d["state"] == "failed", (d["outcome"], lines)
    failure = d["outcome"]["failure"]
    assert "the job's own error, not the machine's" in failure, failure
    assert "IndexError" in failure and "op aten.embedding.default" in failure, failure
    assert "module 'transformer.wpe'" in failure, failure
    assert d["outcome"]["restarts"] == 0
    assert not any("restart " in x or "without" in x for x in lines), lines
    with pytest.raises(Exception, match=r"data.seq_len = 128 is longer than the model's context"):
        _upload(job, check=True)  # and fusionctl's own check refuses it before anything runs


def test_a_nan_checkpoint_is_refused_at_submit_and_by_the_daemon(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from fusiond.graph import state_to_bytes
    from fusiond.jobs.results import save_model

    job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 10"))
    (_, captured), meta = _upload(job, stages=3, first_step=5)
    name = next(k for k, v in captured.state.items() if v.is_floating_point() and v.ndim == 2)
    nan = {**captured.state, name: captured.state[name].clone().fill_(float("nan"))}
    ckpt = save_model(tmp_path / "checkpoint-5.safetensors", nan, metadata={"step": "4"})
    _, other = leader_and_other(cluster3)
    rc, _, err = ctl(other, "submit", str(job), "--resume", str(ckpt), capsys=capsys)
    assert rc == 1 and "--resume refused" in err and f"tensor '{name}' holds" in err, err
    from fusionctl.client import ApiFailure

    with pytest.raises(ApiFailure, match=f"the submitted weights: tensor '{name}' holds "
                                         r"\d+ non-finite values"):
        _post(other, _encode(captured, meta, state_bytes=state_to_bytes(nan)))
    assert not torch.isfinite(nan[name]).any()
    assert all(j["state"] != "running" for j in other.api("GET", "/v1/jobs")["jobs"])


def test_a_minority_never_schedules(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from fusionctl.cli import run as fusionctl

    root = Path(tempfile.mkdtemp(prefix="fza"))
    c = start_cluster(root, 5)
    try:
        _, submitter = leader_and_other(c)
        job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 60\ncheckpoint_interval = 5"))
        rc, res, err = ctl(submitter, "submit", str(job), "--stages", "5", "--detach", "--json",
                           capsys=capsys)
        assert rc == 0, err
        job_id = res["job_id"]
        _at_step(c, submitter, job_id, 7)
        lead = _scheduler_of(c, submitter, job_id)
        gone = [n for n in c.nodes if n is not lead and n is not submitter]
        gone_ids = [c.node_id(n) for n in gone]
        for n in gone:
            n.kill()
        survivors = [lead, submitter]

        def handed_back() -> tuple[bool, str]:
            d = _job(lead, job_id)
            return d["state"] == "handed_back", d["state"]

        c.wait_for(handed_back, 30.0, "the old scheduler giving the job up")
        time.sleep(12.0)  # the dead are declared dead meanwhile (8 s): nobody re-plans
        lines = _lines(lead, job_id)
        assert any("stops scheduling the job" in x for x in lines), lines
        assert not any("restart " in x for x in lines), lines
        ok, why = _no_stage(c, survivors, job_id)
        assert ok, why
        d = _job(submitter, job_id)
        assert d["state"] == "running", d  # waiting for a scheduler with a quorum
        notes = _lines(submitter, job_id)
        assert any("gave the job up" in x for x in notes), notes
        # An operator removes the dead for good: the two form a majority of two, elect a
        # scheduler, and the submitter's failover finishes the job there.
        for nid in gone_ids:
            assert fusionctl(["--socket", submitter.socket, "remove", nid]) == 0
        _ended(c, submitter, job_id, 150.0)
        d = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")
        assert d["state"] == "done", (d.get("outcome"), _lines(submitter, job_id)[-10:])
        rc, _, err = ctl(submitter, "fetch", job_id, "--json", capsys=capsys)  # (--detach)
        assert rc == 0, err
        assert (tmp_path / "out" / "model.safetensors").exists()
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_an_isolated_scheduler_cancels_its_attempt(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="fzi"))
    c = start_cluster(root)
    lead: Any = None
    try:
        _, submitter = leader_and_other(c)
        job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 60\ncheckpoint_interval = 5"))
        rc, res, err = ctl(submitter, "submit", str(job), "--stages", "3", "--detach", "--json",
                           capsys=capsys)
        assert rc == 0, err
        job_id = res["job_id"]
        _at_step(c, submitter, job_id, 12)
        lead = _scheduler_of(c, submitter, job_id)
        lead_id = c.node_id(lead)
        others = [n for n in c.nodes if n is not lead]
        before = sum("restart " in x for x in _lines(lead, job_id))
        c.block(lead, [c.node_id(n) for n in others])
        for n in others:
            c.block(n, [lead_id])

        def cancelled_there() -> tuple[bool, str]:
            d = _job(lead, job_id)
            return d["state"] == "handed_back", d["state"]

        c.wait_for(cancelled_there, 30.0, "the isolated scheduler giving the job up")
        c.wait_for(lambda: _no_stage(c, [lead], job_id), 15.0, "its own stage freed")
        _ended(c, submitter, job_id, 150.0)
        d = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")
        assert d["state"] == "done", (d.get("outcome"), _lines(submitter, job_id)[-10:])
        assert d["scheduler"] != lead_id
        lines = _lines(lead, job_id)
        assert sum("restart " in x for x in lines) == before, lines  # never re-planned onto itself
        assert _job(lead, job_id)["state"] == "handed_back"
    finally:
        if lead is not None:
            for n in c.nodes:
                if n.alive():
                    c.block(n, [])
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_scheduler_that_lost_the_job_gets_it_resubmitted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The scheduler restarts faster than the failure detector declares it dead (here: never
    within the test): alive, in a new incarnation, without the job. Its updates stop; the
    submitter asks, hears "unknown" and resubmits the job from its last checkpoint."""
    from fusionctl.local import merge

    root = Path(tempfile.mkdtemp(prefix="fzq"))
    c = start_cluster(root, timers={"suspect_after_s": 120.0, "dead_after_s": 240.0})
    try:
        _, submitter = leader_and_other(c)
        job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 60\ncheckpoint_interval = 5"))
        rc, res, err = ctl(submitter, "submit", str(job), "--stages", "3", "--detach", "--json",
                           capsys=capsys)
        assert rc == 0, err
        job_id = res["job_id"]
        _at_step(c, submitter, job_id, 12)
        sched = _scheduler_of(c, submitter, job_id)
        seen = len(_lines(submitter, job_id))
        sched.kill()
        t0 = time.monotonic()
        sched.settings = merge(sched.settings,
                               {"cluster": {"bootstrap": [c.address(submitter)]}})
        c.start([sched])
        c.wait_up([sched])

        def resubmitted() -> tuple[bool, str]:
            notes = _lines(submitter, job_id)[seen:]  # (the scheduler's lines go on failover)
            return any("resubmitted" in x or "runs the job" in x for x in notes), notes[-1:]

        c.wait_for(resubmitted, FAILOVER_WAIT_S, "the job resubmitted")
        took = time.monotonic() - t0
        print(f"resubmitted {took:.1f} s after the scheduler's restart began")
        notes = _lines(submitter, job_id)
        assert any("no longer knows the job" in x for x in notes), "\n".join(notes)
        _ended(c, submitter, job_id, 150.0)
        d = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")
        assert d["state"] == "done", (d.get("outcome"), notes[-10:])
        assert took < FAILOVER_WAIT_S, took
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)
