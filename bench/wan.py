"""The honest yardstick (issue 14): fusion against the strongest baseline a user would pick,
on the emulated WAN, in two regimes.

For each topology (`deploy/testbed/topologies/`; random order), for each regime:

- **fits** (`fits`): no binding memory limit (a 4 GiB per-host ceiling only measures peaks);
- **does not fit** (`nofit`): every host of every system under the same memory limit, enforced
  by the kernel (`deploy.testbed`'s per-host memory cgroup), by default 0.8 x the peak
  resident memory the single host reached in "fits"; a run the kernel kills is "out of
  memory";

it brings the testbed up (root) and runs every system, in random order, each for the same
wall-clock budget, the same model, training split, global batch and optimizer
(`bench.wan_common.Workload`):

- (0) `single`: the fastest host alone (with activation checkpointing in "does not fit");
- (1) `pipeline`: torch.distributed.pipelining itself over gloo: equal transformer blocks
  per stage, `Schedule1F1B` over the job's micro-batches, the tied embedding's gradient
  all-reduced between the first and last stage; the stage count and host order a plain
  1F1B model predicts best (`pipeline_hosts`; `bench/wan_ddp.py --pipeline`);
- (4) `fsdp` ("does not fit" only): FSDP2 over gloo on the host subset the same model picks,
  activation checkpointing;
- (5) `hivemind`: hivemind 1.1.12 as its quickstart configures it (local updates, fp16
  compression, matchmaking 3 s; `bench/wan_hivemind.py`, in its own venv);
- (6) `swarm`: SWARM-style int8 cuts: fusion's pipeline with every float cut edge int8
  block-quantized both ways (`compression.codec = "int8"`: per-block absmax, a float32 scale
  per 256 elements, 0.254 of the fp32 bytes; straight-through gradients), the placement the
  planner picks for int8 edges, no AdaTopK (`bench/wan_fusion.py --mode swarm`);
- (4) `ddp_fp16`, `ddp_powersgd`: DDP over gloo with the fp16 / PowerSGD comm hook, one
  bucket, no extra per-step collective (`bench/wan_ddp.py`);
- (2) `opfence`, (3) `adatopk`: fusion as its planner decides, dense and with AdaTopK
  (`bench/wan_fusion.py`).

Every system saves its dense weights at fixed wall-clock points; after each run the one
evaluator (`bench/wan_eval.py`) computes their loss on a held-out split no system trains on.
The verdict (`bench.wan_common.verdict`): per topology and regime, "fusion best / strongest
baseline" with medians and min-max over `--runs`; a missing or failed system fails the bench
(exit 1). Raw traces (JSON) go to `--traces`; the testbed is removed on exit, also on failure,
Ctrl-C or SIGTERM.

    sudo .venv/bin/python bench/wan.py --quick      # four-groups, both regimes, 1 run each
    sudo .venv/bin/python bench/wan.py              # every topology, 3 runs each
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.wan_common import (  # noqa: E402
    FAILED,
    FUSION_SYSTEMS,
    LABELS,
    OK,
    OUT_OF_MEMORY,
    SYSTEMS,
    HeldoutPoint,
    RunResult,
    TopologyVerdict,
    Trace,
    Workload,
    at_fixed_points,
    time_to_heldout_target,
    verdict,
)
from bench.wan_eval import (  # noqa: E402
    HeldoutBatch,
    SnapshotClock,
    evaluate_snapshots,
    heldout_batch,
    heldout_loss,
    save_snapshot,
    split_tokens,
)
from deploy.testbed.bed import OUT_OF_MEMORY as OUT_OF_MEMORY_EXIT  # noqa: E402
from deploy.testbed.bed import (  # noqa: E402
    MemoryReport,
    Testbed,
    cgroup_pids,
    classify_exit,
    kill_cgroup_processes,
)
from deploy.testbed.topology import Topology, format_rate, load_topology  # noqa: E402

TOPOLOGIES = ("two-groups", "four-groups", "mixed-slow")
DEFAULT_HOSTS: dict[str, int | None] = {"two-groups": None, "four-groups": 4, "mixed-slow": 4}
"""Hosts per topology without --hosts: all of two-groups (8: its two groups of 4);
four-groups with one host per group (its 8 would add about 4 minutes of process start-up on 2
cores to a run that must fit in 30 minutes, and 4 keep every kind of link); mixed-slow with 4
of its 5 (f1, f2, s1, r1: fast, slow and remote), because DDP's ranks must split the global
batch of 16 evenly."""
FUSION_PORT = 7600
DDP_PORT = 7700
HIVEMIND_PORT = 7800


def select_hosts(topo: Topology, cap: int | None) -> list[str]:
    """At most `cap` hosts, dealt round-robin over the groups (then group-less hosts), so a
    capped topology keeps every group and so every kind of link."""
    if cap is None or cap >= len(topo.hosts):
        return list(topo.hosts)
    buckets = [list(m) for m in topo.groups.values()]
    grouped = {h for m in buckets for h in m}
    buckets += [[h] for h in topo.hosts if h not in grouped]
    out: list[str] = []
    i = 0
    while len(out) < cap:
        for b in buckets:
            if i < len(b) and len(out) < cap:
                out.append(b[i])
        i += 1
    return [h for h in topo.hosts if h in out]


def restrict(topo: Topology, hosts: Sequence[str]) -> Topology:
    """The topology with only `hosts` (links between them are unchanged)."""
    keep = set(hosts)
    return dataclasses.replace(
        topo, hosts=tuple(h for h in topo.hosts if h in keep),
        groups={g: tuple(h for h in m if h in keep) for g, m in topo.groups.items()
                if any(h in keep for h in m)},
        cpu={h: c for h, c in topo.cpu.items() if h in keep})


def share_quotas(hosts: Sequence[str], relative: dict[str, float], cores: float
                 ) -> dict[str, float]:
    """A CPU quota (cores) for every host such that they sum to at most `cores`: hosts emulated
    on one machine share its cores, and a host without a quota would be profiled (and planned)
    as if it had the machine to itself. The topology's quotas stay relative (a 0.5-core host
    gets half of a full host's share); nothing is scaled up past the topology's own quota."""
    weights = {h: min(1.0, relative.get(h, 1.0)) for h in hosts}
    total = sum(weights.values())
    scale = min(1.0, cores / total) if total > 0 else 1.0
    # rounded down to 1/1000 core, so rounding never lifts the sum over `cores`
    return {h: math.floor(w * scale * 1000) / 1000 for h, w in weights.items()}


def cluster_desc(topo: Topology) -> dict[str, Any]:
    """The configured link matrix and CPU quotas, for the planner in the fusion lead."""
    hs = list(topo.hosts)
    return {
        "hosts": hs,
        "bandwidth_bits_per_s": {a: {b: topo.link(a, b).bandwidth_bits_per_s for b in hs if b != a}
                          for a in hs},
        "rtt_s": {a: {b: topo.link(a, b).rtt_s for b in hs if b != a} for a in hs},
        "cpu": dict(topo.cpu),
    }


def make_credentials(root: Path, hosts: Sequence[str]) -> dict[str, str]:
    """A cluster CA (key with the first host, as after `fusionctl init`) and a node
    certificate per host under `root/<host>`; returns each host's node id."""
    from fusiond.net import pki

    ids: dict[str, str] = {}
    ca, ident, _ = pki.init_cluster(root / hosts[0])
    ids[hosts[0]] = pki.TLSMaterial.in_state_dir(root / hosts[0]).node_id()
    for h in hosts[1:]:
        ident = pki.load_or_create_node_identity(root / h)
        cert = pki.issue_node_certificate(ca, ident.key.public_key())
        ids[h] = pki.store_node_credentials(root / h, cert, ca.cert).node_id()
    return ids


def slowest_mbit(topo: Topology) -> float:
    return min(topo.link(a, b).bandwidth_bits_per_s for a, b in topo.pairs()) / 1e6


def tx_bytes(tb: Testbed, hosts: Sequence[str]) -> int:
    """Bytes all `hosts` have sent on eth0 so far."""
    total = 0
    for h in hosts:
        out = tb.run(h, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], cpu_quota=False)
        total += int(out.strip())
    return total


def stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM each process group we started, then SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()



