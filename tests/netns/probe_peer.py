"""A fusion link-probe peer for the namespace tests: PeerNetwork + LinkProber, nothing else.

    python -m tests.netns.probe_peer serve NODE_ID ADDR PORT
    python -m tests.netns.probe_peer probe NODE_ID ADDR PORT PEER_ADDR:PORT [PEER_ADDR:PORT ...]

`serve` answers probes (prints READY, runs until killed). `probe` connects to each peer over
the real transport (fusiond.net.PeerNetwork, plaintext: the testbed is a closed namespace
network), measures it with fusiond.cluster.probes.LinkProber exactly as the daemon does, and
prints one JSON line per peer: {"peer": ..., "address": ..., "bandwidth_bits_per_s": ...,
"rtt_s": ...}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from fusiond.cluster.probes import LinkProber, ProbeConfig
from fusiond.net import NetConfig, PeerNetwork
from protocol.messages import Message, Ping, Pong, ProbeAck, ProbeData


async def run(mode: str, node_id: str, addr: str, port: int, peers: list[str]) -> None:
    box: dict[str, LinkProber] = {}
    pending: set[asyncio.Task[None]] = set()

    def reply(peer: str, msg: Message) -> None:
        # Answer off the reader (as the cluster service does): the reader never waits on a send.
        task = asyncio.ensure_future(net.send(peer, msg))
        pending.add(task)
        task.add_done_callback(pending.discard)

    async def handler(peer: str, msg: Message) -> None:
        prober = box["p"]
        if isinstance(msg, Ping):
            reply(peer, prober.on_ping(peer, msg))
        elif isinstance(msg, Pong):
            prober.on_pong(peer, msg)
        elif isinstance(msg, ProbeData):
            ack = prober.on_probe_data(peer, msg, time.monotonic())
            if ack is not None:
                reply(peer, ack)
        elif isinstance(msg, ProbeAck):
            prober.on_probe_ack(peer, msg)

    net = PeerNetwork(node_id=node_id, cluster_id="netns-testbed", listen=(addr, port),
                      tls=None, handler=handler,
                      config=NetConfig(allow_plaintext_remote=True, connect_timeout_s=5.0,
                                       handshake_timeout_s=5.0))
    # The daemon's defaults, except a longer timeout; PROBE_TARGET_S overrides the probe
    # duration for experiments (e.g. how much a short probe loses to slow start on long RTTs).
    target_s = float(os.environ.get("PROBE_TARGET_S", ProbeConfig.target_s))
    box["p"] = LinkProber(send=net.send, config=ProbeConfig(timeout_s=10.0, target_s=target_s))
    await net.start()
    await net.ready()
    try:
        if mode == "serve":
            print("READY", flush=True)
            await asyncio.Event().wait()
        for target in peers:
            host, _, p = target.rpartition(":")
            peer = await net.connect((host, int(p)))
            est = await box["p"].probe(peer)
            print(json.dumps({"peer": peer, "address": target,
                              "bandwidth_bits_per_s": est.bandwidth_bits_per_s,
                              "rtt_s": est.rtt_s}), flush=True)
    finally:
        box["p"].cancel()
        for task in list(pending):
            task.cancel()
        await net.close()


def main() -> None:
    mode, node_id, addr, port, *peers = sys.argv[1:]
    if mode not in ("serve", "probe"):
        raise SystemExit(f"unknown mode {mode!r}: serve or probe")
    asyncio.run(run(mode, node_id, addr, int(port), peers))


if __name__ == "__main__":
    main()
