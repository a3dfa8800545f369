"""The pipeline cost model: predicted times and memory of a given cut (the planner's objective).

A plan is a list of stages; stage s runs the contiguous op range [start, stop) of the cost
graph's topological order on one machine. Model (see docs/planner.md):

- Resources: each stage's compute (forward + backward of one micro-batch, `op_times`) and each
  directed machine pair that carries tensors. A cut tensor is sent *directly* from its
  producer's stage to every later stage that reads it (once per stage, however many ops there
  read it); its gradient goes back on the reverse direction. Links are full duplex, so a link's
  time per micro-batch is max(forward bytes / bw(a->b), backward bytes / bw(b->a)).
- Compute and transfers overlap (sends are asynchronous), so in steady state the pipeline
  advances one micro-batch per *bottleneck* = the slowest resource.
- Iteration time = (M - 1) * bottleneck + fill + optimizer step + tied-weight sync, where fill
  is one micro-batch's forward+backward through every stage and link, plus, per hop between
  consecutive stages, one RTT and the *wake-up* of both hosts in each direction: the
  GPipe/1F1B bubble model. A wake-up (`MachineProfile.wake_s`) is what a hand-off costs on a
  host under a CFS CPU quota: once its share of the period is used, the woken thread waits
  for the next period (8 ms for 0.2 core with a 10 ms period). A stage's tasks run as one
  loop on its compute thread (docs/runtime.md), so a task whose inputs are in costs no
  wake-up; one whose inputs arrive while the thread waits pays the hop's wake-up, counted here.
  The tied-weight sync counts only what the exchange takes beyond the next micro-batch's
  forward to the later holder (`_tied_sync`). Measured against task timelines: docs/planner.md.
- Memory of a stage: unique parameters + their gradients + optimizer state + saved activations
  of the micro-batches in flight (1F1B: min(M, S - s) on stage s; GPipe: M) + the largest
  output of one op as workspace, against `memory_fraction` of the machine's memory.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fusiond.plan.model import (
    F64,
    Cluster,
    CostGraph,
    JobSettings,
    PlanError,
    dense_wire_bytes,
    op_forward_times,
    op_times,
    wire_bytes,
)


@dataclass(frozen=True)
class StageSpec:
    """Machine `machine` (an index into the cluster) runs ops [start, stop)."""

    machine: int
    start: int
    stop: int


@dataclass(frozen=True)
class StageReport:
    index: int
    machine: int
    machine_id: str
    start: int
    stop: int
    first_op: str
    last_op: str
    compute_s: float
    memory_bytes: float
    memory_cap: float
    inflight: int
    wire_cpu_s: float = 0.0
    """The stage's own time per micro-batch to send and receive its cut tensors
    (`MachineProfile.wire_s_per_byte` per byte, `msg_s` per message); it adds to `compute_s`
    as the stage's busy time."""

    @property
    def busy_s(self) -> float:
        """Compute and wire handling: the stage's time per micro-batch."""
        return self.compute_s + self.wire_cpu_s


@dataclass(frozen=True)
class LinkReport:
    """Traffic of one directed machine pair per micro-batch (forward a->b, backward b->a)."""

    src_stage: int
    dst_stage: int
    src: int
    dst: int
    fwd_bytes: float
    bwd_bytes: float
    dense_fwd_bytes: float
    dense_bwd_bytes: float
    bandwidth_fwd_bytes_per_s: float
    """Link rate a->b (the forward direction)."""
    bandwidth_bwd_bytes_per_s: float
    """Link rate b->a (the backward direction)."""
    rtt_s: float
    time_s: float
    tensors: tuple[str, ...]
    density: float
    fwd_msgs: float = 0.0
    """Messages per micro-batch forward (one per tensor) and backward (one per gradient)."""
    bwd_msgs: float = 0.0


@dataclass(frozen=True)
class Evaluation:
    """Predicted times (seconds per iteration of M micro-batches) and memory of one cut."""

    stages: tuple[StageReport, ...]
    links: tuple[LinkReport, ...]
    bottleneck_s: float
    bottleneck: str
    compute_bottleneck_s: float
    fill_s: float
    optimizer_s: float
    sync_s: float
    iteration_s: float
    samples_per_s: float
    over_memory: tuple[str, ...]
    unrunnable: tuple[str, ...] = ()
    """`"<machine>: <op>, ..."` for each stage whose machine cannot run some of its ops."""

    @property
    def memory_ok(self) -> bool:
        return not self.over_memory

    @property
    def feasible(self) -> bool:
        """Every stage fits its machine's memory and its machine runs every op of it."""
        return not self.over_memory and not self.unrunnable


