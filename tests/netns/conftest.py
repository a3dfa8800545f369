"""Namespace tests: root only; each builds its own testbed (unique name) and always removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
