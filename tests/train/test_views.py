"""What the API shows of jobs (`fusiond.jobs.views`), from plain records: a forwarded job's
view prefers this daemon's own history to the scheduler's last status, `fusionctl jobs` lists
the past jobs of earlier runs first (oldest first) and never a live job twice."""

from __future__ import annotations

from pathlib import Path

from fusiond.jobs.history import StepHistory
from fusiond.jobs.outputs import StoredFile
from fusiond.jobs.records import RemoteJob
from fusiond.jobs.views import (
    JOBS_KEYS,
    jobs_view,
    logs_view,
    output_dir_of,
    outputs_brief,
    outputs_view,
    owner_of,
    past_view,
    remote_view,
)


def _remote(job_id: str = "j-abcdef", **status: object) -> RemoteJob:
    return RemoteJob(job_id, "m2", Path("/out/j"), {"job_id": job_id, "state": "running",
                                                     **status},
                     owner_uid=1000, submitted_at=50.0)


def test_a_forwarded_job_shows_its_own_history_over_the_schedulers_status() -> None:
    r = _remote(step=1, loss=9.0, lines=["scheduler line"])
    r.history = StepHistory([{"step": 0, "loss": 4.0}, {"step": 1, "loss": 3.0},
                             {"step": 2, "loss": 2.5}])
    v = remote_view(r, 2, {"model.safetensors": {"size_bytes": 3, "sha256": "ab"}})
    assert v["step"] == 3 and v["loss"] == 2.5 and v["first_loss"] == 4.0
    assert [h["step"] for h in v["history"]] == [1, 2] and v["steps_recorded"] == 3
    assert v["scheduler"] == "m2" and v["owner_uid"] == 1000 and v["submitted_at"] == 50.0
    assert v["outputs"] == {"model.safetensors": {"size_bytes": 3, "sha256": "ab"}}
    bare = remote_view(_remote(step=7, loss=1.5, first_loss=6.0), 0, {})
    assert (bare["step"], bare["loss"], bare["first_loss"], bare["history"]) == (7, 1.5, 6.0, [])


def test_jobs_lists_past_jobs_oldest_first_and_a_live_one_once() -> None:
    past = {"old-000001": {"job_id": "old-000001", "submitted_at": 20.0, "extra": 1},
            "older-000002": {"job_id": "older-000002", "submitted_at": 10.0},
            "j-abcdef": {"job_id": "j-abcdef", "submitted_at": 1.0, "state": "failed"}}
    remote = _remote()
    v = jobs_view("m0", {}, {remote.job_id: remote}, past, {"k-000003": {"stage": 1}})
    assert [j["job_id"] for j in v["jobs"]] == ["older-000002", "old-000001", "j-abcdef"]
    assert all(set(j) <= set(JOBS_KEYS) for j in v["jobs"])
    assert v["jobs"][-1]["state"] == "running" and v["jobs"][-1]["scheduler"] == "m2"
    assert v["coordinating"] == [] and v["stages"] == [{"job_id": "k-000003", "stage": 1}]
    assert v["node_id"] == "m0"


def test_logs_owner_and_output_of_past_and_forwarded_jobs() -> None:
    r = _remote(lines=["from the scheduler"])
    r.notes.append("failed over")
    assert logs_view(r.job_id, r, None)["lines"] == ["failed over", "from the scheduler"]
    assert logs_view("p-000001", None, {"lines": ["a", "b"]}) == {
        "job_id": "p-000001", "lines": ["a", "b"]}
    assert owner_of(r, None) == 1000
    assert owner_of(None, {"owner_uid": 7}) == 7
    assert owner_of(None, {"owner_uid": True}) is None  # a bool is no uid
    assert owner_of(None, None) is None
    assert output_dir_of(r, None) == "/out/j"
    assert output_dir_of(None, {"output": "/o"}) == "/o"
    assert output_dir_of(None, {}) is None
    assert past_view({"job_id": "p", "history": [1, 2, 3]}, 2)["history"] == [2, 3]
    assert past_view({"job_id": "p", "history": [1, 2, 3]}, 0)["history"] == []


def test_outputs_say_what_is_stored_and_who_holds_the_rest() -> None:
    files = [StoredFile("metrics.json", 10, "cd")]
    assert outputs_brief(files) == {"metrics.json": {"size_bytes": 10, "sha256": "cd"}}
    r = _remote()
    r.unstored = {"model.safetensors": "No space left on device"}
    r.held_by = "m2"
    v = outputs_view(r.job_id, r, {}, node_id="m0", output="/out/j", files=files)
    assert v == {"job_id": r.job_id, "state": "running", "output": "/out/j",
                 "files": [{"name": "metrics.json", "size_bytes": 10, "sha256": "cd"}],
                 "unstored": {"model.safetensors": "No space left on device"},
                 "held_by": "m2"}
    gone = outputs_view("p", None, {"state": "done"}, node_id="m0", output=None, files=[])
    assert gone["state"] == "done" and gone["held_by"] is None and gone["unstored"] == {}
