"""OP-Fence: fence machines into bandwidth groups, order them into a pipeline, cut the graph.

Algorithm (docs/planner.md has the reasoning):

1. Groups: Kruskal over links by decreasing bandwidth; two groups merge when their link is at
   least 1/`group_ratio` of the slowest link inside each, so fences sit on the slow links.
2. Machine sequence: machines of a group fastest first; group orders (ordered subsets, so a
   badly connected group can be left out) are ranked by a cheap estimate that puts each group
   boundary where the work splits by capacity and charges the cheapest nearby cut over the
   group-to-group bandwidth; the best few orders get the exact search below.
3. Cut: for a machine sequence, a DP over (last active machine, ops placed) places contiguous
   ranges of the topological order on machines (any machine may be skipped = idle), with every
   stage's compute, its incoming link and its memory under a bottleneck bound B, minimising the
   fill (sum of stage and link times). Binary search finds the least feasible B; a ladder of B
   values above it trades bottleneck for fill; each candidate is scored by the exact evaluator
   (`pipeline.evaluate`), which routes skip edges directly and de-duplicates tied weights.
   Large graphs cut only at candidate positions (the cheapest cut in each slice of work).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from fusiond.plan.adatopk import adapt_densities
from fusiond.plan.codecs import choose_codecs
from fusiond.plan.model import (
    DISK_FREE_SHARE,
    F64,
    Cluster,
    CostGraph,
    EdgeEncoding,
    JobSettings,
    MachineProfile,
    PlanError,
    wire_bytes,
)
from fusiond.plan.pipeline import Evaluation, GraphArrays, Plan, StageSpec, evaluate
from fusiond.units import bits_per_s_from_bytes_per_s

I64 = npt.NDArray[np.int64]


def fence_groups(cluster: Cluster, ratio: float = 4.0) -> list[list[int]]:
    """Machine indices grouped so that links inside a group are within `ratio` of each other."""
    k = len(cluster)
    bw_bytes_per_s = np.minimum(cluster.bandwidth_bytes_per_s, cluster.bandwidth_bytes_per_s.T)
    parent = list(range(k))
    slowest = [math.inf] * k

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    pairs = sorted(((float(bw_bytes_per_s[i, j]), i, j) for i in range(k) for j in range(i + 1, k)),
                   reverse=True)
    for w, i, j in pairs:
        ri, rj = find(i), find(j)
        if ri == rj:
            continue
        # the link must be within `ratio` of the slowest link inside *both* groups (a single
        # machine has none), so a slow group cannot chain fast groups together
        inner = max(x if math.isfinite(x) else w for x in (slowest[ri], slowest[rj]))
        if w * ratio >= inner:
            parent[rj] = ri
            slowest[ri] = min(slowest[ri], slowest[rj], w)
    groups: dict[int, list[int]] = {}
    for i in range(k):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


_DENSE_RANGE_MAX = 96  # positions up to which a dense mask beats the sparse table


def _range_argmin(v: F64, lo: I64, hi: I64) -> tuple[F64, I64]:
    """For each query, min and argmin of v[lo..hi] (inclusive); lo > hi gives (inf, -1).
    The leftmost argmin on ties, either way: a dense mask for few positions (one vectorised
    pass, about 5x faster there), a sparse table for many."""
    n = len(v)
    if n <= _DENSE_RANGE_MAX:
        idx = np.arange(n)
        inside = (idx[None, :] >= lo[:, None]) & (idx[None, :] <= hi[:, None])
        masked = np.where(inside, v[None, :], np.inf)
        first = masked.argmin(axis=1)
        has = hi >= lo
        return (np.where(has, masked[np.arange(len(lo)), first], np.inf),
                np.where(has, first, -1))
    levels = [np.arange(n)]
    span = 1
    while span * 2 <= n:
        prev = levels[-1]
        a = prev[: n - span]
        b = prev[span:]
        cur = prev.copy()
        cur[: n - span] = np.where(v[b] < v[a], b, a)
        levels.append(cur)
        span *= 2
    table = np.stack(levels)
    length = hi - lo + 1
    ok = length > 0
    lsafe = np.where(ok, length, 1)
    lvl = np.floor(np.log2(lsafe)).astype(np.int64)
    lo_s = np.where(ok, lo, 0)
    a = table[lvl, lo_s]
    b = table[lvl, np.clip(hi - (1 << lvl) + 1, 0, n - 1)]
    arg = np.where(v[b] < v[a], b, a)
    val = np.where(ok, v[arg], np.inf)
    return val, np.where(ok, arg, -1)


class _Search:
    """The cut DP over a fixed machine sequence, on candidate cut positions `q`."""

    def __init__(self, arrays: GraphArrays, q: I64, compress: bool) -> None:
        self.a = arrays
        self.q = q
        st = arrays.settings
        cf, cb = arrays.cut_bytes(*arrays.search_compression(compress))
        self.cf = cf[q]
        self.cb = cb[q]
        self.prefix = arrays.prefix[:, q]
        # [machine, j]: the first candidate index a stage ending at q[j] may start at there
        # (past every op before q[j] the machine cannot run)
        self.min_start = np.stack([np.searchsorted(q, arrays.min_start[m, q], "left")
                                   for m in range(len(arrays.cluster))]).astype(np.int64)
        self.static = arrays.fit_static_prefix[q]
        self.saved = arrays.saved_prefix[q]
        self.caps = arrays.caps - arrays.workspace
        # with recompute: a stage keeps its inputs per micro-batch in flight (at most this
        # many bytes at any candidate start) and one micro-batch's activations
        self.in_max = float(arrays.in_bytes[q].max()) if st.recompute and len(q) else 0.0
        self.bw_bytes_per_s = arrays.cluster.bandwidth_bytes_per_s
        self.rtt_s = arrays.cluster.rtt_s

    def run(self, seq: Sequence[int], bound: float, window: int) -> tuple[float, list[StageSpec]
                                                                         ] | None:
        """Least fill with every resource <= `bound`; None when infeasible."""
        st = self.a.settings
        K, m1 = len(seq), len(self.q)
        n = m1 - 1
        M = st.num_micro_batches
        dp = np.full((K, m1), np.inf)
        par_p = np.full((K, m1), -1, dtype=np.int64)
        par_k = np.full((K, m1), -1, dtype=np.int64)
        j = np.arange(1, m1)
        cols = np.arange(m1)
        seq_arr = np.asarray(seq, dtype=np.int64)
        for k in range(K):
            m = seq[k]
            best = np.full(m1, np.inf)
            best[0] = 0.0
            bk = np.full(m1, -1, dtype=np.int64)
            if k > 0:
                # every predecessor stage kk in the window at once; the first kk wins ties
                kks = np.arange(max(0, k - window), k)
                a_arr = seq_arr[kks]
                tf = self.cf[None, :] / self.bw_bytes_per_s[a_arr, m][:, None]
                tb = self.cb[None, :] / self.bw_bytes_per_s[m, a_arr][:, None]
                cand = dp[kks] + tf + tb + self.rtt_s[a_arr, m][:, None]
                cand[np.maximum(tf, tb) > bound] = np.inf
                first = cand.argmin(axis=0)
                low = cand[first, cols]
                better = low < best
                best = np.where(better, low, best)
                bk = np.where(better, kks[first], bk)
            P = self.prefix[m]
            infl = M if st.schedule == "gpipe" else min(M, K - k)
            mem = self.static + infl * self.saved
            lo_mem = np.searchsorted(mem, mem[j] - self.caps[m], "left")
            if st.recompute:  # longer stages that fit only recomputing (evaluate decides)
                rc = self.static + self.saved
                lo_mem = np.minimum(lo_mem, np.searchsorted(
                    rc, rc[j] - (self.caps[m] - infl * self.in_max), "left"))
            if st.recompute or st.offload:  # ... or checkpointing blocks, weights on disk
                kept = self.a.block_act_prefix(infl)[self.q]
                const = float(self.a.block_act_const(infl)[self.q].max()) if len(self.q) else 0.0
                if st.recompute:
                    blk = self.static + kept
                    lo_mem = np.minimum(lo_mem, np.searchsorted(
                        blk, blk[j] - (self.caps[m] - const), "left"))
                if st.offload:
                    lo_mem = np.minimum(lo_mem, np.searchsorted(
                        kept, kept[j] - (self.caps[m] - const - self.a.offload_window_bytes),
                        "left"))
            lo = np.maximum.reduce([
                np.searchsorted(P, P[j] - bound, "left"),
                lo_mem,
                self.min_start[m, j],
            ]).astype(np.int64)
            val, arg = _range_argmin(best - P, lo, j - 1)
            dp[k, 1:] = P[1:] + val
            par_p[k, 1:] = arg
            par_k[k] = bk
        last = dp[:, n]
        kbest = int(np.argmin(last))
        if not np.isfinite(last[kbest]):
            return None
        stages: list[StageSpec] = []
        k, jj = kbest, n
        while True:
            p = int(par_p[k, jj])
            stages.append(StageSpec(seq[k], int(self.q[p]), int(self.q[jj])))
            if p == 0:
                break
            k, jj = int(par_k[k, p]), p
        stages.reverse()
        return float(last[kbest]), stages


def _candidate_cuts(arrays: GraphArrays, max_cuts: int, compress: bool) -> I64:
    """All positions when few; else the cheapest cut in each of `max_cuts` equal-work slices."""
    n = arrays.n
    if n + 1 <= max_cuts:
        return np.arange(n + 1, dtype=np.int64)
    cf, cb = arrays.cut_bytes(*arrays.search_compression(compress))
    cost = cf + cb
    ref = arrays.prefix.mean(axis=0)
    edges = np.searchsorted(ref, np.linspace(0, ref[-1], max_cuts + 1)[1:-1])
    picks = {0, n}
    bounds = [1, *edges.tolist(), n]
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            picks.add(lo + int(np.argmin(cost[lo:hi])))
    if arrays.restricted:
        # where a machine starts or stops being able to run the ops: a stage on it must be
        # able to end before an op it lacks and start after one (bounded, like the slices)
        change = np.flatnonzero(np.any(np.diff(arrays.runs.astype(np.int8), axis=1) != 0,
                                       axis=0)) + 1
        edges_ops = {int(x) for x in change}
        for m in range(len(arrays.cluster)):
            bad = np.flatnonzero(~arrays.runs[m])
            edges_ops.update(int(x) for x in bad)
            edges_ops.update(int(x) + 1 for x in bad)
        extra = sorted(e for e in edges_ops if 0 < e < n and e not in picks)
        if len(extra) > max_cuts:
            extra = extra[:: math.ceil(len(extra) / max_cuts)]
        picks.update(extra)
    return np.array(sorted(picks), dtype=np.int64)


@dataclass
class _Candidate:
    stages: list[StageSpec]
    evaluation: Evaluation
    densities: dict[tuple[str, int], float]
    encodings: dict[tuple[str, int], EdgeEncoding] = field(default_factory=dict)


def _score(arrays: GraphArrays, stages: list[StageSpec], compress: bool, *,
           refine: bool = False) -> _Candidate:
    if compress and arrays.settings.codec_choice:
        ch = choose_codecs(arrays, stages, refine=refine)
        return _Candidate(stages, evaluate(arrays, stages, ch.densities, ch.encodings),
                          ch.densities, ch.encodings)
    if compress:
        dens = adapt_densities(arrays, stages)
        return _Candidate(stages, evaluate(arrays, stages, dens), dens)
    return _Candidate(stages, evaluate(arrays, stages), {})


def _search_sequence(
    search: _Search, seq: list[int], window: int, fine: bool, compress: bool
) -> _Candidate | None:
    arrays = search.a
    top = search.run(seq, math.inf, window)
    if top is None:
        return None
    best = _score(arrays, top[1], compress)
    hi = evaluate(arrays, top[1]).bottleneck_s
    speed = sum(1.0 / max(arrays.prefix[m, -1], 1e-300) for m in seq)
    lo = min(hi, 1.0 / speed) * 0.999
    # least feasible bound (log-space bisection)
    feasible_at = hi
    for _ in range(14 if fine else 10):
        if hi / lo < 1.005:
            break
        mid = math.sqrt(lo * hi)
        if search.run(seq, mid, window) is None:
            lo = mid
        else:
            hi = feasible_at = mid
    ladder = ([1.02 ** i for i in range(21)] + [1.6, 1.8, 2.0, 2.5, 3.0, 4.0]
              if fine else [1.0, 1.03, 1.07, 1.15, 1.3, 1.6, 2.2, 3.5])
    for f in ladder:
        res = search.run(seq, feasible_at * f, window)
        if res is None:
            continue
        cand = _score(arrays, res[1], compress)
        if cand.evaluation.feasible and (
            not best.evaluation.feasible
            or cand.evaluation.iteration_s < best.evaluation.iteration_s
        ):
            best = cand
    return best if best.evaluation.feasible else None


def _group_orders(
    arrays: GraphArrays, groups: list[list[int]], cf: F64, cb: F64, limit: int
) -> list[tuple[int, ...]]:
    """Group orders (ordered subsets) ranked by a cheap pipeline estimate; best `limit` first."""
    st = arrays.settings
    M = st.num_micro_batches
    bw_bytes_per_s = arrays.cluster.bandwidth_bytes_per_s
    speed = [sum(1.0 / max(arrays.prefix[m, -1], 1e-300) for m in g) for g in groups]
    cap = [float(arrays.caps[g].sum()) for g in groups]
    need = float(arrays.fit_static_prefix[-1])
    if st.offload:  # weights on disk: a group holds a few blocks of them at a time
        need = min(need, max(arrays.offload_window_bytes, arrays.offload_update_bytes))
    ref = arrays.prefix.mean(axis=0)
    ref = ref / max(ref[-1], 1e-300)
    G = len(groups)
    group_bytes_per_s = np.array([[float(np.mean(bw_bytes_per_s[np.ix_(groups[x], groups[y])]))
                                   if x != y else np.inf
                                   for y in range(G)] for x in range(G)])
    n = arrays.n
    half = max(1, n // 40)

    def score(order: tuple[int, ...]) -> float:
        if sum(cap[g] for g in order) < need:
            return math.inf
        total = sum(speed[g] for g in order)
        bc = 1.0 / total
        acc = 0.0
        worst = 0.0
        links = 0.0
        for x, y in itertools.pairwise(order):
            acc += speed[x] / total
            p = int(np.searchsorted(ref, acc))
            lo, hi = max(1, p - half), min(n, p + half + 1)
            t = np.maximum(cf[lo:hi] / group_bytes_per_s[x, y], cb[lo:hi] / group_bytes_per_s[y, x])
            tl = float(t.min()) if hi > lo else 0.0
            worst = max(worst, tl)
            links += 2 * tl
        machines = sum(len(groups[g]) for g in order)
        return float((M - 1) * max(bc, worst) + machines * bc + links)

    if G <= 6:
        orders = [o for r in range(1, G + 1) for o in itertools.permutations(range(G), r)]
    else:
        # greedy chains from every start (nearest fast neighbour), and their prefixes
        orders = []
        for s in range(G):
            chain = [s]
            while len(chain) < G:
                nxt = max((y for y in range(G) if y not in chain),
                          key=lambda y: group_bytes_per_s[chain[-1], y])
                chain.append(nxt)
            orders += [tuple(chain[:r]) for r in range(1, G + 1)]
    scored = sorted(((score(o), o) for o in orders), key=lambda x: x[0])
    return [o for s, o in scored[:limit] if math.isfinite(s)]


def _sequences(
    arrays: GraphArrays, order: tuple[int, ...], groups: list[list[int]], small: bool
) -> list[list[int]]:
    """Machine sequences for a group order: fastest first, and truncations (the DP's 1F1B
    memory bound min(M, machines left) is tighter on a shorter sequence: without them a
    pipeline shorter than the sequence, down to one machine, can be excluded where memory is
    tight); for large clusters a ladder of prefix lengths and every group's end, for small ones
    every prefix of largest-memory first and of every within-group permutation when few."""
    base = [m for g in order for m in groups[g]]
    if not small:
        ends = set(itertools.accumulate(len(groups[g]) for g in order))
        ladder = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32}
        return [base[:cut] for cut in sorted((ladder | ends) & set(range(1, len(base) + 1)),
                                             reverse=True)]
    variants = [base, [m for g in order for m in sorted(groups[g],
                                                      key=lambda x: -float(arrays.caps[x]))]]
    if math.prod(math.factorial(len(groups[g])) for g in order) <= 24:
        variants += [
            [m for part in combo for m in part]
            for combo in itertools.product(*(itertools.permutations(groups[g]) for g in order))
        ]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for v in variants:
        for cut in range(len(v), 0, -1):
            key = tuple(v[:cut])
            if key not in seen:
                seen.add(key)
                out.append(list(key))
    return out


def _local_search(
    arrays: GraphArrays, best: _Candidate | None, compress: bool, modes: list[bool]
) -> _Candidate | None:
    """Small clusters: improve the machine order by pairwise swaps (machines in one fence
    differ in speed and memory, which the fastest-first order ignores); when no order was
    feasible, first look for one among seeded random orders."""
    K = len(arrays.cluster)
    searches = [_Search(arrays, np.arange(arrays.n + 1, dtype=np.int64), m) for m in modes]
    if best is None:
        rng = np.random.default_rng(0)
        for _ in range(60):
            seq = [int(x) for x in rng.permutation(K)]
            for srch in searches:
                if srch.run(seq, math.inf, K) is not None:
                    cand = _search_sequence(srch, seq, K, False, compress)
                    if cand is not None and (best is None or cand.evaluation.iteration_s
                                             < best.evaluation.iteration_s):
                        best = cand
            if best is not None:
                break
        if best is None:
            seed = _memory_feasible_cut(arrays)
            if seed is None:
                return None
            best = _score(arrays, seed, compress)
    used = [s.machine for s in best.stages]
    seq0 = used + [m for m in range(K) if m not in used]
    for _ in range(4):
        improved = False
        moves: list[list[int]] = []
        for i, j in itertools.permutations(range(K), 2):
            if i < j:  # swap
                seq = list(seq0)
                seq[i], seq[j] = seq[j], seq[i]
                moves.append(seq)
            if abs(i - j) > 1:  # move machine i to position j
                seq = list(seq0)
                seq.insert(j, seq.pop(i))
                moves.append(seq)
        for seq in moves:
            nu = len(best.stages)
            # truncations tighten the DP's 1F1B bound min(M, machines left in the sequence)
            for cut in sorted({max(1, nu - 1), nu, min(K, nu + 1), K}):
                for srch in searches:
                    cand = _search_sequence(srch, seq[:cut], K, False, compress)
                    if cand is not None and cand.evaluation.iteration_s < (
                        best.evaluation.iteration_s * (1 - 1e-9)
                    ):
                        best, seq0, improved = cand, seq, True
        if not improved:
            break
    return best


class _SubsetSearch:
    """Tiny clusters (<= 7 machines): the cut DP over every machine order at once, by machine
    subsets, from the last stage back (each stage knows how many follow: exact 1F1B memory).
    Minimises fill with every resource under a bound, like `_Search`."""

    def __init__(self, arrays: GraphArrays, compress: bool) -> None:
        self.a = arrays
        st = arrays.settings
        n = arrays.n
        # [p, e]: bytes a stage running ops [p, e) sends on (its own outputs read at >= e),
        # so tensors passing over a stage are not charged to it (they travel directly)
        d, enc = arrays.search_compression(compress)
        self.of = np.zeros((n + 1, n + 1))
        self.ob = np.zeros((n + 1, n + 1))
        for t, last in zip(arrays.graph.tensors, arrays.last_use, strict=True):
            if last <= t.src:
                continue
            f, g = wire_bytes(t, st.micro_batch_size, d, st, enc)
            self.of[: t.src + 1, t.src + 1 : last + 1] += f
            self.ob[: t.src + 1, t.src + 1 : last + 1] += g
        outmax = np.zeros((n + 1, n + 1))
        for p0 in range(n):
            outmax[p0, p0 + 1:] = np.maximum.accumulate(arrays.out[p0:])
        self.outmax = outmax
        self.upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        self.comp = arrays.prefix[:, None, :] - arrays.prefix[:, :, None]  # [m, p, e]
        # [m, p, e]: machine m runs every op of [p, e)
        self.runs = arrays.bad_prefix[:, None, :] == arrays.bad_prefix[:, :, None]

    def run(self, bound: float, conservative: bool = False) -> tuple[float, list[StageSpec]
                                                                   ] | None:
        """`conservative`: charge a stage's outgoing bytes on its slowest link into the rest
        of the pipeline (a tensor that skips the next stage may land on any later machine);
        otherwise on the link to the next stage."""
        a, st = self.a, self.a.settings
        K, n, M = len(a.cluster), a.n, st.num_micro_batches
        bw_bytes_per_s, rtt_s = a.cluster.bandwidth_bytes_per_s, a.cluster.rtt_s
        val: dict[tuple[int, int], F64] = {}
        arg: dict[tuple[int, int], tuple[I64, I64]] = {}
        for size in range(1, K + 1):
            infl = M if st.schedule == "gpipe" else min(M, size)
            need = a.stage_need(infl, self.outmax)
            for mask in (m for m in range(1 << K) if bin(m).count("1") == size):
                rest = mask
                for first in (x for x in range(K) if mask >> x & 1):
                    rest = mask & ~(1 << first)
                    tail = np.full((n + 1, n + 1), np.inf)
                    nxt = np.full((n + 1, n + 1), -1, dtype=np.int64)
                    if rest == 0:
                        tail[:, n] = 0.0
                    else:
                        for f2 in (x for x in range(K) if rest >> x & 1):
                            v = val.get((rest, f2))
                            if v is None:
                                continue
                            if conservative:
                                others = [x for x in range(K) if rest >> x & 1]
                                bf_bytes_per_s = min(float(bw_bytes_per_s[first, x])
                                                     for x in others)
                                bb_bytes_per_s = min(float(bw_bytes_per_s[x, first])
                                                     for x in others)
                            else:
                                bf_bytes_per_s = float(bw_bytes_per_s[first, f2])
                                bb_bytes_per_s = float(bw_bytes_per_s[f2, first])
                            tf = self.of / bf_bytes_per_s
                            tb = self.ob / bb_bytes_per_s
                            cand = v[None, :] + tf + tb + rtt_s[first, f2]
                            cand[np.maximum(tf, tb) > bound] = np.inf
                            better = cand < tail
                            tail = np.where(better, cand, tail)
                            nxt = np.where(better, f2, nxt)
                    c = self.comp[first]
                    ok = self.upper & (c <= bound) & (need <= a.caps[first]) & self.runs[first]
                    tot = np.where(ok, c + tail, np.inf)
                    e = np.argmin(tot, axis=1)
                    best = tot[np.arange(n + 1), e]
                    if np.isfinite(best).any():
                        val[(mask, first)] = best
                        arg[(mask, first)] = (e.astype(np.int64),
                                              nxt[np.arange(n + 1), e].astype(np.int64))
        starts = [(v[0], key) for key, v in val.items() if np.isfinite(v[0])]
        if not starts:
            return None
        fill, (mask, first) = min(starts)
        stages: list[StageSpec] = []
        p = 0
        while True:
            e_arr, nxt = arg[(mask, first)]
            e = int(e_arr[p])
            stages.append(StageSpec(first, p, e))
            if e == n:
                return float(fill), stages
            mask, first, p = mask & ~(1 << first), int(nxt[p]), e


def _subset_candidate(arrays: GraphArrays, compress: bool, modes: list[bool]) -> _Candidate | None:
    """Best of the subset DP over a bisection for the least bound and a ladder above it."""
    best: _Candidate | None = None
    for mode, conservative in itertools.product(modes, (False, True)):
        ss = _SubsetSearch(arrays, mode)
        top = ss.run(math.inf, conservative)
        if top is None:
            continue
        hi = evaluate(arrays, top[1]).bottleneck_s
        speed = sum(1.0 / max(float(arrays.prefix[m, -1]), 1e-300)
                    for m in range(len(arrays.cluster)))
        lo = min(hi, 1.0 / speed) * 0.999
        feasible_at = hi
        for _ in range(14):
            if hi / lo < 1.005:
                break
            mid = math.sqrt(lo * hi)
            if ss.run(mid, conservative) is None:
                lo = mid
            else:
                hi = feasible_at = mid
        results = [top[1]]
        for f in [1.02 ** i for i in range(21)] + [1.6, 2.0, 3.0]:
            res = ss.run(feasible_at * f, conservative)
            if res is not None:
                results.append(res[1])
        for stages in results:
            cand = _score(arrays, stages, compress)
            if cand.evaluation.feasible and (
                best is None or cand.evaluation.iteration_s < best.evaluation.iteration_s
            ):
                best = cand
    return best


def _memory_feasible_cut(arrays: GraphArrays) -> list[StageSpec] | None:
    """Any cut that fits memory, over every machine order (small clusters only): a DP over
    (machines used by the suffix, first machine of the suffix, first op), from the last stage
    back, so each stage knows how many stages follow it (its exact 1F1B in-flight count)."""
    K, n = len(arrays.cluster), arrays.n
    st = arrays.settings
    M = st.num_micro_batches
    caps = arrays.caps
    reach: dict[tuple[int, int], npt.NDArray[np.bool_]] = {}
    # largest op output in [p, e): the stage's workspace, exactly (n is small here)
    outmax = np.zeros((n + 1, n + 1))
    for p0 in range(n):
        outmax[p0, p0 + 1:] = np.maximum.accumulate(arrays.out[p0:])
    upper = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    runs = arrays.bad_prefix[:, None, :] == arrays.bad_prefix[:, :, None]  # [m, p, e]
    for size in range(1, K + 1):
        infl = M if st.schedule == "gpipe" else min(M, size)
        need = arrays.stage_need(infl, outmax)  # [p, e]: a stage running ops [p, e)
        for mask in (m for m in range(1 << K) if bin(m).count("1") == size):
            for first in (x for x in range(K) if mask >> x & 1):
                rest = mask & ~(1 << first)
                ends = np.zeros(n + 1, dtype=bool)
                if rest == 0:
                    ends[n] = True
                else:
                    for f2 in (x for x in range(K) if rest >> x & 1):
                        ends |= reach.get((rest, f2), ends & False)
                ok = np.any(upper & (need <= caps[first]) & runs[first] & ends[None, :],
                            axis=1)
                if ok.any():
                    reach[(mask, first)] = ok
    starts = [(mask, f) for (mask, f), ok in reach.items() if ok[0]]
    if not starts:
        return None
    mask, first = min(starts, key=lambda x: bin(x[0]).count("1"))
    stages: list[StageSpec] = []
    p = 0
    while True:
        size = bin(mask).count("1")
        infl = M if st.schedule == "gpipe" else min(M, size)
        need = arrays.stage_need(infl, outmax)
        rest = mask & ~(1 << first)
        if rest == 0:
            stages.append(StageSpec(first, p, n))
            return stages
        nxt = None
        for e in range(n - 1, p, -1):
            if need[p, e] > caps[first] or not runs[first, p, e]:
                continue
            for f2 in (x for x in range(K) if rest >> x & 1):
                r = reach.get((rest, f2))
                if r is not None and r[e]:
                    nxt = (e, f2)
                    break
            if nxt:
                break
        if nxt is None:
            return None
        stages.append(StageSpec(first, p, nxt[0]))
        p, mask, first = nxt[0], rest, nxt[1]


def _neighbours(stages: list[StageSpec], K: int) -> list[list[StageSpec]]:
    """Cuts one edit away: a boundary moved, a stage split onto an idle machine, two stages
    merged, a stage moved to another (idle or busy) machine."""
    out: list[list[StageSpec]] = []
    S = len(stages)
    used = {s.machine for s in stages}
    idle = [m for m in range(K) if m not in used]
    for i in range(S - 1):
        a, b = stages[i], stages[i + 1]
        for d in (-2, -1, 1, 2):
            cut = a.stop + d
            if a.start < cut < b.stop:
                out.append([*stages[:i], StageSpec(a.machine, a.start, cut),
                            StageSpec(b.machine, cut, b.stop), *stages[i + 2:]])
        out.append([*stages[:i], StageSpec(a.machine, a.start, b.stop), *stages[i + 2:]])
        out.append([*stages[:i], StageSpec(b.machine, a.start, b.stop), *stages[i + 2:]])
    for i, st in enumerate(stages):
        for u in idle:
            out.append([*stages[:i], StageSpec(u, st.start, st.stop), *stages[i + 1:]])
            for cut in range(st.start + 1, st.stop):
                lo, hi = StageSpec(st.machine, st.start, cut), StageSpec(u, cut, st.stop)
                out.append([*stages[:i], lo, hi, *stages[i + 1:]])
                lo, hi = StageSpec(u, st.start, cut), StageSpec(st.machine, cut, st.stop)
                out.append([*stages[:i], lo, hi, *stages[i + 1:]])
        for j in range(i + 1, S):
            sw = list(stages)
            sw[i] = StageSpec(stages[j].machine, st.start, st.stop)
            sw[j] = StageSpec(st.machine, stages[j].start, stages[j].stop)
            out.append(sw)
    return out


def _refine(arrays: GraphArrays, best: _Candidate, compress: bool,
            neighbours: Callable[[list[StageSpec], int], list[list[StageSpec]]] | None = None,
            ) -> _Candidate:
    """Hill-climb on the exact evaluator (small problems) over `neighbours` (default: the
    one-machine-per-stage edits of `_neighbours`): repairs what the DP approximates (skip
    edges charged on the next link, the conservative 1F1B memory bound)."""
    step = neighbours or _neighbours
    K = len(arrays.cluster)
    for _ in range(20):
        improved = False
        for stages in step(best.stages, K):
            cand = _score(arrays, stages, compress)
            if cand.evaluation.feasible and cand.evaluation.iteration_s < (
                best.evaluation.iteration_s * (1 - 1e-9)
            ):
                best, improved = cand, True
        if not improved:
            break
    return best


def _no_topk_on_int8(settings: JobSettings, compress: bool) -> None:
    if compress and settings.edge_encoding != "raw":
        raise PlanError(f"AdaTopK (compress=True) does not apply to {settings.edge_encoding} "
                        "cut edges (JobSettings.edge_encoding): plan without compress")


def plan_opfence(
    graph: CostGraph,
    cluster: Cluster,
    settings: JobSettings,
    *,
    compress: bool = False,
    group_ratio: float = 4.0,
    max_cuts: int = 384,
    orders: int = 5,
    arrays: GraphArrays | None = None,
    replicate: bool = False,
) -> Plan:
    """Plan `graph` on `cluster` with OP-Fence (and AdaTopK densities when `compress`).

    With `replicate`, stages may also run on several machines each (data parallelism; the
    shapes of `replica_shapes`, searched as one space with the plain pipeline; docs/planner.md
    "Replicas"). The stage runtime does not run replicas yet: the daemon plans without.

    Raises PlanError when no cut fits the machines' memory. With `settings.int8_edges` the cut
    edges are costed int8 and `compress` (top-k) is refused: the two do not stack.
    """
    _no_topk_on_int8(settings, compress)
    arrays = arrays or GraphArrays(graph, cluster, settings)
    if arrays.n == 0:
        raise PlanError("cannot plan an empty graph")
    nowhere = np.flatnonzero(~arrays.runs.any(axis=0))
    if len(nowhere):
        ops = list(dict.fromkeys(graph.ops[i].op for i in nowhere))
        raise PlanError(f"no machine of the cluster runs op {', '.join(map(repr, ops[:6]))}"
                        f"{' and more' if len(ops) > 6 else ''} of {graph.name!r} (machines "
                        f"{', '.join(cluster.ids())})")
    groups = fence_groups(cluster, group_ratio)
    fast_first = [sorted(g, key=lambda m: float(arrays.prefix[m, -1])) for g in groups]
    small = len(cluster) * min(arrays.n + 1, max_cuts) <= 400
    best: _Candidate | None = None
    modes = [False, True] if compress else [False]
    for mode in modes:
        q = _candidate_cuts(arrays, max_cuts, mode)
        search = _Search(arrays, q, mode)
        cf, cb = arrays.cut_bytes(*arrays.search_compression(mode))
        per_mode = orders if len(modes) == 1 else max(2, (orders + 1) // 2)
        for order in _group_orders(arrays, fast_first, cf, cb,
                                   max(orders, 24) if small else per_mode):
            for seq in _sequences(arrays, order, fast_first, small):
                window = len(seq) if len(seq) <= 12 else max(len(g) for g in groups) + 1
                cand = _search_sequence(search, seq, window, small, compress)
                if cand is not None and (
                    best is None or cand.evaluation.iteration_s < best.evaluation.iteration_s
                ):
                    best = cand
    if len(cluster) <= 7 and arrays.n <= 64:
        sub = _subset_candidate(arrays, compress, modes)
        if sub is not None and (best is None
                                or sub.evaluation.iteration_s < best.evaluation.iteration_s):
            best = sub
    if small:
        best = _local_search(arrays, best, compress, modes)
        if best is not None:
            best = _refine(arrays, best, compress)
    shape = ""
    if replicate and len(cluster) > 1:
        rep = _replicated_candidate(arrays, groups, compress, group_ratio)
        if rep is not None and (best is None or rep[0].evaluation.iteration_s
                                < best.evaluation.iteration_s * (1 - 1e-9)):
            best, shape = rep
        if small and best is not None:
            refined = _refine(arrays, best, compress, _replica_neighbours)
            if refined is not best:
                best = refined
                shape = shape or "a pipeline with replicas added"
    if best is None:
        ops_note = ("; each stage also needs a machine that runs every op of it, and some "
                    "machines lack ops of this graph" if arrays.restricted else "")
        disk_note = (f"; with the weights and optimizer state on disk a stage still holds "
                     f"{arrays.offload_window_bytes / 2**20:.1f} MiB of them (a block's weights "
                     "and gradients and the previous block's weights) plus its activations, "
                     f"and {arrays.offload_update_bytes / 2**20:.1f} MiB while a block steps"
                     + _disk_note(cluster) if settings.offload else
                     "; allowing the optimizer state and weights on disk (batch.offload) "
                     "would need less")
        raise PlanError(
            f"no cut of {graph.name!r} fits the machines' memory "
            f"(parameters+gradients+optimizer state alone need "
            f"{arrays.static_prefix[-1] / 2**30:.2f} GiB){disk_note}{ops_note}"
        )
    if compress and settings.codec_choice:  # the kept plan's links, fill included
        best = _score(arrays, best.stages, compress, refine=True)
    dense = (evaluate(arrays, best.stages) if best.densities or best.encodings
             else best.evaluation)
    return Plan(
        method="op-fence+codecs" if compress and settings.codec_choice else
        "op-fence+adatopk" if compress else
        f"op-fence+{settings.edge_encoding}" if settings.edge_encoding != "raw" else "op-fence",
        arrays=arrays,
        stages=tuple(best.stages),
        densities=best.densities,
        encodings=best.encodings,
        evaluation=best.evaluation,
        dense=dense,
        groups=tuple(tuple(cluster.machines[m].id for m in g) for g in groups),
        idle=_idle_reasons(arrays, groups, best.stages, best.evaluation),
        notes=_op_notes(arrays) + ((f"replicas: {shape}",) if shape else ()),
    )


def _disk_note(cluster: Cluster) -> str:
    """Where the machines' free disk bounds what may go there (`MachineProfile.disk_room_bytes`):
    the most any of them offers, for a plan that did not fit."""
    rooms = [m.disk_room_bytes for m in cluster.machines if m.disk_free_bytes > 0]
    if not rooms:
        return ""
    return (f"; the most disk any machine may give a stage's files is "
            f"{max(rooms) / 2**30:.2f} GiB ({DISK_FREE_SHARE:.0%} of its free space): "
            "free disk under the daemons' state directories for more")


def _op_notes(arrays: GraphArrays) -> tuple[str, ...]:
    """One note per machine that lacks ops of the graph: which, and that its stages avoid
    them."""
    out = []
    for m, machine in enumerate(arrays.cluster.machines):
        lacks = arrays.missing_ops(m, 0, arrays.n)
        if lacks:
            out.append(f"{machine.id} cannot run {', '.join(lacks[:4])}"
                       f"{f' and {len(lacks) - 4} more ops' if len(lacks) > 4 else ''}: "
                       "no stage using one is placed there")
    return tuple(out)


def _idle_reasons(
    arrays: GraphArrays, groups: list[list[int]], stages: Sequence[StageSpec],
    ev: Evaluation,
) -> dict[str, str]:
    used = {m for s in stages for m in s.machines}
    busy = ("a stage or a replica here would add more transfer, pipeline fill or gradient "
            "reduction than it saves")
    if ev.bottleneck.startswith("compute"):
        # a bottleneck made of one op cannot be split further by adding machines
        r = max(ev.stages, key=lambda x: x.compute_s)
        t = arrays.times[r.machine, r.start:r.stop]
        top = int(np.argmax(t))
        if t[top] >= 0.5 * r.compute_s:
            busy = (f"the bottleneck is the single op {arrays.graph.ops[r.start + top].name} "
                    f"({t[top] * 1e3:.3g} ms on {r.machine_id}), which no cut can split; "
                    "more stages would only add fill")
    ms = arrays.cluster.machines
    out: dict[str, str] = {}
    rates = arrays.cluster.bandwidth_bytes_per_s
    bw_bytes_per_s = np.minimum(rates, rates.T)
    for gi, g in enumerate(groups):
        group_used = any(m in used for m in g)
        for m in g:
            if m in used:
                continue
            lacks = arrays.missing_ops(m, 0, arrays.n)
            if lacks:
                out[ms[m].id] = (
                    f"it cannot run op {', '.join(lacks[:3])}{' ...' if len(lacks) > 3 else ''}"
                    f" of this graph: a stage there must avoid them; none was predicted faster")
            elif not group_used:
                others = [x for x in used]
                best = max((float(bw_bytes_per_s[m, x]) for x in others), default=0.0)
                out[ms[m].id] = (
                    f"group {gi} left out: its best link into the pipeline is "
                    f"{bits_per_s_from_bytes_per_s(best) / 1e6:.3g} Mbit/s; a stage there was "
                    "predicted slower"
                )
            else:
                out[ms[m].id] = busy
    return out


def uniform_plan(graph: CostGraph, cluster: Cluster, settings: JobSettings) -> Plan:
    """Baseline: equal op counts per machine, machines in id order, no compression.

    The prediction is reported even when a stage exceeds its memory (`over_memory`).
    """
    arrays = GraphArrays(graph, cluster, settings)
    n, k = arrays.n, min(len(cluster), arrays.n)
    order = sorted(range(len(cluster)), key=lambda i: cluster.machines[i].id)[:k]
    bounds = [round(i * n / k) for i in range(k + 1)]
    stages = tuple(StageSpec(order[i], bounds[i], bounds[i + 1]) for i in range(k))
    ev = evaluate(arrays, stages)
    return Plan(
        method="uniform",
        arrays=arrays,
        stages=stages,
        densities={},
        evaluation=ev,
        dense=ev,
        groups=(tuple(cluster.ids()),),
        idle={},
    )


def plan_from_stages(
    graph: CostGraph,
    cluster: Cluster,
    settings: JobSettings,
    stages: Sequence[StageSpec],
    *,
    compress: bool = False,
) -> Plan:
    """Evaluate a given cut (e.g. from a re-plan or a user) as a Plan."""
    _no_topk_on_int8(settings, compress)
    arrays = GraphArrays(graph, cluster, settings)
    cand = _score(arrays, list(stages), compress, refine=True)
    return Plan(
        method="given",
        arrays=arrays,
        stages=tuple(stages),
        densities=cand.densities,
        encodings=cand.encodings,
        evaluation=cand.evaluation,
        dense=evaluate(arrays, stages),
        groups=(tuple(cluster.ids()),),
        idle={},
    )


# --- replicas: data parallelism inside and across bandwidth groups -------------------------

REPLICA_SET_SIZES: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Replicas per stage the shape search tries inside each bandwidth group."""


