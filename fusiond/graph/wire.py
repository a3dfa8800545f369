"""torch <-> numpy adapter for the protocol tensor codec (`protocol.tensors`), and the top-k edge.

A top-k edge: forward sends TOPK (the largest-magnitude values and their flat indices); the
receiver rebuilds the dense tensor, zeros elsewhere, i.e. `y = mask * x`. Backward sends VALUES:
the gradient at the kept indices only, which the sender scatters back, i.e. `dx = mask * dy`,
the exact gradient of `y = mask * x`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol import tensors as wire
from protocol.limits import DEFAULT_LIMITS, Limits


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU numpy view (or copy) of `t`; bfloat16 widens to float32 (numpy has none)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.contiguous().cpu().numpy()


def from_numpy(arr: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor owning its memory (decoded arrays may be read-only views of a receive buffer)."""
    t = torch.from_numpy(np.array(arr, copy=True))
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def encode_dense(t: torch.Tensor) -> bytes:
    """RAW (exact) encoding of a tensor."""
    return wire.encode(to_numpy(t), wire.Encoding.RAW).tobytes()


def decode_dense(buf: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode any dense-decodable encoding."""
    return from_numpy(wire.decode(buf, limits=limits))


@dataclass(frozen=True)
class TopKSent:
    """What a top-k forward leaves with the sender: the payload and the kept indices."""

    payload: bytes
    indices: np.ndarray


def topk_forward(t: torch.Tensor, density: float, value_dtype: str = "fp32") -> TopKSent:
    """Encode the top `density` fraction of `t` (by magnitude) as TOPK."""
    enc = wire.encode(to_numpy(t), wire.Encoding.TOPK, density=density, value_dtype=value_dtype)
    assert enc.indices is not None  # TOPK always exposes the kept indices
    return TopKSent(enc.tobytes(), np.asarray(enc.indices, dtype=np.int64))


def topk_receive(
    buf: bytes | memoryview, dtype: torch.dtype, limits: Limits = DEFAULT_LIMITS
) -> tuple[torch.Tensor, np.ndarray]:
    """Decode a TOPK payload: the dense tensor (zeros where dropped) and the kept indices."""
    dense, idx = wire.decode_with_indices(buf, limits=limits)
    if idx is None:
        from protocol.errors import RemoteProtocolError

        raise RemoteProtocolError("a top-k edge carried a tensor that is not TOPK-encoded")
    return from_numpy(dense, dtype), np.asarray(idx, dtype=np.int64)


def values_backward(grad: torch.Tensor, indices: np.ndarray, value_dtype: str = "fp32") -> bytes:
    """Encode the gradient at the forward's kept `indices` only (VALUES)."""
    return wire.encode_values(to_numpy(grad), indices, value_dtype).tobytes()


def values_receive(
    buf: bytes | memoryview,
    indices: np.ndarray,
    dtype: torch.dtype,
    limits: Limits = DEFAULT_LIMITS,
) -> torch.Tensor:
    """Decode a VALUES gradient against the kept indices: dense, zeros elsewhere."""
    return from_numpy(wire.decode(buf, limits=limits, indices=indices), dtype)
