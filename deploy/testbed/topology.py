"""Topology files: hosts, groups, per-pair bandwidth and RTT, optional CPU quota per host.

A topology is TOML (see docs/testbed.md)::

    name = "two-groups"
    [defaults]                       # any pair nothing else names
    bandwidth = "1gbit"
    rtt = "0ms"
    [[group]]
    name = "east"
    hosts = ["e1", "e2"]
    bandwidth = "10gbit"             # between two hosts of this group
    rtt = "0.2ms"
    [[link]]
    between = ["east", "west"]       # two groups, or two hosts, or a host and a group
    bandwidth = "100mbit"
    rtt = "40ms"
    [host.e2]
    cpu = 0.5                        # at most half a core (cgroup quota)
    memory = "512MiB"                # at most this much memory (cgroup limit; the kernel
                                     # kills a process of the host that goes over it)

Links are symmetric: a pair's bandwidth holds in each direction and its RTT is the round trip.
The most specific rule wins: host-host link > host-group link > group-group link > the group's
own rate (both hosts in it) > defaults.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOPOLOGY_DIR = Path(__file__).resolve().parent / "topologies"

_HOST_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$", re.IGNORECASE)
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
MIN_MEMORY_BYTES = 4 << 20
"""The smallest per-host memory limit a topology may set (an interpreter alone needs more)."""
MAX_MEMORY_BYTES = 1 << 40
RESERVED_HOSTS = frozenset({"bridge"})


class TopologyError(ValueError):
    """A topology file is malformed; the message names the file and the key."""


@dataclass(frozen=True)
class LinkSpec:
    """One undirected pair: rate in bits/s each way, round-trip time in seconds."""

    bandwidth_bits_per_s: int
    rtt_s: float


@dataclass(frozen=True)
class Topology:
    """A parsed topology; `link(a, b)` resolves the rules for any two distinct hosts."""

    name: str
    hosts: tuple[str, ...]
    groups: Mapping[str, tuple[str, ...]]
    default: LinkSpec
    group_links: Mapping[str, LinkSpec]
    """Rate inside each group (hosts of the same group)."""
    pair_links: Mapping[frozenset[str], tuple[int, LinkSpec]]
    """Explicit links between two names (host or group): (specificity, spec)."""
    cpu: Mapping[str, float] = field(default_factory=dict)
    """Host -> CPU quota in cores (0.5 = half a core); absent = unlimited."""
    memory_bytes: Mapping[str, int] = field(default_factory=dict)
    """Host -> memory limit in bytes (cgroup memory controller); absent = unlimited."""
    mtu: int = 1500
    description: str = ""
    source: str = ""
    """The TOML text it was parsed from (kept in a testbed's state), when known."""

    def group_of(self, host: str) -> str | None:
        """The group `host` belongs to, if any."""
        for g, members in self.groups.items():
            if host in members:
                return g
        return None

    def link(self, a: str, b: str) -> LinkSpec:
        """The configured link between hosts `a` and `b` (symmetric)."""
        if a == b or a not in self.hosts or b not in self.hosts:
            raise KeyError(f"no link {a!r} <-> {b!r} in topology {self.name!r}")
        ga, gb = self.group_of(a), self.group_of(b)
        best: tuple[int, LinkSpec] | None = None
        for x in (a, ga):
            for y in (b, gb):
                if x is None or y is None:
                    continue
                hit = self.pair_links.get(frozenset((x, y)))
                if hit is not None and (best is None or hit[0] > best[0]):
                    best = hit
        if best is not None:
            return best[1]
        if ga is not None and ga == gb and ga in self.group_links:
            return self.group_links[ga]
        return self.default

    def representative_pairs(self) -> list[tuple[str, str]]:
        """One ordered pair per (source group, destination group, link): what `check --sample`
        measures on topologies too big to measure every pair (a host in no group is its own)."""
        seen: set[tuple[str, str, LinkSpec]] = set()
        out = []
        for a, b in self.pairs():
            key = (self.group_of(a) or a, self.group_of(b) or b, self.link(a, b))
            if key not in seen:
                seen.add(key)
                out.append((a, b))
        return out

    def pairs(self) -> list[tuple[str, str]]:
        """Every ordered pair of distinct hosts, in host order."""
        return [(a, b) for a in self.hosts for b in self.hosts if a != b]


def parse_rate(value: object, where: str) -> int:
    """Bits per second from ``"100mbit"``, ``"1gbit"``, ``"8Mbit"`` or a plain number (bit/s)."""
    if isinstance(value, bool):
        raise TopologyError(f"{where}: a rate, not a boolean")
    if isinstance(value, int | float):
        bits_per_s = float(value)
    elif isinstance(value, str):
        m = _RATE_RE.match(value)
        if m is None:
            raise TopologyError(f"{where}: {value!r} is not a rate (e.g. '100mbit', '1gbit')")
        if (m.group(3) or "bit").lower() == "bps":
            raise TopologyError(f"{where}: {value!r}: write rates in bits ('mbit'), as tc does")
        bits_per_s = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    else:
        raise TopologyError(f"{where}: {value!r} is not a rate")
    if not 8_000 <= bits_per_s <= 100e9:
        raise TopologyError(f"{where}: {value!r} is outside 8 kbit/s .. 100 Gbit/s")
    return int(bits_per_s)


def parse_time(value: object, where: str) -> float:
    """Seconds from ``"40ms"``, ``"0.5ms"``, ``"1s"``; a plain number means milliseconds."""
    if isinstance(value, bool):
        raise TopologyError(f"{where}: a duration, not a boolean")
    if isinstance(value, int | float):
        s = float(value) * 1e-3
    elif isinstance(value, str):
        m = _TIME_RE.match(value)
        if m is None:
            raise TopologyError(f"{where}: {value!r} is not a duration (e.g. '40ms')")
        s = float(m.group(1)) * _TIME_UNITS[(m.group(2) or "ms").lower()]
    else:
        raise TopologyError(f"{where}: {value!r} is not a duration")
    if not 0.0 <= s <= 10.0:
        raise TopologyError(f"{where}: {value!r} is outside 0 .. 10 s")
    return s


def parse_size(value: object, where: str) -> int:
    """Bytes from ``"512MiB"``, ``"200MB"``, ``"1.5GiB"`` or a plain integer (bytes)."""
    if isinstance(value, bool):
        raise TopologyError(f"{where}: a size, not a boolean")
    if isinstance(value, int):
        n_bytes = float(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is None:
            raise TopologyError(f"{where}: {value!r} is not a size (e.g. '512MiB', '200MB')")
        base = 1024 if m.group(3) else 1000
        power = "_kmgt".index(m.group(2).lower()) if m.group(2) else 0
        n_bytes = float(m.group(1)) * base ** power
    else:
        raise TopologyError(f"{where}: {value!r} is not a size")
    if not MIN_MEMORY_BYTES <= n_bytes <= MAX_MEMORY_BYTES:
        raise TopologyError(f"{where}: {value!r} is outside 4 MiB .. 1 TiB")
    return int(n_bytes)


def _spec(table: Mapping[str, Any], where: str, fallback: LinkSpec | None,
          extra: frozenset[str] = frozenset()) -> LinkSpec:
    unknown = set(table) - {"bandwidth", "rtt"} - extra
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {sorted(unknown)}")
    if fallback is None and "bandwidth" not in table:
        raise TopologyError(f"{where}: 'bandwidth' is required")
    bw = (parse_rate(table["bandwidth"], f"{where}.bandwidth") if "bandwidth" in table
          else fallback.bandwidth_bits_per_s if fallback is not None else 0)
    rtt = (parse_time(table["rtt"], f"{where}.rtt") if "rtt" in table
           else fallback.rtt_s if fallback is not None else 0.0)
    return LinkSpec(bw, rtt)


def parse_topology(data: Mapping[str, Any], source: str = "<topology>",
                   text: str = "") -> Topology:
    """Validate a decoded TOML document into a Topology; TopologyError names what is wrong.

    `source` names the file in errors; `text` (the TOML itself) is kept as `Topology.source`.
    """
    top_keys = {"name", "description", "mtu", "defaults", "group", "hosts", "link", "host"}
    unknown = set(data) - top_keys
    if unknown:
        raise TopologyError(f"{source}: unknown top-level key(s) {sorted(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{source}: 'name' (a string) is required")
    default = _spec(data.get("defaults", {"bandwidth": "10gbit"}), f"{source}: defaults", None)

    hosts: list[str] = []
    groups: dict[str, tuple[str, ...]] = {}
    group_links: dict[str, LinkSpec] = {}

    def add_host(h: object, where: str) -> str:
        if not isinstance(h, str) or not _HOST_RE.match(h) or h in RESERVED_HOSTS:
            raise TopologyError(f"{where}: host name {h!r} must match {_HOST_RE.pattern} "
                                f"and not be {sorted(RESERVED_HOSTS)}")
        if h in hosts:
            raise TopologyError(f"{where}: host {h!r} listed twice")
        hosts.append(h)
        return h

    for i, g in enumerate(data.get("group", [])):
        where = f"{source}: group[{i}]"
        if not isinstance(g, dict):
            raise TopologyError(f"{where}: must be a table")
        gname = g.get("name")
        if not isinstance(gname, str) or not gname:
            raise TopologyError(f"{where}: 'name' is required")
        if gname in groups:
            raise TopologyError(f"{where}: group {gname!r} defined twice")
        members = g.get("hosts")
        if not isinstance(members, list) or not members:
            raise TopologyError(f"{where}: 'hosts' must be a non-empty list")
        groups[gname] = tuple(add_host(h, f"{where}.hosts") for h in members)
        group_links[gname] = _spec(g, where, default, frozenset({"name", "hosts"}))
    for h in data.get("hosts", []):
        add_host(h, f"{source}: hosts")
    if len(hosts) < 2:
        raise TopologyError(f"{source}: a topology needs at least 2 hosts")
    if len(hosts) > 250:
        raise TopologyError(f"{source}: at most 250 hosts (one /24)")
    clash = set(groups) & set(hosts)
    if clash:
        raise TopologyError(f"{source}: names used for both a group and a host: {sorted(clash)}")

    pair_links: dict[frozenset[str], tuple[int, LinkSpec]] = {}
    for i, link in enumerate(data.get("link", [])):
        where = f"{source}: link[{i}]"
        if not isinstance(link, dict):
            raise TopologyError(f"{where}: must be a table")
        between = link.get("between")
        if (not isinstance(between, list) or len(between) != 2
                or not all(isinstance(x, str) for x in between) or between[0] == between[1]):
            raise TopologyError(f"{where}: 'between' must be two distinct host or group names")
        for x in between:
            if x not in hosts and x not in groups:
                raise TopologyError(f"{where}: {x!r} is neither a host nor a group")
        key = frozenset(between)
        if key in pair_links:
            raise TopologyError(f"{where}: {sorted(key)} linked twice")
        specificity = sum(1 for x in between if x in hosts)
        pair_links[key] = (specificity, _spec(link, where, None, frozenset({"between"})))

    cpu: dict[str, float] = {}
    memory: dict[str, int] = {}
    for h, table in data.get("host", {}).items():
        where = f"{source}: host.{h}"
        if h not in hosts:
            raise TopologyError(f"{where}: no such host")
        if not isinstance(table, dict) or set(table) - {"cpu", "memory"}:
            raise TopologyError(f"{where}: only 'cpu' and 'memory' may be set per host")
        if "memory" in table:
            memory[h] = parse_size(table["memory"], f"{where}.memory")
        c = table.get("cpu")
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, int | float) or not 0.01 <= c <= 64:
                raise TopologyError(f"{where}.cpu: {c!r} must be a number of cores in 0.01..64")
            cpu[h] = float(c)

    mtu = data.get("mtu", 1500)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 65000:
        raise TopologyError(f"{source}: mtu {mtu!r} must be an integer in 576..65000")
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise TopologyError(f"{source}: description must be a string")
    return Topology(name=name, hosts=tuple(hosts), groups=groups, default=default,
                    group_links=group_links, pair_links=pair_links, cpu=cpu,
                    memory_bytes=memory, mtu=mtu,
                    description=desc, source=text)


def resolve_path(name_or_path: str | Path) -> Path:
    """A topology file: an existing path, or the name of a bundled one (``three-hosts``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    bundled = TOPOLOGY_DIR / f"{name_or_path}.toml"
    if bundled.is_file():
        return bundled
    names = sorted(q.stem for q in TOPOLOGY_DIR.glob("*.toml"))
    raise TopologyError(f"no topology file {str(name_or_path)!r}; bundled: {', '.join(names)}")


def load_topology(name_or_path: str | Path) -> Topology:
    """Read and validate a topology file (a path or a bundled name)."""
    path = resolve_path(name_or_path)
    text = path.read_text()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{path}: {exc}") from exc
    return parse_topology(data, str(path), text)


def format_rate(bits_per_s: float) -> str:
    """``100 Mbit/s`` style."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits_per_s >= scale:
            return f"{bits_per_s / scale:.4g} {unit}"
    return f"{bits_per_s:.0f} bit/s"