class GraphArrays:
    """Per-(graph, cluster, settings) numpy views the planner and the evaluator share."""

    def __init__(self, graph: CostGraph, cluster: Cluster, settings: JobSettings) -> None:
        self.graph = graph
        self.cluster = cluster
        self.settings = settings
        b = settings.micro_batch_size
        self.n = len(graph.ops)
        #: [machine, op] forward+backward seconds of one micro-batch
        self.times = np.stack([op_times(graph, m, b) for m in cluster.machines])
        self.prefix = np.concatenate([np.zeros((len(cluster), 1)), np.cumsum(self.times, 1)], 1)
        #: the forward pass's part of `prefix`
        self.prefix_f = np.concatenate(
            [np.zeros((len(cluster), 1)),
             np.cumsum(np.stack([op_forward_times(graph, m, b) for m in cluster.machines]), 1)],
            1)
        self.param = np.array([o.param_bytes for o in graph.ops])
        self.opt = np.array([o.opt_state_bytes for o in graph.ops])
        self.saved = np.array([o.saved_bytes for o in graph.ops]) * b
        self.out = np.array([o.out_bytes for o in graph.ops]) * b
        #: static bytes per op in the planner's prefix sums (tied weights counted per user:
        #: conservative; the evaluator de-duplicates exactly)
        self.static_prefix = np.concatenate([[0.0], np.cumsum(2 * self.param + self.opt)])
        self.saved_prefix = np.concatenate([[0.0], np.cumsum(self.saved)])
        self.workspace = float(self.out.max()) if self.n else 0.0
        self.caps = np.array(
            [m.memory_bytes * settings.memory_fraction for m in cluster.machines]
        )
        self.last_use = np.array([max(t.dsts) if t.dsts else t.src for t in graph.tensors],
                                 dtype=np.int64)
        #: [machine, op] True where the machine runs the op (`MachineProfile.ops`)
        self.runs = np.array([[m.runs(o.op) for o in graph.ops] for m in cluster.machines],
                             dtype=bool).reshape(len(cluster), self.n)
        #: [machine, p]: how many of ops [0, p) the machine cannot run
        self.bad_prefix = np.concatenate(
            [np.zeros((len(cluster), 1), dtype=np.int64),
             np.cumsum(~self.runs, axis=1, dtype=np.int64)], axis=1)
        #: [machine, p]: the first op a stage ending at position p may start at on that machine
        #: (one past the last op before p it cannot run; p itself when op p - 1 is one)
        idx = np.where(~self.runs, np.arange(1, self.n + 1)[None, :], 0)
        self.min_start = np.concatenate(
            [np.zeros((len(cluster), 1), dtype=np.int64),
             np.maximum.accumulate(idx, axis=1).astype(np.int64)], axis=1)
        #: whether any machine lacks an op of the graph (the searches skip the checks if not)
        self.restricted = bool((~self.runs).any())

    def stage_runs(self, machine: int, start: int, stop: int) -> bool:
        """Whether `machine` runs every op in [start, stop)."""
        return bool(self.bad_prefix[machine, stop] == self.bad_prefix[machine, start])

    def missing_ops(self, machine: int, start: int, stop: int) -> list[str]:
        """The op names in [start, stop) that `machine` cannot run (distinct, in order)."""
        ops = self.graph.ops
        bad = [ops[i].op for i in range(start, stop) if not self.runs[machine, i]]
        return list(dict.fromkeys(bad))

    def cut_bytes(self, density_of_compressible: float) -> tuple[F64, F64]:
        """Bytes crossing each position p (between ops p-1 and p): forward and backward.

        A tensor crosses every position in (src, last consumer]; this is what the DP charges to
        the link into the stage that starts at p (the evaluator then routes exactly).
        """
        fwd = np.zeros(self.n + 2)
        bwd = np.zeros(self.n + 2)
        for t, last in zip(self.graph.tensors, self.last_use, strict=True):
            if last <= t.src:
                continue
            f, g = wire_bytes(t, self.settings.micro_batch_size, density_of_compressible,
                              self.settings)
            fwd[t.src + 1] += f
            fwd[last + 1] -= f
            bwd[t.src + 1] += g
            bwd[last + 1] -= g
        return np.cumsum(fwd)[: self.n + 1], np.cumsum(bwd)[: self.n + 1]


