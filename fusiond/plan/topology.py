"""Clusters from a compact description (the bench's reference topologies, the WAN testbed).

A topology is a JSON-able mapping (no I/O here: the caller reads the file)::

    {"name": ..., "kinds": {KIND: {"flops": {"matmul": F, ...}, "mem_bw": B,
                                     "op_overhead_s": S, "memory_gib": G}},
     "groups": [{"name": ..., "kind_counts": {KIND: N, ...}, "mbit": INTRA, "rtt_ms": R}],
     "inter_mbit": [[...]] (group x group), "inter_rtt_ms": [[...]],
     "order": "grouped" | "interleaved"}

Machine ids are `m00`, `m01`, ... in the order given by `order` ("interleaved" deals machines
round-robin over the groups, so neighbouring ids sit behind slow links).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fusiond.plan.model import Cluster, MachineProfile, PlanError
from fusiond.units import bytes_per_s_from_bits_per_s


def cluster_from_topology(spec: Mapping[str, Any]) -> tuple[Cluster, list[int]]:
    """The cluster and each machine's group index. Raises PlanError naming a bad field."""
    try:
        kinds = spec["kinds"]
        groups = spec["groups"]
        inter = np.array(spec["inter_mbit"], dtype=np.float64)
        inter_rtt = np.array(spec.get("inter_rtt_ms", np.zeros_like(inter)), dtype=np.float64)
        members: list[list[tuple[str, int]]] = []
        for gi, g in enumerate(groups):
            members.append([(k, gi) for k, n in g["kind_counts"].items() for _ in range(int(n))])
        if spec.get("order", "grouped") == "interleaved":
            flat: list[tuple[str, int]] = []
            depth = max(len(m) for m in members)
            for i in range(depth):
                flat += [m[i] for m in members if i < len(m)]
        else:
            flat = [x for m in members for x in m]
        machines = []
        for i, (kind, _gi) in enumerate(flat):
            k = kinds[kind]
            machines.append(MachineProfile(
                id=f"m{i:02d}", flops={c: float(v) for c, v in k["flops"].items()},
                mem_bw=float(k["mem_bw"]), op_overhead_s=float(k["op_overhead_s"]),
                memory_bytes=float(k["memory_gib"]) * 2**30, kind=kind,
            ))
        n = len(flat)
        bw_bytes_per_s = np.empty((n, n))
        rtt_s = np.zeros((n, n))
        for a, (_, ga) in enumerate(flat):
            for b, (_, gb) in enumerate(flat):
                if ga == gb:
                    mbit = float(groups[ga]["mbit"])
                    rtt_s[a, b] = float(groups[ga].get("rtt_ms", 0.0)) / 1e3
                else:
                    mbit = float(inter[ga, gb])
                    rtt_s[a, b] = inter_rtt[ga, gb] / 1e3
                bw_bytes_per_s[a, b] = bytes_per_s_from_bits_per_s(mbit * 1e6)
        return Cluster.build(machines, bw_bytes_per_s, rtt_s), [g for _, g in flat]
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise PlanError(f"topology {spec.get('name', '?')!r}: bad or missing field ({e!r})") from e
