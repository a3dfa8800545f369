"""The browser dashboard: each daemon serves it on a loopback address (`dashboard.listen`).

What it shows (docs/dashboard.md): the cluster (members with their names, state, role, the
scheduler and its term, quorum), the link matrix as a heat map with each measurement's age,
and the jobs its viewer may see (the plan's stages, replicas and cut edges with their codecs
and densities, per-stage busy and waiting shares, the loss curve, tokens/s, predicted against
measured iteration time, restarts, the checkpoint's age), kept live by server-sent events.

Who may see what. A TCP port on loopback is open to every local user, so the page itself holds
nothing and every data request needs a **session token**: `fusionctl dashboard` asks the
daemon for one over the API (`POST /v1/dashboard`), where the daemon knows the caller (the
Unix socket's peer credentials, or the API token's holder), and the session sees exactly what
that caller sees through the API: their own jobs (the operator: all), the cluster. The token
travels in the URL's fragment (`#token=...`, never sent to a server nor in a Referer), the
page keeps it in `sessionStorage` (scoped to this origin, port included) and sends it as
`Authorization: Bearer`. No cookie: browsers send a host's cookies to every port of it, so
another local user's server on 127.0.0.1 could collect one. The dashboard is read-only (GET
only): nothing a page does through it changes the cluster. Requests whose `Host` is not a
loopback name are refused (DNS rebinding). Sessions live in the daemon's memory for
`dashboard.session_ttl_s`; a restart ends them.

Routes: ``GET /`` the page, ``GET /static/{name}`` its script and style (vendored in this
package: nothing is fetched from anywhere else), ``GET /api/snapshot`` one snapshot,
``GET /api/events`` the live stream (``text/event-stream``: a ``snapshot`` event every
`interval_s`; each job's loss points are sent once, then only new ones), ``GET /healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from fusiond.api.server import ApiError, Caller, to_jsonable
from fusiond.config import is_loopback

log = logging.getLogger("fusiond.api.dashboard")

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
"""The page's own files, and nothing else, are served from `STATIC_DIR`."""
MAX_SESSIONS = 256
"""Sessions kept at once; the oldest goes first."""
MAX_STREAMS = 32
"""Live streams served at once (each holds a connection)."""
MAX_JOBS = 20
"""Jobs in a snapshot: the running ones, then the newest ended ones."""
MAX_POINTS = 5000
"""Loss points of one job sent to a page (the newest)."""
DEFAULT_INTERVAL_S = 1.0


class DashboardBackend(Protocol):
    """What the dashboard reads: the same calls that answer the API, with the same caller."""

    def status(self) -> dict[str, Any]: ...
    def links(self) -> dict[str, Any]: ...
    def list_jobs(self, caller: Caller) -> dict[str, Any]: ...
    def job(self, job_id: str, history: int, caller: Caller) -> dict[str, Any]: ...
    async def cluster_jobs(self, caller: Caller) -> dict[str, Any]: ...
    async def remote_job(self, job_id: str, history: int, caller: Caller, *,
                         cancel: bool = False) -> dict[str, Any]: ...


# -- sessions ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Session:
    caller: Caller
    expires_at: float
    """On the monotonic clock."""


class Sessions:
    """Dashboard sessions by the SHA-256 of their token (so a lookup leaks nothing of a
    token's bytes through timing), each bound to the API caller that asked for it."""

    def __init__(self, ttl_s: float, *, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_digest: OrderedDict[bytes, Session] = OrderedDict()

    @staticmethod
    def _digest(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "replace")).digest()

    def mint(self, caller: Caller) -> str:
        """A new token for `caller`, valid `ttl_s`."""
        self._prune()
        token = secrets.token_urlsafe(32)
        self._by_digest[self._digest(token)] = Session(caller, self._clock() + self.ttl_s)
        while len(self._by_digest) > self.max_sessions:
            self._by_digest.popitem(last=False)
        return token

    def get(self, token: str) -> Session | None:
        """The live session of `token`, or None (unknown or expired)."""
        if not token or len(token) > 256:
            return None
        s = self._by_digest.get(self._digest(token))
        if s is None or s.expires_at <= self._clock():
            return None
        return s

    def alive(self, s: Session) -> bool:
        """Whether session `s` has not expired."""
        return s.expires_at > self._clock()

    def _prune(self) -> None:
        now = self._clock()
        for d in [d for d, s in self._by_digest.items() if s.expires_at <= now]:
            del self._by_digest[d]

    def __len__(self) -> int:
        return len(self._by_digest)


