"""Prometheus figures of running jobs, read from the coordinators at scrape time.

Register `JobCollector(lambda: coordinators)` with the daemon's registry
(`fusiond.metrics.make_registry`); names follow `fusion_<subsystem>_<name>_<unit>`:

- `fusion_job_step` / `fusion_job_steps` (current step, total), `fusion_job_loss`,
  `fusion_job_throughput_tokens_per_second` (or `..._samples_per_second`),
- `fusion_job_stage_busy_ratio{stage,node}` and `fusion_job_stage_wait_ratio{stage,node}`
  (the share of the last step it computed, and the share it sat waiting for its inputs),
- `fusion_job_edge_wire_bytes_total{edge,direction}` and `..._dense_bytes_total` (before
  compression), `fusion_job_edge_density{edge}` (1 = exact).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["JobCollector"]


class _HasStatus(Protocol):
    def status(self) -> dict[str, Any]: ...


class JobCollector(Collector):
    """Collects `status()` of every live coordinator."""

    def __init__(self, coordinators: Callable[[], Iterable[_HasStatus]]) -> None:
        self._coordinators = coordinators

    def describe(self) -> Iterator[Any]:
        return iter(())  # unchecked: label values are known only at scrape time

    def collect(self) -> Iterator[Any]:
        step = GaugeMetricFamily("fusion_job_step", "Last finished step", labels=["job"])
        steps = GaugeMetricFamily("fusion_job_steps", "Steps the job runs", labels=["job"])
        loss = GaugeMetricFamily("fusion_job_loss", "Loss of the last step", labels=["job"])
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
        for c in self._coordinators():
            st = c.status()
            job = str(st["job_id"])
            steps.add_metric([job], float(st["steps"]))
            if st["step"] is not None:
                step.add_metric([job], float(st["step"]))
            if st["loss"] is not None:
                loss.add_metric([job], float(st["loss"]))
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
        yield from (step, steps, loss, tps, sps, busy, wait, wire, dense, density)