def _inverse_sum(xs: Sequence[float]) -> float:
    """1 / sum(1 / x): what a cost paid per micro-batch on each of several machines working
    side by side costs per micro-batch of their sum (0 when one of them pays nothing)."""
    if any(x <= 0 for x in xs):
        return 0.0
    return 1.0 / sum(1.0 / x for x in xs)


def _virtual_machine(idx: int, members: Sequence[MachineProfile]) -> MachineProfile:
    """Replicas side by side as one machine for the cut search: their rates summed (the
    throughput of the set), the memory of the smallest (each holds the whole stage), the
    longest wake-up, the ops every one of them runs."""
    if len(members) == 1:
        return members[0]
    classes = sorted({k for m in members for k in m.flops})
    ops = None
    for m in members:
        if m.ops is not None:
            ops = m.ops if ops is None else ops & m.ops
    return MachineProfile(
        id=f"replicas{idx}:" + "+".join(m.id for m in members),
        flops={k: sum(m.rate(k) for m in members) for k in classes},
        mem_bw=sum(m.mem_bw for m in members),
        op_overhead_s=_inverse_sum([m.op_overhead_s for m in members]),
        memory_bytes=min(m.memory_bytes for m in members),
        kind="replicas",
        wire_s_per_byte=_inverse_sum([m.wire_s_per_byte for m in members]),
        msg_s=_inverse_sum([m.msg_s for m in members]),
        wake_s=max(m.wake_s for m in members),
        ops=ops,
    )


