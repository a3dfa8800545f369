"""fusion's wire format, sans-IO: bytes in, typed events out, and back.

Never imports asyncio, aiohttp, socket or torch (tests/protocol/test_sans_io.py enforces it).
"""

from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

PROTOCOL_VERSION = 1
"""Highest protocol version this implementation speaks."""
MIN_PROTOCOL_VERSION = 1
"""Lowest protocol version this implementation still accepts."""

__all__ = [
    "MIN_PROTOCOL_VERSION",
    "PROTOCOL_VERSION",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
]
