"""int4 block quantization and stochastic rounding (int8 and int4) of the tensor codec.

Bounds checked (docs/tensor-codec.md): with `step` = absmax / qmax of the element's block (qmax
127 for int8, 7 for int4), nearest rounding is off by at most step / 2 and stochastic rounding by
less than one step, plus float32 rounding, qmax * 2^-149 when the scale is subnormal, and the
rounding of a float16 result. Stochastic rounding is unbiased: over many seeds the mean of the
decoded value converges on x.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Literal, cast

import hypothesis.extra.numpy as hnp
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import tensors as T
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

NDArray = npt.NDArray[Any]

FLOAT_DTYPES = ["float32", "float64", "float16"]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=9)
BLOCKS = [1, 2, 3, 7, 64, 256]
QMAX = {"int8": 127, "int4": 7}
F32_MAX = float(np.finfo(np.float32).max)


@st.composite
def float_arrays(draw: st.DrawFn) -> NDArray:
    """Finite float arrays of any shape (rank 0 and empty included), sometimes strided."""
    dtype = np.dtype(draw(st.sampled_from(FLOAT_DTYPES)))
    width = cast(Literal[16, 32, 64], 8 * dtype.itemsize)
    elements = st.floats(allow_nan=False, allow_infinity=False, width=width)
    arr: NDArray = draw(hnp.arrays(dtype, SHAPES, elements=elements))
    view = draw(st.sampled_from(["c", "transpose", "step"]))
    if view == "transpose" and arr.ndim >= 2:
        arr = arr.T
    elif view == "step" and arr.ndim >= 1:
        arr = np.repeat(arr, 2, axis=-1)[..., ::2]
    return arr


def roundtrip(enc: T.EncodedTensor) -> NDArray:
    return T.decode(enc.tobytes())


def block_steps(x: NDArray, block: int, qmax: int) -> npt.NDArray[np.float64]:
    """absmax / qmax of each element's block (absmax as float32, as the encoder sees it)."""
    flat = x.astype(np.float32).astype(np.float64).reshape(-1)
    pad = np.concatenate([np.abs(flat), np.zeros((-flat.size) % block)])
    absmax = pad.reshape(-1, block).max(axis=1) if pad.size else pad
    return np.repeat(absmax / qmax, block)[: flat.size]


def tolerance(x: NDArray, block: int, qmax: int, steps: float) -> npt.NDArray[np.float64]:
    """`steps` quantization steps plus float32 rounding, a subnormal scale's slack and (for
    float16 results) the cast back to float16."""
    ax = np.abs(x.astype(np.float64).reshape(-1))
    step = block_steps(x, block, qmax)
    tol = step * steps + ax * 1e-6 + qmax * 2.0**-149
    if x.dtype == np.float16:
        tol += (ax + step) * 2e-3 + 2.0**-25  # relative for normals, absolute for subnormals
    return tol