def _virtual_link(cluster: Cluster, a_set: Sequence[int], b_set: Sequence[int]
                  ) -> tuple[float, float, float]:
    """(bytes/s a->b, b->a, rtt) of two replica sets seen as one link: the pairs that will
    carry the micro-batches (the fastest first, every machine of the larger set used, the
    smaller set's machines shared evenly) side by side, their rates summed; and the longest
    of those pairs' round trips."""
    bw = cluster.bandwidth_bytes_per_s
    big, small, swap = (a_set, b_set, False) if len(a_set) >= len(b_set) else (b_set, a_set, True)
    per_small = math.ceil(len(big) / len(small))
    pairs = sorted(((min(float(bw[x, y]), float(bw[y, x])), x, y) for x in big for y in small),
                   key=lambda p: -p[0])
    used_big: set[int] = set()
    load: dict[int, int] = {}
    fwd = bwd = 0.0
    rtt = 0.0
    for _, x, y in pairs:
        if x in used_big or load.get(y, 0) >= per_small:
            continue
        used_big.add(x)
        load[y] = load.get(y, 0) + 1
        a, b = (y, x) if swap else (x, y)
        fwd += float(bw[a, b])
        bwd += float(bw[b, a])
        rtt = max(rtt, float(cluster.rtt_s[a, b]))
    return fwd, bwd, rtt