def explain_miss(trace: Trace, measured_tokens_per_s: float, tokens_per_step: int) -> str:
    """Where a prediction missed: the measured step time against the planner's iteration, and
    the stage whose measured compute (busy fraction x step time) is furthest from its
    predicted compute, or the predicted bottleneck link when compute was on time."""
    extra = trace.extra
    pred = extra.get("prediction") or {}
    last = extra.get("last_step") or {}
    busy = {int(k): float(v) for k, v in (last.get("busy") or {}).items()}
    step_s = tokens_per_step / measured_tokens_per_s
    parts = [f"step {step_s:.3f} s measured vs {float(pred.get('iteration_s', 0)):.3f} s "
             f"predicted (planner's bottleneck: {pred.get('bottleneck', '?')})"]
    worst: tuple[float, str] | None = None
    ratios = []
    for st in pred.get("stages", []):
        b = busy.get(int(st["stage"]))
        # a stage's measured busy time is its compute (the executor); the planner's stage
        # time also holds the wire handling, which the event loop does beside it
        compute = float(st["compute_s"]) - float(st.get("wire_cpu_s", 0.0))
        if b is None or compute <= 0:
            continue
        r = b * step_s / compute
        ratios.append(r)
        text = (f"stage {st['stage']} on {st['machine']}: compute {b * step_s:.3f} s/step "
                f"measured vs {compute:.3f} s predicted ({r:.1f}x)")
        if worst is None or abs(r - 1) > abs(worst[0] - 1):
            worst = (r, text)
    if worst is not None:
        parts.append(worst[1])
    if ratios and all(abs(r - 1) <= 0.25 for r in ratios):
        parts.append(f"every stage's compute is within 25 % of its prediction: the miss is "
                     f"the {step_s - float(pred.get('iteration_s', 0)):.3f} s/step the stages "
                     "spend waiting on each other beyond the pipeline model "
                     "((M-1) x bottleneck + one micro-batch through every stage and hop)")
    reduced = reduction_note(trace)
    if reduced is not None:
        parts.append(reduced)
    measured, predicted = handoffs(trace)
    if measured is not None:
        parts.append(f"hand-offs between consecutive stages: {measured * 1e3:.1f} ms measured "
                     f"(mean, one stage's task end to the next one's inputs in) vs "
                     f"{predicted * 1e3:.1f} ms predicted (both hosts' wake-up under their "
                     "CPU quota, a micro-batch's transfer, and half the RTT where the trace "
                     "records it)")
    slow_links = sorted(pred.get("links", []), key=lambda lk: -lk["time_s"])[:1]
    for lk in slow_links:
        parts.append(f"slowest predicted link: stage {lk['src_stage']} -> {lk['dst_stage']} "
                     f"at {lk['mbit']:.1f} Mbit/s, {lk['bytes'] / 1e3:.0f} kB, "
                     f"{lk['time_s']:.3f} s/step")
    return "; ".join(parts)


def _per_step(steps: list[list[dict[str, Any]]], key: str,
              agg: Callable[[list[float]], float]) -> list[float]:
    """Per step, `key` of each of its slots' timelines (0 where absent) aggregated by `agg`."""
    return [agg([float(v.get(key, 0.0)) for v in vs] or [0.0]) for vs in steps]


def reduction_note(trace: Trace) -> str | None:
    """The replicas' gradient reduction: per stage with replicas, the measured seconds per
    step it ran past the stage's last task (`StepReport.reduce_exposed_s`, the worst replica,
    median over the recorded steps but the first) against the planner's exposed part
    (`SyncReport.exposed_s`), and how many buckets started during the last backward; None
    where the run had no replicas."""
    pred = trace.extra.get("prediction") or {}
    syncs = {int(x["stage"]): x for x in pred.get("syncs", [])}
    slot_stage = {str(k): int(v) for k, v in (trace.extra.get("slot_stage") or {}).items()}
    steps = trace.extra.get("timelines", [])[1:]
    if not syncs or not steps or not slot_stage:
        return None  # no replicas, or a trace from before the figures were recorded
    parts = []
    for stage, x in sorted(syncs.items()):
        # the timelines are keyed by slot (one per machine of the stage)
        mine = [[v for k, v in step.items() if slot_stage.get(k) == stage] for step in steps]
        exposed = _per_step(mine, "reduce_exposed_s", max)  # the worst replica
        early = _per_step(mine, "buckets_early", sum)  # all of them
        cpu = _per_step(mine, "reduce_cpu_s", max)
        parts.append(f"stage {stage} ({x['scheme']}, {x['buckets']} bucket(s), "
                     f"{x['density']:.2g} density, {x['mbit']:.1f} Mbit/s): "
                     f"{statistics.median(exposed):.3f} s/step after the last backward "
                     f"measured vs {float(x['exposed_s']):.3f} s predicted "
                     f"(reduction {float(x['time_s']):.3f} s, hidden behind "
                     f"{float(x['overlap_s']):.3f} s), {statistics.median(early):.0f} "
                     "bucket(s) started during it, the reducer's CPU "
                     f"{statistics.median(cpu):.3f} s/step")
    return "gradient reduction: " + "; ".join(parts)


def handoffs(trace: Trace) -> tuple[float | None, float]:
    """The mean measured hand-off between consecutive stages (producer task's end to the
    consumer's inputs all in, on the hosts' shared monotonic clock, over the recorded steps'
    timelines, both directions) and the planner's (the two hosts' `wake_s` and one
    micro-batch's transfer over the link between them: the link's predicted time per step
    over the micro-batches, and half its RTT where the trace has it)."""
    pred = trace.extra.get("prediction") or {}
    wakes = [float(st.get("wake_s", 0.0)) for st in pred.get("stages", [])]
    timelines = trace.extra.get("timelines", [])
    micro = max((sum(1 for t in v["tasks"] if str(t[0]).startswith("F"))
                 for step in timelines[:1] for v in step.values()), default=1)
    wire = {(int(lk["src_stage"]), int(lk["dst_stage"])):
            float(lk["time_s"]) / max(1, micro) + float(lk.get("rtt_s", 0.0)) / 2
            for lk in pred.get("links", [])}
    predicted = (sum(a + b + wire.get((i, i + 1), 0.0)
                     for i, (a, b) in enumerate(itertools.pairwise(wakes)))
                 / max(1, len(wakes) - 1))
    gaps: list[float] = []
    for step in trace.extra.get("timelines", [])[1:]:  # the first may hold start-up
        at: dict[tuple[int, str], tuple[float, float]] = {}
        for k, v in step.items():
            for name, ready, _start, end, *_ in v["tasks"]:
                at[(int(k), name)] = (v["start"] + ready, v["start"] + end)
        for (s, name), (ready, _end) in at.items():
            src = (s - 1, name) if name.startswith("F") else (s + 1, name)
            if src in at:
                gaps.append(ready - at[src][1])
    return (sum(gaps) / len(gaps) if gaps else None), predicted


def bytes_by_link(trace: Trace, topo: Topology) -> dict[float, float]:
    """Measured payload bytes per step (forward + backward, all edges of the last step) by the
    rate of the link each cut edge crosses, from the trace's stages (machine ids
    `<index>-<host>`) and the topology: shows where a partition puts its traffic."""
    stages = [str(m).split("-", 1)[1] for m in trace.extra.get("stages", [])]
    edges = (trace.extra.get("last_step") or {}).get("edges") or []
    out: dict[float, float] = {}
    for e in edges:
        a, b = int(e["src"]), int(e["dst"])
        if not (0 <= a < len(stages) and 0 <= b < len(stages)) or stages[a] == stages[b]:
            continue
        rate = topo.link(stages[a], stages[b]).bandwidth_bits_per_s
        out[rate] = out.get(rate, 0.0) + float(e["forward_wire"]) + float(e["backward_wire"])
    return out


def traffic_note(traces: dict[str, Trace], topo: Topology) -> str | None:
    """One line comparing (2), (3), (6) and (8)'s bytes per step on each kind of link, or
    None."""
    parts = []
    for s in ("opfence", "adatopk", "swarm", "codecs"):
        t = traces.get(s)
        got = bytes_by_link(t, topo) if t is not None else {}
        if got:
            parts.append(f"{LABELS[s][:3]} " + ", ".join(
                f"{format_rate(r)}: {b / 1e6:.2f} MB" for r, b in sorted(got.items())))
    if not parts:
        return None
    return ("payload per step by link rate (last step, forward + backward; a different "
            "partition can move traffic onto fast links while AdaTopK shrinks the slow ones): "
            + "; ".join(parts))


PREDICTION_BAND = 0.25
"""Issues 15 and 21: every fusion run's measured over predicted throughput within 25 %."""


def measured_step(trace: Trace) -> tuple[float, int] | None:
    """The median seconds between consecutive steps after the first (its warm-up) and the
    tokens per step, from the run's events; None below three steps."""
    ev = trace.events
    if len(ev) < 3:
        return None
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(ev[1:])]
    return statistics.median(gaps), ev[1][3] - ev[0][3]