def scales_of(wire: bytes) -> npt.NDArray[np.float32]:
    """The SCALES section of an uncompressed int8 / int4 encoding."""
    desc = T.read_descriptor(wire)
    s = desc.sections[0]
    assert s.kind is T.SectionKind.SCALES and not s.lz4
    return np.frombuffer(wire, np.float32, s.raw_len // 4, desc.header_len)


def packed_of(wire: bytes) -> npt.NDArray[np.uint8]:
    """The DATA section (packed nibbles) of an uncompressed int4 encoding."""
    desc = T.read_descriptor(wire)
    s = desc.sections[1]
    assert s.kind is T.SectionKind.DATA and not s.lz4
    return np.frombuffer(wire, np.uint8, s.raw_len, len(wire) - s.raw_len)


def pack_reference(q: NDArray) -> npt.NDArray[np.uint8]:
    """Two's complement nibbles, element 2i low, 2i+1 high, odd count padded with 0."""
    nib = (np.asarray(q, np.int64) & 0x0F).astype(np.uint8)
    if nib.size % 2:
        nib = np.concatenate([nib, np.zeros(1, np.uint8)])
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


# ------------------------------------------------------------------------------ round trips


@SETTINGS
@given(float_arrays(), st.sampled_from(BLOCKS), st.sampled_from(["int8", "int4"]), st.booleans())
def test_error_within_the_documented_bound(
    arr: NDArray, block: int, encoding: str, stochastic: bool
) -> None:
    if arr.size and np.abs(arr.astype(np.float64)).max() > F32_MAX:
        with pytest.raises(LocalProtocolError, match="float32 range"):
            T.encode(arr, encoding, block_size=block, stochastic=stochastic)
        return
    enc = T.encode(arr, encoding, block_size=block, stochastic=stochastic, seed=arr.size)
    out = roundtrip(enc)
    assert out.shape == arr.shape and out.dtype.name == arr.dtype.name
    assert enc.descriptor.encoding == encoding and enc.descriptor.block_size == block
    x = arr.astype(np.float64).reshape(-1)
    err = np.abs(out.astype(np.float64).reshape(-1) - x)
    # Nearest: half a step. Stochastic: less than one step (the two neighbours of x/scale).
    qmax = QMAX[encoding]
    assert np.all(err <= tolerance(arr, block, qmax, 1.0 if stochastic else 0.5))


@SETTINGS
@given(st.integers(0, 600), st.sampled_from([*BLOCKS, 255, 257]))
def test_int4_byte_count_is_exact(n: int, block: int) -> None:
    x = np.linspace(-1.0, 1.0, n, dtype=np.float32)
    enc = T.encode(x, "int4", block_size=block, compress="none")
    header = -(-(24 + 8 + 2 * 24) // 8) * 8
    assert enc.descriptor.header_len == header
    assert enc.nbytes == len(enc.tobytes()) == header + 4 * -(-n // block) + (n + 1) // 2
    assert [s.elem_dtype for s in enc.descriptor.sections] == ["float32", "uint8"]


def test_int4_bytes_per_element_at_block_256() -> None:
    n = 1 << 16
    enc = T.encode(np.ones(n, np.float32), "int4", compress="none")
    assert enc.nbytes - enc.descriptor.header_len == n * (0.5 + 4 / 256)
    assert enc.nbytes / n < 0.52


def test_int4_layout_by_hand() -> None:
    """absmax 7 -> scale 1: q = rint(x) = [1, -7, 4, 0, -4] (3.5 rounds to even), packed as
    two's complement nibbles, element 2i low: 0x91 (1, -7 = 0x9), 0x04 (4, 0), 0x0c (-4, pad 0)."""
    x = np.array([1.0, -7.0, 3.5, 0.2, -3.6], np.float32)
    wire = T.encode(x, "int4", compress="none").tobytes()
    assert scales_of(wire).tolist() == [1.0]
    assert packed_of(wire).tobytes() == bytes([0x91, 0x04, 0x0C])
    assert T.decode(wire).tolist() == [1.0, -7.0, 4.0, 0.0, -4.0]
    assert T.read_descriptor(wire).encoding is T.Encoding.INT4
    assert wire[3] == 7  # the wire id of int4


def test_int4_rank0_empty_and_odd_counts() -> None:
    for x in (np.zeros((0, 3), np.float64), np.zeros((3, 0), np.float16)):
        out = roundtrip(T.encode(x, "int4", block_size=2))
        assert out.shape == x.shape and out.dtype == x.dtype
    # Blocks of two with scales 1, 2, 0, 0.5 and a last block of one (scale 1): all on the grid.
    grid = [7.0, 3.0, -14.0, 2.0, 0.0, 0.0, 3.5, -1.5, 7.0]
    for dtype in FLOAT_DTYPES:
        x = np.array(grid, dtype).reshape(3, 3)
        out = roundtrip(T.encode(x, "int4", block_size=2))
        assert out.dtype == x.dtype and np.array_equal(out, x)
    scalar = np.array(2.5, np.float32)
    out = roundtrip(T.encode(scalar, "int4"))
    assert out.shape == () and abs(float(out) - 2.5) <= 2.5e-6


@pytest.mark.parametrize("block", [3, 7, 4096, T._CHUNK + 1, 3 * T._CHUNK])
@pytest.mark.parametrize("stochastic", [False, True])
def test_int4_large_arrays_span_chunks(block: int, stochastic: bool) -> None:
    """Chunks of odd length hand their unpaired last element to the next: the packed bytes
    equal a one-shot reference built from the encoder's own scales."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal(3 * T._CHUNK + 17) * rng.uniform(0, 5, 1)).astype(np.float32)
    wire = T.encode(x, "int4", block_size=block, compress="none", stochastic=stochastic).tobytes()
    scale = np.repeat(scales_of(wire), block)[: x.size]
    qf = x / scale
    packed = packed_of(wire)
    if stochastic:
        out = T.decode(wire)
        q = np.rint(out / scale)
        assert np.all((q == np.floor(qf)) | (q == np.ceil(qf)) | (np.abs(q) == 7))
        assert np.array_equal(packed, pack_reference(q))
    else:
        assert np.array_equal(packed, pack_reference(np.clip(np.rint(qf), -7, 7)))
        assert np.array_equal(T.decode(wire), np.clip(np.rint(qf), -7, 7) * scale)


def test_extreme_magnitudes() -> None:
    """Near float32 max the scale steps down so qmax * scale stays finite; subnormal blocks
    decode within the subnormal slack."""
    big = np.array([F32_MAX, -F32_MAX, F32_MAX / 3, 1.0], np.float32)
    tiny = np.array([1e-45, -3e-45, 2e-40, 0.0, 190 * 2.0**-149], np.float32)
    for encoding, qmax in QMAX.items():
        for x in (big, tiny):
            for stochastic in (False, True):
                out = roundtrip(T.encode(x, encoding, block_size=4, stochastic=stochastic))
                assert np.isfinite(out).all()
                err = np.abs(out.astype(np.float64) - x.astype(np.float64))
                assert np.all(err <= tolerance(x, 4, qmax, 1.0 if stochastic else 0.5))


def test_forced_lz4_and_checksum_roundtrip() -> None:
    x = np.zeros(5000, np.float32)
    x[::97] = 1.5
    for stochastic in (False, True):
        enc = T.encode(x, "int4", compress="lz4", checksum=True, stochastic=stochastic)
        assert enc.descriptor.sections[1].lz4
        assert np.array_equal(roundtrip(enc), x)


def test_int4_refuses_what_int8_refuses() -> None:
    with pytest.raises(LocalProtocolError, match="finite"):
        T.encode(np.array([1.0, np.nan], np.float32), "int4")
    with pytest.raises(LocalProtocolError, match="finite"):
        T.encode(np.array([np.inf], np.float32), "int4", stochastic=True)
    with pytest.raises(LocalProtocolError, match="float32 range"):
        T.encode(np.array([1e300]), "int4")
    with pytest.raises(LocalProtocolError, match="float"):
        T.encode(np.arange(4), "int4")
    for block in (0, T.MAX_BLOCK_SIZE + 1):
        with pytest.raises(LocalProtocolError, match="block_size"):
            T.encode(np.ones(4, np.float32), "int4", block_size=block)


# ------------------------------------------------------------------------- int8 unchanged


def test_int8_nearest_bytes_unchanged() -> None:
    """Hand-computed: block 0 has absmax 127 (scale 1), block 1 absmax 254 (scale 2); rint
    rounds ties to even (-63.5 -> -64, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2)."""
    x = np.array([127.0, -63.5, 1.49, 0.5, -254.0, 3.0, 5.0, 0.0], np.float32)
    want = (
        struct.pack("<2sBBBBBBIIQ", b"FT", 1, 4, 1, 0, 1, 2, 80, 4, 0)
        + struct.pack("<Q", 8)
        + struct.pack("<BBBBIQQ", 2, 0, 1, 0, 0, 8, 8)  # SCALES float32
        + struct.pack("<BBBBIQQ", 1, 0, 8, 0, 0, 8, 8)  # DATA int8
        + struct.pack("<2f", 1.0, 2.0)
        + struct.pack("<8b", 127, -64, 1, 0, -127, 2, 2, 0)
    )
    assert T.encode(x, "int8", block_size=4).tobytes() == want
    assert T.encode(x, "int8", block_size=4, stochastic=False, seed=5).tobytes() == want
    # A scale that is not a round number: float32(1 / 127), q = rint(0.3 * 127) = 38.
    y = np.array([1.0, 0.3], np.float32)
    wire = T.encode(y, "int8", block_size=2).tobytes()
    assert scales_of(wire).tolist() == [float(np.float32(1.0) / np.float32(127.0))]
    assert wire[-2:] == bytes([127, 38])


# ------------------------------------------------------------------- stochastic rounding


SEEDS = 2000


def _fixed_array() -> npt.NDArray[np.float32]:
    """Four blocks of 16: normal values, exact grid points and ties, tiny values, and values
    near float32 max (where the scale steps down)."""
    rng = np.random.default_rng(2024)
    normal = rng.standard_normal(16) * 3.0
    grid = np.array([7, -7, 3.5, -3.5, 0.5, -0.5, 1.0, 0.0, 6.99, -0.01, 2.25, 4.75, 5.5, 1.5,
                     -6.5, 0.1])
    tiny = rng.uniform(-1, 1, 16) * 1e-30
    huge = rng.uniform(-1, 1, 16) * 3e38
    huge[3] = F32_MAX
    return np.concatenate([normal, grid, tiny, huge]).astype(np.float32)


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(encoding: str) -> None:
    """The mean of the decoded value over 2000 seeds is within 4 * scale / sqrt(2000) of x.

    Each decoded value is one of the two grid points around x (an interval of width `scale`)
    and has mean x, so by Hoeffding the mean of N independent draws strays from x by t with
    probability at most 2 exp(-2 N t^2 / scale^2): 2 exp(-32) ~ 3e-14 per element at
    t = 4 scale / sqrt(N), 0.09 of a step. Nearest rounding, biased by up to half a step, fails
    the same check.
    """
    x = _fixed_array()
    block = 16
    nearest = T.encode(x, encoding, block_size=block, compress="none").tobytes()
    scale = np.repeat(scales_of(nearest).astype(np.float64), block)
    total = np.zeros(x.size)
    for seed in range(SEEDS):
        wire = T.encode(x, encoding, block_size=block, stochastic=True, seed=seed).tobytes()
        assert np.array_equal(scales_of(wire), scales_of(nearest))  # same scales, same format
        total += T.decode(wire).astype(np.float64)
    bound = 4.0 * scale / math.sqrt(SEEDS)
    dev = np.abs(total / SEEDS - x.astype(np.float64))
    assert np.all(dev <= bound), (dev / scale).max()
    # The check has the power to see nearest rounding's bias.
    biased = np.abs(T.decode(nearest).astype(np.float64) - x.astype(np.float64))
    assert np.any(biased > bound)


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased_in_aggregate(encoding: str) -> None:
    """Over a million elements at every fractional position, the mean error of one encoding
    is within 6 standard errors of 0 (0.003 of a step): a systematic bias above that shows."""
    rng = np.random.default_rng(5)
    x = rng.uniform(-1.0, 1.0, 1 << 20).astype(np.float32)
    x[::256] = 1.0  # every block of 256 has absmax 1
    out = roundtrip(T.encode(x, encoding, stochastic=True, seed=1))
    step = 1.0 / QMAX[encoding]
    err = (out.astype(np.float64) - x.astype(np.float64)) / step
    assert abs(err.mean()) <= 6 * 0.5 / math.sqrt(x.size)
    near = roundtrip(T.encode(x, encoding))
    assert np.abs(near.astype(np.float64) - x).mean() < np.abs(err).mean() * step


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_stochastic_rounding_is_deterministic_per_seed(encoding: str) -> None:
    x = np.random.default_rng(3).standard_normal((40, 50)).astype(np.float32)
    a = T.encode(x, encoding, stochastic=True, seed=11).tobytes()
    assert T.encode(x, encoding, stochastic=True, seed=11).tobytes() == a
    assert T.encode(x, encoding, stochastic=True, seed=12).tobytes() != a
    assert T.encode(x, encoding, stochastic=True).tobytes() != a  # seed 0
    assert T.encode(x, encoding).tobytes() != a
    assert T.encode(x, encoding).tobytes() == T.encode(x, encoding, seed=11).tobytes()


@pytest.mark.parametrize("encoding", ["raw", "fp16", "bf16", "topk"])
def test_stochastic_only_for_int8_and_int4(encoding: str) -> None:
    with pytest.raises(LocalProtocolError, match="stochastic"):
        T.encode(np.ones(8, np.float32), encoding, density=0.5, stochastic=True)


def test_seed_must_be_a_non_negative_int() -> None:
    for seed in (-1, 1.5, True):
        with pytest.raises(LocalProtocolError, match="seed"):
            T.encode(np.ones(8, np.float32), "int4", stochastic=True, seed=cast(int, seed))


# ------------------------------------------------------------------------ malformed input


def _valid_int4() -> list[bytes]:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 11)).astype(np.float32)
    return [
        T.encode(x, "int4", block_size=16).tobytes(),
        T.encode(x[:, :5], "int4", block_size=3, stochastic=True).tobytes(),
        T.encode(np.array(1.25, np.float64), "int4").tobytes(),
        T.encode(np.zeros(0, np.float16), "int4").tobytes(),
        T.encode(np.zeros(3000, np.float32), "int4", checksum=True).tobytes(),
    ]


VALID = _valid_int4()


def _decode_or_protocol_error(wire: bytes | bytearray) -> None:
    try:
        out = T.decode(wire)
    except ProtocolError:
        return
    assert isinstance(out, np.ndarray)


def test_every_truncation_is_refused() -> None:
    for wire in VALID:
        for cut in range(len(wire)):
            with pytest.raises(RemoteProtocolError):
                T.decode(wire[:cut])
        with pytest.raises(RemoteProtocolError, match="bytes"):
            T.decode(wire + b"\0")


def _section_entry(wire: bytes, i: int) -> int:
    """Offset of section table entry `i` (rank from the head)."""
    return 24 + 8 * wire[6] + 24 * i


def test_wrong_section_lengths_and_types_are_refused() -> None:
    x = np.linspace(-1, 1, 9, dtype=np.float32)  # 9 elements: 5 data bytes, 2 blocks of 8
    wire = T.encode(x, "int4", block_size=8, compress="none").tobytes()
    at_scales, at_data = _section_entry(wire, 0), _section_entry(wire, 1)

    def patched(at: int, fmt: str, *values: int) -> bytes:
        buf = bytearray(wire)
        struct.pack_into(fmt, buf, at, *values)
        return bytes(buf)

    cases = {
        # one data byte too many (the buffer grows to match: only the length is wrong)
        "shape implies 5": patched(at_data + 8, "<QQ", 6, 6) + b"\0",
        "shape implies 8": patched(at_scales + 8, "<QQ", 4, 4)[:-4],
        "element type int8": patched(at_data + 2, "<B", 8),
        "section 1 is SCALES": patched(at_data, "<B", 2),
        "block size 0": patched(12, "<I", 0),
        "sections": patched(7, "<B", 1),
    }
    for what, bad in cases.items():
        with pytest.raises(RemoteProtocolError, match=what):
            T.decode(bad)
    # The block size decides how many scales there must be.
    with pytest.raises(RemoteProtocolError, match="shape implies 4"):
        T.decode(patched(12, "<I", 9))


def test_bad_nibbles_and_scales_are_refused() -> None:
    x = np.linspace(-1, 1, 9, dtype=np.float32)
    wire = T.encode(x, "int4", block_size=8, compress="none").tobytes()
    data_at = len(wire) - 5
    scales_at = data_at - 8
    for pos, byte, what in [
        (data_at, 0x08, "element 0 is nibble 0x8"),
        (data_at + 1, 0x80, "element 3 is nibble 0x8"),
        (data_at + 4, 0x10, "padding nibble"),
        (data_at + 4, 0x80, "padding nibble"),
    ]:
        buf = bytearray(wire)
        buf[pos] = (buf[pos] & (0xF0 if byte < 0x10 else 0x0F)) | byte
        with pytest.raises(RemoteProtocolError, match=what):
            T.decode(bytes(buf))
    for value in (math.nan, math.inf, -math.inf, -1.0):
        buf = bytearray(wire)
        struct.pack_into("<f", buf, scales_at + 4, value)
        with pytest.raises(RemoteProtocolError, match="scale of block 1"):
            T.decode(bytes(buf))
    ok = bytearray(wire)
    struct.pack_into("<f", ok, scales_at, 0.0)  # a zero scale (an all-zero block) is fine
    assert not T.decode(bytes(ok))[:8].any()


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VALID), st.data())
def test_flipped_bytes_raise_only_protocol_errors(wire: bytes, data: st.DataObject) -> None:
    buf = bytearray(wire)
    for _ in range(data.draw(st.integers(1, 4))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(buf)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_random_data_bytes_decode_or_are_refused(blob: bytes) -> None:
    """Any data section of the right length: every value in [-7, 7] or a named refusal."""
    n = 2 * len(blob)
    head = T.encode(np.zeros(n, np.float32), "int4", block_size=8, compress="none").tobytes()
    wire = head[: len(head) - len(blob)] + blob
    try:
        out = T.decode(wire)
    except RemoteProtocolError as exc:
        assert "nibble 0x8" in str(exc)
        assert any(b & 0x0F == 8 or b >> 4 == 8 for b in blob)
        return
    assert out.shape == (n,) and not out.any()  # the scales are all 0
