"""Limits on everything a peer can declare, checked before allocating or decompressing."""

from __future__ import annotations

import dataclasses
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
    max_control_frame_bytes: int = 1 << 20
    """One frame of a CONTROL-lane message (fixed header + message header + payload). Control
    messages never carry bulk bytes: a heartbeat waits behind at most one such frame on its
    lane (1 MiB is about 1 s at 8 Mbit/s, well inside the failure detector's suspicion time).
    A sender refuses to encode a larger CONTROL message (LocalProtocolError: a bug), a
    receiver refuses one on a CONTROL connection (LimitExceeded)."""
    max_preauth_frame_bytes: int = 64 << 10
    """Every frame read before the peer is authenticated: the first frame of an accepted
    connection (Hello, or JoinRequest without a client certificate), and the HelloAck, Refuse
    or JoinResponse a dialer reads. Nothing larger is allocated for an unknown peer."""

    def check(self, what: str, value: int, limit: int) -> None:
        """Raise `LimitExceeded` if `value` is negative or larger than `limit`."""
        if value < 0 or value > limit:
            raise LimitExceeded(f"{what} is {value}, limit is {limit}")

    def for_control(self) -> Limits:
        """These limits with frames bounded as on a CONTROL connection."""
        return self._frames_within(self.max_control_frame_bytes)

    def for_preauth(self) -> Limits:
        """These limits with frames bounded as before the peer is authenticated."""
        return self._frames_within(self.max_preauth_frame_bytes)

    def _frames_within(self, frame_bytes: int) -> Limits:
        frame = min(self.max_frame_bytes, frame_bytes)
        return dataclasses.replace(
            self, max_frame_bytes=frame, max_header_bytes=min(self.max_header_bytes, frame)
        )


DEFAULT_LIMITS = Limits()
