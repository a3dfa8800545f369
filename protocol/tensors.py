"""The tensor codec: numpy arrays to self-describing byte buffers and back.

An encoded tensor is a *descriptor* (fixed 24-byte head, the shape, a section table, an optional
checksum, zero padding to a multiple of 8 bytes) followed by its *sections* back to back. The
byte layout is specified in docs/tensor-codec.md. Encodings:

- ``raw``: the array's bytes, zero-copy both ways (`EncodedTensor.buffers` references the array;
  `decode` returns a view into the buffer it was given).
- ``fp16`` / ``bf16``: float arrays cast to 16 bits (bf16 rounds to nearest even).
- ``int8``: per-block absmax quantization; one float32 scale per block.
- ``int4``: the same with values in [-7, 7], two per byte (0.52 bytes per element at block 256).
  int8 and int4 round to nearest, or stochastically (``stochastic=True``: unbiased).
- ``topk``: the k largest magnitudes (globally or per row of the last axis): values in
  fp16/bf16/fp32, flat indices delta-encoded as varints or as a bitmap, whichever is smaller.
- ``values``: values at flat indices the receiver already knows (the backward of a top-k edge).
- ``lowrank``: a float tensor of rank >= 2 as a matrix X (m x n, n the last dimension) sent as
  rank-r factors P (m x r, values in fp16/bf16/fp32) and Q (n x r float32, orthonormal columns,
  found by a seeded randomized range finder), X ~ P Q^T. The receiver gets Q back
  (`decode_lowrank`) to answer the backward as G Q; the sender keeps Q (`EncodedTensor.basis`).

lz4 is applied to a section only when a sample of it shrinks by at least `LZ4_MIN_SAVING`;
incompressible data (random floats) pays for compressing the sample only. `decode` validates
every declared size against `Limits` before it allocates or decompresses anything, and raises only
`ProtocolError` subclasses on bad input.
"""

from __future__ import annotations

import enum
import functools
import math
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import lz4.block
import numpy as np
import numpy.typing as npt
import xxhash

from protocol._varint import decode_varints, encode_varints, varint_lengths
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits

__all__ = [
    "FORMAT_VERSION",
    "LZ4_MIN_SAVING",
    "ChecksumMismatch",
    "Decoded",
    "EncodedTensor",
    "Encoding",
    "SectionInfo",
    "SectionKind",
    "TensorDescriptor",
    "decode",
    "decode_described",
    "decode_full",
    "decode_lowrank",
    "decode_with_indices",
    "encode",
    "encode_concat",
    "encode_int8_quantized",
    "encode_topk_selected",
    "encode_values",
    "encode_values_selected",
    "read_descriptor",
    "topk_indices",
]

NDArray = npt.NDArray[Any]
Buffer = bytes | bytearray | memoryview

FORMAT_VERSION: Final = 1
"""Version byte of the tensor encoding (independent of the frame protocol version)."""
MAGIC: Final = b"FT"
LZ4_MIN_SAVING: Final = 0.03
"""lz4 is kept for a section only if it saves at least this fraction of its bytes."""
LZ4_MIN_SECTION: Final = 512
"""Sections smaller than this are never compressed: the saving cannot pay for the bookkeeping."""
LZ4_SAMPLE_CHUNK: Final = 16 << 10
LZ4_SAMPLE_CHUNKS: Final = 4
DEFAULT_BLOCK_SIZE: Final = 256
"""int8 / int4 quantization block: 256 elements share one float32 scale (1.6 % of int8's
bytes, 3.1 % of int4's)."""
MAX_BLOCK_SIZE: Final = 1 << 24
_CHUNK: Final = 1 << 16
"""Elements per chunk of the multi-pass encoders: their temporaries stay in the CPU cache."""

_HEAD = struct.Struct("<2sBBBBBBIIQ")  # magic ver enc dtype flags rank nsec hdrlen block k
_DIM = struct.Struct("<Q")
_SECTION = struct.Struct("<BBBBIQQ")  # kind codec elem_dtype 0 0(u32) stored_len raw_len
_CHECKSUM = struct.Struct("<Q")

_FLAG_CHECKSUM: Final = 0x01
_FLAG_PER_ROW: Final = 0x02
_KNOWN_FLAGS: Final = _FLAG_CHECKSUM | _FLAG_PER_ROW
_CODEC_NONE: Final = 0
_CODEC_LZ4: Final = 1


class ChecksumMismatch(RemoteProtocolError):
    """The optional xxh3_64 of the sections does not match the bytes received."""


class Encoding(enum.StrEnum):
    """How a tensor's values are represented on the wire."""

    RAW = "raw"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
    TOPK = "topk"
    VALUES = "values"
    INT4 = "int4"
    LOWRANK = "lowrank"


class SectionKind(enum.IntEnum):
    """What a section holds; each encoding has a fixed sequence of kinds."""

    DATA = 1
    SCALES = 2
    VALUES = 3
    INDEX_VARINT = 4
    INDEX_BITMAP = 5


_ENCODING_IDS: Final[dict[Encoding, int]] = {
    Encoding.RAW: 1,
    Encoding.FP16: 2,
    Encoding.BF16: 3,
    Encoding.INT8: 4,
    Encoding.TOPK: 5,
    Encoding.VALUES: 6,
    Encoding.INT4: 7,
    Encoding.LOWRANK: 8,
}
_ENCODINGS_BY_ID: Final = {v: k for k, v in _ENCODING_IDS.items()}

# Wire ids of element types. "bfloat16" exists only as a section element type (stored as uint16).
_DTYPE_IDS: Final[dict[str, int]] = {
    "float32": 1,
    "float64": 2,
    "float16": 3,
    "bfloat16": 4,
    "int64": 5,
    "int32": 6,
    "int16": 7,
    "int8": 8,
    "uint8": 9,
    "bool": 10,
    "uint16": 11,
    "uint32": 12,
    "uint64": 13,
}
_DTYPES_BY_ID: Final = {v: k for k, v in _DTYPE_IDS.items()}
_ARRAY_DTYPES: Final = frozenset(_DTYPE_IDS) - {"bfloat16"}
_FLOAT_DTYPES: Final = frozenset({"float16", "float32", "float64"})
_VALUE_DTYPES: Final[dict[str, str]] = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_ITEMSIZE: Final[dict[str, int]] = {
    name: (2 if name == "bfloat16" else np.dtype(name).itemsize) for name in _DTYPE_IDS
}


@functools.cache
def _wire_dtype(name: str) -> np.dtype[Any]:
    """The little-endian numpy dtype of a wire element type (bf16 travels as uint16)."""
    return np.dtype("<u2" if name == "bfloat16" else name).newbyteorder("<")


@functools.cache
def _name_of(dtype: np.dtype[Any]) -> str:
    """`dtype.name`, looked up once per dtype (numpy computes it in Python each time: a
    fifth of a small tensor's encode, issue 15)."""
    return dtype.name


@dataclass(frozen=True, slots=True)
class SectionInfo:
    """One entry of the section table."""

    kind: SectionKind
    elem_dtype: str
    """Element type of the section's decompressed bytes."""
    stored_len: int
    """Bytes on the wire."""
    raw_len: int
    """Bytes after decompression (== stored_len unless `lz4`)."""
    lz4: bool = False


@dataclass(frozen=True, slots=True)
class TensorDescriptor:
    """What a receiver needs to know to decode a tensor, as carried in its header."""

    dtype: str
    """numpy dtype name of the dense tensor (decode returns this dtype)."""
    shape: tuple[int, ...]
    encoding: Encoding
    k: int = 0
    """TOPK / VALUES: number of values carried. LOWRANK: the rank r of the factors."""
    block_size: int = 0
    """INT8 / INT4: elements per quantization block."""
    per_row: bool = False
    """TOPK: the k largest were chosen per row of the last axis (informational)."""
    checksum: bool = False
    sections: tuple[SectionInfo, ...] = ()
    header_len: int = 0
    """Bytes of the descriptor itself, padding included (a multiple of 8)."""

    @property
    def numel(self) -> int:
        """Elements of the dense tensor."""
        return math.prod(self.shape)

    @property
    def value_dtype(self) -> str | None:
        """TOPK / VALUES / FP16 / BF16: element type of the values section; LOWRANK: that of
        the factor P."""
        for s in self.sections:
            if s.kind in (SectionKind.VALUES, SectionKind.DATA):
                return s.elem_dtype
        return None

    @property
    def index_format(self) -> str | None:
        """TOPK: "varint" or "bitmap"."""
        for s in self.sections:
            if s.kind == SectionKind.INDEX_VARINT:
                return "varint"
            if s.kind == SectionKind.INDEX_BITMAP:
                return "bitmap"
        return None


