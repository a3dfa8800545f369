"""Prometheus figures of running jobs, read from the coordinators at scrape time.

Register `JobCollector(lambda: coordinators)` with the daemon's registry
(`fusiond.metrics.make_registry`); names follow `fusion_<subsystem>_<name>_<unit>`:

- `fusion_job_step` / `fusion_job_steps` (current step, total), `fusion_job_loss`,
  `fusion_job_heldout_loss` (the last held-out evaluation),
  `fusion_job_throughput_tokens_per_second` (or `..._samples_per_second`),
- `fusion_job_stage_busy_ratio{stage,node}` and `fusion_job_stage_wait_ratio{stage,node}`
  (the share of the last step it computed, and the share it sat waiting for its inputs),
- `fusion_job_edge_wire_bytes_total{edge,direction}` and `..._dense_bytes_total` (before
  compression), `fusion_job_edge_density{edge}` (1 = exact);
- `fusion_job_state{job,state}` (1): every running job, and an ended one for `KEEP_ENDED_S`
  with its last figures, so an alert on a failed job has something to fire on;
- `fusion_job_checkpoint_age_seconds{job}`: since the running job's last whole-model
  checkpoint arrived (`JobRecord.checkpoint_at`, what the dashboard shows the age of; absent
  before the first);

and from `JobStats`, what the jobs coordinated here did since the daemon started:
`fusion_job_outcomes_total{outcome}` (done, failed, cancelled), `fusion_job_restarts_total`,
`fusion_job_step_duration_seconds` (a histogram of the steps' wall time).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["KEEP_ENDED_S", "STEP_BUCKETS_S", "JobCollector", "JobStats"]

KEEP_ENDED_S = 900.0
"""An ended job's figures stay on /metrics this long (an alert's `for:` needs a few scrapes)."""
KEEP_ENDED_JOBS = 64
"""... and at most this many ended jobs (the newest)."""
STEP_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Upper bounds of the step-duration histogram's buckets, seconds."""


