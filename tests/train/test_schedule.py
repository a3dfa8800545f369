"""Pipeline schedules: complete, F before B, deadlock-free, 1F1B memory bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.train.schedule import (
    Phase,
    ScheduleError,
    Task,
    gpipe,
    max_in_flight,
    one_f_one_b,
    schedule,
    simulate,
)

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock

SIZES = [(1, 1), (1, 4), (2, 1), (3, 4), (4, 8), (8, 3), (5, 5)]


@pytest.mark.parametrize(("stages", "micro"), SIZES)
@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
def test_every_task_once_forward_first(kind: str, stages: int, micro: int) -> None:
    tasks = schedule(kind, stages, micro)
    assert len(tasks) == stages
    for ts in tasks:
        assert sorted(ts) == sorted(
            [Task(Phase.F, m) for m in range(micro)] + [Task(Phase.B, m) for m in range(micro)]
        )
        for m in range(micro):
            assert ts.index(Task(Phase.F, m)) < ts.index(Task(Phase.B, m))
    order = simulate(tasks)
    assert len(order) == 2 * stages * micro
    # the global order respects the dependencies along the chain
    pos = {(s, t): i for i, (s, t) in enumerate(order)}
    for s in range(1, stages):
        for m in range(micro):
            assert pos[(s - 1, Task(Phase.F, m))] < pos[(s, Task(Phase.F, m))]
            assert pos[(s, Task(Phase.B, m))] < pos[(s - 1, Task(Phase.B, m))]


@pytest.mark.parametrize(("stages", "micro"), SIZES)
def test_1f1b_in_flight_bound(stages: int, micro: int) -> None:
    for i, ts in enumerate(one_f_one_b(stages, micro)):
        assert max_in_flight(ts) <= min(stages - i, micro)
    for ts in gpipe(stages, micro):
        assert max_in_flight(ts) == micro


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.data())
def test_more_in_flight_that_never_grows_down_the_pipeline_never_deadlocks(
        stages: int, micro: int, data: st.DataObject) -> None:
    """A plan may keep more micro-batches in flight on a stage than 1F1B's S - i (to cover a
    slow link's round trip): any counts that do not grow down the pipeline, with skip edges
    too, run without deadlock, and each stage holds exactly min(count, M) in flight."""
    counts: dict[int, int] = {}
    top = micro + 2
    for i in range(stages):  # non-increasing, at least 1F1B's own on some stages
        top = data.draw(st.integers(1, top), label=f"in_flight[{i}]")
        counts[i] = top
    upstream = {i: sorted({i - 1, *data.draw(st.lists(st.integers(0, i - 1), max_size=2),
                                              label=f"skips into {i}")})
                for i in range(1, stages)}
    tasks = one_f_one_b(stages, micro, counts)
    assert len(simulate(tasks, upstream)) == 2 * stages * micro
    for i, ts in enumerate(tasks):
        assert max_in_flight(ts) == min(counts[i], micro)


def test_in_flight_that_grows_down_the_pipeline_deadlocks_and_zero_is_refused() -> None:
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(one_f_one_b(2, 4, {0: 2, 1: 3}))
    with pytest.raises(ScheduleError, match="at least 1"):
        one_f_one_b(2, 4, {0: 0})
    # the default is 1F1B's own; a count above M is GPipe's order
    assert one_f_one_b(3, 4, {}) == one_f_one_b(3, 4)
    assert one_f_one_b(2, 3, {0: 9}) == [gpipe(2, 3)[0], one_f_one_b(2, 3)[1]]
    assert [str(t) for t in one_f_one_b(2, 4, {0: 3})[0]] == [
        "F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]


def test_1f1b_shape() -> None:
    got = [[str(t) for t in ts] for ts in one_f_one_b(3, 4)]
    assert got[0] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    assert got[1] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert got[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_skip_edges_do_not_deadlock() -> None:
    # stage 0 feeds 1 and 3 directly; 2 feeds 3 (a residual across two cuts)
    ups = {1: [0], 2: [1], 3: [0, 2]}
    for kind in ("1f1b", "gpipe"):
        simulate(schedule(kind, 4, 6), ups)


def test_simulate_rejects_bad_schedules() -> None:
    good = one_f_one_b(2, 2)
    backward_first = [[Task(Phase.B, 0), Task(Phase.F, 0)], good[1]]
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate(backward_first)
    missing = [good[0][:-1], good[1]]
    with pytest.raises(ScheduleError, match="forwards"):
        simulate(missing)
    # last stage does both forwards before any backward while stage 0 waits on B0 before F1:
    # fine; but stage 0 demanding B1 before F1 can never run
    stuck = [[Task(Phase.F, 0), Task(Phase.B, 0), Task(Phase.F, 1), Task(Phase.B, 1)],
             [Task(Phase.F, 0), Task(Phase.F, 1), Task(Phase.B, 0), Task(Phase.B, 1)]]
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(stuck)
    with pytest.raises(ScheduleError, match="unknown pipeline"):
        schedule("zigzag", 2, 2)
    with pytest.raises(ScheduleError):
        one_f_one_b(0, 2)