@dataclass
class EncodedTensor:
    """An encoded tensor: the descriptor plus the buffers that make up its bytes."""

    descriptor: TensorDescriptor
    indices: NDArray | None = None
    """TOPK: the kept flat indices (sorted int64) so the sender can keep them for backward."""
    _parts: list[memoryview] = field(default_factory=list, repr=False)
    basis: NDArray | None = field(default=None, repr=False)
    """LOWRANK: Q, the n x r float32 factor exactly as sent (orthonormal columns). The sender
    keeps it: the receiver's answer G Q to a gradient G of the decoded tensor becomes
    (G Q) Q^T, the gradient with respect to the sender's tensor. Without lz4 the DATA section
    references its memory: do not modify it until the bytes are written."""

    def buffers(self) -> list[memoryview]:
        """The whole self-describing encoding as a gather list (send with `writelines`).

        For RAW without lz4 the data buffer references the array's memory: do not modify the
        array until the bytes are written.
        """
        return list(self._parts)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return sum(p.nbytes for p in self._parts)

    def tobytes(self) -> bytes:
        """The encoding as one bytes object (a copy; for tests and small tensors)."""
        return b"".join(self._parts)


# --------------------------------------------------------------------------------------------
# helpers


def _bytes_view(arr: NDArray) -> memoryview:
    """A flat byte memoryview of an array (rank-0 and empty included); copies if strided."""
    return _flat(arr).data.cast("B")


def _flat(arr: NDArray) -> NDArray:
    """`arr` as a 1-D C-contiguous array: a view when it already is contiguous, else a copy."""
    flat = arr.reshape(-1)  # a view for contiguous input; may stay strided for 1-D input
    return flat if flat.flags.c_contiguous else flat.copy()


def _dtype_name(arr: NDArray) -> str:
    name = _name_of(arr.dtype)
    if name not in _ARRAY_DTYPES:
        raise LocalProtocolError(
            f"dtype {arr.dtype} is not supported by the tensor codec "
            f"(supported: {', '.join(sorted(_ARRAY_DTYPES))})"
        )
    return name


def _as_wire_array(arr: NDArray) -> NDArray:
    """C-contiguous, little-endian; copies only when the input is neither."""
    target = _wire_dtype(_name_of(arr.dtype))
    if arr.dtype != target:
        arr = arr.astype(target)
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    return arr


def _lz4_compress(view: memoryview) -> bytes:
    return bytes(lz4.block.compress(view, mode="default", store_size=False))


def _maybe_lz4(view: memoryview, compress: str) -> tuple[memoryview, bool]:
    """Return (bytes to send, compressed?) for one section under the `compress` policy.

    "auto" compresses a few spread-out chunks first and tries the whole section only when the
    sample saved at least `LZ4_MIN_SAVING`, so incompressible data costs one small sample.
    """
    size = view.nbytes
    if compress == "none" or size < LZ4_MIN_SECTION:
        return view, False
    if compress == "auto" and size > LZ4_SAMPLE_CHUNK * LZ4_SAMPLE_CHUNKS:
        step = (size - LZ4_SAMPLE_CHUNK) // (LZ4_SAMPLE_CHUNKS - 1)
        sampled = 0
        packed = 0
        for i in range(LZ4_SAMPLE_CHUNKS):
            chunk = view[i * step : i * step + LZ4_SAMPLE_CHUNK]
            sampled += chunk.nbytes
            packed += len(_lz4_compress(chunk))
        if packed > sampled * (1.0 - LZ4_MIN_SAVING):
            return view, False
    packed_all = _lz4_compress(view)
    if len(packed_all) > size * (1.0 - LZ4_MIN_SAVING):
        return view, False
    return memoryview(packed_all), True


