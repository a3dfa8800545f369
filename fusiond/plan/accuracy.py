"""What each cut-edge codec costs in accuracy: the measured rule the per-link choice follows.

The per-link codec choice (`fusiond.plan.codecs`) may only pick a codec whose measured cost in
held-out loss is within the job's budget (`compression.accuracy_budget`, default 1 %). The
cost of each codec is measured, not assumed: `bench/compress.py` trains GPT-2 tiny cut in
three for 200 steps with the codec on every float cut edge, forward and backward, and scores
the dense weights on held-out data against the uncompressed run of the same seed (3 seeds;
docs/planner.md "Codecs" has the table). `MEASURED_GAP` is that table's median gap per codec;
`bench/compress.py` fails when a codec admitted here misses the budget in its own run, so the
rule and the measurement cannot drift apart silently.

Every codec is on every cut edge at once in that measurement, which is the worst case of a
plan (a plan compresses only the links that are slower than its bottleneck).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusiond.plan.model import (
    LOWRANK_DIVISOR,
    EdgeEncoding,
    PlanError,
    encoded_wire_bytes,
    topk_index_bytes,
)

__all__ = ["DEFAULT_ACCURACY_BUDGET", "MEASURED_GAP", "Choice", "admissible", "ladder",
           "most_compressing"]

DEFAULT_ACCURACY_BUDGET = 0.01
"""At most 1 % more held-out loss at equal steps than uncompressed (issue 22)."""

MEASURED_GAP: dict[tuple[EdgeEncoding, float | None], float] = {
    ("raw", None): 0.0,
    ("bf16", None): 0.0000,
    ("int8", None): 0.0000,
    ("int4", None): 0.0124,
    ("lowrank", None): 0.0498,
    ("raw", 0.5): 0.0130,
    ("raw", 0.25): 0.0516,
    ("raw", 0.1): 0.0969,
}
"""(encoding, top-k density or None) -> median relative held-out loss gap to uncompressed
(bench/compress.py, GPT-2 tiny, 3 stages, 200 steps, seeds 0-2; negative: no loss seen)."""

@dataclass(frozen=True)
class Choice:
    """One way a cut edge may travel: `encoding`, or top-k at `density` (then encoding is
    "raw"), with its measured accuracy cost and its forward bytes per fp32 element."""

    encoding: EdgeEncoding
    density: float | None
    gap: float
    bytes_per_element: float

    @property
    def label(self) -> str:
        return f"top-k {self.density:g}" if self.density is not None else self.encoding


def _bytes_per_element(encoding: EdgeEncoding, density: float | None) -> float:
    """Forward bytes per fp32 element, to order the ladder (low-rank: its P factor at rank
    features / 8 in bfloat16; its Q adds last_dim x r x 4 bytes per micro-batch)."""
    if encoding == "lowrank":
        return 2.0 / LOWRANK_DIVISOR
    if density is not None:
        return 2.0 * density + topk_index_bytes(1 << 20, density) / (1 << 20)
    return encoded_wire_bytes(1 << 20, encoding) / (1 << 20)


def admissible(encoding: str, density: float | None, budget: float) -> bool:
    """Whether the per-link choice may pick this codec under `budget`: measured, and its
    measured gap within the budget."""
    gap = next((g for (e, d), g in MEASURED_GAP.items() if e == encoding and d == density),
               None)
    return gap is not None and gap <= budget


def ladder(budget: float, density_floor: float = 0.0) -> list[Choice]:
    """The codecs the choice may pick under `budget`, least accuracy cost first (the first is
    always "raw", exact); top-k below `density_floor` is left out. A codec that costs more
    accuracy and sends no fewer bytes on a link than one before it is never picked: the
    choice takes the least lossy codec that suffices, or the one with the least link time
    (the bytes depend on the tensor: a low-rank factor's basis is per tensor)."""
    if not 0 <= budget < 1:
        raise PlanError(f"accuracy budget must be in [0, 1), got {budget}")
    out = sorted(
        (Choice(enc, d, gap, _bytes_per_element(enc, d))
         for (enc, d), gap in MEASURED_GAP.items()
         if gap <= budget and (d is None or d >= density_floor)),
        key=lambda c: (max(c.gap, 0.0), -c.bytes_per_element))
    assert out and out[0].encoding == "raw" and out[0].density is None
    return out


def most_compressing(budget: float, density_floor: float = 0.0) -> Choice:
    """The admitted codec that sends the fewest bytes per element (how OP-Fence's search
    costs a compressed cut)."""
    return min(ladder(budget, density_floor), key=lambda c: c.bytes_per_element)
