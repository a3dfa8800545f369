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
  output of one op as workspace, against `memory_fraction` of the machine's memory. With
  `JobSettings.recompute`, a stage that does not fit so may recompute: it keeps its inputs
  per micro-batch in flight and one micro-batch's saved activations (the backward's second
  forward), and its compute gains one forward per micro-batch (`StageReport.recompute`).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fusiond.plan.memory import (
    ACTIVATION_OVERHEAD,
    UPDATE_CHUNKS,
    MemoryChoice,
    plan_stage_memory,
    stage_blocks,
)
from fusiond.plan.model import (
    F64,
    Cluster,
    CostGraph,
    EdgeEncoding,
    JobSettings,
    PlanError,
    dense_wire_bytes,
    op_forward_times,
    op_times,
    wire_bytes,
)


@dataclass(frozen=True)
class StageSpec:
    """Machine `machine` (an index into the cluster) runs ops [start, stop); so does every
    machine in `replicas` (data parallelism inside the stage: each replica runs its share of
    the micro-batches, `micro_batch_shares`, and the replicas reduce the stage's gradients
    once per iteration before the optimizer step)."""

    machine: int
    start: int
    stop: int
    replicas: tuple[int, ...] = ()

    @property
    def machines(self) -> tuple[int, ...]:
        """Every machine of the stage, `machine` first."""
        return (self.machine, *self.replicas)


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
    replica: int = 0
    """Which of the stage's machines this is (0: `StageSpec.machine`)."""
    recompute: bool = False
    """It recomputes its activations in the backward (its kept activations would not fit;
    `JobSettings.recompute`): `compute_s` includes the second forward."""
    offload: bool = False
    """It keeps its optimizer state on disk (`JobSettings.offload`): the iteration's
    optimizer time includes reading and writing it."""
    micro_batches: int = 0
    """Micro-batches of an iteration this machine runs (all M without replicas)."""
    checkpoint_blocks: tuple[int, ...] = ()
    """The blocks of the stage (`stage_blocks`, in order) it checkpoints: the per-block
    memory planner's choice (`fusiond.plan.memory`), instead of `recompute`; `compute_s`
    includes their second forwards."""
    offload_params: bool = False
    """It keeps its weights and gradients on disk too (with `offload`): `compute_s` includes
    reading them."""
    sizes: tuple[int, ...] = ()
    """The samples of each of its micro-batches, in the order it runs them, where they are not
    all the job's micro-batch size (`JobSettings.sized_micro_batches`); `compute_s` is then
    their mean time."""

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
    micro_batches: int = 0
    """Micro-batches of an iteration routed over this machine pair (all M without
    replicas); the bytes and `time_s` above are per micro-batch."""
    codec: str = "exact"
    """How its compressible tensors travel: "exact", "top-k <density>" or an encoding
    ("bf16", "int8", "int4"; several joined by "+")."""

    @property
    def fill_s(self) -> float:
        """One micro-batch's transfer each way (its share of the pipeline's fill)."""
        return (self.fwd_bytes / self.bandwidth_fwd_bytes_per_s
                + self.bwd_bytes / self.bandwidth_bwd_bytes_per_s)


