"""The tensor codec: round trips of every encoding, top-k exactness, and hostile input."""

from __future__ import annotations

import math
import struct
import tracemalloc
from typing import Any, Literal, cast

import hypothesis.extra.numpy as hnp
import lz4.block
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from protocol import _varint
from protocol import tensors as T
from protocol._varint import decode_varints, encode_varints
from protocol.errors import LimitExceeded, LocalProtocolError, ProtocolError, RemoteProtocolError
from protocol.limits import Limits

NDArray = npt.NDArray[Any]

ALL_DTYPES = [
    "float32",
    "float64",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "uint16",
    "uint32",
    "uint64",
]
FLOAT_DTYPES = ["float32", "float64", "float16"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)


@st.composite
def arrays(draw: st.DrawFn, dtypes: list[str], finite: bool = False) -> NDArray:
    """Arrays of any listed dtype and shape (rank 0 and empty included), sometimes strided."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    elements = None
    if dtype.kind == "f":
        width = cast(Literal[16, 32, 64], 8 * dtype.itemsize)
        elements = st.floats(
            allow_nan=not finite, allow_infinity=not finite, width=width, allow_subnormal=True
        )
    arr: NDArray = draw(hnp.arrays(dtype, SHAPES, elements=elements))
    view = draw(st.sampled_from(["c", "transpose", "step", "byteswap"]))
    if view == "transpose" and arr.ndim >= 2:
        arr = arr.T
    elif view == "step" and arr.ndim >= 1:
        arr = np.repeat(arr, 2, axis=-1)[..., ::2]
        assert not arr.flags.c_contiguous or arr.size <= 1
    elif view == "byteswap" and dtype.itemsize > 1:
        arr = arr.astype(dtype.newbyteorder(">"))
    return arr


def roundtrip(enc: T.EncodedTensor, **kw: Any) -> NDArray:
    return T.decode(enc.tobytes(), **kw)


# ---------------------------------------------------------------------------------- raw


@SETTINGS
@given(arrays(ALL_DTYPES))
def test_raw_roundtrip_every_dtype(arr: NDArray) -> None:
    enc = T.encode(arr)
    out = roundtrip(enc)
    assert out.shape == arr.shape
    assert out.dtype.name == arr.dtype.name
    assert np.array_equal(out, arr, equal_nan=arr.dtype.kind == "f")
    assert enc.nbytes == len(enc.tobytes())
    desc = T.read_descriptor(enc.tobytes())
    assert (desc.dtype, desc.shape, desc.encoding) == (arr.dtype.name, arr.shape, T.Encoding.RAW)


def test_raw_is_zero_copy_both_ways() -> None:
    arr = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    enc = T.encode(arr, compress="none")
    data = enc.buffers()[-1]
    assert np.shares_memory(np.frombuffer(data, dtype=np.uint8), arr)
    wire = bytearray(enc.tobytes())
    out = T.decode(wire)
    assert np.shares_memory(out, np.frombuffer(wire, dtype=np.uint8))
    assert np.array_equal(out, arr)
    # The descriptor is padded to 8 bytes, so an aligned buffer gives an aligned array.
    assert enc.descriptor.header_len % 8 == 0
    assert out.flags.aligned


def test_raw_non_contiguous_input_is_copied_once() -> None:
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    arr = base[:, ::3]
    enc = T.encode(arr, compress="none")
    assert not np.shares_memory(np.frombuffer(enc.buffers()[-1], dtype=np.uint8), base)
    assert np.array_equal(roundtrip(enc), arr)


def test_decode_accepts_unaligned_memoryview() -> None:
    arr = np.linspace(-1, 1, 101, dtype=np.float64)
    wire = b"x" + T.encode(arr).tobytes()
    assert np.array_equal(T.decode(memoryview(wire)[1:]), arr)


def test_raw_from_bytes_is_read_only_view() -> None:
    arr = np.arange(10, dtype=np.int16)
    out = T.decode(T.encode(arr).tobytes())
    assert not out.flags.writeable


# ------------------------------------------------------------------------- lossy casts


@SETTINGS
@given(arrays(FLOAT_DTYPES))
def test_fp16_roundtrip_is_the_fp16_cast(arr: NDArray) -> None:
    out = roundtrip(T.encode(arr, "fp16"))
    with np.errstate(over="ignore"):
        want = arr.astype(np.float16).astype(arr.dtype)
    assert out.dtype == arr.dtype.newbyteorder("=") and out.shape == arr.shape
    assert np.array_equal(out, want, equal_nan=True)


@SETTINGS
@given(arrays(["float32"]))
def test_bf16_rounds_to_nearest_even_like_torch(arr: NDArray) -> None:
    torch = pytest.importorskip("torch")
    out = roundtrip(T.encode(arr, "bf16"))
    ref = torch.from_numpy(arr.astype(np.float32, order="C")).to(torch.bfloat16)
    want = ref.to(torch.float32).numpy()
    assert out.shape == arr.shape
    assert np.array_equal(out, want, equal_nan=True)


def test_bf16_edge_values() -> None:
    x = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4028235e38, 1e-45], np.float32)
    bits = np.array([0x7FC00001, 0xFFFFFFFF, 0x3F808000, 0x3F818000], np.uint32).view(np.float32)
    out = roundtrip(T.encode(np.concatenate([x, bits]), "bf16"))
    assert out[0] == 0 and np.signbit(out[1]) and out[2] == 1.0
    assert out[3] == np.inf and out[4] == -np.inf and np.isnan(out[5])
    assert out[6] == np.inf  # rounds up past the largest finite bf16
    assert np.isnan(out[8]) and np.isnan(out[9])  # NaN payloads never round to inf
    assert out[10] == 1.0  # tie 1 + 2^-8: round to even (down)
    assert out[11] == np.float32(1.015625)  # tie with odd lsb: round up


@SETTINGS
@given(arrays(FLOAT_DTYPES, finite=True), st.sampled_from([1, 7, 64, 256]))
def test_int8_error_is_within_half_a_step(arr: NDArray, block: int) -> None:
    if arr.size and np.abs(arr.astype(np.float64)).max() > np.finfo(np.float32).max:
        with pytest.raises(LocalProtocolError, match="float32 range"):
            T.encode(arr, "int8", block_size=block)
        return
    enc = T.encode(arr, "int8", block_size=block)
    out = roundtrip(enc)
    assert out.shape == arr.shape and out.dtype.name == arr.dtype.name
    assert enc.descriptor.block_size == block
    x = arr.astype(np.float64).reshape(-1)
    pad = (-x.size) % block
    absmax = np.abs(np.concatenate([x, np.zeros(pad)])).reshape(-1, block).max(axis=1)
    step = np.repeat(absmax.astype(np.float32).astype(np.float64) / 127.0, block)[: x.size]
    err = np.abs(out.astype(np.float64).reshape(-1) - x)
    # Half a step, float32 rounding, and a few subnormal ulps when the scale is subnormal.
    tol = step * 0.5 + np.abs(x) * 1e-6 + 127 * 2.0**-149
    if arr.dtype == np.float16:
        tol += np.abs(x) * 2e-3  # the result is cast back to fp16
    assert np.all(err <= tol)


def test_int8_and_bf16_large_arrays_span_chunks() -> None:
    """The encoders work in chunks: a tensor over several chunks matches a one-shot reference."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(3 * T._CHUNK + 17) * rng.uniform(0, 5, 1)).astype(np.float32)
    block = 7
    out = roundtrip(T.encode(x, "int8", block_size=block))
    pad = np.concatenate([x, np.zeros((-x.size) % block, np.float32)]).reshape(-1, block)
    scale = np.abs(pad).max(axis=1) / np.float32(127)
    want = (np.rint(pad / scale[:, None]) * scale[:, None]).reshape(-1)[: x.size]
    assert np.allclose(out, want, rtol=1e-6, atol=1e-7)
    torch = pytest.importorskip("torch")
    bf = roundtrip(T.encode(x, "bf16"))
    assert np.array_equal(bf, torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_int8_rejects_non_finite() -> None:
    with pytest.raises(LocalProtocolError, match="finite"):
        T.encode(np.array([1.0, np.inf], np.float32), "int8")


@pytest.mark.parametrize("encoding", ["fp16", "bf16", "int8", "topk"])
def test_lossy_encodings_need_floats(encoding: str) -> None:
    with pytest.raises(LocalProtocolError, match="float"):
        T.encode(np.arange(4), encoding, k=1)


def test_unsupported_inputs_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError, match="complex"):
        T.encode(np.zeros(3, np.complex64))
    with pytest.raises(LocalProtocolError, match="encoding"):
        T.encode(np.zeros(3), "zstd")
    with pytest.raises(LocalProtocolError, match="exactly one"):
        T.encode(np.zeros(3), "topk", k=1, density=0.5)
    with pytest.raises(LocalProtocolError, match="k="):
        T.encode(np.zeros(3), "topk", k=4)
    with pytest.raises(LocalProtocolError, match="encode_values"):
        T.encode(np.zeros(3), "values")
    with pytest.raises(LocalProtocolError, match="value_dtype"):
        T.encode(np.zeros(3), "topk", k=1, value_dtype="int4")