def _virtual_cluster(cluster: Cluster, sets: Sequence[Sequence[int]]) -> Cluster:
    machines = [_virtual_machine(i, [cluster.machines[m] for m in s]) for i, s in enumerate(sets)]
    k = len(sets)
    bw = np.full((k, k), np.inf)
    rtt = np.zeros((k, k))
    for i in range(k):
        for j in range(i + 1, k):
            f, b, r = _virtual_link(cluster, sets[i], sets[j])
            bw[i, j], bw[j, i] = f, b
            rtt[i, j] = rtt[j, i] = r
    return Cluster(tuple(machines), bw, rtt)


def _deal(ms: Sequence[int], nsets: int) -> list[list[int]]:
    """`ms` (fastest first) dealt into `nsets` sets of about equal speed."""
    nsets = max(1, min(nsets, len(ms)))
    return [list(ms[j::nsets]) for j in range(nsets)]


def replica_shapes(arrays: GraphArrays, groups: Sequence[Sequence[int]]
                   ) -> list[tuple[str, list[list[int]]]]:
    """The replica sets the shape search tries, each (name, sets; a set's machines fastest
    first), the machines of a shape all distinct:

    - inside every bandwidth group, sets of about r machines (r in `REPLICA_SET_SIZES`), so
      the cut search can give each set a stage: replicas on fast links;
    - the groups zipped: the i-th fastest machine of each of the best-provided groups in one
      set, the rest alone: pipelines replicated across sites, gradients reduced over the
      slow links;
    - the fastest k machines of the cluster, of each group, of sites grown from a
      well-provided group by their best-connected neighbours and (up to
      `DP_GROUP_SUBSETS_MAX_GROUPS` groups) of every set of groups, in one set: pure data
      parallelism (a single stage), machines that would slow it left out.
    """
    alone = arrays.prefix[:, -1]
    ff = [sorted(g, key=lambda m: (float(alone[m]), m)) for g in groups]
    everyone = sorted((m for g in ff for m in g), key=lambda m: (float(alone[m]), m))
    out: list[tuple[str, list[list[int]]]] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def add(name: str, sets: list[list[int]]) -> None:
        key = tuple(sorted(tuple(s) for s in sets))
        if key not in seen and any(len(s) > 1 for s in sets):
            seen.add(key)
            out.append((name, sets))

    biggest = max(len(g) for g in ff)
    for r in REPLICA_SET_SIZES:
        if r > biggest:
            break
        add(f"{r} per set inside groups",
            [s for g in ff for s in _deal(g, round(len(g) / r))])
    by_speed = sorted(range(len(ff)), key=lambda i: -sum(1.0 / max(float(alone[m]), 1e-300)
                                                         for m in ff[i]))
    for k in range(2, len(ff) + 1):
        chosen = [ff[i] for i in by_speed[:k]]
        depth = min(len(g) for g in chosen)
        zipped = [[g[i] for g in chosen] for i in range(depth)]
        rest = [[m] for g in chosen for m in g[depth:]] + [
            [m] for i in by_speed[k:] for m in ff[i]]
        add(f"{k} groups zipped", zipped + rest)
    sizes = sorted({k for k in (*REPLICA_SET_SIZES, len(everyone)) if 2 <= k <= len(everyone)})
    for k in sizes:
        add(f"fastest {k} data-parallel", [everyone[:k]])
    for i in by_speed[:2]:
        for k in sizes:
            if k <= len(ff[i]):
                add(f"fastest {k} of a group data-parallel", [ff[i][:k]])
    # whole groups data-parallel, grown from each of the best-provided groups by the group
    # best connected to those already in (a site and its well-connected neighbours)
    bw = np.minimum(arrays.cluster.bandwidth_bytes_per_s, arrays.cluster.bandwidth_bytes_per_s.T)
    for start in by_speed[:3]:
        grown = [start]
        while len(grown) < len(ff):
            left = [i for i in range(len(ff)) if i not in grown]
            nxt = max(left, key=lambda i: (min(float(bw[a, b]) for g in grown for a in ff[g]
                                               for b in ff[i]), -i))
            grown.append(nxt)
            members = sorted((m for g in grown for m in ff[g]),
                             key=lambda m: (float(alone[m]), m))
            add(f"{len(grown)} groups data-parallel", [members])
    # the fastest k of every set of sites, where there are few: a site's slowest machines
    # may cost the ring more than they bring, and the sites that pay are not always the
    # best-connected ones (DDP on the fastest 16 of 3 of 6 regions beat every grown set)
    if len(ff) <= DP_GROUP_SUBSETS_MAX_GROUPS:
        for mask in range(1, 2 ** len(ff)):
            members = sorted((m for i, g in enumerate(ff) if mask >> i & 1 for m in g),
                             key=lambda m: (float(alone[m]), m))
            for k in sizes:
                if k <= len(members):
                    add(f"fastest {k} of {mask.bit_count()} groups data-parallel",
                        [members[:k]])
    if len(everyone) <= EXHAUSTIVE_SHAPES_MACHINES:
        for sets in _set_partitions_of_subsets(everyone):
            add("replica sets of a small cluster",
                [sorted(x, key=lambda m: (float(alone[m]), m)) for x in sets])
    return out