@dataclass(frozen=True)
class SyncReport:
    """The gradient reduction among one stage's replicas, once per iteration."""

    stage: int
    machine_ids: tuple[str, ...]
    grad_bytes: float
    """The stage's unique parameter gradients (fp32), what each replica contributes."""
    scheme: str
    """"ring" (every replica in one ring), "hierarchical" (a ring inside each bandwidth
    group, then one among the groups' first replicas) or "two-level" (inside each group a
    reduce-scatter, then one ring per shard across the groups, then an all-gather)."""
    slowest_bytes_per_s: float
    """The slowest link the reduction crosses."""
    time_s: float
    overlap_s: float
    """What it hides behind: the drain of the stages before it (their last backward passes)
    and, where it goes by buckets during the backward (`JobSettings.reduce_in_backward`),
    all but the last bucket's share of the stage's own last backward."""
    density: float = 1.0
    """The share of `grad_bytes` sent (< 1: compressed low-rank with error feedback, at least
    `JobSettings.grad_density_floor`); `time_s` includes the compression's own work."""
    buckets: int = 1
    """The buckets it goes in, each once its gradients are final (during the stage's last
    backward where the runtime does that), several in flight at once; the last one's share
    of `time_s` can only start once the backward has ended."""
    drain_s: float = 0.0
    """The part of `overlap_s` that is the drain of the stages before it."""
    cpu_s: float = 0.0
    """The part of `time_s` that is the replicas' own CPU work (handling the bytes,
    compressing), on stages that compute on the CPU: it competes with their backward for
    the same cores, so it hides behind the drain only."""
    tail_s: float = 0.0
    """The last bucket's own time (its bytes, every round's latency, its compression): it
    can start only once the backward has ended (0: its share of `time_s`)."""

    @property
    def exposed_s(self) -> float:
        own = self.overlap_s - self.drain_s
        hidden = self.drain_s + min(own, max(self.time_s - self.cpu_s, 0.0))
        tail = (self.tail_s or self.time_s / self.buckets) if self.buckets > 1 else 0.0
        return max(0.0, self.time_s - hidden, min(tail, self.time_s))


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
    replicas: tuple[StageReport, ...] = ()
    """Every machine of every stage (`stages` holds each stage's first machine)."""
    syncs: tuple[SyncReport, ...] = ()
    """One per stage with replicas."""
    grad_sync_s: float = 0.0
    """What the replicas' gradient reductions add to the iteration (the slowest's exposed
    part; they run at once, on different links)."""

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
        self._at: dict[tuple[int, int], tuple[F64, F64]] = {}
        self._syncs: dict[tuple[int, ...], GradientSync] = {}
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
        #: (weights and gradients, and a snapshot of the weights where the job sends its
        #: stages' state, `JobSettings.snapshots`: a stage's first replica holds it)
        copies = 3.0 if settings.snapshots else 2.0
        self.static_prefix = np.concatenate([[0.0], np.cumsum(copies * self.param + self.opt)])
        #: what the searches' memory checks count: without the optimizer state when it may
        #: go to disk (`JobSettings.offload`; the evaluator decides per stage)
        self.fit_static_prefix = (np.concatenate([[0.0], np.cumsum(copies * self.param)])
                                  if settings.offload else self.static_prefix)
        self.saved_prefix = np.concatenate([[0.0], np.cumsum(self.saved)])
        self.workspace = float(self.out.max()) if self.n else 0.0
        self.caps = np.array(
            [m.memory_bytes * settings.memory_fraction for m in cluster.machines]
        )
        self.last_use = np.array([max(t.dsts) if t.dsts else t.src for t in graph.tensors],
                                 dtype=np.int64)
        #: [position p]: the dense bytes of one micro-batch crossing p forward, what a stage
        #: starting there keeps per micro-batch in flight when it recomputes (an upper bound
        #: on its inputs: every tensor alive across p)
        self.in_bytes = self.cut_bytes(1.0)[0] if settings.recompute else np.zeros(self.n + 1)
        # blocks (`CostGraph.block_starts`; without them each op is one): the units of the
        # memory planner's per-block decisions (`fusiond.plan.memory`)
        starts = np.zeros(self.n + 1, dtype=bool)
        starts[list(graph.block_starts) or list(range(self.n))] = True
        starts[0] = True
        #: [p]: whether a block begins at op p
        self.is_block_start = starts
        block_id = np.cumsum(starts[: self.n]) - 1
        nb = int(block_id[-1]) + 1 if self.n else 0
        block_param = np.bincount(block_id, weights=self.param, minlength=nb)
        block_opt = np.bincount(block_id, weights=self.opt, minlength=nb)
        block_saved = np.bincount(block_id, weights=self.saved, minlength=nb)
        #: [p]: inputs per micro-batch the blocks starting before p keep when checkpointed
        #: (block starts only; a stage's first block keeps `in_bytes` at its own start)
        self.block_in_bytes_prefix = np.concatenate(
            [[0.0], np.cumsum(np.where(starts[: self.n], self.in_bytes[: self.n], 0.0))])
        #: the largest block's activations: what a checkpointed block holds again in the
        #: backward
        self.max_block_saved_bytes = float(block_saved.max()) if nb else 0.0
        #: what weights on disk keep in memory while the micro-batches run: the working
        #: block's weights and gradients and the previous block's weights
        #: (`fusiond.plan.memory`, `DiskParameters`)
        windows = [2.0 * float(block_param[i]) + (float(block_param[i - 1]) if i else 0.0)
                   for i in range(nb)]
        self.offload_window_bytes = max([0.0, *windows])
        #: ... and while the optimizer steps (the activations gone): the stepping block's
        #: weights and gradients and `UPDATE_CHUNKS` blocks' optimizer state
        self.offload_update_bytes = (2.0 * float(block_param.max(initial=0.0))
                                     + UPDATE_CHUNKS * float(block_opt.max(initial=0.0)))
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

    def gradient_sync(self, machines: Sequence[int]) -> GradientSync:
        """`gradient_sync` among `machines` at the settings' message cost, cached (the search
        scores the same replica sets many times; a ring's order is a search of its own)."""
        key = tuple(machines)
        got = self._syncs.get(key)
        if got is None:
            got = self._syncs[key] = gradient_sync(self.cluster, key,
                                                   self.settings.reduce_msg_ops)
        return got

    def stage_s_at(self, machine: int, start: int, stop: int, batch: int) -> tuple[float, float]:
        """(forward + backward, forward) seconds of ops [start, stop) on `machine` for one
        micro-batch of `batch` samples (`op_times` at that size; cached per machine and size)."""
        if batch == self.settings.micro_batch_size:
            return (float(self.prefix[machine, stop] - self.prefix[machine, start]),
                    float(self.prefix_f[machine, stop] - self.prefix_f[machine, start]))
        got = self._at.get((machine, batch))
        if got is None:
            m = self.cluster.machines[machine]
            got = (np.concatenate([[0.0], np.cumsum(op_times(self.graph, m, batch))]),
                   np.concatenate([[0.0], np.cumsum(op_forward_times(self.graph, m, batch))]))
            self._at[(machine, batch)] = got
        return float(got[0][stop] - got[0][start]), float(got[1][stop] - got[1][start])

    def stage_need(self, infl: int, outmax: F64) -> F64:
        """[p, e]: the memory a stage running ops [p, e) needs with `infl` micro-batches in
        flight (`outmax[p, e]`: its workspace), as `evaluate` counts it without replicas: the
        smaller of keeping every in-flight activation and, with `settings.recompute`,
        recomputing them."""
        mem = self.fit_static_prefix + infl * self.saved_prefix
        need: F64 = mem[None, :] - mem[:, None] + outmax
        if self.settings.recompute:
            rc = self.fit_static_prefix + self.saved_prefix
            need = np.minimum(need, rc[None, :] - rc[:, None] + infl * self.in_bytes[:, None]
                              + outmax)
        # per-block checkpointing (`fusiond.plan.memory`): every block keeps its inputs, one
        # holds its activations again; with the optimizer state on disk, the weights too
        kept = self.block_act_prefix(infl)
        act = kept[None, :] - kept[:, None] + self.block_act_const(infl)[:, None]
        if self.settings.recompute:
            need = np.minimum(need, self.fit_static_prefix[None, :]
                              - self.fit_static_prefix[:, None] + act + outmax)
        if self.settings.offload:
            need = np.minimum(need, np.maximum(self.offload_window_bytes + act + outmax,
                                               self.offload_update_bytes))
        return need

    def block_act_prefix(self, infl: int) -> F64:
        """[p]: the monotone part of the activations a stage keeps with every block
        checkpointed (`infl` micro-batches of every block's inputs), with the planner's
        allocator factor; `block_act_const` adds the rest. Without recompute: all of them."""
        if not self.settings.recompute:
            return ACTIVATION_OVERHEAD * infl * self.saved_prefix
        return ACTIVATION_OVERHEAD * infl * self.block_in_bytes_prefix

    def block_act_const(self, infl: int) -> F64:
        """[p]: what a stage starting at p keeps besides `block_act_prefix`'s difference: its
        first block's inputs (where p starts no block) and one block's activations."""
        if not self.settings.recompute:
            return np.zeros(self.n + 1)
        first = np.where(self.is_block_start, 0.0, self.in_bytes)
        return ACTIVATION_OVERHEAD * (infl * first + self.max_block_saved_bytes)

    def stage_runs(self, machine: int, start: int, stop: int) -> bool:
        """Whether `machine` runs every op in [start, stop)."""
        return bool(self.bad_prefix[machine, stop] == self.bad_prefix[machine, start])

    def missing_ops(self, machine: int, start: int, stop: int) -> list[str]:
        """The op names in [start, stop) that `machine` cannot run (distinct, in order)."""
        ops = self.graph.ops
        bad = [ops[i].op for i in range(start, stop) if not self.runs[machine, i]]
        return list(dict.fromkeys(bad))

    def search_compression(self, compress: bool) -> tuple[float, EdgeEncoding | None]:
        """How OP-Fence's cut search costs a compressed cut: (density, encoding) of the most
        compressing choice the job allows (the density floor for AdaTopK; with the per-link
        codec choice, the admitted codec that sends fewest bytes); (1.0, None) when not
        compressing."""
        if not compress:
            return 1.0, None
        st = self.settings
        if st.codec_choice:
            from fusiond.plan.accuracy import most_compressing

            last = most_compressing(st.accuracy_budget, st.density_floor)
            if last.density is not None:
                return last.density, None
            return 1.0, last.encoding
        return st.density_floor, None

    def cut_bytes(self, density_of_compressible: float,
                  encoding: EdgeEncoding | None = None) -> tuple[F64, F64]:
        """Bytes crossing each position p (between ops p-1 and p): forward and backward, the
        compressible tensors at `density_of_compressible` or `encoding`.

        A tensor crosses every position in (src, last consumer]; this is what the DP charges to
        the link into the stage that starts at p (the evaluator then routes exactly).
        """
        fwd = np.zeros(self.n + 2)
        bwd = np.zeros(self.n + 2)
        for t, last in zip(self.graph.tensors, self.last_use, strict=True):
            if last <= t.src:
                continue
            f, g = wire_bytes(t, self.settings.micro_batch_size, density_of_compressible,
                              self.settings, encoding)
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


RING_MIN_HOLDERS = 3
"""From this many holders the runtime sums a gradient by a ring (`fusiond.train.stage`'s
constant of the same name; a test holds them equal)."""


