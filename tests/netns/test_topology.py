"""Topology files parse, resolve the most specific rule, and reject what is wrong (no root)."""

from __future__ import annotations

import tomllib

import pytest

from deploy.testbed.bed import shaping_commands
from deploy.testbed.topology import (
    TOPOLOGY_DIR,
    TopologyError,
    load_topology,
    parse_rate,
    parse_time,
    parse_topology,
)


def test_rates_and_times_parse_like_tc() -> None:
    assert parse_rate("8mbit", "x") == 8_000_000
    assert parse_rate("1Gbit", "x") == 1_000_000_000
    assert parse_rate("10gbit", "x") == 10_000_000_000
    assert parse_rate(2_500_000, "x") == 2_500_000
    assert parse_time("40ms", "x") == pytest.approx(0.04)
    assert parse_time("0.5ms", "x") == pytest.approx(0.0005)
    assert parse_time(30, "x") == pytest.approx(0.03)  # bare numbers are milliseconds
    with pytest.raises(TopologyError, match="bits"):
        parse_rate("100mbps", "link[0].bandwidth")
    with pytest.raises(TopologyError, match=r"link\[0\]\.rtt"):
        parse_time("soon", "link[0].rtt")


def test_bundled_topologies_are_valid_and_small_enough() -> None:
    files = sorted(TOPOLOGY_DIR.glob("*.toml"))
    assert {p.stem for p in files} >= {"three-hosts", "two-groups", "four-groups", "mixed-slow"}
    for p in files:
        t = load_topology(p)
        assert 2 <= len(t.hosts) <= 8, p
        for a, b in t.pairs():
            assert t.link(a, b) == t.link(b, a)


def test_two_groups_is_fast_inside_and_slow_between() -> None:
    t = load_topology("two-groups")
    assert t.link("e1", "e2").bandwidth_bits_per_s == 10_000_000_000
    assert t.link("w3", "w4").bandwidth_bits_per_s == 10_000_000_000
    between = t.link("e1", "w4")
    assert between.bandwidth_bits_per_s == 100_000_000
    assert between.rtt_s == pytest.approx(0.04)


def test_sampled_pairs_cover_each_group_pair_once() -> None:
    t = load_topology("two-groups")
    sample = t.representative_pairs()
    assert len(sample) == 4  # east-east, east-west, west-east, west-west
    assert {(t.group_of(a), t.group_of(b)) for a, b in sample} == {
        ("east", "east"), ("east", "west"), ("west", "east"), ("west", "west")}
    assert len(load_topology("three-hosts").representative_pairs()) == 6


def test_four_groups_has_the_papers_three_link_classes() -> None:
    t = load_topology("four-groups")
    rates = {t.link(a, b).bandwidth_bits_per_s for a, b in t.pairs()}
    assert rates == {1_000_000_000, 50_000_000, 8_000_000}
    assert t.link("a1", "c2").bandwidth_bits_per_s == 8_000_000
    assert t.link("a1", "b2").bandwidth_bits_per_s == 50_000_000


def test_the_most_specific_rule_wins() -> None:
    t = parse_topology(tomllib.loads('''
        name = "t"
        [defaults]
        bandwidth = "1gbit"
        [[group]]
        name = "g"
        hosts = ["a", "b", "c"]
        bandwidth = "10gbit"
        [[group]]
        name = "h"
        hosts = ["x"]
        [[link]]
        between = ["g", "h"]
        bandwidth = "100mbit"
        rtt = "20ms"
        [[link]]
        between = ["a", "h"]
        bandwidth = "50mbit"
        [[link]]
        between = ["a", "b"]
        bandwidth = "5mbit"
        rtt = "1ms"
        [host.x]
        cpu = 0.5
    '''))
    assert t.link("b", "c").bandwidth_bits_per_s == 10_000_000_000
    assert t.link("a", "b").bandwidth_bits_per_s == 5_000_000
    assert t.link("b", "x").bandwidth_bits_per_s == 100_000_000
    assert t.link("x", "a").bandwidth_bits_per_s == 50_000_000
    assert t.link("x", "a").rtt_s == 0.0  # a link rule states its own RTT (default 0)
    assert t.cpu == {"x": 0.5}


@pytest.mark.parametrize(("doc", "match"), [
    ('name = "t"\nhosts = ["a"]', "at least 2 hosts"),
    ('name = "t"\nhosts = ["a", "a"]', "listed twice"),
    ('name = "t"\nhosts = ["a", "Bad_Name"]', "host name"),
    ('name = "t"\nhosts = ["a", "bridge"]', "host name"),
    ('name = "t"\nhosts = ["a", "b"]\n[[link]]\nbetween = ["a", "z"]\nbandwidth = "1mbit"',
     "neither a host nor a group"),
    ('name = "t"\nhosts = ["a", "b"]\n[[link]]\nbetween = ["a", "b"]', "'bandwidth'"),
    ('name = "t"\nhosts = ["a", "b"]\n[[link]]\nbetween = ["a", "b"]\nbandwidth = "1mbit"\n'
     'latency = "3ms"', "unknown key"),
    ('name = "t"\nhosts = ["a", "b"]\n[host.a]\ncpu = 0', "cpu"),
    ('name = "t"\nhosts = ["a", "b"]\n[host.q]\ncpu = 1', "no such host"),
    ('name = "t"\nhosts = ["a", "b"]\nmtu = 100', "mtu"),
    ('hosts = ["a", "b"]', "'name'"),
])
def test_bad_topologies_name_what_is_wrong(doc: str, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        parse_topology(tomllib.loads(doc), "bad.toml")


def test_an_unknown_topology_lists_the_bundled_ones() -> None:
    with pytest.raises(TopologyError, match="three-hosts"):
        load_topology("no-such-topology")


def test_shaping_has_one_htb_class_and_filter_per_destination() -> None:
    t = load_topology("three-hosts")
    addr = {"a": "10.250.0.1", "b": "10.250.0.2", "c": "10.250.0.3"}.__getitem__
    cmds = [" ".join(c) for c in shaping_commands(t, "a", addr)]
    assert cmds[0].startswith("tc qdisc add dev eth0 root handle 1: htb default 0")
    classes = [c for c in cmds if " class add " in c]
    filters = [c for c in cmds if " filter add " in c]
    assert len(classes) == len(filters) == 2
    assert "rate 50000000bit ceil 50000000bit" in classes[0]  # a -> b
    assert "rate 20000000bit ceil 20000000bit" in classes[1]  # a -> c
    assert filters[0].endswith("match ip dst 10.250.0.2/32 flowid 1:101")
    assert filters[1].endswith("match ip dst 10.250.0.3/32 flowid 1:102")
    assert not any("netem" in c for c in cmds)


def test_with_netem_each_class_delays_half_the_rtt() -> None:
    t = load_topology("three-hosts")
    addr = {"a": "10.250.0.1", "b": "10.250.0.2", "c": "10.250.0.3"}.__getitem__
    netem = [" ".join(c) for c in shaping_commands(t, "c", addr, netem=True) if "netem" in c]
    assert len(netem) == 2
    assert "parent 1:100 handle 100: netem delay 15000us" in netem[0]  # c -> a: 30 ms RTT
    assert "parent 1:101 handle 101: netem delay 2000us" in netem[1]  # c -> b: 4 ms RTT