DP_GROUP_SUBSETS_MAX_GROUPS = 6
"""Up to this many bandwidth groups, every set of them is tried for pure data parallelism
(63 sets for 6)."""

EXHAUSTIVE_SHAPES_MACHINES = 5
"""Clusters up to this many machines get every way of forming replica sets (203 for 5)."""


def _set_partitions_of_subsets(ms: Sequence[int]) -> list[list[list[int]]]:
    """Every way to leave some of `ms` out and split the rest into non-empty sets."""
    out: list[list[list[int]]] = []

    def rec(i: int, sets: list[list[int]]) -> None:
        if i == len(ms):
            if sets:
                out.append([list(x) for x in sets])
            return
        rec(i + 1, sets)  # ms[i] idle
        for x in sets:
            x.append(ms[i])
            rec(i + 1, sets)
            x.pop()
        sets.append([ms[i]])
        rec(i + 1, sets)
        sets.pop()

    rec(0, [])
    return out


def _expand(stages: Sequence[StageSpec], sets: Sequence[Sequence[int]]) -> list[StageSpec]:
    """A cut of the virtual cluster (machine = replica set) as stages of the real one."""
    return [StageSpec(sets[s.machine][0], s.start, s.stop, tuple(sets[s.machine][1:]))
            for s in stages]