# -- the snapshot (pure functions of the API's answers) --------------------------------------


def member_name(member: Mapping[str, Any], node: Mapping[str, Any]) -> str:
    """A member's gossiped name (its profile's `name` label), this node's own, or ''."""
    prof = member.get("profile") or {}
    labels = prof.get("labels") or {} if isinstance(prof, Mapping) else {}
    name = labels.get("name") if isinstance(labels, Mapping) else None
    if isinstance(name, str) and name:
        return name
    if member.get("node_id") == node.get("node_id"):
        return str(node.get("name") or "")
    return ""


def cluster_block(status: Mapping[str, Any]) -> dict[str, Any]:
    """This node, and the cluster as it sees it: members (name, state, role, address, the
    link to it from here), the scheduler and its term, quorum."""
    node = dict(status.get("node") or {})
    out: dict[str, Any] = {
        "node": {k: node.get(k) for k in ("node_id", "name", "cluster_id", "address",
                                          "security", "phase", "uptime_s")},
        "hint": status.get("hint"), "warning": status.get("warning"),
        "members": [], "leader": None, "term": None, "has_quorum": None,
        "voters": None, "alive_voters": None, "needed": None,
    }
    view = status.get("cluster")
    if not isinstance(view, Mapping):
        return out
    for k in ("leader", "term", "has_quorum", "voters", "alive_voters", "needed"):
        out[k] = view.get(k)
    for m in view.get("members") or []:
        prof = m.get("profile") or {}
        addr = m.get("address")
        out["members"].append({
            "node_id": m.get("node_id"), "name": member_name(m, node),
            "state": str(m.get("state")), "role": str(m.get("role")),
            "address": f"{addr[0]}:{addr[1]}" if isinstance(addr, list | tuple)
            and len(addr) == 2 else addr,
            "self": m.get("node_id") == node.get("node_id"),
            "rtt_s": m.get("rtt_s"), "bandwidth_bits_per_s": m.get("bandwidth_bits_per_s"),
            "device": f"{prof.get('device_kind', '')} {prof.get('device_name', '')}".strip(),
            "gflops": prof.get("gflops"), "cpu_cores": prof.get("cpu_cores"),
            "fusiond": prof.get("fusiond_version"), "torch": prof.get("torch_version"),
        })
    return out


def links_block(links: Mapping[str, Any], members: list[dict[str, Any]], *,
                stale_after_s: float) -> dict[str, Any]:
    """The measured matrix (row: the measurer, column: the peer), each cell with its age and
    `stale`: a figure from or to a member that is not alive, or older than
    `stale_after_s`, is no longer what the link does."""
    state = {m["node_id"]: m["state"] for m in members}
    ids = [m["node_id"] for m in members]
    cells: dict[str, dict[str, Any]] = {}
    for src, row in (links.get("links") or {}).items():
        for dst, lk in (row or {}).items():
            age = lk.get("age_s")
            stale = (state.get(src) != "alive" or state.get(dst) != "alive"
                     or (isinstance(age, int | float) and age > stale_after_s))
            cells.setdefault(src, {})[dst] = {
                "bandwidth_bits_per_s": lk.get("bandwidth_bits_per_s"),
                "rtt_s": lk.get("rtt_s"), "age_s": age,
                "spread": lk.get("bandwidth_spread_ratio"), "stale": stale,
            }
    return {"ids": ids, "cells": cells, "stale_after_s": stale_after_s}


POINT_KEYS = ("step", "loss", "held_out_loss", "wall_s", "tokens_per_s", "samples_per_s")
"""What a loss point carries to the page (a step record has much more)."""


