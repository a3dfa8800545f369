"""Real-daemon test harness: separate fusiond processes on loopback, short timers."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from fusionctl.local import LocalNode, agreement, make_credentials, merge, summary, wait_until

TIMERS: dict[str, Any] = {
    "profile_benchmark": False,
    "log_level": "info",
    "start_timeout_s": 30.0,
    "stop_timeout_s": 5.0,
    "metrics": {"listen": ""},
    "dashboard": {"listen": ""},
    "net": {"listen": "127.0.0.1:0", "connect_timeout_s": 1.0, "handshake_timeout_s": 2.0,
            "backoff_initial_s": 0.05, "backoff_max_s": 0.5, "test_drop_switch": True},
    "cluster": {"mdns": False, "mdns_interfaces": ["127.0.0.1"], "gossip_interval_s": 0.2,
                "suspect_after_s": 1.5, "dead_after_s": 3.0, "election_timeout_s": 1.5,
                "leader_heartbeat_s": 0.25, "leader_lease_s": 1.0, "election_stagger_s": 0.2,
                "election_jitter_s": 0.1, "election_grace_s": 1.0, "probes": False,
                "bootstrap_retry_s": 0.3},
}
"""Small intervals so five daemons converge in seconds on a loaded 2-core machine."""

AGREE_S = 10.0


class Cluster:
    """N LocalNodes under one directory sharing a CA; always stopped at teardown."""

    def __init__(self, root: Path, n: int, settings: Mapping[str, Any] | None = None,
                 tls: bool = True, credentials: bool = True) -> None:
        """`tls` False: plaintext links. `credentials` False: TLS nodes without certificates
        (they wait for `fusionctl init` / `join`)."""
        base = merge(TIMERS, settings or {})
        if not tls:
            base = merge(base, {"net": {"insecure_plaintext": True}})
        self.nodes = [LocalNode(i, root, dict(base)) for i in range(n)]
        self.cluster_id = make_credentials(self.nodes) if tls and credentials else None

    def start(self, nodes: Sequence[LocalNode] | None = None) -> None:
        for node in nodes if nodes is not None else self.nodes:
            node.start()

    def wait_up(self, nodes: Sequence[LocalNode] | None = None, timeout: float = 30.0) -> None:
        """Until every node runs its peer services (start-up: imports, keys, sockets)."""
        nodes = list(nodes if nodes is not None else self.nodes)

        def running(n: LocalNode) -> bool:
            st = n.status(1.0)
            return st is not None and st["node"]["phase"] == "running"

        ok, _why, _ = wait_until(lambda: (all(running(n) for n in nodes), "starting"), timeout)
        assert ok, self.explain("daemons did not start")

    def address(self, node: LocalNode) -> str:
        st = node.status()
        assert st is not None
        addr = st["node"]["address"]
        assert isinstance(addr, str) and addr != "-", st
        return addr

    def node_id(self, node: LocalNode) -> str:
        st = node.status()
        assert st is not None
        return str(st["node"]["node_id"])

    def statuses(self, nodes: Sequence[LocalNode]) -> list[dict[str, Any] | None]:
        return [n.status(2.0) for n in nodes]

    def wait_agreement(self, nodes: Sequence[LocalNode] | None = None,
                       timeout: float = AGREE_S, not_leader: str | None = None
                       ) -> tuple[dict[str, Any], float]:
        """Until `nodes` agree on members, scheduler (other than `not_leader`) and term;
        returns (summary, seconds)."""
        nodes = list(nodes if nodes is not None else self.nodes)

        def check() -> tuple[bool, str]:
            statuses = self.statuses(nodes)
            ok, why = agreement(statuses, len(nodes))
            if ok and not_leader is not None and summary(statuses[0])["leader"] == not_leader:
                return False, f"still agreeing on the old scheduler {not_leader}"
            return ok, why

        ok, why, took = wait_until(check, timeout, 0.1)
        assert ok, self.explain(f"no agreement within {timeout} s: {why}")
        return summary(nodes[0].status()), took

    def wait_for(self, check: Callable[[], tuple[bool, str]], timeout: float, what: str
                 ) -> float:
        ok, why, took = wait_until(check, timeout, 0.1)
        assert ok, self.explain(f"{what} not within {timeout} s: {why}")
        return took

    def block(self, node: LocalNode, node_ids: Sequence[str]) -> None:
        node.api("POST", "/v1/test/block", {"node_ids": list(node_ids)})

    def explain(self, headline: str) -> str:
        """A failure message with each node's summary and log tail (for debugging CI)."""
        parts = [headline]
        for n in self.nodes:
            parts.append(f"--- node{n.index} alive={n.alive()} {summary(n.status(1.0))}")
            parts.extend(n.log_text().splitlines()[-15:])
        return "\n".join(parts)

    def stop(self) -> None:
        """SIGTERM everyone at once, then wait (SIGKILL after 10 s)."""
        for n in self.nodes:
            n.signal(15)
        for n in self.nodes:
            t0 = time.monotonic()
            code = n.stop(10.0)
            if time.monotonic() - t0 > 5 or code not in (0, None, -9):
                # Visible in pytest's warnings summary: a daemon slow to drain, or failing.
                warnings.warn(f"node{n.index} stopped with code {code} after "
                              f"{time.monotonic() - t0:.1f} s; log tail:\n"
                              + "\n".join(n.log_text().splitlines()[-20:]), stacklevel=2)


def iter_members(status: Mapping[str, Any] | None) -> Iterator[Mapping[str, Any]]:
    if status and status.get("cluster"):
        yield from status["cluster"]["members"]


def state_of(status: Mapping[str, Any] | None, node_id: str) -> str | None:
    for m in iter_members(status):
        if m["node_id"] == node_id:
            return str(m["state"])
    return None


def now() -> float:
    return time.monotonic()
