"""What /metrics adds beyond the live figures: the client library's process and platform
collectors, `fusion_build_info`, and the counters of the jobs coordinated here (outcomes,
restarts, a step-duration histogram), with an ended job's figures kept long enough for an
alert to fire on it."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fusiond
from fusiond.jobs.metrics import KEEP_ENDED_S, JobCollector, JobStats
from fusiond.metrics import make_registry


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


class Coord:
    def __init__(self, job: str) -> None:
        self.job = job

    def status(self) -> dict[str, Any]:
        return {"job_id": self.job, "state": "running", "steps": 10, "step": 3, "loss": 2.5,
                "tokens_per_s": 100.0, "samples_per_s": None, "edges": [],
                "stages": [{"stage": 0, "node": "n1", "busy": 0.5, "wait": 0.1}]}


def test_build_info_and_the_process_collectors() -> None:
    got = _samples(generate_latest(make_registry()).decode())
    [info] = [k for k in got if k[0] == "fusion_build_info"]
    assert dict(info[1])["version"] == fusiond.__version__ and got[info] == 1.0
    names = {k[0] for k in got}
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info",
            "python_gc_collections_total"} <= names


def test_job_outcomes_restarts_step_times_and_ended_jobs_that_stay_a_while() -> None:
    now = [1000.0]
    stats = JobStats(clock=lambda: now[0])
    running: list[Coord] = [Coord("a"), Coord("b")]
    reg = make_registry(JobCollector(lambda: list(running), stats), process=False)
    for wall in (0.004, 0.03, 0.03, 7.0, 1e4):
        stats.step(wall)
    stats.step(float("nan"))  # not a duration: not counted
    stats.restarted()
    ended = Coord("b").status()
    running.pop()
    stats.ended("b", "failed", ended)
    got = _samples(generate_latest(reg).decode())
    assert got[("fusion_job_outcomes_total", (("outcome", "failed"),))] == 1.0
    assert got[("fusion_job_outcomes_total", (("outcome", "done"),))] == 0.0
    assert got[("fusion_job_restarts_total", ())] == 1.0
    h = "fusion_job_step_duration_seconds"
    assert got[(f"{h}_bucket", (("le", "0.01"),))] == 1.0
    assert got[(f"{h}_bucket", (("le", "0.05"),))] == 3.0
    assert got[(f"{h}_bucket", (("le", "10.0"),))] == 4.0
    assert got[(f"{h}_bucket", (("le", "+Inf"),))] == 5.0 == got[(f"{h}_count", ())]
    assert abs(got[(f"{h}_sum", ())] - 10007.064) < 1e-6
    # the failed job is still there, with its last figures, for an alert to see
    assert got[("fusion_job_state", (("job", "a"), ("state", "running")))] == 1.0
    assert got[("fusion_job_state", (("job", "b"), ("state", "failed")))] == 1.0
    assert got[("fusion_job_loss", (("job", "b"),))] == 2.5
    now[0] += KEEP_ENDED_S + 1
    got = _samples(generate_latest(reg).decode())
    assert ("fusion_job_state", (("job", "b"), ("state", "failed"))) not in got
    assert got[("fusion_job_outcomes_total", (("outcome", "failed"),))] == 1.0  # a counter
