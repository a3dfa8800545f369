"""Probe accuracy on rate-limited links: two processes in their own network namespaces, joined
by a veth pair whose a->b direction is shaped with tbf, each running PeerNetwork + Cluster.
The measured bandwidth must be within 15 % of the configured rate (tbf itself delivers about
92-96 % of it as goodput, see TESTBED.md). Needs root; always deletes its namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None
                       or shutil.which("tc") is None, reason="needs root, ip and tc"),
]

ROOT = Path(__file__).resolve().parents[2]
PORT = 7420

CHILD = textwrap.dedent('''
    import asyncio, json, sys
    from fusiond.cluster import Cluster, ClusterConfig
    from fusiond.net import NetConfig, PeerNetwork
    from protocol.messages import NodeProfile

    async def main(node_id, host, peer_host, mode, timeout):
        box = {}

        async def handler(peer, msg):
            await box["c"].handle(peer, msg)

        net = PeerNetwork(node_id=node_id, cluster_id="netns-probe", listen=(host, %(port)d),
                          tls=None, handler=handler,
                          config=NetConfig(allow_plaintext_remote=True))
        await net.start()
        await net.ready()
        probe = mode == "probe"
        cfg = ClusterConfig(mdns=False, probes=probe, probe_interval_s=600.0,
                            bootstrap=((peer_host, %(port)d),) if probe else ())
        c = Cluster(node_id=node_id, cluster_id="netns-probe", net=net,
                    advertise=(host, %(port)d), profile=NodeProfile, config=cfg)
        box["c"] = c
        await c.start()
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        result = None
        while loop.time() < end:
            links = c.view().links
            if probe and (node_id, "b") in links:
                result = links[(node_id, "b")]
                break
            await asyncio.sleep(0.05)
        if probe:
            print(json.dumps({"bandwidth_bits_per_s": result[0] if result else None,
                              "rtt_s": result[1] if result else None}), flush=True)
        await c.close()
        await net.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5])))
''') % {"port": PORT}


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture
def veth_pair() -> Iterator[tuple[str, str, str, str, str]]:
    """(ns_a, ns_b, dev_a, addr_a, addr_b): two namespaces joined by a veth pair."""
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b = f"fcl-a-{tag}", f"fcl-b-{tag}"
    dev_a, dev_b = f"fcla{tag}", f"fclb{tag}"
    subnet = int(tag[:2], 16) % 250 + 1
    addr_a, addr_b = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b,
           "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, dev_a, addr_a, addr_b
    finally:
        for ns in (ns_a, ns_b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("mbit", [10, 100, 1000])
def test_measured_bandwidth_within_15_percent_of_the_tbf_rate(
        veth_pair: tuple[str, str, str, str, str], mbit: int, tmp_path: Path) -> None:
    ns_a, ns_b, dev_a, addr_a, addr_b = veth_pair
    rate = mbit * 1_000_000
    burst = max(32 << 10, rate // 8 // 200)  # 5 ms worth of bytes: negligible against a probe
    sh("ip", "netns", "exec", ns_a, "tc", "qdisc", "add", "dev", dev_a, "root", "tbf",
       "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    py = sys.executable
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns_b, py, str(script), "b", addr_b, addr_a, "serve", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.strip() == "READY", server.stderr.read() if server.stderr else line
        prober = subprocess.run(
            ["ip", "netns", "exec", ns_a, py, str(script), "a", addr_a, addr_b, "probe", "40"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=90)
        lines = [ln for ln in prober.stdout.splitlines() if ln.startswith("{")]
        assert lines, prober.stderr[-2000:]
        got = json.loads(lines[-1])
        assert got["bandwidth_bits_per_s"] is not None, prober.stderr[-2000:]
        err = (got["bandwidth_bits_per_s"] - rate) / rate
        print(f"{mbit} Mbit/s: measured {got['bandwidth_bits_per_s'] / 1e6:.1f} Mbit/s "
              f"({err:+.1%}), rtt {got['rtt_s'] * 1e3:.2f} ms")
        assert abs(err) < 0.15, got
    finally:
        server.kill()
        server.wait()