def prediction_lines(traces: Sequence[Trace]) -> list[str]:
    """Per fusion run that trained (and carries the plan's prediction): measured over
    predicted throughput, PASS within `PREDICTION_BAND`, and where a miss went
    (`explain_miss`). Runs in the order given."""
    out = []
    for t in traces:
        pred = t.extra.get("prediction") or {}
        step = measured_step(t)
        label = LABELS.get(t.system, t.system)
        if not pred.get("iteration_s") or step is None:
            if t.system in FUSION_SYSTEMS | {"swarm"}:
                out.append(f"- {label}: no measured/predicted figure (trained "
                           f"{len(t.events)} steps; {'no prediction' if not pred else 'too few'})")
            continue
        step_s, tokens = step
        ratio = float(pred["iteration_s"]) / step_s
        ok = abs(ratio - 1.0) <= PREDICTION_BAND
        line = (f"- {'PASS' if ok else 'FAIL'} {label}: measured / predicted throughput "
                f"{ratio:.2f} (step {step_s:.3f} s measured, median after the first, vs "
                f"{float(pred['iteration_s']):.3f} s predicted; within {PREDICTION_BAND:.0%} "
                "is the target)")
        if not ok and tokens > 0:
            line += ": " + explain_miss(t, tokens / step_s, tokens)
        out.append(line)
    return out


def explain_traces(path: Path) -> list[str]:
    """`prediction_lines` and `traffic_note` of a saved traces file (`save_traces`)."""
    doc = json.loads(path.read_text())
    traces = [Trace.from_dict(r["trace"]) for r in doc["runs"]]
    lines = prediction_lines(traces)
    note = traffic_note({t.system: t for t in traces}, load_topology(str(doc["topology"])))
    return lines + ([f"- {note}"] if note else [])


REGIMES = ("fits", "nofit")
REGIME_TEXT = {"fits": "fits", "nofit": "does not fit"}
NOT_YET: dict[str, str] = {}
"""Baselines the harness cannot run yet, and why: each FAILS the bench until it runs (none
today: (6) SWARM-style runs since fusion's edges can travel int8)."""


def expected_systems(regime: str) -> tuple[str, ...]:
    """Every system the verdict of `regime` needs (FSDP only where the model does not fit)."""
    return tuple(s for s in SYSTEMS if s != "fsdp" or regime == "nofit")


@dataclass
class RunRecord:
    """One run: its trace, held-out curve, outcome, bytes sent and each host's memory peak."""

    system: str
    trace: Trace
    outcome: str
    reason: str
    curve: list[HeldoutPoint]
    wire_bytes: int | None
    peak_bytes: dict[str, int]
    wall_s: float
    cpu_utilisation: dict[str, float] = dataclasses.field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    peak_anon_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    pending: Any = None
    """While the held-out evaluation runs in the background (`Evaluations`): what settles
    the outcome once the curve is in (`settle`)."""

    def settle(self) -> None:
        """Take the background evaluation's curve and decide the run's outcome with it."""
        if self.pending is None:
            return
        fut, exits, reports = self.pending
        self.pending = None
        try:
            self.curve = fut.result()
        except Exception as exc:  # a broken evaluation is a failed row, the bench goes on
            self.curve = []
            self.trace.error = self.trace.error or f"held-out evaluation failed: {exc}"[:600]
        self.outcome, self.reason = run_outcome(self.trace, exits, reports, len(self.curve))

    def result(self, target: float) -> RunResult:
        final = self.curve[-1].loss if self.curve else None
        return RunResult(self.system, self.outcome,
                         time_to_heldout_target(self.curve, target) if self.outcome == OK
                         else None, final if self.outcome == OK else None, self.reason)

    def to_dict(self, interval_s: float, budget_s: float) -> dict[str, Any]:
        return {"system": self.system, "outcome": self.outcome, "reason": self.reason,
                "wire_bytes": self.wire_bytes, "peak_bytes": self.peak_bytes,
                "wall_s": self.wall_s, "cpu_utilisation": self.cpu_utilisation,
                "peak_rss_bytes": self.peak_rss_bytes, "peak_anon_bytes": self.peak_anon_bytes,
                "heldout": [[p.t_s, p.step, p.loss] for p in self.curve],
                "heldout_at": at_fixed_points(self.curve, interval_s, budget_s),
                "trace": json.loads(self.trace.to_json())}


def fastest_host(topo: Topology) -> str:
    """The host with the largest CPU quota (the first of them; no quota = the most)."""
    return max(topo.hosts, key=lambda h: (topo.cpu.get(h, math.inf), -topo.hosts.index(h)))


GRADIENT_BYTES_PER_PARAM = {"ddp_fp16": 2.0, "ddp_powersgd": 4.0 / 20, "fsdp": 3 * 4.0 / 2}
"""What one parameter costs on the wire per step, in the ring model's all-reduce terms: fp16,
PowerSGD at about 20x fewer bytes than fp32 (issue 14's check of this model on gloo), and
FSDP's two fp32 all-gathers and one reduce-scatter (each half an all-reduce)."""


def ddp_hosts(topo: Topology, system: str, n_params: int, sample_cpu_s: float,
              batch: int) -> list[str]:
    """The host subset (at least 2) a competent user would run DDP on: the least predicted
    step time in a plain model, the global batch's compute spread over the subset's cores
    (`sample_cpu_s`: one sample's forward and backward on one core) plus a ring all-reduce
    of the (compressed) gradients over the subset's slowest link and 2 (n - 1) of its
    longest RTTs. One site, all sites or anything between: whichever the model favours."""
    per_param = GRADIENT_BYTES_PER_PARAM.get(system, 4.0)
    best: tuple[float, list[str]] | None = None
    hosts = list(topo.hosts)
    for k in range(2, len(hosts) + 1):
        for sub in itertools.combinations(hosts, k):
            cores = sum(topo.cpu.get(h, 1.0) for h in sub)
            links = [topo.link(a, b) for a, b in itertools.combinations(sub, 2)]
            bw = min(lk.bandwidth_bits_per_s for lk in links) / 8 * 0.95
            rtt = max(lk.rtt_s for lk in links)
            comm = 2 * (k - 1) / k * n_params * per_param / bw + 2 * (k - 1) * rtt
            step = batch * sample_cpu_s / cores + comm
            if batch % k:
                continue
            if best is None or step < best[0]:
                best = (step, list(sub))
    if best is None:
        raise SystemExit(f"no host subset of {hosts} splits the global batch {batch}")
    return best[1]


MAX_PIPELINE_ORDERS = 5000
"""Host orders `pipeline_hosts` scores per stage count (all of them up to 7 of 8 hosts' 4)."""


def pipeline_hosts(topo: Topology, n_blocks: int, sample_cpu_s: float, batch: int,
                   micro: int, act_bytes_per_sample: float) -> list[str]:
    """The stage count (2 ..) and host order a competent user would run (1) on: the least
    predicted step of a plain 1F1B model of equal blocks per stage. A stage's time per
    micro-batch is its blocks' share of one sample's forward and backward (`sample_cpu_s`,
    one core) times the micro-batch, over its host's cores; a hop carries the micro-batch's
    residual stream forward and its gradient back over that link (95 % goodput) plus its
    RTT; a step is the fill (every stage and hop once) plus M - 1 times the slowest of
    them; at most M stages (torch's `Schedule1F1B` refuses more). Rank i runs stage i on the
    i-th host returned."""
    from bench.wan_ddp import pipeline_bounds

    mb = batch / micro
    hosts = list(topo.hosts)
    rng = random.Random(0)
    best: tuple[float, list[str]] | None = None
    # torch's Schedule1F1B needs at least as many micro-batches as stages
    for k in range(2, min(len(hosts), n_blocks, micro) + 1):
        bounds = pipeline_bounds(n_blocks, k)
        orders = list(itertools.permutations(hosts, k))
        if len(orders) > MAX_PIPELINE_ORDERS:
            orders = rng.sample(orders, MAX_PIPELINE_ORDERS)
        for order in orders:
            stage_s = [(hi - lo) / n_blocks * mb * sample_cpu_s / topo.cpu.get(h, 1.0)
                       for (lo, hi), h in zip(bounds, order, strict=True)]
            hop_s = []
            for a, b in itertools.pairwise(order):
                lk = topo.link(a, b)
                hop_s.append(2 * act_bytes_per_sample * mb
                             / (lk.bandwidth_bits_per_s / 8 * 0.95) + lk.rtt_s)
            step = sum(stage_s) + sum(hop_s) + (micro - 1) * max(stage_s + hop_s)
            if best is None or step < best[0]:
                best = (step, list(order))
    if best is None:
        raise SystemExit(f"a pipeline needs at least 2 hosts and 2 blocks ({hosts})")
    return best[1]


def sample_cpu_seconds(wl: Workload, samples: int = 4) -> float:
    """One sample's forward and backward on one thread of this machine (CPU time, which load
    does not bend much), for `ddp_hosts`' model."""
    import torch

    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import parse_job

    spec = parse_job(wl.job_toml(adatopk=False))
    model = build_model(spec.model, seed=spec.seed)
    lossf = loss_fn(spec.loss)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randint(0, wl.vocab_size, (samples, wl.seq_len))
        lossf(model(x), x).backward()  # warm-up
        t = time.process_time()
        lossf(model(x), x).backward()
        return (time.process_time() - t) / samples
    finally:
        torch.set_num_threads(threads)