# ---------------------------------------------------------------------------------- top-k


def assert_topk_set(mag: NDArray, idx: NDArray, k: int) -> None:
    """`idx` is sorted, unique, and holds k entries none smaller than any entry left out."""
    assert idx.dtype == np.int64 and idx.size == k
    assert np.all(np.diff(idx) > 0)
    if 0 < k < mag.size:
        kept = np.zeros(mag.size, bool)
        kept[idx] = True
        # Ties at the threshold may go either way; compare against the k-th magnitude.
        kth = np.sort(mag)[::-1][k - 1]
        assert mag[kept].min() == kth
        assert mag[~kept].max() <= kth


@st.composite
def topk_cases(draw: st.DrawFn) -> tuple[NDArray, int, str]:
    arr = draw(arrays(FLOAT_DTYPES, finite=True))
    k = draw(st.integers(0, arr.size))
    value_dtype = draw(st.sampled_from(["fp16", "bf16", "fp32"]))
    return arr, k, value_dtype


def expected_values(x: NDArray, value_dtype: str) -> NDArray:
    if value_dtype == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(x.dtype)
    if value_dtype == "bf16":
        with np.errstate(over="ignore"):
            return roundtrip(T.encode(x.astype(np.float32), "bf16")).astype(x.dtype)
    with np.errstate(over="ignore"):
        return x.astype(np.float32).astype(x.dtype)


