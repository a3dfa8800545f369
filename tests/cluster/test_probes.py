"""Link probes against links of known latency and bandwidth (the fake network serialises
frames at the configured rate)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusiond.cluster.probes import (
    LinkProber,
    ProbeConfig,
    ProbeFailed,
    bandwidth_from_ack,
    blend_weight,
    blended_spread,
    ewma,
    next_bandwidth,
    round_figure,
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
    hub = FakeHub(latency_s=0.005, bandwidth_bits_per_s=rate)
    sizes: list[int] = []
    a_net, a = wire(hub, "a", sizes=sizes)
    b_net, _ = wire(hub, "b")
    try:
        est = await a.probe("b")
        assert est.bandwidth_bits_per_s is not None and est.rtt_s is not None
        assert abs(est.bandwidth_bits_per_s - rate) / rate < 0.15, est
        assert 0.009 <= est.rtt_s < 0.05, est
        # Sized from the previous estimate: the last transfer targets ~target_s at this rate.
        want = rate / 8 * CFG.target_s
        assert abs(sizes[-1] - want) / want < 0.3 or sizes[-1] >= CFG.max_bytes - (1 << 20)
        # A second round averages into the estimate (EWMA), staying accurate.
        est2 = await a.probe("b")
        assert est2.bandwidth_bits_per_s is not None
        assert abs(est2.bandwidth_bits_per_s - rate) / rate < 0.15
    finally:
        await a_net.close()
        await b_net.close()


async def test_probe_of_an_unreachable_peer_fails_and_keeps_the_estimate() -> None:
    hub = FakeHub(latency_s=0.001, bandwidth_bits_per_s=50e6)
    # The first round gets a generous timeout (a loaded machine must not fail it); only the
    # round after the cut runs with a short one, so the failure comes quickly.
    cfg = dataclasses.replace(CFG, timeout_s=5.0, repeats=1)
    a_net, a = wire(hub, "a", cfg)
    b_net, _ = wire(hub, "b", cfg)
    try:
        first = await a.probe("b")
        assert first.bandwidth_bits_per_s is not None
        hub.cut("a", "b")
        a.config = dataclasses.replace(cfg, timeout_s=0.2)
        assert a.failures == {}
        with pytest.raises(ProbeFailed):
            await a.probe("b")
        assert a.links["b"] == first
        assert a.failures == {"b": 1}  # /metrics: fusion_cluster_probe_failures_total
        a.forget("b")
        assert a.failures == {}
    finally:
        await a_net.close()
        await b_net.close()


async def test_slow_start_does_not_skew_a_long_rtt_link() -> None:
    """TCP restarts in slow start on a new connection and after idling; on a 20 Mbit/s link
    with 30 ms RTT that made the daemon's default 0.3 s probe read about 30 % low. The fake
    link models slow start; the probe must read within 10 %, in the first round and in one
    after an idle period."""
    rate = 20e6
    hub = FakeHub(latency_s=0.015, bandwidth_bits_per_s=rate, initial_window=10 * 1448,
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
            assert est.bandwidth_bits_per_s is not None
            assert abs(est.bandwidth_bits_per_s - rate) / rate < 0.1, est
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
    hub = FakeHub(latency_s=0.002, bandwidth_bits_per_s=100e6)
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
            for (_src, _dst), (bw, rtt, _spread, at) in v.links.items():
                # Loose: three nodes gossip and probe at once on one loop, so on a loaded
                # machine the loop's own delays lower what they measure (64 % of the link was
                # seen in CI); accuracy is tested above, this is about every node holding a
                # real measurement of every pair: never above the link, never a placeholder.
                assert 0.2 * 100e6 < bw < 1.35 * 100e6 and rtt > 0.003 and at > 0
            for m in v.members:
                if m.node_id != v.node_id:
                    assert m.bandwidth_bits_per_s is not None and m.rtt_s is not None
    finally:
        await swarm.close()


# --- step changes: a round outside the estimate's band replaces it -----------------------------

BAND = ProbeConfig().steady_band


def test_round_figure_is_the_median_and_the_relative_half_range() -> None:
    assert round_figure([19e6]) == (19e6, 0.0)
    median, spread = round_figure([18e6, 20e6, 19e6])
    assert median == 19e6 and spread == pytest.approx(1e6 / 19e6)
    with pytest.raises(ValueError):
        round_figure([])


def test_a_step_replaces_the_estimate_and_noise_is_blended() -> None:
    # 100 -> 20 Mbit/s: today's EWMA alone would say 76 after the first round at 20
    rate, changed = next_bandwidth(100e6, 0.02, 20e6, 0.02, alpha=0.3, steady_band=BAND)
    assert (rate, changed) == (20e6, True)
    # 5 % off, tight samples: the same link measured again
    rate, changed = next_bandwidth(100e6, 0.02, 95e6, 0.02, alpha=0.3, steady_band=BAND)
    assert rate == pytest.approx(0.3 * 95e6 + 0.7 * 100e6) and not changed
    # 25 % off, but the round's own samples were +-25 % apart: not a clear step, blended, and
    # as it is 2.5x less accurate than the estimate, at 0.3 / 2.5**2
    rate, changed = next_bandwidth(100e6, 0.02, 75e6, 0.25, alpha=0.3, steady_band=BAND)
    assert rate == pytest.approx(100e6 - 0.048 * 25e6) and not changed
    # the reverse: a loose estimate (a first round whose window was still opening, +-42 %)
    # and a tight round that agrees with it: the round takes over (seen on CI: 80.7 Mbit/s
    # +-42 % on a 100 Mbit/s link, then the EWMA crawled 83, 85 over the next rounds)
    rate, changed = next_bandwidth(80.7e6, 0.42, 92e6, 0.04, alpha=0.3, steady_band=BAND)
    assert rate == pytest.approx(92e6) and not changed
    assert blended_spread(0.42, 0.04, alpha=0.3, steady_band=BAND) == pytest.approx(0.04)
    assert blend_weight(0.05, 0.02, alpha=0.3, steady_band=BAND) == pytest.approx(0.3)
    # the same 25 % off with tight samples is a step
    assert next_bandwidth(100e6, 0.02, 75e6, 0.02, alpha=0.3, steady_band=BAND) == (75e6, True)
    # the first round is the estimate
    assert next_bandwidth(None, 0.0, 42e6, 0.1, alpha=0.3, steady_band=BAND) == (42e6, True)


figure = st.floats(1e4, 1e11)
spread = st.floats(0.0, 0.5)


@given(old=figure, new=figure, s_old=spread, s_new=spread, alpha=st.floats(0.05, 1.0))
def test_the_estimate_lies_between_the_old_figure_and_the_round(
        old: float, new: float, s_old: float, s_new: float, alpha: float) -> None:
    rate, changed = next_bandwidth(old, s_old, new, s_new, alpha=alpha, steady_band=BAND)
    assert min(old, new) * (1 - 1e-12) <= rate <= max(old, new) * (1 + 1e-12)
    if changed:
        assert rate == new


@given(old=figure, s_old=spread, s_new=spread, up=st.booleans(),
       extra=st.floats(1.001, 100.0))
def test_any_step_beyond_both_bands_shows_in_one_round(
        old: float, s_old: float, s_new: float, up: bool, extra: float) -> None:
    """A new figure further from the estimate than both bands together is taken as is: a step
    change shows in the first round that measures it, however small the EWMA weight."""
    apart = (1 + max(BAND, s_old)) * (1 + max(BAND, s_new)) * extra
    new = old * apart if up else old / apart
    assert next_bandwidth(old, s_old, new, s_new, alpha=0.05, steady_band=BAND) == (new, True)


@settings(max_examples=200)
@given(true=figure, noise=st.lists(st.floats(-1.0, 1.0), min_size=2, max_size=40),
       s_round=st.floats(0.0, 0.1), alpha=st.floats(0.05, 1.0))
def test_a_steady_link_is_never_replaced_and_stays_within_its_band(
        true: float, noise: list[float], s_round: float, alpha: float) -> None:
    """Rounds of a steady link whose results scatter within the band (in log space, around the
    true rate) are always blended: the estimate never jumps and stays within the band."""
    lim = math.log1p(BAND)
    rounds = [true * math.exp(lim * x) for x in noise]
    est, _ = next_bandwidth(None, 0.0, rounds[0], s_round, alpha=alpha, steady_band=BAND)
    for r in rounds[1:]:
        est, changed = next_bandwidth(est, s_round, r, s_round, alpha=alpha, steady_band=BAND)
        assert not changed
        assert true / (1 + BAND) * (1 - 1e-9) <= est <= true * (1 + BAND) * (1 + 1e-9)


@pytest.mark.parametrize(("before", "after"), [(100e6, 20e6), (20e6, 100e6)])
async def test_a_reshaped_link_shows_in_the_next_round(before: float, after: float) -> None:
    """The link's rate steps between two rounds (the fake serialises at the new rate at
    once): the round after the step reports the new rate within 15 %, and says it replaced
    the estimate; a round on an unchanged link does not. Before change detection the EWMA made
    the first round after 100 -> 20 Mbit/s read 76 Mbit/s."""
    hub = FakeHub(latency_s=0.005, bandwidth_bits_per_s=before)
    a_net, a = wire(hub, "a")
    b_net, _ = wire(hub, "b")
    try:
        first = await a.probe("b")
        assert first.changed and first.bandwidth_bits_per_s is not None
        assert abs(first.bandwidth_bits_per_s - before) / before < 0.15, first
        steady = await a.probe("b")
        assert not steady.changed, (first, steady)
        assert steady.measured_at >= first.measured_at
        assert 0 <= steady.bandwidth_spread_ratio < BAND
        hub.bandwidth_bits_per_s = after
        est = await a.probe("b")
        assert est.bandwidth_bits_per_s is not None
        assert abs(est.bandwidth_bits_per_s - after) / after < 0.15, (steady, est)
        assert est.changed
    finally:
        await a_net.close()
        await b_net.close()