def delta_report(before: MemoryReport | None, after: MemoryReport | None
                 ) -> MemoryReport | None:
    """What a host's memory cgroup counted during one run (the counters only grow)."""
    if after is None:
        return None
    if before is None:
        return after

    def d(a: int | None, b: int | None) -> int | None:
        return None if a is None else a - (b or 0)

    return MemoryReport(after.limit_bytes, after.peak_bytes,
                        d(after.limit_hits, before.limit_hits), d(after.oom_kills,
                                                                  before.oom_kills))


def run_outcome(trace: Trace, exits: dict[str, int | None],
                reports: dict[str, MemoryReport | None], n_snapshots: int) -> tuple[str, str]:
    """(outcome, reason) of one run: out of memory when the kernel killed a process of any
    host at its limit (never 'did not reach the target'), failed when the run left no trace,
    an error or no snapshot, else ok."""
    oom = [h for h, rep in reports.items()
           if classify_exit(exits.get(h), rep) == OUT_OF_MEMORY_EXIT]
    if oom:
        rep = reports[oom[0]]
        limit = f" at {rep.limit_bytes / 2**20:.0f} MiB" if rep is not None else ""
        return OUT_OF_MEMORY, f"kernel killed a process of {', '.join(oom)}{limit}"
    if trace.error:
        return FAILED, trace.error
    if n_snapshots == 0 or (trace.events and n_snapshots < 2):
        # a run that finished steps but left no snapshot after any of them would read as
        # the initial weights' loss
        return FAILED, "no snapshot of the weights for the held-out evaluator"
    return OK, ""


class CpuMeter:
    """Each host's CPU seconds during a run: the utime + stime of every process in the host's
    cgroups, sampled while it runs (the last value seen of each process counts), so a host's
    utilisation (CPU seconds over wall-clock x its quota) says whether it was compute-bound."""

    def __init__(self, tb: Testbed, hosts: list[str]) -> None:
        self.tb = tb
        self.t0 = time.monotonic()
        self.wall_s = 0.0
        self.cgroups = {h: [Path(c) for c in tb.state.get("cgroups", [])
                            if c.endswith(f"-{tb.name}-{h}")] for h in hosts}
        self.ticks: dict[str, dict[int, int]] = {h: {} for h in hosts}
        self.hwm: dict[str, dict[int, int]] = {h: {} for h in hosts}
        self.anon_peak: dict[str, int] = {}
        self.tick_s = 1.0 / os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        self.wall_s = time.monotonic() - self.t0
        for h, cgs in self.cgroups.items():
            anon = 0
            for pid in {p for c in cgs for p in cgroup_pids(c)}:
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                self.ticks[h][pid] = int(fields[11]) + int(fields[12])  # utime, stime
                with contextlib.suppress(OSError, ValueError, IndexError):
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            self.hwm[h][pid] = int(line.split()[1]) * 1024
                        elif line.startswith("RssAnon:"):
                            anon += int(line.split()[1]) * 1024
            self.anon_peak[h] = max(self.anon_peak.get(h, 0), anon)

    def peak_anon_bytes(self) -> dict[str, int]:
        """Host -> the largest sum, over one sample, of its processes' anonymous resident
        memory (RssAnon): what the host's training needs at once, without the file pages
        (shared libraries) that VmHWM counts in every process and the kernel may reclaim."""
        return {h: v for h, v in self.anon_peak.items() if v}

    def peak_rss_bytes(self) -> dict[str, int]:
        """Host -> the sum of its processes' peak resident memory (VmHWM): the memory a host
        needs, page cache left out (the cgroup's own peak counts reclaimable cache too)."""
        return {h: sum(v.values()) for h, v in self.hwm.items() if v}

    def utilisation(self) -> dict[str, float]:
        """Host -> CPU seconds / (wall-clock x the host's quota in cores)."""
        out = {}
        for h, per_pid in self.ticks.items():
            cores = self.tb.topology.cpu.get(h, 1.0)
            if self.wall_s > 0:
                out[h] = sum(per_pid.values()) * self.tick_s / (self.wall_s * cores)
        return out


class Runner:
    """Runs every system on one testbed (one topology, one regime)."""

    def __init__(self, tb: Testbed, work: Path, args: argparse.Namespace, wl: Workload,
                 planner_memory_bytes: float | None) -> None:
        self.tb = tb
        self.work = work
        self.args = args
        self.wl = wl
        self.hosts = list(tb.topology.hosts)
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        (work / "workload.json").write_text(json.dumps(wl.to_dict()))
        self.creds = make_credentials(work / "creds", self.hosts)
        self.cpu = CpuMeter(tb, [])
        desc = cluster_desc(tb.topology) | {"node_ids": self.creds}
        if planner_memory_bytes:
            desc["memory_bytes"] = planner_memory_bytes
        (work / "cluster.json").write_text(json.dumps(desc))

    def _wait(self, main: subprocess.Popen[bytes], procs: dict[str, subprocess.Popen[bytes]],
              timeout: float) -> dict[str, int | None]:
        """Until `main` exits, or any process exits non-zero (a peer killed: the others would
        wait on it for minutes), or `timeout`; then stop all; each host's exit code."""
        deadline = time.monotonic() + timeout
        self.cpu = CpuMeter(self.tb, list(procs))
        try:
            while time.monotonic() < deadline and main.poll() is None:
                if any(p.poll() not in (None, 0) for p in procs.values()):
                    break
                self.cpu.sample()
                time.sleep(0.1)
        finally:
            before = {h: p.poll() for h, p in procs.items()}
            stop(list(procs.values()))
            self.sweep()
        return before

    def sweep(self) -> None:
        """Kill whatever a run left in the hosts' cgroups (a child outside the process group
        we stop: hivemind's DHT process outlived a killed peer and held 200 MiB of the next
        run's limit on its host): every run starts on empty hosts."""
        for c in self.tb.state.get("cgroups", []):
            path = Path(c)
            left = cgroup_pids(path)
            if left:
                print(f"[{self.tb.name}] {path.name}: killing {len(left)} process(es) the "
                      "run left", flush=True)
                kill_cgroup_processes(path)

    def _trace(self, out: Path, system: str) -> Trace:
        if out.exists():
            return Trace.load(out)
        logs = sorted(self.work.glob(f"{system}-*.log"))
        tail = " | ".join(p.name + ": " + p.read_text(errors="replace")[-400:].replace("\n", " ")
                          for p in logs[:2])
        return Trace(system, [], {}, f"no trace; {tail}"[:1500])

    def torch_baseline(self, system: str, hosts: list[str]) -> tuple[Trace, dict[str, int | None]]:
        out = self.work / f"{system}.json"
        snaps = self.work / f"snap-{system}"
        stop_dir = self.work / f"stop-{system}"
        stop_dir.mkdir(exist_ok=True)
        master = f"{self.tb.address(hosts[0])}:{DDP_PORT}"
        hook = system.removeprefix("ddp_") if system.startswith("ddp_") else "none"
        extra = (["--checkpoint-activations"] if system in ("single", "fsdp")
                 and self.args.regime == "nofit" else [])
        if system == "fsdp":
            extra.append("--fsdp")
        if system == "pipeline":
            extra += ["--pipeline", f"--hosts={','.join(hosts)}"]
        procs = {h: self.tb.exec(h, [
            sys.executable, str(REPO / "bench" / "wan_ddp.py"), f"--rank={i}",
            f"--world={len(hosts)}", f"--master={master}", f"--budget={self.args.budget}",
            f"--hook={hook}", f"--workload={self.work / 'workload.json'}", f"--out={out}",
            f"--snapshot-dir={snaps}", f"--snapshot-interval={self.args.snapshot_interval}",
            f"--stop-dir={stop_dir}", *extra,
        ], log=self.work / f"{system}-{h}.log", env=self.env | {"GLOO_SOCKET_IFNAME": "eth0"})
            for i, h in enumerate(hosts)}  # gloo would advertise 127.0.0.1 otherwise
        exits = self._wait(procs[hosts[0]], procs, timeout=self.args.budget + 240)
        return self._trace(out, system), exits

    def fusion(self, mode: str) -> tuple[Trace, dict[str, int | None]]:
        addr = {h: (self.tb.address(h), FUSION_PORT) for h in self.hosts}
        peers = [f"--peer={self.creds[h]}={a}:{p}" for h, (a, p) in addr.items()]
        out = self.work / f"{mode}.json"
        common = [f"--profile-dir={self.work / f'profiles-{mode}'}",
                  f"--snapshot-dir={self.work / f'snap-{mode}'}",
                  f"--snapshot-interval={self.args.snapshot_interval}"]
        procs: dict[str, subprocess.Popen[bytes]] = {}
        py = sys.executable
        script = str(REPO / "bench" / "wan_fusion.py")
        for h in self.hosts[1:]:
            others = [p for p in peers if not p.startswith(f"--peer={self.creds[h]}=")]
            procs[h] = self.tb.exec(h, [py, script, "node", h, *common,
                                        f"--state-dir={self.work / 'creds' / h}",
                                        f"--listen={addr[h][0]}:{FUSION_PORT}", *others],
                                    log=self.work / f"{mode}-{h}.log", env=self.env)
        h0 = self.hosts[0]
        procs[h0] = self.tb.exec(h0, [
            py, script, "lead", h0, *common, f"--listen={addr[h0][0]}:{FUSION_PORT}",
            f"--state-dir={self.work / 'creds' / h0}",
            *[p for p in peers if not p.startswith(f"--peer={self.creds[h0]}=")],
            f"--mode={mode}", f"--budget={self.args.budget}",
            f"--cluster={self.work / 'cluster.json'}",
            f"--workload={self.work / 'workload.json'}", f"--out={out}",
            f"--captured={self.args.captured_dir}",
        ], log=self.work / f"{mode}-{h0}.log", env=self.env)
        exits = self._wait(procs[h0], procs, timeout=self.args.budget + 300)
        return self._trace(out, mode), exits

    def hivemind(self) -> tuple[Trace, dict[str, int | None]]:
        py = Path(self.args.hivemind_python)
        if not py.exists():
            return Trace("hivemind", [], {}, f"no hivemind venv at {py} "
                                             "(run bench/hivemind/setup.sh)"), {}
        import numpy as np

        out = self.work / "hivemind.json"
        maddrs = self.work / "hivemind-maddrs.txt"
        maddrs.unlink(missing_ok=True)
        barrier = self.work / "hivemind-barrier"
        shutil.rmtree(barrier, ignore_errors=True)
        tokens = self.work / "tokens.npy"
        if not tokens.exists():
            np.save(tokens, np.frombuffer(Path(self.wl.corpus).read_bytes(), dtype=np.uint8)
                    .astype(np.int64))
        procs = {h: self.tb.exec(h, [
            str(py), str(REPO / "bench" / "wan_hivemind.py"), f"--rank={i}",
            f"--world={len(self.hosts)}", f"--listen={self.tb.address(h)}:{HIVEMIND_PORT}",
            f"--maddr-file={maddrs}", f"--barrier-dir={barrier}", f"--budget={self.args.budget}",
            f"--workload={self.work / 'workload.json'}", f"--tokens={tokens}", f"--out={out}",
            f"--snapshot-dir={self.work / 'snap-hivemind'}",
            f"--snapshot-interval={self.args.snapshot_interval}",
        ], log=self.work / f"hivemind-{h}.log", env=self.env) for i, h in enumerate(self.hosts)}
        exits = self._wait(procs[self.hosts[0]], procs, timeout=self.args.budget + 240)
        return self._trace(out, "hivemind"), exits

    def run(self, system: str, evaluate: Evaluations) -> RunRecord:
        t0 = time.monotonic()
        if system in NOT_YET:
            return RunRecord(system, Trace(system, [], {}, NOT_YET[system]), FAILED,
                             NOT_YET[system], [], None, {}, 0.0)
        if system == "single":
            used = [fastest_host(self.tb.topology)]
        elif system.startswith("ddp_") or system == "fsdp":
            used = ddp_hosts(self.tb.topology, system, self.args.n_params,
                             self.args.sample_cpu_s, self.wl.batch)
        elif system == "pipeline":
            used = pipeline_hosts(self.tb.topology, self.args.n_blocks, self.args.sample_cpu_s,
                                  self.wl.batch, self.wl.micro_batches,
                                  self.wl.seq_len * self.args.n_embd * 4.0)
        else:
            used = self.hosts
        for h in used:
            self.tb.reset_memory_peak(h)
        before_rep = {h: self.tb.memory_report(h) for h in used}
        before = tx_bytes(self.tb, self.hosts)
        if system in FUSION_RUNS:
            trace, exits = self.fusion(system)
        elif system == "hivemind":
            trace, exits = self.hivemind()
        else:
            trace, exits = self.torch_baseline(system, used)
        wire = tx_bytes(self.tb, self.hosts) - before
        reports = {h: delta_report(before_rep[h], self.tb.memory_report(h)) for h in used}
        peaks = {h: r.peak_bytes for h, r in reports.items()
                 if r is not None and r.peak_bytes is not None}
        snapdir = self.work / f"snap-{system}"
        rec = RunRecord(system, trace, FAILED, "held-out evaluation pending", [], wire, peaks,
                        time.monotonic() - t0, self.cpu.utilisation(),
                        self.cpu.peak_rss_bytes(), self.cpu.peak_anon_bytes())
        rec.pending = (evaluate.submit(system, snapdir, trace), exits, reports)
        return rec