def _trim_replicas(arrays: GraphArrays, best: _Candidate, compress: bool) -> _Candidate:
    """Drop a stage's replicas that make it slower (the slowest first): one that gets no
    micro-batch, or whose gradient reduction costs more than its share saves."""
    improved = True
    while improved:
        improved = False
        for i, s in enumerate(best.stages):
            if not s.replicas:
                continue
            slowest = max(s.replicas, key=lambda m: float(arrays.prefix[m, s.stop]
                                                          - arrays.prefix[m, s.start]))
            trimmed = StageSpec(s.machine, s.start, s.stop,
                                tuple(m for m in s.replicas if m != slowest))
            cand = _score(arrays, [*best.stages[:i], trimmed, *best.stages[i + 1:]], compress)
            if cand.evaluation.feasible and (cand.evaluation.iteration_s
                                             < best.evaluation.iteration_s * (1 - 1e-9)):
                best, improved = cand, True
                break
    return best


def _replica_neighbours(stages: list[StageSpec], K: int) -> list[list[StageSpec]]:
    """Replica edits one step away: a machine joins a stage (from idle or from another
    stage's replicas), a replica leaves its stage, a stage boundary moves by one op."""
    out: list[list[StageSpec]] = []
    where = {m: i for i, s in enumerate(stages) for m in s.machines}

    def without(st: StageSpec, m: int) -> StageSpec | None:
        ms = [x for x in st.machines if x != m]
        return StageSpec(ms[0], st.start, st.stop, tuple(ms[1:])) if ms else None

    for m in range(K):
        src = where.get(m)
        base = list(stages)
        if src is not None:
            left = without(stages[src], m)
            if left is None:
                continue
            base[src] = left
            out.append(list(base))  # m leaves: idle
        for i, st in enumerate(base):
            if i == src:
                continue
            moved = list(base)
            moved[i] = StageSpec(st.machine, st.start, st.stop, (*st.replicas, m))
            out.append(moved)
    for i in range(len(stages) - 1):
        a, b = stages[i], stages[i + 1]
        for d in (-1, 1):
            cut = a.stop + d
            if a.start < cut < b.stop:
                out.append([*stages[:i], StageSpec(a.machine, a.start, cut, a.replicas),
                            StageSpec(b.machine, cut, b.stop, b.replicas), *stages[i + 2:]])
    return out


