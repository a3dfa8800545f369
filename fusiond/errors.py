"""fusiond's one error root, with local and remote errors apart."""

from __future__ import annotations


class FusionError(Exception):
    """Root of every error raised by `fusiond`."""


class LocalError(FusionError):
    """Something on this machine is wrong: configuration, input, state, a bug."""


class RemoteError(FusionError):
    """A peer misbehaved or failed: bad bytes, refused handshake, vanished mid-job."""


class ConfigError(LocalError):
    """A configuration value is invalid; the message names the key and where it came from."""


class SelfAddress(RemoteError):
    """An address we dialled is this node itself (its own bootstrap address, e.g. from its own
    join token): nothing to dial there, ever."""


def describe(e: BaseException) -> str:
    """An exception as text for a message: its own, or where it has none its kind ("timed
    out" for a timeout). `f"{e or type(e).__name__}"` never fell back (an exception is always
    true), so a dial that timed out under load read "cannot connect to host:port: "."""
    text = str(e)
    if text:
        return text
    return "timed out" if isinstance(e, TimeoutError) else type(e).__name__