def exchange_bytes(grad_bytes: float, holders: int) -> float:
    """What a replicated stage's gradient reduction holds in each replica's memory beyond its
    gradients, as the runtime exchanges them (dense in the warm-up steps even where later
    ones go low-rank). Two holders (`StageExecutor._exchange`): its own flat copy to send,
    the other's copy received, and the sum. Three or more (`StageExecutor._ring_sum`): the
    flat copy the reduce-scatter sums into, the all-gather's result and the chunk in flight,
    whatever their number. 0 without replicas. (DDP's 25 MiB bucket was counted here
    before; a 2-replica exchange of a 19 MB model held 3x the gradients and the kernel
    killed a replica planned to fit. Until 2026-12-07 the ring was counted as holders + 1
    copies, as the all-to-all it replaced: 49 copies of GPT-2 small's 0.5 GB on 48 replicas,
    so no plan of more than 24 fitted.)"""
    if holders < 2:
        return 0.0
    if holders < RING_MIN_HOLDERS:
        return (holders + 1) * grad_bytes
    return (2 + 1 / holders) * grad_bytes


def micro_batch_shares(times_s: Sequence[float], num_micro_batches: int) -> list[int]:
    """Micro-batches per replica for replicas taking `times_s` each per micro-batch: each one
    goes to the replica that would finish it first (the least max share x time; optimal for
    equal jobs on machines of different speeds). Ties go to the earlier replica."""
    if not times_s:
        raise PlanError("a stage needs at least one machine")
    shares = [0] * len(times_s)
    heap = [(max(float(t), 0.0), i) for i, t in enumerate(times_s)]
    heapq.heapify(heap)
    for _ in range(num_micro_batches):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        heapq.heappush(heap, ((shares[i] + 1) * max(float(times_s[i]), 0.0), i))
    return shares


MIN_MICRO_BATCH = 2
"""The fewest samples a micro-batch of its own size may have: a captured graph's batch
dimension is dynamic from 2 (torch.export specialises sizes 0 and 1)."""


def split_evenly(samples: int, count: int) -> list[int]:
    """`samples` in `count` parts that differ by at most one, the larger first."""
    if count <= 0:
        return []
    q, extra = divmod(samples, count)
    return [q + 1] * extra + [q] * (count - extra)


