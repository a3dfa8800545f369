"""Real zeroconf on 127.0.0.1 only (never a real interface): two Cluster instances of one
cluster find each other by mDNS alone; a third of another cluster id is ignored."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest

from fusiond.cluster import Cluster
from fusiond.cluster.discovery import MdnsDiscovery, parse_txt
from protocol.messages import NodeProfile
from tests.cluster.fakes import FAST, FakeHub, FakeNet, until

MDNS = dataclasses.replace(FAST, mdns=True, mdns_interfaces=("127.0.0.1",))


async def test_two_nodes_find_each_other_by_mdns_and_ignore_another_cluster() -> None:
    hub = FakeHub()
    cluster_id = f"mdns-test-{uuid.uuid4().hex[:8]}"
    nodes: list[Cluster] = []
    nets: list[FakeNet] = []
    try:
        for node_id, cid in (("m1", cluster_id), ("m2", cluster_id),
                             ("stranger", f"other-{uuid.uuid4().hex[:8]}")):
            net = FakeNet(hub, f"{node_id}-{cluster_id}")
            node = Cluster(node_id=net.node_id, cluster_id=cid, net=net, advertise=net.address,
                           profile=lambda: NodeProfile(gflops=1.0), config=MDNS)
            net.handler = node.handle
            nodes.append(node)
            nets.append(net)
        # Registration probes the name for ~1 s: start all three at once.
        await asyncio.gather(*(node.start() for node in nodes))
        m1, m2, stranger = nodes

        def found() -> bool:
            a, b = m1.view().member(m2.node_id), m2.view().member(m1.node_id)
            return (a is not None and b is not None and a.state == b.state == "alive")

        await until(found, 10, "m1 and m2 to find each other over mDNS")
        assert m1.view().member(m2.node_id).source == "mdns"  # type: ignore[union-attr]
        assert m2.view().member(m1.node_id).source == "mdns"  # type: ignore[union-attr]
        # The stranger advertised on the same service type but another cluster id.
        for n in (m1, m2):
            assert n.view().member(stranger.node_id) is None
        assert [m.node_id for m in stranger.view().members] == [stranger.node_id]
        assert all(net.peer_addresses.get(stranger.node_id) is None for net in nets[:2])
    finally:
        for node in nodes:
            await node.close()
            await node.close()  # idempotent
        for net in nets:
            await net.close()


async def test_discovery_close_is_idempotent_and_txt_parsing_is_strict() -> None:
    found: list[str] = []
    d = MdnsDiscovery(node_id="solo", cluster_id=f"c-{uuid.uuid4().hex[:8]}",
                      advertise=("127.0.0.1", 1), on_found=lambda n, a, s: found.append(n),
                      interfaces=["127.0.0.1"])
    await d.start()
    await d.close()
    await d.close()
    assert found == []
    assert parse_txt({b"node_id": b"x", b"bad": b"\xff", b"none": None}) == {"node_id": "x"}


async def test_an_address_mdns_cannot_advertise_is_a_clear_error() -> None:
    from fusiond.cluster import DiscoveryError

    for host in ("::1", "0.0.0.0"):
        d = MdnsDiscovery(node_id="v6", cluster_id="c", advertise=(host, 1),
                          on_found=lambda n, a, s: None, interfaces=["127.0.0.1"] if host ==
                          "::1" else [])
        try:
            with pytest.raises(DiscoveryError, match="advertise"):
                await d.start()
        finally:
            await d.close()
