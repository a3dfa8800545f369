"""The per-link codec choice: AdaTopK's successor (docs/planner.md "Codecs").

For a cut, each link slower than the pipeline's target gets the codec, among those the job's
accuracy budget admits (`fusiond.plan.accuracy.ladder`: least measured held-out loss cost
first), that costs the least accuracy and still brings the link within the target; when none
does, the one that sends the fewest bytes (the link stays the bottleneck, and the plan says
so: it is the budget, not the planner, that keeps it there). The target is the pipeline's
compute bottleneck, or what the links can reach with the most compressing admitted codec if
that is slower, as AdaTopK's. Every compressible tensor on a link gets that link's codec;
exact edges (user-marked or non-float) are never compressed; links within the target stay
exact.

The choice is the same function of the same measurements whenever it runs, so re-adaptation
(`readapt` with `codec_choice`) is this choice on the newly measured links.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fusiond.plan.accuracy import Choice, ladder
from fusiond.plan.model import EdgeEncoding, TensorEdge, wire_bytes
from fusiond.plan.pipeline import GraphArrays, LinkReport, StageSpec, evaluate

__all__ = ["LinkCodecs", "choose_codecs"]


@dataclass(frozen=True)
class LinkCodecs:
    """The choice for one plan: top-k `densities` and quantized `encodings`, both by
    (tensor name, destination stage); `labels` names each compressed link's codec by
    (source stage, destination stage)."""

    densities: dict[tuple[str, int], float]
    encodings: dict[tuple[str, int], EdgeEncoding]
    labels: dict[tuple[int, int], str]


def _link_time(tensors: list[TensorEdge], arrays: GraphArrays, c: Choice, lk: LinkReport
               ) -> float:
    st = arrays.settings
    f = b = 0.0
    for t in tensors:
        tf, tb = wire_bytes(t, st.micro_batch_size, c.density or 1.0, st,
                            None if c.density is not None else c.encoding)
        f += tf
        b += tb
    return max(f / lk.bandwidth_fwd_bytes_per_s, b / lk.bandwidth_bwd_bytes_per_s)


REFINE_TOLERANCE = 0.005
"""`refine`: a codec that predicts an iteration within 0.5 % of the fastest choice for its link
counts as fast as it (the least lossy of those wins)."""


def choose_codecs(arrays: GraphArrays, stages: tuple[StageSpec, ...] | list[StageSpec], *,
                  refine: bool = False) -> LinkCodecs:
    """Each slow link's codec for `stages` (see the module's docstring). With `refine`, then
    every link (the slow ones first) gets, among the admitted codecs, the least lossy one
    whose predicted iteration is within `REFINE_TOLERANCE` of the fastest: a link that is not
    the bottleneck still adds its time to the pipeline's fill (one micro-batch through every
    stage and link), which a codec the budget admits may cut. OP-Fence's search scores cuts
    without it (one evaluation per cut) and refines the plan it keeps."""
    out = _bottleneck_rule(arrays, stages)
    return _refined(arrays, stages, out) if refine else out


def _refined(arrays: GraphArrays, stages: tuple[StageSpec, ...] | list[StageSpec],
             out: LinkCodecs) -> LinkCodecs:
    st = arrays.settings
    options = ladder(st.accuracy_budget, st.density_floor)
    if len(options) < 2:
        return out
    dense = evaluate(arrays, stages)
    by_name = {t.name: t for t in arrays.graph.tensors}
    dens, encs, labels = dict(out.densities), dict(out.encodings), dict(out.labels)
    pairs = sorted({(lk.src_stage, lk.dst_stage): lk.time_s for lk in dense.links}.items(),
                   key=lambda kv: -kv[1])
    for (src, dst), _ in pairs:
        names = [n for lk in dense.links if (lk.src_stage, lk.dst_stage) == (src, dst)
                 for n in lk.tensors]
        movable = [n for n in dict.fromkeys(names)
                   if by_name[n].compressible and n not in st.exact_edges]
        if not movable:
            continue
        trials = []
        for c in options:
            d2 = {k: v for k, v in dens.items() if not (k[1] == dst and k[0] in movable)}
            e2 = {k: v for k, v in encs.items() if not (k[1] == dst and k[0] in movable)}
            for n in movable:
                if c.density is not None:
                    d2[(n, dst)] = c.density
                elif c.encoding != "raw":
                    e2[(n, dst)] = c.encoding
            trials.append((evaluate(arrays, stages, d2, e2).iteration_s, c, d2, e2))
        fastest = min(t[0] for t in trials)
        _, c, dens, encs = next(t for t in trials if t[0] <= fastest * (1 + REFINE_TOLERANCE))
        if c.density is None and c.encoding == "raw":
            labels.pop((src, dst), None)
        else:
            labels[(src, dst)] = c.label
    return LinkCodecs(dens, encs, labels)


def _bottleneck_rule(arrays: GraphArrays, stages: tuple[StageSpec, ...] | list[StageSpec]
                     ) -> LinkCodecs:
    st = arrays.settings
    options = ladder(st.accuracy_budget, st.density_floor)
    dense = evaluate(arrays, stages)
    by_name = {t.name: t for t in arrays.graph.tensors}

    def tensors(lk: LinkReport) -> list[TensorEdge]:
        out = []
        for n in lk.tensors:
            t = by_name[n]
            if t.name in st.exact_edges and t.compressible:
                t = dataclasses.replace(t, compressible=False)
            out.append(t)
        return out

    per_link = {(lk.src_stage, lk.dst_stage): tensors(lk) for lk in dense.links}
    target = dense.compute_bottleneck_s
    for lk in dense.links:
        ts = per_link[(lk.src_stage, lk.dst_stage)]
        target = max(target, min(_link_time(ts, arrays, c, lk) for c in options))
    bound = target * (1 + 1e-9)
    out = LinkCodecs({}, {}, {})
    for lk in dense.links:
        if lk.time_s <= bound:
            continue
        ts = per_link[(lk.src_stage, lk.dst_stage)]
        fits = [c for c in options if _link_time(ts, arrays, c, lk) <= bound]
        pick = fits[0] if fits else min(options, key=lambda c: _link_time(ts, arrays, c, lk))
        if pick.density is None and pick.encoding == "raw":
            continue
        out.labels[(lk.src_stage, lk.dst_stage)] = pick.label
        for t in ts:
            if not t.compressible:
                continue
            if pick.density is not None:
                out.densities[(t.name, lk.dst_stage)] = pick.density
            else:
                out.encodings[(t.name, lk.dst_stage)] = pick.encoding
    return out
