"""The userspace delay stage's logic (no namespace needed): packets leave in due order, early
by the loop's measured wake-up lateness so that on average they leave on time."""

from __future__ import annotations

import pytest

from deploy.testbed.delay import DelayStage, WakeLateness

PAIR = bytes([10, 250, 0, 1, 10, 250, 0, 2])


class _Pkt:
    def __init__(self, log: list[int], n: int) -> None:
        self.log, self.n = log, n

    def get_payload(self) -> bytes:
        return b"\x45" + b"\x00" * 11 + PAIR

    def accept(self) -> None:
        self.log.append(self.n)


def test_packets_leave_in_order_and_early_by_the_lead(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("deploy.testbed.delay.time.monotonic", lambda: clock[0])
    out: list[int] = []
    stage = DelayStage({PAIR: 0.010})
    for n in range(3):
        stage.on_packet(_Pkt(out, n))
        clock[0] += 0.001
    # at 100.003 the first is due at 100.010: 7 ms to wait, 6 ms with a 1 ms lead
    assert stage.release_due(0.0) == pytest.approx(0.007)
    assert stage.release_due(0.001) == pytest.approx(0.006)
    assert out == []
    assert stage.release_due(0.001, now=100.0095) == pytest.approx(0.0005)
    assert out == [0]
    assert stage.release_due(0.0, now=100.020) is None
    assert out == [0, 1, 2] and stage.passed == 3


def test_wake_lateness_follows_late_sleeps_within_its_cap() -> None:
    late = WakeLateness(weight=0.5, cap_s=0.003)
    late.observe(0.005, 0.007)
    assert late.estimate_s == pytest.approx(0.001)
    for _ in range(30):
        late.observe(0.005, 0.05)  # a stall is not a timer: at most the cap
    assert late.estimate_s == pytest.approx(0.003, rel=1e-6)
    for _ in range(60):
        late.observe(0.005, 0.004)  # early wake-ups count as on time
    assert late.estimate_s < 1e-9