def _to_bf16_bits(x: NDArray) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, round to nearest even; NaN stays (quiet) NaN.

    Works in cache-sized chunks: the rounding takes five passes, which from RAM would cost
    five trips over the whole array.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).reshape(-1).view(np.uint32)
    bits = np.empty(u.size, dtype=np.uint16)
    t = np.empty(min(u.size, _CHUNK), dtype=np.uint32)
    for start in range(0, u.size, _CHUNK):
        uc = u[start : start + _CHUNK]
        tc = t[: uc.size]
        np.right_shift(uc, np.uint32(16), out=tc)
        tc &= np.uint32(1)
        tc += np.uint32(0x7FFF)
        tc += uc  # wraps only for negative NaNs, fixed below
        tc >>= np.uint32(16)
        bits[start : start + _CHUNK] = tc
    # NaN <=> exponent all ones and mantissa non-zero: (u & 0x7fffffff) > 0x7f800000.
    nan = np.flatnonzero((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
    if nan.size:
        # Rounding can carry a NaN's payload into the exponent (-> inf); force a quiet NaN.
        bits[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return bits.reshape(np.shape(x))


def _from_bf16_bits(bits: NDArray) -> npt.NDArray[np.float32]:
    widened = bits.astype(np.uint32)
    widened <<= np.uint32(16)
    return widened.view(np.float32)


def _cast_values(values: NDArray, value_dtype: str) -> NDArray:
    """Cast float values to a wire value type ("float16", "bfloat16", "float32")."""
    with np.errstate(over="ignore"):  # overflow -> inf is the documented cast semantics
        if value_dtype == "bfloat16":
            return _to_bf16_bits(values.astype(np.float32, copy=False))
        return values.astype(_wire_dtype(value_dtype), copy=False)


def _uncast_values(raw: NDArray, value_dtype: str, dtype: str) -> NDArray:
    if value_dtype == "bfloat16":
        return _from_bf16_bits(raw).astype(dtype, copy=False)
    return raw.astype(dtype, copy=False)


def _value_dtype_name(value_dtype: str) -> str:
    try:
        return _VALUE_DTYPES[value_dtype]
    except KeyError:
        raise LocalProtocolError(
            f"value_dtype {value_dtype!r} is not one of {sorted(_VALUE_DTYPES)}"
        ) from None


def _require_float(name: str, encoding: Encoding) -> None:
    if name not in _FLOAT_DTYPES:
        raise LocalProtocolError(f"encoding {encoding} needs a float array, got {name}")


def _build(
    desc_dtype: str,
    shape: tuple[int, ...],
    encoding: Encoding,
    sections: Sequence[tuple[SectionKind, str, memoryview | list[memoryview], int, bool]],
    *,
    k: int = 0,
    block_size: int = 0,
    per_row: bool = False,
    checksum: bool = False,
    indices: NDArray | None = None,
    basis: NDArray | None = None,
) -> EncodedTensor:
    """Assemble descriptor bytes and buffers; sections are (kind, elem, bytes, raw_len, lz4),
    a section's bytes one buffer or several sent in turn (`encode_concat`)."""
    pieces = [[v] if isinstance(v, memoryview) else list(v) for _, _, v, _, _ in sections]
    if len(shape) > 255:
        raise LocalProtocolError(f"rank {len(shape)} exceeds the wire format's 255")
    flags = (_FLAG_CHECKSUM if checksum else 0) | (_FLAG_PER_ROW if per_row else 0)
    infos = tuple(
        SectionInfo(kind, elem, sum(p.nbytes for p in views), raw_len, lz4)
        for (kind, elem, _, raw_len, lz4), views in zip(sections, pieces, strict=True)
    )
    body = _HEAD.size + _DIM.size * len(shape) + _SECTION.size * len(infos)
    body += _CHECKSUM.size if checksum else 0
    header_len = -(-body // 8) * 8
    head = bytearray(header_len)
    _HEAD.pack_into(
        head,
        0,
        MAGIC,
        FORMAT_VERSION,
        _ENCODING_IDS[encoding],
        _DTYPE_IDS[desc_dtype],
        flags,
        len(shape),
        len(infos),
        header_len,
        block_size,
        k,
    )
    off = _HEAD.size
    for d in shape:
        _DIM.pack_into(head, off, d)
        off += _DIM.size
    for info in infos:
        _SECTION.pack_into(
            head,
            off,
            int(info.kind),
            _CODEC_LZ4 if info.lz4 else _CODEC_NONE,
            _DTYPE_IDS[info.elem_dtype],
            0,
            0,
            info.stored_len,
            info.raw_len,
        )
        off += _SECTION.size
    if checksum:
        h = xxhash.xxh3_64()
        for views in pieces:
            for view in views:
                h.update(view)
        _CHECKSUM.pack_into(head, off, h.intdigest())
    desc = TensorDescriptor(
        dtype=desc_dtype,
        shape=shape,
        encoding=encoding,
        k=k,
        block_size=block_size,
        per_row=per_row,
        checksum=checksum,
        sections=infos,
        header_len=header_len,
    )
    parts = [memoryview(head)] + [view for views in pieces for view in views]
    return EncodedTensor(desc, indices, parts, basis)


def _section(
    kind: SectionKind, elem: str, arr: NDArray, compress: str
) -> tuple[SectionKind, str, memoryview, int, bool]:
    view = _bytes_view(arr)
    stored, lz4 = _maybe_lz4(view, compress)
    return kind, elem, stored, view.nbytes, lz4


# --------------------------------------------------------------------------------------------
# top-k selection


def topk_indices(arr: NDArray, k: int, per_row: bool = False) -> npt.NDArray[np.int64]:
    """Sorted flat int64 indices of the `k` largest magnitudes of `arr`.

    With `per_row`, `k` applies to each row of the last axis (rank >= 1). Among equal magnitudes
    at the threshold, which ones are kept is unspecified.
    """
    arr = np.asarray(arr)
    n = arr.size
    if per_row:
        if arr.ndim == 0:
            raise LocalProtocolError("per_row top-k needs an array of rank >= 1")
        cols = arr.shape[-1]
        rows = n // cols if cols else 0
        if not 0 <= k <= cols:
            raise LocalProtocolError(f"per-row k={k} is outside [0, {cols}]")
        if k == 0 or rows == 0:
            return np.empty(0, dtype=np.int64)
        mag = np.abs(arr.reshape(rows, cols))
        if k == cols:
            cols_idx = np.broadcast_to(np.arange(cols, dtype=np.int64), (rows, cols))
        else:
            cols_idx = np.argpartition(mag, cols - k, axis=-1)[:, cols - k :]
            cols_idx = np.sort(cols_idx, axis=-1)
        flat = cols_idx + (np.arange(rows, dtype=np.int64) * cols)[:, None]
        return np.ascontiguousarray(flat, dtype=np.int64).reshape(-1)
    if not 0 <= k <= n:
        raise LocalProtocolError(f"k={k} is outside [0, {n}]")
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)
    mag = np.abs(arr.reshape(-1))
    idx = _topk_by_sampled_threshold(mag, k)
    if idx is None:
        idx = np.argpartition(mag, n - k)[n - k :]
    idx.sort()
    return idx.astype(np.int64, copy=False)


_TOPK_SAMPLE: Final = 1 << 16
_TOPK_SAMPLED_MIN_N: Final = 1 << 18


def _topk_by_sampled_threshold(mag: NDArray, k: int) -> NDArray | None:
    """Exact top-k of large, sparse selections without partitioning the whole array.

    A random sample gives a threshold `t` a little *below* the k-th largest magnitude; when at
    least k elements reach `t`, the k largest are all among them, and partitioning those few
    candidates is exact. Returns None (use a full argpartition) when the array is small, the
    selection dense, or the sample was unlucky. NaN magnitudes are never candidates here.
    """
    n = mag.size
    if n < _TOPK_SAMPLED_MIN_N or k > n // 8:
        return None
    # Deterministic per shape, unbiased by any row/column structure of the data.
    positions = np.random.default_rng(n * 31 + k).integers(0, n, _TOPK_SAMPLE)
    sample = mag[positions]
    expected = k * _TOPK_SAMPLE / n
    # Four standard deviations of margin: an unlucky sample (fallback) is rarer than 1 in 10^4.
    rank = math.ceil(expected + 4.0 * math.sqrt(expected) + 8.0)
    if rank >= _TOPK_SAMPLE // 4:
        return None
    threshold = np.partition(sample, _TOPK_SAMPLE - rank)[_TOPK_SAMPLE - rank]
    candidates = np.flatnonzero(mag >= threshold)
    if candidates.size < k or candidates.size > n // 4:
        return None
    chosen = np.argpartition(mag[candidates], candidates.size - k)[candidates.size - k :]
    return candidates[chosen]


def _resolve_k(shape: tuple[int, ...], k: int | None, density: float | None, per_row: bool) -> int:
    if (k is None) == (density is None):
        raise LocalProtocolError("top-k needs exactly one of k and density")
    if k is not None:
        return int(k)
    assert density is not None
    if not 0.0 <= density <= 1.0 or math.isnan(density):
        raise LocalProtocolError(f"density {density} is outside [0, 1]")
    if per_row:
        if not shape:
            raise LocalProtocolError("per_row top-k needs an array of rank >= 1")
        return min(shape[-1], math.ceil(density * shape[-1]))
    n = math.prod(shape)
    return min(n, math.ceil(density * n))


def _encode_indices(
    idx: npt.NDArray[np.int64], n: int, compress: str
) -> tuple[SectionKind, str, memoryview, int, bool]:
    """Sorted flat indices -> varint gaps or a bitmap, whichever is smaller."""
    k = idx.size
    bitmap_len = (n + 7) // 8
    if k >= bitmap_len and k > 0:
        # Every varint takes >= 1 byte, so the bitmap cannot lose.
        use_bitmap = True
        gaps = lengths = None
    else:
        # Gaps minus one (indices are strictly increasing), so a gap of 128 still fits one byte.
        gaps = np.empty(k, dtype=np.uint64)
        if k:
            gaps[0] = idx[0]
            np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
            gaps[1:] -= np.uint64(1)
        lengths = varint_lengths(gaps)
        use_bitmap = bool(int(lengths.sum(dtype=np.int64)) > bitmap_len)
    if use_bitmap:
        mask = np.zeros(n, dtype=np.bool_)
        mask[idx] = True
        packed = np.packbits(mask, bitorder="little")
        return _section(SectionKind.INDEX_BITMAP, "uint8", packed, compress)
    assert gaps is not None and lengths is not None
    stream = encode_varints(gaps, lengths)
    return _section(SectionKind.INDEX_VARINT, "uint8", stream, compress)


# --------------------------------------------------------------------------------------------
# encode


def encode(
    arr: NDArray,
    encoding: Encoding | str = "raw",
    *,
    density: float | None = None,
    k: int | None = None,
    per_row: bool = False,
    value_dtype: str = "fp16",
    compress: str = "auto",
    checksum: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False,
    seed: int = 0,
) -> EncodedTensor:
    """Encode `arr` (any supported dtype; float for the lossy encodings).

    `compress`: "auto" (lz4 a section only if a sample saves >= 3 %), "lz4" (try every section in
    full, keep lz4 if it saves >= 3 %), "none". TOPK takes exactly one of `k` (per row with
    `per_row`) or `density` (k = ceil(density * n)); `value_dtype` is "fp16", "bf16" or "fp32".
    `checksum` adds an xxh3_64 of the sections (frames already carry one; off by default).
    INT8 / INT4: `block_size` elements share a scale; `stochastic` rounds x/scale up with
    probability its fractional part (else down), drawing from PCG64(`seed`): the dequantized
    value is then x in expectation, and the same seed gives the same bytes. The default rounds
    to nearest (half the per-element error; biased). The wire format is the same either way.
    LOWRANK (rank >= 2 float arrays, as an m x n matrix with n = the last dimension): `k` is the
    rank r, 1 <= r <= min(m, n); the factor P is sent in `value_dtype`, Q in float32, and the
    range finder's Gaussian start is drawn from PCG64(`seed`) (same seed, same bytes); the
    result's `basis` is Q. Raises `LocalProtocolError` on unsupported input.
    """
    try:
        enc = Encoding(encoding)
    except ValueError:
        raise LocalProtocolError(
            f"unknown encoding {encoding!r}; one of {[e.value for e in Encoding]}"
        ) from None
    if compress not in ("auto", "lz4", "none"):
        raise LocalProtocolError(f"compress must be 'auto', 'lz4' or 'none', not {compress!r}")
    rng: np.random.Generator | None = None
    if stochastic:
        if enc not in (Encoding.INT8, Encoding.INT4):
            raise LocalProtocolError(
                f"stochastic rounding applies to int8 and int4 only, not {enc}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise LocalProtocolError(f"seed must be a non-negative int, not {seed!r}")
        rng = np.random.Generator(np.random.PCG64(seed))
    arr = np.asarray(arr)
    name = _dtype_name(arr)
    shape = tuple(int(d) for d in arr.shape)
    if enc is Encoding.RAW:
        data = _as_wire_array(arr)
        return _build(
            name,
            shape,
            enc,
            [_section(SectionKind.DATA, name, data, compress)],
            checksum=checksum,
        )
    _require_float(name, enc)
    flat = _flat(arr)
    if enc in (Encoding.FP16, Encoding.BF16):
        elem = "float16" if enc is Encoding.FP16 else "bfloat16"
        cast = _cast_values(flat, elem)
        return _build(
            name, shape, enc, [_section(SectionKind.DATA, elem, cast, compress)], checksum=checksum
        )
    if enc in (Encoding.INT8, Encoding.INT4):
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise LocalProtocolError(f"block_size {block_size} is outside [1, {MAX_BLOCK_SIZE}]")
        if enc is Encoding.INT8:
            scales, q = _quantize_int8(flat, block_size, rng)
            data_section = _section(SectionKind.DATA, "int8", q, compress)
        else:
            scales, packed = _quantize_int4(flat, block_size, rng)
            data_section = _section(SectionKind.DATA, "uint8", packed, compress)
        return _build(
            name,
            shape,
            enc,
            [_section(SectionKind.SCALES, "float32", scales, compress), data_section],
            block_size=block_size,
            checksum=checksum,
        )
    if enc is Encoding.TOPK:
        vname = _value_dtype_name(value_dtype)
        kk = _resolve_k(shape, k, density, per_row)
        idx = topk_indices(flat.reshape(shape), kk, per_row=per_row)
        values = _cast_values(flat[idx], vname)
        return _build(
            name,
            shape,
            enc,
            [
                _section(SectionKind.VALUES, vname, values, compress),
                _encode_indices(idx, arr.size, compress),
            ],
            k=int(idx.size),
            per_row=per_row,
            checksum=checksum,
            indices=idx,
        )
    if enc is Encoding.LOWRANK:
        return _encode_lowrank(arr, name, k, density, value_dtype, seed, compress, checksum)
    raise LocalProtocolError("use encode_values() for the values encoding: it needs the indices")


LOWRANK_POWER_ITERATIONS: Final = 2
"""Power iterations of the low-rank range finder (each multiplies by X^T X, then
orthonormalizes)."""


def _encode_lowrank(
    arr: NDArray,
    name: str,
    k: int | None,
    density: float | None,
    value_dtype: str,
    seed: int,
    compress: str,
    checksum: bool,
) -> EncodedTensor:
    shape = tuple(int(d) for d in arr.shape)
    if len(shape) < 2:
        raise LocalProtocolError(
            f"lowrank needs an array of rank >= 2 (a matrix, or a batch of rows with the "
            f"features last), got rank {len(shape)}"
        )
    if density is not None:
        raise LocalProtocolError("lowrank takes k (the rank of the factors), not density")
    if k is None or isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise LocalProtocolError(f"lowrank needs k, the rank of the factors, as an int, not {k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise LocalProtocolError(f"seed must be a non-negative int, not {seed!r}")
    cols = shape[-1]
    rows = math.prod(shape[:-1])
    limit = min(rows, cols)
    r = int(k)
    if not 1 <= r <= limit:
        raise LocalProtocolError(
            f"lowrank rank k={r} is outside [1, min(m, n)] = [1, {limit}] for the "
            f"{rows} x {cols} matrix of shape {shape}"
        )
    vname = _value_dtype_name(value_dtype)
    x = np.asarray(arr, dtype=np.float64).reshape(rows, cols)
    if not np.isfinite(x).all():
        raise LocalProtocolError("lowrank needs finite values (found inf or nan)")
    q, p = _lowrank_factors(x, r, seed)
    p_wire = _cast_values(p, vname)
    back = _uncast_values(p_wire, vname, "float64") if vname == "bfloat16" else p_wire
    if not np.isfinite(back).all():
        hint = "send it as value_dtype 'fp32' or 'bf16'" if vname == "float16" else "scale X down"
        raise LocalProtocolError(
            f"lowrank factor P = X Q (largest |P| = {float(np.abs(p).max()):.3g}) is beyond the "
            f"range of {value_dtype}; {hint}"
        )
    return _build(
        name,
        shape,
        Encoding.LOWRANK,
        [
            _section(SectionKind.VALUES, vname, p_wire, compress),
            _section(SectionKind.DATA, "float32", q, compress),
        ],
        k=r,
        checksum=checksum,
        basis=q,
    )


def _lowrank_factors(
    x: npt.NDArray[np.float64], r: int, seed: int
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float64]]:
    """(Q, P) of the m x n matrix `x` (float64, finite): Q an n x r float32 basis with
    orthonormal columns from a randomized range finder on X^T X, P = X Q (float64, with Q as
    rounded to float32, so P Q^T is exactly X projected on the Q that is sent).

    Q0 is an n x r standard Gaussian from PCG64(seed); each of `LOWRANK_POWER_ITERATIONS`
    steps sets Q = orthonormal factor of `np.linalg.qr(X^T (X Q))`. X is scaled by a power of
    two (exact) to an absmax in [0.5, 1) so that X^T X cannot overflow.
    """
    cols = x.shape[1]
    absmax = float(np.abs(x).max())
    exp = int(np.frexp(absmax)[1]) if absmax > 0.0 else 0
    xs = np.ldexp(x, -exp) if exp else x
    rng = np.random.Generator(np.random.PCG64(seed))
    q64 = rng.standard_normal((cols, r))
    for _ in range(LOWRANK_POWER_ITERATIONS):
        y = xs.T @ (xs @ q64)
        q64 = np.linalg.qr(y, mode="reduced")[0]
    q = np.ascontiguousarray(q64, dtype=np.float32)
    with np.errstate(over="ignore"):
        p = np.ldexp(xs @ q.astype(np.float64), exp)
    return q, p


def encode_concat(arrays: Sequence[NDArray], *, checksum: bool = False) -> EncodedTensor:
    """RAW encoding of the 1-D concatenation of `arrays` (one dtype, none empty), without
    concatenating: the one DATA section is each array's own memory in turn (C-contiguous,
    little-endian ones are not copied), so the bytes on the wire, and what `decode` returns,
    are those of ``encode(np.concatenate([a.ravel() for a in arrays]), compress="none")``. Do
    not modify the arrays until the bytes are written. Raises `LocalProtocolError` on mixed
    dtypes or none."""
    if not arrays:
        raise LocalProtocolError("encode_concat needs at least one array")
    wired = [_as_wire_array(np.asarray(a)) for a in arrays]
    name = _dtype_name(wired[0])
    if any(_dtype_name(a) != name for a in wired):
        raise LocalProtocolError(
            f"encode_concat needs one dtype, got {sorted({_dtype_name(a) for a in wired})}"
        )
    views = [_bytes_view(a) for a in wired]
    nbytes = sum(v.nbytes for v in views)
    numel = sum(int(a.size) for a in wired)
    return _build(
        name, (numel,), Encoding.RAW, [(SectionKind.DATA, name, views, nbytes, False)],
        checksum=checksum,
    )


def _check_reduced(dtype: str, shape: Sequence[int], encoding: Encoding) -> tuple[int, ...]:
    if dtype not in _FLOAT_DTYPES:
        raise LocalProtocolError(f"encoding {encoding} needs a float dtype, got {dtype!r}")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise LocalProtocolError(f"shape {dims} has a negative dimension")
    return dims


def encode_topk_selected(
    dtype: str,
    shape: Sequence[int],
    indices: NDArray,
    values: NDArray,
    *,
    per_row: bool = False,
    value_dtype: str = "fp16",
    compress: str = "auto",
) -> EncodedTensor:
    """TOPK of a tensor whose selection was made elsewhere (an accelerator: only the kept
    values and their indices came to the host): the same bytes `encode(..., "topk")` writes
    for that selection. `dtype` and `shape` are the dense tensor's; `indices` its sorted flat
    int64 kept indices (per row of the last axis: the same count in every row); `values`
    the dense values at them, already in `value_dtype` ("fp16" float16, "bf16" as its
    16-bit patterns in uint16, "fp32" float32)."""
    dims = _check_reduced(dtype, shape, Encoding.TOPK)
    n = math.prod(dims)
    vname = _value_dtype_name(value_dtype)
    idx = _check_indices(indices, n, None)
    if idx.size > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise LocalProtocolError("top-k indices must be strictly increasing")
    vals = np.asarray(values)
    want = np.uint16 if vname == "bfloat16" else _wire_dtype(vname)
    if vals.dtype != want or vals.shape != (idx.size,):
        raise LocalProtocolError(f"top-k values must be {idx.size} {np.dtype(want).name}, got "
                                 f"{vals.size} {vals.dtype}")
    if per_row and (not dims or (dims[-1] and idx.size % max(1, n // dims[-1]))):
        raise LocalProtocolError("per-row top-k keeps the same count in every row")
    return _build(
        dtype,
        dims,
        Encoding.TOPK,
        [_section(SectionKind.VALUES, vname, vals, compress), _encode_indices(idx, n, compress)],
        k=int(idx.size),
        per_row=per_row,
        indices=idx,
    )


def encode_values_selected(
    dtype: str, shape: Sequence[int], values: NDArray, *, value_dtype: str = "fp16",
    compress: str = "auto",
) -> EncodedTensor:
    """VALUES of a gradient gathered elsewhere at a top-k edge's indices (in their order),
    already in `value_dtype`: the bytes `encode_values` writes for them."""
    dims = _check_reduced(dtype, shape, Encoding.VALUES)
    vname = _value_dtype_name(value_dtype)
    vals = np.asarray(values)
    want = np.uint16 if vname == "bfloat16" else _wire_dtype(vname)
    if vals.dtype != want or vals.ndim != 1 or vals.size > math.prod(dims):
        raise LocalProtocolError(f"values must be at most {math.prod(dims)} "
                                 f"{np.dtype(want).name}, got {vals.size} {vals.dtype}")
    return _build(dtype, dims, Encoding.VALUES,
                  [_section(SectionKind.VALUES, vname, vals, compress)], k=int(vals.size))


def encode_int8_quantized(
    dtype: str, shape: Sequence[int], scales: NDArray, q: NDArray, *,
    block_size: int = DEFAULT_BLOCK_SIZE, compress: str = "auto",
) -> EncodedTensor:
    """INT8 of a tensor quantized elsewhere (an accelerator) by the rule `encode` uses
    (per-block absmax / 127, to nearest): its float32 scales per block and int8 values came
    to the host; the same bytes."""
    dims = _check_reduced(dtype, shape, Encoding.INT8)
    n = math.prod(dims)
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise LocalProtocolError(f"block_size {block_size} is outside [1, {MAX_BLOCK_SIZE}]")
    sc, qv = np.asarray(scales), np.asarray(q)
    if sc.dtype != np.float32 or sc.shape != (-(-n // block_size),):
        raise LocalProtocolError(f"int8 scales must be {-(-n // block_size)} float32")
    if qv.dtype != np.int8 or qv.shape != (n,):
        raise LocalProtocolError(f"int8 values must be {n} int8")
    return _build(
        dtype, dims, Encoding.INT8,
        [_section(SectionKind.SCALES, "float32", sc, compress),
         _section(SectionKind.DATA, "int8", qv, compress)],
        block_size=block_size,
    )


def encode_values(
    arr: NDArray,
    indices: NDArray,
    value_dtype: str = "fp16",
    *,
    compress: str = "auto",
    checksum: bool = False,
) -> EncodedTensor:
    """Encode the values of dense float `arr` at flat `indices` (the backward of a top-k edge).

    The descriptor carries `arr`'s shape and dtype and len(indices); the receiver decodes with
    `decode(buf, indices=...)` using the same indices, in the same order.
    """
    arr = np.asarray(arr)
    name = _dtype_name(arr)
    _require_float(name, Encoding.VALUES)
    if compress not in ("auto", "lz4", "none"):
        raise LocalProtocolError(f"compress must be 'auto', 'lz4' or 'none', not {compress!r}")
    vname = _value_dtype_name(value_dtype)
    idx = _check_indices(indices, arr.size, None)
    values = _cast_values(_flat(arr)[idx], vname)
    return _build(
        name,
        tuple(int(d) for d in arr.shape),
        Encoding.VALUES,
        [_section(SectionKind.VALUES, vname, values, compress)],
        k=int(idx.size),
        checksum=checksum,
    )


def _check_indices(indices: NDArray, n: int, k: int | None) -> NDArray:
    """Validate caller-supplied flat indices (LocalProtocolError: they are ours)."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or not (np.issubdtype(idx.dtype, np.integer) or idx.size == 0):
        raise LocalProtocolError(f"indices must be a 1-D integer array, got {idx.dtype}{idx.shape}")
    if k is not None and idx.size != k:
        raise RemoteProtocolError(f"values tensor carries {k} values but {idx.size} indices given")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        raise LocalProtocolError(f"indices out of range for a tensor of {n} elements")
    return idx.astype(np.int64, copy=False)


_LITTLE_ENDIAN: Final = sys.byteorder == "little"
_INT8_MAX: Final = np.float32(127.0)
_INT4_MAX: Final = np.float32(7.0)


def _block_chunks(n: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """(first block, end block, first element, end element) of each chunk of whole blocks that
    the quantizers process at a time (about `_CHUNK` elements), then of the short last block."""
    full = n // block
    rows = max(1, _CHUNK // block)
    for r0 in range(0, full, rows):
        r1 = min(full, r0 + rows)
        yield r0, r1, r0 * block, r1 * block
    if n % block:
        yield full, full + 1, full * block, n


def _quantize_int8(
    arr: NDArray, block: int, rng: np.random.Generator | None = None
) -> tuple[NDArray, NDArray]:
    """Per-block absmax int8 of flat `arr`: scale = absmax/127, q = rint(x/scale) (or rounded
    stochastically with `rng`).

    Returns (scales float32 per block, q int8 per element). Processes whole blocks in
    cache-sized chunks.
    """
    n = arr.size
    scales = np.empty(-(-n // block), dtype=np.float32)
    q = np.empty(n, dtype=np.int8)
    for b0, b1, e0, e1 in _block_chunks(n, block):
        rows = b1 - b0
        _quantize_rows(
            arr[e0:e1].reshape(rows, -1), scales[b0:b1], q[e0:e1].reshape(rows, -1), _INT8_MAX, rng
        )
    return scales, q


def _quantize_int4(
    arr: NDArray, block: int, rng: np.random.Generator | None = None
) -> tuple[NDArray, NDArray]:
    """Per-block absmax int4 of flat `arr`: scale = absmax/7, q = rint(x/scale) in [-7, 7] (or
    rounded stochastically with `rng`), packed two per byte: element 2i in the low nibble, 2i+1
    in the high nibble, each as a 4-bit two's complement; an odd count leaves the last high
    nibble 0.

    Returns (scales float32 per block, packed uint8). Each chunk is quantized into a small int8
    buffer (after the odd element the previous chunk left unpaired, if any) and packed from
    there while it is in cache.
    """
    n = arr.size
    scales = np.empty(-(-n // block), dtype=np.float32)
    packed = np.empty((n + 1) // 2, dtype=np.uint8)
    q = np.empty(min(n, max(_CHUNK, block)) + 1, dtype=np.int8)
    carry = 0  # 1 when q[0] holds an element not packed yet
    at = 0
    for b0, b1, e0, e1 in _block_chunks(n, block):
        rows = b1 - b0
        m = carry + e1 - e0
        _quantize_rows(
            arr[e0:e1].reshape(rows, -1),
            scales[b0:b1],
            q[carry:m].reshape(rows, -1),
            _INT4_MAX,
            rng,
        )
        pairs = m // 2
        _pack_nibbles(q[: 2 * pairs], packed[at : at + pairs])
        at += pairs
        carry = m % 2
        if carry:
            q[0] = q[m - 1]
    if carry:
        packed[at] = q[:1].view(np.uint8)[0] & np.uint8(0x0F)
    return scales, packed


def _pack_nibbles(q: NDArray, out: NDArray) -> None:
    """Pairs of int8 values in [-8, 7] into bytes: the first in the low nibble (two's
    complement, so the byte's low 4 bits), the second in the high one."""
    if _LITTLE_ENDIAN:
        # Each pair as one uint16 (first value in the low byte): 3x faster than strided views.
        pair = q.view(np.uint16)
        t = pair >> np.uint16(4)
        t &= np.uint16(0xF0)
        t |= pair & np.uint16(0x0F)
        out[...] = t
        return
    u = q.view(np.uint8)
    np.bitwise_and(u[0::2], np.uint8(0x0F), out=out)
    out |= np.left_shift(u[1::2], np.uint8(4))  # uint8: the sign bits above the nibble drop out


def _quantize_rows(
    xb: NDArray, scales: NDArray, q: NDArray, qmax: np.float32, rng: np.random.Generator | None
) -> None:
    """Quantize the blocks that are the rows of `xb` into `scales` and `q` (in place), to
    integers in [-qmax, qmax]: to nearest, or stochastically when `rng` is given."""
    with np.errstate(over="ignore"):  # float64 beyond float32 range -> inf, refused below
        x = xb.astype(np.float32, copy=False)
    absmax = np.abs(x).max(axis=1)
    if not np.isfinite(absmax).all():
        raise LocalProtocolError(
            f"int{8 if qmax == _INT8_MAX else 4} quantization needs finite values within float32 "
            "range (found inf or nan)"
        )
    scale = absmax / qmax
    # Rounding may leave qmax * scale just above absmax (inf near float32 max): step down.
    # Then x/scale may exceed qmax by float32 rounding (a few 1e-7 relative); the clip below
    # takes that back, which biases stochastic rounding by as little.
    with np.errstate(over="ignore"):
        high = scale * qmax > absmax
    scale[high] = np.nextafter(scale[high], np.float32(0.0))
    # Divide (not multiply by 1/scale): 1/scale overflows for subnormal scales.
    qf = x / np.where(scale > 0, scale, np.float32(1.0))[:, None]
    if rng is None:
        np.rint(qf, out=qf)
    else:
        # Up with probability frac(qf), else down: floor(qf + u) in distribution, but exact
        # (qf - floor(qf) is exact for qf >= 0; the sum qf + u would round to qf's ulp).
        low = np.floor(qf)
        qf -= low
        np.less(rng.random(qf.shape, dtype=np.float32), qf, out=qf)
        qf += low
    np.clip(qf, -qmax, qmax, out=qf)
    scales[...] = scale
    q[...] = qf


# --------------------------------------------------------------------------------------------
# decode


def _as_byte_view(buf: Buffer) -> memoryview:
    try:
        view = memoryview(buf)
    except TypeError:
        raise LocalProtocolError(f"cannot decode a {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise LocalProtocolError("tensor buffer must be contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def read_descriptor(buf: Buffer, *, limits: Limits = DEFAULT_LIMITS) -> TensorDescriptor:
    """Parse and validate the descriptor of an encoded tensor (nothing is allocated or decoded).

    Checks the magic, version, ids and flags, rank / element / decompressed-size limits, that every
    section has exactly the size its encoding implies, and that the buffer holds exactly the
    descriptor plus its sections. Raises `RemoteProtocolError` (or `LimitExceeded`).
    """
    view = _as_byte_view(buf)
    return _parse(view, limits)


def _parse(view: memoryview, limits: Limits) -> TensorDescriptor:
    total = view.nbytes
    if total < _HEAD.size:
        raise RemoteProtocolError(f"tensor descriptor truncated: {total} of {_HEAD.size} bytes")
    magic, version, enc_id, dtype_id, flags, rank, nsec, header_len, block, k = _HEAD.unpack_from(
        view, 0
    )
    if magic != MAGIC:
        raise RemoteProtocolError(f"bad tensor magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise RemoteProtocolError(
            f"tensor format version {version} not supported (this side speaks {FORMAT_VERSION})"
        )
    enc = _ENCODINGS_BY_ID.get(enc_id)
    if enc is None:
        raise RemoteProtocolError(f"unknown tensor encoding id {enc_id}")
    dtype = _DTYPES_BY_ID.get(dtype_id)
    if dtype is None or dtype not in _ARRAY_DTYPES:
        raise RemoteProtocolError(f"unknown tensor dtype id {dtype_id}")
    if flags & ~_KNOWN_FLAGS:
        raise RemoteProtocolError(f"unknown tensor flags 0x{flags:02x}")
    limits.check("tensor rank", rank, limits.max_tensor_rank)
    expected_nsec = (
        2 if enc in (Encoding.INT8, Encoding.INT4, Encoding.TOPK, Encoding.LOWRANK) else 1
    )
    if nsec != expected_nsec:
        raise RemoteProtocolError(f"{enc} tensor has {nsec} sections, expected {expected_nsec}")
    checksum = bool(flags & _FLAG_CHECKSUM)
    body = (
        _HEAD.size + _DIM.size * rank + _SECTION.size * nsec + (_CHECKSUM.size if checksum else 0)
    )
    if header_len != -(-body // 8) * 8:
        raise RemoteProtocolError(f"tensor header_len {header_len} inconsistent with its contents")
    if total < header_len:
        raise RemoteProtocolError(f"tensor descriptor truncated: {total} of {header_len} bytes")
    off = _HEAD.size
    shape: list[int] = []
    for _ in range(rank):
        (d,) = _DIM.unpack_from(view, off)
        limits.check("tensor dimension", d, limits.max_tensor_elements)
        shape.append(d)
        off += _DIM.size
    n = math.prod(shape)
    limits.check("tensor elements", n, limits.max_tensor_elements)
    if enc is not Encoding.RAW:
        # The dense result is allocated by decode: its size counts as decompressed bytes.
        limits.check("decoded tensor bytes", n * _ITEMSIZE[dtype], limits.max_decompressed_bytes)
        if dtype not in _FLOAT_DTYPES:
            raise RemoteProtocolError(f"{enc} tensor must have a float dtype, not {dtype}")
    per_row = bool(flags & _FLAG_PER_ROW)
    if enc in (Encoding.TOPK, Encoding.VALUES):
        if k > n:
            raise RemoteProtocolError(f"{enc} tensor declares k={k} > {n} elements")
        if enc is Encoding.TOPK:
            # The kept indices come back as int64 next to the dense result.
            limits.check(
                "decoded tensor and index bytes",
                n * _ITEMSIZE[dtype] + 8 * k,
                limits.max_decompressed_bytes,
            )
        if per_row and rank == 0:
            raise RemoteProtocolError("per-row top-k on a rank-0 tensor")
    elif enc is Encoding.LOWRANK:
        if rank < 2:
            raise RemoteProtocolError(f"lowrank tensor has rank {rank}, needs >= 2")
        rows, cols = math.prod(shape[:-1]), shape[-1]
        if not 1 <= k <= min(rows, cols):
            raise RemoteProtocolError(
                f"lowrank tensor declares rank k={k}, outside [1, {min(rows, cols)}] for its "
                f"{rows} x {cols} matrix"
            )
        # decode_lowrank returns Q (float32, cols x k) next to the dense result.
        limits.check(
            "decoded tensor and factor bytes",
            n * _ITEMSIZE[dtype] + 4 * cols * k,
            limits.max_decompressed_bytes,
        )
    elif k != 0:
        raise RemoteProtocolError(f"{enc} tensor declares k={k}, must be 0")
    if enc in (Encoding.INT8, Encoding.INT4):
        if not 1 <= block <= MAX_BLOCK_SIZE:
            raise RemoteProtocolError(f"{enc} block size {block} outside [1, {MAX_BLOCK_SIZE}]")
    elif block != 0:
        raise RemoteProtocolError(f"{enc} tensor declares block size {block}, must be 0")
    if enc is not Encoding.TOPK and per_row:
        raise RemoteProtocolError(f"per_row flag on a {enc} tensor")

    sections: list[SectionInfo] = []
    for i in range(nsec):
        kind_id, codec, elem_id, r0, r1, stored_len, raw_len = _SECTION.unpack_from(view, off)
        off += _SECTION.size
        if r0 or r1:
            raise RemoteProtocolError(f"tensor section {i}: reserved bytes are not zero")
        if codec not in (_CODEC_NONE, _CODEC_LZ4):
            raise RemoteProtocolError(f"tensor section {i}: unknown codec {codec}")
        elem = _DTYPES_BY_ID.get(elem_id)
        if elem is None:
            raise RemoteProtocolError(f"tensor section {i}: unknown element type id {elem_id}")
        try:
            kind = SectionKind(kind_id)
        except ValueError:
            raise RemoteProtocolError(f"tensor section {i}: unknown kind {kind_id}") from None
        lz4 = codec == _CODEC_LZ4
        if lz4:
            limits.check("decompressed section bytes", raw_len, limits.max_decompressed_bytes)
        elif stored_len != raw_len:
            raise RemoteProtocolError(
                f"tensor section {i}: stored {stored_len} != raw {raw_len} without compression"
            )
        sections.append(SectionInfo(kind, elem, stored_len, raw_len, lz4))
    _check_layout(enc, dtype, tuple(shape), k, block, sections)
    if checksum:
        off += _CHECKSUM.size
    if any(view[off:header_len]):
        raise RemoteProtocolError("tensor descriptor padding is not zero")
    expected_total = header_len + sum(s.stored_len for s in sections)
    if total != expected_total:
        raise RemoteProtocolError(
            f"tensor buffer is {total} bytes, descriptor and sections say {expected_total}"
        )
    return TensorDescriptor(
        dtype=dtype,
        shape=tuple(shape),
        encoding=enc,
        k=k,
        block_size=block,
        per_row=per_row,
        checksum=checksum,
        sections=tuple(sections),
        header_len=header_len,
    )


def _check_layout(
    enc: Encoding,
    dtype: str,
    shape: tuple[int, ...],
    k: int,
    block: int,
    sections: list[SectionInfo],
) -> None:
    """Each encoding has fixed section kinds, element types and exact decompressed sizes."""
    n = math.prod(shape)

    def want(i: int, kinds: tuple[SectionKind, ...], elems: tuple[str, ...], raw: int) -> None:
        s = sections[i]
        if s.kind not in kinds:
            raise RemoteProtocolError(f"{enc} tensor section {i} is {s.kind.name}")
        if s.elem_dtype not in elems:
            raise RemoteProtocolError(f"{enc} tensor section {i} has element type {s.elem_dtype}")
        if s.raw_len != raw:
            raise RemoteProtocolError(
                f"{enc} tensor section {i} declares {s.raw_len} bytes, shape implies {raw}"
            )

    values_elems = tuple(_VALUE_DTYPES.values())
    if enc is Encoding.RAW:
        want(0, (SectionKind.DATA,), (dtype,), n * _ITEMSIZE[dtype])
    elif enc is Encoding.FP16:
        want(0, (SectionKind.DATA,), ("float16",), n * 2)
    elif enc is Encoding.BF16:
        want(0, (SectionKind.DATA,), ("bfloat16",), n * 2)
    elif enc is Encoding.INT8:
        want(0, (SectionKind.SCALES,), ("float32",), -(-n // block) * 4)
        want(1, (SectionKind.DATA,), ("int8",), n)
    elif enc is Encoding.INT4:
        want(0, (SectionKind.SCALES,), ("float32",), -(-n // block) * 4)
        want(1, (SectionKind.DATA,), ("uint8",), (n + 1) // 2)
    elif enc is Encoding.VALUES:
        v = sections[0].elem_dtype
        want(0, (SectionKind.VALUES,), values_elems, k * _ITEMSIZE.get(v, 0))
    elif enc is Encoding.LOWRANK:
        cols = shape[-1]
        rows = n // cols  # cols >= k >= 1: checked in _parse
        v = sections[0].elem_dtype
        want(0, (SectionKind.VALUES,), values_elems, rows * k * _ITEMSIZE.get(v, 0))
        want(1, (SectionKind.DATA,), ("float32",), cols * k * 4)
    else:  # TOPK
        v = sections[0].elem_dtype
        want(0, (SectionKind.VALUES,), values_elems, k * _ITEMSIZE.get(v, 0))
        s = sections[1]
        if s.kind is SectionKind.INDEX_BITMAP:
            want(1, (SectionKind.INDEX_BITMAP,), ("uint8",), (n + 7) // 8)
        elif s.kind is SectionKind.INDEX_VARINT:
            # 1..9 bytes per index: bounds the declared size before anything is decompressed.
            if s.elem_dtype != "uint8" or not k <= s.raw_len <= 9 * k:
                raise RemoteProtocolError(
                    f"topk varint index section of {s.raw_len} bytes cannot hold {k} indices"
                )
        else:
            raise RemoteProtocolError(f"topk tensor section 1 is {s.kind.name}")


def _section_arrays(view: memoryview, desc: TensorDescriptor) -> list[NDArray]:
    """Each section as a flat numpy array (a view of `view` unless it was lz4-compressed)."""
    out: list[NDArray] = []
    off = desc.header_len
    if desc.checksum:
        at = _HEAD.size + _DIM.size * len(desc.shape) + _SECTION.size * len(desc.sections)
        (want,) = _CHECKSUM.unpack_from(view, at)
        got = xxhash.xxh3_64(view[off:]).intdigest()
        if got != want:
            raise ChecksumMismatch(f"tensor checksum {got:016x} != declared {want:016x}")
    for s in desc.sections:
        stored = view[off : off + s.stored_len]
        off += s.stored_len
        raw: Buffer
        if s.lz4:
            try:
                raw = lz4.block.decompress(stored, uncompressed_size=s.raw_len)
            except Exception as exc:  # lz4 raises its own LZ4BlockError; map it to ours
                raise RemoteProtocolError(
                    f"tensor section {s.kind.name}: bad lz4 data ({exc})"
                ) from None
            if len(raw) != s.raw_len:
                raise RemoteProtocolError(
                    f"tensor section {s.kind.name}: lz4 gave {len(raw)} bytes, declared {s.raw_len}"
                )
        else:
            raw = stored
        out.append(np.frombuffer(raw, dtype=_wire_dtype(s.elem_dtype)))
    return out


def decode(
    buf: Buffer, *, limits: Limits = DEFAULT_LIMITS, indices: NDArray | None = None
) -> NDArray:
    """Decode an encoded tensor into a dense array of its original dtype and shape.

    RAW (without lz4) returns a view into `buf` (read-only if `buf` is): zero-copy. TOPK and
    VALUES scatter into zeros; VALUES needs the flat `indices` the values belong to (the same
    array, in the same order, as given to `encode_values`). Bad bytes raise `RemoteProtocolError`
    (`LimitExceeded` for limits); misuse raises `LocalProtocolError`.
    """
    dense, _, _ = _decode(buf, limits, indices)
    return dense


def decode_with_indices(
    buf: Buffer, *, limits: Limits = DEFAULT_LIMITS
) -> tuple[NDArray, npt.NDArray[np.int64] | None]:
    """Like `decode`, also returning the kept flat indices of a TOPK tensor (else None).

    The receiver of a top-k forward needs them to send the backward with `encode_values`.
    """
    dense, idx, _ = _decode(buf, limits, None)
    return dense, idx


def decode_described(
    buf: Buffer, *, limits: Limits = DEFAULT_LIMITS, indices: NDArray | None = None
) -> tuple[NDArray, npt.NDArray[np.int64] | None, TensorDescriptor]:
    """Like `decode_with_indices` (and `decode` with `indices`), also returning the tensor's
    descriptor (its encoding: a BF16 one says the sender's tensor was bfloat16, which numpy
    has no dtype for; a LOWRANK one gives the rank as `k`, and `decode_lowrank` also returns
    its factor Q)."""
    return _decode(buf, limits, indices)


class Decoded(NamedTuple):
    """Everything a received tensor decodes to, from one parse of its descriptor
    (`decode_full`)."""

    dense: NDArray
    """The tensor in its dtype and shape (RAW: a view of the buffer)."""
    indices: npt.NDArray[np.int64] | None
    """TOPK: the kept flat indices; else None."""
    basis: npt.NDArray[np.float32] | None
    """LOWRANK: Q (n x r float32, a fresh array); else None."""
    descriptor: TensorDescriptor


def decode_full(buf: Buffer, *, limits: Limits = DEFAULT_LIMITS) -> Decoded:
    """Decode a tensor of any encoding that needs no indices (every one but VALUES), with its
    TOPK indices or LOWRANK basis and its descriptor: what a receiver that follows the
    sender's codec needs, from one parse (`read_descriptor` then `decode_described` parse
    twice: a tenth of a small activation's receive, issue 15)."""
    view = _as_byte_view(buf)
    desc = _parse(view, limits)
    if desc.encoding is Encoding.LOWRANK:
        dense, q = _lowrank_dense(_section_arrays(view, desc), desc)
        return Decoded(dense, None, q, desc)
    dense, idx = _decode_parsed(view, desc, None)
    return Decoded(dense, idx, None, desc)


def decode_lowrank(
    buf: Buffer, *, limits: Limits = DEFAULT_LIMITS
) -> tuple[NDArray, npt.NDArray[np.float32]]:
    """Decode a LOWRANK tensor: (dense, Q), dense = P Q^T in the tensor's dtype and shape, Q the
    n x r float32 factor (a fresh array; n the last dimension, r the descriptor's `k`).

    The receiver answers a gradient G of the dense tensor (viewed as m x n) with G Q (m x r);
    the sender, which kept Q, recovers (G Q) Q^T. A tensor of another encoding raises
    `RemoteProtocolError` (the peer did not send what was expected); use `decode_described`
    when either may arrive.
    """
    view = _as_byte_view(buf)
    desc = _parse(view, limits)
    if desc.encoding is not Encoding.LOWRANK:
        raise RemoteProtocolError(f"expected a lowrank tensor, got {desc.encoding}")
    return _lowrank_dense(_section_arrays(view, desc), desc)


def _lowrank_dense(
    secs: list[NDArray], desc: TensorDescriptor
) -> tuple[NDArray, npt.NDArray[np.float32]]:
    """dense = P Q^T (in float32, float64 for a float64 tensor) and a fresh float32 Q; refuses
    non-finite factors. Any finite factors are valid: Q's orthonormality is the encoder's
    property, not checked here (P Q^T and the backward G Q are well defined either way)."""
    r = desc.k
    cols = desc.shape[-1]
    rows = desc.numel // cols
    work = np.float64 if desc.dtype == "float64" else np.float32
    p = _uncast_values(secs[0], desc.sections[0].elem_dtype, "float32").astype(work)
    q = np.array(secs[1], dtype=np.float32)  # a copy: aligned and owned by the caller
    for name, f in (("P", p), ("Q", q)):
        finite = np.isfinite(f)
        if not finite.all():
            at = int(np.argmin(finite))
            raise RemoteProtocolError(
                f"lowrank factor {name} element {at} is {float(f[at])}, must be finite"
            )
    q = q.reshape(cols, r)
    with np.errstate(over="ignore", invalid="ignore"):  # a product beyond dtype's range: inf
        dense = np.matmul(p.reshape(rows, r), q.astype(work, copy=False).T)
        return dense.astype(desc.dtype, copy=False).reshape(desc.shape), q


def _decode(
    buf: Buffer, limits: Limits, indices: NDArray | None
) -> tuple[NDArray, npt.NDArray[np.int64] | None, TensorDescriptor]:
    view = _as_byte_view(buf)
    desc = _parse(view, limits)
    dense, idx = _decode_parsed(view, desc, indices)
    return dense, idx, desc


def _decode_parsed(
    view: memoryview, desc: TensorDescriptor, indices: NDArray | None
) -> tuple[NDArray, npt.NDArray[np.int64] | None]:
    enc = desc.encoding
    if enc is Encoding.VALUES:
        if indices is None:
            raise LocalProtocolError("a values tensor decodes only with the indices it belongs to")
    elif indices is not None:
        raise LocalProtocolError(f"indices given for a {enc} tensor (only values takes them)")
    secs = _section_arrays(view, desc)
    shape = desc.shape
    dtype = desc.dtype
    n = desc.numel
    if enc is Encoding.RAW:
        data = secs[0]
        if dtype == "bool" and data.size and int(data.view(np.uint8).max()) > 1:
            raise RemoteProtocolError("bool tensor holds bytes other than 0 and 1")
        return data.reshape(shape), None
    if enc in (Encoding.FP16, Encoding.BF16):
        values = _uncast_values(secs[0], desc.sections[0].elem_dtype, dtype)
        return values.reshape(shape), None
    if enc is Encoding.INT8:
        return _dequantize_int8(secs[0], secs[1], desc.block_size, dtype).reshape(shape), None
    if enc is Encoding.INT4:
        dense = _dequantize_int4(secs[0], secs[1], n, desc.block_size, dtype)
        return dense.reshape(shape), None
    if enc is Encoding.LOWRANK:
        return _lowrank_dense(secs, desc)[0], None
    values = _uncast_values(secs[0], desc.sections[0].elem_dtype, dtype)
    out = np.zeros(n, dtype=dtype)
    if enc is Encoding.VALUES:
        assert indices is not None
        idx = _check_indices(indices, n, desc.k)
        out[idx] = values
        return out.reshape(shape), None
    idx = _decode_indices(secs[1], desc)
    out[idx] = values
    return out.reshape(shape), idx


def _decode_indices(stream: NDArray, desc: TensorDescriptor) -> npt.NDArray[np.int64]:
    n = desc.numel
    k = desc.k
    if desc.sections[1].kind is SectionKind.INDEX_BITMAP:
        if n % 8 and int(stream[-1]) >> (n % 8):
            raise RemoteProtocolError("topk bitmap has bits set past the last element")
        mask = np.unpackbits(stream, count=n, bitorder="little")
        idx = np.flatnonzero(mask)
        if idx.size != k:
            raise RemoteProtocolError(f"topk bitmap has {idx.size} bits set, descriptor says {k}")
        return idx.astype(np.int64, copy=False)
    gaps = decode_varints(stream, k)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    # Bounding each gap first keeps the cumulative sum far from uint64 overflow (k*n < 2**63).
    if int(gaps.max()) >= n:
        raise RemoteProtocolError(f"topk index gap out of range for {n} elements")
    # idx[j] = sum(gaps[:j+1] + 1) - 1, in place on the (fresh, < 2**63) gap array.
    idx = gaps.view(np.int64)
    idx += 1
    np.cumsum(idx, out=idx)
    idx -= 1
    if int(idx[-1]) >= n:
        raise RemoteProtocolError(f"topk index {int(idx[-1])} out of range for {n} elements")
    return idx


def _dequantize_int8(scales: NDArray, q: NDArray, block: int, dtype: str) -> NDArray:
    n = q.size
    out = np.empty(n, dtype=np.float32)
    full = n // block
    if full:
        qb = q[: full * block].reshape(full, block)
        np.multiply(qb, scales[:full, None], out=out[: full * block].reshape(full, block))
    if n % block:
        np.multiply(q[full * block :], scales[full], out=out[full * block :])
    return out.astype(dtype, copy=False)


def _int4_pairs() -> NDArray:
    """Byte -> its two int4 values (low nibble, high nibble) as int8, one uint16 per byte."""
    nibble = np.arange(16, dtype=np.int8)
    value = np.where(nibble < 8, nibble, nibble - 16).astype(np.int8)
    byte = np.arange(256)
    pairs = np.stack([value[byte & 0x0F], value[byte >> 4]], axis=1)  # (256, 2) int8
    return np.ascontiguousarray(pairs).view(np.uint16).reshape(256)


_INT4_PAIRS: Final = _int4_pairs()


def _dequantize_int4(scales: NDArray, data: NDArray, n: int, block: int, dtype: str) -> NDArray:
    """Element i = q[i] * scales[i // block], q unpacked from `data` one cache-sized chunk at a
    time (one table lookup per byte yields both of its values).

    Refuses a scale that is not finite or negative, the unused nibble 0x8 (-8), and a non-zero
    padding nibble: an encoder never writes them."""
    ok = (scales >= 0) & (scales <= np.finfo(np.float32).max)
    if not ok.all():
        at = int(np.argmin(ok))
        raise RemoteProtocolError(
            f"int4 tensor scale of block {at} is {float(scales[at])}, must be finite and >= 0"
        )
    if n % 2 and int(data[-1]) >> 4:
        raise RemoteProtocolError(
            f"int4 tensor padding nibble (high nibble of the last byte) is {int(data[-1]) >> 4}, "
            "must be 0"
        )
    out = np.empty(n, dtype=np.float32)
    for b0, b1, e0, e1 in _block_chunks(n, block):
        odd = e0 % 2
        q = np.take(_INT4_PAIRS, data[e0 // 2 : (e1 + 1) // 2]).view(np.int8)[odd : odd + e1 - e0]
        if int(q.min()) < -7:
            at = e0 + int(np.argmax(q < -7))
            raise RemoteProtocolError(
                f"int4 tensor element {at} is nibble 0x8 (-8), outside [-7, 7]"
            )
        rows = b1 - b0
        np.multiply(q.reshape(rows, -1), scales[b0:b1, None], out=out[e0:e1].reshape(rows, -1))
    return out.astype(dtype, copy=False)
