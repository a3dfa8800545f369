"""Namespace tests: root only; each builds its own testbed (unique name) and always removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, iptables)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (iproute2)"
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns` is unavailable: {res.stderr.strip()}"
    return None


NETNS_SKIP = _netns_unavailable()
needs_netns = pytest.mark.skipif(NETNS_SKIP is not None, reason=NETNS_SKIP or "")


def needs_delay_stage() -> str | None:
    """Why latency cannot be emulated here (None: it can, by netem or the NFQUEUE stage)."""
    from deploy.testbed.bed import kernel_has_netem

    if kernel_has_netem():
        return None
    if shutil.which("iptables") is None:
        return "needs iptables (Debian package iptables) for the NFQUEUE delay stage"
    try:
        import netfilterqueue  # noqa: F401
    except ImportError:
        return ("needs the NetfilterQueue package (pip install NetfilterQueue; Debian "
                "libnetfilter-queue-dev) for the delay stage")
    return None


@dataclass(frozen=True)
class HostSnapshot:
    """What the root namespace looks like: none of it may change across a testbed's life."""

    links: str
    qdiscs: str
    iptables: str


def _out(args: list[str]) -> str:
    res = subprocess.run(args, capture_output=True, text=True)
    return res.stdout if res.returncode == 0 else f"<{' '.join(args)}: rc {res.returncode}>"


def snapshot() -> HostSnapshot:
    # Counters in iptables-save and link statistics move by themselves: compare structure only.
    links = "\n".join(sorted(line.split(":")[1].split("@")[0].strip()
                             for line in _out(["ip", "-o", "link", "show"]).splitlines()
                             if ":" in line))
    qdiscs = "\n".join(sorted(_out(["tc", "qdisc", "show"]).splitlines()))
    rules = "\n".join(sorted(
        line for line in (_out(["iptables-save"]) if shutil.which("iptables-save") else
                          "").splitlines() if line.startswith("-")))
    return HostSnapshot(links, qdiscs, rules)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """A private state directory; anything still recorded there at the end is removed."""
    d = tmp_path / "testbed-state"
    yield d
    from deploy.testbed import Testbed, recorded_testbeds

    for name in recorded_testbeds(d):
        Testbed.load(name, d).down()


SETTLE_PROBE_INTERVAL_S = 4.0
"""Probe interval of the tests that wait for settled link figures (`wait_for_settled_links`)."""


def wait_for_settled_links(nodes: list[Any], want: set[tuple[str, str]], *, rounds: int = 2,
                           timeout_s: float = 90.0) -> dict[str, dict[str, dict[str, Any]]]:
    """Wait until every daemon in `nodes` holds each (src, dst) link of `want` as measured in
    at least `rounds` probe rounds (distinct ``measured_at``), and return the first node's
    ``/v1/links`` then. Every daemon probes every peer as it starts, all links at once and
    each from a cold TCP window, so a first round can read low (CI: 80.7 Mbit/s +-42 % on a
    100 Mbit/s link); the rounds after it measure the link, and a settled figure is what a
    plan should be judged on."""
    seen: dict[tuple[int, str, str], set[float]] = {}
    deadline = time.monotonic() + timeout_s
    short: list[str] = []
    while True:
        short = []
        first: dict[str, dict[str, dict[str, Any]]] = {}
        for i, node in enumerate(nodes):
            links: dict[str, dict[str, dict[str, Any]]] = node.api("GET", "/v1/links")["links"]
            if i == 0:
                first = links
            for src, dst in sorted(want):
                lk = links.get(src, {}).get(dst)
                if lk is None or not lk.get("bandwidth_bits_per_s"):
                    short.append(f"node {i}: {src}->{dst} not measured")
                    continue
                times = seen.setdefault((i, src, dst), set())
                times.add(float(lk.get("measured_at") or 0.0))
                if len(times) < rounds:
                    short.append(f"node {i}: {src}->{dst} {len(times)} round(s)")
        if not short:
            return first
        if time.monotonic() > deadline:
            raise AssertionError(f"links not measured in {rounds} rounds within {timeout_s:g} s: "
                                 + "; ".join(short[:6]))
        time.sleep(0.3)