def _stage_static(graph: CostGraph, start: int, stop: int) -> tuple[float, float, set[str]]:
    """(unique parameter bytes, optimizer-state bytes, parameter names) of ops [start, stop)."""
    names: set[str] = set()
    unnamed = 0.0
    total_named = 0.0
    opt = 0.0
    sizes = graph_param_sizes(graph)
    for o in graph.ops[start:stop]:
        opt += o.opt_state_bytes
        if o.params and all(p in sizes for p in o.params):
            names.update(o.params)
            total_named += o.param_bytes
        else:
            unnamed += o.param_bytes
    uniq = sum(sizes[p] for p in names)
    if total_named > 0:
        # scale optimizer state by the de-duplication of tied weights
        opt *= (uniq + unnamed) / (total_named + unnamed)
    return uniq + unnamed, opt, names


def _tied_sync(arrays: GraphArrays, stages: Sequence[StageSpec],
               reports: Sequence[StageReport], links: Sequence[LinkReport],
               holders: Mapping[str, Sequence[int]], sizes: Mapping[str, float]) -> float:
    """What the exchange of tied weights' gradients adds to an iteration.

    The first holder h0 (the embedding's stage) finishes the iteration last; its gradient goes
    to every later holder h, which needs it before its optimizer step, and h's next forward
    waits for the next micro-batch from h0 anyway: one forward through the stages in between
    (their forward compute, links, half RTTs and wake-ups). So the exchange shows only where
    it takes longer than that forward; later holders' gradients, sent at their own last
    backward, reach h0 during its drain. Exchanges with several holders run at once: the
    slowest counts."""
    c = arrays.cluster
    pair_bytes: dict[tuple[int, int], float] = {}
    for p, hs in holders.items():
        for h in hs[1:]:
            pair_bytes[(hs[0], h)] = pair_bytes.get((hs[0], h), 0.0) + sizes[p]
    if not pair_bytes:
        return 0.0
    fwd_link: dict[tuple[int, int], LinkReport] = {(lk.src_stage, lk.dst_stage): lk
                                                   for lk in links}

    def wake(i: int) -> float:
        return c.machines[stages[i].machine].wake_s

    def forward(i: int) -> float:
        s, r = stages[i], reports[i]
        f = float(arrays.prefix_f[s.machine, s.stop] - arrays.prefix_f[s.machine, s.start])
        share = f / r.compute_s if r.compute_s > 0 else 0.0
        return f + share * r.wire_cpu_s

    out = 0.0
    for (h0, h), nbytes in pair_bytes.items():
        a, z = stages[h0].machine, stages[h].machine
        x = (nbytes / min(float(c.bandwidth_bytes_per_s[a, z]),
                          float(c.bandwidth_bytes_per_s[z, a]))
             + float(c.rtt_s[a, z]) / 2 + wake(h0) + wake(h))
        ahead = 0.0
        for i in range(h0, h):
            ahead += forward(i)
            lk = fwd_link.get((i, i + 1))
            ahead += (lk.fwd_bytes / lk.bandwidth_fwd_bytes_per_s if lk is not None else 0.0)
            ahead += (float(c.rtt_s[stages[i].machine, stages[i + 1].machine]) / 2
                      + wake(i) + wake(i + 1))
        out = max(out, x - ahead)
    return out


def graph_param_sizes(graph: CostGraph) -> dict[str, float]:
    """Parameter name -> bytes, derived from ops that own exactly one named parameter group.

    An op's `param_bytes` is split evenly over its named params when sizes are not otherwise
    known; the IR estimator fills `CostGraph.param_sizes`, which wins when present.
    """
    if graph.param_sizes:
        return dict(graph.param_sizes)
    sizes: dict[str, float] = {}
    for o in graph.ops:
        for p in o.params:
            sizes.setdefault(p, o.param_bytes / len(o.params))
    return sizes


