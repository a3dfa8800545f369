"""The yardsticks of bench/plan.py: what a competent user would run instead of OP-Fence.

Every system here is scored with the planner's own cost model (`fusiond.plan.pipeline.evaluate`,
the function OP-Fence's plans are scored with), at the same fixed global batch, over the same
micro-batch sizes, so a ratio between two rows compares plans, not models. docs/planner.md
("Benchmark baselines") has the reasoning; this module is pure (no torch, no I/O).

- (a) `best_single`: every machine alone (gradient accumulation over the global batch), memory
  permitting.
- (b) `even_split`: equal blocks per stage at block boundaries (GPipe's and
  torch.distributed.pipelining's split), 1F1B, over 2..min(machines, blocks) stages, on the
  machine subsets and orders a competent user picks: every ordered subset on a small cluster,
  else prefixes of site chains (fastest machines of a site first, the next site the one best
  connected to the last) and the fastest machines arranged along those chains.
- (c) `block_placement`: contiguous blocks (and the embedding and head as their own units)
  placed to minimise the bottleneck, a stage's time being the larger of its compute and its
  incoming link (Petals' server throughput, min of compute and network), over machines grouped
  by similar bandwidth and ordered as an open path through the groups (DT-FM's pipeline order).
- (f) `data_parallel`: DDP with its PowerSGD hook (low-rank gradients with error feedback, at
  the workload's gradient density floor, dense where the reduction hides behind the last
  backward anyway): the whole model on each of the k fastest machines that hold it, for every
  k in the planner's replica sizes and all of them, the one ring or hierarchical all-reduce
  the planner's model costs.
- (d), (e): OP-Fence dense and OP-Fence + AdaTopK (`fusiond.plan.plan_opfence`), one machine
  per stage; (g) OP-Fence with replicas (`plan_opfence(replicate=True)`): pipelines, data
  parallelism and their mixes searched as one space.

`fraction_of_aggregate_compute`: a plan's samples/s over the sum of what each machine reaches
alone (same model, same global batch, best micro-batch, memory not checked: the cluster's
compute, what the later data-parallel planner is measured against).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fusiond.plan import (
    Cluster,
    CostGraph,
    Evaluation,
    GraphArrays,
    JobSettings,
    PlanError,
    StageSpec,
    evaluate,
    plan_opfence,
)
from fusiond.plan.fence import REPLICA_SET_SIZES
from fusiond.plan.model import REDUCE_MSG_OPS

#: clusters up to this many machines get every ordered machine subset (6: 1956 orders)
EXHAUSTIVE_MACHINES = 6
#: machines share a bandwidth group when their link is within this factor of both ends' best
GROUP_RATIO = 4.0
#: groups up to this many get an exhaustive open-path (TSP) order from every start group
TSP_GROUPS = 7
#: OP-Fence "must never plan worse than a baseline in its own search space": equal within this
REL_TOL = 1e-9

SYSTEMS: tuple[tuple[str, str], ...] = (
    ("single", "(a) best single machine"),
    ("even", "(b) even block split"),
    ("placement", "(c) bandwidth-aware block placement"),
    ("opfence", "(d) OP-Fence"),
    ("opfence+adatopk", "(e) OP-Fence + AdaTopK"),
    ("ddp", "(f) DDP + PowerSGD"),
    ("opfence+replicas", "(g) OP-Fence with replicas"),
)
BASELINES: frozenset[str] = frozenset({"single", "even", "placement", "ddp"})


@dataclass(frozen=True)
class Workload:
    """A model at a fixed global batch, with the micro-batch sizes every system may pick from.

    `graphs[b]`: the cost graph evaluated at micro-batch `b` (every `b` divides
    `global_batch`; one optimizer step = `global_batch // b` micro-batches). `block_bounds`:
    the op positions where each block (a transformer block, a ResNet bottleneck) starts, then
    where the last one ends; ops before the first block (embeddings, the stem) and after the
    last (final norm, head, loss) are the pre and post segments.
    """

    name: str
    global_batch: int
    graphs: Mapping[int, CostGraph]
    block_bounds: tuple[int, ...]
    grad_density_floor: float = 1.0
    """What a replicated stage's gradient reduction may shrink to (`JobSettings`); the same
    for DDP's PowerSGD hook and OP-Fence's replicas."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or not self.graphs:
            raise PlanError(f"workload {self.name!r}: needs a global batch and a micro-batch")
        sizes = {len(g.ops) for g in self.graphs.values()}
        if len(sizes) != 1:
            raise PlanError(f"workload {self.name!r}: the cost graphs differ in op count")
        for b in self.graphs:
            if b < 1 or self.global_batch % b:
                raise PlanError(f"workload {self.name!r}: micro-batch {b} does not divide the "
                                f"global batch {self.global_batch}")
        bb = self.block_bounds
        n = sizes.pop()
        if len(bb) < 2 or any(y <= x for x, y in itertools.pairwise(bb)) or bb[0] < 0 \
                or bb[-1] > n:
            raise PlanError(f"workload {self.name!r}: block bounds {bb} must increase within "
                            f"[0, {n}] and name at least one block")

    @property
    def micro_batches(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs))

    @property
    def n_ops(self) -> int:
        return len(next(iter(self.graphs.values())).ops)

    @property
    def blocks(self) -> int:
        return len(self.block_bounds) - 1

    def settings(self, micro_batch_size: int, fusion: bool = False) -> JobSettings:
        """The job's settings at this micro-batch size. Replicas as fusion's runtime runs
        them (`fusion`): a one-stage plan's replicas may take micro-batches of their own
        sizes, and each message of their reduction costs its Python reducer's handling
        (`REDUCE_MSG_OPS`); else as DDP runs them: one batch size per rank, collectives in
        C++ (the transport's cost per message only)."""
        return JobSettings(micro_batch_size=micro_batch_size,
                           num_micro_batches=self.global_batch // micro_batch_size,
                           grad_density_floor=self.grad_density_floor,
                           sized_micro_batches=fusion,
                           reduce_msg_ops=REDUCE_MSG_OPS if fusion else 0.0)

    def units(self) -> tuple[int, ...]:
        """Boundaries of the placement units: the pre segment, each block, the post segment
        (an empty segment is left out)."""
        return tuple(sorted({0, *self.block_bounds, self.n_ops}))


