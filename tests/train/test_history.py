"""Persisted job records and step histories (`fusiond.jobs.history`): round trip, a job the stop
killed, bad files skipped, the oldest pruned; a step history keeps each step once across
rewinds (restarts, failovers), is bounded by thinning, and its file is appended, rewritten
after a rewind, and survives a torn last line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.jobs.history import HISTORY_KEPT, MAX_RECORD_BYTES, JobHistory, StepHistory

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock


def _rec(job_id: str, state: str = "done", t: float = 1.0, **extra: object) -> dict[str, object]:
    return {"job_id": job_id, "state": state, "submitted_at": t, "output": "/out/x",
            "lines": ["a"], "outputs": {}, **extra}


def test_round_trip_with_the_whole_step_history(tmp_path: Path) -> None:
    h = JobHistory(tmp_path / "jobs")
    assert h.load() == {}  # no directory yet
    steps = StepHistory()
    steps.extend({"step": i, "loss": 1.0 / (i + 1)} for i in range(HISTORY_KEPT + 5))
    h.save("j-000001", _rec("j-000001", owner_uid=1234, history=["not stored here"]))
    assert h.save_steps("j-000001", steps) == HISTORY_KEPT + 5
    got = JobHistory(tmp_path / "jobs").load()
    assert list(got) == ["j-000001"] and got["j-000001"]["state"] == "done"
    assert got["j-000001"]["owner_uid"] == 1234
    # in memory: the newest HISTORY_KEPT; on disk: every step
    assert [x["step"] for x in got["j-000001"]["history"]] == list(range(5, HISTORY_KEPT + 5))
    assert [x["step"] for x in h.steps("j-000001")] == list(range(HISTORY_KEPT + 5))
    assert not list((tmp_path / "jobs").glob(".*.tmp"))
    with pytest.raises(ValueError, match="cannot name a file"):
        h.save("../evil", _rec("../evil"))


def test_a_job_running_at_the_stop_is_failed_with_the_resume_command(tmp_path: Path) -> None:
    h = JobHistory(tmp_path)
    h.save("j-000002", _rec("j-000002", state="running"))
    got = h.load()["j-000002"]
    assert got["state"] == "failed"
    assert "stopped while the job ran" in got["outcome"]["failure"]
    assert got["lines"][-1] == ("resume it: fusionctl fetch j-000002, then fusionctl submit "
                                "JOB.toml --resume /out/x/checkpoint-N.safetensors")
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
    (tmp_path / "badowner.json").write_text(json.dumps(_rec("badowner", owner_uid="root")))
    (tmp_path / "huge.json").write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    assert list(h.load()) == ["good-000003"]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 7
    assert any("does not match its file name" in m for m in skipped)
    assert any("lines is not a list" in m for m in skipped)
    assert any("owner_uid" in m for m in skipped)


def test_only_the_newest_records_are_kept_with_their_steps(tmp_path: Path) -> None:
    h = JobHistory(tmp_path, keep=3)
    for i in range(5):
        h.save(f"j-{i:06d}", _rec(f"j-{i:06d}", t=float(i)))
        h.save_steps(f"j-{i:06d}", StepHistory([{"step": 0}]))
    assert sorted(h.load()) == ["j-000002", "j-000003", "j-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"j-00000{i}{s}" for i in (2, 3, 4) for s in (".json", ".steps.jsonl")]


def test_a_record_for_a_step_held_supersedes_it_and_every_later_one() -> None:
    h = StepHistory()
    h.extend({"step": s, "attempt": 1} for s in range(10))
    h.add({"step": 6, "attempt": 2})  # a restart resumed after the checkpoint of step 5
    h.extend({"step": s, "attempt": 2} for s in range(7, 12))
    assert h.steps() == list(range(12))
    assert [r["attempt"] for r in h] == [1] * 6 + [2] * 6
    with pytest.raises(ValueError, match="integer step"):
        h.add({"loss": 1.0})


def test_a_cursor_sends_each_record_once_and_rewinds_with_the_history() -> None:
    h = StepHistory()
    c = h.cursor()
    h.extend({"step": s} for s in range(5))
    assert [r["step"] for r in h.take(c, 3)] == [0, 1, 2]
    assert [r["step"] for r in h.take(c, 10)] == [3, 4]
    assert h.take(c, 10) == []
    h.truncate_from(2)  # the attempt resumes at step 2
    h.extend({"step": s, "again": True} for s in range(2, 4))
    assert [(r["step"], r.get("again")) for r in h.take(c, 10)] == [(2, True), (3, True)]
    big = {"step": 4, "pad": "x" * 1000}
    h.add(big)
    h.add({"step": 5, "pad": "x" * 1000})
    assert [r["step"] for r in h.take(c, 10, max_bytes=1500)] == [4]  # bounded in bytes too


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 15)), min_size=1, max_size=12))
def test_any_sequence_of_attempts_leaves_each_step_once_in_order(
        attempts: list[tuple[int, int]]) -> None:
    """Whatever attempts run (each resuming at some step and running a few steps), the
    history holds each step once, in order, each from the latest attempt that ran it, and
    a receiver fed through a cursor ends with the same records."""
    h, mirror = StepHistory(), StepHistory()
    c = h.cursor()
    want: dict[int, int] = {}
    for k, (first, n) in enumerate(attempts):
        h.truncate_from(first)
        for s in [x for x in want if x >= first]:
            del want[s]
        for s in range(first, first + n):
            h.add({"step": s, "attempt": k})
            want[s] = k
        mirror.extend(h.take(c, 7))
    mirror.extend(h.take(c, 10_000))
    assert h.steps() == sorted(h.steps()) and len(set(h.steps())) == len(h)
    assert {r["step"]: r["attempt"] for r in h} == {s: a for s, a in want.items()
                                                   if s in set(h.steps())}
    assert list(mirror) == list(h)


def test_thinning_bounds_the_history_and_says_so() -> None:
    h = StepHistory(cap=100)
    h.extend({"step": s} for s in range(1000))
    assert len(h) <= 100 and h.thinned == 1000 - len(h)
    steps = h.steps()
    assert steps[0] == 0 and steps[-50:] == list(range(950, 1000))  # newest half whole
    assert steps == sorted(set(steps))


def test_the_steps_file_is_appended_rewritten_after_a_rewind_and_survives_a_torn_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    jh = JobHistory(tmp_path)
    h = StepHistory()
    h.extend({"step": s, "loss": float("nan") if s == 3 else 1.0} for s in range(5))
    jh.save_steps("j-000009", h)
    f = tmp_path / "j-000009.steps.jsonl"
    first = f.stat().st_ino
    h.extend({"step": s} for s in range(5, 8))
    assert jh.save_steps("j-000009", h) == 3
    assert f.stat().st_ino == first  # appended in place
    h.truncate_from(6)
    h.add({"step": 6, "again": True})
    jh.save_steps("j-000009", h)
    assert f.stat().st_ino != first  # rewritten whole (atomically)
    got = jh.steps("j-000009")
    assert [r["step"] for r in got] == list(range(7)) and got[-1]["again"] is True
    assert got[3]["loss"] is None  # JSON has no NaN
    with f.open("ab") as out:  # a kill mid-append leaves a torn last line
        out.write(b'{"step": 7, "lo')
    assert [r["step"] for r in jh.steps("j-000009")] == list(range(7))
    assert any("torn or damaged" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in jh.steps("j-000009", tail=2)] == [5, 6]
    h.add({"step": 7})  # the next append starts a fresh line after the torn one
    jh.save_steps("j-000009", h)
    assert [r["step"] for r in jh.steps("j-000009")] == list(range(8))
