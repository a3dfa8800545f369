"""The testbed itself: namespaces, a bridge, shaped veths, a delay stage, processes; and `down`.

Layout of one testbed named N (default ``fzt<pid>``), nothing of it in the root namespace:

- namespace ``N-bridge`` holds bridge ``br0`` and one port ``p<i>`` per host; with delays, it
  also runs the NFQUEUE delay stage (``deploy.testbed.delay``) fed by iptables FORWARD rules
  (bridged IPv4 goes through iptables there: ``bridge-nf-call-iptables=1`` in that namespace);
- namespace ``N-<host>`` per host, with ``eth0`` (the other end of ``p<i>``) at
  ``10.250.0.<i+1>/24`` and ``lo``; its egress is shaped by an htb class per destination
  (u32 filter on the destination address), unclassified traffic (ARP) goes unshaped;
- TCP buffers raised per host namespace (``tcp_rmem``/``tcp_wmem`` max 64 MiB) so long fat
  links are not window-bound;
- optional CPU quota per host: a cgroup (v2 ``cpu.max`` where the cpu controller is enabled,
  else v1 ``cpu.cfs_quota_us``) that every process started in the host joins;
- optional memory limit per host: a cgroup (v2 ``memory.max`` and ``memory.swap.max`` 0 where
  the memory controller is enabled, else v1 ``memory.limit_in_bytes`` and, where swap
  accounting exists, ``memory.memsw.limit_in_bytes``) that every process started in the host
  joins; the kernel kills a process of the host that goes over it, and `memory_report` /
  `classify_exit` tell that "out of memory" apart from any other failure.

Everything made is written to ``<state_dir>/<N>.json`` *before* it is made, so `down` removes it
after a crash too: it kills every process in the testbed's namespaces, deletes the namespaces
(their veths, qdiscs and iptables rules go with them) and the cgroups, then the state.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from deploy.testbed.topology import (
    Topology,
    format_rate,
    load_topology,
    parse_topology,
    resolve_path,
)
from fusiond.units import BITS_PER_BYTE, bytes_per_s_from_bits_per_s

DEFAULT_STATE_DIR = Path(os.environ.get("FUSION_TESTBED_STATE", "/run/fusion-testbed"))
SUBNET = "10.250.0"
METER_PORT = 5201
NAME_RE = re.compile(r"^[a-z][a-z0-9]{1,15}$")
REPO_ROOT = Path(__file__).resolve().parents[2]
TCP_MEM = "4096 131072 67108864"


class TestbedError(RuntimeError):
    """A testbed step failed; the message names the command and its error output."""

    __test__ = False  # not a pytest test class


def _run(args: Sequence[str], *, check: bool = True, timeout: float = 30.0,
         input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                             input=input)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"{shlex.join(args)}: {exc}") from exc
    if check and res.returncode != 0:
        raise TestbedError(f"{shlex.join(args)} failed ({res.returncode}): "
                           f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    """Processes running in namespace `ns`."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = 2.0) -> None:
    """SIGTERM every process in `ns`, SIGKILL what is left after `grace_s`."""
    pids = namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = namespace_pids(ns)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while namespace_pids(ns) and time.monotonic() < deadline:
        time.sleep(0.05)


def cgroup_pids(path: Path) -> list[int]:
    """Processes in the cgroup at `path` (none when it is gone)."""
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split() if p.isdigit()]
    except OSError:
        return []


def kill_cgroup_processes(path: Path, grace_s: float = 2.0) -> None:
    """SIGKILL every process in one of our cgroups (each joined it when this testbed started
    it) and wait until it is empty, so it can be removed."""
    deadline = time.monotonic() + grace_s
    pids = cgroup_pids(path)
    while pids and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        pids = cgroup_pids(path)


def kernel_has_netem() -> bool:
    """Whether this kernel can add a netem qdisc (probed in a throwaway namespace)."""
    ns = f"fztprobe{os.getpid()}"
    if _run(["ip", "netns", "add", ns], check=False).returncode != 0:
        return False
    try:
        res = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root",
                    "netem", "delay", "1ms"], check=False)
        return res.returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


CFS_PERIOD_US = 10_000
"""CFS period of the hosts' CPU quotas: 10 ms, not the kernel's default 100 ms. A quota is
emulating a slower machine; within one period a throttled host waits up to
period x (1 - share) with its work half done, and a pipeline that hands micro-batches from
host to host many times a step would feel that as up to 77 ms of extra latency per hop at
0.225 core with the default period (what a slow CPU does not do). Shorter periods cost a
little more scheduler work."""

_MOUNT_CGROUP = (
    'r="$0"; k="$1"; o="$2"; shift 2; '
    'if [ ! -e "$r/cgroup.procs" ]; then '
    '{ mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup; } '
    '&& mkdir -p "$r" && if [ "$k" = v2 ]; then mount -t cgroup2 cgroup2 "$r"; '
    'else mount -t cgroup -o "$o" cgroup "$r"; fi '
    '|| echo "testbed: cannot mount the cgroup hierarchy at $r: quota not visible" >&2; fi; '
    'exec "$@"')
