"""Persisted job records (`fusiond.jobs.history`): round trip, a job the stop killed, bad files
skipped, the oldest pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusiond.jobs.history import HISTORY_KEPT, MAX_RECORD_BYTES, JobHistory


def _rec(job_id: str, state: str = "done", t: float = 1.0, **extra: object) -> dict[str, object]:
    return {"job_id": job_id, "state": state, "submitted_at": t, "output": "/out/x",
            "lines": ["a"], "history": [{"step": 0}], "outputs": {}, **extra}


def test_round_trip_and_bounded_history(tmp_path: Path) -> None:
    h = JobHistory(tmp_path / "jobs")
    assert h.load() == {}  # no directory yet
    h.save("j-000001", _rec("j-000001", history=[{"step": i} for i in range(HISTORY_KEPT + 5)]))
    got = JobHistory(tmp_path / "jobs").load()
    assert list(got) == ["j-000001"] and got["j-000001"]["state"] == "done"
    assert [x["step"] for x in got["j-000001"]["history"]] == list(range(5, HISTORY_KEPT + 5))
    assert not list((tmp_path / "jobs").glob("*.tmp"))
    with pytest.raises(ValueError, match="cannot name a file"):
        h.save("../evil", _rec("../evil"))


def test_a_job_running_at_the_stop_is_failed_with_the_resume_command(tmp_path: Path) -> None:
    h = JobHistory(tmp_path)
    h.save("j-000002", _rec("j-000002", state="running"))
    got = h.load()["j-000002"]
    assert got["state"] == "failed"
    assert "stopped while the job ran" in got["outcome"]["failure"]
    assert got["lines"][-1] == ("resume it: fusionctl submit JOB.toml --resume "
                                "/out/x/checkpoint-N.safetensors")
    again = JobHistory(tmp_path).load()["j-000002"]  # rewritten: not failed twice
    assert again["state"] == "failed" and again["lines"] == got["lines"]


def test_bad_files_are_skipped_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    h = JobHistory(tmp_path)
    h.save("good-000003", _rec("good-000003"))
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "other.json").write_text(json.dumps(_rec("mismatch")))
    (tmp_path / "nostate.json").write_text(json.dumps({"job_id": "nostate"}))
    (tmp_path / "badlines.json").write_text(json.dumps(_rec("badlines", lines="x")))
    (tmp_path / "huge.json").write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    assert list(h.load()) == ["good-000003"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 6
    assert any("does not match its file name" in m for m in skipped)
    assert any("lines is not a list" in m for m in skipped)


def test_only_the_newest_records_are_kept(tmp_path: Path) -> None:
    h = JobHistory(tmp_path, keep=3)
    for i in range(5):
        h.save(f"j-{i:06d}", _rec(f"j-{i:06d}", t=float(i)))
    assert sorted(h.load()) == ["j-000002", "j-000003", "j-000004"]
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["j-000002", "j-000003",
                                                               "j-000004"]
