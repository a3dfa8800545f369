"""The protocol's one error root, with local and remote errors apart.

- `LocalProtocolError`: *we* were asked to build something invalid (a bug or bad input on our
  side: a tensor too large, a field of the wrong type).
- `RemoteProtocolError`: the *peer* sent bytes that are not a valid frame or message. The
  connection that carried them should be closed; the daemon keeps serving others.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of every error raised by `protocol`."""


class LocalProtocolError(ProtocolError):
    """We tried to encode something invalid; the message says what and why."""


class RemoteProtocolError(ProtocolError):
    """The peer sent invalid bytes; the message says which field or limit was violated."""


class LimitExceeded(RemoteProtocolError):
    """A declared length, size, rank or element count exceeds a configured limit."""