Evaluator = Callable[[str, Path, Trace], list[HeldoutPoint]]


def _lowest_priority() -> None:
    """A background evaluation thread's start: nice 19 (CFS gives it about 1.5 % of a core
    against any host process that wants one) and, with one torch thread in this process, its
    forward passes stay on it."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class Evaluations:
    """Each run's held-out evaluation in a background thread at the lowest CPU priority, while
    the next run trains: its snapshots move out of the testbed first (`keep_root`, removed once
    evaluated), and the hosts' quotas keep what they were given (the thread takes only CPU no
    host wants). `submit` returns the curve's future; `close` waits for the last ones."""

    def __init__(self, evaluate: Evaluator, keep_root: Path) -> None:
        self.evaluate = evaluate
        self.keep_root = keep_root
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="heldout",
                                        initializer=_lowest_priority)
        self._n = itertools.count()

    def submit(self, system: str, snapdir: Path, trace: Trace) -> Future[list[HeldoutPoint]]:
        keep = self.keep_root / f"{system}-{next(self._n)}"
        if snapdir.is_dir():
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(snapdir), str(keep))
        return self._pool.submit(self._one, system, keep, trace)

    def _one(self, system: str, keep: Path, trace: Trace) -> list[HeldoutPoint]:
        try:
            return self.evaluate(system, keep, trace)
        finally:
            shutil.rmtree(keep, ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
FUSION_RUNS = ("swarm", "opfence", "adatopk", "replicas", "codecs")
"""Systems run by fusion's own pipeline (`bench/wan_fusion.py`): (6) with int8 cut edges
where the planner puts them, (2), (3) and (7) as its planner decides."""


@dataclass
class Data:
    """The training split (a file every system trains on) and the held-out windows."""

    train_path: Path
    heldout: HeldoutBatch


def prepare_data(args: argparse.Namespace, root: Path) -> Data:
    from fusiond.train.data import TextWindows, make_source
    from fusiond.train.spec import parse_job

    spec = parse_job(Workload(seed=args.seed).job_toml(adatopk=False))
    src = make_source(spec.data, spec.seed)
    assert isinstance(src, TextWindows)
    train, held = split_tokens(src.tokens, seed=args.seed,
                               train_tokens=int(args.train_mb * 2**20),
                               heldout_tokens=int(args.heldout_kb * 2**10))
    root.mkdir(parents=True, exist_ok=True)
    path = root / "train.txt"
    path.write_bytes(train.astype("uint8").tobytes())
    return Data(path, heldout_batch(held, seq_len=args.seq, count=args.eval_windows))


def make_evaluator(wl: Workload, data: Data, interval_s: float, captured_dir: Path
                   ) -> Evaluator:
    """The one evaluator: the dense snapshots of any system, on the held-out windows."""
    from bench.wan_fusion import load_captured
    from fusiond.graph.capture import state_from_bytes
    from fusiond.jobs.results import gather_state
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import parse_job

    spec = parse_job(wl.job_toml(adatopk=False))
    lossf = loss_fn(spec.loss)

    def make_model() -> Any:
        return build_model(spec.model, seed=spec.seed)

    captured: list[Any] = []

    def fusion_snapshots(snapdir: Path, trace: Trace) -> None:
        """Gather the stages' checkpoints of each step into whole-model snapshots (the time
        of a step: the lead's event of it). Each stage's first replica writes its own (the
        others hold the same weights and send none): a step is complete with every stage's,
        and gathering checks that tied copies hold the same weights."""
        n_stages = len(trace.extra.get("stages", []))
        at = {int(s): float(t) for t, s, _, _ in trace.events}
        by_step: dict[int, dict[int, Path]] = {}
        for p in snapdir.glob("part-*-step-*.safetensors"):
            _, part, _, step = p.stem.split("-")
            by_step.setdefault(int(step), {})[int(part)] = p
        if not captured:
            captured.append(load_captured(captured_dir))
        complete = sorted(s for s, parts in by_step.items()
                          if all(k in parts for k in range(n_stages)) and s in at)
        clock = SnapshotClock(interval_s)
        keep = [s for s in complete if clock.due(at[s])]
        if complete and complete[-1] not in keep:
            keep.append(complete[-1])  # the end of the budget
        for i, step in enumerate(keep):
            parts = by_step[step]
            states = [state_from_bytes(parts[k].read_bytes()) for k in range(n_stages)]
            save_snapshot(snapdir, i, at[step], step, gather_state(captured[0].graph, states))
        for parts in by_step.values():
            for p in parts.values():
                p.unlink(missing_ok=True)

    def fsdp_snapshots(snapdir: Path, trace: Trace) -> None:
        """Reassemble the FSDP ranks' dim-0 shards of the steps at the fixed wall-clock points
        (rank 0's clock) and of the last step every rank wrote."""
        import safetensors.torch
        import torch

        world = int(trace.extra.get("world", 0))
        at = {int(s): float(t) for t, s, _, _ in trace.events}
        by_step: dict[int, dict[int, Path]] = {}
        for p in snapdir.glob("fsdp-rank*-step*.safetensors"):
            rank, step = p.stem.removeprefix("fsdp-rank").split("-step")
            by_step.setdefault(int(step), {})[int(rank)] = p
        complete = sorted(s for s, parts in by_step.items() if len(parts) == world and s in at)
        clock = SnapshotClock(interval_s)
        keep = [s for s in complete if clock.due(at[s])]
        if complete and complete[-1] not in keep:
            keep.append(complete[-1])
        shapes = {k: v.shape for k, v in make_model().state_dict().items()}
        for i, step in enumerate(keep):
            shards = [safetensors.torch.load_file(str(by_step[step][r])) for r in range(world)]
            full = {}
            for k, shape in shapes.items():
                t = torch.cat([sh[k] for sh in shards]) if len(shape) else shards[0][k]
                if tuple(t.shape) != tuple(shape):
                    raise ValueError(f"FSDP shards of {k} make {tuple(t.shape)}, not "
                                     f"{tuple(shape)}")
                full[k] = t
            save_snapshot(snapdir, i, at[step], step, full)
        for parts in by_step.values():
            for p in parts.values():
                p.unlink(missing_ok=True)

    def pipeline_snapshots(snapdir: Path, trace: Trace) -> None:
        """Merge the torch pipeline's stages (each rank's parameters under the full model's
        names) of the steps at the fixed wall-clock points (rank 0's clock) and the last."""
        import safetensors.torch

        world = int(trace.extra.get("world", 0))
        at = {int(s): float(t) for t, s, _, _ in trace.events}
        by_step: dict[int, dict[int, Path]] = {}
        for p in snapdir.glob("pipe-rank*-step*.safetensors"):
            rank, step = p.stem.removeprefix("pipe-rank").split("-step")
            by_step.setdefault(int(step), {})[int(rank)] = p
        complete = sorted(s for s, parts in by_step.items() if len(parts) == world and s in at)
        clock = SnapshotClock(interval_s)
        keep = [s for s in complete if clock.due(at[s])]
        if complete and complete[-1] not in keep:
            keep.append(complete[-1])
        for i, step in enumerate(keep):
            full: dict[str, Any] = {}
            for r in range(world):
                full |= safetensors.torch.load_file(str(by_step[step][r]))
            save_snapshot(snapdir, i, at[step], step, full)
        for parts in by_step.values():
            for p in parts.values():
                p.unlink(missing_ok=True)

    initial: list[HeldoutPoint] = []

    def evaluate(system: str, snapdir: Path, trace: Trace) -> list[HeldoutPoint]:
        """The held-out curve of a run: the initial weights at t = 0 (every system starts
        from the same seeded model; a run that finishes no step in its budget has that
        point alone), then its snapshots."""
        if trace.error and not trace.events:
            return []
        if not initial:
            initial.append(HeldoutPoint(0.0, -1, heldout_loss(make_model(), data.heldout,
                                                               lossf)))
        if not snapdir.is_dir():
            return list(initial)
        if system in FUSION_RUNS:
            fusion_snapshots(snapdir, trace)
        if system == "fsdp":
            fsdp_snapshots(snapdir, trace)
        if system == "pipeline":
            pipeline_snapshots(snapdir, trace)
        return initial + evaluate_snapshots(snapdir, make_model, data.heldout, lossf)

    return evaluate


def regime_topology(topo: Topology, regime: str, limit_bytes: int) -> Topology:
    """`topo` with every host under `limit_bytes` of memory (fits: a ceiling no run nears,
    there to measure each host's peak)."""
    return dataclasses.replace(topo, memory_bytes=dict.fromkeys(topo.hosts, limit_bytes))


def idle_process_bytes(tb: Testbed, host: str) -> int | None:
    """The memory peak of an idle host process (Python with torch and fusiond imported):
    what a stage's model share comes on top of."""
    tb.reset_memory_peak(host)
    tb.run(host, [sys.executable, "-c", "import torch, fusiond.train.stage, "
                  "fusiond.net.transport"], timeout=120)
    rep = tb.memory_report(host)
    return rep.peak_bytes if rep is not None else None


def run_regime(name: str, regime: str, topo: Topology, args: argparse.Namespace,
               wl: Workload, evaluate: Evaluations, limit_bytes: int, order: list[str]
               ) -> list[RunRecord]:
    # not "fzt<digits>": tests that sweep stray testbeds of that name (`remove_stray`) must
    # not take this one's namespaces away mid-run
    tb = Testbed(regime_topology(topo, regime, limit_bytes),
                 name=f"fzb{os.getpid() % 100000}{regime[0]}")
    records: list[RunRecord] = []
    args.regime = regime
    try:
        tb.up(latency=args.latency)
        work = tb.work_dir / "wan"
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o777)
        planner_bytes: float | None = None
        if regime == "nofit":
            idle = idle_process_bytes(tb, topo.hosts[0]) or 0
            planner_bytes = max(1 << 20, limit_bytes - idle)
            print(f"[{name}/{regime}] limit {limit_bytes / 2**20:.0f} MiB per host, idle "
                  f"process {idle / 2**20:.0f} MiB: planner memory "
                  f"{planner_bytes / 2**20:.0f} MiB", flush=True)
        runner = Runner(tb, work, args, wl, planner_bytes)
        for s in order:
            print(f"[{name}/{regime}] {LABELS[s]} ...", flush=True)
            try:
                rec = runner.run(s, evaluate)
            except Exception as exc:  # a broken run is a failed row, the bench goes on
                why = f"harness error: {type(exc).__name__}: {exc}"[:600]
                rec = RunRecord(s, Trace(s, [], {}, why), FAILED, why, [], None, {}, 0.0)
            records.append(rec)
            print(f"[{name}/{regime}] {LABELS[s]}: {len(rec.trace.events)} steps"
                  f"{' (' + rec.trace.error[:200] + ')' if rec.trace.error else ''}"
                  f", peak RSS {max(rec.peak_rss_bytes.values(), default=0) / 2**20:.0f} MiB"
                  f" (cgroup {max(rec.peak_bytes.values(), default=0) / 2**20:.0f} MiB), CPU "
                  + " ".join(f"{h} {u:.0%}" for h, u in rec.cpu_utilisation.items())
                  + f" of quota ({rec.wall_s:.0f} s)", flush=True)
        for rec in records:  # the background evaluations of this regime's runs
            rec.settle()
            last = rec.curve[-1].loss if rec.curve else None
            print(f"[{name}/{regime}] {LABELS[rec.system]}: {rec.outcome}"
                  f"{' (' + rec.reason[:200] + ')' if rec.reason else ''}; held-out "
                  f"{'-' if last is None else f'{last:.3f}'}", flush=True)
    finally:
        for rec in records:
            rec.settle()
        keep = Path(args.logs) / f"{name}-{regime}-logs"
        with contextlib.suppress(OSError):
            keep.mkdir(parents=True, exist_ok=True)
            for log in (tb.work_dir / "wan").glob("*.log"):
                shutil.copyfile(log, keep / log.name)
        tb.down()
    return records


