"""The fusiond supervisor: starts services in dependency order, reports ready, drains on stop.

Order (each awaited ready before the next starts), all inside one ``asyncio.TaskGroup``:

1. the local API (so ``fusionctl`` can always reach a running daemon, even before it has a
   cluster) and the metrics endpoint;
2. the profile (device, memory, a cached matmul benchmark: run in a thread);
3. once the node has cluster credentials (``fusionctl init`` / ``join``, or plaintext dev mode):
   the peer listener (`fusiond.net.PeerNetwork`), then discovery, membership, probes and
   election (`fusiond.cluster.Cluster`).

Then it reports ready (``READY=1`` and ``STATUS=`` to ``$NOTIFY_SOCKET``). SIGTERM/SIGINT close
the services in reverse order and `run` returns 0. SIGHUP re-reads the config and applies what
can change live (log level, new bootstrap addresses); other changes are logged as needing a
restart. A service that fails (start raises, ready times out, or its ``wait()`` returns while
not stopping) is logged with its cause, every other service is closed, and `run` returns 1:
the daemon is never left half alive.

Message routing: PeerNetwork calls `Daemon._on_message` for each message, which offers it to
the cluster (``await cluster.handle(peer, msg) -> bool``), then the job service
(`fusiond.jobs.service.JobService`: stages hosted here, jobs coordinated here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

import fusiond
import protocol
from fusiond import profile as profiling
from fusiond.api import ApiError, ApiServer, to_jsonable
from fusiond.api.server import Caller, body_bool, body_number, user_name
from fusiond.config import (
    DEFAULT_PEER_PORT,
    DaemonConfig,
    LoadedConfig,
    advertise_address,
    gpu_indices,
    is_loopback,
    load_config,
    parse_hostport,
)
from fusiond.durable import write_bytes
from fusiond.errors import FusionError, LocalError
from fusiond.metrics import DaemonCollector, MetricsServer, make_registry
from fusiond.tasks import cancel_and_wait

log = logging.getLogger("fusiond")

LEFT_MARKER = "left"
"""File in the state dir: this node left its cluster; do not rejoin until `fusionctl join`."""
DENIED_FILE = "denied.json"
"""Members removed here with `fusionctl remove`: the transport refuses them even though their
certificates are still valid (there is no revocation yet; docs/security.md)."""
ELECTION_FILE = "election.json"
"""The election's term and vote (fusiond.cluster.persist): no second vote in a term after a
restart."""
MEMBERS_FILE = "members.json"
"""The member list (signed headers and certificates), removals and voter set
(fusiond.cluster.persist): a restarted node counts the voters it knew."""
BOOTSTRAP_FILE = "bootstrap.json"
"""Addresses learned from `fusionctl join`, kept so a restart finds the cluster again."""
PLAINTEXT_CLUSTER_ID = "insecure-dev"
CLUSTER_JOBS_OPERATOR_ONLY = (
    "other members' jobs are shown to this daemon's operator only (root, its own user, or the "
    "API token's holder): a job belongs to a user of the machine it was submitted on")
LIST_ASK_S = 3.0
"""How long listing the cluster's jobs waits for the scheduler (then: this daemon's only)."""
STATUS_EVERY_S = 2.0
"""How often the daemon looks whether its `systemctl status` line changed."""
STALE_PROBES = 3
"""A link figure older than this many probe intervals is shown stale (the dashboard)."""
MAX_TOKEN_TTL_S = 366 * 24 * 3600.0
"""A join token lives at most a year (`fusionctl token --ttl`); a longer one is refused."""


class Service(Protocol):
    async def start(self) -> None: ...
    async def ready(self) -> None: ...
    async def close(self) -> None: ...


class ServiceFailed(LocalError):
    """A supervised service failed; the message names it and the cause."""


def sd_notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send one datagram to ``$NOTIFY_SOCKET`` (systemd's notify protocol). False if unset.

    Written out here (20 lines) rather than pulling in a systemd dependency. An address
    starting with ``@`` is in the abstract namespace.
    """
    env = os.environ if env is None else env
    addr = env.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
    except OSError as e:
        log.warning("sd_notify to %s failed: %s", env.get("NOTIFY_SOCKET"), e)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when systemd asked
    for none (or asked another process: $WATCHDOG_PID)."""
    env = os.environ if env is None else env
    usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2e6


SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                   logging.CRITICAL: 2}
"""Python's levels as syslog priorities (journald reads a `<N>` prefix as the line's)."""


class JournalFormatter(logging.Formatter):
    """`<N>logger: message`: journald stamps the time itself, and takes the `<N>` prefix as
    the priority, so `journalctl -u fusiond -p warning` shows warnings and worse. A traceback
    continues on lines of the same priority."""

    def format(self, record: logging.LogRecord) -> str:
        prio = SYSLOG_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `ts` (Unix seconds), `level`, `logger`, `msg`, and `exc` (the
    traceback) when there is one: for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6),
                               "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def journal_stream(env: Mapping[str, str] | None = None, fd: int = 2) -> bool:
    """Whether `fd` is the journal's stream: systemd sets $JOURNAL_STREAM to its
    `device:inode` (so a daemon whose stderr was redirected elsewhere is not fooled)."""
    env = os.environ if env is None else env
    want = env.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return bool(want) and want == f"{st.st_dev}:{st.st_ino}"


def configure_logging(level: str, fmt: str = "auto") -> None:
    """One line per record on stderr, as `fmt` says: `text` (time, level, logger, message),
    `journal` (syslog priority prefix, no time: journald adds it), `json` (JSON lines), or
    `auto`: journal when stderr is the journal, else text."""
    if fmt == "auto":
        fmt = "journal" if journal_stream() else "text"
    formatter: logging.Formatter = (
        JournalFormatter() if fmt == "journal" else JsonFormatter() if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    mine: list[logging.Handler] = [h for h in root.handlers if getattr(h, "_fusiond", False)]
    if not mine:
        new = logging.StreamHandler()
        new._fusiond = True  # type: ignore[attr-defined]
        root.addHandler(new)
        mine = [new]
    for h in mine:
        h.setFormatter(formatter)
    root.setLevel(level.upper())


@dataclass
class _Running:
    name: str
    service: Service


class Daemon:
    """One fusiond. `run()` until stopped; returns the process exit code (0 clean, 1 failed).

    `flags` are the parsed command-line flags, kept so SIGHUP can re-layer the config.
    `owns_process` (the `fusiond` command): once drained, further SIGTERM/SIGINT/SIGHUP are
    ignored until exit (in-process tests leave the host's signal handling alone).
    """

    def __init__(self, loaded: LoadedConfig, *, flags: argparse.Namespace | None = None,
                 config_path: str | None = None, owns_process: bool = False) -> None:
        self._owns_process = owns_process
        self.loaded = loaded
        self.cfg: DaemonConfig = loaded.config
        self._flags = flags
        self._config_path = config_path
        self.state_dir = Path(self.cfg.state_dir)
        self.node_id = ""
        self.cluster_id: str | None = None
        self.security = "none"
        self.phase = "starting"
        self.started_at = time.time()
        self.profiler: profiling.Profiler | None = None
        self.api: ApiServer | None = None
        self.metrics: MetricsServer | None = None
        self.dashboard: Any = None
        """The browser dashboard (`fusiond.api.dashboard.DashboardServer`), when configured."""
        self.net: Any = None
        self.cluster: Any = None
        self._denied_here: frozenset[str] | None = None
        self._denied_applied: frozenset[str] | None = None
        self.jobs: Any = None
        """The job service (`fusiond.jobs.service.JobService`), once the peer network runs."""
        self.op_sets: Any = None
        """This node's op set and the members' (`fusiond.jobs.opsets.OpSetService`), once the
        peer network is about to start."""
        self.address: tuple[str, int] | None = None
        self._running: list[_Running] = []
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._tg: asyncio.TaskGroup | None = None
        self._peer_lock = asyncio.Lock()
        self._stopping = False
        self._failure: BaseException | None = None
        self._handlers: list[Callable[[str, Any], Awaitable[bool]]] = []
        self._status_sent = ""
        """The last STATUS= line sent to systemd."""
        self.registry: CollectorRegistry = make_registry()
        """This daemon's Prometheus registry: jobs and training register their collectors
        here (e.g. tensor bytes before compression) and they appear on /metrics."""

    # -- lifecycle -------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a clean shutdown (signal handlers and tests call this)."""
        if not self._stop.is_set():
            log.info("stopping: draining services")
        self._stop.set()

    async def run(self) -> int:
        """Start everything, wait for a stop request or a failure, close in reverse."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        for sig, cb in ((signal.SIGTERM, self.request_stop), (signal.SIGINT, self.request_stop),
                        (signal.SIGHUP, self._on_sighup)):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, cb)
                installed.append(sig)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                # Start-up races the stop request: SIGTERM during a slow start (a peer
                # listener retrying, a long benchmark) must not wait for it to finish.
                starting = tg.create_task(self._start_all(), name="start")
                stop = tg.create_task(self._stop.wait(), name="stop-request")
                await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not starting.done():
                    log.info("stop requested during start-up")
                    await cancel_and_wait([starting], what="start-up")
                await stop
                self._stopping = True
                self.phase = "stopping"
                sd_notify("STOPPING=1\nSTATUS=draining")
                await self._close_all()
        except BaseException as e:
            self._stopping = True
            await self._close_all()
            cause = self._failure or e
            if isinstance(e, KeyboardInterrupt):
                return 130
            if isinstance(e, asyncio.CancelledError) and self._failure is None:
                raise
            log.error("fusiond stopped because %s", _describe(cause))
            sd_notify(f"STATUS=failed: {_describe(cause)}")
            return 1
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
                if self._owns_process:
                    # A second SIGTERM during the last moments of shutdown (systemd, a
                    # supervisor, an impatient operator) must not turn a clean drain into
                    # death by signal: the exit code stays the drain's.
                    signal.signal(sig, signal.SIG_IGN)
            self.phase = "stopped"
        if self._failure is not None:  # a failure reported through the API (init/join)
            log.error("fusiond stopped because %s", _describe(self._failure))
            return 1
        log.info("fusiond stopped cleanly")
        return self._exit_code

    async def _start_all(self) -> None:
        cfg = self.cfg
        if cfg.net.insecure_plaintext:
            log.warning("PLAINTEXT peer links (net.insecure_plaintext): anyone who can reach "
                        "%s can read and inject cluster traffic. Loopback development only.",
                        cfg.net.listen)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.node_id = await asyncio.to_thread(self._load_identity)
        log.info("node id %s (state in %s)", self.node_id, self.state_dir)
        self.api = ApiServer(
            self,
            socket_path=cfg.api.socket or None,
            tcp=parse_hostport(cfg.api.tcp) if cfg.api.tcp else None,
            token_path=cfg.token_path,
            test_endpoints=cfg.net.test_drop_switch,
            max_upload_bytes=cfg.api.max_upload_bytes,
        )
        await self._start_service("api", self.api)
        self.registry.register(DaemonCollector(
            node_id=lambda: self.node_id,
            net_stats=lambda: self.net.stats() if self.net is not None else None,
            cluster_view=lambda: self.cluster.view() if self.cluster is not None else None,
            started_at=self.started_at,
            net_counts=lambda: self.net.counts() if self.net is not None else None,
            probe_failures=lambda: (self.cluster.probe_failures if self.cluster is not None
                                    else None)))
        if cfg.metrics.listen:
            host, port = parse_hostport(cfg.metrics.listen)
            self.metrics = MetricsServer(self.registry, host, port)
            await self._start_service("metrics", self.metrics)
        if cfg.dashboard.listen:
            from fusiond.api.dashboard import DashboardServer

            host, port = parse_hostport(cfg.dashboard.listen)
            self.dashboard = DashboardServer(
                self, host, port, session_ttl_s=cfg.dashboard.session_ttl_s,
                stale_after_s=STALE_PROBES * cfg.cluster.probe_interval_s)
            await self._start_service("dashboard", self.dashboard)
        owned = gpu_indices(cfg.gpus)
        static = await asyncio.to_thread(
            profiling.compute_profile, cfg.cache_dir, benchmark=cfg.profile_benchmark,
            gpus=owned if not isinstance(owned, str) else frozenset())
        # the free disk it gossips is the state directory's: stages keep their files there
        self.profiler = profiling.Profiler(static, disk_dir=self.state_dir)
        # The name travels in the gossiped profile's labels (a field every member's schema
        # already has, so older members verify the signed body unchanged): peers show it.
        self.profiler.update(labels={**static.labels, "name": self._name()})
        if cfg.job_memory_gib > 0:  # gossiped: the memory the planner gives this node
            self.profiler.update(job_memory_bytes=int(cfg.job_memory_gib * 2**30))
        log.info("profile: %s %s, %.1f GFLOP/s", static.device_kind, static.device_name,
                 static.gflops)
        if self._has_credentials() and not (self.state_dir / LEFT_MARKER).exists():
            await self._start_peer_services(self._load_bootstrap())
            status = (f"serving {self.cluster_id} as {self.node_id} on "
                      f"{_fmt_addr(self.address)}")
        elif (self.state_dir / LEFT_MARKER).exists():
            self.phase = "left"
            status = "left the cluster; run `fusionctl join TOKEN` to join one"
        else:
            self.phase = "unconfigured"
            status = ("not in a cluster: run `fusionctl init` (new cluster) or "
                      "`fusionctl join TOKEN`")
        log.info("ready: %s", status)
        sd_notify(f"READY=1\nSTATUS={status}")
        self._status_sent = status
        interval = watchdog_interval()
        if interval is not None and self._tg is not None:
            self._tg.create_task(self._watchdog(interval), name="sd-watchdog")
        if os.environ.get("NOTIFY_SOCKET") and self._tg is not None:
            self._tg.create_task(self._keep_status(), name="sd-status")

    def status_line(self) -> str:
        """One line for `systemctl status` (systemd's STATUS=): the phase and, in a cluster,
        the scheduler and its term, quorum, members alive, the stages hosted here."""
        if self.cluster is None:
            return {"left": "left the cluster; run `fusionctl join TOKEN` to join one",
                    "unconfigured": "not in a cluster: run `fusionctl init` (new cluster) or "
                                    "`fusionctl join TOKEN`"}.get(self.phase, self.phase)
        view = self.cluster.view()
        alive = sum(1 for m in view.members if m.state == "alive")
        lead = ("this node" if view.leader == self.node_id else view.leader) or "none"
        stages = sum(1 for s in (self.jobs.worker.jobs().values() if self.jobs else ())
                     if s.get("running"))
        return (f"cluster {self.cluster_id}: scheduler {lead} term {view.term}, quorum "
                f"{'yes' if view.has_quorum else 'NO'}, {alive} of {len(view.members)} "
                f"members alive, {stages} stage(s) running here")

    async def _keep_status(self) -> None:
        """Keep systemd's STATUS= current: the line is sent again whenever it changes."""
        while not self._stopping:
            await asyncio.sleep(STATUS_EVERY_S)
            line = self.status_line()
            if line != self._status_sent and not self._stopping:
                self._status_sent = line
                sd_notify(f"STATUS={line}")

    async def _watchdog(self, interval: float) -> None:
        """Ping systemd's watchdog from the event loop: a loop blocked for WatchdogSec (a bug:
        compute belongs off the loop) gets the daemon restarted instead of hanging."""
        while not self._stopping:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _start_service(self, name: str, svc: Service) -> None:
        """Start `svc`, await its readiness (bounded), and watch it for failure."""
        t = self.cfg.start_timeout_s
        try:
            await asyncio.wait_for(svc.start(), t)
            await asyncio.wait_for(svc.ready(), t)
        except TimeoutError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(svc.close(), self.cfg.stop_timeout_s)
            raise ServiceFailed(f"service {name} was not ready within start_timeout_s={t}") \
                from None
        except asyncio.CancelledError:
            # Stopped mid-start: whatever the service already opened is closed, not leaked.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(svc.close(), self.cfg.stop_timeout_s)
            raise
        except ServiceFailed:
            raise
        except Exception as e:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(svc.close(), self.cfg.stop_timeout_s)
            raise ServiceFailed(f"service {name} failed to start: {_describe(e)}") from e
        self._running.append(_Running(name, svc))
        log.debug("service %s ready", name)
        waiter = getattr(svc, "wait", None) or getattr(svc, "wait_closed", None)
        if callable(waiter) and self._tg is not None:
            self._tg.create_task(self._watch(name, waiter), name=f"watch-{name}")

    async def _watch(self, name: str, waiter: Callable[[], Awaitable[Any]]) -> None:
        """A service's wait() returning (or raising) while we are not stopping is a crash."""
        try:
            await waiter()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._stopping:
                self._failure = ServiceFailed(f"service {name} crashed: {_describe(e)}")
                raise self._failure from e
            return
        if not self._stopping and any(r.name == name for r in self._running):
            self._failure = ServiceFailed(f"service {name} stopped unexpectedly")
            raise self._failure

    async def _close_all(self) -> None:
        """Close running services in reverse start order; idempotent."""
        while self._running:
            r = self._running.pop()
            await self._close_one(r)

    async def _close_one(self, r: _Running) -> None:
        try:
            await asyncio.wait_for(r.service.close(), self.cfg.stop_timeout_s)
            log.debug("service %s closed", r.name)
        except TimeoutError:
            log.error("service %s did not close within stop_timeout_s=%s", r.name,
                      self.cfg.stop_timeout_s)
            self._exit_code = 1
        except Exception as e:
            log.error("service %s failed while closing: %s", r.name, _describe(e))
            self._exit_code = 1

    # -- identity and credentials ----------------------------------------------------------

    def _load_identity(self) -> str:
        from fusiond.net import pki

        return pki.load_or_create_node_identity(self.state_dir).node_id

    def _tls_material(self) -> Any:
        from fusiond.net import pki

        return pki.TLSMaterial.in_state_dir(self.state_dir)

    def _check_credentials(self, tls: Any) -> str:
        """The cluster id, after checking that node.crt is ours and issued by ca.crt: a
        mismatch is named here instead of surfacing as refused handshakes on every peer."""
        from fusiond.net import pki

        try:
            cert, ca_cert = pki.load_cert(tls.cert), pki.load_cert(tls.ca_cert)
            pki.verify_issued_by(cert, ca_cert)
            cert_id = pki.node_id_of_cert(cert)
        except pki.PKIError as e:
            raise ServiceFailed(f"credentials in {self.state_dir} are unusable: {e}") from None
        if cert_id != self.node_id:
            raise ServiceFailed(f"{tls.cert} was issued to node {cert_id}, but {tls.key} is "
                                f"node {self.node_id}: rejoin with a fresh token "
                                "(`fusionctl token` on a member, then `fusionctl join`)")
        return str(pki.cluster_id_of_ca_cert(ca_cert))

    def _cluster_trust(self, tls: Any, cluster_id: str) -> Any:
        """This node's signing key, certificate and the cluster CA (plus the CA key where this
        member holds it: it may then remove members), for signed membership facts."""
        from cryptography.hazmat.primitives import serialization

        from fusiond.cluster import Trust, X509Authority
        from fusiond.net import pki

        ident = pki.load_or_create_node_identity(self.state_dir)
        ca = pki.load_cluster_ca(self.state_dir)
        return Trust(cluster_id=cluster_id, node_id=self.node_id, key=ident.key,
                     credential=pki.load_cert(tls.cert).public_bytes(serialization.Encoding.DER),
                     authority=X509Authority(pki.load_cert(tls.ca_cert)),
                     operator_key=ca.key if ca is not None else None)

    def _apply_denied(self, local: set[str] | None = None) -> None:
        """The transport refuses the members removed here (denied.json; `local` when just
        changed) and those whose operator-signed removal reached us by gossip. Called on
        every cluster change: only a changed set reaches the transport."""
        if local is not None:
            self._denied_here = frozenset(local)
        elif self._denied_here is None:
            self._denied_here = frozenset(self._load_denied())
        if self.net is None:
            return
        removed = self.cluster.removed() if self.cluster is not None else frozenset()
        denied = self._denied_here | removed
        if denied != self._denied_applied:
            self._denied_applied = denied
            self.net.set_denied(set(denied))

    def _has_credentials(self) -> bool:
        return bool(self.cfg.net.insecure_plaintext or self._tls_material().exists())

    def _load_bootstrap(self) -> list[str]:
        learned: list[str] = []
        with contextlib.suppress(FileNotFoundError, ValueError):
            data = json.loads((self.state_dir / BOOTSTRAP_FILE).read_text())
            if isinstance(data, list):
                learned = [a for a in data if isinstance(a, str)]
        return list(dict.fromkeys([*self.cfg.cluster.bootstrap, *learned]))

    def _remember_bootstrap(self, addrs: list[str]) -> None:
        known = list(dict.fromkeys([*self._load_bootstrap_file(), *addrs]))
        write_bytes(self.state_dir / BOOTSTRAP_FILE, json.dumps(known).encode(), 0o600)

    def _load_denied(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError, ValueError):
            data = json.loads((self.state_dir / DENIED_FILE).read_text())
            if isinstance(data, list):
                return {a for a in data if isinstance(a, str)}
        return set()

    def _deny(self, node_id: str) -> set[str]:
        denied = self._load_denied() | {node_id}
        write_bytes(self.state_dir / DENIED_FILE, json.dumps(sorted(denied)).encode(), 0o600)
        return denied

    def _load_bootstrap_file(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError, ValueError):
            data = json.loads((self.state_dir / BOOTSTRAP_FILE).read_text())
            if isinstance(data, list):
                return [a for a in data if isinstance(a, str)]
        return []

    # -- peer services ---------------------------------------------------------------------

    async def _start_peer_services(self, bootstrap: list[str]) -> None:
        """Start PeerNetwork then Cluster (once); needs credentials or plaintext mode."""
        async with self._peer_lock:
            if self.cluster is not None:
                return
            from fusiond.cluster import Cluster, ClusterConfig
            from fusiond.net import JoinAuthority, NetConfig, PeerNetwork, load_cluster_ca

            cfg = self.cfg
            await self._start_op_sets()
            tls: Any = None
            trust: Any = None
            cluster_id: str
            if cfg.net.insecure_plaintext:
                cluster_id = cfg.cluster.id or PLAINTEXT_CLUSTER_ID
                self.security = "plaintext"
            else:
                tls = self._tls_material()
                cluster_id = await asyncio.to_thread(self._check_credentials, tls)
                trust = await asyncio.to_thread(self._cluster_trust, tls, cluster_id)
                self.security = "tls"
            self.cluster_id = cluster_id
            host, port = parse_hostport(cfg.net.listen)
            join_authority = None
            if tls is not None:
                ca = await asyncio.to_thread(load_cluster_ca, self.state_dir)
                if ca is not None:  # this member can admit joiners
                    join_authority = JoinAuthority(ca, self.state_dir)
            advertise = parse_hostport(cfg.net.advertise) if cfg.net.advertise else None
            net = PeerNetwork(
                node_id=self.node_id, cluster_id=cluster_id, listen=(host, port), tls=tls,
                handler=self._on_message, config=_net_config(NetConfig, cfg),
                join_authority=join_authority, advertise=advertise,
            )
            self.net = net
            if self.jobs is not None:  # tensors to the stages as their bytes arrive
                net.set_receive_now(self.jobs.worker.receive_now)
            await self._start_service("net", net)
            denied = self._load_denied()
            self._denied_here, self._denied_applied = frozenset(denied), frozenset(denied)
            if denied:
                net.set_denied(denied)
                log.info("refusing %d removed member(s): %s", len(denied),
                         ", ".join(sorted(denied)))
            self.address = advertise_address(cfg, net.address)
            net.advertise = self.address
            if is_loopback(self.address[0]) and not is_loopback(net.address[0]):
                log.warning("advertising %s, a loopback address: peers on other machines "
                            "cannot dial it; set net.advertise to this machine's address",
                            _fmt_addr(self.address))
            assert self.profiler is not None
            cluster = Cluster(
                node_id=self.node_id, cluster_id=cluster_id, net=net,
                advertise=self.address, profile=self.profiler,
                config=_cluster_config(ClusterConfig, cfg, bootstrap),
                state_path=self.state_dir / ELECTION_FILE,
                members_path=self.state_dir / MEMBERS_FILE, trust=trust,
            )
            self.cluster = cluster
            await self._start_service("cluster", cluster)
            cluster.on_change(lambda _view: self._apply_denied())
            self._apply_denied()
            await self._start_jobs()
            self.phase = "running"
            log.info("peer services up: cluster %s, %s links, listening on %s, advertising %s",
                     self.cluster_id, self.security, _fmt_addr(tuple(net.address)),
                     _fmt_addr(self.address))

    async def _start_op_sets(self) -> None:
        """This node's op set (its torch's registry less `jobs.disabled_ops`) into the
        gossiped profile, and the service that tells other members its names and learns
        theirs (once; before the peer network, so no request finds nobody to answer it)."""
        if self.op_sets is not None:
            return
        from fusiond.jobs.opsets import OpSetService

        ops, fields = await asyncio.to_thread(profiling.op_set_fields, self.cfg.jobs.disabled_ops)
        if ops.unknown:
            log.warning("jobs.disabled_ops names %s, which this torch's op registry does not "
                        "have: they disable nothing (a typo, or another torch's op?)",
                        ", ".join(ops.unknown))
        if ops.disabled:
            log.info("jobs.disabled_ops: this daemon runs no stage using %s",
                     ", ".join(ops.disabled))
        assert self.profiler is not None
        self.profiler.update(**fields)

        async def send(peer: str, msg: Any, payload: Any = ()) -> None:
            if self.net is None:
                raise LocalError(f"cannot send {type(msg).__name__} to {peer}: not in a cluster")
            await self.net.send(peer, msg, payload)

        self.op_sets = OpSetService(node_id=self.node_id, local=ops, send=send)
        await self._start_service("opsets", self.op_sets)
        self.add_message_handler(self.op_sets.handle)

    async def _start_peer_services_for_api(self) -> None:
        """Start the peer services for init/join; a failure stops the daemon (exit 1) like a
        failure at start-up would, and the caller gets an error saying so."""
        try:
            await self._start_peer_services(self._load_bootstrap())
        except ServiceFailed as e:
            self._failure = e
            self.request_stop()
            raise ApiError(500, "service_failed",
                           f"{e}; fusiond is stopping (exit 1): fix the cause, start it again "
                           "and it resumes with the credentials it has") from None

    async def _stop_peer_services(self) -> None:
        """Close cluster then net (used by leave); the daemon keeps serving its API."""
        async with self._peer_lock:
            for name in ("cluster", "net"):
                for r in [r for r in self._running if r.name == name]:
                    self._running.remove(r)
                    await self._close_one(r)
            self.cluster = None
            self.net = None
            self.address = None

    async def _start_jobs(self) -> None:
        """The job service (once): hosts stages, runs the jobs submitted here, and follows
        membership so a dead stage machine fails its job; its figures go on /metrics."""
        if self.jobs is not None:
            if self.cluster is not None:
                self.cluster.on_change(self.jobs.on_view)
            return
        from fusiond.jobs.metrics import JobCollector
        from fusiond.jobs.service import JobService

        async def send(peer: str, msg: Any, payload: Any = ()) -> None:
            if self.net is None:
                raise LocalError(f"cannot send {type(msg).__name__} to {peer}: not in a cluster")
            await self.net.send(peer, msg, payload)

        def send_now(peer: str, msg: Any, payload: Any = ()) -> bool:
            return self.net is not None and self.net.send_now(peer, msg, payload)

        from fusiond.train.stage import StageConfig

        jobs = JobService(node_id=self.node_id, send_raw=send, send_now_raw=send_now,
                          view=lambda: self.cluster.view() if self.cluster is not None else None,
                          state_dir=self.state_dir, op_sets=self.op_sets,
                          stage_config=StageConfig(
                              disabled_ops=frozenset(self.cfg.jobs.disabled_ops),
                              recv_timeout_s=self.cfg.jobs.stage_recv_timeout_s,
                              memory_limit_bytes=profiling.memory_allowance().limit_bytes))
        self.jobs = jobs
        if self.net is not None:
            self.net.set_receive_now(jobs.worker.receive_now)
        await self._start_service("jobs", jobs)
        self.add_message_handler(jobs.dispatch)
        if self.cluster is not None:
            self.cluster.on_change(jobs.on_view)
        self.registry.register(JobCollector(
            jobs.coordinators, jobs.scheduling.stats,
            checkpoints=lambda: {j: r.checkpoint_at for j, r in jobs.scheduling.records.items()}))

    def add_message_handler(self, handler: Callable[[str, Any], Awaitable[bool]]) -> None:
        """Offer peer messages the cluster does not take to `handler(peer, msg) -> handled`
        (jobs and training plug in here), in registration order."""
        self._handlers.append(handler)

    async def _on_message(self, peer: str, msg: Any) -> None:
        """PeerNetwork's handler: the cluster first (membership, election, probes), then the
        registered handlers. Errors are logged by PeerNetwork and never kill the reader."""
        cluster = self.cluster
        if cluster is not None and await cluster.handle(peer, msg):
            return
        for handler in self._handlers:
            if await handler(peer, msg):
                return
        log.debug("no service handles %s from %s", type(msg).__name__, peer)

    # -- reload ----------------------------------------------------------------------------

    def _on_sighup(self) -> None:
        # systemd's reload protocol (what Type=notify-reload, systemd 253 and later, waits
        # for): RELOADING=1 with the monotonic time, then READY=1 once done
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        sd_notify(f"RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS=reloading the configuration")
        try:
            self._reload()
        finally:
            sd_notify(f"READY=1\nSTATUS={self.status_line()}")

    def _reload(self) -> None:
        try:
            new = load_config(path=self._config_path, flags=self._flags)
        except FusionError as e:
            log.error("SIGHUP: config not reloaded, keeping the running one: %s", e)
            return
        old, cfg = self.cfg, new.config
        if cfg.log_level != old.log_level or cfg.log_format != old.log_format:
            configure_logging(cfg.log_level, cfg.log_format)
            log.info("SIGHUP: log_level %s -> %s, log_format %s -> %s", old.log_level,
                     cfg.log_level, old.log_format, cfg.log_format)
        added = [b for b in cfg.cluster.bootstrap if b not in old.cluster.bootstrap]
        if added and self.cluster is not None:
            for b in added:
                self.cluster.add_bootstrap(parse_hostport(b, default_port=DEFAULT_PEER_PORT))
            log.info("SIGHUP: added bootstrap addresses %s", ", ".join(added))
        old.log_level, old.log_format = cfg.log_level, cfg.log_format
        old.cluster.bootstrap = cfg.cluster.bootstrap
        from fusiond.config import get, keys

        restart = [k.path for k in keys() if k.path not in ("log_level", "log_format",
                                                             "cluster.bootstrap")
                   and get(cfg, k.path) != get(old, k.path)]
        if restart:
            log.warning("SIGHUP: changes to %s take effect after a restart", ", ".join(restart))
        log.info("SIGHUP: configuration reloaded")

    # -- API backend -----------------------------------------------------------------------

    def _node_block(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "name": self._name(),
            "cluster_id": self.cluster_id,
            "address": _fmt_addr(self.address) if self.address else None,
            "security": self.security,
            "phase": self.phase,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "profile": self.profiler() if self.profiler else None,
            "denied": sorted(self._load_denied()),
        }

    def _name(self) -> str:
        """This node's human name: `name` from the config, else the host name (bounded as a
        profile text field is)."""
        return (self.cfg.name or socket.gethostname())[:64]

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self._node_block(), "cluster": None, "hint": None}
        if self.cluster is not None:
            view = self.cluster.view()
            out["cluster"] = view_json(view)
            # torch/Python/fusiond versions and op sets per member; a warning when mixed
            out["software"] = profiling.software_summary(view.members)
        elif self.phase == "unconfigured":
            out["hint"] = ("this node is not in a cluster: run `fusionctl init` to create one, "
                           "or `fusionctl join TOKEN` with a token from a member "
                           "(`fusionctl token` there)")
        elif self.phase == "left":
            out["hint"] = "this node left its cluster: run `fusionctl join TOKEN` to join again"
        if self.security == "plaintext":
            out["warning"] = ("PLAINTEXT peer links: loopback development only; membership, "
                              "votes and terms are unsigned (any peer can forge them)")
        return out

    def links(self) -> dict[str, Any]:
        if self.cluster is None:
            return {"node_id": self.node_id, "members": [], "links": {}}
        view = view_json(self.cluster.view())
        return {"node_id": self.node_id,
                "members": [m["node_id"] for m in view["members"]],
                "links": view["links"]}

    def paths(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "config_file": str(self.loaded.file) if self.loaded.file else None,
            "state_dir": str(self.state_dir),
            "cache_dir": cfg.cache_dir,
            "api_socket": cfg.api.socket or None,
            "api_tcp": _fmt_addr(self.api.tcp_address) if self.api and self.api.tcp_address
            else None,
            "api_token_file": str(cfg.token_path) if cfg.api.tcp else None,
            "metrics": (f"http://{_fmt_addr(self.metrics.address)}/metrics"
                        if self.metrics and self.metrics.address else None),
            "peer_listen": _fmt_addr(tuple(self.net.address)) if self.net is not None else None,
            "dashboard": self.dashboard.url if self.dashboard is not None else None,
        }

    def version(self) -> dict[str, Any]:
        static = self.profiler.static if self.profiler else None
        return {"fusiond": fusiond.__version__, "protocol": protocol.PROTOCOL_VERSION,
                "protocol_min": protocol.MIN_PROTOCOL_VERSION,
                "torch": static.torch_version or None if static else None,
                "python": static.python_version or None if static else None}

    async def init(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from fusiond.net import pki

        if self.cfg.net.insecure_plaintext:
            raise ApiError(409, "plaintext", "this daemon runs with net.insecure_plaintext: "
                           "there is no CA to create; peers join with `fusionctl join ADDR`")
        # checked before anything is created (token() checks them again)
        body_number(body, "ttl_s", pki.DEFAULT_TOKEN_TTL_S, lo=0.0, hi=MAX_TOKEN_TTL_S,
                    lo_open=True, unit="seconds")
        body_bool(body, "one_time", False)
        if self._tls_material().exists():
            raise ApiError(409, "exists", f"this node is already in cluster "
                           f"{self.cluster_id or '(stopped)'}; run `fusionctl token` for a join "
                           "token, or `fusionctl status`")
        listen = parse_hostport(self.cfg.net.listen)
        self._refuse_unreachable_advertise(
            await asyncio.to_thread(advertise_address, self.cfg, listen), listen)
        await asyncio.to_thread(pki.init_cluster, self.state_dir)
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / LEFT_MARKER).unlink()
        await self._start_peer_services_for_api()
        tok = await self.token({"ttl_s": body.get("ttl_s", pki.DEFAULT_TOKEN_TTL_S),
                                "one_time": body.get("one_time", False)})
        return {"cluster_id": self.cluster_id, "node_id": self.node_id, **tok}

    async def token(self, body: Mapping[str, Any]) -> dict[str, Any]:
        from fusiond.net import pki

        ca = await asyncio.to_thread(pki.load_cluster_ca, self.state_dir)
        if ca is None:
            raise ApiError(409, "no_ca", "this node does not hold the cluster CA key; run "
                           "`fusionctl token` on the node where `fusionctl init` ran")
        if self.address is None:
            raise ApiError(409, "not_running", "peer services are not running here")
        if self.net is not None:
            self._refuse_unreachable_advertise(self.address, tuple(self.net.address))
        ttl = body_number(body, "ttl_s", pki.DEFAULT_TOKEN_TTL_S, lo=0.0, hi=MAX_TOKEN_TTL_S,
                          lo_open=True, unit="seconds")
        one_time = body_bool(body, "one_time", True)
        tok = pki.make_join_token(ca, [self.address], ttl_s=float(ttl), one_time=one_time)
        return {"token": tok, "expires_in_s": ttl, "one_time": one_time,
                "next": f"fusionctl join {tok}"}

    def _refuse_unreachable_advertise(self, advertised: tuple[str, int],
                                      listen: tuple[Any, ...]) -> None:
        """A join token names the address this node advertises. A loopback one while the
        node listens beyond loopback (no default route, a host name resolving to 127.0.0.1)
        works on no other machine: refuse to print it, and say what to set. A node that
        listens on loopback only (a development cluster) gets its loopback token."""
        if is_loopback(str(advertised[0])) and not is_loopback(str(listen[0])):
            raise ApiError(409, "unreachable_address", (
                f"this node would advertise {_fmt_addr(advertised)}, a loopback address (it "
                "found no default route, and its host name resolves to loopback), so a join "
                "token naming it works on no other machine. Set net.advertise to the address "
                "the other machines reach this one at (e.g. 10.0.0.5:7420: "
                "/etc/fusion/fusiond.toml [net] advertise, or FUSION_NET_ADVERTISE), restart "
                "fusiond, and run this again"))

    async def join(self, body: Mapping[str, Any]) -> dict[str, Any]:
        token, address = body.get("token"), body.get("address")
        if isinstance(address, str) and address:
            return await self._join_address(address)
        if not isinstance(token, str) or not token:
            raise ApiError(400, "bad_request", "join needs {\"token\": ...} or "
                           "{\"address\": \"host:port\"}")
        return await self._join_token(token)

    async def _join_address(self, address: str) -> dict[str, Any]:
        try:
            addr = parse_hostport(address, default_port=DEFAULT_PEER_PORT)
        except ValueError as e:
            raise ApiError(400, "bad_request", str(e)) from None
        if not self._has_credentials():
            raise ApiError(409, "needs_token", "joining a TLS cluster needs a join token: run "
                           "`fusionctl token` on a member, then `fusionctl join TOKEN` here")
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / LEFT_MARKER).unlink()
        self._remember_bootstrap([_fmt_addr(addr)])
        if self.cluster is None:
            await self._start_peer_services_for_api()
        else:
            self.cluster.add_bootstrap(addr)
        return {"joined": True, "cluster_id": self.cluster_id, "node_id": self.node_id,
                "bootstrap": _fmt_addr(addr), "next": "fusionctl status"}

    async def _join_token(self, token: str) -> dict[str, Any]:
        from fusiond.net import pki

        try:
            tok = pki.parse_join_token(token)
        except pki.JoinTokenError as e:
            raise ApiError(400, "bad_token", f"{e}; copy the whole token, or make a new one "
                           "with `fusionctl token` on the member that ran `fusionctl init`"
                           ) from None
        addrs = [_fmt_addr(a) for a in tok.addresses]
        material = self._tls_material()
        if material.exists():
            mine = pki.cert_fingerprint(pki.load_cert(material.ca_cert))
            if mine != tok.ca_fingerprint:
                raise ApiError(409, "other_cluster", f"this node is already in cluster "
                               f"{material.cluster_id()}, and the token is for another cluster; "
                               "`fusionctl leave` first, and use a fresh state directory")
            already = self.cluster is not None
        else:
            from fusiond.net import join_cluster

            try:
                result = await join_cluster(token, self.state_dir,
                                            timeout_s=self.cfg.net.handshake_timeout_s * 2,
                                            hostname=self.cfg.name or socket.gethostname())
            except FusionError as e:
                raise ApiError(502, "join_failed", f"{e}. Check that the member named in the "
                               f"token ({', '.join(addrs)}) runs and is reachable from here; "
                               "if the token expired or was used, make a new one with "
                               "`fusionctl token` there") from None
            addrs = list(dict.fromkeys([*addrs, *(_fmt_addr(a) for a in result.bootstrap)]))
            already = False
        with contextlib.suppress(FileNotFoundError):
            (self.state_dir / LEFT_MARKER).unlink()
        self._remember_bootstrap(addrs)
        if self.cluster is None:
            await self._start_peer_services_for_api()
        else:
            for a in tok.addresses:
                self.cluster.add_bootstrap(a)
        return {"joined": True, "already_member": already, "cluster_id": self.cluster_id,
                "node_id": self.node_id, "bootstrap": addrs, "next": "fusionctl status"}

    async def leave(self) -> dict[str, Any]:
        if self.cluster is None:
            raise ApiError(409, "not_member", "this node is not in a cluster")
        await self.cluster.leave()
        cid = self.cluster_id
        (self.state_dir / LEFT_MARKER).write_text(f"{cid}\n")
        await self._stop_peer_services()
        self.phase = "left"
        return {"left": True, "cluster_id": cid, "node_id": self.node_id,
                "next": "fusionctl join TOKEN (to join a cluster again)"}

    async def remove(self, node_id: str) -> dict[str, Any]:
        if self.cluster is None:
            raise ApiError(409, "not_member", "this node is not in a cluster")
        if node_id == self.node_id:
            raise ApiError(400, "self", "use `fusionctl leave` to remove this node")
        from fusiond.cluster import NotAuthorizedError

        try:
            await self.cluster.remove(node_id)
        except NotAuthorizedError as e:
            raise ApiError(403, "not_operator", str(e)) from None
        denied = self._deny(node_id)
        self._apply_denied(denied)
        return {"removed": node_id, "denied": sorted(denied), "next": "fusionctl status"}

    def _job_service(self) -> Any:
        if self.jobs is None:
            raise ApiError(409, "not_member", "this node is not in a cluster: jobs need one "
                           "(`fusionctl init`, `fusionctl join TOKEN`, or `fusionctl local up`)")
        return self.jobs

    def upload_dir(self) -> Path:
        """Where the API spools job uploads (in the state dir: owned by the daemon, 0700)."""
        return self.state_dir / "uploads"

    async def submit_job(self, spool: Path, dry_run: bool, caller: Caller) -> dict[str, Any]:
        jobs = self._job_service()
        return dict(await jobs.submit_upload(spool, dry_run=dry_run, owner_uid=caller.uid))

    def list_jobs(self, caller: Caller) -> dict[str, Any]:
        """Every job for the operator; a user sees their own (and how many others there are),
        and the stages this daemon hosts."""
        if self.jobs is None:
            return {"node_id": self.node_id, "jobs": [], "stages": []}
        data = dict(self.jobs.jobs())
        if not caller.operator:
            mine = [j for j in data["jobs"] if j.get("owner_uid") == caller.uid]
            data["hidden"] = len(data["jobs"]) - len(mine)
            data["jobs"] = mine
            data["coordinating"] = []
        return data

    def _known_job(self, job_id: str, caller: Caller) -> Any:
        """The job service, once `caller` may act on `job_id`: its owner (the uid that
        submitted it) and the daemon's operator only; 404 for an unknown job, 403 else."""
        jobs = self._job_service()
        if not jobs.knows(job_id):
            raise ApiError(404, "unknown_job", f"no job {job_id!r} was submitted to this "
                           "daemon (`fusionctl jobs` lists them)")
        owner = jobs.owner(job_id)
        if not caller.operator and (owner is None or caller.uid != owner):
            raise ApiError(403, "forbidden", f"job {job_id} belongs to {user_name(owner)}, "
                           f"not to {caller.describe()}: only its owner and the daemon's "
                           f"operator (root or {user_name(os.geteuid())}) may see it, its "
                           "logs and outputs, or cancel it")
        return jobs

    def job(self, job_id: str, history: int, caller: Caller) -> dict[str, Any]:
        return dict(self._known_job(job_id, caller).job(job_id, history))

    def job_logs(self, job_id: str, caller: Caller) -> dict[str, Any]:
        return dict(self._known_job(job_id, caller).logs(job_id))

    async def cancel_job(self, job_id: str, caller: Caller) -> dict[str, Any]:
        return dict(await self._known_job(job_id, caller).cancel(job_id))

    async def job_outputs(self, job_id: str, caller: Caller, fetch: bool) -> dict[str, Any]:
        jobs = self._known_job(job_id, caller)
        if fetch:
            try:
                return dict(await jobs.fetch(job_id))
            except FusionError as e:
                raise ApiError(409, "not_stored", str(e)) from None
        return dict(jobs.outputs(job_id))

    def job_output_file(self, job_id: str, name: str, caller: Caller) -> tuple[Path, str]:
        got: tuple[Path, str] | None = self._known_job(job_id, caller).output_file(job_id,
                                                                                   name)
        if got is None:
            raise ApiError(404, "no_output", f"job {job_id} has no stored output {name!r} "
                           f"(`fusionctl fetch {job_id}` lists what it has)")
        return got

    async def cluster_jobs(self, caller: Caller) -> dict[str, Any]:
        """`list_jobs`, and under `cluster` the jobs the scheduler coordinates, whoever took
        their submission (for the operator: a job belongs to a user of the machine it was
        submitted on, so only the operator sees other members' jobs)."""
        data = self.list_jobs(caller)
        data["cluster"] = None
        if self.jobs is None:
            data["cluster_note"] = "this node is not in a cluster"
        elif not caller.operator:
            data["cluster_note"] = CLUSTER_JOBS_OPERATOR_ONLY
        else:
            try:
                # short: `fusionctl jobs` and the dashboard wait for it
                leader, answer = await self.jobs.ask_scheduler(timeout_s=LIST_ASK_S)
            except FusionError as e:
                data["cluster_note"] = str(e)
            else:
                data["cluster"] = {"scheduler": leader, "jobs": list(answer.jobs)}
        return data

    async def remote_job(self, job_id: str, history: int, caller: Caller, *,
                         cancel: bool = False) -> dict[str, Any]:
        """A job this daemon does not know, as the scheduler that coordinates it shows it
        (cancelled first with `cancel`): the operator's `fusionctl job/logs/cancel ID` on any
        member."""
        jobs = self._job_service()
        if not caller.operator:
            raise ApiError(404, "unknown_job", f"no job {job_id!r} was submitted to this daemon "
                           f"(`fusionctl jobs` lists yours); {CLUSTER_JOBS_OPERATOR_ONLY}")
        if self.cluster is None:
            raise ApiError(404, "unknown_job", f"no job {job_id!r} was submitted to this daemon "
                           "(`fusionctl jobs` lists them), and this node is not in a cluster: "
                           "there is no scheduler to ask")
        from protocol.messages import MAX_JOBS_ANSWER_HISTORY

        try:
            leader, answer = await jobs.ask_scheduler(
                job_id, min(history, MAX_JOBS_ANSWER_HISTORY), cancel=cancel)
        except FusionError as e:
            raise ApiError(502, "no_scheduler", f"no job {job_id!r} was submitted to this "
                           f"daemon, and the scheduler could not be asked: {e}") from None
        if not answer.known:
            raise ApiError(404, "unknown_job", f"no job {job_id!r} here, nor at the scheduler "
                           f"{leader} (`fusionctl jobs` lists every member's)")
        return {**answer.job, "via_scheduler": leader}

    def dashboard_session(self, caller: Caller) -> dict[str, Any]:
        """A dashboard session for `caller` (it sees what the caller may see: docs/dashboard.md)."""
        if self.dashboard is None:
            raise ApiError(409, "disabled", "this daemon serves no dashboard: set "
                           "dashboard.listen (e.g. 127.0.0.1:7421) and restart it")
        return dict(self.dashboard.session_url(caller))

    async def test_block(self, node_ids: list[str]) -> dict[str, Any]:
        if not self.cfg.net.test_drop_switch or self.net is None:
            raise ApiError(404, "disabled", "the test drop switch is disabled")
        self.net.set_blocked(set(node_ids))  # NET logs the switch loudly
        return {"blocked": sorted(node_ids)}