def evaluate(
    arrays: GraphArrays,
    stages: Sequence[StageSpec],
    densities: Mapping[tuple[str, int], float] | None = None,
) -> Evaluation:
    """Predict iteration time, per-stage/per-link times and memory of `stages`.

    `stages` must cover ops [0, n) contiguously, in order, each on a distinct machine.
    `densities[(tensor, dst_stage)]` < 1 sends that tensor top-k compressed to that stage.
    """
    g, c, st = arrays.graph, arrays.cluster, arrays.settings
    n = arrays.n
    if not stages or stages[0].start != 0 or stages[-1].stop != n:
        raise PlanError("stages must cover all ops")
    for prev, nxt in itertools.pairwise(stages):
        if prev.stop != nxt.start or nxt.start >= nxt.stop:
            raise PlanError("stages must be contiguous and non-empty")
    if len({s.machine for s in stages}) != len(stages):
        raise PlanError("a machine may run only one stage")
    dens = densities or {}
    S = len(stages)
    M = st.num_micro_batches
    b = st.micro_batch_size
    stage_of = np.empty(n, dtype=np.int64)
    for i, s in enumerate(stages):
        stage_of[s.start : s.stop] = i

    reports: list[StageReport] = []
    over: list[str] = []
    unrunnable: list[str] = []
    holders: dict[str, list[int]] = {}
    opt_s = 0.0
    sizes = graph_param_sizes(g)
    for i, s in enumerate(stages):
        m = c.machines[s.machine]
        compute = float(arrays.prefix[s.machine, s.stop] - arrays.prefix[s.machine, s.start])
        params, opt, names = _stage_static(g, s.start, s.stop)
        for p in names:
            holders.setdefault(p, []).append(i)
        inflight = M if st.schedule == "gpipe" else min(M, S - i)
        mem = (2 * params + opt + inflight * float(arrays.saved[s.start : s.stop].sum())
               + float(arrays.out[s.start : s.stop].max()))
        cap = float(arrays.caps[s.machine])
        if mem > cap:
            over.append(m.id)
        if not arrays.stage_runs(s.machine, s.start, s.stop):
            lacks = arrays.missing_ops(s.machine, s.start, s.stop)
            unrunnable.append(f"{m.id}: {', '.join(lacks)}")
        opt_s = max(opt_s, params * st.optimizer_passes / m.mem_bw)
        reports.append(StageReport(
            i, s.machine, m.id, s.start, s.stop, g.ops[s.start].name, g.ops[s.stop - 1].name,
            compute, mem, cap, inflight,
        ))

    # route every tensor directly to each later stage that reads it
    traffic: dict[tuple[int, int], list[float]] = {}
    names_on: dict[tuple[int, int], list[str]] = {}
    for t in g.tensors:
        ps = int(stage_of[t.src])
        for ds in sorted({int(stage_of[d]) for d in t.dsts} - {ps}):
            d = dens.get((t.name, ds), 1.0)
            f, bk = wire_bytes(t, b, d, st)
            df, db = dense_wire_bytes(t, b)
            acc = traffic.setdefault((ps, ds), [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
            acc[0] += f
            acc[1] += bk
            acc[2] += df
            acc[3] += db
            if t.compressible:
                acc[4] = min(acc[4], d)
            acc[5] += 1.0
            acc[6] += 1.0 if t.grad else 0.0
            names_on.setdefault((ps, ds), []).append(t.name)
    links: list[LinkReport] = []
    for (ps, ds), (f, bk, df, db, dmin, nf, nb) in sorted(traffic.items()):
        a, z = stages[ps].machine, stages[ds].machine
        fwd_bytes_per_s = float(c.bandwidth_bytes_per_s[a, z])
        bwd_bytes_per_s = float(c.bandwidth_bytes_per_s[z, a])
        t_link = max(f / fwd_bytes_per_s, bk / bwd_bytes_per_s)
        links.append(LinkReport(
            ps, ds, a, z, f, bk, df, db, fwd_bytes_per_s, bwd_bytes_per_s, float(c.rtt_s[a, z]),
            t_link,
            tuple(names_on[(ps, ds)]), dmin, nf, nb,
        ))

    # a stage's host also pays for every byte it sends and receives (encoding, TLS, socket
    # copies): on a small CPU share that is time the stage is not computing
    handled = [0.0] * S
    msgs = [0.0] * S
    for lk in links:
        for end in (lk.src_stage, lk.dst_stage):
            handled[end] += lk.fwd_bytes + lk.bwd_bytes
            msgs[end] += lk.fwd_msgs + lk.bwd_msgs
    reports = [dataclasses.replace(
        r, wire_cpu_s=handled[i] * c.machines[r.machine].wire_s_per_byte
        + msgs[i] * c.machines[r.machine].msg_s)
        for i, r in enumerate(reports)]
    compute_b = max(r.busy_s for r in reports)
    bottleneck_s, bottleneck = compute_b, f"compute {reports[0].machine_id}"
    for r in reports:
        if r.busy_s >= bottleneck_s:
            bottleneck_s, bottleneck = r.busy_s, f"compute {r.machine_id}"
    for lk in links:
        if lk.time_s > bottleneck_s:
            bottleneck_s = lk.time_s
            bottleneck = f"link {c.machines[lk.src].id}->{c.machines[lk.dst].id}"
    fill = sum(r.busy_s for r in reports)
    fill += sum(lk.fwd_bytes / lk.bandwidth_fwd_bytes_per_s
                + lk.bwd_bytes / lk.bandwidth_bwd_bytes_per_s for lk in links)
    fill += sum(float(c.rtt_s[stages[i].machine, stages[i + 1].machine]) for i in range(S - 1))
    # every hand-off between consecutive stages, forward and backward, wakes both hosts
    wake = sum(2 * (c.machines[stages[i].machine].wake_s + c.machines[stages[i + 1].machine].wake_s)
               for i in range(S - 1))
    fill += wake
    sync = _tied_sync(arrays, stages, reports, links, holders, sizes)
    iteration = (M - 1) * bottleneck_s + fill + opt_s + sync
    return Evaluation(
        stages=tuple(reports),
        links=tuple(links),
        bottleneck_s=bottleneck_s,
        bottleneck=bottleneck,
        compute_bottleneck_s=compute_b,
        fill_s=fill,
        optimizer_s=opt_s,
        sync_s=sync,
        iteration_s=iteration,
        samples_per_s=M * b / iteration,
        over_memory=tuple(over),
        unrunnable=tuple(unrunnable),
    )


@dataclass(frozen=True, eq=False)
class Plan:
    """A schedule: which machine runs which ops, per-edge densities, and the prediction.

    `assignment`: op name -> machine id (every op of the cost graph). `densities`:
    (tensor name, destination stage) -> density for compressed cut edges (absent = dense).
    `dense`: the prediction of the same cut without compression (for AdaTopK's gain).
    `idle`: machine id -> why it runs nothing. `groups`: the bandwidth groups (machine ids).
    """

    method: str
    arrays: GraphArrays
    stages: tuple[StageSpec, ...]
    densities: Mapping[tuple[str, int], float]
    evaluation: Evaluation
    dense: Evaluation
    groups: tuple[tuple[str, ...], ...]
    idle: Mapping[str, str]
    notes: tuple[str, ...] = ()

    @property
    def assignment(self) -> dict[str, str]:
        ops = self.arrays.graph.ops
        ids = self.arrays.cluster.ids()
        return {ops[i].name: ids[s.machine] for s in self.stages for i in range(s.start, s.stop)}

    @property
    def iteration_s(self) -> float:
        return self.evaluation.iteration_s

    @property
    def samples_per_s(self) -> float:
        return self.evaluation.samples_per_s

    @property
    def gain(self) -> float:
        """Predicted speed-up of the compressed plan over the same cut sent dense."""
        return self.dense.iteration_s / self.evaluation.iteration_s

    def stage_assignment(self) -> dict[str, int]:
        """Op (IR node id) -> stage index: the `assignment` for `fusiond.graph.partition`
        (partition id = stage index, so stage s runs on `stages[s].machine`)."""
        return {self.arrays.graph.ops[i].name: k
                for k, s in enumerate(self.stages) for i in range(s.start, s.stop)}

    def machine_of_stage(self) -> list[str]:
        """Stage index -> machine id."""
        ids = self.arrays.cluster.ids()
        return [ids[s.machine] for s in self.stages]

    def edge_densities(self) -> dict[str, float]:
        """Compressed cut edges by `fusiond.graph.partition.Edge.id` (`"<value>-><dst stage>"`)
        -> density; edges not listed travel dense."""
        return {f"{name}->{dst}": d for (name, dst), d in self.densities.items()}

    def value_densities(self) -> dict[str, float]:
        """Per value (`Edge.value`), the lowest density over its destinations (for
        `fusiond.graph.driver.Driver(topk=...)`, which takes one density per value)."""
        out: dict[str, float] = {}
        for (name, _dst), d in self.densities.items():
            out[name] = min(d, out.get(name, 1.0))
        return out
