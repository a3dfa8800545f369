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


def choose_codecs(arrays: GraphArrays, stages: tuple[StageSpec, ...] | list[StageSpec]
                  ) -> LinkCodecs:
    """Each slow link's codec for `stages` (see the module's docstring)."""
    st = arrays.settings
    options = ladder(st.accuracy_budget, st.density_floor)
    dense = evaluate(arrays, stages)
    by_name = {t.name: t for t in arrays.graph.tensors}

    def tensors(lk: LinkReport) -> list[TensorEdge]:
        out = []
        for n in lk.tensors:
            t = by_name[n]
            if t.name in st.exact_edges and t.compressible:
                t = TensorEdge(t.name, t.src, t.dsts, t.nbytes, t.numel, t.grad, False)
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
