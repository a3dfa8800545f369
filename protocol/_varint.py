"""Vectorised unsigned LEB128 varints over numpy arrays (private to protocol.tensors).

Each value is written as 7-bit groups, least significant first; the high bit of a byte is set
when another byte of the same value follows. Values here are below 2**63, so at most 9 bytes.
Both directions make at most one numpy pass per byte position, never a Python loop per value.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from protocol.errors import RemoteProtocolError

MAX_VARINT_BYTES = 9
"""Longest varint accepted: 9 groups of 7 bits cover every value below 2**63."""

U64Array = npt.NDArray[np.uint64]
U8Array = npt.NDArray[np.uint8]


def varint_lengths(values: U64Array) -> U8Array:
    """Bytes each value of `values` takes as a varint (1..9)."""
    lengths = np.ones(values.shape, dtype=np.uint8)
    if values.size == 0:
        return lengths
    top = int(values.max())
    shift = 7
    # One comparison pass per extra byte that the largest value needs (1 pass at 1 % density).
    while top >> shift:
        lengths += values >= np.uint64(1 << shift)
        shift += 7
    return lengths


def encode_varints(values: U64Array, lengths: U8Array | None = None) -> U8Array:
    """Concatenated varints of `values` (uint64, each < 2**63); `lengths` if already computed."""
    if lengths is None:
        lengths = varint_lengths(values)
    if values.size == 0:
        return np.empty(0, dtype=np.uint8)
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1])
    starts = ends - lengths
    out = np.empty(total, dtype=np.uint8)
    max_len = int(lengths.max())
    # Byte position 0 of every value, without masking (the common case is all one-byte values).
    low = (values & np.uint64(0x7F)).astype(np.uint8)
    if max_len > 1:
        low |= (lengths > 1).astype(np.uint8) << np.uint8(7)
    out[starts] = low
    for j in range(1, max_len):
        sel = lengths > j
        group = ((values[sel] >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        group |= (lengths[sel] > j + 1).astype(np.uint8) << np.uint8(7)
        out[starts[sel] + j] = group
    return out


def decode_varints(data: U8Array, count: int) -> U64Array:
    """Decode exactly `count` varints filling all of `data`.

    Raises `RemoteProtocolError` if the stream holds a different number of values, ends inside a
    value, or has a value longer than `MAX_VARINT_BYTES`.
    """
    total = int(data.size)
    if count == 0:
        if total:
            raise RemoteProtocolError(f"varint stream has {total} bytes but declares 0 values")
        return np.empty(0, dtype=np.uint64)
    if total == count:
        # Every value is one byte: all high bits must be clear.
        if int(data.max()) >= 0x80:
            raise RemoteProtocolError("varint stream ends inside a value")
        return data.astype(np.uint64)
    if total < count:
        raise RemoteProtocolError(f"varint stream of {total} bytes cannot hold {count} values")
    ends = np.flatnonzero(data < 0x80)
    if ends.size != count:
        raise RemoteProtocolError(
            f"varint stream holds {ends.size} complete values, descriptor says {count}"
        )
    if int(ends[-1]) != total - 1:
        raise RemoteProtocolError("varint stream ends inside a value")
    lengths = np.diff(ends, prepend=-1)
    starts = ends - lengths
    starts += 1
    if int(lengths.max()) > MAX_VARINT_BYTES:
        raise RemoteProtocolError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    # One gather per byte position, like the encoder: position 0 for every value, then only the
    # (few) values that are longer.
    decoded: U64Array = (data[starts] & np.uint8(0x7F)).astype(np.uint64)
    for j in range(1, int(lengths.max())):
        sel = np.flatnonzero(lengths > j)
        group = (data[starts[sel] + j] & np.uint8(0x7F)).astype(np.uint64)
        decoded[sel] |= group << np.uint64(7 * j)
    return decoded
