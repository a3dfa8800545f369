"""A development cluster on one machine: N fusiond processes on loopback (`fusionctl local`).

Each node gets its own directory ``<dir>/nodeK`` holding its config file, state, API socket and
log. By default the nodes share a local cluster CA (node0 holds its key, so ``fusionctl token``
works against node0) and talk mutual TLS; ``insecure=True`` uses plaintext links instead.
Discovery is mDNS bound to 127.0.0.1, or node0's address as the only bootstrap address.
`up` returns once every node reports the same members alive, the same scheduler and the same
term. The multi-daemon tests use the same building blocks (`LocalNode`, `agreement`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusiond.config import toml_value
from fusiond.errors import LocalError

STATE_FILE = "local.json"

DEV_SETTINGS: dict[str, Any] = {
    "profile_benchmark": False,
    "log_level": "info",
    "start_timeout_s": 30.0,
    "stop_timeout_s": 5.0,
    "net": {"listen": "127.0.0.1:0", "connect_timeout_s": 2.0, "handshake_timeout_s": 2.0,
            "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
    "metrics": {"listen": "127.0.0.1:0"},
    "dashboard": {"listen": "127.0.0.1:0"},
    "cluster": {"mdns": True, "mdns_interfaces": ["127.0.0.1"], "gossip_interval_s": 0.3,
                "suspect_after_s": 1.5, "dead_after_s": 3.0, "election_timeout_s": 1.0,
                "leader_heartbeat_s": 0.2, "leader_lease_s": 0.8, "election_stagger_s": 0.3,
                "election_jitter_s": 0.1, "election_grace_s": 1.0,
                "probe_interval_s": 10.0, "probe_target_s": 0.05, "probe_repeats": 1,
                "probe_max_bytes": 4 << 20, "bootstrap_retry_s": 0.5},
}
"""Short timers so a local cluster converges in seconds; everything else is the default."""


class LocalClusterError(LocalError):
    """The local cluster could not be started or inspected; the message says why."""


class LocalTimeout(LocalClusterError):
    """The daemons did not agree within the wait; they are left running for inspection."""


def default_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return str(Path(base) / f"fusion-local-{os.getuid()}")


# -- config files -------------------------------------------------------------------------------


def to_toml(settings: Mapping[str, Any]) -> str:
    """Write a two-level settings dict (top-level keys and [section] tables) as TOML."""
    top = [f"{k} = {toml_value(v)}" for k, v in settings.items() if not isinstance(v, Mapping)]
    out = ["# written by fusionctl.local", *top]
    for k, v in settings.items():
        if isinstance(v, Mapping):
            out.append(f"\n[{k}]")
            out.extend(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
    return "\n".join(out) + "\n"


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Two-level merge of settings dicts (sections merged key by key)."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k].update(v)
        else:
            out[k] = dict(v) if isinstance(v, Mapping) else v
    return out


# -- one node -----------------------------------------------------------------------------------


@dataclass
class LocalNode:
    """One fusiond process with its own directory; `start()` spawns it, `stop()` ends it."""

    index: int
    root: Path
    settings: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    python: str = ""
    """The Python that runs this daemon (another virtual environment: another torch);
    empty: this process's."""

    @property
    def dir(self) -> Path:
        return self.root / f"node{self.index}"

    @property
    def socket(self) -> str:
        return str(self.dir / "fusiond.sock")

    @property
    def config_path(self) -> Path:
        return self.dir / "fusiond.toml"

    @property
    def log_path(self) -> Path:
        return self.dir / "fusiond.log"

    @property
    def state_dir(self) -> Path:
        return self.dir / "state"

    def write_config(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        s = merge(self.settings, {
            "state_dir": str(self.state_dir),
            "cache_dir": str(self.root / "cache"),
            "name": f"node{self.index}",
            "api": {"socket": self.socket},
        })
        self.config_path.write_text(to_toml(s))

    def start(self, extra_env: Mapping[str, str] | None = None) -> None:
        """Spawn the daemon (its own session, so a terminal's ^C does not reach it)."""
        self.write_config()
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("FUSION_") and k != "NOTIFY_SOCKET"}
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra_env or {})
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self.proc = subprocess.Popen(
                [self.python or sys.executable, "-m", "fusiond", "--config",
                 str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True)
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, as far as the cluster can tell."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def api(self, method: str, path: str, body: dict[str, Any] | None = None,
            timeout: float = 5.0) -> dict[str, Any]:
        from fusionctl.client import Client, Endpoint

        return Client(Endpoint(socket_path=self.socket), timeout=timeout).request(
            method, path, body)

    def status(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """The daemon's /v1/status, or None when it does not answer."""
        from fusionctl.client import ClientError

        try:
            return self.api("GET", "/v1/status", timeout=timeout)
        except ClientError:
            return None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


# -- agreement ----------------------------------------------------------------------------------


def summary(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """The parts of a status the nodes must agree on."""
    if status is None:
        return {"up": False}
    view = status.get("cluster") or {}
    members = view.get("members", [])
    return {
        "up": True,
        "node_id": status.get("node", {}).get("node_id"),
        "alive": sorted(m["node_id"] for m in members if m.get("state") == "alive"),
        "leader": view.get("leader"),
        "term": view.get("term"),
        "quorum": bool(view.get("has_quorum")),
    }


def agreement(statuses: Sequence[Mapping[str, Any] | None], expect: int) -> tuple[bool, str]:
    """True when all nodes answer, see the same `expect` members alive, the same leader and
    the same term, with quorum; else False and what is still missing."""
    s = [summary(x) for x in statuses]
    down = [i for i, x in enumerate(s) if not x["up"]]
    if down:
        return False, f"node(s) {down} not answering"
    ids = sorted(x["node_id"] for x in s)
    for i, x in enumerate(s):
        if len(x["alive"]) != expect:
            return False, f"node{i} sees {len(x['alive'])} of {expect} members alive"
        if x["alive"] != ids:
            return False, f"node{i} sees other members"
    leaders = {x["leader"] for x in s}
    terms = {x["term"] for x in s}
    if None in leaders:
        return False, "no scheduler elected yet"
    if len(leaders) != 1 or len(terms) != 1:
        return False, f"scheduler not agreed yet ({len(leaders)} leaders, terms {sorted(terms)})"
    if not all(x["quorum"] for x in s):
        return False, "quorum not reached"
    return True, f"scheduler {s[0]['leader']} term {s[0]['term']}"


def wait_until(check: Callable[[], tuple[bool, str]], timeout: float, interval: float = 0.2
               ) -> tuple[bool, str, float]:
    """Poll `check` until it returns True or `timeout` passes; returns (ok, last reason, s)."""
    t0 = time.monotonic()
    ok, why = False, "not checked"
    while True:
        ok, why = check()
        elapsed = time.monotonic() - t0
        if ok or elapsed >= timeout:
            return ok, why, elapsed
        time.sleep(interval)


# -- credentials --------------------------------------------------------------------------------


def make_credentials(nodes: Sequence[LocalNode]) -> str:
    """A local cluster CA (key kept by node 0) and a certificate per node; returns cluster id.

    Written in the daemon's on-disk format (fusiond.net.pki) before the daemons start: the one
    place fusionctl touches a daemon room, named in tests/test_layers.py."""
    import fusiond.net.pki as pki

    ca, _, _ = pki.init_cluster(nodes[0].state_dir)
    for n in nodes[1:]:
        ident = pki.load_or_create_node_identity(n.state_dir)
        cert = pki.issue_node_certificate(ca, ident.key.public_key())
        pki.store_node_credentials(n.state_dir, cert, ca.cert)
    return ca.cluster_id


# -- up / down ----------------------------------------------------------------------------------


def _load_state(root: Path) -> dict[str, Any]:
    try:
        data = json.loads((root / STATE_FILE).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def up(n: int, directory: str | os.PathLike[str], *, insecure: bool = False,
       discovery: str = "mdns", wait_s: float = 60.0,
       settings: Mapping[str, Any] | None = None,
       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start `n` daemons under `directory` and wait until they agree; returns `describe()`.

    Raises LocalClusterError if a local cluster already runs there, LocalTimeout when the
    daemons do not agree within `wait_s` (they keep running; `down` stops them).
    """
    if n < 1:
        raise LocalClusterError("-n must be at least 1")
    root = Path(directory)
    old = _load_state(root)
    if any(_pid_alive(int(p)) for p in old.get("pids", [])):
        raise LocalClusterError(f"a local cluster already runs in {root}; run "
                                "`fusionctl local down` first")
    root.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda s: None)
    base = merge(DEV_SETTINGS, settings or {})
    if insecure:
        base = merge(base, {"net": {"insecure_plaintext": True}})
    if discovery == "bootstrap":
        base = merge(base, {"cluster": {"mdns": False}})
    nodes = [LocalNode(i, root, dict(base)) for i in range(n)]
    for node in nodes:
        if node.dir.exists():
            import shutil

            shutil.rmtree(node.dir)  # a previous run's state: a dev cluster starts fresh
    if not insecure:
        say("creating a local cluster CA and node certificates")
        make_credentials(nodes)
    say(f"starting {n} daemon(s) in {root}")
    nodes[0].start()
    _save(root, nodes, insecure)
    if discovery == "bootstrap":
        ok, why, _ = wait_until(lambda: (_address(nodes[0]) is not None, "node0 starting"),
                                wait_s)
        if not ok:
            raise LocalTimeout(f"node0 did not start: see {nodes[0].log_path}")
        addr = _address(nodes[0])
        for node in nodes[1:]:
            node.settings = merge(node.settings, {"cluster": {"bootstrap": [addr]}})
    for node in nodes[1:]:
        node.start()
    _save(root, nodes, insecure)
    say("waiting for the daemons to agree on members and a scheduler")

    def check() -> tuple[bool, str]:
        for x in nodes:  # fail fast, with the cause, when a daemon exits
            if not x.alive():
                tail = "\n".join(x.log_text().splitlines()[-5:])
                raise LocalClusterError(f"node{x.index} exited with code "
                                        f"{x.proc.returncode if x.proc else '?'}; the end of "
                                        f"{x.log_path}:\n{tail}\n(`fusionctl local down` "
                                        "stops the others)")
        return agreement([x.status(2.0) for x in nodes], n)

    ok, why, took = wait_until(check, wait_s, 0.3)
    if not ok:
        dead = [x.index for x in nodes if not x.alive()]
        extra = f"; node(s) {dead} exited (see their fusiond.log)" if dead else ""
        raise LocalTimeout(f"no agreement after {wait_s:g} s: {why}{extra}. The daemons "
                           f"keep running for inspection (logs in {root}/node*/fusiond.log); "
                           "`fusionctl local down` stops them")
    say(f"agreed in {took:.1f} s: {why}")
    return describe(root)


def _address(node: LocalNode) -> str | None:
    st = node.status(1.0)
    addr = st.get("node", {}).get("address") if st else None
    return addr if isinstance(addr, str) and addr != "-" else None


def _save(root: Path, nodes: Sequence[LocalNode], insecure: bool) -> None:
    data = {"pids": [x.pid for x in nodes if x.pid is not None],
            "nodes": [{"index": x.index, "pid": x.pid, "socket": x.socket,
                       "config": str(x.config_path), "log": str(x.log_path)} for x in nodes],
            "insecure": insecure}
    (root / STATE_FILE).write_text(json.dumps(data, indent=2))


def describe(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """What runs in `directory`: each node's pid, liveness, socket, node id, address."""
    root = Path(directory)
    data = _load_state(root)
    nodes = []
    for nd in data.get("nodes", []):
        pid = nd.get("pid")
        running = isinstance(pid, int) and _pid_alive(pid)
        node = LocalNode(int(nd["index"]), root)
        st = node.status(2.0) if running else None
        nodes.append({**nd, "running": running, **({k: v for k, v in summary(st).items()
                                                    if k in ("node_id", "leader", "term")})})
    return {"dir": str(root), "insecure": data.get("insecure"), "nodes": nodes}


def howto(info: Mapping[str, Any]) -> str:
    """Human instructions for talking to a local cluster."""
    nodes = info.get("nodes", [])
    lines = [f"local cluster in {info.get('dir')}: {len(nodes)} daemon(s)"]
    for nd in nodes:
        state = "running" if nd.get("running") else "stopped"
        lines.append(f"  node{nd['index']}  pid {nd.get('pid')}  {state}  "
                     f"{nd.get('node_id') or ''}  socket {nd['socket']}")
    here = "" if info.get("dir") == default_dir() else f" --dir {info.get('dir')}"
    if nodes:
        lines += ["", "talk to node0:",
                  f"  fusionctl --socket {nodes[0]['socket']} status",
                  f"  export FUSION_API_SOCKET={nodes[0]['socket']}   # then plain `fusionctl "
                  "status`, `fusionctl links`",
                  "stop them:", f"  fusionctl local down{here}"]
    return "\n".join(lines)


def down(directory: str | os.PathLike[str], *, keep: bool = False,
         progress: Callable[[str], None] | None = None, timeout: float = 10.0) -> int:
    """SIGTERM every daemon `up` started there (SIGKILL after `timeout`); returns how many."""
    root = Path(directory)
    data = _load_state(root)
    pids = [int(p) for p in data.get("pids", []) if _pid_alive(int(p))]
    for pid in pids:
        # Only the pids this launcher recorded, each checked to be a fusiond first.
        if _is_fusiond(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_alive(p) and _is_fusiond(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _pid_alive(pid) and _is_fusiond(pid):
            os.kill(pid, signal.SIGKILL)
    if not keep and root.exists() and data:
        import shutil

        for nd in data.get("nodes", []):
            shutil.rmtree(root / f"node{nd['index']}", ignore_errors=True)
        (root / STATE_FILE).unlink(missing_ok=True)
    if progress:
        progress(f"stopped {len(pids)} daemon(s) in {root}")
    return len(pids)


def _is_fusiond(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"fusiond" in cmd
