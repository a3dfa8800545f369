"""PowerSGD-style low-rank gradients with error feedback (fusiond.train.lowrank)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.train.lowrank import (
    LowRankState,
    compressed,
    matrix_shape,
    orthonormalize,
    sent_fraction,
)


def reduce(states: list[LowRankState], name: str, grads: list[torch.Tensor]) -> torch.Tensor:
    """One step of the two-round exchange among `states` (slot order = list order): what
    every holder applies (asserted equal, bit for bit)."""
    ps = [s.p_factor(name, g) for s, g in zip(states, grads, strict=True)]
    p_sum = sum(ps[1:], ps[0].clone())
    qs = [s.q_factor(name, p_sum) for s in states]
    q_sum = sum(qs[1:], qs[0].clone())
    out = [s.gradient(name, q_sum, grads[0].shape) for s in states]
    for o in out[1:]:
        assert torch.equal(o, out[0])
    return out[0]


def test_which_parameters_travel_low_rank() -> None:
    assert matrix_shape((8,)) is None and matrix_shape(()) is None
    assert matrix_shape((4, 3, 2)) == (4, 6)
    assert compressed((256, 1024), 2) and not compressed((256,), 2)
    assert not compressed((4, 4), 2)  # 16 elements against 16 sent: no gain
    assert not compressed((3, 1000), 4)  # the rank reaches a side
    assert sent_fraction([(256, 1024)], 2) == 2 * (256 + 1024) / (256 * 1024)
    assert sent_fraction([(256, 1024), (256,)], None) == 1.0
    # a vector goes dense beside a compressed matrix
    assert sent_fraction([(256, 1024), (256,)], 2) == (2 * 1280 + 256) / (256 * 1024 + 256)


def test_orthonormalize_gives_orthonormal_columns_and_keeps_a_dead_one_zero() -> None:
    torch.manual_seed(0)
    q = orthonormalize(torch.randn(50, 4))
    torch.testing.assert_close(q.T @ q, torch.eye(4), atol=1e-6, rtol=0)
    p = torch.randn(20, 3)
    p[:, 1] = 2 * p[:, 0]  # no direction of its own
    q = orthonormalize(p)
    assert torch.count_nonzero(q[:, 1]) == 0
    torch.testing.assert_close(q[:, 2] @ q[:, 0], torch.tensor(0.0), atol=1e-6, rtol=0)


def test_the_gradient_is_the_sum_projected_and_each_holder_keeps_its_own_residual() -> None:
    torch.manual_seed(1)
    g = [torch.randn(30, 20), torch.randn(30, 20), torch.randn(30, 20)]
    states = [LowRankState(2, seed=7) for _ in g]
    fresh = LowRankState(2, seed=7)
    fresh.p_factor("w", g[0])
    q0 = fresh._params["w"].q.clone()  # the shared start: every holder draws the same Q
    got = reduce(states, "w", g)
    total = g[0] + g[1] + g[2]
    p_hat = orthonormalize(total @ q0)
    want = p_hat @ p_hat.T @ total
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for s, gi in zip(states, g, strict=True):
        err = s.error("w")
        assert err is not None
        torch.testing.assert_close(err, gi - p_hat @ p_hat.T @ gi, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 3), st.integers(1, 3), st.integers(0, 10_000))
def test_error_feedback_loses_nothing(holders: int, rank: int, seed: int) -> None:
    """Over any number of steps, what was applied plus what the holders still hold back is
    exactly what their gradients summed to (to float rounding)."""
    gen = torch.Generator().manual_seed(seed)
    states = [LowRankState(rank, seed=seed) for _ in range(holders)]
    applied = torch.zeros(12, 9, dtype=torch.float64)
    total = torch.zeros(12, 9, dtype=torch.float64)
    for _ in range(6):
        g = [torch.randn(12, 9, generator=gen) for _ in range(holders)]
        applied += reduce(states, "w", g).double()
        total += sum(x.double() for x in g)
    held = sum(s.error("w").double() for s in states)  # type: ignore[union-attr]
    torch.testing.assert_close(applied + held, total, atol=1e-4, rtol=1e-5)


def test_a_low_rank_gradient_comes_through_exact_once_the_factor_has_warmed_up() -> None:
    torch.manual_seed(3)
    a, b = torch.randn(40, 2), torch.randn(25, 2)
    g = a @ b.T  # rank 2
    states = [LowRankState(2), LowRankState(2)]
    for _ in range(3):
        got = reduce(states, "w", [g / 2, g / 2])
    torch.testing.assert_close(got, g, atol=1e-4, rtol=1e-4)
