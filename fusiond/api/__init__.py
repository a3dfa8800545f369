"""The daemon's local HTTP API (aiohttp): the only way fusionctl talks to fusiond.

It listens on a Unix socket (file permissions are the access control) and/or a loopback TCP
address that requires ``Authorization: Bearer <token>`` (the token is in a 0600 file). Every
response is JSON; an error is ``{"error": {"code": str, "message": str}}`` with an HTTP status.
"""

from fusiond.api.server import ApiError, ApiServer, Backend, to_jsonable

__all__ = ["ApiError", "ApiServer", "Backend", "to_jsonable"]
