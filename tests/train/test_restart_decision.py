"""The restart decision after a failed attempt (`fusiond.jobs.runner.decide_restart`) and when
a machine left out is planned again (`released_exclusions`), with plain values: no network, no
service, no stand-in for one."""

from __future__ import annotations

from typing import Any

import pytest

from fusiond.jobs.coordinator import (
    FAULT_JOB,
    FAULT_MACHINE,
    FAULT_REFUSED,
    FAULT_SCHEDULER,
    FAULT_STALE,
    FailureReport,
)
from fusiond.jobs.runner import EXCLUDE_FOR_S, RestartDecision, decide_restart, released_exclusions

ME = "m0"
INPUT_TIMEOUT = "m0: stage 0, step 3, B0: no backward on edge 'add_93:0->1' within 15s"


def _failure(node: str = "m1", fault: str = FAULT_MACHINE, cause: str = "connection lost",
             others: tuple[str, ...] = ()) -> FailureReport:
    return FailureReport(node, 1, 3, cause, fault, others)


def _decide(failure: FailureReport | None, *, ok: bool = False, **kw: Any) -> RestartDecision:
    return decide_restart(ok, failure, **({"self_node": ME, "restarts": 0, "max_restarts": 3}
                                          | kw))


def test_a_machine_that_failed_is_left_out_of_the_restart() -> None:
    f = _failure("m1", others=("m2",))
    d = _decide(f, restarts=1)
    assert d == RestartDecision(True, "restart", log=f"attempt 2 failed: {f}",
                                exclude=("m1", "m2"), refused=False)


def test_nothing_is_restarted_after_an_attempt_that_succeeded() -> None:
    assert _decide(None, ok=True) == RestartDecision(False, "ok")
    assert _decide(_failure(), ok=True).restart is False
    assert _decide(None) == RestartDecision(False, "no_failure")


def test_a_cancelled_job_or_a_closing_daemon_restarts_nothing() -> None:
    assert _decide(_failure(), cancel_requested=True) == RestartDecision(False, "cancelled")
    assert _decide(_failure(), closed=True) == RestartDecision(False, "closed")


def test_a_daemon_that_lost_the_lease_hands_the_job_back_instead() -> None:
    f = _failure()
    d = _decide(f, not_leading="this daemon lost its quorum (term 3)")
    assert not d.restart and d.why == "not_leading" and not d.exclude
    assert d.hand_back == "this daemon lost its quorum (term 3)"
    assert d.log == f"attempt 1 failed ({f}); not restarted here: this daemon lost its " \
                    "quorum (term 3)"


def test_a_job_already_handed_back_is_not_restarted_nor_handed_back_again() -> None:
    d = _decide(_failure(), handed_back="it stepped down", not_leading="no quorum")
    assert d == RestartDecision(False, "handed_back")


def test_a_stale_refusal_hands_the_job_back_blaming_no_machine() -> None:
    f = _failure("m2", FAULT_STALE, "not_scheduler: term 4 > 3")
    d = _decide(f)
    assert not d.restart and d.why == "stale" and not d.exclude
    assert d.hand_back == f"a member does not take this daemon for the scheduler: {f}"
    assert d.log == f"attempt 1 failed ({f}); not restarted here: another scheduler was elected"


def test_the_jobs_own_error_is_never_retried() -> None:
    f = _failure("m1", FAULT_JOB, "ZeroDivisionError in forward")
    assert _decide(f) == RestartDecision(False, "job_fault", log=f"not restarted: {f}")


def test_a_fault_of_the_scheduler_side_ends_the_job() -> None:
    assert _decide(_failure("scheduler", FAULT_SCHEDULER, "a bug")) == \
        RestartDecision(False, "scheduler_fault")


def test_a_failure_naming_no_machine_ends_the_job() -> None:
    assert _decide(_failure("m1", "unknown")) == RestartDecision(False, "no_machines")


def test_a_failure_of_the_schedulers_own_machine_ends_the_job() -> None:
    assert _decide(_failure(ME, cause="out of memory")) == \
        RestartDecision(False, "scheduler_machine")


@pytest.mark.parametrize("others", [(), ("m2",)])
def test_an_input_timeout_on_the_schedulers_own_stage_restarts_blaming_itself_never(
        others: tuple[str, ...]) -> None:
    f = _failure(ME, cause=INPUT_TIMEOUT, others=others)
    d = _decide(f)
    assert d.restart and d.why == "victim" and d.exclude == others and not d.refused
    assert d.log == f"attempt 1 failed: {f}"


def test_an_input_timeout_elsewhere_leaves_that_machine_out() -> None:
    d = _decide(_failure("m1", cause=INPUT_TIMEOUT.replace("m0:", "m1:")))
    assert d.restart and d.why == "restart" and d.exclude == ("m1",)


def test_a_refused_partition_is_left_out_even_on_the_schedulers_own_machine() -> None:
    d = _decide(_failure(ME, FAULT_REFUSED, "assign_failed: no op aten.foo"))
    assert d.restart and d.why == "restart" and d.exclude == (ME,) and d.refused
    d = _decide(_failure("m2", FAULT_REFUSED, "assign_failed: no op aten.foo"))
    assert d.exclude == ("m2",) and d.refused


def test_no_restart_past_max_restarts() -> None:
    assert _decide(_failure(), restarts=3, max_restarts=3) == \
        RestartDecision(False, "max_restarts")
    assert _decide(_failure(), restarts=0, max_restarts=0).why == "max_restarts"
    assert _decide(_failure(), restarts=2, max_restarts=3).restart


def test_a_machine_is_planned_again_once_it_restarted_or_after_the_exclusion_time() -> None:
    t0 = 1000.0
    excluded = {"m1": (101, t0, False), "m2": (102, t0, False), "m3": (103, t0, True),
                "m4": (None, t0, False)}
    incarnations: dict[str, int | None] = {"m1": 101, "m2": 102, "m3": 103, "m4": None}
    assert released_exclusions(excluded, incarnations.get, t0 + 1) == {}
    incarnations["m1"] = 201  # m1 restarted
    assert released_exclusions(excluded, incarnations.get, t0 + 2) == {
        "m1": "it restarted since it failed"}
    late = t0 + EXCLUDE_FOR_S
    assert released_exclusions(excluded, incarnations.get, late) == {
        "m1": "it restarted since it failed", "m2": f"{EXCLUDE_FOR_S:g}s since it failed",
        "m4": f"{EXCLUDE_FOR_S:g}s since it failed"}  # m3 refused: only a restart lets it in
    incarnations["m3"] = 203
    assert list(released_exclusions(excluded, incarnations.get, late)) == [
        "m1", "m2", "m3", "m4"]