@SETTINGS
@given(topk_cases())
def test_topk_keeps_exactly_the_largest(case: tuple[NDArray, int, str]) -> None:
    arr, k, value_dtype = case
    flat = arr.reshape(-1).astype(arr.dtype.newbyteorder("="))
    enc = T.encode(arr, "topk", k=k, value_dtype=value_dtype)
    assert enc.indices is not None
    assert_topk_set(np.abs(flat.astype(np.float64)), enc.indices, k)
    out, idx = T.decode_with_indices(enc.tobytes())
    assert T.read_descriptor(enc.tobytes()) == enc.descriptor
    assert idx is not None and np.array_equal(idx, enc.indices)
    assert out.shape == arr.shape and out.dtype.name == arr.dtype.name
    dense = out.reshape(-1)
    assert np.array_equal(dense[idx], expected_values(flat[idx], value_dtype))
    rest = np.ones(flat.size, bool)
    rest[idx] = False
    assert not dense[rest].any()


@SETTINGS
@given(
    arrays(["float32", "float64"], finite=True).filter(lambda a: a.ndim >= 1),
    st.integers(0, 7),
)
def test_topk_per_row(arr: NDArray, k: int) -> None:
    cols = arr.shape[-1]
    k = min(k, cols)
    enc = T.encode(arr, "topk", k=k, per_row=True, value_dtype="fp32")
    out = roundtrip(enc)
    assert enc.descriptor.per_row
    rows = arr.reshape(-1, cols) if cols else np.zeros((0, 0))
    assert enc.indices is not None
    assert enc.descriptor.k == k * rows.shape[0]
    for r in range(rows.shape[0]):
        in_row = enc.indices[(enc.indices >= r * cols) & (enc.indices < (r + 1) * cols)] - r * cols
        assert_topk_set(np.abs(rows[r].astype(np.float64)), in_row, k)
    kept = np.zeros(arr.size, bool)
    kept[enc.indices] = True
    with np.errstate(over="ignore"):
        want = np.where(kept, arr.reshape(-1).astype(np.float32), 0).astype(out.dtype)
    assert np.array_equal(out.reshape(-1), want)


