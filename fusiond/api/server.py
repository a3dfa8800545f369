"""aiohttp server of the local API; the daemon supplies a `Backend` that does the work.

Routes (all JSON):

=======  ====================  ======================================================
GET      /v1/status            this node, the cluster view, quorum, security mode
GET      /v1/links             the RTT / bandwidth matrix as every member gossiped it
GET      /v1/paths             state, cache, socket, config file locations
GET      /v1/version           fusiond, protocol and torch versions
POST     /v1/init              create a cluster here (CA, node cert, a join token)
POST     /v1/join              {"token": ...} or {"address": "host:port"}
POST     /v1/token             {"ttl_s": float, "one_time": bool}: a new join token
POST     /v1/leave             leave the cluster for good (stops counting toward quorum)
POST     /v1/remove            {"node_id": ...}: an operator removes a member
POST     /v1/test/block        {"node_ids": [...]}: TEST ONLY, 404 unless enabled in config
POST     /v1/jobs              a job upload (binary, `fusiond.jobs.upload`; spooled to a file
                               as it streams in, at most `api.max_upload_bytes`); ``?dry_run=1``
                               plans only
GET      /v1/jobs              jobs submitted here (the caller's own, unless operator), stages
                               hosted here
GET      /v1/jobs/{id}         one job: state, plan, live per-stage / per-link figures, history
                               (``?history=N`` last steps)
GET      /v1/jobs/{id}/logs    the job's log lines
POST     /v1/jobs/{id}/cancel  stop every partition of the job
GET      /v1/jobs/{id}/outputs the job's stored outputs (name, size, sha256), what is not
POST     /v1/jobs/{id}/fetch   store again what could not be stored, then the same
GET      /v1/jobs/{id}/outputs/{name}  one output file, streamed (``X-Fusion-SHA256``)
POST     /v1/dashboard     a dashboard session for the caller: the URL that opens it
GET      /healthz              200 "ok" while the daemon serves (no JSON; no token on TCP)
=======  ====================  ======================================================

Who may ask what: on the Unix socket the kernel tells the API the caller's uid and gid
(``SO_PEERCRED``), so a job records its owner, and `GET /v1/jobs/{id}` (and its logs,
outputs, fetch, cancel) is answered only for that user and for the daemon's operator: root,
the daemon's own uid, or a TCP client holding the API token. Anyone else gets 403 naming the
job and its owner. Every number in a request is checked (finite, integer where an integer is
meant, in range) and a bad one is a 400 naming the field; an upload larger than
`api.max_upload_bytes` is a 413 before any of it is read (Content-Length) or as soon as it
passes the limit (chunked), and its spool file is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hmac
import json
import logging
import math
import os
import secrets
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from fusiond.durable import write_bytes
from fusiond.errors import FusionError, LocalError, RemoteError
from fusiond.tasks import cancel_and_wait

log = logging.getLogger("fusiond.api")

MAX_BODY_BYTES = 64 * 1024
"""Requests are small JSON objects; anything larger is refused before it is read."""
SPOOL_CHUNK_BYTES = 1 << 20
"""An upload is written to its spool file in pieces of this size."""
TRIM_AFTER_BYTES = 32 << 20
"""After a request body this large, give the freed heap back to the OS (`malloc_trim`)."""
TRIM_DELAY_S = 0.05
"""... this long after its answer (by then the request's objects are gone)."""
MAX_HISTORY = 100_000
"""`?history=N` at most (a job keeps up to `fusiond.jobs.history.MAX_STEPS` steps)."""


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who sent a request. On the Unix socket: the peer's credentials (SO_PEERCRED). Over
    TCP: the holder of the API token, the daemon's operator (uid and gid unknown)."""

    via: str
    uid: int | None = None
    gid: int | None = None
    pid: int | None = None

    @property
    def operator(self) -> bool:
        """Root, the daemon's own user, or the token holder: may act on every job."""
        return self.via == "tcp" or self.uid == 0 or self.uid == os.geteuid()

    def describe(self) -> str:
        return "the API token holder (TCP)" if self.uid is None else user_name(self.uid)


CALLER = web.RequestKey("caller", Caller)
"""Where the middleware leaves the request's `Caller`."""


def user_name(uid: int | None) -> str:
    """'uid 1001 (alice)', or the daemon's operator when `uid` is None."""
    if uid is None:
        return "the daemon's operator"
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def peer_caller(sock: Any) -> Caller:
    """The credentials of the process at the other end of a Unix socket."""
    size = struct.calcsize("3i")
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        size))
    return Caller("unix", uid, gid, pid)