"""sh script run inside a host: ROOT KIND OPTIONS ARGV... -> the cgroup hierarchy of OPTIONS
(v1; KIND v2: the unified one) mounted at ROOT, then ARGV run (itself this script again for a
second hierarchy)."""


@dataclass(frozen=True)
class CgroupSupport:
    """Where CPU quotas can be set: `kind` is "v2", "v1" or "none" (with the reason)."""

    kind: str
    root: Path | None
    reason: str = ""
    options: str = ""
    """The hierarchy's mount options (v1: its controllers), to mount it again in a host."""


def detect_cgroup() -> CgroupSupport:
    """Find a writable cgroup hierarchy with the cpu controller (v2 preferred, then v1)."""
    mounts: list[tuple[str, str, str]] = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                mounts.append((parts[1], parts[2], parts[3]))
    for path, fstype, _ in mounts:
        if fstype == "cgroup2":
            ctl = Path(path) / "cgroup.controllers"
            with contextlib.suppress(OSError):
                if "cpu" in ctl.read_text().split() and os.access(path, os.W_OK):
                    return CgroupSupport("v2", Path(path), options="")
    for path, fstype, opts in mounts:
        if (fstype == "cgroup" and "cpu" in opts.split(",")
                and (Path(path) / "cpu.cfs_quota_us").exists() and os.access(path, os.W_OK)):
            return CgroupSupport("v1", Path(path), options=opts)
    return CgroupSupport("none", None, "no writable cgroup v2 with the cpu controller, "
                         "nor a cgroup v1 cpu hierarchy")


def detect_memory_cgroup() -> CgroupSupport:
    """Find a writable cgroup hierarchy with the memory controller (v2 preferred, then v1)."""
    mounts: list[tuple[str, str, str]] = []
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                mounts.append((parts[1], parts[2], parts[3]))
    for path, fstype, _ in mounts:
        if fstype == "cgroup2":
            ctl = Path(path) / "cgroup.controllers"
            with contextlib.suppress(OSError):
                if "memory" in ctl.read_text().split() and os.access(path, os.W_OK):
                    return CgroupSupport("v2", Path(path), options="")
    for path, fstype, opts in mounts:
        if (fstype == "cgroup" and "memory" in opts.split(",")
                and (Path(path) / "memory.limit_in_bytes").exists()
                and os.access(path, os.W_OK)):
            return CgroupSupport("v1", Path(path), options=opts)
    return CgroupSupport("none", None, "no writable cgroup v2 with the memory controller, "
                         "nor a cgroup v1 memory hierarchy")


OUT_OF_MEMORY = "out of memory"
"""What `classify_exit` calls a host process the kernel killed at its memory limit."""


@dataclass(frozen=True)
class MemoryReport:
    """What a host's memory cgroup recorded (None where this kernel does not say)."""

    limit_bytes: int
    peak_bytes: int | None
    limit_hits: int | None
    """Times usage hit the limit (v1 ``memory.failcnt``, v2 ``memory.events`` max)."""
    oom_kills: int | None
    """Processes the kernel's OOM killer ended in the cgroup (v1 ``memory.oom_control``
    oom_kill, v2 ``memory.events`` oom_kill; absent on kernels before 4.13)."""


