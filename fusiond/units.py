"""The one place where link rates change unit: bits per second <-> bytes per second.

Links are measured, gossiped and shown in bits per second (``_bits_per_s``: what tc, iperf and
every network person speak); the planner and every timeout compute in bytes per second
(``_bytes_per_s``: tensors are sized in bytes). A quantity crosses from one to the other only
through these two functions, so a grep for them finds every conversion (a bits-for-bytes
mix-up once made every plan see links 8x too fast).
"""

from __future__ import annotations

BITS_PER_BYTE = 8


def bytes_per_s_from_bits_per_s(bits_per_s: float) -> float:
    """A rate in bits per second as bytes per second."""
    return float(bits_per_s) / BITS_PER_BYTE


def bits_per_s_from_bytes_per_s(bytes_per_s: float) -> float:
    """A rate in bytes per second as bits per second."""
    return float(bytes_per_s) * BITS_PER_BYTE


__all__ = ["BITS_PER_BYTE", "bits_per_s_from_bytes_per_s", "bytes_per_s_from_bits_per_s"]
