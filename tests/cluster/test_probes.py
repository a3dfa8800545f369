"""Link probes against links of known latency and bandwidth (the fake network serialises
frames at the configured rate)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from fusiond.cluster.probes import (
    LinkProber,
    ProbeConfig,
    ProbeFailed,
    bandwidth_from_ack,
    ewma,
    transfer_duration,
    transfer_size,
)
from protocol.frames import Buffer
from protocol.messages import Message, Ping, Pong, ProbeAck, ProbeData
from tests.cluster.fakes import FAST, FakeHub, FakeNet, Swarm, until

CFG = ProbeConfig(target_s=0.1, repeats=3, max_bytes=4 << 20, min_bytes=16 << 10,
                  initial_bytes=64 << 10, chunk_bytes=256 << 10, timeout_s=1.0)


def wire(hub: FakeHub, node_id: str, cfg: ProbeConfig = CFG,
         sizes: list[int] | None = None) -> tuple[FakeNet, LinkProber]:
    net = FakeNet(hub, node_id)

    async def send(peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None:
        if sizes is not None and isinstance(msg, ProbeData) and msg.seq == 0:
            sizes.append(sum(memoryview(b).nbytes for b in payload) * msg.count)
        await net.send(peer, msg, payload)

    prober = LinkProber(send=send, config=cfg)

    async def handle(peer: str, msg: Message) -> bool:
        if isinstance(msg, Ping):
            await net.send(peer, prober.on_ping(peer, msg))
        elif isinstance(msg, Pong):
            prober.on_pong(peer, msg)
        elif isinstance(msg, ProbeData):
            ack = prober.on_probe_data(peer, msg, asyncio.get_running_loop().time())
            if ack is not None:
                await net.send(peer, ack)
        elif isinstance(msg, ProbeAck):
            prober.on_probe_ack(peer, msg)
        return True

    net.handler = handle
    return net, prober


@pytest.mark.parametrize("rate", [20e6, 200e6])
async def test_bandwidth_and_rtt_of_a_shaped_link(rate: float) -> None:
    hub = FakeHub(latency_s=0.005, bandwidth_bps=rate)
    sizes: list[int] = []
    a_net, a = wire(hub, "a", sizes=sizes)
    b_net, _ = wire(hub, "b")
    try:
        est = await a.probe("b")
        assert est.bandwidth_bps is not None and est.rtt_s is not None
        assert abs(est.bandwidth_bps - rate) / rate < 0.15, est
        assert 0.009 <= est.rtt_s < 0.05, est
        # Sized from the previous estimate: the last transfer targets ~target_s at this rate.
        want = rate / 8 * CFG.target_s
        assert abs(sizes[-1] - want) / want < 0.3 or sizes[-1] >= CFG.max_bytes - (1 << 20)
        # A second round averages into the estimate (EWMA), staying accurate.
        est2 = await a.probe("b")
        assert est2.bandwidth_bps is not None
        assert abs(est2.bandwidth_bps - rate) / rate < 0.15
    finally:
        await a_net.close()
        await b_net.close()


async def test_probe_of_an_unreachable_peer_fails_and_keeps_the_estimate() -> None:
    hub = FakeHub(latency_s=0.001, bandwidth_bps=50e6)
    # The first round gets a generous timeout (a loaded machine must not fail it); only the
    # round after the cut runs with a short one, so the failure comes quickly.
    cfg = dataclasses.replace(CFG, timeout_s=5.0, repeats=1)
    a_net, a = wire(hub, "a", cfg)
    b_net, _ = wire(hub, "b", cfg)
    try:
        first = await a.probe("b")
        assert first.bandwidth_bps is not None
        hub.cut("a", "b")
        a.config = dataclasses.replace(cfg, timeout_s=0.2)
        with pytest.raises(ProbeFailed):
            await a.probe("b")
        assert a.links["b"] == first
    finally:
        await a_net.close()
        await b_net.close()


async def test_slow_start_does_not_skew_a_long_rtt_link() -> None:
    """TCP restarts in slow start on a new connection and after idling; on a 20 Mbit/s link
    with 30 ms RTT that made the daemon's default 0.3 s probe read about 30 % low. The fake
    link models slow start; the probe must read within 10 %, in the first round and in one
    after an idle period."""
    rate = 20e6
    hub = FakeHub(latency_s=0.015, bandwidth_bps=rate, initial_window=10 * 1448,
                  idle_restart_s=0.1)
    cfg = ProbeConfig(timeout_s=5.0)  # the daemon's sizes and durations
    a_net, a = wire(hub, "a", cfg)
    b_net, _ = wire(hub, "b", cfg)
    try:
        # The fake does model the problem: a cold transfer of a probe's size reads low.
        await asyncio.sleep(0.15)
        cold, _ = await a.bulk("b", int(rate / 8 * cfg.target_s), 0.03)
        assert cold < 0.9 * rate, cold
        await asyncio.sleep(0.15)  # idle again: the next round starts cold
        for _ in range(2):
            est = await a.probe("b")
            assert est.bandwidth_bps is not None
            assert abs(est.bandwidth_bps - rate) / rate < 0.1, est
            await asyncio.sleep(0.15)
    finally:
        await a_net.close()
        await b_net.close()


def test_transfer_duration_and_size() -> None:
    cfg = ProbeConfig(target_s=0.3, rtt_factor=10.0, min_bytes=64 << 10, max_bytes=64 << 20,
                      initial_bytes=256 << 10)
    assert transfer_duration(cfg, 0.001) == 0.3  # short links: the target
    assert transfer_duration(cfg, 0.1) == pytest.approx(1.0)  # long ones: 10 RTTs
    assert transfer_size(cfg, None, 1.0) == 256 << 10  # nothing known yet
    assert transfer_size(cfg, 20e6, 0.3) == 750_000
    assert transfer_size(cfg, 1e3, 0.3) == 64 << 10  # at least min_bytes
    assert transfer_size(cfg, 100e9, 1.0) == 64 << 20  # at most max_bytes


def test_bandwidth_from_ack_takes_the_smaller_estimate() -> None:
    # The receiver's span is the longer one (its view is the lower estimate): use it.
    ack = ProbeAck(probe_id=1, received=4, nbytes=4_000_000, elapsed_s=0.6)
    bw, took = bandwidth_from_ack(ack, 4, 4_000_000, duration_s=0.5, rtt_s=0.1)
    assert bw == pytest.approx(3_000_000 * 8 / 0.6) and took == 0.6
    # The first frame was handed over late (reordering after a loss): the receiver's span is
    # short and would over-estimate; the sender's timing minus one RTT is the honest one.
    ack = ProbeAck(probe_id=1, received=4, nbytes=4_000_000, elapsed_s=0.15)
    bw, took = bandwidth_from_ack(ack, 4, 4_000_000, duration_s=0.5, rtt_s=0.1)
    assert bw == pytest.approx(4_000_000 * 8 / 0.4) and took == pytest.approx(0.4)
    # All frames in one read: the sender's timing.
    ack = ProbeAck(probe_id=1, received=4, nbytes=4_000_000, elapsed_s=0.0)
    bw, took = bandwidth_from_ack(ack, 4, 4_000_000, duration_s=0.5, rtt_s=0.1)
    assert bw == pytest.approx(4_000_000 * 8 / 0.4) and took == pytest.approx(0.4)


def test_ewma() -> None:
    assert ewma(None, 5.0, 0.3) == 5.0
    assert ewma(10.0, 0.0, 0.3) == pytest.approx(7.0)


async def test_cluster_gossips_the_link_matrix() -> None:
    hub = FakeHub(latency_s=0.002, bandwidth_bps=100e6)
    cfg = dataclasses.replace(FAST, probes=True, probe_interval_s=0.3, probe_target_s=0.1,
                              probe_repeats=2, probe_max_bytes=2 << 20, probe_timeout_s=1.0)
    swarm = Swarm(hub, cfg)
    try:
        for nid in ("p", "q", "r"):
            await swarm.add(nid, bootstrap=[swarm.addresses["p"]] if nid != "p" else [])

        def full_matrix() -> bool:
            return all(len(v.links) == 6 for v in swarm.views().values())

        await until(full_matrix, 8, "every node to hold the 3x2 link matrix")
        for v in swarm.views().values():
            for (_src, _dst), (bw, rtt) in v.links.items():
                # Loose: three nodes gossip and probe at once on one loop, so on a loaded
                # machine the loop's own delays lower what they measure (64 % of the link was
                # seen in CI); accuracy is tested above, this is about every node holding a
                # real measurement of every pair: never above the link, never a placeholder.
                assert 0.2 * 100e6 < bw < 1.35 * 100e6 and rtt > 0.003
            for m in v.members:
                if m.node_id != v.node_id:
                    assert m.bandwidth_bps is not None and m.rtt_s is not None
    finally:
        await swarm.close()