def run_topology(name: str, args: argparse.Namespace, wl: Workload, evaluate: Evaluations,
                 rng: random.Random) -> tuple[list[str], list[TopologyVerdict]]:
    topo = load_topology(name)
    hosts = select_hosts(topo, args.hosts if args.hosts else DEFAULT_HOSTS.get(name))
    topo = restrict(topo, hosts)
    relative = dict(topo.cpu)
    topo = dataclasses.replace(topo, cpu=share_quotas(hosts, relative, args.cpu_cores))
    md = [f"### {name}: {', '.join(hosts)}", "",
          "CPU quota per host (cores): " + ", ".join(f"{h} {c:g}" for h, c in topo.cpu.items()),
          ""]
    verdicts_out = []
    nofit_limit = int(args.nofit_memory_mb * 2**20) if args.nofit_memory_mb else None
    for regime in args.regimes:
        expected = expected_systems(regime)  # a system left out by --systems is missing
        systems = [s for s in expected if s in args.systems]
        records: list[RunRecord] = []
        for _ in range(args.runs):
            order = systems[:]
            if regime == "fits" and nofit_limit is None and "single" in order:
                order.remove("single")  # first: its peak sets the other regime's limit
                rng.shuffle(order)
                order.insert(0, "single")
            else:
                rng.shuffle(order)
            limit = (FITS_CEILING_BYTES if regime == "fits" else nofit_limit
                     or FITS_CEILING_BYTES)
            if regime == "nofit" and nofit_limit is None:
                raise SystemExit("the 'does not fit' regime needs --nofit-memory-mb, or the "
                                 "'fits' regime with the single-host run first")
            recs = run_regime(name, regime, topo, args, wl, evaluate, limit, order)
            records += recs
            single = next((r for r in recs if r.system == "single" and r.peak_rss_bytes),
                          None)
            if regime == "fits" and nofit_limit is None and single is not None:
                # resident memory, file pages included: 0.8 x the anonymous part alone (348
                # of 435 MiB measured) left no system room, FSDP on 2 hosts included, since
                # a Python + torch process's own 152 MiB is most of it
                need = max(single.peak_rss_bytes.values())
                nofit_limit = int(args.nofit_fraction * need)
                print(f"[{name}] 'does not fit' limit: {args.nofit_fraction:g} x the single "
                      f"host's peak resident memory {need / 2**20:.0f} MiB = "
                      f"{nofit_limit / 2**20:.0f} MiB", flush=True)
        v = verdict(name, REGIME_TEXT[regime], [r.result(args.target_loss) for r in records],
                    expected)
        verdicts_out.append(v)
        save_traces(Path(args.traces), name, regime, records, args)
        md += [f"#### {REGIME_TEXT[regime]}"
               + (f" (memory limit {nofit_limit / 2**20:.0f} MiB per host, enforced by the "
                  "kernel)" if regime == "nofit" and nofit_limit else
                  f" (a {FITS_CEILING_BYTES >> 30} GiB per-host ceiling, to measure peaks)"),
               "", results_table(v, records, LABELS), "", f"- {v.line(LABELS)}", ""]
        predicted = prediction_lines([r.trace for r in records])
        if predicted:
            md += ["Fusion's runs against their plan's prediction:", "", *predicted, ""]
        note = traffic_note({r.system: r.trace for r in records}, topo)
        if note:
            md += [f"- {note}", ""]
        md += [f"![held-out loss on {name}, {REGIME_TEXT[regime]}]"
               f"(benchmarks-{name}-{regime}.png)", ""]
    return md, verdicts_out


