"""Issue 7: with tc rate limits between namespaces, the bandwidth fusion's own link probe
measures (fusiond.cluster.probes.LinkProber over fusiond.net.PeerNetwork, in one process per
namespace) is within 15 % of the configured rate for 10 Mbit/s, 100 Mbit/s and 1 Gbit/s.

One testbed serves all three cases: host `a` reaches `b` at 10 Mbit/s, `c` at 100 Mbit/s and
`d` at 1 Gbit/s (htb classes per destination on a's egress, the bridge between), so each case
is a link between two namespaces and the setup is paid once."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import pytest

from deploy.testbed import testbed
from tests.netns.conftest import needs_netns

pytestmark = [pytest.mark.netns, pytest.mark.slow, needs_netns]

RATES_MBIT = {"b": 10, "c": 100, "d": 1000}
PORT = 7420
TOPOLOGY = """
name = "probe-rates"
description = "a to b/c/d at 10 Mbit/s, 100 Mbit/s, 1 Gbit/s (issue 7's probe test)"
hosts = ["a", "b", "c", "d"]
[defaults]
bandwidth = "10gbit"
""" + "".join(f"""
[[link]]
between = ["a", "{h}"]
bandwidth = "{mbit}mbit"
""" for h, mbit in RATES_MBIT.items())


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, float]]]:
    """Run the probe from a to b, c, d once; {host: {"bandwidth_bits_per_s", "rtt_s"}}."""
    tmp = tmp_path_factory.mktemp("probe-rates")
    topo = tmp / "probe-rates.toml"
    topo.write_text(TOPOLOGY)
    name = f"fzt{os.getpid() % 100000}p"
    py = sys.executable
    env = {"OMP_NUM_THREADS": "1"}
    with testbed(topo, name=name, state_dir=tmp / "state") as tb:
        servers = {}
        for h in RATES_MBIT:
            log = tmp / f"{h}.log"
            servers[h] = tb.exec(h, [py, "-m", "tests.netns.probe_peer", "serve", h,
                                     tb.address(h), str(PORT)], log=log, env=env)
        for h, proc in servers.items():
            tb.wait_ready(proc, tmp / f"{h}.log", f"probe peer {h}")
        out = tb.run("a", [py, "-m", "tests.netns.probe_peer", "probe", "a", tb.address("a"),
                           str(PORT), *(f"{tb.address(h)}:{PORT}" for h in RATES_MBIT)],
                     timeout=120)
        by_addr = {tb.address(h): h for h in RATES_MBIT}
        got = {}
        for line in out.splitlines():
            rec = json.loads(line)
            got[by_addr[rec["address"].rpartition(":")[0]]] = rec
        yield got


@pytest.mark.parametrize("host", list(RATES_MBIT))
def test_probe_bandwidth_within_15_percent_of_the_tc_rate(
        measured: dict[str, dict[str, float]], host: str) -> None:
    rate = RATES_MBIT[host] * 1e6
    rec = measured[host]
    assert rec["bandwidth_bits_per_s"] is not None
    err = (rec["bandwidth_bits_per_s"] - rate) / rate
    got_mbit = rec["bandwidth_bits_per_s"] / 1e6
    print(f"{RATES_MBIT[host]} Mbit/s: probe measured {got_mbit:.1f} Mbit/s "
          f"({err:+.1%}), rtt {rec['rtt_s'] * 1e3:.2f} ms")
    assert abs(err) <= 0.15, rec


def test_the_probe_runs_in_the_namespaces_not_on_loopback(
        measured: dict[str, dict[str, float]]) -> None:
    """A guard against a silently unshaped path: the three links must differ as configured."""
    bw = {h: measured[h]["bandwidth_bits_per_s"] for h in RATES_MBIT}
    assert bw["b"] < bw["c"] < bw["d"]