@dataclass(frozen=True)
class Found:
    stages: tuple[StageSpec, ...]
    evaluation: Evaluation


@dataclass(frozen=True)
class Outcome:
    """One system's best plan over the micro-batch sizes (`found` None: nothing fits)."""

    system: str
    label: str
    found: Found | None
    micro_batch_size: int
    planning_s: float
    machine_ids: tuple[str, ...]
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.found is not None

    @property
    def samples_per_s(self) -> float:
        return self.found.evaluation.samples_per_s if self.found else 0.0

    @property
    def machines_used(self) -> int:
        return sum(len(s.machines) for s in self.found.stages) if self.found else 0


Search = Callable[[GraphArrays, Workload], Found | None]


def _best(arrays: GraphArrays, candidates: Iterable[Sequence[StageSpec]]) -> Found | None:
    """The feasible candidate with the most samples/s (the first one on a tie)."""
    best: Found | None = None
    for stages in candidates:
        ev = evaluate(arrays, stages)
        if ev.feasible and (best is None or ev.samples_per_s > best.evaluation.samples_per_s):
            best = Found(tuple(stages), ev)
    return best


def single_machine(arrays: GraphArrays, workload: Workload) -> Found | None:
    """(a) The whole model on one machine, for every machine; None when it fits none."""
    n = arrays.n
    return _best(arrays, ([StageSpec(m, 0, n)] for m in range(len(arrays.cluster))))


