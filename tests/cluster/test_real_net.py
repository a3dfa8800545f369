"""Cluster over the real PeerNetwork (plaintext, loopback, one process): bootstrap, gossip,
election and probes through real sockets and the real codec."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fusiond.cluster import Cluster
from fusiond.net import NetConfig, PeerNetwork
from protocol.messages import Message, NodeProfile
from tests.cluster.fakes import FAST, agreed_leader, until

# Real sockets cost more CPU than the fake: timers closer to the daemon tests' than to FAST,
# so a loaded machine does not make the failure detector see ghosts.
CFG = dataclasses.replace(FAST, gossip_interval_s=0.2, suspect_after_s=1.5, dead_after_s=3.0,
                          election_timeout_s=1.0, leader_heartbeat_s=0.2, leader_lease_s=0.7,
                          election_grace_s=0.6, probes=True, probe_interval_s=0.5,
                          probe_target_s=0.05, probe_repeats=2, probe_max_bytes=4 << 20,
                          probe_timeout_s=2.0)
NET = NetConfig(connect_timeout_s=1.0, handshake_timeout_s=1.0, backoff_initial_s=0.05,
                backoff_max_s=0.5, close_timeout_s=1.0)


async def test_three_nodes_over_real_sockets() -> None:
    cluster_id = f"real-{uuid.uuid4().hex[:8]}"
    nets: list[PeerNetwork] = []
    nodes: list[Cluster] = []
    try:
        for i in range(3):
            box: dict[str, Cluster] = {}

            async def handler(peer: str, msg: Message, box: dict[str, Any] = box) -> None:
                await box["node"].handle(peer, msg)

            net = PeerNetwork(node_id=f"r{i}", cluster_id=cluster_id, listen=("127.0.0.1", 0),
                              tls=None, handler=handler, config=NET)
            await net.start()
            await net.ready()
            bootstrap = (nets[0].address,) if nets else ()
            node = Cluster(node_id=f"r{i}", cluster_id=cluster_id, net=net,
                           advertise=net.address, profile=lambda: NodeProfile(gflops=1.0),
                           config=dataclasses.replace(CFG, bootstrap=bootstrap))
            box["node"] = node
            await node.start()
            nets.append(net)
            nodes.append(node)

        def converged() -> bool:
            views = {n.node_id: n.view() for n in nodes}
            return (all(v.alive_voters == 3 for v in views.values())
                    and agreed_leader(views) is not None)

        await until(converged, 15, "3 real nodes to agree on members and a leader")

        def measured() -> bool:
            return all(len(n.view().links) == 6 for n in nodes)

        await until(measured, 15, "the full link matrix over real sockets")
        for (a, b), (bw, rtt, *_) in nodes[0].view().links.items():
            print(f"{a}->{b}: {bw / 1e6:.0f} Mbit/s rtt {rtt * 1e3:.2f} ms")
            assert bw > 1e6 and 0 < rtt < 1.0
    finally:
        for node in nodes:
            await node.close()
        for net in nets:
            await net.close()