def _median(xs: list[float]) -> float | None:
    xs = sorted(x for x in xs if isinstance(x, int | float) and math.isfinite(x))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def job_block(job: Mapping[str, Any], names: Mapping[str, str], *,
              now: float) -> dict[str, Any]:
    """One job as the page draws it, from `GET /v1/jobs/ID` (without its points)."""
    status = job.get("status") or {}
    hist = list(job.get("history") or [])
    last = hist[-1] if hist else {}
    plan = job.get("plan_summary")
    measured = _median([h.get("wall_s") for h in hist[-10:]])

    def who(n: Any) -> dict[str, Any]:
        return {"node_id": n, "name": names.get(str(n), "")}

    stages = []
    for s in status.get("stages") or []:
        stages.append({**dict(s), **{"machine": who(s.get("node"))}})
    if isinstance(plan, Mapping):  # the planner's figures per stage, replicas included
        by_stage = {p.get("stage"): p for p in plan.get("stages") or []}
        for s in stages:
            p = by_stage.get(s.get("stage"))
            if p is not None:
                s["replicas"] = [who(r) for r in p.get("replica_machine_ids") or []]
                s["first_op"], s["last_op"] = p.get("first_op"), p.get("last_op")
                s["ops"] = int(p.get("stop_op", 0)) - int(p.get("start_op", 0))
                s["predicted_compute_s"] = p.get("compute_s")
                s["memory_bytes"] = p.get("memory_bytes")
                s["micro_batches"] = p.get("micro_batches")
                s["recompute"] = bool(p.get("recompute"))
                s["offload"] = bool(p.get("offload"))
                s["offload_params"] = bool(p.get("offload_params"))
                blocks = p.get("checkpoint_blocks") or []
                s["checkpoint"] = f"{len(blocks)}/{p.get('blocks')}" if blocks else None
    ckpt_at = job.get("checkpoint_at")
    return {
        "job_id": job.get("job_id"), "name": job.get("name"), "state": job.get("state"),
        "steps": job.get("steps"), "step": job.get("step"), "loss": job.get("loss"),
        "first_loss": job.get("first_loss"), "owner_uid": job.get("owner_uid"),
        "scheduler": who(job.get("scheduler")), "submitted_at": job.get("submitted_at"),
        "eta_s": job.get("eta_s"),
        "tokens_per_s": status.get("tokens_per_s", last.get("tokens_per_s")),
        "samples_per_s": status.get("samples_per_s", last.get("samples_per_s")),
        "stages": stages, "edges": list(status.get("edges") or []),
        "method": plan.get("method") if isinstance(plan, Mapping) else None,
        "bottleneck": plan.get("bottleneck") if isinstance(plan, Mapping) else None,
        "idle": {k: v for k, v in (plan.get("idle") or {}).items()}
        if isinstance(plan, Mapping) else {},
        "predicted_iteration_s": plan.get("iteration_s") if isinstance(plan, Mapping)
        else None,
        "measured_iteration_s": measured,
        "restarts": job.get("restarts", (job.get("outcome") or {}).get("restarts")),
        "checkpoint_step": job.get("checkpoint_step"),
        "checkpoint_age_s": round(now - ckpt_at, 1) if isinstance(ckpt_at, int | float)
        else None,
        "failure": status.get("failure") or (job.get("outcome") or {}).get("error"),
    }


@dataclasses.dataclass
class Follower:
    """One page's stream: the last loss point each job's page has (its step)."""

    sent: dict[str, int] = dataclasses.field(default_factory=dict)


History = Callable[[int], Awaitable[Mapping[str, Any]]]
"""A job's view with its newest `n` step records (`GET /v1/jobs/ID?history=n`)."""