NET_CONFIG_NOT_CONFIGURABLE = frozenset({"limits", "versions"})
"""NetConfig fields the daemon leaves at their default: the protocol limits and the version
range are the code's, not the operator's (tests narrow `versions` directly)."""


def _net_config(cls: Any, cfg: DaemonConfig) -> Any:
    """The [net] section as NetConfig: same field names (tests keep them in step);
    payload_check auto/on/off becomes None/True/False."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)} - NET_CONFIG_NOT_CONFIGURABLE
    values: dict[str, Any] = dataclasses.asdict(cfg.net)
    values["payload_check"] = {"auto": None, "on": True, "off": False}[cfg.net.payload_check]
    return cls(**{k: v for k, v in values.items() if k in names})


CLUSTER_CONFIG_NOT_CONFIGURABLE = frozenset({"mdns_service"})
"""ClusterConfig fields the daemon leaves at their default (tests assert every other field has
a [cluster] key of the same name, so no knob of the cluster service is out of reach)."""


def _cluster_config(cls: Any, cfg: DaemonConfig, bootstrap: list[str]) -> Any:
    """The [cluster] section as ClusterConfig: same field names; bootstrap as (host, port)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)} - CLUSTER_CONFIG_NOT_CONFIGURABLE
    values: dict[str, Any] = dataclasses.asdict(cfg.cluster)
    values["bootstrap"] = tuple(parse_hostport(b, default_port=DEFAULT_PEER_PORT)
                                for b in bootstrap)
    values["mdns_interfaces"] = tuple(cfg.cluster.mdns_interfaces) or None
    return cls(**{k: v for k, v in values.items() if k in names})


