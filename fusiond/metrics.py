"""Prometheus metrics, named ``fusion_<subsystem>_<name>_<unit>``, served on loopback.

Values are read from the services at scrape time (a custom collector), so nothing is double
bookkept and a scrape always shows the same numbers as ``fusionctl status``. Each daemon has
its own registry: several daemons in one test process never share counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fusiond.units import bytes_per_s_from_bits_per_s

if TYPE_CHECKING:  # the records it reads, for annotations only
    from fusiond.cluster import ClusterView
    from fusiond.net.transport import NetCounts, PeerStats

log = logging.getLogger("fusiond.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _none() -> None:
    return None


class DaemonCollector(Collector):
    """Collects from callables returning the live state; each may return None when not up:
    the transport's per-peer `PeerStats` and its `NetCounts` (refusals), the cluster's
    `ClusterView` and its failed probe rounds per peer, read as the typed records they are."""

    def __init__(
        self,
        *,
        node_id: Callable[[], str],
        net_stats: Callable[[], Mapping[str, PeerStats] | None],
        cluster_view: Callable[[], ClusterView | None],
        started_at: float,
        net_counts: Callable[[], NetCounts | None] = _none,
        probe_failures: Callable[[], Mapping[str, int] | None] = _none,
    ) -> None:
        self._node_id = node_id
        self._net_stats = net_stats
        self._cluster_view = cluster_view
        self._started_at = started_at
        self._net_counts = net_counts
        self._probe_failures = probe_failures

    def describe(self) -> Iterator[Any]:
        return iter(())  # unchecked collector: metric names are known only at scrape time

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("fusion_daemon_start_time_seconds",
                               "Unix time the daemon started", labels=["node"])
        up.add_metric([self._node_id()], self._started_at)
        yield up
        yield from self._collect_net()
        yield from self._collect_refusals()
        yield from self._collect_cluster()

    def _collect_net(self) -> Iterator[Any]:
        stats = self._net_stats()
        if stats is None:
            return
        sent = CounterMetricFamily("fusion_net_sent_bytes", "Bytes sent to a peer",
                                   labels=["peer", "stage"])
        recv = CounterMetricFamily("fusion_net_received_bytes", "Bytes received from a peer",
                                   labels=["peer", "stage"])
        depth = GaugeMetricFamily("fusion_net_queue_depth_frames",
                                  "Frames queued for a peer", labels=["peer", "lane"])
        conn = GaugeMetricFamily("fusion_net_connected_peers",
                                 "1 when a connection to the peer is open", labels=["peer"])
        redial = CounterMetricFamily("fusion_net_reconnects",
                                     "Links to a peer dialled again after one was up",
                                     labels=["peer"])
        for peer, st in stats.items():
            # "wire": every byte the sockets carried (frames and headers included)
            sent.add_metric([peer, "wire"], float(st.bytes_sent))
            recv.add_metric([peer, "wire"], float(st.bytes_received))
            depth.add_metric([peer, "control"], float(st.control_queue_depth))
            depth.add_metric([peer, "bulk"], float(st.bulk_queue_depth))
            conn.add_metric([peer], 1.0 if st.connected else 0.0)
            redial.add_metric([peer], float(st.reconnects))
        yield from (sent, recv, depth, conn, redial)

    def _collect_refusals(self) -> Iterator[Any]:
        counts = self._net_counts()
        if counts is None:
            return
        tls = CounterMetricFamily("fusion_net_tls_refusals",
                                  "Peer connections refused by the TLS handshake or the trust "
                                  "check, by check", labels=["check"])
        for check, n in sorted(counts.tls_refusals.items()):
            tls.add_metric([check], float(n))
        join = CounterMetricFamily("fusion_cluster_join_refusals",
                                   "Join requests this member refused, by reason",
                                   labels=["reason"])
        for reason, n in sorted(counts.join_refusals.items()):
            join.add_metric([reason], float(n))
        yield from (tls, join)

    def _collect_cluster(self) -> Iterator[Any]:
        view = self._cluster_view()
        if view is None:
            return
        rtt = GaugeMetricFamily("fusion_cluster_rtt_seconds", "Measured RTT to a peer",
                                labels=["peer"])
        bw = GaugeMetricFamily("fusion_cluster_bandwidth_bytes_per_second",
                               "Measured bandwidth to a peer (the prober's estimate)",
                               labels=["peer"])
        members = GaugeMetricFamily("fusion_cluster_members", "Members by state",
                                    labels=["state"])
        counts: dict[str, int] = {}
        for m in view.members:
            state = str(m.state)  # a StrEnum: its value
            counts[state] = counts.get(state, 0) + 1
            if m.rtt_s is not None:
                rtt.add_metric([m.node_id], m.rtt_s)
            if m.bandwidth_bits_per_s is not None:
                bw.add_metric([m.node_id], bytes_per_s_from_bits_per_s(m.bandwidth_bits_per_s))
        for state, n in sorted(counts.items()):
            members.add_metric([state], n)
        term = GaugeMetricFamily("fusion_cluster_term", "Current election term")
        term.add_metric([], float(view.term))
        leader = GaugeMetricFamily("fusion_cluster_leader",
                                   "1 when this node is the elected scheduler")
        leader.add_metric([], 1.0 if view.leader == self._node_id() else 0.0)
        quorum = GaugeMetricFamily("fusion_cluster_quorum",
                                   "1 when this node sees a majority of members")
        quorum.add_metric([], 1.0 if view.has_quorum else 0.0)
        yield from (rtt, bw, members, term, leader, quorum)
        failures = self._probe_failures()
        if failures is not None:
            probes = CounterMetricFamily("fusion_cluster_probe_failures",
                                         "Link probe rounds to a peer that failed",
                                         labels=["peer"])
            for peer, n in sorted(failures.items()):
                probes.add_metric([peer], float(n))
            yield probes


class MetricsServer:
    """Serves ``/metrics`` of one registry (and ``/healthz``: 200 "ok" while the daemon runs)
    on a loopback host:port (a service)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.address: tuple[str, int] | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._handle)
        app.router.add_get("/healthz", self._healthz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port)
        await site.start()
        self._runner = runner
        server = getattr(site, "_server", None)
        socks = getattr(server, "sockets", None) or []
        self.address = socks[0].getsockname()[:2] if socks else (self._host, self._port)
        log.info("metrics on http://%s:%d/metrics", *self.address)

    async def ready(self) -> None:
        """Ready once start() returned: the port is bound."""

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()


def make_registry(*collectors: Collector, process: bool = True) -> CollectorRegistry:
    """A registry of its own (never the process-global one: tests run several daemons), with
    the client library's process (`process_*`: CPU, memory, open files), platform
    (`python_info`) and garbage-collector (`python_gc_*`) collectors unless `process` is off,
    and `fusion_build_info`."""
    reg = CollectorRegistry(auto_describe=False)
    if process:
        from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        GCCollector(registry=reg)
    reg.register(BuildInfo())
    for c in collectors:
        reg.register(c)
    return reg


class BuildInfo(Collector):
    """`fusion_build_info{version,protocol,python} 1`: which fusiond runs (join it on the
    labels to tell members apart in a mixed cluster)."""

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        import platform

        import fusiond
        import protocol

        g = GaugeMetricFamily("fusion_build_info", "The fusiond that runs (always 1)",
                              labels=["version", "protocol", "python"])
        g.add_metric([fusiond.__version__, str(protocol.PROTOCOL_VERSION),
                      platform.python_version()], 1.0)
        yield g


def now() -> float:
    return time.time()
