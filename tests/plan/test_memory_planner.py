"""The per-stage memory planner (issue 17): per-block checkpointing chosen by a min-cost cover
that matches an exhaustive search, placements tried from cheapest to last resort, and the
blocks read off a real model's cost graph."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

from fusiond.graph.capture import capture
from fusiond.models.gpt2 import gpt2, lm_loss
from fusiond.plan import Cluster, GraphArrays, JobSettings, MachineProfile, cost_graph_from_ir
from fusiond.plan.memory import (
    ACTIVATION_OVERHEAD,
    BlockCost,
    _choose,
    plan_stage_memory,
    stage_blocks,
)
from protocol import ir


@pytest.fixture(scope="module")
def captured_gpt2_blocks() -> ir.Graph:
    torch.manual_seed(0)
    model = gpt2("tiny")
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    return capture(model, [x], targets=x, loss=lm_loss, dynamic=[{0: "batch"}, {0: "batch"}]
                   ).graph


def _brute(blocks: list[BlockCost], room: float, inflight: int) -> float | None:
    best: float | None = None
    for flags in itertools.product([False, True], repeat=len(blocks)):
        if any(f and not b.can_recompute for f, b in zip(flags, blocks, strict=True)):
            continue
        act = inflight * sum(b.in_bytes if f else b.saved_bytes
                             for b, f in zip(blocks, flags, strict=True))
        act += max((b.saved_bytes for b, f in zip(blocks, flags, strict=True) if f), default=0)
        if act <= room:
            cost = sum(b.fwd_s for b, f in zip(blocks, flags, strict=True) if f)
            best = cost if best is None else min(best, cost)
    return best


def test_checkpoint_choice_matches_exhaustive_search() -> None:
    rng = random.Random(7)
    for _ in range(300):
        blocks = [BlockCost(rng.uniform(1, 10), 0.0, rng.uniform(1, 20), rng.uniform(0.1, 3),
                            rng.uniform(0.1, 2), can_recompute=rng.random() > 0.1)
                  for _ in range(rng.randint(1, 7))]
        inflight = rng.randint(1, 3)
        room = rng.uniform(0, inflight * sum(b.saved_bytes for b in blocks) * 1.1)
        got = _choose(blocks, room, inflight)
        best = _brute(blocks, room, inflight)
        assert (got is None) == (best is None)
        if got is not None and best is not None:
            cost, flags, act = got
            assert act <= room  # never over the budget
            assert cost <= best * 1.02 + 1e-12  # optimal up to the memory rounding
            assert not any(f and not b.can_recompute
                           for f, b in zip(flags, blocks, strict=True))


def _blocks(n: int) -> list[BlockCost]:
    # a transformer-like stage: each block 3 MB of weights, 6 MB of state, 5 MB of activations
    # (0.1 MB of inputs), 5 ms of forward
    return [BlockCost(3e6, 6e6, 5e6, 0.1e6, 0.005) for _ in range(n)]


def test_placements_from_cheapest_to_last_resort() -> None:
    kw = {"micro_batches": 4, "inflight": 1, "disk_bytes_per_s": 500e6}
    blocks = _blocks(10)  # plain: 60 MB weights + grads, 60 MB state, 50 MB activations
    plain = plan_stage_memory(blocks, budget_bytes=200e6, **kw)
    assert plain.fits and not plain.recomputed and not plain.offload_optimizer
    assert plain.peak_bytes == pytest.approx(120e6 + ACTIVATION_OVERHEAD * 50e6)
    # 150 MB: checkpointing some blocks (20 ms each a step) is cheaper than the state's trip
    # to disk (240 ms)
    some = plan_stage_memory(blocks, budget_bytes=150e6, **kw)
    assert some.fits and 0 < some.recomputed < 10 and not some.offload_optimizer
    assert some.peak_bytes <= 150e6
    # 100 MB: the state must leave memory (and some blocks recompute)
    disk = plan_stage_memory(blocks, budget_bytes=100e6, **kw)
    assert disk.fits and disk.offload_optimizer and not disk.offload_params
    assert disk.peak_bytes <= 100e6
    # 40 MB: not even the weights fit: they go to disk too, about two blocks at a time
    weights = plan_stage_memory(blocks, budget_bytes=40e6, **kw)
    assert weights.fits and weights.offload_params and weights.offload_optimizer
    assert weights.peak_bytes <= 40e6
    assert weights.added_s > disk.added_s > some.added_s > 0
    # 10 MB: nothing fits; the answer needing least memory, marked so
    none = plan_stage_memory(blocks, budget_bytes=10e6, **kw)
    assert not none.fits and none.offload_params and none.peak_bytes > 10e6
    # what the job forbids is not chosen
    no_disk = plan_stage_memory(blocks, budget_bytes=100e6, allow_offload=False, **kw)
    assert not no_disk.offload_optimizer and no_disk.recomputed == 10 and not no_disk.fits


def test_a_hundred_blocks_plan_fast() -> None:
    blocks = [BlockCost(3e6, 6e6, 5e6 + i * 1e4, 0.1e6, 0.01 + i * 1e-4) for i in range(100)]
    t0 = time.perf_counter()
    for budget in (900e6, 700e6, 400e6):
        c = plan_stage_memory(blocks, budget_bytes=budget, micro_batches=4, inflight=2,
                              disk_bytes_per_s=500e6)
        assert c.fits and c.peak_bytes <= budget
    assert time.perf_counter() - t0 < 1.0


def test_blocks_of_a_captured_gpt2(captured_gpt2_blocks: ir.Graph) -> None:
    g = captured_gpt2_blocks
    cost = cost_graph_from_ir(g, {"batch": 4})
    starts = ir.block_starts(g)
    assert cost.block_starts == tuple(starts)
    paths = [ir.block_key(g.nodes[i].module_path) for i in starts]
    assert [p for p in paths if ".h." in p] == ["transformer.h.0", "transformer.h.1"]
    m = MachineProfile(id="m", flops={"other": 1e10}, mem_bw=1e10, op_overhead_s=1e-6,
                       memory_bytes=1e9)
    arrays = GraphArrays(cost, Cluster.build([m], [[1e9]]), JobSettings())
    blocks, at = stage_blocks(arrays, 0, 0, len(cost))
    assert at == starts
    assert sum(b.param_bytes for b in blocks) == pytest.approx(float(arrays.param.sum()))
    assert sum(b.saved_bytes for b in blocks) == pytest.approx(float(arrays.saved.sum()))
    # a stage from the middle: its first block starts where the stage does
    mid, at = stage_blocks(arrays, 0, starts[3] + 1, len(cost))
    assert at[0] == starts[3] + 1 and len(mid) == len(starts) - 3


def test_the_update_holds_what_the_runtime_holds() -> None:
    """The planner's chunks of state in an update are the runtime's: the one stepping and the
    ones its writer thread may still hold mapped."""
    from fusiond.plan.memory import UPDATE_CHUNKS
    from fusiond.train.offload import WRITE_BEHIND_CHUNKS
    assert UPDATE_CHUNKS == 1 + WRITE_BEHIND_CHUNKS


@pytest.mark.parametrize("budget_mib", [10_000, 60, 30, 12])
def test_a_choice_says_what_its_peak_is_made_of(budget_mib: int) -> None:
    """peak = the larger of the micro-batches' phase (static + workspace +
    ACTIVATION_OVERHEAD x activations) and the update's, whatever the placement: the parts
    bench/memory.py reports next to each measured peak."""
    mib = 2.0**20
    blocks = [BlockCost(param_bytes=2 * mib, opt_bytes=4 * mib, saved_bytes=3 * mib,
                        in_bytes=0.25 * mib, fwd_s=0.01) for _ in range(8)]
    c = plan_stage_memory(blocks, budget_bytes=budget_mib * mib, micro_batches=2, inflight=2,
                          disk_bytes_per_s=1e8, workspace_bytes=mib)
    assert c.peak_bytes == pytest.approx(max(
        c.static_bytes + mib + ACTIVATION_OVERHEAD * c.activation_bytes, c.update_bytes))
    params = sum(b.param_bytes for b in blocks)
    if not c.offload_optimizer:
        assert c.static_bytes == c.update_bytes == 2 * params + sum(b.opt_bytes for b in blocks)
    elif not c.offload_params:  # UPDATE_CHUNKS blocks' state in memory while it steps
        assert (c.static_bytes, c.update_bytes) == (2 * params, 2 * params + 8 * mib)
    else:  # a block's weights and gradients and the one before's weights; then the update's
        assert (c.static_bytes, c.update_bytes) == (6 * mib, 4 * mib + 8 * mib)
    if c.fits:
        assert c.peak_bytes <= budget_mib * mib
    assert c.activation_bytes >= 2 * sum(b.in_bytes for b in blocks)


def test_what_goes_to_disk_fits_the_disk() -> None:
    """The state goes to disk only where the disk has room for it, and the weights only where
    it has room for the state, the weights and their gradients; a stage that fits only with
    more on disk than that does not fit."""
    kw = {"micro_batches": 4, "inflight": 1, "disk_bytes_per_s": 500e6}
    blocks = _blocks(10)  # 60 MB weights + grads, 60 MB state, 50 MB activations
    state = sum(b.opt_bytes for b in blocks)
    weights = sum(b.param_bytes for b in blocks)
    assert plan_stage_memory(blocks, budget_bytes=100e6, **kw).offload_optimizer
    # room for the state only: no weights on disk even where they would have to go
    small = plan_stage_memory(blocks, budget_bytes=40e6, disk_room_bytes=state * 1.01, **kw)
    assert not small.fits and small.offload_optimizer and not small.offload_params
    enough = plan_stage_memory(blocks, budget_bytes=40e6,
                               disk_room_bytes=state + 2 * weights, **kw)
    assert enough.fits and enough.offload_params
    # no room at all: checkpointing only, and where that is not enough, nothing fits
    none = plan_stage_memory(blocks, budget_bytes=100e6, disk_room_bytes=0.0, **kw)
    assert not none.offload_optimizer and not none.fits