def bandwidth_groups(cluster: Cluster, ratio: float = GROUP_RATIO) -> list[list[int]]:
    """Machines joined when their link (the slower direction) is within `ratio` of the best
    link of both ends: sites, as a user who knows the network would draw them."""
    k = len(cluster)
    bw = np.minimum(cluster.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s.T).astype(float)
    np.fill_diagonal(bw, 0.0)
    best = bw.max(axis=1) if k > 1 else np.zeros(1)
    parent = list(range(k))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in range(k):
        for j in range(i + 1, k):
            if bw[i, j] * ratio >= max(best[i], best[j]):
                parent[find(j)] = find(i)
    groups: dict[int, list[int]] = {}
    for i in range(k):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def machine_sequences(arrays: GraphArrays) -> list[list[int]]:
    """Machine orders a competent user would try: bandwidth groups chained from every start
    group, by the best-connected next group (greedy) and by the open path of least total
    1/bandwidth (DT-FM's TSP; exhaustive up to `TSP_GROUPS` groups); in a group, the fastest
    machine first (then the larger memory)."""
    cluster = arrays.cluster
    groups = bandwidth_groups(cluster)
    alone_s = arrays.prefix[:, -1]
    ordered = [sorted(g, key=lambda m: (float(alone_s[m]), -float(arrays.caps[m]), m))
               for g in groups]
    G = len(groups)
    bw = np.minimum(cluster.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s.T)
    gbw = np.array([[float(np.mean(bw[np.ix_(groups[x], groups[y])])) if x != y else math.inf
                     for y in range(G)] for x in range(G)])
    gspeed = [sum(1.0 / max(float(alone_s[m]), 1e-300) for m in g) for g in groups]
    paths: list[tuple[int, ...]] = []

    def cost(p: tuple[int, ...]) -> float:
        return sum(1.0 / float(gbw[x, y]) for x, y in itertools.pairwise(p))

    for start in range(G):
        chain = [start]
        while len(chain) < G:
            rest = [y for y in range(G) if y not in chain]
            chain.append(max(rest, key=lambda y: (gbw[chain[-1], y], gspeed[y], -y)))
        paths.append(tuple(chain))
        if 2 < G <= TSP_GROUPS:
            others = [y for y in range(G) if y != start]
            paths.append(min(((start, *p) for p in itertools.permutations(others)), key=cost))
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for p in paths:
        seq = tuple(m for g in p for m in ordered[g])
        if seq not in seen:
            seen.add(seq)
            out.append(list(seq))
    return out


def _subsets(arrays: GraphArrays, size: int, seqs: Sequence[Sequence[int]]
             ) -> list[list[int]]:
    """Ordered machine subsets of `size` to try: all of them on a small cluster, else each
    sequence's prefix and its `size` fastest machines in the sequence's order."""
    K = len(arrays.cluster)
    if K <= EXHAUSTIVE_MACHINES:
        return [list(p) for p in itertools.permutations(range(K), size)]
    alone_s = arrays.prefix[:, -1]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for seq in seqs:
        pos = {m: i for i, m in enumerate(seq)}
        fastest = sorted(sorted(seq, key=lambda m: (float(alone_s[m]), pos[m]))[:size],
                         key=lambda m: pos[m])
        for sub in (tuple(seq[:size]), tuple(fastest)):
            if len(sub) == size and sub not in seen:
                seen.add(sub)
                out.append(list(sub))
    return out