def body_number(body: Mapping[str, Any], key: str, default: float, *, lo: float, hi: float,
                integer: bool = False, lo_open: bool = False, unit: str = "") -> float:
    """`body[key]` as a finite number in [lo, hi] ((lo, hi] with `lo_open`; an integer with
    `integer`), or `default` when absent. ApiError 400 naming the field otherwise: strings,
    booleans, NaN, infinities, 1e300 and out-of-range values are all refused."""
    v = body.get(key, default)
    kind = "an integer" if integer else "a number"
    rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" + (f" {unit}" if unit else "")
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) \
        and (v > lo if lo_open else v >= lo) and v <= hi \
        and (not integer or isinstance(v, int) or float(v).is_integer())
    if not ok:
        raise ApiError(400, "bad_request", f"{key} must be {kind} in {rng}, got {v!r}")
    return int(v) if integer else float(v)


def body_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise ApiError(400, "bad_request", f"{key} must be true or false, got {v!r}")
    return v


def malloc_trim() -> bool:
    """Return the free heap to the OS (glibc): a big request's buffers are freed into the
    heap, and `fusiond.net.tune_allocator` raises glibc's trim threshold to 512 MiB so the
    transport can reuse frame buffers; that would keep them resident. False without glibc."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


class ApiError(FusionError):
    """An error the API returns as JSON with `status` and a machine-readable `code`."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Backend(Protocol):
    """What the daemon provides to the API. Methods raise ApiError or FusionError; those
    about jobs get the `Caller` and check it (403 for another user's job)."""

    def status(self) -> dict[str, Any]: ...
    def links(self) -> dict[str, Any]: ...
    def paths(self) -> dict[str, Any]: ...
    def version(self) -> dict[str, Any]: ...
    async def init(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    async def join(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    async def token(self, body: Mapping[str, Any]) -> dict[str, Any]: ...
    async def leave(self) -> dict[str, Any]: ...
    async def remove(self, node_id: str) -> dict[str, Any]: ...
    async def test_block(self, node_ids: list[str]) -> dict[str, Any]: ...
    def upload_dir(self) -> Path: ...
    async def submit_job(self, spool: Path, dry_run: bool, caller: Caller
                         ) -> dict[str, Any]: ...
    def list_jobs(self, caller: Caller) -> dict[str, Any]: ...
    def job(self, job_id: str, history: int, caller: Caller) -> dict[str, Any]: ...
    def job_logs(self, job_id: str, caller: Caller) -> dict[str, Any]: ...
    async def cancel_job(self, job_id: str, caller: Caller) -> dict[str, Any]: ...
    async def job_outputs(self, job_id: str, caller: Caller, fetch: bool
                          ) -> dict[str, Any]: ...
    def job_output_file(self, job_id: str, name: str, caller: Caller) -> tuple[Path, str]: ...
    def dashboard_session(self, caller: Caller) -> dict[str, Any]: ...
    async def cluster_jobs(self, caller: Caller) -> dict[str, Any]: ...
    async def remote_job(self, job_id: str, history: int, caller: Caller, *,
                         cancel: bool = False) -> dict[str, Any]: ...


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, enums, tuples, sets and paths -> plain JSON values (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, bytes):
        return obj.hex()
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    return str(obj)


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(to_jsonable(data)), status=status,
                        content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": {"code": code, "message": message}}, status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiServer:
    """Serves the API for one backend on a Unix socket and/or loopback TCP (a service).

    `socket_path` is created 0660 in a 0755 directory made if missing; a stale socket left by
    a crashed daemon is replaced, a live one (another daemon answering) is an error.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        socket_path: str | None,
        tcp: tuple[str, int] | None = None,
        token_path: Path | None = None,
        test_endpoints: bool = False,
        max_upload_bytes: int = 4 << 30,
    ) -> None:
        self.backend = backend
        self.socket_path = socket_path or None
        self.tcp = tcp
        self.token_path = token_path
        self.test_endpoints = test_endpoints
        self.max_upload_bytes = max_upload_bytes
        self.tcp_address: tuple[str, int] | None = None
        self._token: str | None = None
        self._runner: web.AppRunner | None = None
        self._trims: set[asyncio.Task[None]] = set()
        self._socket_ino: int | None = None
        """Inode of the socket we bound: close() removes that file and never another
        daemon's (a second daemon that failed to start must not unlink the first's socket)."""

    # -- service ---------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(_clear_spools, self.backend.upload_dir())
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_get("/v1/status", self._get(self.backend.status))
        r.add_get("/v1/links", self._get(self.backend.links))
        r.add_get("/v1/paths", self._get(self.backend.paths))
        r.add_get("/v1/version", self._get(self.backend.version))
        r.add_post("/v1/init", self._post(lambda b: self.backend.init(b)))
        r.add_post("/v1/join", self._post(lambda b: self.backend.join(b)))
        r.add_post("/v1/token", self._post(lambda b: self.backend.token(b)))
        r.add_post("/v1/leave", self._post(lambda b: self.backend.leave()))
        r.add_post("/v1/remove", self._post(self._remove))
        r.add_post("/v1/jobs", self._upload)
        r.add_get("/v1/jobs", self._list_jobs)
        r.add_get("/v1/jobs/{job_id}", self._job)
        r.add_get("/v1/jobs/{job_id}/logs", self._job_logs)
        r.add_post("/v1/jobs/{job_id}/cancel", self._job_cancel)
        r.add_get("/v1/jobs/{job_id}/outputs", self._job_outputs)
        r.add_post("/v1/jobs/{job_id}/fetch", self._job_fetch)
        r.add_get("/v1/jobs/{job_id}/outputs/{name}", self._job_output_file)
        r.add_post("/v1/dashboard", self._dashboard)
        r.add_get("/healthz", self._healthz)
        if self.test_endpoints:
            r.add_post("/v1/test/block", self._post(self._block))
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        try:
            if self.socket_path:
                self._prepare_socket_path(self.socket_path)
                site: web.BaseSite = web.UnixSite(runner, self.socket_path)
                await site.start()
                os.chmod(self.socket_path, 0o660)
                self._socket_ino = os.stat(self.socket_path).st_ino
                log.info("local API on unix:%s", self.socket_path)
            if self.tcp is not None:
                self._token = self._load_or_make_token()
                tsite = web.TCPSite(runner, self.tcp[0], self.tcp[1])
                await tsite.start()
                server = getattr(tsite, "_server", None)
                socks = getattr(server, "sockets", None) or []
                self.tcp_address = socks[0].getsockname()[:2] if socks else self.tcp
                log.info("local API on http://%s:%d (token in %s)", *self.tcp_address,
                         self.token_path)
        except BaseException:
            await self.close()
            raise

    async def ready(self) -> None:
        """Ready once start() returned: the sockets are bound and serving."""

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await cancel_and_wait(list(self._trims), what="heap trim")
        ino, self._socket_ino = self._socket_ino, None
        if self.socket_path and ino is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.socket_path).st_ino == ino:
                    os.unlink(self.socket_path)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _prepare_socket_path(path: str) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() and not p.is_socket():
            raise LocalError(f"api.socket {path} exists and is not a socket; refusing to "
                             "replace it (choose another path)")
        if p.is_socket():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(p))
            except OSError:
                p.unlink()  # stale socket of a daemon that died: safe to replace
            else:
                raise LocalError(f"another fusiond is already serving {path}; stop it first "
                                 f"or set api.socket to another path")
            finally:
                probe.close()

    def _load_or_make_token(self) -> str:
        assert self.token_path is not None
        try:
            tok = self.token_path.read_text().strip()
            if tok:
                return tok
        except FileNotFoundError:
            pass
        tok = secrets.token_urlsafe(32)
        self.token_path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes(self.token_path, (tok + "\n").encode(), 0o600)
        return tok

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        is_unix = sock is not None and sock.family == socket.AF_UNIX
        if request.path == "/healthz" and request.method == "GET":
            return await handler(request)  # liveness says nothing about anyone: no token
        if not is_unix:
            expect = f"Bearer {self._token}" if self._token else None
            got = request.headers.get("Authorization", "")
            if expect is None or not hmac.compare_digest(got.encode(), expect.encode()):
                return _error(401, "unauthorized",
                              "missing or wrong API token (Authorization: Bearer <token from "
                              f"{self.token_path}>)")
            request[CALLER] = Caller("tcp")
        else:
            try:
                request[CALLER] = peer_caller(sock)
            except OSError as e:  # no credentials: nobody in particular, never an operator
                log.warning("API: no peer credentials on the socket: %s", e)
                request[CALLER] = Caller("unix", uid=-1)
        try:
            return await handler(request)
        except ApiError as e:
            return _error(e.status, e.code, e.message)
        except web.HTTPException as e:
            return _error(e.status, "http", e.reason)
        except RemoteError as e:
            return _error(502, "remote", str(e))
        except FusionError as e:
            return _error(400, "refused", str(e))
        except Exception as e:  # a bug: answer, log with traceback, keep serving
            log.exception("API %s %s failed", request.method, request.path)
            return _error(500, "internal", f"{type(e).__name__}: {e}")

    def _get(self, fn: Callable[[], dict[str, Any]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return _json(fn())

        return handler

    def _post(self, fn: Callable[[Mapping[str, Any]], Awaitable[dict[str, Any]]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            body: Any = {}
            if request.can_read_body:
                try:
                    body = await request.json()
                except ValueError:
                    raise ApiError(400, "bad_request", "request body is not JSON") from None
            if not isinstance(body, dict):
                raise ApiError(400, "bad_request", "request body must be a JSON object")
            return _json(await fn(body))

        return handler

    async def _remove(self, body: Mapping[str, Any]) -> dict[str, Any]:
        node_id = body.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise ApiError(400, "bad_request", "remove needs {\"node_id\": \"...\"}")
        return await self.backend.remove(node_id)

    async def _block(self, body: Mapping[str, Any]) -> dict[str, Any]:
        ids = body.get("node_ids")
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, "bad_request", "test/block needs {\"node_ids\": [..]}")
        return await self.backend.test_block(list(ids))

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        """A job upload, spooled to a file in the daemon's state dir as it streams in (never
        held in memory whole), refused before reading when its Content-Length is over the
        limit and as soon as it passes it otherwise; the spool file is always removed."""
        limit = self.max_upload_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise ApiError(413, "too_large", f"job upload of {declared} bytes exceeds "
                           f"api.max_upload_bytes={limit} of this daemon")
        dry = request.query.get("dry_run", "") in ("1", "true", "yes")
        spool_dir = self.backend.upload_dir()
        await asyncio.to_thread(spool_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
        spool = spool_dir / f"upload-{secrets.token_hex(8)}"
        size = 0
        try:
            fd = await asyncio.to_thread(os.open, spool, os.O_WRONLY | os.O_CREAT | os.O_EXCL
                                         | os.O_CLOEXEC, 0o600)
            try:
                async for chunk in request.content.iter_chunked(SPOOL_CHUNK_BYTES):
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(413, "too_large", "job upload exceeds "
                                       f"api.max_upload_bytes={limit} of this daemon")
                    await asyncio.to_thread(_write_all, fd, chunk)
                    del chunk
            finally:
                os.close(fd)
            return _json(await self.backend.submit_job(spool, dry, request[CALLER]))
        except OSError as e:
            raise ApiError(507, "no_space" if e.errno == 28 else "spool_failed",
                           f"the daemon could not spool the upload to {spool_dir}: "
                           f"{e.strerror or e}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(spool)
            if size >= TRIM_AFTER_BYTES:
                self._trim_soon()

    def _trim_soon(self) -> None:
        """Give the heap back once this request is over: an error's traceback still holds
        the upload's buffers while the handler unwinds, so trim from a task that runs after
        the answer went out."""
        async def trim() -> None:
            await asyncio.sleep(TRIM_DELAY_S)
            await asyncio.to_thread(malloc_trim)

        t = asyncio.get_running_loop().create_task(trim(), name="api malloc_trim")
        self._trims.add(t)
        t.add_done_callback(self._trims.discard)

    @staticmethod
    def _caller(request: web.Request) -> Caller:
        return request[CALLER]

    async def _list_jobs(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("cluster", "") in ("1", "true", "yes"):
            return _json(await self.backend.cluster_jobs(self._caller(request)))
        return _json(self.backend.list_jobs(self._caller(request)))

    async def _job(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("history", "20")
        if not raw.isdigit() or int(raw) > MAX_HISTORY:
            raise ApiError(400, "bad_request", f"history must be an integer in [0, "
                           f"{MAX_HISTORY}], got {raw!r}")
        job_id, caller = request.match_info["job_id"], self._caller(request)
        try:
            return _json(self.backend.job(job_id, int(raw), caller))
        except ApiError as e:  # submitted elsewhere: the scheduler coordinates it
            if e.code != "unknown_job":
                raise
        return _json(await self.backend.remote_job(job_id, int(raw), caller))

    async def _job_logs(self, request: web.Request) -> web.StreamResponse:
        job_id, caller = request.match_info["job_id"], self._caller(request)
        try:
            return _json(self.backend.job_logs(job_id, caller))
        except ApiError as e:
            if e.code != "unknown_job":
                raise
        got = await self.backend.remote_job(job_id, 0, caller)
        return _json({"job_id": job_id, "lines": got.get("lines") or [],
                      "via_scheduler": got.get("via_scheduler")})

    async def _job_cancel(self, request: web.Request) -> web.StreamResponse:
        job_id, caller = request.match_info["job_id"], self._caller(request)
        try:
            return _json(await self.backend.cancel_job(job_id, caller))
        except ApiError as e:
            if e.code != "unknown_job":
                raise
        got = await self.backend.remote_job(job_id, 0, caller, cancel=True)
        return _json({"job_id": job_id, "state": got.get("state"),
                      "cancelled": got.get("state") == "cancelled",
                      "via_scheduler": got.get("via_scheduler")})

    async def _job_outputs(self, request: web.Request) -> web.StreamResponse:
        return _json(await self.backend.job_outputs(request.match_info["job_id"],
                                                    self._caller(request), False))

    async def _job_fetch(self, request: web.Request) -> web.StreamResponse:
        return _json(await self.backend.job_outputs(request.match_info["job_id"],
                                                    self._caller(request), True))

    async def _dashboard(self, request: web.Request) -> web.StreamResponse:
        return _json(self.backend.dashboard_session(self._caller(request)))

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def _job_output_file(self, request: web.Request) -> web.StreamResponse:
        path, sha = self.backend.job_output_file(request.match_info["job_id"],
                                                 request.match_info["name"],
                                                 self._caller(request))
        return web.FileResponse(path, chunk_size=SPOOL_CHUNK_BYTES,
                                headers={"X-Fusion-SHA256": sha,
                                         "Content-Type": "application/octet-stream"})


def _clear_spools(root: Path) -> None:
    """At start: remove the uploads a stopped daemon left half-spooled."""
    if not root.is_dir():
        return
    for p in root.glob("upload-*"):
        with contextlib.suppress(OSError):
            p.unlink()
            log.info("removed a half-spooled upload left by a stopped daemon: %s", p)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