FITS_CEILING_BYTES = 4 << 30


def save_traces(root: Path, name: str, regime: str, records: list[RunRecord],
                args: argparse.Namespace) -> None:
    root.mkdir(parents=True, exist_ok=True)
    doc = {"topology": name, "regime": regime, "budget_s": args.budget,
           "snapshot_interval_s": args.snapshot_interval, "target_loss": args.target_loss,
           "runs": [r.to_dict(args.snapshot_interval, args.budget) for r in records]}
    (root / f"{name}-{regime}.json").write_text(json.dumps(doc))


def results_table(v: TopologyVerdict, records: list[RunRecord], labels: dict[str, str]) -> str:
    """One line per system: outcome, time to the held-out target and final held-out loss
    (median [min .. max] over runs), steps, bytes sent and the largest host peak."""
    lines = ["| system | outcome | time to target (held-out) | final held-out loss | steps "
             "| wire bytes | peak RSS (anon) / host | CPU used / quota | start-up |",
             "|" + "---|" * 9]
    for s, summ in v.summaries.items():
        recs = [r for r in records if r.system == s]
        steps = ", ".join(str(len(r.trace.events)) for r in recs) or "-"
        wire = ", ".join(f"{r.wire_bytes / 1e6:.1f} MB" for r in recs
                         if r.wire_bytes is not None) or "-"
        peak = max((p for r in recs for p in r.peak_rss_bytes.values()), default=None)
        anon = max((p for r in recs for p in r.peak_anon_bytes.values()), default=None)
        tt = summ.time_to_target.text() if summ.time_to_target else "-"
        fl = summ.final_loss.text("", 3) if summ.final_loss else "-"
        outcome = summ.outcome + (f": {summ.reason}" if summ.reason else "")
        cpu = "; ".join(" ".join(f"{h} {u:.0%}" for h, u in r.cpu_utilisation.items())
                        for r in recs if r.cpu_utilisation) or "-"
        start = ", ".join(f"{float(r.trace.extra['startup_s']):.0f} s" for r in recs
                          if r.trace.extra.get("startup_s") is not None) or "-"
        lines.append(f"| {labels.get(s, s)} | {outcome} | {tt} | {fl} | {steps} | {wire} "
                     f"| {'-' if peak is None else f'{peak / 2**20:.0f} MiB'}"
                     f"{'' if anon is None else f' ({anon / 2**20:.0f})'} | {cpu} "
                     f"| {start} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--topology", action="append", help=f"default: {', '.join(TOPOLOGIES)}")
    ap.add_argument("--quick", action="store_true",
                    help="four-groups only, 4 hosts, one run each")
    ap.add_argument("--hosts", type=int, help="at most this many hosts per topology")
    ap.add_argument("--runs", type=int, default=3, help="runs per system and regime")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="wall-clock seconds of training per run (start-up apart)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)} (a left-out system "
                         "is missing: the verdict fails)")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--size", default="mini", help="GPT-2 size (fusiond.models.gpt2)")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-mb", type=float, default=2.0,
                    help="training split (MiB of byte tokens of the default corpus)")
    ap.add_argument("--heldout-kb", type=float, default=256.0)
    ap.add_argument("--eval-windows", type=int, default=64,
                    help="held-out windows of --seq tokens per evaluation")
    ap.add_argument("--snapshot-interval", type=float, default=5.0,
                    help="seconds between the held-out evaluator's snapshots (each costs a "
                         "forward of --eval-windows windows after the run)")
    ap.add_argument("--target-loss", type=float, default=3.15,
                    help="held-out loss that counts as reached")
    ap.add_argument("--nofit-memory-mb", type=float,
                    help="per-host memory limit of the 'does not fit' regime (default: "
                         "--nofit-fraction x the single host's peak resident memory in 'fits')")
    ap.add_argument("--nofit-fraction", type=float, default=0.8)
    ap.add_argument("--latency", default="auto", help="testbed latency mode")
    ap.add_argument("--cpu-cores", type=float,
                    default=round(0.8 * len(os.sched_getaffinity(0)), 2),
                    help="cores the hosts' quotas share (default 80 %% of this process's CPUs)")
    ap.add_argument("--hivemind-python", default=str(REPO / "bench" / ".venv-hivemind" / "bin"
                                                      / "python"))
    ap.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--traces", default=str(REPO / "docs" / "wan-traces"),
                    help="where each regime's raw traces are kept (small JSON, committed; "
                         "bench/wan_plot.py redraws the plots from them)")
    ap.add_argument("--logs", default=str(REPO / "out" / "wan"),
                    help="the hosts' logs and the training split's file (not committed)")
    ap.add_argument("--explain", metavar="TRACES_JSON", type=Path,
                    help="print, from a committed traces file (docs/wan-traces/*.json), each "
                         "fusion run's measured over predicted throughput and where a miss "
                         "went, and the bytes per link rate; runs nothing")
    args = ap.parse_args()
    if args.explain is not None:
        print("\n".join(explain_traces(args.explain)))
        return
    if args.quick:
        args.topology = args.topology or ["four-groups"]
        args.hosts = args.hosts or 4
        args.runs = 1
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}")
    if [r for r in args.regimes if r not in REGIMES]:
        ap.error(f"regimes: a subset of {', '.join(REGIMES)}")
    if os.geteuid() != 0:
        ap.error("the testbed needs root")
    # Ctrl-C and SIGTERM unwind through every `finally` (testbed down, processes stopped)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # and Ctrl-C even where the shell started the bench with SIGINT ignored (a background job)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    data = prepare_data(args, Path(args.logs) / "corpus")
    wl = Workload(size=args.size, batch=args.batch, micro_batches=args.micro,
                  seq_len=args.seq, lr=args.lr, seed=args.seed, n_layer=args.n_layer,
                  n_embd=args.n_embd, n_head=args.n_head, corpus=str(data.train_path))
    # the submitting side (fusionctl submit's capture): once, outside every host's quota
    # and memory limit; every fusion run's lead reads the IR and weights it wrote
    from bench.wan_fusion import save_captured
    from fusiond.train.spec import parse_job

    args.captured_dir = Path(args.logs) / "captured"
    args.capture_s = save_captured(parse_job(wl.job_toml(adatopk=False)), args.captured_dir)
    # evaluations run in a background thread at nice 19 on this process's one torch thread
    import torch

    torch.set_num_threads(1)
    evaluate = Evaluations(make_evaluator(wl, data, args.snapshot_interval, args.captured_dir),
                           Path(args.logs) / "evaluating")
    model = make_model_for(wl)
    args.n_params = sum(p.numel() for p in model.parameters())
    args.n_blocks = len(model.transformer.h)
    args.n_embd = int(model.transformer.wte.weight.shape[1])
    del model
    args.sample_cpu_s = sample_cpu_seconds(wl)
    print(f"model: {args.n_params / 1e6:.2f} M parameters, {args.sample_cpu_s * 1e3:.0f} ms "
          "per sample (forward + backward, one thread)", flush=True)
    rng = random.Random(args.seed)
    topologies = list(args.topology or TOPOLOGIES)
    rng.shuffle(topologies)
    sections, all_v = [], []
    try:
        for name in topologies:
            md, vs = run_topology(name, args, wl, evaluate, rng)
            print("\n".join(md), flush=True)
            sections.append("\n".join(md))
            all_v += vs
    finally:
        evaluate.close()
    n_params = args.n_params
    header = [
        "# Benchmarks: fusion against the strongest baseline on the emulated WAN",
        "",
        f"Generated by `bench/wan.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"command: `{' '.join(sys.argv[1:]) or '(defaults)'}`).",
        "",
        f"Workload: GPT-2 `{wl.size}` with {wl.model_overrides()} ({n_params / 1e6:.2f} M "
        f"parameters), global batch {wl.batch} x {wl.seq_len} tokens, AdamW lr {wl.lr}, seed "
        f"{wl.seed}; {args.budget:g} s per run, {args.runs} run(s) per system and regime in "
        f"random order. Training split {args.train_mb:g} MiB, held-out split "
        f"{args.heldout_kb:g} KiB of the default corpus; target held-out loss "
        f"{args.target_loss}.",
        "",
    ]
    Path(args.doc).write_text("\n".join(header) + "\n" + "\n\n".join(sections) + "\n" + NOTES)
    print(f"wrote {args.doc}")
    with contextlib.suppress(ImportError):
        from bench.wan_plot import redraw

        for png in redraw(Path(args.traces), Path(args.doc).parent):
            print(f"wrote {png}")
    for v in all_v:
        print(v.line(LABELS))
    sys.exit(0 if all(v.ok for v in all_v) else 1)


