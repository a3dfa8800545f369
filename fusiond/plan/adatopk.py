"""AdaTopK: per cut edge, the top-k density that keeps its link off the bottleneck.

Policy (docs/planner.md): the target is the pipeline's compute bottleneck, or what the links can
reach at the density floor if that is slower (exact edges cannot shrink). Each link slower than
the target gets the largest density d in [floor, 1] with link time(d) <= target, applied to all
compressible tensors on that link; every other link stays dense. Exact edges (user-marked or
non-float) are never compressed. Re-adaptation recomputes densities for new bandwidths on the
same cut and says whether a re-cut would be better by more than a threshold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fusiond.plan.model import Cluster, EdgeEncoding, TensorEdge, wire_bytes
from fusiond.plan.pipeline import (
    Evaluation,
    GraphArrays,
    LinkReport,
    Plan,
    StageSpec,
    evaluate,
)

_BISECT_STEPS = 40


def _link_time(
    tensors: list[TensorEdge], arrays: GraphArrays, d: float, fwd_bytes_per_s: float,
    bwd_bytes_per_s: float
) -> float:
    st = arrays.settings
    f = b = 0.0
    for t in tensors:
        tf, tb = wire_bytes(t, st.micro_batch_size, d, st)
        f += tf
        b += tb
    return max(f / fwd_bytes_per_s, b / bwd_bytes_per_s)


def _rates(lk: LinkReport) -> tuple[float, float]:
    """(forward, backward) bytes per second of a link."""
    return lk.bandwidth_fwd_bytes_per_s, lk.bandwidth_bwd_bytes_per_s


def adapt_densities(
    arrays: GraphArrays, stages: tuple[StageSpec, ...] | list[StageSpec]
) -> dict[tuple[str, int], float]:
    """Densities (tensor name, destination stage) -> d < 1 for the links that need them; none
    when the job's cut edges are quantized (`JobSettings.edge_encoding`: never also top-k)."""
    st = arrays.settings
    if st.edge_encoding != "raw":
        return {}
    floor = st.density_floor
    dense = evaluate(arrays, stages)
    by_name = {t.name: t for t in arrays.graph.tensors}

    def movable(lk: LinkReport) -> list[TensorEdge]:
        return [by_name[n] for n in lk.tensors]

    def exact(t: TensorEdge) -> TensorEdge:
        if t.name in st.exact_edges and t.compressible:
            return dataclasses.replace(t, compressible=False)
        return t

    per_link = {
        (lk.src_stage, lk.dst_stage): [exact(t) for t in movable(lk)] for lk in dense.links
    }
    target = dense.compute_bottleneck_s
    for lk in dense.links:
        ts = per_link[(lk.src_stage, lk.dst_stage)]
        target = max(target, _link_time(ts, arrays, floor, *_rates(lk)))
    out: dict[tuple[str, int], float] = {}
    for lk in dense.links:
        if lk.time_s <= target * (1 + 1e-9):
            continue
        ts = per_link[(lk.src_stage, lk.dst_stage)]
        lo, hi = floor, 1.0
        if _link_time(ts, arrays, lo, *_rates(lk)) > target * (1 + 1e-9):
            d = lo
        else:
            for _ in range(_BISECT_STEPS):
                mid = (lo + hi) / 2
                if _link_time(ts, arrays, mid, *_rates(lk)) <= target:
                    lo = mid
                else:
                    hi = mid
            d = lo
        for t in ts:
            if t.compressible:
                out[(t.name, lk.dst_stage)] = d
    return out


@dataclass(frozen=True)
class Readaptation:
    """Result of `readapt`: new densities on the same cut, and whether to re-cut."""

    densities: dict[tuple[str, int], float]
    evaluation: Evaluation
    recut_iteration_s: float | None
    recut_recommended: bool
    reason: str
    encodings: dict[tuple[str, int], EdgeEncoding] = field(default_factory=dict)
    """With the per-link codec choice (`JobSettings.codec_choice`): the quantized edges."""


def readapt(
    plan: Plan,
    cluster: Cluster,
    *,
    threshold: float = 0.1,
    replan: Callable[[GraphArrays], Plan] | None = None,
) -> Readaptation:
    """New densities for `plan`'s cut under `cluster`'s newly measured links (same machines).

    Without re-cutting; when `replan` is given (e.g. `lambda a: plan_opfence(...)`), also plans
    from scratch and recommends a re-cut if that predicts an iteration time more than
    `threshold` (a fraction) lower.
    """
    old = plan.arrays
    if cluster.ids() != old.cluster.ids():
        from fusiond.plan.model import PlanError

        raise PlanError("readapt: the cluster's machines changed; re-plan instead")
    arrays = GraphArrays.__new__(GraphArrays)
    arrays.__dict__.update(old.__dict__)
    arrays.cluster = cluster
    encs: dict[tuple[str, int], EdgeEncoding] = {}
    if arrays.settings.codec_choice:
        from fusiond.plan.codecs import choose_codecs

        ch = choose_codecs(arrays, plan.stages, refine=True)
        dens, encs = ch.densities, ch.encodings
    else:
        dens = adapt_densities(arrays, plan.stages)
    ev = evaluate(arrays, plan.stages, dens, encs)
    if replan is None:
        return Readaptation(dens, ev, None, False, "re-cut not evaluated", encs)
    fresh = replan(arrays)
    better = fresh.iteration_s < ev.iteration_s * (1 - threshold)
    gain = ev.iteration_s / fresh.iteration_s if fresh.iteration_s > 0 else float(np.inf)
    reason = (
        f"a re-cut predicts {fresh.iteration_s:.3g} s vs {ev.iteration_s:.3g} s "
        f"({gain:.2f}x); threshold {1 / (1 - threshold):.2f}x"
    )
    return Readaptation(dens, ev, fresh.iteration_s, better, reason, encs)
