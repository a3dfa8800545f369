"""A small synchronous client of fusiond's local API (Unix socket, or loopback TCP + token).

Plain `http.client`: fusionctl makes one or two requests per run, so an event loop and an
HTTP library would only add start-up time.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

DEFAULT_SOCKET = "/run/fusion/fusiond.sock"


class ClientError(Exception):
    """Root of fusionctl's client errors."""


class Unreachable(ClientError):
    """No daemon answers at the configured address; the message says where we looked."""


class NoAnswer(Unreachable):
    """Something listens at the address but did not answer in time: a busy or stuck daemon,
    not a stopped one."""


class NotPermitted(Unreachable):
    """The daemon's socket refuses this user (its file permissions): the daemon may well run."""


class DownloadError(ClientError):
    """A download did not arrive whole (cut short, or its hash differs)."""


class ApiFailure(ClientError):
    """The daemon answered with an error; carries its status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self._path)
        except OSError:
            s.close()
            raise
        self.sock = s


@dataclass
class Endpoint:
    """Where the daemon's API is: a Unix socket path, or host:port with a bearer token."""

    socket_path: str | None = DEFAULT_SOCKET
    tcp: tuple[str, int] | None = None
    token: str | None = None

    def describe(self) -> str:
        if self.tcp is not None:
            return f"http://{self.tcp[0]}:{self.tcp[1]}"
        return f"unix:{self.socket_path}"


def endpoint_from(socket_path: str | None, tcp: str | None, token: str | None,
                  token_file: str | None) -> Endpoint:
    """Build an Endpoint from flags/environment: TCP wins when given, else the socket."""
    if tcp:
        host, _, port = tcp.rpartition(":")
        if not host or not port.isdigit():
            raise ClientError(f"--api {tcp!r} is not host:port")
        tok = token
        if tok is None and token_file:
            try:
                tok = Path(token_file).read_text().strip()
            except OSError as e:
                raise ClientError(f"cannot read the API token file {token_file}: {e}") from None
        return Endpoint(socket_path=None, tcp=(host.strip("[]"), int(port)), token=tok)
    return Endpoint(socket_path=socket_path or DEFAULT_SOCKET)


class Client:
    """Requests to one daemon; raises Unreachable or ApiFailure."""

    def __init__(self, endpoint: Endpoint, timeout: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout

    def _conn(self) -> http.client.HTTPConnection:
        ep = self.endpoint
        if ep.tcp is not None:
            return http.client.HTTPConnection(ep.tcp[0], ep.tcp[1], timeout=self.timeout)
        assert ep.socket_path is not None
        return _UnixConnection(ep.socket_path, self.timeout)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                raw: bytes | None = None) -> dict[str, Any]:
        """One request; `body` as JSON, or `raw` bytes (application/octet-stream)."""
        headers = {"Accept": "application/json"}
        data: bytes | None = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        elif raw is not None:
            data = raw
            headers["Content-Type"] = "application/octet-stream"
        if self.endpoint.token:
            headers["Authorization"] = f"Bearer {self.endpoint.token}"
        conn = self._conn()
        try:
            try:
                conn.request(method, path, body=data, headers=headers)
            except BrokenPipeError:
                # The daemon refused a large upload before reading it all: its answer says why.
                pass
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
                raise Unreachable(f"no fusiond answers at {self.endpoint.describe()} "
                                  f"({e.strerror or e})") from None
            except PermissionError:
                raise NotPermitted(f"permission denied on {self.endpoint.describe()}") from None
            except TimeoutError:
                raise NoAnswer(f"fusiond at {self.endpoint.describe()} did not accept the "
                               f"connection within {self.timeout:g} s") from None
            except OSError as e:
                raise Unreachable(f"cannot reach fusiond at {self.endpoint.describe()}: "
                                  f"{e}") from None
            resp = conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            raise NoAnswer(f"fusiond at {self.endpoint.describe()} did not answer within "
                           f"{self.timeout:g} s") from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else {}
        except ValueError:
            raise ApiFailure(resp.status, "bad_response",
                             f"the daemon answered with non-JSON (HTTP {resp.status})") from None
        if resp.status >= 400:
            err = payload.get("error", {}) if isinstance(payload, dict) else {}
            raise ApiFailure(resp.status, str(err.get("code", "error")),
                             str(err.get("message", f"HTTP {resp.status}")))
        if not isinstance(payload, dict):
            raise ApiFailure(resp.status, "bad_response", "the daemon answered a non-object")
        return payload

    def get(self, path: str) -> dict[str, Any]:
        return self.request("GET", path)

    def download(self, path: str, out: BinaryIO, progress: Callable[[int], None] | None = None,
                 chunk_bytes: int = 1 << 20) -> tuple[int, str]:
        """GET `path` and stream its body into `out`; (bytes, sha256). Checks the length and
        the daemon's `X-Fusion-SHA256` (DownloadError); ApiFailure for an error answer."""
        headers = {"Accept": "application/octet-stream"}
        if self.endpoint.token:
            headers["Authorization"] = f"Bearer {self.endpoint.token}"
        conn = self._conn()
        try:
            try:
                conn.request("GET", path, headers=headers)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
                raise Unreachable(f"no fusiond answers at {self.endpoint.describe()} "
                                  f"({e.strerror or e})") from None
            except PermissionError:
                raise NotPermitted(f"permission denied on {self.endpoint.describe()}") from None
            resp = conn.getresponse()
            if resp.status >= 400:
                raw = resp.read()
                try:
                    err = json.loads(raw).get("error", {})
                except (ValueError, AttributeError):
                    err = {}
                raise ApiFailure(resp.status, str(err.get("code", "error")),
                                 str(err.get("message", f"HTTP {resp.status}")))
            want = resp.getheader("X-Fusion-SHA256")
            length = resp.getheader("Content-Length")
            h = hashlib.sha256()
            n = 0
            while chunk := resp.read(chunk_bytes):
                out.write(chunk)
                h.update(chunk)
                n += len(chunk)
                if progress is not None:
                    progress(n)
        except TimeoutError:
            raise NoAnswer(f"fusiond at {self.endpoint.describe()} stopped sending within "
                           f"{self.timeout:g} s") from None
        finally:
            conn.close()
        if length is not None and length.isdigit() and int(length) != n:
            raise DownloadError(f"{path}: {n} of {length} bytes arrived")
        got = h.hexdigest()
        if want and want != got:
            raise DownloadError(f"{path}: sha256 {got} differs from the daemon's {want}")
        return n, got

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("POST", path, body or {})


def env_default(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return v if v else default
