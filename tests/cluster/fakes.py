"""An in-memory PeerNetwork for cluster tests: many Cluster instances in one event loop.

Every message goes through the real codec (encode_message -> FrameDecoder -> decode_message),
so what the cluster sends must be valid on the wire. Links deliver in order after a latency,
optionally serialised at a bandwidth, optionally with TCP's slow start; the hub can partition
nodes into groups, cut single links, and "crash" a node (its traffic is dropped from then on).

Swarm nodes sign their facts by default (`NameAuthority`: a test CA for arbitrary node names,
with real ECDSA P-256 keys and signatures, so every service test also runs the checks a TLS
daemon runs); `Swarm(signed=False)` is plaintext dev mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace

import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fusiond.cluster import Cluster, ClusterConfig, ClusterView, Trust, TrustError
from protocol.frames import Buffer, FrameDecoder
from protocol.messages import Message, NodeProfile, decode_message, encode_message

log = logging.getLogger(__name__)

Address = tuple[str, int]
Handler = Callable[[str, Message], Awaitable[bool]]


class Unreachable(ConnectionError):
    """No live node at that address, or the path is cut."""


@dataclass
class _Item:
    due: float
    msg: Message


class FakeHub:
    """The 'network' joining FakeNets: addresses, partitions, per-link latency and bandwidth."""

    def __init__(self, *, latency_s: float = 0.0005, bandwidth_bits_per_s: float | None = None,
                 initial_window: int | None = None, idle_restart_s: float = 0.2) -> None:
        """`latency_s` one way; with `initial_window` (bytes; needs `bandwidth_bits_per_s`) each
        link models slow start: it sends at ``ln 2 * (initial_window + bytes sent) / RTT`` (the
        window grows by what is acknowledged: it doubles every RTT), capped at the bandwidth,
        and starts over after `idle_restart_s` without traffic (TCP's restart after idle)."""
        self.latency_s = latency_s
        self.bandwidth_bits_per_s = bandwidth_bits_per_s
        self.initial_window = initial_window
        self.idle_restart_s = idle_restart_s
        self.link_bandwidth_bits_per_s: dict[tuple[str, str], float] = {}
        self.nets: dict[str, FakeNet] = {}
        self.by_address: dict[Address, str] = {}
        self._groups: list[set[str]] | None = None
        self._cut: set[frozenset[str]] = set()
        self.sent: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._next_port = 10000

    def address(self) -> Address:
        """A fresh loopback-looking address."""
        self._next_port += 1
        return ("127.0.0.1", self._next_port)

    def partition(self, *groups: set[str]) -> None:
        """Only nodes in the same group can talk (nodes in no group are isolated)."""
        self._groups = [set(g) for g in groups]

    def cut(self, a: str, b: str) -> None:
        """Cut the single link a <-> b."""
        self._cut.add(frozenset((a, b)))

    def heal(self) -> None:
        """Remove every partition and cut."""
        self._groups = None
        self._cut.clear()

    def can_talk(self, a: str, b: str) -> bool:
        """Whether a message from a to b would be delivered now."""
        if frozenset((a, b)) in self._cut:
            return False
        if self._groups is None:
            return True
        return any(a in g and b in g for g in self._groups)


class FakeNet:
    """One node's transport: implements fusiond.cluster.Transport."""

    def __init__(self, hub: FakeHub, node_id: str, address: Address | None = None) -> None:
        self.hub = hub
        self.node_id = node_id
        self.address = address or hub.address()
        self.handler: Handler | None = None
        self.peer_addresses: dict[str, Address] = {}
        self.alive = True
        self._queues: dict[str, asyncio.Queue[_Item]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._link_free: dict[str, float] = {}
        self._window_sent: dict[str, int] = {}
        hub.nets[node_id] = self
        hub.by_address[self.address] = node_id

    async def connect(self, address: Address) -> str:
        peer = self.hub.by_address.get(address)
        net = self.hub.nets.get(peer) if peer is not None else None
        if peer is None or net is None or not net.alive or not self.hub.can_talk(
                self.node_id, peer):
            raise Unreachable(f"nothing answers at {address[0]}:{address[1]}")
        self.peer_addresses[peer] = address
        return peer

    def add_peer_address(self, node_id: str, address: Address) -> None:
        self.peer_addresses[node_id] = address

    def set_link_rate(self, node_id: str, bytes_per_s: float) -> None:
        """The fake links have no frame deadlines."""

    async def send(self, peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None:
        if not self.alive:
            raise ConnectionError("closed")
        data = b"".join(bytes(b) for b in encode_message(msg, payload))
        frames = FrameDecoder().feed(data)
        assert len(frames) == 1
        decoded = decode_message(frames[0])
        loop = asyncio.get_running_loop()
        now = loop.time()
        bits_per_s = self.hub.link_bandwidth_bits_per_s.get((self.node_id, peer),
                                                            self.hub.bandwidth_bits_per_s)
        free = self._link_free.get(peer)
        start = max(now, free if free is not None else now)
        done = start + (self._transmit_s(peer, len(data), bits_per_s, idle=free is None or (
            now - free > self.hub.idle_restart_s)) if bits_per_s else 0.0)
        self._link_free[peer] = done
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = asyncio.Queue(maxsize=100_000)
            self._workers[peer] = asyncio.ensure_future(self._deliver(peer, queue))
        self.hub.sent[type(msg).__name__] += 1
        await queue.put(_Item(done + self.hub.latency_s, decoded))

    def _transmit_s(self, peer: str, nbytes: int, bits_per_s: float, *, idle: bool) -> float:
        """Seconds to put `nbytes` on the link to `peer`: at `bits_per_s`, or slower while the slow
        start window (see FakeHub) is below the bandwidth-delay product."""
        iw = self.hub.initial_window
        if iw is None:
            return nbytes * 8 / bits_per_s
        if idle:
            self._window_sent[peer] = 0
        sent = self._window_sent.get(peer, 0)
        self._window_sent[peer] = sent + nbytes
        rtt = 2 * self.hub.latency_s
        rate = bits_per_s / 8  # bytes/s
        # Window-limited while ln2 * (iw + sent) / rtt < rate, where
        # d(sent)/dt = ln2 * (iw + sent) / rtt, i.e. sent(t) = (iw + sent0) * 2**(t/rtt) - iw.
        ramp_end = max(0.0, rate * rtt / math.log(2) - iw)
        ramped = min(sent + nbytes, ramp_end)
        t = 0.0
        if ramped > sent:
            t += rtt / math.log(2) * math.log((iw + ramped) / (iw + sent))
        return t + (sent + nbytes - max(ramped, sent)) / rate

    async def _deliver(self, peer: str, queue: asyncio.Queue[_Item]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            delay = item.due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            dst = self.hub.nets.get(peer)
            name = type(item.msg).__name__
            if (not self.alive or dst is None or not dst.alive or dst.handler is None
                    or not self.hub.can_talk(self.node_id, peer)):
                self.hub.dropped[name] += 1
                continue
            try:
                await dst.handler(self.node_id, item.msg)
            except Exception:  # like the real transport: log, keep the link
                log.exception("handler of %s failed on %s", peer, name)

    async def close(self) -> None:
        """Crash/stop this node: nothing more in or out."""
        self.alive = False
        for task in self._workers.values():
            task.cancel()
        for task in self._workers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers.clear()
        self._queues.clear()
        if self.hub.nets.get(self.node_id) is self:
            del self.hub.nets[self.node_id]


# -- a test authority ---------------------------------------------------------------------------

_ECDSA = ec.ECDSA(hashes.SHA256())


class NameAuthority:
    """A cluster authority for tests, over arbitrary node names: a credential is msgpack
    [name, public key (SPKI DER), expiry, the authority's signature over the three]; the
    authority's key is also the operator key. The daemon uses the X.509 cluster CA instead
    (fusiond.cluster.trust.X509Authority), where names are derived from keys."""

    def __init__(self) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())

    def issue(self, name: str, public_key: ec.EllipticCurvePublicKey,
              valid_s: float = 3600.0) -> bytes:
        spki = public_key.public_bytes(serialization.Encoding.DER,
                                       serialization.PublicFormat.SubjectPublicKeyInfo)
        expires = time.time() + valid_s
        body = msgpack.packb([name, spki, expires])
        return msgpack.packb([name, spki, expires, self.key.sign(body, _ECDSA)])

    def verify_credential(self, node_id: str,
                          credential: bytes) -> tuple[ec.EllipticCurvePublicKey, float]:
        try:
            name, spki, expires, sig = msgpack.unpackb(credential)
            self.key.public_key().verify(sig, msgpack.packb([name, spki, expires]), _ECDSA)
            key = serialization.load_der_public_key(spki)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise TrustError(f"credential of {node_id} does not verify: {exc!r}") from None
        if name != node_id or not isinstance(key, ec.EllipticCurvePublicKey):
            raise TrustError(f"credential names {name!r}, not {node_id!r}")
        if time.time() > expires:
            raise TrustError(f"credential of {node_id} expired")
        return key, float(expires)

    def verify_operator(self, statement: bytes, signature: bytes) -> bool:
        try:
            self.key.public_key().verify(signature, statement, _ECDSA)
        except (InvalidSignature, ValueError):
            return False
        return True


# -- a swarm of Cluster instances on one hub --------------------------------------------------

FAST = ClusterConfig(
    gossip_interval_s=0.08, gossip_fanout=3, suspect_after_s=0.6, dead_after_s=1.2,
    election_timeout_s=0.5, leader_heartbeat_s=0.08, leader_lease_s=0.35,
    election_stagger_s=0.15, election_jitter_s=0.05, election_grace_s=0.4, tick_s=0.02,
    mdns=False, probes=False, send_timeout_s=0.5, bootstrap_retry_s=0.05,
)
"""Intervals 4-6x shorter than the defaults, in about the same proportions (shorter ones
starve the shared CPUs of a test machine and the failure detector sees ghosts)."""


class Swarm:
    """Start, crash and restart Cluster nodes on one FakeHub."""

    def __init__(self, hub: FakeHub | None = None, config: ClusterConfig = FAST,
                 signed: bool = True) -> None:
        self.hub = hub or FakeHub()
        self.config = config
        self.signed = signed
        self.authority = NameAuthority()
        self.keys: dict[str, ec.EllipticCurvePrivateKey] = {}
        self.nodes: dict[str, Cluster] = {}
        self.nets: dict[str, FakeNet] = {}
        self.addresses: dict[str, Address] = {}

    def trust(self, node_id: str, operator: bool = True) -> Trust:
        """`node_id`'s signing key (the same across restarts) and credential."""
        key = self.keys.setdefault(node_id, ec.generate_private_key(ec.SECP256R1()))
        return Trust(cluster_id="test", node_id=node_id, key=key,
                     credential=self.authority.issue(node_id, key.public_key()),
                     authority=self.authority,
                     operator_key=self.authority.key if operator else None)

    async def add(self, node_id: str, *, bootstrap: Sequence[Address] = (),
                  profile: dict[str, object] | None = None, incarnation: int | None = None,
                  config: ClusterConfig | None = None,
                  state_path: str | None = None, members_path: str | None = None,
                  operator: bool = True) -> Cluster:
        """Start a node (reusing its old address and key if it ran before: a restart).
        `operator`: it holds the operator key (may remove members)."""
        net = FakeNet(self.hub, node_id, self.addresses.get(node_id))
        self.addresses[node_id] = net.address
        cfg = config or self.config
        cfg = replace(cfg, bootstrap=tuple(bootstrap))
        prof = NodeProfile(**(profile or {"gflops": 10.0, "memory_bytes": 1 << 30}))  # type: ignore[arg-type]
        node = Cluster(node_id=node_id, cluster_id="test", net=net, advertise=net.address,
                       profile=lambda: prof, config=cfg, incarnation=incarnation,
                       state_path=state_path, members_path=members_path,
                       trust=self.trust(node_id, operator) if self.signed else None)
        net.handler = node.handle
        await node.start()
        await node.ready()
        self.nodes[node_id] = node
        self.nets[node_id] = net
        return node

    async def crash(self, node_id: str) -> None:
        """Stop a node abruptly (no leave)."""
        await self.nets[node_id].close()
        await self.nodes[node_id].close()
        del self.nodes[node_id]

    async def close(self) -> None:
        for node_id in list(self.nodes):
            await self.crash(node_id)

    def views(self, ids: Sequence[str] | None = None) -> dict[str, ClusterView]:
        return {n: self.nodes[n].view() for n in (ids or list(self.nodes))}


class LoopLag:
    """How far this event loop fell behind while the block ran: a task sleeps `interval` over
    and over and sums how late each wake-up was. A test's wall-clock bound adds ``total``, so
    a starved machine (a stalled process, a busy CPU) does not fail it while an implementation
    that is late by itself still does."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.total = 0.0
        self.worst = 0.0
        """The longest single stall."""
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval)
            late = max(0.0, loop.time() - t0 - self.interval)
            self.total += late
            self.worst = max(self.worst, late)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def until(pred: Callable[[], bool], within: float, what: str,
                interval: float = 0.02) -> float:
    """Wait until `pred()`; return seconds waited; AssertionError naming `what` on timeout."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not pred():
        if loop.time() - t0 > within:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(interval)
    return loop.time() - t0


def agreed_leader(views: dict[str, ClusterView]) -> str | None:
    """The one leader every view names (with one term), or None."""
    leaders = {(v.leader, v.term) for v in views.values()}
    if len(leaders) != 1:
        return None
    leader, _ = next(iter(leaders))
    return leader