def make_model_for(wl: Workload) -> Any:
    from fusiond.train.model import build_model
    from fusiond.train.spec import parse_job

    spec = parse_job(wl.job_toml(adatopk=False))
    return build_model(spec.model, seed=spec.seed)


NOTES = """
## How this is measured (bench/wan.py, issue 14)

- **Regimes.** "fits": no binding memory limit (every host's cgroup has a 4 GiB ceiling, only
  to measure its peak). "does not fit": every host of every system under the same limit,
  enforced by the kernel (deploy/testbed's per-host memory cgroup; cgroup v1
  `memory.limit_in_bytes` here), by default 0.8 x the peak resident memory (VmHWM, file pages
  included) the single host reached in "fits"; its anonymous peak (RssAnon, sampled every
  0.1 s) is printed in brackets beside it. 0.8 x the anonymous peak alone was tried: it left
  no system room, FSDP on two hosts included, since a Python + torch process holds 152 MiB of
  it. Fusion's planner gets the limit less an idle host process's peak (Python, torch and
  fusiond imported). A run in which the kernel killed a process at its limit is "out of
  memory", never "did not reach the target".
- **Systems.** (0) the fastest host alone (activation checkpointing in "does not fit");
  (1) torch.distributed.pipelining itself over gloo across the namespaces: equal transformer
  blocks per stage, 1F1B (`Schedule1F1B`) over the job's micro-batches, the tied
  embedding's gradient all-reduced between the first and last stage (as Megatron does), the
  stage count and host order a plain 1F1B model of the hosts' quotas and links predicts
  best; (4) DDP over gloo with the fp16 and with the PowerSGD comm hook (rank 2, error
  feedback, warm start, 2 warm-up steps), one bucket, no extra per-step collective, on the
  host subset a ring all-reduce model predicts fastest; in "does not fit" also FSDP2
  (`fully_shard`) over gloo with activation checkpointing, on the subset the same model
  picks; (5) hivemind 1.1.12 as its quickstart configures it (local updates, parameters and
  state averaged once per epoch of 4 global batches, fp16 compression, matchmaking 3 s; its
  docs' epochs of thousands of samples do not fit the budget); (6) SWARM-style int8 cuts:
  fusion's pipeline with every float cut edge int8 block-quantized in both directions
  (per-block absmax, one float32 scale per 256 elements: 0.254 of the fp32 bytes; the
  receiver decodes dense, straight-through gradients), placed by fusion's planner costing the
  edges int8, no AdaTopK (SWARM's own stochastic wiring and rebalancing are not reproduced:
  only its compression of the pipeline's cuts); (2), (3) and (7) fusion as its planner
  decides: dense, with AdaTopK, and with replicas allowed. The model is captured once, on the
  submitting side (the bench's own process, outside every host's quota and limit), as
  `fusionctl submit` does; fusion's lead reads the IR and weights, as a daemon restores an
  upload (a daemon never runs torch.export).
- **Budget and start-up.** Each run trains for the same wall-clock budget, counted from the
  start of training: DDP's and FSDP's clocks start after the rendezvous and the parameter
  broadcast, hivemind's after its DHT, optimizer and a start barrier, fusion's once every
  stage is Ready (its weights shipped to every stage); the pipeline's after the rendezvous.
  What came before is start-up, printed in its own column and kept out of every figure (on a
  long run it is paid once). The first step's warm-up is inside the budget for every system.
- **One evaluator.** Every system saves its dense weights at fixed wall-clock points (fusion:
  its stages' own checkpoints, written where they run after every step, of which the steps at
  those points, by the lead's clock, and the last are kept; the torch pipeline and FSDP: each
  rank's part after every step, merged the same way; DDP's rank 0 and hivemind's peer 0 only
  at those points). After each run the same code loads them strictly into the model and
  computes the mean loss over fixed windows of a held-out split (chunks of the corpus no
  system trains on); every curve starts with the initial weights at t = 0 (the same seeded
  model everywhere). Time to target = when the held-out loss first reaches the target,
  interpolated linearly between the snapshot before and the first at or below it.
- **The target.** 3.15 nats: on the held-out curve's descent, where a run crosses it sharply
  (about 0.01 per step) and not on the plateau near 3.0 that one machine reaches after about
  40 steps, where noise would decide the crossing. A calibration of this workload in one
  process (`python`, 1 thread, 150 steps) shows the held-out loss at 3.63 after 5 steps, 3.15
  after 20, 3.02 after 35, flat at 3.0 to 2.99 from 45 to 80 steps, and below it only after
  about 95 steps (2.94 after 100, 2.77 after 150). A target below that plateau needs about 100
  steps: 140 s on the fastest 0.4-core host, 5x the budget that lets the full run (3
  topologies x 2 regimes x 10 systems x 3 runs) fit in two hours. That part of issue 14 is not
  met. Tried on 2026-12-07 with `bench/wan_calibrate.py` (`--lr`, `--betas`, `--batch`),
  for a setting that leaves the plateau sooner: lr 3e-3 (3.12 after 45 steps, then 3.01-3.04
  to 80), lr 6e-3 (3.11 after 45, 2.97 after 80), AdamW betas (0.9, 0.95) at lr 1e-3 (3.15
  after 20, 2.98-3.02 from 40 to 80), a batch of 8 (3.00 after 95, 2.94 after 120): the
  plateau near 3.0 (between the training split's byte entropy, 3.26 nats, and its entropy
  given the previous byte, 2.43) holds for 40-90 steps in every one, so a target below it
  costs as many steps whatever the optimizer's setting.
- **Verdict.** A missing or failed system fails the bench (exit 1); out of memory and out of
  regime are outcomes (an out-of-regime baseline never counts as a fusion win). Each line
  reads "fusion best / strongest baseline" with that baseline named, medians and min-max over
  the runs; the score is the median time to target, then the median final held-out loss.
- **Hosts.** They share this machine's cores: each in a CPU quota (10 ms CFS period), the
  quotas summing to 80 % of the CPUs; "CPU used / quota" is each host's CPU seconds over its
  quota x wall-clock. The figures are what these runs saw on a machine shared with other
  work; nothing is adjusted.
- **Against the plan.** Each fusion run that trained at least three steps is compared with
  its plan's prediction: the median interval between steps after the first against the
  planner's iteration time, PASS within 25 % (issues 15 and 21), and on a miss the stage
  whose measured compute is furthest from the plan's, the hand-offs and the slowest link.
  `bench/wan.py --explain docs/wan-traces/<topology>-<regime>.json` prints the same lines
  from a committed traces file.
- Raw traces: `docs/wan-traces/<topology>-<regime>.json`; `bench/wan_plot.py` redraws the
  plots from them.
"""


if __name__ == "__main__":
    main()