async def job_points(fetch: History, brief: Mapping[str, Any], follower: Follower,
                     *, most: int = MAX_POINTS) -> tuple[Mapping[str, Any], list[dict[str, Any]],
                                                         bool]:
    """The job's view, the loss points the page does not have yet, and whether they replace
    what it has (`reset`: the first time, or after a restart redid steps it had)."""
    job_id = str(brief.get("job_id"))
    have = follower.sent.get(job_id)
    step = brief.get("step")
    done = int(step) if isinstance(step, int) and not isinstance(step, bool) else 0

    def points(view: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        hist = view.get("history") or []
        return [(h["step"], {k: h.get(k) for k in POINT_KEYS if h.get(k) is not None})
                for h in hist if isinstance(h, Mapping) and isinstance(h.get("step"), int)
                and not isinstance(h.get("step"), bool)]

    if have is None:
        view = await fetch(most)
        got, reset = points(view), True
    else:
        view = await fetch(min(most, max(16, done - have + 16)))
        got = points(view)
        reset = bool(got) and got[-1][0] < have  # a restart redid steps the page has
        if reset:
            view = await fetch(most)
            got = points(view)
        else:
            got = [(st, p) for st, p in got if st > have]
    if got:
        follower.sent[job_id] = got[-1][0]
    elif reset:
        follower.sent[job_id] = -1
    return view, [p for _, p in got], reset


REMOTE_POINTS = 2000
"""A job the scheduler reports for another member: at most this many points at once (what one
`JobsAnswer` carries)."""


async def snapshot(backend: DashboardBackend, caller: Caller, follower: Follower, *,
                   stale_after_s: float, now: float | None = None) -> dict[str, Any]:
    """Everything the page shows, for `caller` (the session's API caller): the jobs this
    daemon knows and, for the operator, every job the scheduler runs for any member."""
    now = time.time() if now is None else now
    cl = cluster_block(backend.status())
    names = {str(m["node_id"]): m["name"] for m in cl["members"]}
    out: dict[str, Any] = {"at": now, "cluster": cl,
                           "links": links_block(backend.links(), cl["members"],
                                                stale_after_s=stale_after_s),
                           "viewer": {"operator": caller.operator,
                                      "who": caller.describe()},
                           "jobs": [], "hidden_jobs": 0, "stages_here": [],
                           "cluster_note": None}
    try:
        listing = await backend.cluster_jobs(caller)
    except ApiError:
        return out
    out["hidden_jobs"] = int(listing.get("hidden") or 0)
    out["stages_here"] = [dict(s) for s in listing.get("stages") or []]
    out["cluster_note"] = listing.get("cluster_note")
    local = [*(listing.get("jobs") or []), *(listing.get("coordinating") or [])]
    remote = list((listing.get("cluster") or {}).get("jobs") or [])
    seen: set[str] = set()
    uniq: list[tuple[bool, Mapping[str, Any]]] = []
    for is_remote, b in [*((False, b) for b in local), *((True, b) for b in remote)]:
        if str(b.get("job_id")) not in seen:
            seen.add(str(b.get("job_id")))
            uniq.append((is_remote, b))
    uniq.sort(key=lambda x: (x[1].get("state") != "running",
                             -float(x[1].get("submitted_at") or 0.0)))
    for is_remote, b in uniq[:MAX_JOBS]:
        job_id = str(b["job_id"])

        async def local_view(n: int, job_id: str = job_id) -> Mapping[str, Any]:
            return backend.job(job_id, n, caller)

        async def remote_view(n: int, job_id: str = job_id) -> Mapping[str, Any]:
            return await backend.remote_job(job_id, n, caller)

        try:
            if is_remote:
                view, pts, reset = await job_points(remote_view, b, follower,
                                                    most=REMOTE_POINTS)
                detail = view
            else:
                detail = backend.job(job_id, 16, caller)
                _, pts, reset = await job_points(local_view, b, follower)
        except ApiError:  # gone between the list and the look (retired, or not ours)
            continue
        out["jobs"].append({**job_block(detail, names, now=now), "points": pts,
                            "reset": reset, "submitter": {
                                "node_id": detail.get("submitter"),
                                "name": names.get(str(detail.get("submitter")), "")}
                            if is_remote else None})
    return out


# -- the server ----------------------------------------------------------------------------


def _loopback_host(host_header: str) -> bool:
    host = host_header.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    else:
        host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return is_loopback(host.lower())


def _dumps(data: Any) -> str:
    return json.dumps(to_jsonable(data), allow_nan=False, default=str)


def _finite(obj: Any) -> Any:
    """Non-finite floats as null (JSON has no NaN; a diverged loss is one)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class DashboardServer:
    """Serves the dashboard of one backend on a loopback host:port (a service)."""

    def __init__(self, backend: DashboardBackend, host: str, port: int, *,
                 session_ttl_s: float, stale_after_s: float,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.backend = backend
        self.sessions = Sessions(session_ttl_s)
        self.stale_after_s = stale_after_s
        self.interval_s = interval_s
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self._streams = 0
        self._closing = asyncio.Event()
        self.address: tuple[str, int] | None = None

    @property
    def url(self) -> str | None:
        if self.address is None:
            return None
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    def session_url(self, caller: Caller) -> dict[str, Any]:
        """A new session for `caller`: the URL that opens the dashboard with it."""
        if self.url is None:
            raise ApiError(409, "not_serving", "the dashboard is not serving yet")
        token = self.sessions.mint(caller)
        return {"url": f"{self.url}#token={token}", "base_url": self.url, "token": token,
                "expires_in_s": self.sessions.ttl_s, "viewer": caller.describe()}

    async def start(self) -> None:
        self._closing.clear()
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        r.add_get("/", self._index)
        r.add_get("/healthz", self._healthz)
        r.add_get("/favicon.ico", self._no_icon)
        r.add_get("/static/{name}", self._static)
        r.add_get("/api/snapshot", self._snapshot)
        r.add_get("/api/events", self._events)
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               shutdown_timeout=1.0)
        await runner.setup()
        self._runner = runner
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
        except BaseException:
            await self.close()
            raise
        server = getattr(site, "_server", None)
        socks = getattr(server, "sockets", None) or []
        self.address = socks[0].getsockname()[:2] if socks else (self._host, self._port)
        log.info("dashboard on %s (open it with `fusionctl dashboard`)", self.url)

    async def ready(self) -> None:
        """Ready once start() returned: the port is bound."""

    async def close(self) -> None:
        self._closing.set()  # live streams end their loop
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- handlers ----------------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _loopback_host(request.host):
            return web.json_response({"error": {"code": "bad_host", "message": (
                f"the dashboard answers only to loopback names, not Host {request.host!r}")}},
                status=421)
        if request.method not in ("GET", "HEAD"):
            return web.json_response({"error": {"code": "read_only", "message":
                                      "the dashboard is read-only"}}, status=405)
        try:
            resp = await handler(request)
        except ApiError as e:
            resp = web.json_response({"error": {"code": e.code, "message": e.message}},
                                     status=e.status)
        except web.HTTPException as e:
            resp = web.json_response({"error": {"code": "http", "message": e.reason}},
                                     status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: answer, log with traceback, keep serving
            log.exception("dashboard %s failed", request.path)
            resp = web.json_response({"error": {"code": "internal",
                                                "message": f"{type(e).__name__}: {e}"}},
                                     status=500)
        if not resp.prepared:
            resp.headers.update(SECURITY_HEADERS)
        return resp

    def _session(self, request: web.Request) -> Session:
        auth = request.headers.get("Authorization", "")
        token = auth[7:].strip() if auth.startswith("Bearer ") else ""
        s = self.sessions.get(token)
        if s is None:
            raise ApiError(401, "no_session", "no dashboard session, or it expired: run "
                           "`fusionctl dashboard` for a new link")
        return s

    async def _index(self, request: web.Request) -> web.StreamResponse:
        text = await asyncio.to_thread((STATIC_DIR / "index.html").read_text)
        return web.Response(text=text, content_type="text/html", charset="utf-8")

    async def _healthz(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok\n")

    async def _no_icon(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=204)

    async def _static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        ctype = STATIC_FILES.get(name)
        if ctype is None:
            raise ApiError(404, "not_found", f"no such file {name!r}")
        body = await asyncio.to_thread((STATIC_DIR / name).read_bytes)
        return web.Response(body=body, content_type=ctype, charset="utf-8")

    async def _snapshot_for(self, s: Session, follower: Follower) -> str:
        return _dumps(_finite(await snapshot(self.backend, s.caller, follower,
                                             stale_after_s=self.stale_after_s)))

    async def _snapshot(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        return web.Response(text=await self._snapshot_for(s, Follower()),
                            content_type="application/json")

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """The live stream: a snapshot every `interval_s` (new loss points only, after the
        first), until the session expires, the page goes, or the daemon stops."""
        s = self._session(request)
        if self._streams >= MAX_STREAMS:
            raise ApiError(503, "busy", f"{MAX_STREAMS} dashboard streams are open already")
        self._streams += 1
        try:
            resp = web.StreamResponse(headers={**SECURITY_HEADERS,
                                               "Content-Type": "text/event-stream",
                                               "X-Accel-Buffering": "no"})
            await resp.prepare(request)
            follower = Follower()
            await resp.write(b"retry: 2000\n\n")
            while not self._closing.is_set():
                if self.sessions.alive(s):
                    data = await self._snapshot_for(s, follower)
                    await resp.write(f"event: snapshot\ndata: {data}\n\n".encode())
                else:
                    await resp.write(b"event: expired\ndata: {}\n\n")
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._closing.wait()
            return resp
        finally:
            self._streams -= 1