def view_json(view: Any, now: float | None = None) -> dict[str, Any]:
    """A ClusterView as JSON: links keyed (src, dst) become ``{src: {dst: {...}}}`` (JSON has
    no tuple keys), each with ``bandwidth_bits_per_s``, ``rtt_s``, ``bandwidth_spread_ratio``
    (the accuracy of the probe round behind the figure), ``measured_at`` (its Unix time, on
    the measurer's clock) and ``age_s`` (seconds since then by this daemon's clock; null when
    unknown). `now`: this daemon's Unix time (default: the clock's)."""
    import dataclasses

    from fusiond.cluster.membership import Link

    now = time.time() if now is None else now
    out: dict[str, Any] = {f.name: to_jsonable(getattr(view, f.name))
                           for f in dataclasses.fields(view) if f.name != "links"}
    links: dict[str, dict[str, dict[str, float | None]]] = {}
    for (src, dst), raw in dict(getattr(view, "links", {}) or {}).items():
        lk = Link(*raw)
        at = float(lk.measured_at)
        links.setdefault(str(src), {})[str(dst)] = {
            "bandwidth_bits_per_s": float(lk.bandwidth_bits_per_s),
            "rtt_s": float(lk.rtt_s),
            "bandwidth_spread_ratio": float(lk.bandwidth_spread_ratio),
            "measured_at": at if at > 0 else None,
            "age_s": round(max(0.0, now - at), 3) if at > 0 else None,
        }
    out["links"] = links
    return out


def _fmt_addr(addr: tuple[str, int] | tuple[Any, ...] | None) -> str:
    if not addr:
        return "-"
    host, port = str(addr[0]), int(addr[1])
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _describe(e: BaseException) -> str:
    """The cause chain of an error (or group) in one line."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(_describe(x) for x in e.exceptions)
    parts = [f"{type(e).__name__}: {e}" if str(e) else type(e).__name__]
    cause = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    seen = 0
    while cause is not None and seen < 4:
        parts.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__
        seen += 1
    return " ".join(parts)
