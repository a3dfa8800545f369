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


_DECODE_CHUNK = 1 << 20
"""Stream bytes decoded per step: keeps the int64 temporaries at a few MiB, whatever `count`."""


def decode_varints(data: U8Array, count: int) -> U64Array:
    """Decode exactly `count` varints filling all of `data`.

    Raises `RemoteProtocolError` if the stream holds a different number of values, ends inside a
    value, or has a value longer than `MAX_VARINT_BYTES`. Allocates the result (8 bytes per
    value) plus temporaries bounded by `_DECODE_CHUNK`, never in proportion to a declared size.
    """
    total = int(data.size)
    if count == 0:
        if total:
            raise RemoteProtocolError(f"varint stream has {total} bytes but declares 0 values")
        return np.empty(0, dtype=np.uint64)
    if total < count:
        raise RemoteProtocolError(f"varint stream of {total} bytes cannot hold {count} values")
    if total == count:
        # Every value is one byte: all high bits must be clear.
        if int(data.max()) >= 0x80:
            raise RemoteProtocolError("varint stream ends inside a value")
        return data.astype(np.uint64)
    out = np.empty(count, dtype=np.uint64)
    produced = 0
    pos = 0
    while pos < total:
        piece = data[pos : pos + _DECODE_CHUNK]
        ends = np.flatnonzero(piece < 0x80)
        last_piece = pos + piece.size == total
        if last_piece and (ends.size == 0 or int(ends[-1]) != piece.size - 1):
            raise RemoteProtocolError("varint stream ends inside a value")
        if ends.size == 0:  # a whole chunk without a final byte: one value would be too long
            raise RemoteProtocolError(f"varint longer than {MAX_VARINT_BYTES} bytes")
        if produced + ends.size > count:
            raise RemoteProtocolError(
                f"varint stream holds more than the {count} values the descriptor says"
            )
        _decode_piece(piece, ends, out[produced : produced + ends.size])
        produced += ends.size
        pos += int(ends[-1]) + 1  # the next piece starts after this one's last complete value
    if produced != count:
        raise RemoteProtocolError(
            f"varint stream holds {produced} complete values, descriptor says {count}"
        )
    return out


def _decode_piece(piece: U8Array, ends: npt.NDArray[np.intp], out: U64Array) -> None:
    """Decode the values ending at `ends` (positions in `piece`) into `out`."""
    lengths = np.diff(ends, prepend=-1)
    if int(lengths.max()) > MAX_VARINT_BYTES:
        raise RemoteProtocolError(f"varint longer than {MAX_VARINT_BYTES} bytes")
    starts = ends - lengths
    starts += 1
    # One gather per byte position, like the encoder: position 0 for every value, then only the
    # (few) values that are longer.
    np.bitwise_and(piece[starts], np.uint8(0x7F), out=out, casting="unsafe")
    for j in range(1, int(lengths.max())):
        sel = np.flatnonzero(lengths > j)
        group = (piece[starts[sel] + j] & np.uint8(0x7F)).astype(np.uint64)
        out[sel] |= group << np.uint64(7 * j)
