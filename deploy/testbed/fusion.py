"""Start a fusiond in every host of a testbed, all members of one cluster.

Credentials: one cluster CA made up front (`fusionctl.local.make_credentials`: the first host
holds the CA key, every other host gets a node certificate), so links are mutual TLS exactly as
in a deployment; ``insecure=True`` uses plaintext links instead (allowed off loopback only
because the testbed is a closed namespace network). Discovery: every host dials the first
host's address (bootstrap), as a WAN deployment would; mDNS is off. Timers are the short ones
of `fusionctl local` so the cluster converges in seconds; link probes keep their production
sizes so `fusionctl links` shows what the shaped links really carry.

Each daemon's directory is ``<work_dir>/fusiond/node<i>`` (config, state, log, API socket);
talk to host i with ``fusionctl --socket <work_dir>/fusiond/node<i>/fusiond.sock status``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from deploy.testbed.bed import Testbed, TestbedError
from fusionctl.local import DEV_SETTINGS, LocalNode, agreement, make_credentials, merge

PEER_PORT = 7420
PROBE_TARGET_S = 1.0


@dataclass
class _Node(LocalNode):
    """A LocalNode whose API socket lives at a short path: a Unix socket path has at most 107
    bytes, and a testbed's work directory (under pytest's tmp_path, say) can be longer."""

    socket_path: str = ""

    @property
    def socket(self) -> str:
        return self.socket_path or super().socket


@dataclass(frozen=True)
class FusiondCluster:
    """The daemons `start_fusiond` started: host -> LocalNode (config, socket, log, API)."""

    nodes: Mapping[str, LocalNode]
    summary: str


def start_fusiond(tb: Testbed, *, insecure: bool = False, wait_s: float = 90.0,
                  progress: Callable[[str], None] | None = None,
                  settings: Mapping[str, Any] | None = None,
                  host_settings: Mapping[str, Mapping[str, Any]] | None = None
                  ) -> FusiondCluster:
    """Start the daemons, wait until all agree on members, scheduler and term.

    `settings` are merged into every daemon's config (e.g. ``{"cluster":
    {"probe_interval_s": 2.0}}``), then `host_settings[host]` into that host's (e.g. the
    memory it offers to jobs, ``{"job_memory_gib": 0.5}``).

    Raises TestbedError (naming the daemon's log) when they do not agree within `wait_s`; the
    daemons keep running until `down`.
    """
    say = progress or (lambda s: None)
    hosts = tb.topology.hosts
    root = tb.work_dir / "fusiond"
    first = f"{tb.address(hosts[0])}:{PEER_PORT}"
    nodes = []
    sock_dir = tb.short_dir("sock")
    for i, host in enumerate(hosts):
        addr = f"{tb.address(host)}:{PEER_PORT}"
        net: dict[str, Any] = {"listen": addr, "advertise": addr}
        if insecure:
            net |= {"insecure_plaintext": True, "allow_plaintext_remote": True}
        # Probes last 1 s, not the daemon's default 0.3 s: on 10-30 ms RTT links a 0.3 s
        # transfer spends a third of its time in TCP slow start and the probe reads 30-35 %
        # low (measured here: 20 Mbit/s at 30 ms -> 14.4 with 0.3 s, 19.1 with 1 s).
        cluster = {"mdns": False, "bootstrap": [first] if i else [],
                   "probe_target_s": PROBE_TARGET_S, "probe_repeats": 3,
                   "probe_max_bytes": 64 << 20, "probe_interval_s": 30.0}
        config = merge(DEV_SETTINGS, {"name": host, "net": net, "cluster": cluster,
                                      "metrics": {"listen": "127.0.0.1:9464"}})
        config = merge(config, dict(settings or {}))
        config = merge(config, dict((host_settings or {}).get(host, {})))
        nodes.append(_Node(i, root, config, socket_path=str(sock_dir / f"{host}.sock")))
    if not insecure:
        say("creating a cluster CA and a node certificate per host")
        make_credentials(nodes)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FUSION_") and k != "NOTIFY_SOCKET"}
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    for node, host in zip(nodes, hosts, strict=True):
        node.write_config()
        argv = [sys.executable, "-m", "fusiond", "--config", str(node.config_path)]
        procs.append(tb.exec(host, argv, log=node.log_path, env=env))
    say(f"started {len(nodes)} fusiond; waiting for them to agree on a scheduler")
    ok, why = False, "not checked"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        ok, why = agreement([n.status(2.0) for n in nodes], len(nodes))
        if ok:
            break
        dead = [(h, p.returncode) for h, p in zip(hosts, procs, strict=True)
                if p.poll() is not None]
        if dead:
            h, rc = dead[0]
            log = nodes[hosts.index(h)].log_text()[-1500:]
            raise TestbedError(f"fusiond on {h} exited with {rc}: {log}")
        time.sleep(0.5)
    if not ok:
        raise TestbedError(f"the fusiond cluster did not agree within {wait_s:g} s: {why} "
                           f"(logs: {root}/node*/fusiond.log)")
    lines = [f"fusiond cluster ({'PLAINTEXT' if insecure else 'mutual TLS'}): {why}"]
    for node, host in zip(nodes, hosts, strict=True):
        lines.append(f"  {host}: fusionctl --socket {node.socket} status")
    return FusiondCluster(dict(zip(hosts, nodes, strict=True)), "\n".join(lines))