@pytest.mark.parametrize("case", ["normal", "ties", "mostly-zero", "outlier-columns"])
def test_topk_large_arrays_sampled_threshold_is_exact(case: str) -> None:
    """Above 2**18 elements top-k selects by a sampled threshold; it must stay exact."""
    rng = np.random.default_rng(10)
    n = (1 << 18) + 123
    x = rng.standard_normal(n).astype(np.float32)
    if case == "ties":
        x = np.round(x, 1)  # thousands of equal magnitudes at any threshold
    elif case == "mostly-zero":
        x[rng.random(n) < 0.995] = 0  # fewer non-zeros than k: the threshold is 0
    elif case == "outlier-columns":
        x = x.reshape(-1, 1)[: (n // 512) * 512].reshape(-1, 512)
        x[:, ::97] *= 50
    mag = np.abs(x.reshape(-1))
    sampled = T._topk_by_sampled_threshold(mag, x.size // 100)
    assert (sampled is None) == (case == "mostly-zero")  # the fast path ran, or fell back
    for k in (1, 100, x.size // 100, x.size // 9):
        idx = T.topk_indices(x, k)
        assert_topk_set(np.abs(x.reshape(-1).astype(np.float64)), idx, k)


@pytest.mark.parametrize(
    ("density", "fmt"), [(0.001, "varint"), (0.01, "varint"), (0.05, "varint"), (0.3, "bitmap")]
)
def test_topk_index_format_is_the_smaller(density: float, fmt: str) -> None:
    x = np.random.default_rng(2).standard_normal(200_000).astype(np.float32)
    enc = T.encode(x, "topk", density=density, compress="none")
    assert enc.descriptor.k == math.ceil(density * x.size)
    assert enc.descriptor.index_format == fmt
    index_bytes = enc.descriptor.sections[1].stored_len
    assert index_bytes <= (x.size + 7) // 8
    out = roundtrip(enc)
    assert np.count_nonzero(out) <= enc.descriptor.k
    assert enc.indices is not None
    assert np.array_equal(out[enc.indices], x[enc.indices].astype(np.float16).astype(np.float32))


def test_topk_wire_size_at_one_percent() -> None:
    x = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
    enc = T.encode(x, "topk", density=0.01)
    assert enc.nbytes / enc.descriptor.k <= 3.5  # fp16 value + ~1.3 byte varint gap


def test_topk_on_rank0_and_empty() -> None:
    x = np.array(-2.5, np.float32)
    out = roundtrip(T.encode(x, "topk", k=1))
    assert out.shape == () and out == -2.5
    assert roundtrip(T.encode(x, "topk", k=0)) == 0
    empty = np.zeros((3, 0), np.float32)
    assert roundtrip(T.encode(empty, "topk", density=0.5, per_row=True)).shape == (3, 0)


# ---------------------------------------------------------------------------------- values


@SETTINGS
@given(arrays(FLOAT_DTYPES, finite=True), st.data())
def test_values_line_up_with_indices(arr: NDArray, data: st.DataObject) -> None:
    n = arr.size
    idx = np.array(data.draw(st.lists(st.integers(0, max(n - 1, 0)), unique=True, max_size=n)))
    idx = idx.astype(np.int64) if n else np.empty(0, np.int64)
    enc = T.encode_values(arr, idx)
    assert enc.descriptor.k == idx.size and enc.descriptor.shape == arr.shape
    out = T.decode(enc.tobytes(), indices=idx)
    assert out.shape == arr.shape and out.dtype.name == arr.dtype.name
    flat = arr.reshape(-1).astype(arr.dtype.newbyteorder("="))
    assert np.array_equal(out.reshape(-1)[idx], expected_values(flat[idx], "fp16"))
    rest = np.ones(n, bool)
    rest[idx] = False
    assert not out.reshape(-1)[rest].any()


def test_values_backward_of_topk_edge() -> None:
    rng = np.random.default_rng(4)
    act = rng.standard_normal((16, 48)).astype(np.float32)
    fwd = T.encode(act, "topk", density=0.1)
    _, idx = T.decode_with_indices(fwd.tobytes())  # the receiver's copy of the indices
    assert idx is not None
    grad = rng.standard_normal(act.shape).astype(np.float32)
    back = T.encode_values(grad, idx, "bf16")
    assert fwd.indices is not None
    got = T.decode(back.tobytes(), indices=fwd.indices)  # the sender kept its own
    mask = np.zeros(act.size, bool)
    mask[idx] = True
    assert np.allclose(got.reshape(-1), np.where(mask, grad.reshape(-1), 0), rtol=1 / 128)


def test_values_misuse() -> None:
    grad = np.ones(10, np.float32)
    wire = T.encode_values(grad, np.array([1, 3])).tobytes()
    with pytest.raises(LocalProtocolError, match="indices"):
        T.decode(wire)
    with pytest.raises(RemoteProtocolError, match="2 values but 3 indices"):
        T.decode(wire, indices=np.array([1, 2, 3]))
    with pytest.raises(LocalProtocolError, match="out of range"):
        T.decode(wire, indices=np.array([1, 10]))
    with pytest.raises(LocalProtocolError, match="only values"):
        T.decode(T.encode(grad).tobytes(), indices=np.array([1]))


# ----------------------------------------------------------------------------------- lz4


def test_lz4_only_when_it_pays() -> None:
    zeros = np.zeros(100_000, np.int32)
    enc = T.encode(zeros)
    assert enc.descriptor.sections[0].lz4 and enc.nbytes < 2000
    assert np.array_equal(roundtrip(enc), zeros)
    noise = np.random.default_rng(5).standard_normal(100_000).astype(np.float32)
    assert not T.encode(noise).descriptor.sections[0].lz4
    assert not T.encode(noise, compress="lz4").descriptor.sections[0].lz4
    assert not T.encode(zeros, compress="none").descriptor.sections[0].lz4


def test_lz4_auto_samples_incompressible_data(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = T._lz4_compress

    def counting(view: memoryview) -> bytes:
        seen.append(view.nbytes)
        return real(view)

    monkeypatch.setattr(T, "_lz4_compress", counting)
    noise = np.random.default_rng(6).standard_normal(1 << 20).astype(np.float32)
    T.encode(noise)
    assert 0 < sum(seen) <= T.LZ4_SAMPLE_CHUNK * T.LZ4_SAMPLE_CHUNKS
    seen.clear()
    T.encode(np.zeros(1 << 20, np.float32))
    assert sum(seen) >= 4 << 20  # compressible: the sample passed, then all 4 MiB were compressed


@pytest.mark.parametrize("encoding", ["raw", "fp16", "bf16", "int8", "topk"])
def test_forced_lz4_and_checksum_roundtrip(encoding: str) -> None:
    x = np.round(np.random.default_rng(7).standard_normal((40, 50)), 1).astype(np.float32)
    enc = T.encode(x, encoding, compress="lz4", checksum=True, density=0.5)
    assert enc.descriptor.checksum
    plain = T.encode(x, encoding, compress="none", density=0.5)
    assert np.array_equal(roundtrip(enc), roundtrip(plain))


# ------------------------------------------------------------------------------ varints


@SETTINGS
@given(st.lists(st.integers(0, (1 << 63) - 1), max_size=200))
def test_varint_roundtrip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.uint64)
    stream = encode_varints(arr)
    want = b"".join(_leb128(v) for v in values)
    assert stream.tobytes() == want
    assert np.array_equal(decode_varints(stream, len(values)), arr)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, (1 << 20)), max_size=300), st.integers(9, 40))
def test_varint_decode_in_small_pieces(values: list[int], chunk: int) -> None:
    """Decoding works in pieces of the stream; values straddling a piece boundary included."""
    arr = np.array(values, dtype=np.uint64)
    stream = encode_varints(arr)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_varint, "_DECODE_CHUNK", chunk)
        assert np.array_equal(decode_varints(stream, len(values)), arr)
        if len(values) > 1:
            # A wrong count is refused; which check fires first depends on the byte lengths.
            wrong_count = "holds|cannot hold|ends inside"
            with pytest.raises(RemoteProtocolError, match=wrong_count):
                decode_varints(stream, len(values) - 1)
            with pytest.raises(RemoteProtocolError, match=wrong_count):
                decode_varints(stream, len(values) + 1)
        # A final byte followed by a run of continuation bytes longer than a piece.
        bad = np.array([0x05] + [0x80] * (chunk + 3) + [0x01], np.uint8)
        with pytest.raises(RemoteProtocolError, match="longer than"):
            decode_varints(bad, 2)


