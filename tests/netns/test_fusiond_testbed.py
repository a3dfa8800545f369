"""fusiond on the emulated WAN: a daemon per host (mutual TLS from one CA, one bootstrap
address), they elect one scheduler, and the link matrix their own probes gossip matches the
shaped links; `down` stops every daemon."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deploy.testbed import list_namespaces, namespace_pids, testbed
from tests.netns.conftest import (
    SETTLE_PROBE_INTERVAL_S,
    needs_delay_stage,
    needs_netns,
    wait_for_settled_links,
)

pytestmark = [pytest.mark.netns, pytest.mark.multidaemon, pytest.mark.slow, needs_netns]


def test_fusiond_per_host_agrees_and_measures_the_shaped_links(state_dir: Path) -> None:
    why = needs_delay_stage()
    if why:
        pytest.skip(why)
    from deploy.testbed.fusion import start_fusiond

    name = f"fzt{os.getpid() % 100000}d"
    with testbed("three-hosts", name=name, state_dir=state_dir) as tb:
        cluster = start_fusiond(tb, wait_s=60, settings={
            "cluster": {"probe_interval_s": SETTLE_PROBE_INTERVAL_S}})
        assert "mutual TLS" in cluster.summary and "term" in cluster.summary
        ids = {}
        for host, node in cluster.nodes.items():
            st = node.status()
            assert st is not None
            ids[st["node"]["node_id"]] = host
            assert len(namespace_pids(tb.ns(host))) >= 1
        # Every daemon probes every peer at start; wait until node a holds the full matrix,
        # each link measured in two rounds.
        want = {(a, b) for a in ids for b in ids if a != b}
        links = wait_for_settled_links([cluster.nodes["a"]], want)
        topo = tb.topology
        lines, bad = [], []
        for src, dst in sorted(want):
            got = links.get(src, {}).get(dst)
            spec = topo.link(ids[src], ids[dst])
            if got is None:
                bad.append(f"{ids[src]}->{ids[dst]}: not measured")
                continue
            err = got["bandwidth_bits_per_s"] / spec.bandwidth_bits_per_s - 1
            lines.append(f"{ids[src]}->{ids[dst]}: {got['bandwidth_bits_per_s'] / 1e6:.1f} Mbit/s "
                         f"({err:+.1%}), rtt {got['rtt_s'] * 1e3:.1f} ms "
                         f"(configured {spec.rtt_s * 1e3:g})")
            if abs(err) > 0.15:
                bad.append(lines[-1])
            # Ping/Pong share the connection with probe bulk: allow queueing, never less.
            if not spec.rtt_s - 0.001 <= got["rtt_s"] <= spec.rtt_s + 0.010:
                bad.append(lines[-1])
        print("\n".join(lines))
        assert not bad, "\n".join(bad)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{name}-")]
    for node in cluster.nodes.values():
        assert node.status(1.0) is None  # the daemons are gone
