"""What signed membership costs one node: its gossip CPU per round, signed vs plaintext.

One real `Cluster` (the receiver, its loops running, its sends dropped) in a cluster of N
members; the N - 1 others are simulated: each beats once per round and signs its header with
its own node key (a certificate from one cluster CA, fusiond.net.pki, as in a daemon; their
signing is not charged to the receiver). Each round the receiver gets `fanout` gossip messages
from random members holding everyone's latest heartbeats (the worst case for checks: every
other member's new header arrives in the first one), the sender's own profile and links every
`gossip_full_every`-th round and the whole view every `gossip_sync_every`-th, as the service
sends them. Only the receiver's process time is measured. The figures go to docs/cluster.md.

    .venv/bin/python -m bench.gossip_trust --members 48 --rounds 40
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from fusiond.cluster import Cluster, ClusterConfig, Trust, X509Authority
from fusiond.cluster.membership import MemberRecord
from fusiond.cluster.service import record_to_wire
from fusiond.cluster.trust import (
    body_digest,
    body_statement,
    header_statement,
)
from fusiond.net import pki
from protocol.frames import Buffer
from protocol.messages import Gossip, Message, NodeProfile

Address = tuple[str, int]
PROFILE = NodeProfile(gflops=50.0, device_kind="cpu", memory_bytes=16 << 30, cpu_count=8,
                      torch_version="2.13.0", python_version="3.11.7", fusiond_version="0.1.0",
                      device_name="cpu", device_count=1, device_memory_bytes=16 << 30,
                      free_memory_bytes=8 << 30, labels={"host": "host", "arch": "x86_64"})


class NullNet:
    """The receiver's transport: every send is dropped (its cost of building them counts)."""

    async def connect(self, address: Address) -> str:
        raise ConnectionError("simulated")

    async def send(self, peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None:
        return None

    def add_peer_address(self, node_id: str, address: Address) -> None:
        return None


@dataclasses.dataclass
class Sim:
    """One simulated member: its key, certificate and current signed record."""

    trust: Trust | None
    record: MemberRecord


def sign(sim: Sim, cluster_id: str, body: bool) -> None:
    r, tr = sim.record, sim.trust
    sig = tr.sign(header_statement(cluster_id, r.node_id, r.address, r.incarnation,
                                   r.heartbeat, False, r.term)) if tr else b""
    sim.record = dataclasses.replace(r, signature=sig)
    if body:
        profile = dataclasses.replace(PROFILE, free_memory_bytes=random.randrange(1 << 30))
        digest = body_digest(profile, sim.record.links)
        bsig = tr.sign(body_statement(cluster_id, r.node_id, r.incarnation, r.heartbeat,
                                      digest)) if tr else b""
        sim.record = dataclasses.replace(sim.record, profile=profile,
                                         body_version=r.heartbeat, body_signature=bsig)


async def run(members: int, rounds: int, signed: bool, state: Path,
              cfg: ClusterConfig) -> dict[str, float]:
    ca = pki.create_cluster_ca(state / f"ca-{signed}")

    def identity(i: int) -> tuple[Trust | None, str]:
        ident = pki.load_or_create_node_identity(state / f"n{i}-{signed}")
        cert = pki.issue_node_certificate(ca, ident.key.public_key())
        trust = Trust(cluster_id=ca.cluster_id, node_id=ident.node_id, key=ident.key,
                      credential=cert.public_bytes(serialization.Encoding.DER),
                      authority=X509Authority(ca.cert))
        return (trust if signed else None), ident.node_id

    me_trust, me = identity(0)
    sims: list[Sim] = []
    for i in range(1, members):
        trust, nid = identity(i)
        links = {f"peer{j}": (1e9, 0.001) for j in range(members - 1)}
        sims.append(Sim(trust, MemberRecord(nid, ("127.0.0.1", 20000 + i), 1000 + i, 0,
                                            "alive", PROFILE, links)))
    for s in sims:
        sign(s, ca.cluster_id, body=True)
    node = Cluster(node_id=me, cluster_id=ca.cluster_id, net=NullNet(),
                   advertise=("127.0.0.1", 20000), profile=lambda: PROFILE,
                   trust=me_trust, config=cfg)
    await node.start()
    checks = [0]
    if me_trust is not None:
        verify = me_trust.verify_by

        def counted(node_id: str, statement: bytes, signature: bytes) -> bool:
            checks[0] += 1
            return verify(node_id, statement, signature)

        me_trust.verify_by = counted  # type: ignore[method-assign]

    def message(sender: Sim, full_sender: bool, sync: bool) -> Gossip:
        entries = []
        for s in sims:
            wide = sync or (full_sender and s is sender)
            cred = s.trust.credential if (s.trust and (wide or s is sender)) else b""
            entries.append(record_to_wire(s.record, wide, cred))
        return Gossip(sender=sender.record.node_id, members=tuple(entries))

    try:
        cpu = 0.0
        for n in range(rounds):
            t_round = time.monotonic()
            for s in sims:
                s.record = dataclasses.replace(s.record, heartbeat=s.record.heartbeat + 1)
                sign(s, ca.cluster_id, body=n % cfg.gossip_full_every == 0)
            senders = random.sample(sims, cfg.gossip_fanout)
            msgs = [message(s, n % cfg.gossip_full_every == 0, i == 0 and (
                n % cfg.gossip_sync_every == 0)) for i, s in enumerate(senders)]
            c0 = time.process_time()
            for s, m in zip(senders, msgs, strict=True):
                await node.handle(s.record.node_id, m)
            cpu += time.process_time() - c0
            # The receiver's own loops (its gossip round, its timers) run in the sleep.
            c0 = time.process_time()
            await asyncio.sleep(max(0.0, cfg.gossip_interval_s - (time.monotonic() - t_round)))
            cpu += time.process_time() - c0
        view = node.view()
        return {"alive": view.alive_voters, "cpu_ms_per_round": cpu / rounds * 1e3,
                "cpu_share": cpu / (rounds * cfg.gossip_interval_s),
                "checks_per_round": checks[0] / rounds,
                "rejected": float(sum(node.rejected.values()))}
    finally:
        await node.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--members", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    cfg = ClusterConfig(mdns=False, probes=False)
    with tempfile.TemporaryDirectory() as d:
        for signed in (False, True):
            res = asyncio.run(run(args.members, args.rounds, signed, Path(d), cfg))
            print("signed   " if signed else "plaintext",
                  {k: round(v, 4) for k, v in res.items()})


if __name__ == "__main__":
    main()
