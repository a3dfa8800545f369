"""Issue 15's bench figures from the stages' reports: the per-task breakdown and the hand-off
between stages (bench/train.py), on hand-made timelines."""

from __future__ import annotations

import pytest

from bench.train import breakdown, handoffs
from fusiond.train.local import StepMetrics
from fusiond.train.stage import StepReport, TaskTiming


def _report(stage: int, start: float, tasks: list[TaskTiming]) -> StepReport:
    return StepReport(stage, 0, None, 1e-3, 1.0, 0.5, [], tasks, start_mono=start)


def _metrics(*reports: StepReport) -> StepMetrics:
    return StepMetrics(step=0, loss=None, lr=1e-3, wall_s=1.0, samples=1, tokens=1,
                       stage_busy={}, edges=[], reports={r.stage: r for r in reports})


def test_a_hand_off_is_a_tasks_end_to_its_successors_inputs_where_it_waited() -> None:
    # stage 0 ends F0 at 100.010 and B0 starts only after stage 1's B0 (ends 100.030)
    s0 = _report(0, 100.0, [TaskTiming("F0", 0.0, 0.0, 0.010, 0.0),
                            TaskTiming("B0", 0.032, 0.033, 0.040, 0.022)])
    # stage 1 waited for F0 (in at 100.012: 2 ms) and ran B0 without waiting
    s1 = _report(1, 100.001, [TaskTiming("F0", 0.011, 0.0111, 0.020, 0.011),
                              TaskTiming("B0", 0.020, 0.020, 0.029, 0.0)])
    got = sorted(handoffs([_metrics(s0, s1)]))
    assert got == pytest.approx([0.002, 0.002])  # F0 0 -> 1, and B0 1 -> 0 (100.030 -> 100.032)


def test_the_breakdown_is_medians_in_ms_of_each_tasks_parts() -> None:
    t = [TaskTiming("F0", 0.0, 0.001, 0.005, 0.0, cpu_s=0.003, kernel_s=0.002, codec_s=0.001,
                    send_s=0.0005),
         TaskTiming("B0", 0.005, 0.005, 0.015, 0.0, cpu_s=0.010, kernel_s=0.008,
                    codec_s=0.001, send_s=0.0)]
    b = breakdown([_metrics(_report(0, 0.0, t))])
    assert b["dispatch"] == pytest.approx(0.5)  # 1 ms and 0 ms
    assert b["kernel"] == pytest.approx(5.0)
    assert b["no_cpu"] == pytest.approx(0.5)  # 4 - 3 ms and 10 - 10 ms
    # overhead: (5 - 0 + 0.5 - 2) = 3.5 ms and (15 - 5 + 0 - 8) = 2 ms
    assert b["overhead"] == pytest.approx(2.75)
    assert b["send"] == pytest.approx(0.25)
