"""Random planning instances (chains with skip edges, grouped clusters) and an exhaustive oracle.

The oracle enumerates every ordered subset of machines and every contiguous split of the ops,
and scores them with a vectorised re-implementation of `fusiond.plan.pipeline.evaluate` (cross-
checked against it in test_fence.py), so "optimum" means the best cut under the same model.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from fusiond.plan.model import (
    Cluster,
    CostGraph,
    JobSettings,
    MachineProfile,
    OpCost,
    TensorEdge,
    op_times,
    wire_bytes,
)


@dataclass
class Instance:
    graph: CostGraph
    cluster: Cluster
    settings: JobSettings


def random_instance(rng: np.random.Generator, *, max_machines: int = 6,
                    max_ops: int = 12) -> Instance:
    n = int(rng.integers(4, max_ops + 1))
    ops = []
    for i in range(n):
        flops = float(rng.lognormal(math.log(1e10), 0.8))
        params = float(rng.choice([0.0, rng.lognormal(math.log(2e8), 1.0)]))
        ops.append(OpCost(
            name=f"op{i}", op="synthetic", op_class=str(rng.choice(["matmul", "other"])),
            fwd_flops=flops, bwd_flops=2 * flops, fwd_bytes=flops / 50, bwd_bytes=flops / 25,
            param_bytes=params, opt_state_bytes=2 * params,
            saved_bytes=float(rng.lognormal(math.log(5e7), 0.7)),
            out_bytes=float(rng.lognormal(math.log(4e6), 0.7)),
            fwd_launches=1, bwd_launches=1,
        ))
    tensors = []
    for i in range(n - 1):
        dsts = {i + 1}
        if i + 2 < n and rng.random() < 0.3:
            dsts.add(int(rng.integers(i + 2, n)))
        nb = ops[i].out_bytes
        tensors.append(TensorEdge(f"t{i}", i, tuple(sorted(dsts)), nb, nb / 4,
                                  grad=bool(rng.random() < 0.9),
                                  compressible=bool(rng.random() < 0.8)))
    graph = CostGraph(tuple(ops), tuple(tensors), name="synthetic")

    k = int(rng.integers(2, max_machines + 1))
    ngroups = int(rng.integers(1, min(3, k) + 1))
    group = [int(g) for g in rng.integers(0, ngroups, size=k)]
    intra = [float(rng.choice([1e9, 3e8, 1.25e9])) for _ in range(ngroups)]
    inter = float(rng.choice([1e7, 3e7, 1e8]))
    bw = np.empty((k, k))
    for a in range(k):
        for b in range(k):
            base = intra[group[a]] if group[a] == group[b] else inter
            bw[a, b] = base * float(rng.uniform(0.85, 1.15))
    total_static = 3 * sum(o.param_bytes for o in ops)
    machines = []
    for a in range(k):
        speed = float(rng.choice([1e12, 2e12, 4e12])) * float(rng.uniform(0.9, 1.1))
        mem = float(rng.uniform(0.5, 3.0)) * (total_static + 4e9) / max(1, k - 1)
        machines.append(MachineProfile(
            id=f"m{a}", flops={"matmul": speed, "other": speed / 3}, mem_bw=speed / 20,
            op_overhead_s=1e-5, memory_bytes=mem,
        ))
    rtt = rng.uniform(1e-4, 2e-2, size=(k, k))
    cluster = Cluster.build(machines, bw, (rtt + rtt.T) / 2)
    settings = JobSettings(micro_batch_size=int(rng.choice([1, 2])),
                           num_micro_batches=int(rng.choice([2, 4, 8, 16])),
                           schedule=str(rng.choice(["1f1b", "gpipe"])))  # type: ignore[arg-type]
    return Instance(graph, cluster, settings)


def restrict(inst: Instance, rng: np.random.Generator, kinds: int = 4) -> Instance:
    """`inst` with its ops named after `kinds` op kinds and each machine lacking a random
    subset of them (possibly none), as machines on different torch versions or with ops
    disabled by their operators are."""
    names = [f"aten.k{i}.default" for i in range(kinds)]
    ops = tuple(dataclasses.replace(o, op=str(rng.choice(names))) for o in inst.graph.ops)
    graph = CostGraph(ops, inst.graph.tensors, name=inst.graph.name)
    machines = []
    for m in inst.cluster.machines:
        lack = {x for x in names if rng.random() < 0.3}
        machines.append(dataclasses.replace(m, ops=frozenset(set(names) - lack) if lack
                                            else None))
    cluster = Cluster(tuple(machines), inst.cluster.bandwidth_bytes_per_s, inst.cluster.rtt_s)
    return Instance(graph, cluster, inst.settings)


def exhaustive(inst: Instance) -> tuple[float, tuple[tuple[int, int, int], ...]]:
    """Optimal predicted iteration time over all pipelines; (inf, ()) if none fits memory
    (with every stage on a machine that runs all of its ops)."""
    g, c, st = inst.graph, inst.cluster, inst.settings
    n, K = len(g.ops), len(c.machines)
    b, M = st.micro_batch_size, st.num_micro_batches
    times = np.stack([op_times(g, m, b) for m in c.machines])
    pre = np.concatenate([np.zeros((K, 1)), np.cumsum(times, 1)], 1)
    par = np.array([o.param_bytes for o in g.ops])
    opt = np.array([o.opt_state_bytes for o in g.ops])
    saved = np.array([o.saved_bytes for o in g.ops]) * b
    out = np.array([o.out_bytes for o in g.ops]) * b
    caps = np.array([m.memory_bytes * st.memory_fraction for m in c.machines])
    # [machine, p]: ops of [0, p) the machine cannot run (`MachineProfile.ops`)
    bad = np.array([[not m.runs(o.op) for o in g.ops] for m in c.machines]).reshape(K, n)
    badpre = np.concatenate([np.zeros((K, 1)), np.cumsum(bad, 1)], 1)
    mbw = np.array([m.mem_bw for m in c.machines])
    best = (math.inf, ())
    for r in range(1, min(K, n) + 1):
        comps = np.array([(0, *cut, n) for cut in itertools.combinations(range(1, n), r - 1)])
        C = len(comps)
        starts, stops = comps[:, :-1], comps[:, 1:]
        stage_of = np.stack([np.searchsorted(row[1:], np.arange(n), "right") for row in comps])
        sp = np.concatenate([[0], np.cumsum(2 * par + opt)])
        sv = np.concatenate([[0], np.cumsum(saved)])
        pp = np.concatenate([[0], np.cumsum(par)])
        infl = np.array([M if st.schedule == "gpipe" else min(M, r - s) for s in range(r)])
        outmax = np.array([[out[a:z].max() for a, z in itertools.pairwise(row)] for row in comps])
        mem = sp[stops] - sp[starts] + infl * (sv[stops] - sv[starts]) + outmax  # (C, r)
        pstage = pp[stops] - pp[starts]
        F = np.zeros((C, r, r))
        G = np.zeros((C, r, r))
        ci = np.arange(C)
        for t in g.tensors:
            f, bk = wire_bytes(t, b, 1.0, st)
            ps = stage_of[:, t.src]
            recv = np.zeros((C, r), dtype=bool)
            for d in t.dsts:
                recv[ci, stage_of[:, d]] = True
            recv[ci, ps] = False
            for s in range(r):
                sel = recv[:, s]
                F[ci[sel], ps[sel], s] += f
                G[ci[sel], ps[sel], s] += bk
        for perm in itertools.permutations(range(K), r):
            pm = np.array(perm)
            comp = pre[pm[None, :], stops] - pre[pm[None, :], starts]  # (C, r)
            ok = np.all(mem <= caps[pm][None, :], axis=1) & np.all(
                badpre[pm[None, :], stops] == badpre[pm[None, :], starts], axis=1)
            bwab = c.bandwidth_bytes_per_s[pm[:, None], pm[None, :]]
            with np.errstate(divide="ignore", invalid="ignore"):
                tf = np.where(F > 0, F / bwab[None], 0.0)
                tb = np.where(G > 0, G / bwab.T[None], 0.0)
            link = np.maximum(tf, tb).reshape(C, -1).max(axis=1) if r > 1 else np.zeros(C)
            bott = np.maximum(comp.max(axis=1), link)
            rtt = sum(c.rtt_s[pm[s], pm[s + 1]] for s in range(r - 1))
            fill = comp.sum(axis=1) + tf.reshape(C, -1).sum(1) + tb.reshape(C, -1).sum(1) + rtt
            optt = (pstage * st.optimizer_passes / mbw[pm][None, :]).max(axis=1)
            T = np.where(ok, (M - 1) * bott + fill + optt, np.inf)
            i = int(np.argmin(T))
            if T[i] < best[0]:
                best = (float(T[i]), tuple((int(pm[s]), int(starts[i, s]), int(stops[i, s]))
                                           for s in range(r)))
    return best