def _replicated_candidate(arrays: GraphArrays, groups: Sequence[Sequence[int]], compress: bool,
                          group_ratio: float) -> tuple[_Candidate, str] | None:
    """The best plan over `replica_shapes`: each shape's sets become machines of a virtual
    cluster, OP-Fence cuts the graph over them, and the exact evaluator (replica shares,
    routes, gradient reduction) scores the result on the real cluster."""
    best: tuple[_Candidate, str] | None = None
    for name, sets in replica_shapes(arrays, groups):
        if len(sets) == 1:  # pure data parallelism: one stage, nothing to cut
            stages = [StageSpec(sets[0][0], 0, arrays.n, tuple(sets[0][1:]))]
        else:
            virtual = _virtual_cluster(arrays.cluster, sets)
            try:
                vplan = plan_opfence(arrays.graph, virtual, arrays.settings, compress=False,
                                     group_ratio=group_ratio, orders=1, max_cuts=96)
            except PlanError:
                continue
            stages = _expand(vplan.stages, sets)
        cand = _score(arrays, stages, compress)
        if not cand.evaluation.feasible:
            continue
        if best is None or cand.evaluation.iteration_s < 1.25 * best[0].evaluation.iteration_s:
            cand = _trim_replicas(arrays, cand, compress)
        if best is None or cand.evaluation.iteration_s < best[0].evaluation.iteration_s:
            best = (cand, name)
    return best