def _int_file(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _keyed_file(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    return out


def read_memory_report(path: Path, kind: str) -> MemoryReport:
    """The memory cgroup at `path` (kind "v1" or "v2"): limit, peak, hits, OOM kills."""
    if kind == "v2":
        events = _keyed_file(path / "memory.events")
        limit = _int_file(path / "memory.max")
        return MemoryReport(limit_bytes=limit if limit is not None else -1,
                            peak_bytes=_int_file(path / "memory.peak"),
                            limit_hits=events.get("max"), oom_kills=events.get("oom_kill"))
    ctl = _keyed_file(path / "memory.oom_control")
    limit = _int_file(path / "memory.limit_in_bytes")
    return MemoryReport(limit_bytes=limit if limit is not None else -1,
                        peak_bytes=_int_file(path / "memory.max_usage_in_bytes"),
                        limit_hits=_int_file(path / "memory.failcnt"),
                        oom_kills=ctl.get("oom_kill"))


def classify_exit(returncode: int | None, report: MemoryReport | None) -> str:
    """A host process's outcome: "ok", `OUT_OF_MEMORY` or "failed (exit N)".

    Out of memory: the host's cgroup counts an OOM kill, or (a kernel that counts none) the
    process died of SIGKILL while its cgroup had hit the limit. A run that ends so must be
    reported as out of memory, never as "did not reach the target". `returncode` is Popen's
    (negative: killed by that signal; 128 + N: a shell saw signal N)."""
    if report is not None:
        if report.oom_kills:
            return OUT_OF_MEMORY
        killed = returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
        if killed and report.oom_kills is None and report.limit_hits:
            return OUT_OF_MEMORY
    if returncode == 0:
        return "ok"
    return f"failed (exit {returncode})"


def _htb_rate_args(topo: Topology, rate_bits_per_s: int) -> list[str]:
    """An htb class's rate arguments: rate = ceil, burst 1 ms at the rate (at least a few MTUs,
    so a fast class is not starved by timer granularity), quantum within htb's sane range to
    share fairly."""
    bytes_per_s = rate_bits_per_s // BITS_PER_BYTE
    burst = max(4 * topo.mtu, bytes_per_s // 1000)
    quantum = max(topo.mtu + 14, min(200_000, bytes_per_s // 1000))
    return ["rate", f"{rate_bits_per_s}bit", "ceil", f"{rate_bits_per_s}bit", "burst",
            str(burst), "cburst", str(burst), "quantum", str(quantum)]


def reshape_command(topo: Topology, src: str, dst: str, rate_bits_per_s: int) -> list[str]:
    """The tc command that changes the rate of `src`'s egress towards `dst` in place (the htb
    class `shaping_commands` made; a running flow sees the new rate at once)."""
    if src == dst or src not in topo.hosts or dst not in topo.hosts:
        raise TestbedError(f"no link {src!r} -> {dst!r} in topology {topo.name!r}")
    if not 8_000 <= rate_bits_per_s <= 100e9:
        raise TestbedError(f"rate {rate_bits_per_s} bit/s is outside 8 kbit/s .. 100 Gbit/s")
    cls = f"1:{0x100 + topo.hosts.index(dst):x}"
    return ["tc", "class", "change", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
            *_htb_rate_args(topo, int(rate_bits_per_s))]


def shaping_commands(topo: Topology, host: str, address: Callable[[str], str], *,
                     netem: bool = False) -> list[list[str]]:
    """The tc commands shaping `host`'s egress (``eth0``): htb, one class per destination at
    the pair's rate, a u32 filter on the destination address; with `netem`, each class's leaf
    is a netem qdisc adding half the pair's RTT (the other half is added the other way)."""
    # default 0: traffic no filter claims (ARP) leaves unshaped.
    cmds = [["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "0"]]
    for j, dst in enumerate(topo.hosts):
        if dst == host:
            continue
        spec = topo.link(host, dst)
        bytes_per_s = spec.bandwidth_bits_per_s // BITS_PER_BYTE
        minor = 0x100 + j
        cls = f"1:{minor:x}"
        cmds.append(["tc", "class", "add", "dev", "eth0", "parent", "1:", "classid", cls, "htb",
                     *_htb_rate_args(topo, spec.bandwidth_bits_per_s)])
        if netem and spec.rtt_s > 0:
            # The leaf queue holds a bandwidth-delay product and more, or netem drops.
            limit = max(1000, int(bytes_per_s * spec.rtt_s / topo.mtu) * 4)
            cmds.append(["tc", "qdisc", "add", "dev", "eth0", "parent", cls, "handle",
                         f"{minor:x}:", "netem", "delay", f"{spec.rtt_s / 2 * 1e6:.0f}us",
                         "limit", str(limit)])
        cmds.append(["tc", "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst", f"{address(dst)}/32",
                     "flowid", cls])
    return cmds


LATENCY_MODES = ("auto", "netem", "nfqueue", "none")


@dataclass
class PairResult:
    """Configured against measured for one direction of one pair."""

    src: str
    dst: str
    rate_bits_per_s: int
    rtt_s: float
    measured_bits_per_s: float | None
    measured_rtt_s: float | None
    error: str = ""
    rate_tolerance: float = 0.15
    rtt_tolerance_s: float = 0.002

    @property
    def rate_ok(self) -> bool:
        got = self.measured_bits_per_s
        return (got is not None
                and abs(got - self.rate_bits_per_s) <= self.rate_tolerance * self.rate_bits_per_s)

    @property
    def rtt_ok(self) -> bool:
        return (self.measured_rtt_s is not None
                and abs(self.measured_rtt_s - self.rtt_s) <= self.rtt_tolerance_s)

    @property
    def ok(self) -> bool:
        return self.rate_ok and self.rtt_ok

    def line(self) -> str:
        """One human line: pair, configured, measured, PASS/FAIL."""
        got = self.measured_bits_per_s
        got_bw = format_rate(got) if got is not None else "-"
        got_rtt = (f"{self.measured_rtt_s * 1e3:.2f} ms" if self.measured_rtt_s is not None
                   else "-")
        verdict = "PASS" if self.ok else "FAIL"
        err = f"  ({self.error})" if self.error else ""
        return (f"{self.src:>8} -> {self.dst:<8} {format_rate(self.rate_bits_per_s):>12} "
                f"{got_bw:>12}   {self.rtt_s * 1e3:7.2f} ms {got_rtt:>10}   {verdict}{err}")


class Testbed:
    """One emulated WAN. `up()` builds it, `down()` removes it; usable as a context manager.

    `exec(host, argv)` starts a process inside a host (its namespace and CPU cgroup).
    """

    __test__ = False

    def __init__(self, topology: Topology, *, name: str | None = None,
                 state_dir: Path = DEFAULT_STATE_DIR, topology_path: str = "") -> None:
        self.topology = topology
        self.name = name or f"fzt{os.getpid()}"
        if not NAME_RE.match(self.name):
            raise TestbedError(f"testbed name {self.name!r} must match {NAME_RE.pattern}")
        self.state_dir = Path(state_dir)
        self.topology_path = topology_path
        self.state: dict[str, Any] = {}
        self.cgroup = detect_cgroup()
        self.memory_cgroup = detect_memory_cgroup()

    # -- names -----------------------------------------------------------------------------

    @property
    def bridge_ns(self) -> str:
        return f"{self.name}-bridge"

    def ns(self, host: str) -> str:
        """The namespace of `host`."""
        if host not in self.topology.hosts:
            raise KeyError(f"no host {host!r} in testbed {self.name}")
        return f"{self.name}-{host}"

    def address(self, host: str) -> str:
        """The IPv4 address of `host` (inside the testbed only)."""
        return f"{SUBNET}.{self.topology.hosts.index(host) + 1}"

    @property
    def state_file(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    @property
    def work_dir(self) -> Path:
        """Logs and per-host files of this testbed."""
        return self.state_dir / self.name

    def short_dir(self, what: str) -> Path:
        """A directory with a short path (``/tmp/<name>-<what>``: Unix socket paths must stay
        under 108 bytes), recorded so `down` removes it."""
        path = Path("/tmp") / f"{self.name}-{what}"
        if str(path) not in self.state.get("dirs", []):
            if path.exists():
                raise TestbedError(f"{path} already exists and is not this testbed's")
            self._record("dirs", str(path))
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    # -- state -----------------------------------------------------------------------------

    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_file)

    def _record(self, key: str, value: Any) -> None:
        """Note something about to be created (write-ahead: a crash leaves it recorded)."""
        self.state.setdefault(key, [])
        if value not in self.state[key]:
            self.state[key].append(value)
        self._save()

    @classmethod
    def load(cls, name: str, state_dir: Path = DEFAULT_STATE_DIR) -> Testbed:
        """The testbed `name` as recorded by `up` (for down/check/status from another process)."""
        path = Path(state_dir) / f"{name}.json"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TestbedError(f"no testbed {name!r} under {state_dir} ({exc})") from exc
        # The topology as it was at `up` (the file may have changed or gone since).
        text = state.get("topology_toml")
        topo = (parse_topology(tomllib.loads(text), state.get("topology_path", name)) if text
                else load_topology(state["topology_path"]))
        tb = cls(topo, name=name, state_dir=Path(state_dir),
                 topology_path=state.get("topology_path", ""))
        tb.state = state
        return tb

    # -- up --------------------------------------------------------------------------------

    def up(self, *, latency: str = "auto", tcp_buffers: bool = True) -> None:
        """Build the testbed; on any failure, remove what was made and raise TestbedError.

        `latency`: "netem" (a netem leaf per htb class), "nfqueue" (the userspace delay stage
        on the bridge), "auto" (netem where the kernel has it, else nfqueue) or "none".
        """
        if latency not in LATENCY_MODES:
            raise TestbedError(f"latency {latency!r}: one of {', '.join(LATENCY_MODES)}")
        if self.state_file.exists():
            raise TestbedError(f"testbed {self.name} already exists ({self.state_file}); "
                               f"run `python -m deploy.testbed down {self.name}` first")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise TestbedError(f"`{tool}` not found: install iproute2")
        self.state = {"name": self.name, "topology_path": self.topology_path,
                      "topology": self.topology.name, "topology_toml": self.topology.source,
                      "created_at": time.time(), "creator_pid": os.getpid(),
                      "complete": False, "namespaces": [], "cgroups": [], "pids": [],
                      "warnings": []}
        self._save()
        try:
            self._build(latency=latency, tcp_buffers=tcp_buffers)
        except BaseException:
            self.down()
            raise
        self.state["complete"] = True
        self._save()

    def _add_ns(self, ns: str) -> None:
        if ns in list_namespaces():
            # Never record (and so never delete) a namespace this testbed did not make.
            raise TestbedError(f"namespace {ns} already exists (another testbed named "
                               f"{self.name}?); pick another --name, or `down --all`")
        self._record("namespaces", ns)
        _run(["ip", "netns", "add", ns])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self, *, latency: str, tcp_buffers: bool) -> None:
        topo, br = self.topology, self.bridge_ns
        rtts = [(a, b) for a, b in topo.pairs() if topo.link(a, b).rtt_s > 0]
        if rtts and latency == "auto":
            latency = "netem" if kernel_has_netem() else "nfqueue"
        elif not rtts:
            latency = "none"
        self.state["delay"] = latency
        self._save()
        mtu = str(topo.mtu)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._add_ns(br)
        _run(["ip", "-n", br, "link", "add", "br0", "mtu", mtu, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for i, host in enumerate(topo.hosts):
            ns, port = self.ns(host), f"p{i}"
            self._add_ns(ns)
            _run(["ip", "-n", br, "link", "add", port, "mtu", mtu, "type", "veth", "peer",
                  "name", "eth0", "mtu", mtu, "netns", ns])
            _run(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if tcp_buffers:
                for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                    _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={TCP_MEM}"])
                # A fresh measurement must not start from a previous connection's cwnd.
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw",
                      "net.ipv4.tcp_no_metrics_save=1"])
            self._shape(host, netem=latency == "netem")
        self._cpu_quotas()
        self._memory_limits()
        if latency == "nfqueue":
            self._start_delay(rtts)
        elif rtts and latency == "none":
            self._warn("latency not emulated (latency none): RTTs are the bare veth's")

    def _warn(self, msg: str) -> None:
        self.state.setdefault("warnings", []).append(msg)
        self._save()
        warnings.warn(f"testbed {self.name}: {msg}", RuntimeWarning, stacklevel=3)

    def _shape(self, host: str, netem: bool) -> None:
        for cmd in shaping_commands(self.topology, host, self.address, netem=netem):
            _run(["ip", "netns", "exec", self.ns(host), *cmd])

    def reshape(self, src: str, dst: str, rate_bits_per_s: int) -> None:
        """Change the rate of the link from `src` to `dst` (that direction only) while the
        testbed runs, as a route change or another tenant would; the topology is not changed
        (`down` needs none of it)."""
        _run(["ip", "netns", "exec", self.ns(src),
              *reshape_command(self.topology, src, dst, rate_bits_per_s)])

    def _cpu_quotas(self) -> None:
        quotas = self.topology.cpu
        if not quotas:
            return
        cg = self.cgroup
        if cg.root is None:
            self._warn(f"CPU quotas {dict(quotas)} NOT applied: {cg.reason}")
            return
        for host, cores in quotas.items():
            path = cg.root / f"fusion-testbed-{self.name}-{host}"
            if path.exists():
                self._warn(f"CPU quota for {host} NOT applied: {path} exists and is not ours")
                continue
            self._record("cgroups", str(path))
            try:
                if cg.kind == "v2":
                    # Children get a cpu.max only when the parent delegates the controller.
                    ctl = cg.root / "cgroup.subtree_control"
                    if "cpu" not in ctl.read_text().split():
                        ctl.write_text("+cpu")
                path.mkdir(exist_ok=True)
                quota = max(1000, int(cores * CFS_PERIOD_US))  # the kernel's minimum: 1 ms
                if cg.kind == "v2":
                    (path / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
                else:
                    (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                    (path / "cpu.cfs_quota_us").write_text(str(quota))
            except OSError as exc:
                self._warn(f"CPU quota for {host} NOT applied ({cg.kind} at {path}): {exc}")

    def memory_cgroup_path(self, host: str) -> Path | None:
        """The memory cgroup of `host` (None: the host has no memory limit)."""
        if self.memory_cgroup.root is None or host not in self.topology.memory_bytes:
            return None
        path = self.memory_cgroup.root / f"fusion-testbed-{self.name}-{host}"
        return path if str(path) in self.state.get("cgroups", []) else None

    def _memory_limits(self) -> None:
        limits = self.topology.memory_bytes
        if not limits:
            return
        cg = self.memory_cgroup
        if cg.root is None:
            # A limit the kernel does not enforce would make an "out of memory" regime that
            # binds nobody: refuse, as a run under it would measure something else.
            raise TestbedError(f"memory limits {dict(limits)} cannot be enforced: {cg.reason}")
        for host, limit_bytes in limits.items():
            path = cg.root / f"fusion-testbed-{self.name}-{host}"
            shared = str(path) in self.state.get("cgroups", [])  # v2: the CPU quota's cgroup
            if path.exists() and not shared:
                raise TestbedError(f"memory limit for {host}: {path} exists and is not ours")
            self._record("cgroups", str(path))
            try:
                if cg.kind == "v2":
                    ctl = cg.root / "cgroup.subtree_control"
                    if "memory" not in ctl.read_text().split():
                        ctl.write_text("+memory")
                path.mkdir(exist_ok=True)
                if cg.kind == "v2":
                    (path / "memory.max").write_text(str(limit_bytes))
                    swap = path / "memory.swap.max"
                    if swap.exists():
                        swap.write_text("0")  # over the limit means killed, not swapped
                else:
                    (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                    memsw = path / "memory.memsw.limit_in_bytes"
                    if memsw.exists():
                        memsw.write_text(str(limit_bytes))
            except OSError as exc:
                raise TestbedError(f"memory limit for {host} NOT applied ({cg.kind} at "
                                   f"{path}): {exc}") from exc

    def memory_report(self, host: str) -> MemoryReport | None:
        """What `host`'s memory cgroup recorded so far (None: the host has no limit)."""
        path = self.memory_cgroup_path(host)
        if path is None or not path.is_dir():
            return None
        return read_memory_report(path, self.memory_cgroup.kind)

    def reset_memory_peak(self, host: str) -> bool:
        """Start `host`'s memory peak afresh (cgroup v1 ``memory.max_usage_in_bytes``; v2's
        ``memory.peak`` resets only per open file on new kernels: False there, and where the
        host has no limit)."""
        path = self.memory_cgroup_path(host)
        if path is None or self.memory_cgroup.kind != "v1":
            return False
        try:
            (path / "memory.max_usage_in_bytes").write_text("0")
        except OSError:
            return False
        return True

    def _start_delay(self, pairs: list[tuple[str, str]]) -> None:
        """The NFQUEUE delay stage in the bridge namespace, then the iptables rules feeding it."""
        topo, br = self.topology, self.bridge_ns
        try:
            import netfilterqueue  # noqa: F401
        except ImportError as exc:
            raise TestbedError("latency needs the NetfilterQueue package (pip install "
                               "NetfilterQueue; Debian: libnetfilter-queue-dev), or use "
                               "--latency none") from exc
        if shutil.which("iptables") is None:
            raise TestbedError("the delay stage needs iptables (Debian package iptables)")
        _run(["ip", "netns", "exec", br, "sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"])
        cfg = self.work_dir / "delays.json"
        cfg.write_text(json.dumps({"delays": [
            [self.address(a), self.address(b), topo.link(a, b).rtt_s / 2] for a, b in pairs]}))
        log = self.work_dir / "delay.log"
        proc = self._spawn(br, [sys.executable, "-m", "deploy.testbed.delay", "--queue", "0",
                                "--config", str(cfg)], log)
        self.wait_ready(proc, log, "delay stage")
        for a, b in pairs:
            _run(["ip", "netns", "exec", br, "iptables", "-w", "-A", "FORWARD",
                  "-s", self.address(a), "-d", self.address(b), "-j", "NFQUEUE",
                  "--queue-num", "0"])

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, ns: str, argv: Sequence[str], log: Path | None, *,
               cgroups: Sequence[str] = (), env: Mapping[str, str] | None = None,
               **kw: Any) -> subprocess.Popen[bytes]:
        cmd = ["ip", "netns", "exec", ns, *argv]
        if cgroups and self.cgroup.root is not None:
            # `ip netns exec` gives the host a fresh /sys, without /sys/fs/cgroup: mount the
            # quota's hierarchy again (in that private mount namespace only), so a process can
            # read its own CPU limit there as in a container (fusiond.profile.cpu_allowance),
            # and the memory limit's where that is another (cgroup v1: a daemon reads its
            # limit, fusiond.profile.memory_allowance, and plans and trims within it)
            inner = list(argv)
            mem = self.memory_cgroup
            if (mem.root is not None and mem.root != self.cgroup.root
                    and any(Path(c).is_relative_to(mem.root) for c in cgroups)):
                inner = ["sh", "-c", _MOUNT_CGROUP, str(mem.root), mem.kind, mem.options,
                         *inner]
            cmd = ["ip", "netns", "exec", ns, "sh", "-c", _MOUNT_CGROUP,
                   str(self.cgroup.root), self.cgroup.kind, self.cgroup.options, *inner]
        if cgroups:
            # Join the cgroups (CPU quota, memory limit) before exec so every child process
            # inherits them; a cgroup that cannot be joined fails the start (exit 125).
            cmd = ["sh", "-c", 'n="$0"; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; '
                   'shift; n=$((n - 1)); done; exec "$@"', str(len(cgroups)),
                   *[f"{c}/cgroup.procs" for c in cgroups], *cmd]
        out: IO[bytes] | int | None = kw.pop("stdout", None)
        if out is None and log is not None:
            out = open(log, "ab")  # noqa: SIM115 (the child keeps it; closed below)
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=kw.pop("stderr", subprocess.STDOUT),
                                    stdin=subprocess.DEVNULL, env=full_env, cwd=kw.pop("cwd",
                                    REPO_ROOT), start_new_session=True, **kw)
        finally:
            if log is not None and out is not None and not isinstance(out, int):
                out.close()
        self._record("pids", proc.pid)
        return proc

    def wait_ready(self, proc: subprocess.Popen[bytes], log: Path, what: str,
                    timeout: float = 20.0) -> None:
        """Wait until `proc` writes READY to `log`; TestbedError (with the log) if it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "READY" in log.read_text(errors="replace"):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        raise TestbedError(f"{what} did not start: {log.read_text(errors='replace')[-2000:]}")

    def exec(self, host: str, argv: Sequence[str], *, log: Path | None = None,
             env: Mapping[str, str] | None = None, cpu_quota: bool = True,
             **popen: Any) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host` (its namespace and, unless `cpu_quota` is False, its
        cgroups: the CPU quota and the memory limit); `down` kills it.

        Output goes to `log` (default ``<work_dir>/<host>.log``) unless `stdout` is given.
        """
        ns = self.ns(host)
        cgs = [c for c in dict.fromkeys(self.state.get("cgroups", []))
               if c.endswith(f"-{self.name}-{host}") and Path(c).is_dir()] if cpu_quota else []
        if log is None and "stdout" not in popen:
            log = self.work_dir / f"{host}.log"
        return self._spawn(ns, argv, log, cgroups=cgs, env=env, **popen)

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0, *,
            cpu_quota: bool = True) -> str:
        """Run `argv` in `host` to completion; its stdout (TestbedError when it fails)."""
        proc = self.exec(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cpu_quota=cpu_quota)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            proc.communicate()
            raise TestbedError(f"{host}: {shlex.join(argv)} timed out after {timeout}s") from exc
        if proc.returncode != 0:
            raise TestbedError(f"{host}: {shlex.join(argv)} failed ({proc.returncode}): "
                               f"{err.decode(errors='replace')[-2000:]}")
        return out.decode()

    def start_each(self, template: str) -> dict[str, subprocess.Popen[bytes]]:
        """Start one process per host from a shell template.

        Placeholders: {host} {ns} {addr} {index} {name} {work} (this testbed's work dir)
        {peers} (the other hosts' addresses, comma-separated) {first} (the first host's addr).
        """
        procs = {}
        first = self.address(self.topology.hosts[0])
        for i, host in enumerate(self.topology.hosts):
            peers = ",".join(self.address(h) for h in self.topology.hosts if h != host)
            cmd = template.format(host=host, ns=self.ns(host), addr=self.address(host),
                                  index=i, name=self.name, work=self.work_dir, peers=peers,
                                  first=first)
            procs[host] = self.exec(host, ["sh", "-c", cmd])
        return procs

    # -- check -----------------------------------------------------------------------------

    def check(self, *, duration_s: float = 1.0, pings: int = 10,
              rate_tolerance: float = 0.15, rtt_tolerance_s: float = 0.002,
              pairs: Sequence[tuple[str, str]] | None = None) -> list[PairResult]:
        """Measure every ordered pair (or `pairs`) one at a time: RTT and TCP goodput."""
        topo = self.topology
        servers = []
        try:
            for host in topo.hosts:
                log = self.work_dir / f"meter-{host}.log"
                log.write_text("")
                # The meters run outside the hosts' CPU quotas: check measures the network,
                # not how fast a slowed-down host can push bytes.
                proc = self.exec(host, [sys.executable, "-m", "deploy.testbed.meter", "serve",
                                        self.address(host), str(METER_PORT)], log=log,
                                 cpu_quota=False)
                servers.append(proc)
                self.wait_ready(proc, log, f"meter on {host}")
            results = []
            for a, b in pairs if pairs is not None else topo.pairs():
                spec = topo.link(a, b)
                nbytes = max(64 << 10,
                             int(bytes_per_s_from_bits_per_s(spec.bandwidth_bits_per_s)
                                 * duration_s))
                res = PairResult(a, b, spec.bandwidth_bits_per_s, spec.rtt_s, None, None,
                                 rate_tolerance=rate_tolerance, rtt_tolerance_s=rtt_tolerance_s)
                try:
                    out = self.run(a, [sys.executable, "-m", "deploy.testbed.meter", "measure",
                                       self.address(b), str(METER_PORT), "--bytes", str(nbytes),
                                       "--pings", str(pings)],
                                   timeout=30 + 10 * duration_s, cpu_quota=False)
                    got = json.loads(out.strip().splitlines()[-1])
                    res.measured_bits_per_s = got["bandwidth_bits_per_s"]
                    res.measured_rtt_s = got["rtt_s"]
                except (TestbedError, ValueError, KeyError, IndexError) as exc:
                    res.error = str(exc)[-300:]
                results.append(res)
            return results
        finally:
            for proc in servers:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()

    # -- status / down ---------------------------------------------------------------------

    def describe(self) -> str:
        """Hosts, addresses, links and what runs: the `status` text."""
        topo = self.topology
        lines = [f"testbed {self.name}: topology {topo.name} ({len(topo.hosts)} hosts), "
                 f"latency: {self.state.get('delay', '?')}, state {self.state_file}"]
        live = set(list_namespaces())
        for host in topo.hosts:
            ns = self.ns(host)
            cpu = topo.cpu.get(host)
            mem = topo.memory_bytes.get(host)
            lines.append(f"  {host:<10} {self.address(host):<13} ns {ns:<24} "
                         f"{'up' if ns in live else 'MISSING'}"
                         f"{f'  cpu {cpu:g} cores' if cpu else ''}"
                         f"{f'  memory {mem / 2**20:g} MiB' if mem else ''}"
                         f"  processes {len(namespace_pids(ns)) if ns in live else 0}")
        lines.append("  links:")
        for i, a in enumerate(topo.hosts):
            for b in topo.hosts[i + 1:]:
                spec = topo.link(a, b)
                lines.append(f"    {a} <-> {b}: {format_rate(spec.bandwidth_bits_per_s)}, "
                             f"rtt {spec.rtt_s * 1e3:g} ms")
        lines.extend(f"  warning: {w}" for w in self.state.get("warnings", []))
        return "\n".join(lines)

    def down(self) -> list[str]:
        """Remove everything recorded (idempotent, tolerant of half-built testbeds).

        Returns what could not be removed (empty when clean).
        """
        return teardown(self.name, self.state, self.state_dir)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()


CGROUP_REMOVE_GRACE_S = 10.0
"""How long `teardown` keeps trying to remove a cgroup its killed processes are still leaving."""


def teardown(name: str, state: Mapping[str, Any], state_dir: Path) -> list[str]:
    """Remove what `state` records for testbed `name`: the processes inside its namespaces
    (found through the namespaces, never by pid or name: a pid may have been reused), the
    namespaces (their veths, qdiscs and iptables rules go with them), cgroups, directories,
    then the state file. Needs nothing but the state, so it works when the topology is gone.
    Returns what could not be removed."""
    problems: list[str] = []
    namespaces = list(state.get("namespaces", []))
    live = set(list_namespaces())
    # Hosts first, the bridge (and its delay stage) last: senders stop before the stage that
    # holds their packets.
    for ns in sorted(namespaces, key=lambda n: n == f"{name}-bridge"):
        if ns in live:
            kill_namespace_processes(ns)
    for ns in namespaces:
        if ns in live:
            res = _run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0:
                problems.append(f"namespace {ns}: {res.stderr.strip()}")
    for cg in state.get("cgroups", []):
        # A process started just before `down` may have joined its host's cgroup without
        # being in the namespace yet (`ip netns exec` not run yet): the cgroup still has it.
        kill_cgroup_processes(Path(cg))
    for cg in state.get("cgroups", []):
        path = Path(cg)
        # A killed process leaves its cgroup only once the kernel has finished its exit (a
        # loaded machine took more than the kill's grace once): EBUSY is retried, killing again.
        deadline = time.monotonic() + CGROUP_REMOVE_GRACE_S
        while path.is_dir():
            try:
                path.rmdir()
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    problems.append(f"cgroup {cg}: {exc}")
                    break
                kill_cgroup_processes(path, grace_s=0.2)
                time.sleep(0.1)
    if not problems:
        for d in state.get("dirs", []):
            _rmtree(Path(d))
        with contextlib.suppress(FileNotFoundError):
            (Path(state_dir) / f"{name}.json").unlink()
        _rmtree(Path(state_dir) / name)
    return problems


def down_recorded(name: str, state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """`teardown` of a recorded testbed from its state file alone (any process, any time)."""
    path = Path(state_dir) / f"{name}.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TestbedError(f"no readable state for testbed {name!r} at {path} ({exc})") from exc
    return teardown(name, state, Path(state_dir))


def _rmtree(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            if child.is_dir() and not child.is_symlink():
                child.rmdir()
            else:
                child.unlink()
    with contextlib.suppress(OSError):
        path.rmdir()


def recorded_testbeds(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Names of the testbeds with a state file under `state_dir`."""
    if not Path(state_dir).is_dir():
        return []
    return sorted(p.stem for p in Path(state_dir).glob("*.json"))


def stray_namespaces(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Namespaces named like ours (``fzt<digits>-…``) whose testbed has no state file."""
    known = set(recorded_testbeds(state_dir))
    out = []
    for ns in list_namespaces():
        m = re.match(r"^(fzt[0-9]+)-", ns)
        if m and m.group(1) not in known:
            out.append(ns)
    return out


def remove_stray(state_dir: Path = DEFAULT_STATE_DIR) -> list[str]:
    """Delete `stray_namespaces` (their processes first); returns what was removed."""
    removed = []
    for ns in stray_namespaces(state_dir):
        kill_namespace_processes(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    return removed


@contextlib.contextmanager
def testbed(topology: str | Path | Topology, *, name: str | None = None,
            state_dir: Path = DEFAULT_STATE_DIR, latency: str = "auto") -> Iterator[Testbed]:
    """``with testbed("three-hosts") as tb:`` builds it and always removes it."""
    if isinstance(topology, Topology):
        tb = Testbed(topology, name=name, state_dir=state_dir)
    else:
        path = str(resolve_path(topology).resolve())
        tb = Testbed(load_topology(path), name=name, state_dir=state_dir, topology_path=path)
    tb.up(latency=latency)
    try:
        yield tb
    finally:
        tb.down()


testbed.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test
