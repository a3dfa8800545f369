"""Limits on everything a peer can declare, checked before allocating or decompressing."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.errors import LimitExceeded


@dataclass(frozen=True, slots=True)
class Limits:
    """Upper bounds applied to every frame, message and tensor decoded from the wire.

    Each `check_*` raises `LimitExceeded` naming the quantity, the declared value and the limit.
    """

    max_frame_bytes: int = 1 << 30
    """Header plus payload of one frame."""
    max_header_bytes: int = 16 << 20
    """The msgpack message header of one frame (Assign carries a partition's IR)."""
    max_decompressed_bytes: int = 1 << 31
    """Any one lz4-compressed section after decompression."""
    max_tensor_rank: int = 8
    max_tensor_elements: int = 1 << 31
    max_string_bytes: int = 1 << 20
    max_list_items: int = 1 << 20

    def check(self, what: str, value: int, limit: int) -> None:
        """Raise `LimitExceeded` if `value` is negative or larger than `limit`."""
        if value < 0 or value > limit:
            raise LimitExceeded(f"{what} is {value}, limit is {limit}")


DEFAULT_LIMITS = Limits()
