"""Low-rank gradient compression with error feedback (PowerSGD, Vogels et al. 2019) for the
gradients a stage's holders sum: replicas of a stage, and tied parameters.

For each compressed parameter (a matrix view `m x n` of its gradient, `m` the first dimension,
worth it when `rank * (m + n)` is well below `m * n`), every holder `w` of step t:

1. `M_w = g_w + e_w` (its gradient plus what compression left out before), `P_w = M_w Q`
   with `Q` the step's shared `n x rank` factor; the holders exchange their `P_w` and each
   sums them in slot order: `P = sum P_w`;
2. `P^ = orthonormalize(P)` (Gram-Schmidt in float64), `Q_w = M_w^T P^`; the holders
   exchange their `Q_w` and sum them in slot order: `Q = sum Q_w`;
3. the gradient is `P^ Q^T` (the sum of the holders' gradients projected on `P^`), the error
   `e_w = M_w - P^ Q_w^T` stays with `w` for its next step, and `Q` is the next step's factor
   (warm start).

Every holder starts from the same `Q` (drawn from a generator seeded by the parameter's name),
sums the same factors in the same order and builds the product from them in float64
(`_outer_sum`: each product of two float32 values is exact there, so only the order of the
rank's few additions could differ between CPUs, and then only a value within a float64
rounding of a float32 boundary rounds apart), so every holder applies the same gradient, bit
for bit where the holders compute float64 alike (as `orthonormalize`). Vectors and parameters
too small to gain travel dense (`compressed` is False for them).

What a holder's step costs (one thread of this Intel Xeon, GPT-2 mini's 19 MB of matrices;
a copy of them is 2 passes): the error added in place (2 passes), the two skinny products
(each short side first: `M Q`, `(P^T M)^T`), the float64 product by row blocks (about 5
passes whatever the rank) and the new error in place (`addmm_`: 2 passes). The float32 outer
products added one rank after another, as before, took 11 ms of the 29 at rank 4, and the
error as `M - P^ Q^T` 3-9 ms more (`LOWRANK_PASSES` in the planner carries what remains).

Each holder sends `rank * (m + n)` floats in two rounds instead of `m * n` in one: rank 2 of
a 256 x 1024 weight is 0.98 % of it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

__all__ = [
    "MIN_GAIN",
    "LowRankState",
    "compressed",
    "matrix_shape",
    "orthonormalize",
    "sent_fraction",
]

MIN_GAIN = 4.0
"""A parameter is compressed only when its dense size is at least this many times the two
factors a holder sends (below it, the second round's latency buys too little)."""


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The `m x n` view of a parameter of `shape` (first dimension by the rest), or None for
    a scalar or a vector."""
    if len(shape) < 2:
        return None
    m = shape[0]
    n = 1
    for d in shape[1:]:
        n *= d
    return m, n


def compressed(shape: tuple[int, ...], rank: int) -> bool:
    """Whether a parameter of `shape` travels as rank-`rank` factors."""
    mn = matrix_shape(shape)
    if mn is None:
        return False
    m, n = mn
    return rank < min(m, n) and m * n >= MIN_GAIN * rank * (m + n)


def sent_fraction(shapes: list[tuple[int, ...]], rank: int | None) -> float:
    """The share of the dense gradient's elements a holder sends for parameters of `shapes`
    (1.0 without compression)."""
    dense = sum(max(1, _numel(s)) for s in shapes)
    if rank is None or dense == 0:
        return 1.0
    sent = 0
    for s in shapes:
        mn = matrix_shape(s)
        sent += rank * (mn[0] + mn[1]) if mn is not None and compressed(s, rank) \
            else max(1, _numel(s))
    return sent / dense


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def orthonormalize(p: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """The columns of `p` (m x r) made orthonormal by Gram-Schmidt, in float64 (so holders on
    different CPUs agree to the last float32 bit but for rare ties), returned in `p`'s dtype.
    A column with no norm left stays zero."""
    q = p.detach().to(torch.float64).clone()
    for k in range(q.shape[1]):
        col = q[:, k]
        for j in range(k):
            col -= torch.dot(q[:, j], col) * q[:, j]
        norm = torch.linalg.vector_norm(col)
        if norm > eps:
            col /= norm
        else:
            col.zero_()
    return q.to(p.dtype)


_BLOCK_BYTES = 1 << 20
"""The float64 rows `_outer_sum` computes at a time (in cache, and no m x n float64 copy of a
large matrix in memory)."""


def _outer_sum(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """`p @ q.T` (m x r, n x r) in `p`'s dtype, computed in float64 by blocks of rows: each
    product of float32 values is exact in float64, so holders whose float64 sums of the r
    terms agree (the same order) get the same bits, and otherwise only where a value lies
    within a float64 rounding of a float32 boundary (as `orthonormalize`). 3x faster at rank
    4 than r float32 outer products added in order, which a matmul's blocking could not be
    trusted to reproduce. `out`: an m x n tensor of `p`'s dtype to write it into (memory
    already touched: a new m x n tensor's first writes fault its pages in, as long again as
    the product on this CPU)."""
    m, n = p.shape[0], q.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=p.dtype)
    p64 = p.detach().to(torch.float64)
    qt64 = q.detach().to(torch.float64).T
    rows = max(1, min(m, _BLOCK_BYTES // (8 * max(1, n))))
    buf = torch.empty(rows, n, dtype=torch.float64)
    for a in range(0, m, rows):
        b = min(m, a + rows)
        torch.matmul(p64[a:b], qt64, out=buf[: b - a])
        out[a:b].copy_(buf[: b - a])
    return out


@dataclass
class _Param:
    q: torch.Tensor
    """The shared n x r factor of this step (the last step's sum: warm start)."""
    error: torch.Tensor
    """What compression left out of this holder's gradient so far (m x n)."""
    m: torch.Tensor | None = None
    p_hat: torch.Tensor | None = None
    q_own: torch.Tensor | None = None


class LowRankState:
    """One holder's PowerSGD state: per compressed parameter, the shared factor and its own
    error; the three calls of one step go in order (`p_factor`, `q_factor`, `gradient`)."""

    def __init__(self, rank: int, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"a low-rank gradient needs rank >= 1, not {rank}")
        self.rank = rank
        self.seed = seed
        self._params: dict[str, _Param] = {}

    def p_factor(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Round 1: this holder's `P_w = (g_w + e_w) Q` (m x r) for `name`."""
        mn = matrix_shape(tuple(grad.shape))
        if mn is None:
            raise ValueError(f"{name}: a {tuple(grad.shape)} gradient has no matrix view")
        m, n = mn
        st = self._params.get(name)
        if st is None:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            q0 = torch.randn(n, self.rank, generator=gen, dtype=torch.float32)
            st = self._params[name] = _Param(q0.to(grad.dtype),
                                             torch.zeros(m, n, dtype=grad.dtype))
        # M = g + e in the error's own memory (the error is rebuilt from M in `gradient`)
        st.m = st.error.add_(grad.detach().reshape(m, n))
        return st.m @ st.q

    def q_factor(self, name: str, p_sum: torch.Tensor) -> torch.Tensor:
        """Round 2: from the holders' summed `P`, this holder's `Q_w = M_w^T P^` (n x r)."""
        st = self._params[name]
        assert st.m is not None, "p_factor first"
        st.p_hat = orthonormalize(p_sum)
        # (P^T M)^T: the short side first, 2x faster than M^T P^ at rank 4 on this CPU
        st.q_own = (st.p_hat.T @ st.m).T
        return st.q_own

    def gradient(self, name: str, q_sum: torch.Tensor, shape: torch.Size,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """The step's gradient of `name` from the holders' summed `Q` (every holder gets the
        same); this holder keeps its error and `Q` for the next step. `out`: a contiguous
        tensor of `shape` to write it into (the holder's own gradient, whose values
        `p_factor` has taken in), else a new one."""
        st = self._params[name]
        assert st.p_hat is not None and st.q_own is not None and st.m is not None, \
            "q_factor first"
        into = None
        if out is not None and out.is_contiguous() and out.dtype == st.m.dtype \
                and tuple(out.shape) == tuple(shape) and out.device == st.m.device:
            into = out.view(st.m.shape)
        grad = _outer_sum(st.p_hat, q_sum, into)
        # e = M - P^ Q_w^T in M's memory (the error's own): this holder's alone, any rounding
        st.error = st.m.addmm_(st.p_hat, st.q_own.T, alpha=-1)
        st.q = q_sum.clone()
        st.m = st.p_hat = st.q_own = None
        return grad.reshape(shape)

    def error(self, name: str) -> torch.Tensor | None:
        """What compression has left out of this holder's gradient of `name` (None: never
        compressed); between `p_factor` and `gradient`, the error plus the step's gradient."""
        st = self._params.get(name)
        return None if st is None else st.error