class JobStats:
    """Counters of the jobs coordinated here (`Scheduling` reports to it): outcomes, restarts,
    the steps' wall time; and the last figures of recently ended jobs."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.outcomes: dict[str, int] = {"done": 0, "failed": 0, "cancelled": 0}
        self.restarts = 0
        self.step_counts = [0] * (len(STEP_BUCKETS_S) + 1)
        """Steps per bucket (the last: above every bound)."""
        self.step_sum_s = 0.0
        self._ended: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()

    def step(self, wall_s: float) -> None:
        if not wall_s >= 0.0:  # NaN or negative: a clock fault, not a step's duration
            return
        i = next((i for i, b in enumerate(STEP_BUCKETS_S) if wall_s <= b), len(STEP_BUCKETS_S))
        self.step_counts[i] += 1
        self.step_sum_s += wall_s

    def restarted(self) -> None:
        self.restarts += 1

    def ended(self, job_id: str, state: str, status: Mapping[str, Any]) -> None:
        """A job ended in `state`: counted, and its last figures kept a while."""
        self.outcomes[state] = self.outcomes.get(state, 0) + 1
        self._ended.pop(job_id, None)
        self._ended[job_id] = (self._clock(), {**status, "state": state})
        while len(self._ended) > KEEP_ENDED_JOBS:
            self._ended.popitem(last=False)

    def recently_ended(self) -> list[dict[str, Any]]:
        """The last figures of the jobs that ended within `KEEP_ENDED_S`."""
        now = self._clock()
        for j in [j for j, (t, _) in self._ended.items() if now - t > KEEP_ENDED_S]:
            del self._ended[j]
        return [st for _, st in self._ended.values()]


class _HasStatus(Protocol):
    def status(self) -> dict[str, Any]: ...


class JobCollector(Collector):
    """Collects `status()` of every live coordinator, the recently ended jobs' last figures,
    the counters of `stats`, and the checkpoints' ages from `checkpoints` (job id -> Unix
    time its last checkpoint arrived) by the wall clock `clock`."""

    def __init__(self, coordinators: Callable[[], Iterable[_HasStatus]],
                 stats: JobStats | None = None, *,
                 checkpoints: Callable[[], Mapping[str, float | None]] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._coordinators = coordinators
        self._stats = stats
        self._checkpoints = checkpoints
        self._clock = clock

    def describe(self) -> Iterator[Any]:
        return iter(())  # unchecked: label values are known only at scrape time

    def collect(self) -> Iterator[Any]:
        step = GaugeMetricFamily("fusion_job_step", "Last finished step", labels=["job"])
        steps = GaugeMetricFamily("fusion_job_steps", "Steps the job runs", labels=["job"])
        loss = GaugeMetricFamily("fusion_job_loss", "Loss of the last step", labels=["job"])
        held = GaugeMetricFamily("fusion_job_heldout_loss",
                                 "Held-out loss of the last evaluated step (job.eval_interval, "
                                 "checkpoints)", labels=["job"])
        tps = GaugeMetricFamily("fusion_job_throughput_tokens_per_second",
                                "Tokens per second of the last step", labels=["job"])
        sps = GaugeMetricFamily("fusion_job_throughput_samples_per_second",
                                "Samples per second of the last step", labels=["job"])
        busy = GaugeMetricFamily("fusion_job_stage_busy_ratio",
                                 "Share of the last step a stage spent computing",
                                 labels=["job", "stage", "node"])
        wait = GaugeMetricFamily("fusion_job_stage_wait_ratio",
                                 "Share of the last step a stage sat waiting for its inputs",
                                 labels=["job", "stage", "node"])
        wire = CounterMetricFamily("fusion_job_edge_wire_bytes",
                                   "Tensor bytes sent on a cut edge",
                                   labels=["job", "edge", "direction"])
        dense = CounterMetricFamily("fusion_job_edge_dense_bytes",
                                    "What those bytes were before compression",
                                    labels=["job", "edge", "direction"])
        density = GaugeMetricFamily("fusion_job_edge_density",
                                    "Top-k density of a cut edge (1 = exact)",
                                    labels=["job", "edge"])
        state = GaugeMetricFamily("fusion_job_state", "1 for a running job's state, and for "
                                  "an ended one's for a while", labels=["job", "state"])
        statuses = [c.status() for c in self._coordinators()]
        live = {str(st["job_id"]) for st in statuses}
        if self._stats is not None:
            statuses += [st for st in self._stats.recently_ended()
                         if str(st.get("job_id")) not in live]
        for st in statuses:
            job = str(st["job_id"])
            state.add_metric([job, "running" if job in live else str(st.get("state"))], 1.0)
            steps.add_metric([job], float(st["steps"]))
            if st["step"] is not None:
                step.add_metric([job], float(st["step"]))
            if st["loss"] is not None:
                loss.add_metric([job], float(st["loss"]))
            if st.get("held_out_loss") is not None:
                held.add_metric([job], float(st["held_out_loss"]))
            if st["tokens_per_s"] is not None:
                tps.add_metric([job], float(st["tokens_per_s"]))
            if st["samples_per_s"] is not None:
                sps.add_metric([job], float(st["samples_per_s"]))
            for s in st["stages"]:
                if s["busy"] is not None:
                    busy.add_metric([job, str(s["stage"]), str(s["node"])], float(s["busy"]))
                if s.get("wait") is not None:
                    wait.add_metric([job, str(s["stage"]), str(s["node"])], float(s["wait"]))
            for e in st["edges"]:
                if e["density"] is not None:
                    density.add_metric([job, e["edge"]], float(e["density"]))
                for direction, v in e["wire_bytes"].items():
                    wire.add_metric([job, e["edge"], direction], float(v))
                for direction, v in e["dense_bytes"].items():
                    dense.add_metric([job, e["edge"], direction], float(v))
        yield from (state, step, steps, loss, held, tps, sps, busy, wait, wire, dense, density)
        yield from self._checkpoint_ages(live)
        yield from self._counters()

    def _checkpoint_ages(self, live: set[str]) -> Iterator[Any]:
        if self._checkpoints is None:
            return
        age = GaugeMetricFamily("fusion_job_checkpoint_age_seconds",
                                "Since the running job's last whole-model checkpoint arrived",
                                labels=["job"])
        now = self._clock()
        for job, at in sorted(self._checkpoints().items()):
            if job in live and at is not None:
                age.add_metric([job], max(0.0, now - at))
        yield age

    def _counters(self) -> Iterator[Any]:
        s = self._stats
        if s is None:
            return
        out = CounterMetricFamily("fusion_job_outcomes", "Jobs coordinated here that ended, "
                                  "by outcome", labels=["outcome"])
        for k, v in sorted(s.outcomes.items()):
            out.add_metric([k], float(v))
        restarts = CounterMetricFamily("fusion_job_restarts", "Restarts of jobs coordinated "
                                       "here after a machine failed")
        restarts.add_metric([], float(s.restarts))
        buckets, acc = [], 0
        bounds = [str(floatToGoString(b)) for b in STEP_BUCKETS_S]  # type: ignore[no-untyped-call]
        for bound, n in zip([*bounds, "+Inf"], s.step_counts):
            acc += n
            buckets.append((bound, float(acc)))
        hist = HistogramMetricFamily("fusion_job_step_duration_seconds",
                                     "Wall time of the steps of jobs coordinated here",
                                     buckets=buckets, sum_value=s.step_sum_s)
        yield from (out, restarts, hist)