def _leb128(v: int) -> bytes:
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        out.append(byte | (0x80 if v else 0))
        if not v:
            return bytes(out)


def test_varint_malformed() -> None:
    with pytest.raises(RemoteProtocolError, match="inside a value"):
        decode_varints(np.array([0x01, 0x81], np.uint8), 1)
    with pytest.raises(RemoteProtocolError, match="inside a value"):
        decode_varints(np.array([0x80], np.uint8), 1)
    with pytest.raises(RemoteProtocolError, match="holds 2"):
        decode_varints(np.array([0x81, 0x01, 0x81, 0x01], np.uint8), 3)
    with pytest.raises(RemoteProtocolError, match="longer than"):
        decode_varints(np.array([0xFF] * 10 + [0x01], np.uint8), 1)


# --------------------------------------------------------------------------- robustness


def valid_encodings() -> list[bytes]:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    return [
        T.encode(x).tobytes(),
        T.encode(x, "fp16", checksum=True).tobytes(),
        T.encode(x, "bf16").tobytes(),
        T.encode(x, "int8", block_size=16).tobytes(),
        T.encode(x, "topk", density=0.1).tobytes(),
        T.encode(x, "topk", density=0.9, compress="lz4").tobytes(),
        T.encode(np.zeros(3000, np.bool_)).tobytes(),
        T.encode(np.array(7, np.int64)).tobytes(),
    ]


