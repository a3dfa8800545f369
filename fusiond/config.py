"""fusiond configuration: dataclass defaults < TOML file < ``FUSION_*`` environment < flags.

Every key has one name in each layer, derived mechanically so that none can drift:

- ``state_dir``: top-level ``state_dir = ...``, ``FUSION_STATE_DIR``, ``--state-dir``
- ``net.listen``: ``[net] listen = ...``, ``FUSION_NET_LISTEN``, ``--net-listen``

Booleans take ``true/false/1/0/yes/no/on/off`` in the environment and ``--x`` / ``--no-x`` as
flags; lists are comma separated in the environment and repeatable (or comma separated) as flags.
A bad value raises `ConfigError` naming the key, the value and where it came from (``file:line``,
the environment variable, or the flag). `load_config` returns the config plus the origin of each
value, which ``fusiond --check-config`` prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import socket
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from fusiond.defaults import DEFAULT_PEER_PORT as DEFAULT_PEER_PORT
from fusiond.defaults import ClusterSection as ClusterSection
from fusiond.defaults import NetSection as NetSection
from fusiond.errors import ConfigError
from fusiond.opsets import OP_NAME_RE

DEFAULT_CONFIG_PATH = Path("/etc/fusion/fusiond.toml")
ENV_PREFIX = "FUSION_"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "text", "journal", "json")
LOOPS = ("auto", "asyncio", "uvloop")


@dataclass
class ApiSection:
    """The local API that fusionctl talks to."""

    socket: str = "/run/fusion/fusiond.sock"
    """Unix socket path (file permissions are the access control). Empty: use `tcp`."""
    tcp: str = ""
    """Loopback host:port instead of (or besides) the socket; requests need the token."""
    token_file: str = ""
    """Where the TCP token is written; empty: <state_dir>/api.token."""
    max_upload_bytes: int = 4 << 30
    """Largest job upload (IR + weights + shipped data) `fusionctl submit` may send."""


@dataclass
class MetricsSection:
    """Prometheus exposition."""

    listen: str = "127.0.0.1:9464"
    """Loopback host:port for /metrics; empty disables metrics."""


@dataclass
class DashboardSection:
    """The browser dashboard (docs/dashboard.md): the cluster, its links and its jobs, live."""

    listen: str = "127.0.0.1:7421"
    """Loopback host:port for the dashboard; empty disables it. A browser gets in only with a
    session from `fusionctl dashboard` (which asks over the API socket, so the session sees
    what its user may see)."""
    session_ttl_s: float = 43200.0
    """How long a dashboard session from `fusionctl dashboard` lasts."""


@dataclass
class JobsSection:
    """The stages this daemon hosts (fusiond.jobs)."""

    disabled_ops: list[str] = field(default_factory=list)
    """IR op names this daemon refuses to run (e.g. ["aten.gelu.default"]: an op broken on
    this machine): the scheduler plans no stage using one here, and an Assign using one is
    refused naming it."""
    stage_recv_timeout_s: float = 120.0
    """The longest a stage hosted here waits for an input tensor before its step fails (the
    floor: a planned job's Assign asks for 10x its predicted iteration when that is longer).
    A tensor lost on the way (a link that broke, a peer frozen or cut off) stalls the job this
    long before its scheduler restarts it from the last checkpoint."""


@dataclass
class DaemonConfig:
    """The whole configuration of one fusiond. Sections are TOML tables of the same name."""

    state_dir: str = "/var/lib/fusion"
    """Node key, certificates, cluster membership: survives restarts."""
    cache_dir: str = "/var/cache/fusion"
    """The profile benchmark result and other things safe to delete."""
    name: str = ""
    """Human name shown in status; empty: the host name."""
    log_level: str = "info"
    """debug, info, warning or error. SIGHUP applies a change without a restart."""
    log_format: str = "auto"
    """How stderr lines look: text (time, level, logger, message), journal (a syslog priority
    prefix and no time: `journalctl -p warning` works), json (one object per line), or auto
    (journal when stderr is the journal, else text)."""
    loop: str = "auto"
    """Event loop: auto (uvloop where available), asyncio or uvloop."""
    profile_benchmark: bool = True
    """Probe the device (CUDA or CPU) and time a short matmul (cached in cache_dir); off:
    report the CPU without importing torch (fast start: tests)."""
    gpus: str = "all"
    """The CUDA devices this daemon owns and offers: all, none, or their indices ("0,1"). A
    server with several GPUs may run one daemon per GPU (each with its own gpus, state_dir
    and port): the planner then sees each GPU as a machine of its own, joined to the others
    by the loopback link the daemons measure."""
    start_timeout_s: float = 60.0
    """Each service must be ready within this long, or the daemon stops non-zero."""
    stop_timeout_s: float = 10.0
    """Each service must close within this long on shutdown."""
    job_memory_gib: float = 0.0
    """GiB of memory this node offers to jobs (gossiped in its profile); 0: its free memory."""
    net: NetSection = field(default_factory=NetSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    api: ApiSection = field(default_factory=ApiSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    dashboard: DashboardSection = field(default_factory=DashboardSection)
    jobs: JobsSection = field(default_factory=JobsSection)

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def token_path(self) -> Path:
        return Path(self.api.token_file) if self.api.token_file else self.state_path / "api.token"


SECTIONS: dict[str, type[Any]] = {
    "net": NetSection,
    "cluster": ClusterSection,
    "api": ApiSection,
    "metrics": MetricsSection,
    "dashboard": DashboardSection,
    "jobs": JobsSection,
}


@dataclass(frozen=True)
class Key:
    """One configurable key: its dotted name and the names of its twins."""

    path: str  # "net.listen" or "state_dir"
    section: str | None
    name: str
    type: Any

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.path.replace(".", "_").upper()

    @property
    def flag(self) -> str:
        return "--" + self.path.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        return "cfg__" + self.path.replace(".", "__")


def keys() -> list[Key]:
    """Every configurable key, top level first."""
    out: list[Key] = []
    top_hints = get_type_hints(DaemonConfig)
    for f in dataclasses.fields(DaemonConfig):
        if f.name in SECTIONS:
            continue
        out.append(Key(f.name, None, f.name, top_hints[f.name]))
    for sname, scls in SECTIONS.items():
        hints = get_type_hints(scls)
        for f in dataclasses.fields(scls):
            out.append(Key(f"{sname}.{f.name}", sname, f.name, hints[f.name]))
    return out


def _key_doc(k: Key) -> str:
    """The attribute docstring of a key, for --help (parsed from this module's source)."""
    return _DOCS.get(k.path, "")


def _parse_docs() -> dict[str, str]:
    """Attribute docstrings of the config dataclasses, whitespace-joined, from this source."""
    try:  # the [net] and [cluster] sections live in fusiond/defaults.py (see there)
        src = Path(__file__).read_text() + "\n" + (Path(__file__).parent / "defaults.py"
                                                   ).read_text()
    except OSError:  # frozen/zip installs: help text is a nicety
        return {}
    docs: dict[str, str] = {}
    classes = {"DaemonConfig": None, **{c.__name__: s for s, c in SECTIONS.items()}}
    for m in re.finditer(r"^class (\w+)\b.*?(?=^class |^SECTIONS|\Z)", src, re.M | re.S):
        if m.group(1) not in classes:
            continue
        section = classes[m.group(1)]
        for a in re.finditer(r'^    (\w+): [^\n=]+=[^\n]*\n    """(.*?)"""', m.group(0),
                             re.M | re.S):
            name = a.group(1) if section is None else f"{section}.{a.group(1)}"
            docs[name] = " ".join(a.group(2).split())
    return docs


_DOCS = _parse_docs()


# ---------------------------------------------------------------------------------------------
# Conversion and validation


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_string(k: Key, raw: str, where: str) -> Any:
    """Convert an environment/flag string to the key's type."""
    t = k.type
    try:
        if t is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError("expected true or false")
        if t is int:
            return int(raw)
        if t is float:
            return float(raw)
        if t == list[str]:
            return [p.strip() for p in raw.split(",") if p.strip()]
        return raw
    except ValueError as e:
        raise ConfigError(f"{k.path} = {raw!r} from {where}: {e}") from None


def _from_toml(k: Key, value: Any, where: str) -> Any:
    """Check a TOML value's type against the key's type (ints are accepted for floats)."""
    t = k.type
    ok: bool
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t == list[str]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, str)
    if not ok:
        tname = "list of strings" if t == list[str] else getattr(t, "__name__", str(t))
        raise ConfigError(
            f"{k.path} = {value!r} from {where}: expected {tname}, got {type(value).__name__}"
        )
    return value


def parse_hostport(value: str, *, what: str = "address", default_port: int | None = None
                   ) -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` too). Raises ValueError with a plain message."""
    v = value.strip()
    if not v:
        raise ValueError(f"empty {what}")
    m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", v)
    if m:
        host, port_s = m.group(1), m.group(2)
    elif v.count(":") == 1:
        host, port_s = v.split(":")
    elif ":" not in v:
        host, port_s = v, None
    else:
        raise ValueError(f"{what} {value!r} is not host:port (write IPv6 as [addr]:port)")
    if port_s is None:
        if default_port is None:
            raise ValueError(f"{what} {value!r} has no port (expected host:port)")
        port = default_port
    else:
        port = int(port_s)
    if not host:
        raise ValueError(f"{what} {value!r} has no host")
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} out of range 0-65535")
    return host, port


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def gpu_indices(gpus: str) -> frozenset[int] | str | None:
    """`gpus` as the CUDA device indices it names: None for all, an empty set for none,
    "bad" where it is neither."""
    text = gpus.strip().lower()
    if text == "all":
        return None
    if text in ("none", ""):
        return frozenset()
    try:
        out = frozenset(int(x) for x in text.split(","))
    except ValueError:
        return "bad"
    return out if all(0 <= i < 100 for i in out) else "bad"


def _validate(cfg: DaemonConfig, origin: Mapping[str, str]) -> None:
    """Raise ConfigError for the first invalid value, naming key, value and origin."""

    def bad(path: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{path} = {value!r} from {origin.get(path, 'default')}: {why}")

    for k in keys():
        v = get(cfg, k.path)
        if k.type is float and k.name.endswith("_s") and not v > 0:
            raise bad(k.path, v, "must be a positive rate" if k.name.endswith("_per_s")
                      else "must be a positive number of seconds")
        if k.type is int and v <= 0:
            raise bad(k.path, v, "must be a positive integer")
    if not 0 <= cfg.net.backoff_jitter < 1:
        raise bad("net.backoff_jitter", cfg.net.backoff_jitter, "must be in [0, 1)")
    if cfg.net.payload_check not in ("auto", "on", "off"):
        raise bad("net.payload_check", cfg.net.payload_check, "must be auto, on or off")
    if cfg.log_format not in LOG_FORMATS:
        raise bad("log_format", cfg.log_format, f"must be one of {', '.join(LOG_FORMATS)}")
    if cfg.log_level not in LOG_LEVELS:
        raise bad("log_level", cfg.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
    if cfg.loop not in LOOPS:
        raise bad("loop", cfg.loop, f"must be one of {', '.join(LOOPS)}")
    if gpu_indices(cfg.gpus) == "bad":
        raise bad("gpus", cfg.gpus, "must be all, none, or CUDA device indices like 0,1")
    if not cfg.state_dir:
        raise bad("state_dir", cfg.state_dir, "must not be empty")
    for path in ("net.listen", "net.advertise", "api.tcp", "metrics.listen", "dashboard.listen"):
        v = get(cfg, path)
        if path != "net.listen" and not v:
            continue
        try:
            host, port = parse_hostport(v)
        except ValueError as e:
            raise bad(path, v, str(e)) from None
        if path in ("api.tcp", "metrics.listen", "dashboard.listen") and not is_loopback(host):
            raise bad(path, v, "must be a loopback address (127.0.0.1, ::1 or localhost)")
        if path == "net.advertise" and (port == 0 or host in ("0.0.0.0", "::")):
            raise bad(path, v, "must be a concrete host and port that peers can dial")
    if cfg.net.insecure_plaintext and not cfg.net.allow_plaintext_remote:
        host, _ = parse_hostport(cfg.net.listen)
        if not is_loopback(host):
            raise bad("net.listen", cfg.net.listen,
                      "net.insecure_plaintext only listens on loopback (set net.listen to "
                      "127.0.0.1:PORT, or use TLS: fusionctl init / join)")
    for i, b in enumerate(cfg.cluster.bootstrap):
        try:
            parse_hostport(b, default_port=DEFAULT_PEER_PORT)
        except ValueError as e:
            raise bad("cluster.bootstrap", b, f"entry {i}: {e}") from None
    if not cfg.api.socket and not cfg.api.tcp:
        raise bad("api.socket", cfg.api.socket, "api.socket and api.tcp are both empty")
    c = cfg.cluster
    for low, high in (("suspect_after_s", "dead_after_s"),
                      ("leader_heartbeat_s", "leader_lease_s"),
                      ("leader_lease_s", "election_timeout_s")):
        if not get(cfg, f"cluster.{low}") < get(cfg, f"cluster.{high}"):
            raise bad(f"cluster.{high}", get(cfg, f"cluster.{high}"),
                      f"must be larger than cluster.{low} ({get(cfg, f'cluster.{low}')})")
    if not 0 < c.bandwidth_ewma <= 1:
        raise bad("cluster.bandwidth_ewma", c.bandwidth_ewma, "must be in (0, 1]")
    if c.probe_min_bytes > c.probe_max_bytes:
        raise bad("cluster.probe_max_bytes", c.probe_max_bytes,
                  "must be at least cluster.probe_min_bytes")
    if not cfg.net.member_handshake_reserve < cfg.net.max_pending_handshakes:
        raise bad("net.member_handshake_reserve", cfg.net.member_handshake_reserve,
                  f"must be below net.max_pending_handshakes ({cfg.net.max_pending_handshakes})")
    if not cfg.net.frame_deadline_factor > 0:
        raise bad("net.frame_deadline_factor", cfg.net.frame_deadline_factor, "must be positive")
    for op in cfg.jobs.disabled_ops:
        if not OP_NAME_RE.fullmatch(op):
            raise bad("jobs.disabled_ops", op, "not an IR op name like 'aten.gelu.default' "
                      "(`aten.<name>.<overload>` or `sym.<op>`, as docs/ir.md names them)")
    if not 1.0 <= cfg.jobs.stage_recv_timeout_s <= 86_400.0:
        raise bad("jobs.stage_recv_timeout_s", cfg.jobs.stage_recv_timeout_s,
                  "must be between 1 and 86400 seconds (the bounds of an Assign's own)")
    if cfg.net.backoff_max_s < cfg.net.backoff_initial_s:
        raise bad("net.backoff_max_s", cfg.net.backoff_max_s,
                  "must be at least net.backoff_initial_s")


# ---------------------------------------------------------------------------------------------
# Access by dotted path


def get(cfg: DaemonConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(cfg: DaemonConfig, path: str, value: Any) -> None:
    parts = path.split(".")
    obj: Any = cfg
    for part in parts[:-1]:
        obj = getattr(obj, part)
    setattr(obj, parts[-1], value)


# ---------------------------------------------------------------------------------------------
# Layers


def _toml_lines(text: str) -> dict[str, int]:
    """Best-effort line number of each ``key =`` per table, for error messages."""
    lines: dict[str, int] = {}
    section: str | None = None
    for no, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        m = re.fullmatch(r"\[\s*([A-Za-z0-9_.-]+)\s*\](\s*#.*)?", s)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"([A-Za-z0-9_-]+)\s*=", s)
        if m:
            path = m.group(1) if section is None else f"{section}.{m.group(1)}"
            lines.setdefault(path, no)
    return lines


def _apply_file(cfg: DaemonConfig, origin: dict[str, str], path: Path) -> None:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    lines = _toml_lines(text)
    by_path = {k.path: k for k in keys()}

    def where(p: str) -> str:
        return f"{path}:{lines[p]}" if p in lines else str(path)

    for name, value in data.items():
        if name in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{where(name)}: [{name}] must be a table")
            items = [(f"{name}.{k}", v) for k, v in value.items()]
        else:
            items = [(name, value)]
        for p, v in items:
            k = by_path.get(p)
            if k is None:
                raise ConfigError(f"{where(p)}: unknown key {p!r}")
            _set(cfg, p, _from_toml(k, v, where(p)))
            origin[p] = where(p)


def _apply_env(cfg: DaemonConfig, origin: dict[str, str], env: Mapping[str, str]) -> list[str]:
    """Apply FUSION_* variables; returns warnings for unknown ones (typos should be visible)."""
    known = {k.env: k for k in keys()}
    extra = {ENV_PREFIX + "CONFIG", ENV_PREFIX + "CHECK_CONFIG"}
    warnings: list[str] = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX):
            continue
        k = known.get(var)
        if k is None:
            if var not in extra:
                warnings.append(f"ignoring unknown environment variable {var}")
            continue
        where = f"environment {var}"
        _set(cfg, k.path, _from_string(k, env[var], where))
        origin[k.path] = where
    return warnings


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per key (``--net-listen``, ``--no-cluster-mdns`` ...) to `parser`."""
    group = parser.add_argument_group(
        "configuration", "each flag overrides FUSION_<KEY> from the environment, which "
        "overrides the config file")
    for k in keys():
        doc = _key_doc(k)
        helptext = f"{doc} [env {k.env}]" if doc else f"[env {k.env}]"
        if k.type is bool:
            group.add_argument(k.flag, dest=k.dest, action=argparse.BooleanOptionalAction,
                               default=None, help=helptext)
        elif k.type == list[str]:
            group.add_argument(k.flag, dest=k.dest, action="append", default=None,
                               metavar="VALUE", help=helptext + " (repeatable)")
        else:
            group.add_argument(k.flag, dest=k.dest, default=None, metavar="VALUE",
                               help=helptext)


def _apply_flags(cfg: DaemonConfig, origin: dict[str, str], ns: argparse.Namespace) -> None:
    for k in keys():
        v = getattr(ns, k.dest, None)
        if v is None:
            continue
        where = f"flag {k.flag}"
        if k.type is bool:
            val: Any = bool(v)
        elif k.type == list[str]:
            val = [p.strip() for item in v for p in str(item).split(",") if p.strip()]
        else:
            val = _from_string(k, str(v), where)
        _set(cfg, k.path, val)
        origin[k.path] = where


@dataclass
class LoadedConfig:
    """A validated config, where each non-default value came from, and warnings."""

    config: DaemonConfig
    origin: dict[str, str]
    file: Path | None
    warnings: list[str]


def load_config(
    *,
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    flags: argparse.Namespace | None = None,
) -> LoadedConfig:
    """Build the config from all layers and validate it.

    `path` None: FUSION_CONFIG from `env`, else /etc/fusion/fusiond.toml if it exists. An
    explicitly named file that does not exist is an error; the default one is optional.
    Raises ConfigError naming the key, value and origin of the first bad value.
    """
    env = dict(os.environ) if env is None else dict(env)
    cfg = DaemonConfig()
    origin: dict[str, str] = {}
    file: Path | None
    if path is not None:
        file = Path(path)
    elif env.get(ENV_PREFIX + "CONFIG"):
        file = Path(env[ENV_PREFIX + "CONFIG"])
    else:
        file = DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None
    if file is not None:
        _apply_file(cfg, origin, file)
    warnings = _apply_env(cfg, origin, env)
    if flags is not None:
        _apply_flags(cfg, origin, flags)
    _validate(cfg, origin)
    return LoadedConfig(cfg, origin, file, warnings)


def describe(loaded: LoadedConfig) -> str:
    """Every key with its value and origin, one line each (for --check-config)."""
    out = [f"config file: {loaded.file if loaded.file else '(none)'}"]
    for k in keys():
        out.append(f"{k.path} = {get(loaded.config, k.path)!r}  "
                   f"# {loaded.origin.get(k.path, 'default')}")
    return "\n".join(out)


def advertise_address(cfg: DaemonConfig, bound: tuple[str, int]) -> tuple[str, int]:
    """The address peers should dial: net.advertise, else the bound address with a real host.

    For a wildcard listen address the host is the source address of the default route (a UDP
    socket "connected" to a documentation address: a routing-table lookup, nothing is sent),
    else the host name's address. A loopback result is returned as is; the daemon warns that
    remote peers cannot dial it and that net.advertise should be set.
    """
    if cfg.net.advertise:
        return parse_hostport(cfg.net.advertise)
    host, port = bound
    if host not in ("0.0.0.0", "::", ""):
        return host, port
    v6 = host == "::"
    try:
        with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("2001:db8::1" if v6 else "192.0.2.1", 9))
            return str(s.getsockname()[0]), port
    except OSError:
        pass  # no default route: fall back to the host name
    try:
        return socket.gethostbyname(socket.gethostname()), port
    except OSError:
        return "127.0.0.1", port


def config_keys_table() -> Sequence[tuple[str, str, str, str]]:
    """(key, env, flag, default) rows, for docs and tests."""
    d = DaemonConfig()
    return [(k.path, k.env, k.flag, repr(get(d, k.path))) for k in keys()]


def toml_value(v: Any) -> str:
    """One value in TOML syntax (str, int, float, bool, lists of those)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def example_body() -> str:
    """Every key, commented out at its default under its docstring: the body of
    deploy/fusiond.toml (regenerate: python -c 'from fusiond.config import example_body as
    e; print(e(), end="")' and keep the file's header)."""
    import textwrap

    d = DaemonConfig()
    out: list[str] = []
    section: str | None = "-"
    for k in keys():
        if k.section != section:
            section = k.section
            if section:
                out += ["", f"[{section}]"]
        out.append("")
        out += [f"# {line}" for line in textwrap.wrap(_DOCS.get(k.path, ""), 94)]
        out.append(f"# {k.name} = {toml_value(get(d, k.path))}")
    return "\n".join(out) + "\n"


def keys_markdown() -> str:
    """The key table of docs/daemon.md."""
    rows = ["| key | environment | flag | default |", "|---|---|---|---|"]
    rows += [f"| `{k}` | `{e}` | `{f}` | `{d}` |" for k, e, f, d in config_keys_table()]
    return "\n".join(rows) + "\n"