def sized_shares(time_s: Callable[[int, int], float], counts: Sequence[int], total: int,
                 min_size: int = MIN_MICRO_BATCH) -> list[list[int]]:
    """The samples of each micro-batch of each replica: replica r keeps its `counts[r]`
    micro-batches and takes a number of samples n_r (`split_evenly` over them; sum `total`)
    so that the replicas finish together. `time_s(r, x)`: replica r's time for one
    micro-batch of x samples. Solved on a line through each replica's time at the job's size
    and at half of it, then corrected sample by sample on the real times: first to the
    total, then while moving one sample off the slowest replica to the one it then costs
    least shortens the step."""
    live = [r for r, k in enumerate(counts) if k > 0]
    if not live:
        raise PlanError("no replica runs a micro-batch")
    size = max(total // sum(counts), 1)
    least = {r: min_size * counts[r] for r in live}
    if sum(least.values()) > total:
        raise PlanError(f"{total} samples do not make {sum(counts)} micro-batches of at "
                        f"least {min_size}")

    def load(r: int, n: int) -> float:
        parts = split_evenly(n, counts[r])
        hi, lo = parts[0], parts[-1]
        big = n - lo * counts[r]
        return big * time_s(r, hi) + (counts[r] - big) * time_s(r, lo)

    half = max(min_size, size // 2)
    slope, fixed = {}, {}
    for r in live:
        t1 = time_s(r, size)
        t0 = time_s(r, half) if half < size else 0.0
        beta = (t1 - t0) / (size - half) if half < size and t1 > t0 else t1 / size
        slope[r], fixed[r] = max(beta, 1e-12), max(t1 - max(beta, 1e-12) * size, 0.0)
    # the step T at which the lines' samples add up to the total
    step = ((total + sum(counts[r] * fixed[r] / slope[r] for r in live))
            / sum(1 / slope[r] for r in live))
    n = {r: max(least[r], int((step - counts[r] * fixed[r]) / slope[r])) for r in live}
    while sum(n.values()) > total:
        r = max((r for r in live if n[r] > least[r]), key=lambda r: load(r, n[r]))
        n[r] -= 1
    while sum(n.values()) < total:
        r = min(live, key=lambda r: load(r, n[r] + 1))
        n[r] += 1
    for _ in range(4 * len(live)):
        worst = max(live, key=lambda r: load(r, n[r]))
        if n[worst] <= least[worst]:
            break
        to = min((r for r in live if r != worst), key=lambda r: load(r, n[r] + 1),
                 default=None)
        if to is None or max(load(worst, n[worst] - 1), load(to, n[to] + 1)) \
                >= load(worst, n[worst]):
            break
        n[worst] -= 1
        n[to] += 1
    return [split_evenly(n[r], k) if k > 0 else [] for r, k in enumerate(counts)]


def _interleave(shares: Sequence[int]) -> list[int]:
    """Smooth weighted round robin: replica indices, each `shares[i]` times, spread out."""
    total = sum(shares)
    current = [0] * len(shares)
    out: list[int] = []
    for _ in range(total):
        for i, w in enumerate(shares):
            current[i] += w
        i = max(range(len(shares)), key=lambda x: (current[x], -x))
        current[i] -= total
        out.append(i)
    return out


def route_micro_batches(cluster: Cluster, stages: Sequence[StageSpec],
                        shares: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """`route[s][j]`: which of stage s's machines (an index into `StageSpec.machines`) runs
    micro-batch j of an iteration. Stage 0 deals its shares out interleaved; between two
    stages, the fastest machine pairs carry as many micro-batches as both ends' shares allow
    (so replicated pipelines keep their micro-batches on their own site), then the next
    fastest. A micro-batch's path is fixed for the iteration, so its backward retraces it."""
    bw = np.minimum(cluster.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s.T)
    first = _interleave(shares[0])
    routes: list[tuple[int, ...]] = [tuple(first)]
    for s in range(1, len(stages)):
        prev = routes[-1]
        a_ms, b_ms = stages[s - 1].machines, stages[s].machines
        if len(b_ms) == 1:
            routes.append((0,) * len(prev))
            continue
        pools: list[list[int]] = [[] for _ in a_ms]
        for j, a in enumerate(prev):
            pools[a].append(j)
        want = list(shares[s])
        pairs = sorted(((float(bw[a_ms[a], b_ms[b]]), a, b) for a in range(len(a_ms))
                        for b in range(len(b_ms))), key=lambda x: (-x[0], x[1], x[2]))
        nxt = [0] * len(prev)
        for _, a, b in pairs:
            k = min(len(pools[a]), want[b])
            for j in pools[a][:k]:
                nxt[j] = b
            del pools[a][:k]
            want[b] -= k
        routes.append(tuple(nxt))
    return tuple(routes)


_RING_EXHAUSTIVE = 7
"""Rings through up to this many machines are chosen among all orders."""


def _ring_order(bw: F64, ms: Sequence[int]) -> list[int]:
    """A ring through `ms` whose slowest link is as fast as can be found (then the most
    bandwidth in total): every order up to `_RING_EXHAUSTIVE` machines, else the greedy
    best-connected-next walk from every start."""

    def key(order: Sequence[int]) -> tuple[float, float]:
        edges = [float(bw[a, b]) for a, b in zip(order, [*order[1:], order[0]], strict=True)]
        return min(edges), sum(1.0 / e for e in edges) * -1

    if len(ms) <= 2:
        return list(ms)
    if len(ms) <= _RING_EXHAUSTIVE:
        first, rest = ms[0], ms[1:]
        return max(([first, *p] for p in itertools.permutations(rest)), key=key)
    best: list[int] | None = None
    for start in ms:
        order = [start]
        left = [m for m in ms if m != start]
        while left:
            nxt = max(left, key=lambda m: (float(bw[order[-1], m]), -m))
            order.append(nxt)
            left.remove(nxt)
        if best is None or key(order) > key(best):
            best = order
    assert best is not None
    return best


RUNTIME_TWO_LEVEL = True
"""Whether the stage runtime runs the two-level reduction (`GradientSync.time_s`;
`fusiond.train.stage.StageExecutor._two_level_sum`): the planner plans only what a stage
performs. Its inner part there is direct sends to each shard's owner and back (one message
each way, (shards - 1) / shards of the gradient out of a holder), which this model prices as
the group's ring all-reduce: no less."""


@dataclass(frozen=True)
class _Ring:
    """A ring all-reduce's time as `s_per_byte` x bytes + `fixed_s`, and its slowest link."""

    s_per_byte: float
    fixed_s: float
    slowest_bytes_per_s: float
    members: int = 0
    steps: int = 1
    """Its machines, and its messages one after another (each paying a latency)."""
    msg_s: float = 0.0
    """The part of `fixed_s` that is the machines' own handling of its messages (CPU: it
    does not overlap another reduction's, as a link's latency does)."""

    def time_s(self, nbytes: float) -> float:
        return self.s_per_byte * nbytes + self.fixed_s if nbytes > 0 else 0.0


def _ring(c: Cluster, ms: Sequence[int], homogeneous: bool = False,
          msg_ops: float = 0.0) -> _Ring:
    """An all-reduce over `ms`: each machine sends and receives 2 (n - 1) / n x the bytes at
    the speed of the slowest link of the ring (`_ring_order`) and handles them on its own CPU
    (`wire_s_per_byte`, the slowest machine's), in 2 (n - 1) steps of one message (a one-way
    latency each), as the runtime's ring (`StageExecutor._ring_flat`) runs; `homogeneous`:
    machines on links of one speed (a bandwidth group), any order. (Until 2026-12-07 a group
    was priced as halving-doubling, gloo's and MPI's 2 ceil(log2 n) steps, which the runtime
    does not run: 6 latencies for 8 machines where it pays 14.) Two machines send each
    other the whole gradient at once (`StageExecutor._exchange`, `_ring_flat`): the same
    bytes from each, in one step. Each message also costs each end `msg_ops` op dispatches
    of its own (`JobSettings.reduce_msg_ops`)."""
    n = len(ms)
    if n < 2:
        return _Ring(0.0, 0.0, math.inf)
    bw = np.minimum(c.bandwidth_bytes_per_s, c.bandwidth_bytes_per_s.T)
    ring = _ring_order(bw, ms)
    edges = list(zip(ring, ring[1:] + ring[:1], strict=True))
    slowest = min(float(bw[a, b]) for a, b in edges)
    lat = max(float(c.rtt_s[a, b]) for a, b in edges) / 2
    if homogeneous:
        slowest = min(float(bw[a, b]) for a, b in itertools.combinations(ms, 2))
        lat = max(float(c.rtt_s[a, b]) for a, b in itertools.combinations(ms, 2)) / 2
    steps = 2 * (n - 1)
    share = 2 * (n - 1) / n
    if n == 2:
        steps, share = 1, 1.0
    cpu = max(c.machines[m].wire_s_per_byte for m in ms) * 2
    msg = max(2 * c.machines[m].msg_s + msg_ops * c.machines[m].op_overhead_s
              for m in ms) * steps
    return _Ring(share * (1 / slowest + cpu), steps * lat + msg, slowest, n, steps, msg)


def sync_groups(c: Cluster, ms: Sequence[int], ratio: float = 4.0) -> list[list[int]]:
    """`ms` joined into bandwidth groups (links within `ratio` of the best link of both
    ends, among these machines)."""
    bw = np.minimum(c.bandwidth_bytes_per_s, c.bandwidth_bytes_per_s.T)
    best = {a: max((float(bw[a, b]) for b in ms if b != a), default=0.0) for a in ms}
    parent = {m: m for m in ms}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in itertools.combinations(ms, 2):
        if float(bw[a, b]) * ratio >= max(best[a], best[b]):
            parent[find(b)] = find(a)
    groups: dict[int, list[int]] = {}
    for m in ms:
        groups.setdefault(find(m), []).append(m)
    return list(groups.values())


@dataclass(frozen=True)
class GradientSync:
    """How one stage's replicas reduce their gradients: one ring, or hierarchical (a ring
    inside each bandwidth group, then one ring among the groups' first machines with the
    whole gradient; the inner all-reduce covers both the reduction and the way back)."""

    flat: _Ring
    inner: tuple[_Ring, ...]
    outer: _Ring | None

    shards: int = 1
    """Machines in the smallest group: a two-level reduction splits the gradient in this many
    shards, each all-reduced across the groups by a ring of its own."""

    def msg_s(self, scheme: str) -> float:
        """The messages' own handling (CPU) in one round of `scheme` (`_Ring.msg_s`)."""
        if scheme == "ring" or self.outer is None:
            return self.flat.msg_s
        inner = max(r.msg_s for r in self.inner)
        if scheme == "hierarchical":
            back = max((r.msg_s / r.steps for r in self.inner if r.members > 1), default=0.0)
            return inner + self.outer.msg_s + back
        return inner + self.outer.msg_s

    def time_s(self, nbytes: float) -> tuple[float, float, str]:
        """(seconds, slowest link bytes/s, scheme) for `nbytes` per replica: the fastest of
        one ring, hierarchical (an all-reduce inside each group, one among the groups' first
        replicas with the whole gradient, which then send the total to the rest of their
        group: the runtime's `_hier_sum`) and, where the runtime runs it
        (`RUNTIME_TWO_LEVEL`), two-level (reduce-scatter inside each group, each of `shards`
        shards all-reduced across the groups at once on its own machines' links, all-gather
        inside)."""
        ring_s = self.flat.time_s(nbytes)
        if self.outer is None:
            return ring_s, self.flat.slowest_bytes_per_s, "ring"
        inner_s = max(r.time_s(nbytes) for r in self.inner)
        slowest = min([self.outer.slowest_bytes_per_s,
                       *(r.slowest_bytes_per_s for r in self.inner)])
        best = (ring_s, self.flat.slowest_bytes_per_s, "ring")
        # the totals sent back: a first replica sends the gradient to every other member at
        # once, each on its own link (as every link of this model is independent)
        back_s = max((nbytes / r.slowest_bytes_per_s + r.fixed_s / r.steps
                      for r in self.inner if r.members > 1), default=0.0) if nbytes > 0 else 0.0
        hier_s = inner_s + self.outer.time_s(nbytes) + back_s
        if hier_s < best[0]:
            best = (hier_s, slowest, "hierarchical")
        if self.shards > 1 and RUNTIME_TWO_LEVEL:
            two_s = inner_s + self.outer.time_s(nbytes / self.shards)
            if two_s < best[0]:
                best = (two_s, slowest, "two-level")
        return best


def gradient_sync(c: Cluster, ms: Sequence[int], msg_ops: float = 0.0) -> GradientSync:
    """The reduction among machines `ms` (see `GradientSync`); each message costs each end
    `msg_ops` op dispatches beyond the transport's own (`JobSettings.reduce_msg_ops`)."""
    groups = sync_groups(c, ms)
    if len(groups) == 1:
        return GradientSync(_ring(c, ms, homogeneous=True, msg_ops=msg_ops), (), None)
    if all(len(g) == 1 for g in groups):
        return GradientSync(_ring(c, ms, msg_ops=msg_ops), (), None)
    return GradientSync(_ring(c, ms, msg_ops=msg_ops),
                        tuple(_ring(c, g, homogeneous=True, msg_ops=msg_ops) for g in groups),
                        _ring(c, [g[0] for g in groups], msg_ops=msg_ops),
                        shards=min(len(g) for g in groups))


BUCKET_CHOICES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""The bucket counts the evaluator weighs for a replicated stage's reduction: more hide more
of it behind the last backward; each handles its messages once more, and every
`BUCKETS_IN_FLIGHT` of them pay the scheme's latency once more."""

BUCKETS_IN_FLIGHT = 32
"""Buckets the runtime reduces at once (`fusiond.train.stage`'s constant of the same name,
interleaved on the stage's one reducer thread): their rounds wait on the links together, so
a reduction in B buckets pays its scheme's latency ceil(B / this) times per round, not B
times, while their CPU (the messages' handling, the compression) goes one bucket after
another. (One after another altogether, as the runtime went until 2026-12-07, each bucket's
round paid its own latency: on `geo`'s 60-215 ms round trips that alone kept a second site's
replicas out of every plan. A thread per bucket, tried the same day, cost 3-4x the CPU.)"""


LOWRANK_PASSES = (9.7, 2.1)
"""A low-rank (PowerSGD) round of one holder, in passes over its gradient's bytes at the
machine's memory rate (`MachineProfile.mem_bw`, bytes touched per second): a + b x rank. What
`fusiond.train.lowrank`'s P factor (gradient + error), Q factor, product and new error cost,
measured on GPT-2 mini's 19.2 MB of matrices, one thread of this Intel Xeon, three runs:
8.0-8.4 ms at rank 1, 12.5-14 ms at rank 4, 17.8-19 ms at rank 8 (11.3-12.1, 17.6-20.9 and
26.1-27.4 passes; a copy of the same bytes is 2). Before the product went to float64 by
row blocks, the error was rebuilt in place and the product written into the holder's own
gradient (no new pages), it was 18.8 and 46.6 passes at ranks 1 and 4 (9.5 + 9.3 x rank):
the rank's outer products, added one after another in float32, were most of it. The model
counted 3 passes and 4 FLOPs per byte before either: a fifth of the first, which left the
replicas' reduction on the WAN's 0.4-core hosts 0.1 s per step short."""


def lowrank_s_per_byte(mem_bw: float, rank: int) -> float:
    """Seconds per gradient byte one holder spends compressing at `rank` (`LOWRANK_PASSES`)."""
    a, b = LOWRANK_PASSES
    return (a + b * max(1, rank)) / mem_bw


def reduction_s(sync: GradientSync, grad_bytes: float, density: float, buckets: int,
                extra_s_per_byte: float) -> float:
    """A reduction's time: its bytes (`density` of `grad_bytes`), its scheme's latency once
    per round of every `BUCKETS_IN_FLIGHT` buckets (the runtime reduces that many at once;
    low-rank ones in two rounds each, the P factors then the Q factors), each bucket's round's
    messages handled, plus, compressed, the compression's own work (`extra_s_per_byte` of
    the dense bytes)."""
    t_s, _, scheme = sync.time_s(grad_bytes * density)
    fixed_s = sync.time_s(1.0)[0]
    msg_s = sync.msg_s(scheme)
    per_bucket = 2 if density < 1.0 else 1
    waves = math.ceil(max(1, buckets) / BUCKETS_IN_FLIGHT)
    t_s += (waves * per_bucket - 1) * (fixed_s - msg_s)
    t_s += (buckets * per_bucket - 1) * msg_s
    if density < 1.0:
        t_s += extra_s_per_byte * grad_bytes
    return t_s


def _sync_density(sync: GradientSync, grad_bytes: float, overlap_s: float, floor: float,
                  extra_s_per_byte: float, buckets: int = 1) -> float:
    """The largest share of the gradient bytes (>= `floor`) whose reduction
    (`reduction_s`) hides behind `overlap_s`; `floor` when none does; 1.0 (dense) when the
    dense reduction hides, or when even the floor would take longer than dense."""
    dense_s = reduction_s(sync, grad_bytes, 1.0, buckets, extra_s_per_byte)
    if dense_s <= overlap_s or floor >= 1.0:
        return 1.0

    def cost(d: float) -> float:
        return reduction_s(sync, grad_bytes, min(d, 1.0 - 1e-12), buckets, extra_s_per_byte)

    if cost(floor) >= dense_s:
        return 1.0  # latency-bound: the second round costs more than the bytes it saves
    if cost(floor) >= overlap_s:
        return floor
    lo, hi = floor, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if cost(mid) <= overlap_s:
            lo = mid
        else:
            hi = mid
    return lo


def round_trip_s(busy: Sequence[float], hops_s: Sequence[float]) -> list[float]:
    """Per stage i, one micro-batch's round trip from its forward on stage i to its backward
    there: every later stage's forward and backward (`busy`, the slowest machine of each)
    and every hop after i both ways (`hops_s[k]`: k -> k + 1 and back, transfers, RTT and
    wake-ups)."""
    out = [0.0] * len(busy)
    acc = 0.0
    for i in range(len(busy) - 1, -1, -1):
        acc += busy[i] + (hops_s[i] if i < len(hops_s) else 0.0)
        out[i] = acc
    return out


def latency_rest_s(micro_batches: int, in_flight: int, trip_s: float, busy_s: float) -> float:
    """What a stage of 1F1B spends past its first micro-batch's round trip, bound by the
    round trips rather than its compute: its last micro-batch starts after
    k = (m - 1) // w full round trips and j = (m - 1) % w of its own tasks (a forward and a
    backward each, in the steady phase) after the start of the last round. Compare with
    (m - 1) x the bottleneck, the throughput bound (the larger one holds)."""
    if micro_batches <= 1 or in_flight <= 0:
        return 0.0
    k, j = divmod(micro_batches - 1, in_flight)
    return k * trip_s + j * busy_s if k else 0.0


def choose_in_flight(reps: list[list[StageReport]], trips_s: Sequence[float],
                     bound_s: float, saved_bytes: Sequence[float]
                     ) -> tuple[list[list[StageReport]], tuple[float, str]]:
    """1F1B's micro-batches in flight per stage: the schedule's min(m, S - i), raised on a
    stage of one machine that keeps all of its micro-batch's activations (no recompute, no
    checkpointed blocks, weights in memory) until its round trip hides behind its tasks,
    `latency_rest_s` <= `bound_s` (the throughput bound), or its memory is full; never more
    than the stage before it holds (the schedule stays deadlock-free,
    `fusiond.train.schedule`). Returns the reports with `inflight` and `memory_bytes` as
    chosen, and the largest round-trip bound left with the stage it is on."""
    out: list[list[StageReport]] = []
    worst, where = 0.0, ""
    above = max((r.micro_batches for row in reps for r in row), default=0)
    for i, row in enumerate(reps):
        new_row = []
        for rep in row:
            w = rep.inflight
            per_mb = saved_bytes[i]
            plain = (not rep.recompute and not rep.checkpoint_blocks
                     and not rep.offload_params and len(row) == 1)
            if plain and w < min(rep.micro_batches, above):
                room = rep.memory_cap - rep.memory_bytes
                top = min(rep.micro_batches, above,
                          w + (int(room // per_mb) if per_mb > 0 else rep.micro_batches))
                while w < top and latency_rest_s(rep.micro_batches, w, trips_s[i],
                                                 rep.busy_s) > bound_s:
                    w += 1
                if w != rep.inflight:
                    rep = dataclasses.replace(
                        rep, inflight=w,
                        memory_bytes=rep.memory_bytes + (w - rep.inflight) * per_mb)
            new_row.append(rep)
            got = latency_rest_s(rep.micro_batches, rep.inflight, trips_s[i], rep.busy_s)
            if got > worst:
                worst = got
                where = (f"round trip from {rep.machine_id} ({rep.inflight} micro-batches "
                         "in flight)")
        above = min(above, max(r.inflight for r in new_row))
        out.append(new_row)
    return out, (worst, where)


def evaluate(
    arrays: GraphArrays,
    stages: Sequence[StageSpec],
    densities: Mapping[tuple[str, int], float] | None = None,
    encodings: Mapping[tuple[str, int], EdgeEncoding] | None = None,
) -> Evaluation:
    """Predict iteration time, per-stage/per-link times and memory of `stages`.

    `stages` must cover ops [0, n) contiguously, in order, no machine in two places.
    `densities[(tensor, dst_stage)]` < 1 sends that tensor top-k compressed to that stage;
    `encodings[(tensor, dst_stage)]` sends it so encoded (else `settings.edge_encoding`).
    A stage with replicas splits the micro-batches (`micro_batch_shares`, by compute time),
    routes them (`route_micro_batches`) and reduces its gradients (`gradient_sync`). With
    `JobSettings.sized_micro_batches`, a one-stage plan's replicas also take micro-batches of
    their own sizes (`sized_shares`) where that is faster and fits.
    """
    st = arrays.settings
    if st.sized_micro_batches and len(stages) == 1 and stages[0].replicas \
            and st.num_micro_batches > 1:
        # (larger micro-batches may not fit where the job's size does: then that one)
        sized = _evaluate(arrays, stages, densities, encodings, sized=True)
        if sized.feasible and not any(r.recompute or r.offload or r.checkpoint_blocks
                                      for r in sized.replicas):
            return sized
    return _evaluate(arrays, stages, densities, encodings, sized=False)


def _evaluate(
    arrays: GraphArrays,
    stages: Sequence[StageSpec],
    densities: Mapping[tuple[str, int], float] | None,
    encodings: Mapping[tuple[str, int], EdgeEncoding] | None,
    *,
    sized: bool,
) -> Evaluation:
    g, c, st = arrays.graph, arrays.cluster, arrays.settings
    n = arrays.n
    if not stages or stages[0].start != 0 or stages[-1].stop != n:
        raise PlanError("stages must cover all ops")
    for prev, nxt in itertools.pairwise(stages):
        if prev.stop != nxt.start or nxt.start >= nxt.stop:
            raise PlanError("stages must be contiguous and non-empty")
    every = [m for s in stages for m in s.machines]
    if len(set(every)) != len(every):
        raise PlanError("a machine may run only one stage")
    dens = densities or {}
    encs = encodings or {}
    S = len(stages)
    M = st.num_micro_batches
    b = st.micro_batch_size
    replicated = any(s.replicas for s in stages)
    stage_of = np.empty(n, dtype=np.int64)
    for i, s in enumerate(stages):
        stage_of[s.start : s.stop] = i

    computes = [[float(arrays.prefix[m, s.stop] - arrays.prefix[m, s.start]) for m in s.machines]
                for s in stages]
    shares = [micro_batch_shares(cs, M) if len(cs) > 1 else [M] for cs in computes]
    routes = route_micro_batches(c, stages, shares) if replicated else None
    # (one stage) each replica's micro-batch sizes where they are its own, and its mean time
    own_sizes: list[tuple[int, ...]] = [() for _ in stages[0].machines]
    fwds = [[float(arrays.prefix_f[m, s.stop] - arrays.prefix_f[m, s.start])
             for m in s.machines] for s in stages]
    if sized:
        s0 = stages[0]

        def at(r: int, x: int) -> tuple[float, float]:
            return arrays.stage_s_at(s0.machines[r], s0.start, s0.stop, x)

        for r, parts in enumerate(sized_shares(lambda r, x: at(r, x)[0], shares[0], M * b)):
            if parts and any(x != b for x in parts):
                own_sizes[r] = tuple(parts)
                computes[0][r] = sum(at(r, x)[0] for x in parts) / len(parts)
                fwds[0][r] = sum(at(r, x)[1] for x in parts) / len(parts)

    reps: list[list[StageReport]] = []
    over: list[str] = []
    unrunnable: list[str] = []
    holders: dict[str, list[int]] = {}
    opt_s = 0.0
    sizes = graph_param_sizes(g)
    grad_bytes: list[float] = []
    n_params: list[int] = []
    saved_per_stage: list[float] = []
    for i, s in enumerate(stages):
        params, opt, names = _stage_static(g, s.start, s.stop)
        grad_bytes.append(params)
        n_params.append(len(names) or max(BUCKET_CHOICES))  # unnamed: no per-tensor bound
        for p in names:
            holders.setdefault(p, []).append(i)
        saved = float(arrays.saved[s.start : s.stop].sum())
        saved_per_stage.append(saved)
        work = float(arrays.out[s.start : s.stop].max())
        row: list[StageReport] = []
        for r, mi in enumerate(s.machines):
            m = c.machines[mi]
            mb = shares[i][r]
            inflight = mb if st.schedule == "gpipe" else min(mb, S - i)
            bucket = exchange_bytes(params, len(s.machines))
            cap = float(arrays.caps[mi])
            # activations grow with its largest micro-batch where it has sizes of its own
            grow = max(own_sizes[r]) / b if i == 0 and own_sizes[r] else 1.0
            saved_r, work_r = saved * grow, work * grow
            kept = inflight * float(arrays.in_bytes[s.start]) * grow + saved_r
            fwd_s = fwds[i][r]
            disk_s = 2 * opt / m.disk_rate_bytes_per_s
            # plain, then the cheapest of recompute (a forward per micro-batch), offload (the
            # state through the disk once per step), both, that fits
            options = [(0.0, False, False)]
            if st.recompute and kept < inflight * saved:
                options.append((mb * fwd_s, True, False))
            disk_ok = st.offload and m.device == "cpu"  # a GPU stage keeps its state on it
            if disk_ok and 0 < opt <= m.disk_room_bytes:
                options.append((disk_s, False, True))
                if st.recompute and kept < inflight * saved:
                    options.append((mb * fwd_s + disk_s, True, True))

            # the first replica's snapshot of its weights, while it is sent (JobSettings)
            snap = params if st.snapshots and r == 0 else 0.0
            need = {(rc, off): (2 * params + (0.0 if off else opt)
                                + (kept if rc else inflight * saved_r) + work_r + bucket
                                + snap)
                    for _, rc, off in options}
            fits = [o for o in options if need[(o[1], o[2])] <= cap]
            cost, recompute, offload = (min(fits) if fits
                                        else min(options, key=lambda o: need[(o[1], o[2])]))
            mem = need[(recompute, offload)]
            blockwise: MemoryChoice | None = None
            if (st.recompute or disk_ok) and (cost > 0 or mem > cap):
                # per block (AutoHete): which blocks to checkpoint, and the weights on disk
                # as a last resort, where that fits or costs less than the stage-wide choice
                blocks, _ = stage_blocks(arrays, mi, s.start, s.stop)
                got = plan_stage_memory(
                    blocks, budget_bytes=cap - bucket - snap, micro_batches=mb,
                    inflight=inflight,
                    disk_bytes_per_s=m.disk_rate_bytes_per_s, workspace_bytes=work,
                    allow_recompute=st.recompute, allow_offload=disk_ok,
                    allow_param_offload=disk_ok and st.offload_params,
                    disk_room_bytes=m.disk_room_bytes)
                if got.fits and (mem > cap or got.added_s < cost):
                    blockwise = got
            micro_s, step_s = (fwd_s if recompute else 0.0), (disk_s if offload else 0.0)
            if blockwise is not None:
                recompute, offload = False, blockwise.offload_optimizer
                mem = blockwise.peak_bytes + bucket + snap
                micro_s, step_s = blockwise.per_micro_s, blockwise.per_step_s
            computes[i][r] += micro_s
            if mem > cap:
                over.append(m.id)
            if not arrays.stage_runs(mi, s.start, s.stop):
                lacks = arrays.missing_ops(mi, s.start, s.stop)
                unrunnable.append(f"{m.id}: {', '.join(lacks)}")
            opt_s = max(opt_s, params * st.optimizer_passes / m.mem_bw + step_s)
            row.append(StageReport(
                i, mi, m.id, s.start, s.stop, g.ops[s.start].name, g.ops[s.stop - 1].name,
                computes[i][r], mem, cap, inflight, replica=r, micro_batches=mb,
                recompute=recompute, offload=offload,
                checkpoint_blocks=blockwise.checkpoint_blocks if blockwise else (),
                offload_params=blockwise.offload_params if blockwise else False,
                sizes=own_sizes[r] if i == 0 else (),
            ))
        reps.append(row)

    # route every tensor directly to each later stage that reads it
    traffic: dict[tuple[int, int], list[float]] = {}
    names_on: dict[tuple[int, int], list[str]] = {}
    codecs_on: dict[tuple[int, int], set[str]] = {}
    for t in g.tensors if S > 1 else ():  # one stage cuts no tensor
        ps = int(stage_of[t.src])
        for ds in sorted({int(stage_of[d]) for d in t.dsts} - {ps}):
            d = dens.get((t.name, ds), 1.0)
            f, bk = wire_bytes(t, b, d, st, encs.get((t.name, ds)))
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
            if t.compressible and t.name not in st.exact_edges and d >= 1.0:
                enc = encs.get((t.name, ds), st.edge_encoding)
                if enc != "raw":
                    codecs_on.setdefault((ps, ds), set()).add(enc)
    links: list[LinkReport] = []
    for (ps, ds), (f, bk, df, db, dmin, nf, nb) in sorted(traffic.items()):
        labels = sorted(codecs_on.get((ps, ds), ()))
        if dmin < 1.0:
            labels.insert(0, f"top-k {dmin:.3g}")
        codec = "+".join(labels) or "exact"
        if routes is None:
            pair_counts = {(0, 0): M}
        else:
            pair_counts = {}
            for ra, rz in zip(routes[ps], routes[ds], strict=True):
                pair_counts[(ra, rz)] = pair_counts.get((ra, rz), 0) + 1
        for (ra, rz), count in sorted(pair_counts.items()):
            a, z = stages[ps].machines[ra], stages[ds].machines[rz]
            fwd_bytes_per_s = float(c.bandwidth_bytes_per_s[a, z])
            bwd_bytes_per_s = float(c.bandwidth_bytes_per_s[z, a])
            t_link = max(f / fwd_bytes_per_s, bk / bwd_bytes_per_s)
            links.append(LinkReport(
                ps, ds, a, z, f, bk, df, db, fwd_bytes_per_s, bwd_bytes_per_s,
                float(c.rtt_s[a, z]), t_link, tuple(names_on[(ps, ds)]), dmin, nf, nb,
                micro_batches=count, codec=codec,
            ))

    # a stage's host also pays for every byte it sends and receives (encoding, TLS, socket
    # copies): on a small CPU share that is time the stage is not computing
    handled: dict[int, float] = {}
    for lk in links:
        for end in (lk.src, lk.dst):
            pm = c.machines[end]
            handled[end] = handled.get(end, 0.0) + lk.micro_batches * (
                (lk.fwd_bytes + lk.bwd_bytes) * pm.wire_s_per_byte
                + (lk.fwd_msgs + lk.bwd_msgs) * pm.msg_s)
    reps = [[dataclasses.replace(r, wire_cpu_s=handled.get(r.machine, 0.0)
                                 / max(r.micro_batches, 1)) for r in row] for row in reps]
    reports = [row[0] for row in reps]
    flat = [r for row in reps for r in row]

    # every resource's load over the iteration, less the one micro-batch the fill counts
    def rest(load_s: float, unit_s: float) -> float:
        return max(load_s - unit_s, 0.0)

    active = [r for r in flat if r.micro_batches > 0]
    compute_b = max(r.micro_batches * r.busy_s for r in active) / M
    # the fill: one micro-batch through every stage (its slowest busy machine) and link
    busy = [max((r.busy_s for r in row if r.micro_batches > 0), default=0.0) for row in reps]
    fill = sum(busy)
    per_pair: dict[tuple[int, int], float] = {}
    for lk in links:
        key = (lk.src_stage, lk.dst_stage)
        per_pair[key] = max(per_pair.get(key, 0.0), lk.fill_s)
    fill += sum(per_pair.values())
    # Each resource's load after its first micro-batch, plus the fill with that micro-batch
    # in its stage's (or machine pair's) place: a replica faster than its stage's slowest
    # takes more micro-batches, so its own unit, not the slowest one's, is in its path.
    # (Charging every resource the slowest replica's unit overstated a heterogeneous data
    # parallel step by up to that unit: 13 % for GPT-2 small on 24 A100s and RTX 3090s.)
    bottleneck_rest, bottleneck = -math.inf, ""
    for rep in active:
        x = rest(rep.micro_batches * rep.busy_s, rep.busy_s) + rep.busy_s - busy[rep.index]
        if x >= bottleneck_rest:
            bottleneck_rest, bottleneck = x, f"compute {rep.machine_id}"
    bottleneck_s = compute_b
    for lk in links:
        x = (rest(lk.micro_batches * lk.time_s, lk.time_s)
             + lk.fill_s - per_pair[(lk.src_stage, lk.dst_stage)])
        if x > bottleneck_rest:
            bottleneck_rest = x
            bottleneck = f"link {c.machines[lk.src].id}->{c.machines[lk.dst].id}"
        bottleneck_s = max(bottleneck_s, lk.micro_batches * lk.time_s / M)

    def hop(i: int) -> tuple[float, float]:
        """(round trip, wake-ups forward and backward) of the hop from stage i to i + 1."""
        a_ms, z_ms = stages[i].machines, stages[i + 1].machines
        rtt = max(float(c.rtt_s[a, z]) for a in a_ms for z in z_ms)
        wake = 2 * (max(c.machines[a].wake_s for a in a_ms)
                    + max(c.machines[z].wake_s for z in z_ms))
        return rtt, wake

    hops = [hop(i) for i in range(S - 1)]
    fill += sum(r + w for r, w in hops)

    # 1F1B's round trips: stage i keeps w_i micro-batches in flight, so its micro-batch
    # m + w_i starts only once m's backward is back from the last stage. Where that round
    # trip (`round_trip_s`) is longer than w_i of the stage's own tasks, the stage waits on
    # it, whatever the bottleneck: a latency-bound pipeline. The plan raises w_i where the
    # stage's memory holds the extra micro-batches' activations (`choose_in_flight`).
    if st.schedule == "1f1b" and S > 1:
        trips = round_trip_s(busy, [per_pair.get((i, i + 1), 0.0) + r + w
                                    for i, (r, w) in enumerate(hops)])
        reps, waits = choose_in_flight(reps, trips, bottleneck_rest, saved_per_stage)
        reports = [row[0] for row in reps]
        flat = [r for row in reps for r in row]
        if waits[0] > bottleneck_rest:
            bottleneck_rest = waits[0]
            bottleneck = waits[1]
    sync = _tied_sync(arrays, stages, reports, links, holders, sizes)

    # replicas reduce their gradients after their last backward (the stage runtime's
    # `_reduce_shared`, at the end of the step): that hides behind the drain of the stages
    # before it (their last backward, its link and hop), not behind its own last backward,
    # which is over by then. A single stage of replicas (data parallel) hides nothing.
    syncs: list[SyncReport] = []
    back = [max(busy[i] - max(fwds[i]), 0.0) for i in range(S)]
    bwd_link = [0.0] * S
    for lk in links:
        if lk.dst_stage == lk.src_stage + 1:
            bwd_link[lk.src_stage] = max(bwd_link[lk.src_stage],
                                         lk.bwd_bytes / lk.bandwidth_bwd_bytes_per_s)
    for i, s in enumerate(stages):
        if not s.replicas:
            continue
        plan_sync = arrays.gradient_sync(s.machines)
        drain = sum(back[j] + bwd_link[j] + hops[j][0] / 2 for j in range(i))
        # compressing costs each replica passes over its gradient (error feedback, the
        # projections, the reconstruction) that grow with the rank
        compress_s_per_byte = max(lowrank_s_per_byte(c.machines[m].mem_bw, st.grad_rank)
                                  for m in s.machines)
        # the reduction goes by B buckets (the plan chooses B, the runtime splits the
        # gradients so), each started once ready and up to `BUCKETS_IN_FLIGHT` in flight at
        # once; during the stage's own last backward where the runtime does that, bucket k
        # ready (k + 1) / B into it, so all but the last one's share of it hides them
        # (`SyncReport.exposed_s`)
        can_overlap = st.reduce_in_backward and not any(r.offload_params for r in reps[i])
        counts = sorted({min(b, n_params[i]) for b in BUCKET_CHOICES}) if can_overlap else [1]
        # on CPU machines the replicas' own handling of the bytes (and compression) takes the
        # cores their backward runs on: only the wait on the links hides behind it
        on_cpu = all(c.machines[m].device == "cpu" for m in s.machines)
        n = len(s.machines)
        wire = max(c.machines[m].wire_s_per_byte for m in s.machines)
        choices = []
        for buckets in counts:
            hide_s = drain + back[i] * (buckets - 1) / buckets
            for dense_only in (True, False):
                d = 1.0 if dense_only else _sync_density(
                    plan_sync, grad_bytes[i], hide_s, st.grad_density_floor,
                    compress_s_per_byte, buckets)
                _, slowest, scheme = plan_sync.time_s(grad_bytes[i] * d)
                t_s = reduction_s(plan_sync, grad_bytes[i], d, buckets, compress_s_per_byte)
                # the last bucket, after the backward: its bytes, rounds and compression
                tail_s = reduction_s(plan_sync, grad_bytes[i] / buckets, d, 1,
                                     compress_s_per_byte)
                cpu_s = 0.0
                if on_cpu:  # the bytes, the compression and every message's handling
                    cpu_s = 4 * (n - 1) / n * grad_bytes[i] * d * wire + (
                        compress_s_per_byte * grad_bytes[i] if d < 1.0 else 0.0) + (
                        buckets * (2 if d < 1.0 else 1) * plan_sync.msg_s(scheme))
                choices.append(SyncReport(i, tuple(c.machines[m].id for m in s.machines),
                                          grad_bytes[i], scheme, slowest, t_s, hide_s,
                                          density=d, buckets=buckets, drain_s=drain,
                                          cpu_s=min(cpu_s, t_s), tail_s=tail_s))
        syncs.append(min(choices, key=lambda x: (x.exposed_s, x.buckets, -x.density)))
    grad_sync = max((x.exposed_s for x in syncs), default=0.0)
    iteration = bottleneck_rest + fill + opt_s + sync + grad_sync
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
        replicas=tuple(flat),
        syncs=tuple(syncs),
        grad_sync_s=grad_sync,
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
    encodings: Mapping[tuple[str, int], EdgeEncoding] = dataclasses.field(default_factory=dict)
    """(tensor name, destination stage) -> the encoding the per-link codec choice gave that
    cut edge (`fusiond.plan.codecs`; absent: dense, or top-k at `densities`)."""

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
        """Stage index -> machine id (its first machine, with replicas)."""
        ids = self.arrays.cluster.ids()
        return [ids[s.machine] for s in self.stages]

    def routes(self) -> dict[int, tuple[int, ...]]:
        """Replicated stage -> which of its machines (0: `StageSpec.machine`, then its
        replicas) runs each micro-batch of an iteration (`route_micro_batches` on the
        evaluation's shares)."""
        if not any(s.replicas for s in self.stages):
            return {}
        shares = [[r.micro_batches for r in self.evaluation.replicas if r.index == i]
                  for i in range(len(self.stages))]
        routes = route_micro_batches(self.arrays.cluster, self.stages, shares)
        return {i: routes[i] for i, s in enumerate(self.stages) if s.replicas}

    def micro_batch_sizes(self) -> tuple[int, ...]:
        """The samples of each micro-batch of an iteration, where the replicas take sizes of
        their own (`JobSettings.sized_micro_batches`; they add up to the global batch); ()
        where every micro-batch has the job's size. Replica r's sizes go to the micro-batches
        `routes()` gives it, in order."""
        reps = [r for r in self.evaluation.replicas if r.index == 0]
        if len(self.stages) != 1 or not any(r.sizes for r in reps):
            return ()
        b = self.arrays.settings.micro_batch_size
        left = [list(r.sizes or (b,) * r.micro_batches) for r in reps]
        return tuple(left[r].pop(0) for r in self.routes()[0])

    def edge_densities(self) -> dict[str, float]:
        """Compressed cut edges by `fusiond.graph.partition.Edge.id` (`"<value>-><dst stage>"`)
        -> density; edges not listed travel dense."""
        return {f"{name}->{dst}": d for (name, dst), d in self.densities.items()}

    def edge_encodings(self) -> dict[str, EdgeEncoding]:
        """Cut edges the codec choice quantized, by `Edge.id` -> encoding."""
        return {f"{name}->{dst}": e for (name, dst), e in self.encodings.items()}

    def value_densities(self) -> dict[str, float]:
        """Per value (`Edge.value`), the lowest density over its destinations (for
        `fusiond.graph.driver.Driver(topk=...)`, which takes one density per value)."""
        out: dict[str, float] = {}
        for (name, _dst), d in self.densities.items():
            out[name] = min(d, out.get(name, 1.0))
        return out
