"""Edge codec: torch tensors <-> wire payloads through `protocol.tensors`.

An exact edge travels RAW (fp32 stays fp32, so an uncompressed pipeline is bit-identical to
local autograd). A top-k edge travels TOPK forward and VALUES backward: the gradient only at the
indices the forward kept, which is the exact gradient of `y = mask * x`. An int8 edge travels
INT8 both ways (`encode_int8`: per-block absmax, `protocol.tensors.DEFAULT_BLOCK_SIZE` elements
per float32 scale) and decodes dense: straight-through, the gradient with respect to the
dequantized activation is taken as the activation's gradient.

A bfloat16 tensor (a stage computing in bf16, `StageConfig.precision`) travels as BF16, its
16 bits exactly (numpy has no bfloat16: the encoder takes its float32 value, which rounds back
to itself), and decodes back to bfloat16: the wire dtype follows the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from fusiond.plan.model import EDGE_ENCODINGS, EdgeEncoding, lowrank_rank
from protocol import tensors as wire
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "EDGE_ENCODINGS",
    "EdgeCodec",
    "EdgeEncoding",
    "EdgeIn",
    "Encoded",
    "decode_any",
    "decode_dense",
    "decode_edge",
    "decode_topk",
    "decode_values",
    "encode_bf16",
    "encode_concat",
    "encode_dense",
    "encode_edge",
    "encode_int4",
    "encode_int8",
    "encode_lowrank",
    "encode_topk",
    "encode_values",
    "lowrank_applies",
    "project",
    "topk_count",
    "unproject",
]


# How a cut edge travels when it is not top-k (one definition, the planner's: it costs them):
# "raw" (exact), "bf16", "int8" or "int4", both directions, decoded dense. The lossy ones are
# straight-through: the receiver computes on the decoded tensor, and the gradient with respect
# to it is taken as the activation's gradient (the exact gradient of the compressed forward,
# the quantizer passed as identity).


@dataclass(frozen=True)
class EdgeCodec:
    """How one cut edge travels: top-k at `density` (then `encoding` is "raw"), or `encoding`
    (exact when "raw" and no density)."""

    encoding: EdgeEncoding = "raw"
    density: float | None = None

    def __post_init__(self) -> None:
        if self.encoding not in EDGE_ENCODINGS:
            raise ValueError(f"encoding {self.encoding!r} is not one of {list(EDGE_ENCODINGS)}")
        if self.density is not None:
            if not 0.0 < self.density < 1.0:
                raise ValueError(f"top-k density {self.density} not in (0, 1)")
            if self.encoding != "raw":
                raise ValueError(f"a {self.encoding} edge is never also top-k")

    @property
    def label(self) -> str:
        """"top-k 0.25", "int8", ... ("raw": exact)."""
        return f"top-k {self.density:g}" if self.density is not None else self.encoding


@dataclass(frozen=True)
class Encoded:
    """One encoded tensor: the gather list `protocol.tensors` built (`parts`, sent as they are:
    a RAW part references the tensor's own memory), how many bytes they make, and the dense
    size. Safe without a copy because a stage never modifies a tensor it has sent: outputs and
    input gradients are fresh per micro-batch, and a parameter gradient that leaves in an
    exchange (`encode_concat`) stops being the parameter's `.grad` (the sum takes its place,
    so zeroing gradients in place between steps never reaches it; gradients in files leave
    through a copy); the parts keep the memory alive until the bytes are written."""

    parts: tuple[memoryview, ...]
    nbytes: int
    dense_nbytes: int

    @property
    def buffers(self) -> Sequence[memoryview]:
        """The gather list for `PeerNetwork.send` (no copy)."""
        return self.parts

    @property
    def payload(self) -> bytes:
        """The encoding as one bytes object (a copy: for in-memory links and tests)."""
        return b"".join(self.parts)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has none: its float32 value, exactly
        t = t.float()
    return t.contiguous().cpu().numpy()


def _encoded(enc: wire.EncodedTensor, dense_nbytes: int) -> Encoded:
    parts = tuple(enc.buffers())
    return Encoded(parts, sum(p.nbytes for p in parts), dense_nbytes)


def topk_count(numel: int, density: float) -> int:
    """How many elements a top-k edge of `density` keeps (at least one)."""
    return max(1, min(numel, round(numel * density)))


def encode_dense(t: torch.Tensor) -> Encoded:
    """RAW encoding: exact, every element. Float data goes out as it is: lz4 saves nothing on
    it (docs/tensor-codec.md), and sampling it to find that out was a fifth of a small
    activation's encode (issue 15); integer data (token ids, masks) may still shrink."""
    arr = _np(t)
    if t.dtype == torch.bfloat16:  # its own 16 bits (dense_nbytes: its bf16 size)
        return _encoded(wire.encode(arr, wire.Encoding.BF16), arr.nbytes // 2)
    enc = wire.encode(arr, wire.Encoding.RAW,
                      compress="none" if t.dtype.is_floating_point else "auto")
    return _encoded(enc, arr.nbytes)


def encode_concat(ts: Sequence[torch.Tensor]) -> Encoded:
    """RAW encoding of the float32 tensors `ts` flattened one after the other, as
    `encode_dense(torch.cat([t.reshape(-1) for t in ts]))` encodes them, without the copy:
    the parts are each tensor's own memory (a gradient exchange's bucket; the caller must not
    modify the tensors until the bytes are written)."""
    if any(t.dtype != torch.float32 for t in ts):
        raise ValueError("encode_concat takes float32 tensors")
    arrs = [_np(t) for t in ts]
    return _encoded(wire.encode_concat(arrs), sum(a.nbytes for a in arrs))


def encode_int8(t: torch.Tensor, *, stochastic: bool = False, seed: int = 0) -> Encoded:
    """INT8 encoding: per-block absmax quantization, one float32 scale per
    `protocol.tensors.DEFAULT_BLOCK_SIZE` elements; every element within absmax(block) / 254
    of its value (stochastic rounding, `seed`: within absmax(block) / 127, unbiased). Decodes
    dense (`decode_dense` / `decode_any`)."""
    arr = _np(t)
    if stochastic:
        enc = wire.encode(arr, wire.Encoding.INT8, block_size=wire.DEFAULT_BLOCK_SIZE,
                          stochastic=True, seed=seed)
    else:
        enc = wire.encode(arr, wire.Encoding.INT8, block_size=wire.DEFAULT_BLOCK_SIZE)
    return _encoded(enc, arr.nbytes)


def encode_int4(t: torch.Tensor, *, stochastic: bool = False, seed: int = 0) -> Encoded:
    """INT4 encoding: per-block absmax quantization to [-7, 7], one float32 scale per
    `protocol.tensors.DEFAULT_BLOCK_SIZE` elements; nearest rounding puts every element within
    absmax(block) / 14 of its value, stochastic rounding (`seed`) within absmax(block) / 7 and
    unbiased. Decodes dense."""
    arr = _np(t)
    enc = wire.encode(arr, wire.Encoding.INT4, block_size=wire.DEFAULT_BLOCK_SIZE,
                      stochastic=stochastic, seed=seed)
    return _encoded(enc, arr.nbytes)


def encode_bf16(t: torch.Tensor) -> Encoded:
    """BF16 encoding of a float tensor: its value rounded to bfloat16 (relative error at most
    2^-9). Decodes to bfloat16; the receiving stage computes in its own precision."""
    arr = _np(t)
    return _encoded(wire.encode(arr, wire.Encoding.BF16, compress="none"), arr.nbytes)


def lowrank_applies(t: torch.Tensor) -> bool:
    """Whether a low-rank edge factorizes `t` (a float tensor with a last axis of 2 or more
    and rows to factor); anything else travels raw."""
    return t.dtype.is_floating_point and t.dim() >= 2 and t.shape[-1] >= 2 and t.numel() > 0


def encode_lowrank(t: torch.Tensor, seed: int = 0) -> tuple[Encoded, np.ndarray]:
    """LOWRANK encoding of `t` viewed as rows x its last axis: P (bfloat16) and Q (float32,
    orthonormal columns) with t ≈ P Q^T at rank `fusiond.plan.model.lowrank_rank`; returns Q,
    which the sender keeps to turn the answer G Q back into G Q Q^T."""
    arr = _np(t)
    n = arr.shape[-1]
    r = min(lowrank_rank(n), arr.size // n, n)
    enc = wire.encode(arr, wire.Encoding.LOWRANK, k=r, value_dtype="bf16", seed=seed)
    assert enc.basis is not None, "protocol.tensors LOWRANK must expose its basis"
    return _encoded(enc, arr.nbytes), np.asarray(enc.basis, dtype=np.float32)


def project(g: torch.Tensor, q: np.ndarray) -> torch.Tensor:
    """G Q: a low-rank edge's gradient G (rows x features) on the forward's basis Q, what the
    receiver sends back (rows x r)."""
    return g.reshape(-1, g.shape[-1]).float() @ torch.from_numpy(q)


def unproject(gq: torch.Tensor, q: np.ndarray, shape: torch.Size) -> torch.Tensor:
    """G Q Q^T in `shape`: the exact gradient of the low-rank forward X Q Q^T with Q held
    fixed, from the receiver's G Q."""
    return (gq.float() @ torch.from_numpy(q).T).reshape(shape)


def encode_edge(t: torch.Tensor, encoding: EdgeEncoding, *, stochastic: bool = False,
                seed: int = 0) -> Encoded:
    """A dense-decodable cut-edge tensor as `encoding` says (integer tensors always RAW).
    `stochastic` (int8, int4): unbiased stochastic rounding drawn from `seed`, for gradients.
    "lowrank" is not dense-decodable on its own (the receiver answers on the basis):
    `encode_lowrank`."""
    if encoding == "raw" or not t.dtype.is_floating_point:
        return encode_dense(t)
    if encoding == "lowrank":
        raise ValueError("a low-rank edge is encoded with encode_lowrank (it returns its basis)")
    if encoding == "bf16":
        return encode_bf16(t)
    if encoding == "int8":
        return encode_int8(t, stochastic=stochastic, seed=seed)
    if encoding == "int4":
        return encode_int4(t, stochastic=stochastic, seed=seed)
    raise ValueError(f"unknown edge encoding {encoding!r}; one of {list(EDGE_ENCODINGS)}")


def encode_topk(
    t: torch.Tensor, density: float, per_row: bool = True
) -> tuple[Encoded, np.ndarray]:
    """TOPK encoding of the largest-magnitude `density` fraction; returns the kept flat indices.

    `per_row` (the default for tensors of rank >= 2) keeps the top `density` of every row of the
    last axis, i.e. of every token's or pixel's features: a global top-k can drop whole rows,
    and measured on GPT-2 tiny at density 0.1 per-row converges closer to the dense run.
    """
    arr = _np(t)
    if per_row and arr.ndim >= 2 and arr.shape[-1] > 0:
        k = topk_count(arr.shape[-1], density)
        enc = wire.encode(arr, wire.Encoding.TOPK, k=k, per_row=True)
    else:
        enc = wire.encode(arr, wire.Encoding.TOPK, k=topk_count(arr.size, density))
    assert enc.indices is not None, "protocol.tensors TOPK must expose the kept indices"
    return _encoded(enc, arr.nbytes), np.asarray(enc.indices, dtype=np.int64)


def encode_values(grad: torch.Tensor, indices: np.ndarray) -> Encoded:
    """VALUES encoding: the gradient at the forward's kept `indices` only."""
    arr = _np(grad)
    enc = wire.encode_values(arr, indices)
    return _encoded(enc, arr.nbytes)


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A decoded array as a tensor autograd may own. RAW decodes as a view of the received
    buffer: a read-only one (bytes) is copied, a writable and aligned one (the bytearray a
    daemon's stage receives into, which nothing else holds) is used as it is (issue 15: the
    second copy of every received activation); what other encodings decode is fresh memory."""
    if arr.flags.writeable and arr.flags.aligned:
        return torch.from_numpy(arr)
    return torch.from_numpy(np.array(arr, copy=True))


def _typed(dense: np.ndarray, desc: wire.TensorDescriptor) -> torch.Tensor:
    """The decoded tensor in its sender's dtype: a BF16-encoded one was bfloat16."""
    t = _tensor(dense)
    return t.to(torch.bfloat16) if desc.encoding is wire.Encoding.BF16 else t


def decode_dense(payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Decode any dense-decodable encoding into a fresh tensor."""
    dense, _, desc = wire.decode_described(payload, limits=limits)
    return _typed(dense, desc)


def decode_topk(
    payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[torch.Tensor, np.ndarray]:
    """Decode a TOPK payload: the dense tensor (zeros where dropped) and the kept indices.

    The receiver needs the indices to answer with a VALUES gradient: the flat positions the
    encoding carries.
    """
    dense, indices = wire.decode_with_indices(payload, limits=limits)
    if indices is None:
        raise RemoteProtocolError("a top-k edge carried a tensor that is not TOPK-encoded")
    return _tensor(dense), np.asarray(indices, dtype=np.int64)


def decode_any(
    payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[torch.Tensor, np.ndarray | None]:
    """Decode whatever the sender chose: dense, or TOPK with its kept indices (else None).

    The receiver follows the payload, so a sender may change an edge's density between any two
    micro-batches without telling the receiver first.
    """
    dense, indices, desc = wire.decode_described(payload, limits=limits)
    idx = None if indices is None else np.asarray(indices, dtype=np.int64)
    return _typed(dense, desc), idx


_EDGE_OF_WIRE: dict[wire.Encoding, EdgeEncoding] = {
    wire.Encoding.RAW: "raw", wire.Encoding.FP16: "raw", wire.Encoding.BF16: "bf16",
    wire.Encoding.INT8: "int8", wire.Encoding.INT4: "int4", wire.Encoding.LOWRANK: "lowrank",
}


class EdgeIn(NamedTuple):
    """A decoded cut-edge tensor and how to answer it: `indices` (TOPK: answer with VALUES
    there), `basis` (LOWRANK: answer with G Q on it), `encoding` (answer a dense one so)."""

    tensor: torch.Tensor
    indices: np.ndarray | None
    basis: np.ndarray | None
    encoding: EdgeEncoding


def decode_edge(payload: bytes | memoryview, limits: Limits = DEFAULT_LIMITS) -> EdgeIn:
    """`decode_any`, and how the receiver answers: TOPK with VALUES at its indices, LOWRANK
    with the gradient on its basis, a dense encoding with the same encoding (`encode_edge`),
    so only the sender of an edge needs to know its codec and may change it between any two
    micro-batches."""
    got = wire.decode_full(payload, limits=limits)  # one parse of the descriptor
    if got.basis is not None:
        return EdgeIn(_tensor(got.dense), None, got.basis, "lowrank")
    idx = None if got.indices is None else np.asarray(got.indices, dtype=np.int64)
    return EdgeIn(_typed(got.dense, got.descriptor), idx, None,
                  _EDGE_OF_WIRE.get(got.descriptor.encoding, "raw"))


def decode_values(
    payload: bytes | memoryview, indices: np.ndarray, limits: Limits = DEFAULT_LIMITS
) -> torch.Tensor:
    """Decode a VALUES payload against the indices the forward kept; dense, zeros elsewhere."""
    return _tensor(wire.decode(payload, limits=limits, indices=indices))


# -- compression on the tensor's own device (a GPU stage) ---------------------------------------

ToHost = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Copies device tensors to host memory, finished on return (`StagePlace.host`)."""

_WIRE_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.bfloat16: "float32",  # bf16 is described as its f32 value
    torch.float16: "float16", torch.float64: "float64"}


def reduces_on_device(t: torch.Tensor, density: float | None, encoding: EdgeEncoding) -> bool:
    """Whether a cut edge's forward tensor is compressed where it lies (an accelerator), so
    only the compressed arrays cross to the host: top-k, and int8 rounded to nearest."""
    return (t.device.type == "cuda" and t.dtype in _WIRE_DTYPE_NAMES
            and (density is not None or encoding == "int8"))


def _dense_nbytes(t: torch.Tensor) -> int:
    """What the host codecs count as `t`'s dense size (`_np`: a bf16 tensor as float32)."""
    return t.numel() * (4 if t.dtype == torch.bfloat16 else t.element_size())


def _described(t: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return _WIRE_DTYPE_NAMES[t.dtype], tuple(int(d) for d in t.shape)


def encode_topk_torch(t: torch.Tensor, density: float, per_row: bool, to_host: ToHost
                      ) -> tuple[Encoded, np.ndarray]:
    """`encode_topk` computed on `t`'s device: the selection (per row of the last axis as
    `encode_topk` makes it) and the values in float16 there, then only they and their indices
    to the host (`to_host`), written as `protocol.tensors.encode_topk_selected`. The same
    bytes as `encode_topk` wherever the k-th magnitude is not tied (among equal magnitudes
    either keeps any)."""
    x = t.detach()
    name, shape = _described(x)
    n = x.numel()
    if per_row and x.dim() >= 2 and shape[-1] > 0:
        cols = shape[-1]
        rows = n // cols
        k = topk_count(cols, density)
        if k == cols:
            cidx = torch.arange(cols, device=x.device).expand(rows, cols)
        else:
            cidx = torch.topk(x.reshape(rows, cols).abs(), k, dim=-1, sorted=False).indices
            cidx = cidx.sort(dim=-1).values
        offsets = torch.arange(rows, device=x.device, dtype=torch.int64).unsqueeze(1) * cols
        flat = (cidx.to(torch.int64) + offsets).reshape(-1)
        row_wise = True
    else:
        k = topk_count(n, density)
        flat = torch.topk(x.reshape(-1).abs(), k, sorted=False).indices.sort().values
        row_wise = False
    values = x.reshape(-1)[flat].float().to(torch.float16)
    got = to_host({"i": flat, "v": values})
    idx = got["i"].numpy().astype(np.int64, copy=False)
    enc = wire.encode_topk_selected(name, shape, idx, got["v"].numpy(), per_row=row_wise)
    return _encoded(enc, _dense_nbytes(x)), idx


def encode_values_torch(grad: torch.Tensor, indices: np.ndarray, to_host: ToHost) -> Encoded:
    """`encode_values` on `grad`'s device: the gradient gathered at a top-k edge's indices and
    cast to float16 there; only those values cross to the host."""
    g = grad.detach()
    name, shape = _described(g)
    where = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64)).to(g.device)
    values = g.reshape(-1)[where].float().to(torch.float16)
    got = to_host({"v": values})
    enc = wire.encode_values_selected(name, shape, got["v"].numpy())
    return _encoded(enc, _dense_nbytes(g))


def encode_int8_torch(t: torch.Tensor, to_host: ToHost) -> Encoded:
    """`encode_int8` (to nearest) computed on `t`'s device by the same float32 arithmetic
    (per-block absmax / 127, the scale stepped down where scale x 127 rounds above the
    absmax, division, round half to even, clip): only the scales and the int8 values cross to
    the host, and the bytes are `encode_int8`'s."""
    x = t.detach()
    name, shape = _described(x)
    flat = x.reshape(-1).float()
    n = flat.numel()
    block = wire.DEFAULT_BLOCK_SIZE
    blocks = -(-n // block)
    xb = torch.nn.functional.pad(flat, (0, blocks * block - n)).view(blocks, block)
    absmax = xb.abs().amax(dim=1) if n else torch.zeros(0, device=x.device)
    scale = absmax / 127.0
    high = scale * 127.0 > absmax
    scale = torch.where(high, torch.nextafter(scale, torch.zeros_like(scale)), scale)
    qf = xb / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    q = torch.round(qf).clamp_(-127.0, 127.0).to(torch.int8).reshape(-1)[:n]
    got = to_host({"s": scale, "q": q})
    scales = got["s"].numpy()
    if not np.isfinite(scales).all():
        raise LocalProtocolError("int8 quantization needs finite values within float32 "
                                      "range (found inf or nan)")
    enc = wire.encode_int8_quantized(name, shape, scales, got["q"].numpy(), block_size=block)
    return _encoded(enc, _dense_nbytes(x))
