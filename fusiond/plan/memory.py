"""The per-stage memory planner (issue 17, after AutoHete): for one stage on one machine, which
blocks to checkpoint, and whether its optimizer state and its parameters live on disk, so that
the stage fits a memory budget at the least added time.

A stage is a sequence of blocks (`fusiond.train.segments.block_starts`: a transformer block,
the embedding, the head), each with its parameters, optimizer state, the activations one
micro-batch saves for the backward, the bytes of its inputs, and its forward time. Model (the
runtime it prices: `SegmentRunner`, `DiskOptimizerState`, `DiskParameters`):

- activations: each of the `inflight` micro-batches keeps, per block, its saved activations
  (plain) or only its inputs (checkpointed); the backward of a checkpointed block holds that
  block's activations once more while it runs: `inflight * sum(kept) + max(saved of the
  checkpointed)`. A checkpointed block costs one more forward per micro-batch.
- optimizer state: in memory, or on disk, stepped a block at a time (`UPDATE_CHUNKS` blocks'
  state resident: the one stepping, the one being written back); it is read and written once
  per step at the disk's rate.
- parameters and gradients: in memory, or on disk (then the optimizer state too), with the
  working block's weights and gradients and the previous block's weights mapped at a time,
  and one block's weights, gradients and state while it steps; priced as read from disk twice per
  micro-batch (forward and backward) and the gradients read and written once per micro-batch,
  nothing assumed cached: an upper bound, as the page cache keeps what fits.
- plus the largest op output as workspace; the activations count `ACTIVATION_OVERHEAD` times
  the cost graph's bytes (the allocator's share, measured).
- two phases: the micro-batches (the static bytes, the activations, the workspace) and the
  update (the static bytes and a chunk of state on disk; the activations are gone). The peak
  is the larger.

`plan_stage_memory` tries the four placements; in each, which blocks to checkpoint is a
min-cost cover (the cheapest set of blocks whose checkpointing frees enough memory), solved by
dynamic programming over the memory to free in `MEMORY_QUANTUM` steps (rounded so the answer
never exceeds the budget), once for each cap on the largest checkpointed block. Exact up to
that rounding, and fast: 100 blocks plan in a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fusiond.plan.pipeline import GraphArrays

__all__ = ["ACTIVATION_OVERHEAD", "MEMORY_QUANTUM", "UPDATE_CHUNKS", "BlockCost",
           "MemoryChoice", "plan_stage_memory", "stage_blocks"]

ACTIVATION_OVERHEAD = 1.3
"""Resident bytes per byte of activations the cost graph counts: the allocator's own
(fragmentation between a forward's temporaries, chunk headers) and what a backward holds
besides the saved tensors. Measured by bench/memory.py's worker on GPT-2 (width 256, 30-97
layers, 256 tokens per micro-batch, the C heap trimmed after each backward): 1.13-1.31 (the
saved tensors themselves match the cost graph to 7 %); the planner takes the high end, so
that a plan errs on the side of fitting."""

UPDATE_CHUNKS = 2
"""Chunks of optimizer state (a block's each) an update on disk holds mapped at once: the one
stepping and the one still being written back (`fusiond.train.offload.WRITE_BEHIND_CHUNKS`,
1). The next one, read ahead, is in the page cache, which the kernel reclaims first."""

MEMORY_QUANTUM = 2048
"""Steps the memory to free is counted in, per solve (the budget's rounding)."""


@dataclass(frozen=True)
class BlockCost:
    """One block of a stage, per micro-batch where it says so."""

    param_bytes: float
    opt_bytes: float
    saved_bytes: float
    """Activations one micro-batch keeps for this block's backward."""
    in_bytes: float
    """What a checkpointed block keeps per micro-batch instead: its inputs."""
    fwd_s: float
    """Its forward on this machine, one micro-batch."""
    can_recompute: bool = True
    """False where a second forward is not exact (it updates a buffer)."""


@dataclass(frozen=True)
class MemoryChoice:
    """What the planner decided for one stage, and what it predicts."""

    recompute: tuple[bool, ...]
    offload_optimizer: bool
    offload_params: bool
    peak_bytes: float
    """Predicted peak of the stage's training state (not the process's own footprint)."""
    per_micro_s: float
    """Time the decisions add to each micro-batch: second forwards, the weights' disk reads."""
    per_step_s: float
    """Time they add once an iteration: the optimizer state's (and weights') trip to disk."""
    micro_batches: int
    fits: bool
    static_bytes: float = 0.0
    """The weights, gradients and optimizer state resident while the micro-batches run (on
    disk: the blocks mapped at a time)."""
    activation_bytes: float = 0.0
    """The activations the cost graph counts, before the allocator's share (kept per
    micro-batch in flight, and a checkpointed block's recomputed ones)."""
    update_bytes: float = 0.0
    """Resident while the optimizer steps (the activations are gone by then; a chunk of
    state on disk is in). `peak_bytes` = max(static + workspace + ACTIVATION_OVERHEAD x
    activations, update)."""

    @property
    def added_s(self) -> float:
        """Time per iteration the decisions add."""
        return self.micro_batches * self.per_micro_s + self.per_step_s

    @property
    def recomputed(self) -> int:
        return sum(self.recompute)

    @property
    def checkpoint_blocks(self) -> tuple[int, ...]:
        """The indices of the checkpointed blocks."""
        return tuple(i for i, f in enumerate(self.recompute) if f)


def _cover(saving: Sequence[float], cost: Sequence[float], need: float
           ) -> tuple[float, list[bool]] | None:
    """The cheapest subset whose savings sum to at least `need` (None: none does)."""
    n = len(saving)
    if need <= 0:
        return 0.0, [False] * n
    if sum(saving) < need:
        return None
    quantum = need / MEMORY_QUANTUM
    # a block's saving counted down to whole quanta, the need up: the choice never frees less
    units = [int(s // quantum) for s in saving]
    q = MEMORY_QUANTUM
    inf = float("inf")
    best = np.full(q + 1, inf)
    best[0] = 0.0
    take = np.zeros((n, q + 1), dtype=bool)
    for i in range(n):
        u = units[i]
        if u <= 0:
            continue
        # at least q' units with i taken: at least q' - u of them before it
        src = np.maximum(np.arange(q + 1) - u, 0)
        cand = best[src] + cost[i]
        better = cand < best
        take[i] = better
        best = np.where(better, cand, best)
    if not np.isfinite(best[q]):
        return None
    chosen = [False] * n
    level = q
    for i in range(n - 1, -1, -1):
        if level > 0 and take[i, level]:
            chosen[i] = True
            level = max(0, level - units[i])
    return float(best[q]), chosen


def _choose(blocks: Sequence[BlockCost], room: float, inflight: int
            ) -> tuple[float, tuple[bool, ...], float] | None:
    """Checkpoint flags that fit the activations in `room` bytes at the least added forward
    time: (added seconds per micro-batch, flags, activation bytes), or None."""
    plain = inflight * sum(b.saved_bytes for b in blocks)
    if plain <= room:
        return 0.0, tuple(False for _ in blocks), plain
    best: tuple[float, tuple[bool, ...], float] | None = None
    caps = sorted({b.saved_bytes for b in blocks if b.can_recompute})
    for cap in caps:
        eligible = [i for i, b in enumerate(blocks)
                    if b.can_recompute and b.saved_bytes <= cap]
        need = plain + cap - room
        saving = [inflight * max(0.0, blocks[i].saved_bytes - blocks[i].in_bytes)
                  for i in eligible]
        got = _cover(saving, [blocks[i].fwd_s for i in eligible], need)
        if got is None:
            continue
        cost, chosen = got
        flags = [False] * len(blocks)
        for i, c in zip(eligible, chosen, strict=True):
            flags[i] = c
        if not any(flags):
            continue
        act = inflight * sum(b.in_bytes if f else b.saved_bytes
                             for b, f in zip(blocks, flags, strict=True))
        act += max(b.saved_bytes for b, f in zip(blocks, flags, strict=True) if f)
        if act > room:  # the rounding never lets this happen; keep the check honest
            continue
        if best is None or cost < best[0]:
            best = (cost, tuple(flags), act)
    return best


def plan_stage_memory(blocks: Sequence[BlockCost], *, budget_bytes: float, micro_batches: int,
                      inflight: int, disk_bytes_per_s: float, workspace_bytes: float = 0.0,
                      allow_recompute: bool = True, allow_offload: bool = True,
                      allow_param_offload: bool = True,
                      disk_room_bytes: float = float("inf")) -> MemoryChoice:
    """The cheapest decisions that fit `budget_bytes` (see the module's docstring); where
    none fits, the one that needs least memory, with `fits` False. What goes to disk fits
    `disk_room_bytes` (`MachineProfile.disk_room_bytes`): the optimizer state, and with the
    weights their file and their gradients' (page-rounded: counted at their size)."""
    if not blocks:
        return MemoryChoice((), False, False, workspace_bytes, 0.0, 0.0, micro_batches,
                            workspace_bytes <= budget_bytes)
    params = sum(b.param_bytes for b in blocks)
    opt = sum(b.opt_bytes for b in blocks)
    # weights on disk, while the micro-batches run: the block at work's weights and
    # gradients and the weights of the one before (`DiskParameters` keeps two blocks mapped
    # in the forward, one in the backward; measured at most 2.2 blocks' worth on GPT-2)
    window = max(2 * b.param_bytes + (blocks[i - 1].param_bytes if i else 0.0)
                 for i, b in enumerate(blocks))
    # the update on disk: `UPDATE_CHUNKS` blocks' state at once (stepping, written back),
    # and with the weights on disk the stepping block's weights and gradients
    update_state = UPDATE_CHUNKS * max(b.opt_bytes for b in blocks)
    update_weights_on_disk = max(2 * b.param_bytes for b in blocks) + update_state
    placements = [(False, False)]
    if allow_offload and opt > 0 and opt <= disk_room_bytes:
        placements.append((True, False))
        if allow_param_offload and opt + 2 * params <= disk_room_bytes:
            placements.append((True, True))
    candidates: list[MemoryChoice] = []
    for off_opt, off_params in placements:
        # `static`: resident while the micro-batches run (with the activations); `update`:
        # while the optimizer steps (the activations are gone; a chunk of state on disk is in)
        if off_params:
            static, update = window, update_weights_on_disk
            micro_disk_s = 4 * params / disk_bytes_per_s
            disk_s = 2 * (params + opt) / disk_bytes_per_s
        elif off_opt:
            static, update = 2 * params, 2 * params + update_state
            micro_disk_s, disk_s = 0.0, 2 * opt / disk_bytes_per_s
        else:
            static = update = 2 * params + opt
            micro_disk_s, disk_s = 0.0, 0.0
        # the activations' model counts ACTIVATION_OVERHEAD times what the cost graph does
        room = (budget_bytes - static - workspace_bytes) / ACTIVATION_OVERHEAD
        if update > budget_bytes:
            room = -1.0  # not even the update fits
        plain_act = inflight * sum(b.saved_bytes for b in blocks)
        got = (_choose(blocks, room, inflight) if allow_recompute
               else (0.0, tuple(False for _ in blocks), plain_act) if plain_act <= room
               else None)
        if got is None:
            rc = tuple(b.can_recompute and allow_recompute for b in blocks)
            act = (inflight * sum(b.in_bytes if f else b.saved_bytes
                                  for b, f in zip(blocks, rc, strict=True))
                   + max((b.saved_bytes for b, f in zip(blocks, rc, strict=True) if f),
                         default=0.0))
            fwd = sum(b.fwd_s for b, f in zip(blocks, rc, strict=True) if f)
            candidates.append(MemoryChoice(rc, off_opt, off_params,
                                           max(static + workspace_bytes
                                               + ACTIVATION_OVERHEAD * act, update),
                                           fwd + micro_disk_s, disk_s, micro_batches, False,
                                           static, act, update))
            continue
        fwd, flags, act = got
        candidates.append(MemoryChoice(flags, off_opt, off_params,
                                       max(static + workspace_bytes
                                           + ACTIVATION_OVERHEAD * act, update),
                                       fwd + micro_disk_s, disk_s, micro_batches, True,
                                       static, act, update))
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (c.added_s, c.peak_bytes))
    return min(candidates, key=lambda c: c.peak_bytes)


def stage_blocks(arrays: GraphArrays, machine: int, start: int, stop: int
                 ) -> tuple[list[BlockCost], list[int]]:
    """The blocks of ops [start, stop) on `machine` (the cost graph's `block_starts` inside
    the range, the range's start first) and where each begins, as op positions."""
    g = arrays.graph
    starts = [start, *(p for p in (g.block_starts or range(len(g))) if start < p < stop)]
    ends = [*starts[1:], stop]
    in_bytes = arrays.in_bytes if arrays.settings.recompute else arrays.cut_bytes(1.0)[0]
    blocks = [
        BlockCost(
            param_bytes=float(arrays.param[a:b].sum()),
            opt_bytes=float(arrays.opt[a:b].sum()),
            saved_bytes=float(arrays.saved[a:b].sum()),
            in_bytes=float(in_bytes[a]),
            fwd_s=float(arrays.prefix_f[machine, b] - arrays.prefix_f[machine, a]),
        )
        for a, b in zip(starts, ends, strict=True)
    ]
    return blocks, starts