VALID = valid_encodings()


def test_every_truncation_is_refused() -> None:
    for wire in VALID:
        for cut in range(len(wire)):
            with pytest.raises(RemoteProtocolError):
                T.decode(wire[:cut])
        with pytest.raises(RemoteProtocolError, match="bytes"):
            T.decode(wire + b"\0")


def _decode_or_protocol_error(wire: bytes | bytearray, limits: Limits | None = None) -> None:
    try:
        out = T.decode(wire, limits=limits or Limits())
    except ProtocolError:
        return
    assert isinstance(out, np.ndarray)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_flipped_bits_raise_only_protocol_errors(wire: bytes, data: st.DataObject) -> None:
    buf = bytearray(wire)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(buf) - 1))
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_protocol_error(buf)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_protocol_errors(blob: bytes) -> None:
    _decode_or_protocol_error(blob)
    _decode_or_protocol_error(b"FT\x01" + blob)


def _header(
    enc: int,
    dtype: int,
    shape: list[int],
    sections: list[tuple[int, int, int, int, int]],
    *,
    k: int = 0,
    block: int = 0,
    flags: int = 0,
) -> bytes:
    body = 24 + 8 * len(shape) + 24 * len(sections)
    hlen = -(-body // 8) * 8
    out = struct.pack(
        "<2sBBBBBBIIQ", b"FT", 1, enc, dtype, flags, len(shape), len(sections), hlen, block, k
    )
    out += b"".join(struct.pack("<Q", d) for d in shape)
    for kind, codec, elem, stored, raw in sections:
        out += struct.pack("<BBBBIQQ", kind, codec, elem, 0, 0, stored, raw)
    return out + b"\0" * (hlen - body)


SMALL = Limits(max_tensor_elements=1 << 16, max_decompressed_bytes=1 << 18, max_tensor_rank=4)


def _refused_peak(wire: bytes, exc: type[Exception]) -> int:
    """Decode `wire` under SMALL limits expecting `exc`; return the peak bytes allocated."""
    tracemalloc.start()
    try:
        with pytest.raises(exc):
            T.decode(wire, limits=SMALL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_absurd_descriptors_hit_limits_before_allocating() -> None:
    cases = [
        # raw float32 of 2**40 elements, no data
        _header(1, 1, [1 << 20, 1 << 20], [(1, 0, 1, 0, 0)]),
        # top-k claiming a huge dense shape with no values: the dense output is the bomb
        _header(5, 1, [1 << 17], [(3, 0, 3, 0, 0), (4, 0, 9, 0, 0)]),
        # rank above the limit
        _header(1, 9, [1] * 9, [(1, 0, 9, 1, 1)]) + b"\0",
        # an lz4 section declaring more than max_decompressed_bytes
        _header(1, 9, [1 << 16], [(1, 1, 9, 16, 1 << 30)]) + b"\0" * 16,
    ]
    for wire in cases:
        assert _refused_peak(wire, LimitExceeded) < 64 << 10


def test_lz4_bombs_are_refused() -> None:
    zeros = np.zeros(1 << 20, np.uint8)
    wire = T.encode(zeros).tobytes()
    assert len(wire) < 10_000  # 1 MiB of zeros, a few KiB on the wire
    with pytest.raises(LimitExceeded):
        T.decode(wire, limits=SMALL)
    # Lie about the decompressed size (within limits): lz4 must stop at the declared size.
    packed = lz4.block.compress(zeros.tobytes(), store_size=False)
    lie = _header(1, 9, [1000], [(1, 1, 9, len(packed), 1000)]) + packed
    assert _refused_peak(lie, RemoteProtocolError) < 64 << 10
    garbage = _header(1, 9, [1000], [(1, 1, 9, 8, 1000)]) + b"\xff" * 8
    with pytest.raises(RemoteProtocolError, match="lz4"):
        T.decode(garbage)


def _topk_bomb(n: int, k: int) -> bytes:
    """A top-k tensor of n float32 whose k fp16 values and k one-byte gaps are lz4'd zeros."""
    values = lz4.block.compress(bytes(2 * k), store_size=False)
    gaps = lz4.block.compress(bytes(k), store_size=False)
    sections = [(3, 1, 3, len(values), 2 * k), (4, 1, 9, len(gaps), k)]
    return _header(5, 1, [n], sections, k=k) + values + gaps


def test_topk_index_bombs_stay_within_limits() -> None:
    n = 1 << 15
    within = _topk_bomb(n, n // 2)  # 4n + 8k = 2**18: exactly the limit
    assert len(within) < 2000
    tracemalloc.start()
    try:
        out, idx = T.decode_with_indices(within, limits=SMALL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert idx is not None and np.array_equal(idx, np.arange(n // 2))
    assert not out.any()
    assert peak <= 3 * SMALL.max_decompressed_bytes
    over = _topk_bomb(n, n)  # the int64 indices alone would double the decoded size
    assert _refused_peak(over, LimitExceeded) < 64 << 10


def test_descriptor_field_errors_name_the_field() -> None:
    good = T.encode(np.arange(4, dtype=np.int32)).tobytes()
    cases = {
        "magic": b"XX" + good[2:],
        "version": good[:2] + b"\x09" + good[3:],
        "encoding id": good[:3] + b"\x63" + good[4:],
        "dtype id": good[:4] + b"\x63" + good[5:],
        "flags": good[:5] + b"\x80" + good[6:],
    }
    for what, wire in cases.items():
        with pytest.raises(RemoteProtocolError, match=what.split()[0]):
            T.decode(wire)
    bad_bool = T.encode(np.zeros(4, np.bool_), compress="none").tobytes()[:-1] + b"\x02"
    with pytest.raises(RemoteProtocolError, match="bool"):
        T.decode(bad_bool)
    bitmap = bytearray(T.encode(np.arange(1.0, 13.0, dtype=np.float32), "topk", k=12).tobytes())
    bitmap[-1] |= 0x80  # 12 elements: bits 12..15 of the second byte are padding
    with pytest.raises(RemoteProtocolError, match="past the last element"):
        T.decode(bytes(bitmap))
    # top-k indices out of range for the shape
    topk = bytearray(T.encode(np.arange(1000, dtype=np.float32), "topk", k=1).tobytes())
    topk[-1] = 0x7F
    with pytest.raises(RemoteProtocolError, match="out of range"):
        T.decode(bytes(topk))


@pytest.mark.fuzz
@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_fuzz_tensor_decoder(wire: bytes, data: st.DataObject) -> None:
    buf = bytearray(wire)
    action = data.draw(st.sampled_from(["flip", "splice", "truncate", "extend"]))
    if action == "flip":
        for _ in range(data.draw(st.integers(1, 16))):
            buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    elif action == "splice":
        at = data.draw(st.integers(0, len(buf)))
        buf[at:at] = data.draw(st.binary(max_size=64))
    elif action == "truncate":
        del buf[data.draw(st.integers(0, len(buf))) :]
    else:
        buf += data.draw(st.binary(max_size=64))
    assume(bytes(buf) != wire)
    tracemalloc.start()
    try:
        _decode_or_protocol_error(buf, SMALL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Whatever the bytes declare, decoding allocates within the limits (plus small change).
    assert peak <= 2 * SMALL.max_decompressed_bytes + (64 << 10)


@pytest.mark.parametrize("encoding,kw", [
    ("raw", {}), ("bf16", {}), ("fp16", {}), ("int8", {"block_size": 64}),
    ("int4", {"block_size": 64}), ("topk", {"k": 40}), ("topk", {"k": 3, "per_row": True}),
    ("lowrank", {"k": 4}),
])
def test_decode_full_is_decode_described_and_decode_lowrank_in_one_parse(
        encoding: str, kw: dict[str, Any]) -> None:
    """What a receiver following the sender's codec gets from one parse equals what the
    two-parse path (`read_descriptor`, then `decode_described` or `decode_lowrank`) gave."""
    x = np.random.default_rng(3).standard_normal((6, 16)).astype(np.float32)
    wire = T.encode(x, encoding, **kw).tobytes()
    got = T.decode_full(wire)
    assert got.descriptor == T.read_descriptor(wire)
    dense, idx, desc = T.decode_described(wire)
    assert desc == got.descriptor
    assert np.array_equal(got.dense, dense)
    if idx is None:
        assert got.indices is None
    else:
        assert got.indices is not None and np.array_equal(got.indices, idx)
    if encoding == "lowrank":
        _, q = T.decode_lowrank(wire)
        assert got.basis is not None and np.array_equal(got.basis, q)
    else:
        assert got.basis is None


def test_decode_full_refuses_values_and_bad_bytes() -> None:
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(LocalProtocolError, match="indices"):
        T.decode_full(T.encode_values(x, np.arange(3)).tobytes())
    with pytest.raises(RemoteProtocolError):
        T.decode_full(T.encode(x, "raw").tobytes()[:-1])


@given(st.lists(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6),
                           elements=st.floats(-1e6, 1e6, width=32)),
                min_size=1, max_size=5),
       st.booleans())
def test_a_concatenation_encodes_as_the_concatenated_array_without_copying(
        arrays: list[npt.NDArray[np.float32]], checksum: bool) -> None:
    """`encode_concat` (a gradient exchange's bucket) sends the bytes `encode` would send for
    the concatenation, each array's own memory as a part of it."""
    assume(all(a.size for a in arrays))
    got = T.encode_concat(arrays, checksum=checksum)
    want = T.encode(np.concatenate([a.ravel() for a in arrays]), compress="none",
                    checksum=checksum)
    assert got.tobytes() == want.tobytes()
    assert got.descriptor == want.descriptor
    for a, part in zip(arrays, got.buffers()[1:], strict=True):
        assert np.shares_memory(np.frombuffer(part, dtype=np.float32), a)
    np.testing.assert_array_equal(T.decode(got.tobytes()),
                                  np.concatenate([a.ravel() for a in arrays]))


def test_a_concatenation_of_nothing_or_of_mixed_dtypes_is_refused() -> None:
    with pytest.raises(LocalProtocolError, match="at least one"):
        T.encode_concat([])
    with pytest.raises(LocalProtocolError, match="one dtype"):
        T.encode_concat([np.zeros(2, np.float32), np.zeros(2, np.float64)])