def even_stages(seq: Sequence[int], block_bounds: Sequence[int], n_ops: int) -> list[StageSpec]:
    """Blocks dealt evenly over `seq` (the first `blocks % stages` stages get one more, as
    numpy.array_split and torch.tensor_split do); the pre segment goes with the first stage,
    the post segment with the last."""
    nb, S = len(block_bounds) - 1, len(seq)
    if not 1 <= S <= nb:
        raise PlanError(f"an even split of {nb} blocks needs 1..{nb} stages, got {S}")
    counts = [nb // S + (1 if i < nb % S else 0) for i in range(S)]
    starts = [0]
    acc = 0
    for c in counts[:-1]:
        acc += c
        starts.append(block_bounds[acc])
    starts.append(n_ops)
    return [StageSpec(seq[i], starts[i], starts[i + 1]) for i in range(S)]


def even_split(arrays: GraphArrays, workload: Workload) -> Found | None:
    """(b) Equal blocks per stage on 2..min(machines, blocks) machines."""
    K = len(arrays.cluster)
    seqs = machine_sequences(arrays)

    def candidates() -> Iterable[list[StageSpec]]:
        for S in range(2, min(K, workload.blocks) + 1):
            for seq in _subsets(arrays, S, seqs):
                yield even_stages(seq, workload.block_bounds, arrays.n)

    return _best(arrays, candidates())


def place_blocks(arrays: GraphArrays, seq: Sequence[int], units: Sequence[int]
                 ) -> list[StageSpec] | None:
    """Contiguous units on every machine of `seq`, in order, minimising the bottleneck: each
    stage's compute, and its incoming link (the bytes crossing its first boundary, forward and
    backward, over that link's two directions), under its memory (1F1B: stage t keeps
    min(M, S - t) micro-batches of activations). None when no placement fits."""
    S, U = len(seq), len(units) - 1
    if not 1 <= S <= U:
        return None
    st = arrays.settings
    M = st.num_micro_batches
    u = np.asarray(units, dtype=np.int64)
    cf, cb = arrays.cut_bytes(1.0)
    static, saved = arrays.static_prefix[u], arrays.saved_prefix[u]
    idx = np.arange(U + 1)
    upper = idx[:, None] < idx[None, :]
    bw = arrays.cluster.bandwidth_bytes_per_s
    prev = np.where(idx == 0, 0.0, np.inf)
    back: list[np.ndarray] = []
    for t, m in enumerate(seq):
        P = arrays.prefix[m, u]
        comp = P[None, :] - P[:, None]
        infl = M if st.schedule == "gpipe" else min(M, S - t)
        mem = (static[None, :] - static[:, None]) + infl * (saved[None, :] - saved[:, None])
        bad = arrays.bad_prefix[m, u]
        ok = upper & (mem <= arrays.caps[m] - arrays.workspace) & (bad[None, :] == bad[:, None])
        if t == 0:
            link = np.zeros(U + 1)
        else:
            a = seq[t - 1]
            link = np.maximum(cf[u] / bw[a, m], cb[u] / bw[m, a])
        cost = np.maximum(np.maximum(prev, link)[:, None], comp)
        cost[~ok] = np.inf
        arg = np.argmin(cost, axis=0)
        prev = cost[arg, idx]
        back.append(arg)
    if not math.isfinite(float(prev[U])):
        return None
    stages: list[StageSpec] = []
    j = U
    for t in range(S - 1, -1, -1):
        i = int(back[t][j])
        stages.append(StageSpec(seq[t], int(u[i]), int(u[j])))
        j = i
    stages.reverse()
    return stages


def block_placement(arrays: GraphArrays, workload: Workload) -> Found | None:
    """(c) `place_blocks` on every candidate machine subset of 2..min(machines, units)."""
    units = workload.units()
    K = len(arrays.cluster)
    seqs = machine_sequences(arrays)

    def candidates() -> Iterable[list[StageSpec]]:
        for S in range(2, min(K, len(units) - 1) + 1):
            for seq in _subsets(arrays, S, seqs):
                stages = place_blocks(arrays, seq, units)
                if stages is not None:
                    yield stages

    return _best(arrays, candidates())


MAX_DDP_GROUP_SUBSETS = 64
"""Sets of bandwidth groups (sites) the DDP baseline tries its machines from: every one up to
6 groups, else all machines and each group alone."""


def data_parallel(arrays: GraphArrays, workload: Workload) -> Found | None:
    """(f) The whole model on the k fastest machines that hold it alone, of every set of
    sites (bandwidth groups) a user who knows the network would try: all of them, one site,
    or several (up to `MAX_DDP_GROUP_SUBSETS` sets); k from `REPLICA_SET_SIZES` and all."""
    # (DDP reduces each bucket during the backward, PowerSGD's included: its comm hook; the
    # settings' `reduce_in_backward`, as fusion's runtime does)
    n = arrays.n
    K = len(arrays.cluster)
    alone = arrays.prefix[:, -1]
    fit = [m for m in sorted(range(K), key=lambda m: (float(alone[m]), m))
           if evaluate(arrays, [StageSpec(m, 0, n)]).feasible]
    groups = bandwidth_groups(arrays.cluster)
    if 2 ** len(groups) - 1 <= MAX_DDP_GROUP_SUBSETS:
        sets = [frozenset(m for i, g in enumerate(groups) if mask >> i & 1 for m in g)
                for mask in range(1, 2 ** len(groups))]
    else:
        sets = [frozenset(range(K)), *(frozenset(g) for g in groups)]
    seen: set[tuple[int, ...]] = set()

    def candidates() -> Iterable[list[StageSpec]]:
        for members in sets:
            ms = [m for m in fit if m in members]
            for k in sorted({k for k in (*REPLICA_SET_SIZES, len(ms)) if 2 <= k <= len(ms)}):
                key = tuple(ms[:k])
                if key not in seen:
                    seen.add(key)
                    yield [StageSpec(ms[0], 0, n, tuple(ms[1:k]))]

    return _best(arrays, candidates())


def opfence(compress: bool, replicate: bool = False) -> Search:
    """(d)/(e)/(g) The product's planner, on the same cost tables."""

    def search(arrays: GraphArrays, workload: Workload) -> Found | None:
        if replicate:  # its replicas as fusion's runtime runs them (`Workload.settings`)
            arrays = GraphArrays(arrays.graph, arrays.cluster, workload.settings(
                arrays.settings.micro_batch_size, fusion=True))
        try:
            plan = plan_opfence(arrays.graph, arrays.cluster, arrays.settings,
                                compress=compress, arrays=arrays, replicate=replicate)
        except PlanError:
            return None
        return Found(plan.stages, plan.evaluation)

    return search


SEARCHES: Mapping[str, Search] = {
    "single": single_machine,
    "even": even_split,
    "placement": block_placement,
    "opfence": opfence(False),
    "opfence+adatopk": opfence(True),
    "ddp": data_parallel,
    "opfence+replicas": opfence(False, replicate=True),
}


def cost_tables(workload: Workload, cluster: Cluster) -> dict[int, GraphArrays]:
    """The planner's cost tables per micro-batch size (shared by every system)."""
    return {b: GraphArrays(workload.graphs[b], cluster, workload.settings(b))
            for b in workload.micro_batches}


def run_system(system: str, workload: Workload, tables: Mapping[int, GraphArrays],
               search: Search | None = None) -> Outcome:
    """`system`'s best plan over the micro-batch sizes; planning time summed over them."""
    label = dict(SYSTEMS).get(system, system)
    fn = search or SEARCHES[system]
    best: Found | None = None
    best_b = 0
    t0 = time.perf_counter()
    for b, arrays in sorted(tables.items()):
        found = fn(arrays, workload)
        if found is not None and (best is None or found.evaluation.samples_per_s
                                  > best.evaluation.samples_per_s):
            best, best_b = found, b
    planning_s = time.perf_counter() - t0
    cluster = next(iter(tables.values())).cluster
    if best is None:
        why = ("needs at least 2 machines" if system in ("even", "placement", "ddp")
               and len(cluster) < 2 else "does not fit")
        return Outcome(system, label, None, 0, planning_s, (), why)
    ids = tuple(cluster.machines[m].id for s in best.stages for m in s.machines)
    return Outcome(system, label, best, best_b, planning_s, ids)


def alone_samples_per_s(tables: Mapping[int, GraphArrays]) -> list[float]:
    """Per machine, the samples/s it reaches alone at the global batch (its best micro-batch;
    memory not checked: the compute it brings)."""
    arrays = list(tables.values())
    K, n = len(arrays[0].cluster), arrays[0].n
    return [max(evaluate(a, [StageSpec(m, 0, n)]).samples_per_s for a in arrays)
            for m in range(K)]


def fraction_of_aggregate_compute(samples_per_s: float, alone: Sequence[float]) -> float:
    """What share of the cluster's aggregate compute (the sum over machines of what each
    reaches alone) a plan turns into throughput."""
    total = float(sum(alone))
    if not total > 0:
        raise PlanError("aggregate compute must be positive")
    return samples_per_s / total


@dataclass(frozen=True)
class Verdict:
    """OP-Fence's best row against the strongest baseline row."""

    strongest: Outcome | None
    best: Outcome | None
    ratio: float
    min_ratio: float
    dense_ratio: float | None = None
    """OP-Fence dense (d) alone over the strongest baseline: the same dense wire format as the
    baselines, so the placement's own gain (None without a dense row or a baseline)."""

    @property
    def passed(self) -> bool:
        return self.ratio >= self.min_ratio * (1 - REL_TOL)


def verdict(outcomes: Sequence[Outcome], min_ratio: float = 1.0) -> Verdict:
    """Target: OP-Fence's best (dense or AdaTopK) >= `min_ratio` x the strongest baseline.
    No baseline fits: the ratio is inf when OP-Fence fits; OP-Fence fits nothing: 0."""
    base = [o for o in outcomes if o.system in BASELINES and o.fits]
    ours = [o for o in outcomes if o.system not in BASELINES and o.fits]
    strongest = max(base, key=lambda o: o.samples_per_s, default=None)
    best = max(ours, key=lambda o: o.samples_per_s, default=None)
    if best is None:
        ratio = 0.0
    elif strongest is None:
        ratio = math.inf
    else:
        ratio = best.samples_per_s / strongest.samples_per_s
    dense = next((o for o in outcomes if o.system == "opfence"), None)
    dense_ratio = (dense.samples_per_s / strongest.samples_per_s
                   if dense is not None and strongest is not None else None)
    return Verdict(strongest, best, ratio, min_ratio, dense_ratio)


def compare(workload: Workload, cluster: Cluster, systems: Sequence[str] | None = None
            ) -> tuple[list[Outcome], list[float]]:
    """Every system's outcome and each machine's alone samples/s, in the same cost tables."""
    tables = cost_tables(workload, cluster)
    names = [s for s, _ in SYSTEMS] if systems is None else list(systems)
    return [run_system(s, workload, tables) for s in names], alone_samples_per_s(tables)
