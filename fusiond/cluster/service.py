"""The Cluster service: discovery, gossip membership, link probes and election, tied together.

The daemon constructs one `Cluster` after its PeerNetwork, routes every peer message to
`handle()` first, and reads `view()` for status, metrics and scheduling. Everything runs on one
event loop; the sans-IO cores (Membership, Election) get the monotonic time passed in, and this
module does the sending: fire-and-forget with a timeout, so a slow or dead peer never stalls a
gossip round or an election.

With a `Trust` (signed mode, every TLS daemon) this module signs our own record once per gossip
round and checks every relayed fact before the cores see it (fusiond.cluster.trust): a member's
header and body against its own key, removals against the operator key. What fails is dropped
with a rate-limited log line, and a peer that relays a forgery or malformed data is ignored for
a while (`quarantine_s`), which bounds the signature checks a peer can make us spend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from fusiond.cluster.discovery import SERVICE_TYPE, BootstrapDialer, MdnsDiscovery
from fusiond.cluster.election import MAX_TERM, Election, ElectionTiming, majority, rank_order
from fusiond.cluster.errors import TrustError, UnknownMemberError
from fusiond.cluster.membership import (
    ELIDED,
    Address,
    Link,
    MemberRecord,
    Membership,
    MemberSource,
    MemberState,
    Transition,
    new_incarnation,
)
from fusiond.cluster.persist import (
    ElectionState,
    ElectionStateError,
    MembersState,
    MembersStateError,
    StoredMember,
    load_election_state,
    load_members_state,
    save_election_state,
    save_members_state,
)
from fusiond.cluster.probes import LinkProber, ProbeConfig, ProbeFailed
from fusiond.cluster.trust import (
    MAX_BODY_BYTES,
    MAX_NODE_ID_CHARS,
    MAX_SIGNATURE_BYTES,
    Trust,
    body_bytes,
    body_statement,
    entry_problem,
    header_statement,
)
from fusiond.defaults import ClusterSection as _CLUSTER
from fusiond.errors import ConfigError
from fusiond.units import bytes_per_s_from_bits_per_s
from protocol.errors import LocalProtocolError
from protocol.frames import Buffer
from protocol.messages import (
    Gossip,
    Leader,
    LeaderAck,
    Leave,
    LinkMeasurement,
    MemberEntry,
    Message,
    NodeProfile,
    Ping,
    Pong,
    PreVote,
    ProbeAck,
    ProbeData,
    Removal,
    Vote,
    VoteRequest,
    wire_bytes,
)
from protocol.messages import MemberState as WireState

log = logging.getLogger(__name__)

Role = Literal["scheduler", "worker"]
_MAX_PENDING_SENDS = 1024
"""Background sends in flight; beyond this, gossip and election messages are dropped (they
are periodic and idempotent, and a full backlog means peers are not draining anyway)."""
_MAX_BAD_ENTRIES = 8
"""A gossip message with this many entries that fail their checks is not read further."""
_LOG_EVERY_S = 10.0
"""Rate limit of the log line about refused facts (per peer and reason)."""
_ROUTINE_REFUSALS = frozenset({"stale term", "just started", "voted for", "leader is alive",
                               "not a voter", "candidate is not a voter", "conflicting leader",
                               "proof needed", "unproven leader"})
"""Election refusals that happen in a healthy cluster (not logged)."""
_MEMBERS_SAVE_DELAY_S = 0.2
VIEW_PART_BYTES = 256 << 10
"""A whole view goes out in Gossip messages of about this size at most (`_view_messages`),
well inside the CONTROL lane's bound (`Limits.max_control_frame_bytes`)."""
"""Member-list changes are written together, at most this long after the first."""


class Transport(Protocol):
    """What the cluster needs of fusiond.net.PeerNetwork (a fake implements it in tests)."""

    async def connect(self, address: Address) -> str: ...

    async def send(self, peer: str, msg: Message, payload: Sequence[Buffer] = ()) -> None: ...

    def add_peer_address(self, node_id: str, address: Address) -> None: ...

    def set_link_rate(self, node_id: str, bytes_per_s: float) -> None:
        """The measured rate of our link to `node_id` (the transport's frame deadlines)."""


@dataclass(frozen=True)
class ClusterConfig:
    """Every interval and timeout of the cluster service (seconds unless named otherwise). The
    defaults are the daemon's (`fusiond.defaults.ClusterSection`, ``[cluster]`` in
    fusiond.toml); tests use shorter ones (tests/cluster/fakes.py FAST)."""

    gossip_interval_s: float = _CLUSTER.gossip_interval_s
    gossip_fanout: int = _CLUSTER.gossip_fanout
    """Random live peers each gossip round goes to (plus one dead one, to heal partitions)."""
    gossip_full_every: int = _CLUSTER.gossip_full_every
    """Every n-th round carries our own profile and links to every target (other rounds carry
    heartbeats only)."""
    gossip_sync_every: int = _CLUSTER.gossip_sync_every
    """Every n-th round one random target gets the whole view with everyone's profile and links
    (anti-entropy; with N members that message holds N*(N-1) link measurements)."""
    suspect_after_s: float = _CLUSTER.suspect_after_s
    dead_after_s: float = _CLUSTER.dead_after_s
    probe_interval_s: float = _CLUSTER.probe_interval_s
    probe_target_s: float = _CLUSTER.probe_target_s
    probe_repeats: int = _CLUSTER.probe_repeats
    probe_max_bytes: int = _CLUSTER.probe_max_bytes
    probe_min_bytes: int = _CLUSTER.probe_min_bytes
    probe_timeout_s: float = _CLUSTER.probe_timeout_s
    probes: bool = _CLUSTER.probes
    """Measure links periodically (off: no bandwidth/RTT, e.g. in membership-only tests)."""
    bandwidth_ewma: float = _CLUSTER.bandwidth_ewma
    election_timeout_s: float = _CLUSTER.election_timeout_s
    leader_heartbeat_s: float = _CLUSTER.leader_heartbeat_s
    leader_lease_s: float = _CLUSTER.leader_lease_s
    """Must be below election_timeout_s: an old leader lets go before a new one can win."""
    election_stagger_s: float = _CLUSTER.election_stagger_s
    election_jitter_s: float = _CLUSTER.election_jitter_s
    election_grace_s: float = _CLUSTER.election_grace_s
    """After start: no campaigning or voting while the node learns the cluster."""
    mdns: bool = _CLUSTER.mdns
    mdns_interfaces: tuple[str, ...] | None = None
    """Addresses zeroconf binds to; None = all (tests must pass ("127.0.0.1",))."""
    mdns_service: str = SERVICE_TYPE
    bootstrap: tuple[tuple[str, int], ...] = ()
    bootstrap_retry_s: float = _CLUSTER.bootstrap_retry_s
    send_timeout_s: float = _CLUSTER.send_timeout_s
    """A control send blocked (peer queue full) longer than this is dropped."""
    tick_s: float = _CLUSTER.tick_s
    """Failure detector and election timer resolution."""
    max_members: int = _CLUSTER.max_members
    """Bound on the membership table (peers cannot make us hold more)."""
    quarantine_s: float = _CLUSTER.quarantine_s
    """A peer that relayed a forged or malformed fact is not listened to for this long (its
    own facts still arrive through the others)."""

    def __post_init__(self) -> None:
        # The daemon maps its config by field name and may pass lists: normalise to tuples.
        if self.mdns_interfaces is not None:
            object.__setattr__(self, "mdns_interfaces", tuple(self.mdns_interfaces))
        object.__setattr__(self, "bootstrap",
                           tuple((str(h), int(p)) for h, p in self.bootstrap))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (isinstance(value, int | float) and value > 0
                                              and math.isfinite(value)):
                raise ConfigError(f"cluster.{f.name} must be a positive number, got {value!r}")
        for name in ("gossip_fanout", "gossip_full_every", "gossip_sync_every", "probe_repeats",
                     "probe_max_bytes",
                     "probe_min_bytes", "max_members"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cluster.{name} must be at least 1")
        if not self.suspect_after_s < self.dead_after_s:
            raise ConfigError("cluster.suspect_after_s must be below cluster.dead_after_s")
        if not self.leader_lease_s < self.election_timeout_s:
            raise ConfigError("cluster.leader_lease_s must be below cluster.election_timeout_s")
        if not self.leader_heartbeat_s < self.leader_lease_s:
            raise ConfigError("cluster.leader_heartbeat_s must be below cluster.leader_lease_s")
        if not 0 < self.bandwidth_ewma <= 1:
            raise ConfigError("cluster.bandwidth_ewma must be in (0, 1]")


@dataclass(frozen=True)
class MemberView:
    """One member as this node sees it."""

    node_id: str
    address: Address
    source: MemberSource
    state: MemberState
    incarnation: int
    heartbeat: int
    profile: NodeProfile
    rtt_s: float | None
    """Round trip between this node and the member (our measurement, else the member's)."""
    bandwidth_bits_per_s: float | None
    """Goodput between this node and the member, bits per second (same source as `rtt_s`)."""
    role: Role


@dataclass(frozen=True)
class ClusterView:
    """A frozen snapshot of the cluster as this node sees it."""

    node_id: str
    cluster_id: str
    members: tuple[MemberView, ...]
    """Sorted by node id; this node included (source "self")."""
    leader: str | None
    """The scheduler, if there is a working one (heard lately / our lease holds)."""
    term: int
    has_quorum: bool
    """A majority of voters is alive in our view. False: this side cannot have a scheduler;
    if the missing members are gone for good, `remove` them."""
    voters: int
    alive_voters: int
    needed: int
    """Voters needed for a majority."""
    links: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    """(measurer, peer) -> its `Link` (bits per second, RTT, the round's spread and time), as
    gossiped by every measurer; a bandwidth of 0 means RTT measured but no bandwidth sample
    counted yet."""

    def member(self, node_id: str) -> MemberView | None:
        """The member `node_id`, or None."""
        for m in self.members:
            if m.node_id == node_id:
                return m
        return None

    def states(self) -> dict[str, MemberState]:
        """node id -> state, for every member."""
        return {m.node_id: m.state for m in self.members}

    def quorum_advice(self) -> str | None:
        """None with a quorum; else a plain sentence saying what is missing and what to run."""
        if self.has_quorum:
            return None
        gone = sorted(m.node_id for m in self.members if m.state in ("dead", "suspect"))
        text = (f"no quorum: {self.alive_voters} of {self.voters} voters alive, "
                f"{self.needed} needed; no scheduler can be elected on this side.")
        if gone:
            text += (" If these members are gone for good, remove them: "
                     + "; ".join(f"fusionctl remove {n}" for n in gone))
        return text


# -- wire conversion ------------------------------------------------------------------------

def checked_profile(profile: NodeProfile) -> str | None:
    """None if `profile` can go on the wire; else what is wrong with it (a field named)."""
    try:
        profile.to_wire()
    except LocalProtocolError as exc:
        return str(exc)
    return None


def record_to_wire(rec: MemberRecord, full: bool = True, credential: bytes = b"") -> MemberEntry:
    """A membership record as a gossip entry, its signatures and `credential` with it; without
    profile and links unless `full` (and never a body of an older incarnation)."""
    full = full and rec.body_version >= 0
    return MemberEntry(
        node_id=rec.node_id,
        address=rec.address,
        incarnation=rec.incarnation,
        heartbeat=rec.heartbeat,
        state=WireState(rec.state),
        profile=rec.profile if full else None,
        links=tuple(LinkMeasurement(peer=p, bandwidth_bits_per_s=lk.bandwidth_bits_per_s,
                                    rtt_s=lk.rtt_s, measured_at=lk.measured_at,
                                    bandwidth_spread_ratio=lk.bandwidth_spread_ratio)
                    for p, lk in sorted(rec.links.items())) if full else (),
        term=rec.term,
        signature=rec.signature,
        body_version=rec.body_version if full else 0,
        body_signature=rec.body_signature if full else b"",
        credential=credential,
    )


_STATE_FROM_WIRE: dict[WireState, MemberState] = {
    WireState.ALIVE: "alive", WireState.SUSPECT: "suspect", WireState.DEAD: "dead",
    WireState.LEFT: "left",
}


def record_from_wire(entry: MemberEntry) -> MemberRecord:
    """A gossip entry as a membership record."""
    return MemberRecord(
        node_id=entry.node_id,
        address=(entry.address[0], int(entry.address[1])),
        incarnation=entry.incarnation,
        heartbeat=entry.heartbeat,
        state=_STATE_FROM_WIRE[entry.state],
        # No profile: a heartbeat-only entry, which also leaves the links out.
        profile=entry.profile if entry.profile is not None else ELIDED,
        links={m.peer: Link(m.bandwidth_bits_per_s, m.rtt_s, m.bandwidth_spread_ratio,
                            m.measured_at) for m in entry.links},
        term=entry.term,
        signature=entry.signature,
        body_version=entry.body_version if entry.profile is not None else 0,
        body_signature=entry.body_signature if entry.profile is not None else b"",
    )


# -- the service ----------------------------------------------------------------------------


class Cluster:
    """Discovery + gossip membership + link probes + election, as one daemon service."""

    def __init__(
        self,
        *,
        node_id: str,
        cluster_id: str,
        net: Transport,
        advertise: Address,
        profile: Callable[[], NodeProfile],
        config: ClusterConfig,
        incarnation: int | None = None,
        state_path: str | os.PathLike[str] | None = None,
        members_path: str | os.PathLike[str] | None = None,
        trust: Trust | None = None,
    ) -> None:
        """`state_path`: where the election's term and vote persist across restarts (the
        daemon passes a file in its state directory); None keeps them in memory only.
        `members_path`: where the member list and voter set persist (likewise).
        `trust`: this node's signing key and the cluster's authority (signed mode); None is
        plaintext dev mode, where nothing a peer says can be checked."""
        if trust is not None and (trust.node_id != node_id or trust.cluster_id != cluster_id):
            raise ConfigError(f"the cluster trust is for {trust.node_id} in "
                              f"{trust.cluster_id}, not {node_id} in {cluster_id}")
        self.node_id = node_id
        self.cluster_id = cluster_id
        self._net = net
        self._advertise = (str(advertise[0]), int(advertise[1]))
        self._profile = profile
        self.config = config
        self._incarnation = incarnation if incarnation is not None else new_incarnation()
        self._rng = random.Random()
        self._membership: Membership | None = None
        self._election: Election | None = None
        self._prober = LinkProber(send=self._net.send, config=ProbeConfig(
            target_s=config.probe_target_s, repeats=config.probe_repeats,
            max_bytes=config.probe_max_bytes,
            min_bytes=min(config.probe_min_bytes, config.probe_max_bytes),
            initial_bytes=min(256 << 10, config.probe_max_bytes),
            ewma=config.bandwidth_ewma, timeout_s=config.probe_timeout_s))
        self._mdns: MdnsDiscovery | None = None
        self._dialer: BootstrapDialer | None = None
        self._pending_bootstrap: list[Address] = list(config.bootstrap)
        self._contacts: dict[str, Address] = {}
        self._addresses: dict[str, Address] = {}
        self._last_probe: dict[str, float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sends: set[asyncio.Task[None]] = set()
        self._callbacks: list[Callable[[ClusterView], None]] = []
        self._signature: object = None
        self._ready = asyncio.Event()
        self._done: asyncio.Future[None] | None = None
        self._closing = False
        self._closed = False
        self._warned_profile = False
        self._state_path = Path(state_path) if state_path is not None else None
        self._persisted = ElectionState()
        self._persist_error = ""
        self._members_path = Path(members_path) if members_path is not None else None
        self._members_key: object = None
        self._members_saver: asyncio.Task[None] | None = None
        self._trust = trust
        self._own_header: tuple[tuple[Any, ...], bytes] | None = None
        self._own_body: tuple[bytes, int, bytes] | None = None
        """(digest, body_version, signature) of the body we last signed."""
        self._quarantine: dict[str, float] = {}
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}
        self.rejected: dict[str, int] = {}
        """Reason -> facts refused (gossip entries, removals, whole messages); election
        refusals are in the election's own counters (`election_refusals`)."""

    @property
    def signed(self) -> bool:
        """Whether facts are signed and checked (False: plaintext dev mode)."""
        return self._trust is not None

    def removed(self) -> frozenset[str]:
        """Members removed for good by an operator (here or, signed, anywhere)."""
        return frozenset(self._membership.removed()) if self._membership is not None else (
            frozenset())

    @property
    def probe_failures(self) -> dict[str, int]:
        """Peer -> link probe rounds to it that failed (no answer in time, or unreachable)."""
        return dict(self._prober.failures)

    @property
    def election_refusals(self) -> dict[str, int]:
        """Reason -> election messages refused (claims not the sender's own, unproven
        leaders, terms too far ahead, bad signatures)."""
        return dict(self._election.refused) if self._election is not None else {}

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start discovery and the gossip, timer and probe loops; DiscoveryError if mDNS fails."""
        if self._membership is not None:
            return
        now = time.monotonic()
        self._done = asyncio.get_running_loop().create_future()
        self._membership = Membership(
            node_id=self.node_id, address=self._advertise, incarnation=self._incarnation,
            profile=self._safe_profile(NodeProfile()), now=now,
            suspect_after_s=self.config.suspect_after_s, dead_after_s=self.config.dead_after_s,
            max_members=self.config.max_members)
        c = self.config
        self._election = Election(self.node_id, now=now, address=self._advertise, rng=self._rng,
                                  endorser=self._trust, timing=ElectionTiming(
                                      election_timeout_s=c.election_timeout_s,
                                      heartbeat_s=c.leader_heartbeat_s, lease_s=c.leader_lease_s,
                                      stagger_s=c.election_stagger_s,
                                      jitter_s=c.election_jitter_s, grace_s=c.election_grace_s))
        if self._state_path is not None:
            try:
                saved = load_election_state(self._state_path, cluster_id=self.cluster_id,
                                            node_id=self.node_id)
            except ElectionStateError as exc:
                # Not fatal: the start grace still keeps a restarted node from voting at once.
                log.warning("cluster: ignoring the election state: %s", exc)
                saved = None
            if saved is not None and self._election.restore(saved.term, saved.voted_for):
                self._persisted = saved
                log.debug("cluster: resuming at term %d (voted for %s)", saved.term,
                          saved.voted_for)
        if self._members_path is not None:
            await self._restore_members(now)
        if self._trust is None:
            log.warning("cluster: UNSIGNED membership and election (plaintext dev mode): any "
                        "peer can forge members, departures, votes and terms")
        self._spawn(self._gossip_loop(), "gossip")
        self._spawn(self._tick_loop(), "tick")
        if c.probes:
            self._spawn(self._probe_loop(), "probes")
        self._dialer = BootstrapDialer(connect=self._net.connect, on_found=self._on_found,
                                       retry_s=c.bootstrap_retry_s)
        for address in self._pending_bootstrap:
            self._dialer.add(address)
        if c.mdns:
            self._mdns = MdnsDiscovery(
                node_id=self.node_id, cluster_id=self.cluster_id, advertise=self._advertise,
                on_found=self._on_found, interfaces=c.mdns_interfaces,
                service_type=c.mdns_service)
            try:
                await self._mdns.start()
            except BaseException:
                await self.close()
                raise
        self._ready.set()
        log.info("cluster %s: node %s (incarnation %d) discovering via %s", self.cluster_id,
                 self.node_id, self._incarnation,
                 ", ".join(s for s, on in (("mdns", c.mdns), ("bootstrap", True)) if on))

    async def ready(self) -> None:
        """Return once started (discovery registered, loops running)."""
        await self._ready.wait()

    async def wait(self) -> None:
        """Return when closed; raise the error that crashed one of the service's loops."""
        if self._done is None:
            raise RuntimeError("Cluster.wait() before start()")
        await asyncio.shield(self._done)

    async def close(self) -> None:
        """Stop discovery and every loop and send; idempotent."""
        if self._closed:
            return
        self._closing = True
        if self._mdns is not None:
            await self._mdns.close()
        if self._dialer is not None:
            await self._dialer.close()
        self._prober.cancel()
        tasks = [*self._tasks, *self._sends]
        if self._members_saver is not None:
            tasks.append(self._members_saver)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._membership is not None and self._members_path is not None:
            await self._save_members()  # the latest view, for the next start
        self._closed = True
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _spawn(self, coro: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(f"cluster-{name}")
        task.add_done_callback(self._loop_done)
        self._tasks.append(task)

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._closing:
            return
        exc = task.exception()
        err = exc or RuntimeError(f"{task.get_name()} returned")
        log.error("cluster: %s crashed: %r", task.get_name(), err)
        if self._done is not None and not self._done.done():
            self._done.set_exception(err)

    # -- public API ----------------------------------------------------------------------------

    def on_change(self, callback: Callable[[ClusterView], None]) -> None:
        """Call `callback(view)` on membership, leader or term changes and new link estimates."""
        self._callbacks.append(callback)

    def add_bootstrap(self, address: tuple[str, int]) -> None:
        """Dial `address` until it answers once (e.g. from `fusionctl join ADDR`)."""
        address = (str(address[0]), int(address[1]))
        if self._dialer is None:
            if address not in self._pending_bootstrap:
                self._pending_bootstrap.append(address)
        else:
            self._dialer.add(address)

    def accepts_term(self, term: int) -> bool:
        """Whether a scheduler message of `term` is current here (stale terms are refused)."""
        return self._election is None or self._election.accepts_term(term)

    async def leave(self) -> None:
        """Leave the cluster for good (this incarnation): tell everyone, stop voting."""
        ms, el = self._membership, self._election
        if ms is None or el is None or ms.me.state == "left":
            return
        now = time.monotonic()
        ms.leave(now)
        el.disable(now)
        self._members_changed()
        if self._mdns is not None:
            await self._mdns.close()
        leave = Leave(node_id=self.node_id, incarnation=self._incarnation)
        view = self._view_messages()
        peers = [p for p in ms.with_state("alive", "suspect") if p != self.node_id]
        await asyncio.gather(*(self._send_now(p, m) for p in peers for m in (leave, *view)))
        log.info("cluster: left (told %d peers)", len(peers))
        self._notify(force=True)

    async def remove(self, node_id: str) -> None:
        """Operator removal, for good: `node_id` stops counting toward the majority and its
        records are never merged again; gossiped at once, signed with the operator (cluster
        CA) key.

        Raises UnknownMemberError if `node_id` is not a member, NotAuthorizedError if this
        node does not hold the operator key (signed mode).
        """
        ms = self._membership
        if ms is None or ms.get(node_id) is None:
            raise UnknownMemberError(f"{node_id!r} is not a member of cluster {self.cluster_id}")
        if node_id == self.node_id:
            await self.leave()
            return
        signature = self._trust.sign_removal(node_id) if self._trust is not None else b""
        now = time.monotonic()
        # Told: everyone reachable, the removed member included (if it still runs, it learns
        # it was removed and stops voting; afterwards nobody gossips to it any more).
        peers = [p for p in ms.with_state("alive", "suspect") if p != self.node_id]
        ms.remove(node_id, now, signature)
        self._members_changed()
        self._prober.forget(node_id)
        assert self._election is not None
        self._election.forget(node_id, now)
        log.warning("cluster: %s removed by operator; voters now %d", node_id, len(ms.voters()))
        view = self._view_messages()
        await asyncio.gather(*(self._send_now(p, m) for p in peers for m in view))
        self._notify(force=True)

    def view(self) -> ClusterView:
        """A snapshot of membership, leadership and the link matrix."""
        ms, el = self._membership, self._election
        now = time.monotonic()
        if ms is None or el is None:
            return ClusterView(self.node_id, self.cluster_id, (), None, 0, False, 0, 0, 1, {})
        leader = el.leader(now)
        links = ms.links()
        members = []
        for nid in ms.ids():
            rec = ms.get(nid)
            state = ms.state(nid)
            source = ms.source(nid)
            assert rec is not None and state is not None and source is not None
            link = links.get((self.node_id, nid)) or links.get((nid, self.node_id))
            members.append(MemberView(
                node_id=nid, address=rec.address, source=source, state=state,
                incarnation=rec.incarnation, heartbeat=rec.heartbeat, profile=rec.profile,
                rtt_s=link.rtt_s if link else None,
                bandwidth_bits_per_s=(link.bandwidth_bits_per_s
                                      if link and link.bandwidth_bits_per_s > 0 else None),
                role="scheduler" if nid == leader else "worker"))
        voters = ms.voters()
        alive = [v for v in voters if ms.state(v) == "alive"]
        need = majority(voters)
        return ClusterView(
            node_id=self.node_id, cluster_id=self.cluster_id, members=tuple(members),
            leader=leader, term=el.term, has_quorum=bool(voters) and len(alive) >= need,
            voters=len(voters), alive_voters=len(alive), needed=need, links=links)

    # -- messages ------------------------------------------------------------------------------

    async def handle(self, peer: str, msg: Message) -> bool:
        """Handle a peer message if it is the cluster's; True if consumed."""
        ms, el = self._membership, self._election
        if not isinstance(msg, _CLUSTER_MESSAGES):
            return False
        if ms is None or el is None or self._closing:
            return True  # ours, but we are not running: drop it
        now = time.monotonic()
        if isinstance(msg, Gossip):
            self._on_gossip(peer, msg, now)
        elif isinstance(msg, Ping):
            self._send_bg(peer, self._prober.on_ping(peer, msg))
        elif isinstance(msg, Pong):
            self._prober.on_pong(peer, msg)
        elif isinstance(msg, ProbeData):
            ack = self._prober.on_probe_data(peer, msg, now)
            if ack is not None:
                self._send_bg(peer, ack)
        elif isinstance(msg, ProbeAck):
            self._prober.on_probe_ack(peer, msg)
        elif isinstance(msg, Leave):
            self._on_leave(peer, msg, now)
        else:
            before = (el.leader(now), el.term)
            voters = ms.voters()
            if isinstance(msg, PreVote):
                outs = el.on_prevote(peer, msg, now, voters)
            elif isinstance(msg, VoteRequest):
                outs = el.on_vote_request(peer, msg, now, voters)
            elif isinstance(msg, Vote):
                outs = el.on_vote(peer, msg, now, voters, self._reachable())
            elif isinstance(msg, Leader):
                outs = el.on_leader(peer, msg, now, voters)
            else:
                assert isinstance(msg, LeaderAck)
                outs = el.on_leader_ack(peer, msg, now)
            self._persist_election()  # a vote or a new term is durable before it is sent
            for dst, out in outs:
                self._send_bg(dst, out)
            self._log_leadership(now)
            if (el.leader(now), el.term) != before:
                self._notify()
            self._log_election_refusals(peer, now)
        return True

    def _on_gossip(self, peer: str, msg: Gossip, now: float) -> None:
        ms, el = self._membership, self._election
        assert ms is not None and el is not None
        until = self._quarantine.get(peer)
        if until is not None:
            if now < until:
                self._reject(peer, "quarantined", now, "the peer relayed forged or malformed "
                             "facts lately; its gossip is ignored for a while")
                return
            del self._quarantine[peer]
        if not 0 <= msg.term <= MAX_TERM:
            # Hearsay never adopted anyway (each member's term is in its own signed record);
            # an absurd one is said, as the sign of a broken or hostile peer it is.
            self._reject(peer, "absurd gossip term", now, f"{msg.term}; ignored")
        limit = self.config.max_members
        if len(msg.members) > limit + 1 or len(msg.removals) > limit:
            self._reject(peer, "oversized gossip", now, f"{len(msg.members)} entries and "
                         f"{len(msg.removals)} removals, limit {limit} (cluster.max_members)")
            self._quarantine[peer] = now + self.config.quarantine_s
            return
        records: list[MemberRecord] = []
        bad = 0
        own = False
        for entry in msg.members:
            rec, problem, misbehaved = self._admit(entry)
            if rec is None:
                # Unverifiable is routine (a heartbeat of a member whose certificate has not
                # reached us yet); forged or malformed is not.
                self._reject(peer, problem, now, f"entry for {entry.node_id[:MAX_NODE_ID_CHARS]}",
                             logging.WARNING if misbehaved else logging.DEBUG)
                if entry.node_id == peer:
                    self._reject(peer, "unverified sender", now, "its own entry does not "
                                 "verify: the whole message is dropped",
                                 logging.WARNING if misbehaved else logging.DEBUG)
                    if misbehaved:
                        self._quarantine[peer] = now + self.config.quarantine_s
                    return
                if misbehaved:
                    bad += 1
                    if bad >= _MAX_BAD_ENTRIES:
                        break
                continue
            own = own or rec.node_id == peer
            records.append(rec)
        removals = self._admit_removals(peer, msg.removals, now)
        if removals is None:
            bad += 1
            removals = {}
        if bad:
            self._quarantine[peer] = now + self.config.quarantine_s
            if len(self._quarantine) > 4 * self.config.max_members:
                self._quarantine = {p: t for p, t in self._quarantine.items() if t > now}
        if not own:
            log.debug("gossip from %s without its own entry; ignored", peer)
            return
        result = ms.merge(records, now, removals)
        self._after_merge(result.transitions, result.self_removed, now)
        if result.sender_behind:
            self._send_view(peer)

    def _after_merge(self, transitions: Sequence[Transition], self_removed: bool,
                     now: float) -> None:
        ms, el = self._membership, self._election
        assert ms is not None and el is not None
        self._learn_addresses()
        before = (el.leader(now), el.term)
        el.set_reported_terms(ms.reported_terms())
        if self_removed:
            el.disable(now)
            log.warning("cluster: this node was removed from the cluster by an operator; "
                        "it no longer votes (restart fusiond to rejoin)")
        for t in transitions:
            self._log_transition(t)
            if t.new == "left":
                el.forget(t.node_id, now)
                self._prober.forget(t.node_id)
        self._members_changed()
        self._log_leadership(now)
        if transitions or (el.leader(now), el.term) != before:
            self._notify()

    def _admit(self, entry: MemberEntry) -> tuple[MemberRecord | None, str, bool]:
        """(the entry as a record, '', False) if it may be merged; else (None, why, whether
        that is the sender's misbehaviour: malformed or forged, not merely unverifiable)."""
        ms = self._membership
        assert ms is not None
        problem = entry_problem(entry, max_links=self.config.max_members)
        if problem:
            return None, f"malformed entry: {problem}", True
        rec = record_from_wire(entry)
        tr = self._trust
        if tr is None:
            return rec, "", False
        nid = entry.node_id
        if entry.credential:
            try:
                tr.learn(nid, entry.credential)
            except TrustError as exc:
                return None, f"bad credential: {exc}", True
        header = ms.header_is_news(nid, rec.incarnation, rec.heartbeat, rec.state == "left")
        body = entry.profile is not None and ms.body_is_news(nid, rec.incarnation,
                                                             rec.body_version)
        if not header and not body:
            return rec, "", False  # changes nothing (it only tells what the sender knows)
        if not tr.knows(nid):
            return None, "no credential known", False
        if header and not tr.verify_by(nid, header_statement(
                self.cluster_id, nid, rec.address, rec.incarnation, rec.heartbeat,
                rec.state == "left", rec.term), entry.signature):
            return None, "bad header signature", True
        if entry.profile is not None:
            ok = False
            if body:
                profile = entry.profile  # as the member signed it
                raw = body_bytes(profile, rec.links)
                ok = len(raw) <= MAX_BODY_BYTES and tr.verify_by(nid, body_statement(
                    self.cluster_id, nid, rec.incarnation, rec.body_version,
                    hashlib.sha256(raw).digest()), entry.body_signature)
                if ok:
                    rec = dataclasses.replace(rec, profile=profile)
                elif not header:
                    return None, "bad body signature", True
            if not ok:
                rec = dataclasses.replace(rec, profile=ELIDED, links={}, body_version=0,
                                          body_signature=b"")
        return rec, "", False

    def _admit_removals(self, peer: str, removals: Sequence[Removal],
                        now: float) -> dict[str, bytes] | None:
        """The sender's removals that hold (signed with the operator key); None if one is
        forged or malformed (the rest are then dropped too)."""
        ms = self._membership
        assert ms is not None
        out: dict[str, bytes] = {}
        for r in removals:
            if (not r.node_id or len(r.node_id) > MAX_NODE_ID_CHARS
                    or len(r.signature) > MAX_SIGNATURE_BYTES):
                self._reject(peer, "malformed removal", now, "")
                return None
            if ms.is_removed(r.node_id):
                out[r.node_id] = r.signature
                continue
            if self._trust is not None and not self._trust.verify_removal(r.node_id,
                                                                        r.signature):
                self._reject(peer, "forged removal", now,
                             f"of {r.node_id}: not signed with the cluster CA key")
                return None
            out[r.node_id] = r.signature
        return out

    def _reject(self, peer: str, reason: str, now: float, detail: str,
                level: int = logging.WARNING) -> None:
        """Count a refused fact; log it at most once per _LOG_EVERY_S per peer and reason."""
        key = reason.split(":")[0]
        self.rejected[key] = self.rejected.get(key, 0) + 1
        last, suppressed = self._logged.get((peer, key), (-math.inf, 0))
        if now - last < _LOG_EVERY_S:
            self._logged[(peer, key)] = (last, suppressed + 1)
            return
        if len(self._logged) > 4 * self.config.max_members:
            self._logged.clear()
        self._logged[(peer, key)] = (now, 0)
        more = f" (and {suppressed} more since)" if suppressed else ""
        log.log(level, "cluster: refused from %s: %s%s%s", peer, reason,
                f" ({detail})" if detail else "", more)

    def _log_election_refusals(self, peer: str, now: float) -> None:
        el = self._election
        assert el is not None
        for reason, count in el.refused.items():
            seen = self._logged.get(("election", reason))
            if seen is None or (count > seen[1] and now - seen[0] >= _LOG_EVERY_S):
                self._logged[("election", reason)] = (now, count)
                if reason not in _ROUTINE_REFUSALS:
                    log.warning("cluster: election message refused (latest from %s): %s "
                                "(%d so far)", peer, reason, count)

    def _on_leave(self, peer: str, msg: Leave, now: float) -> None:
        ms = self._membership
        assert ms is not None
        if msg.node_id != peer:
            return  # a node can only announce its own departure
        t = ms.left_by_message(msg.node_id, msg.incarnation, now)
        if t is None:
            return
        self._prober.forget(msg.node_id)
        assert self._election is not None
        self._election.forget(msg.node_id, now)
        log.info("cluster: %s left", msg.node_id)
        self._log_leadership(now)
        self._members_changed()
        self._notify()

    # -- loops ---------------------------------------------------------------------------------

    async def _gossip_loop(self) -> None:
        ms = self._membership
        assert ms is not None
        interval = self.config.gossip_interval_s
        rounds = 0
        while True:
            now = time.monotonic()
            ms.beat(now, self._safe_profile(ms.me.profile))
            # Heartbeats every round. Profiles and links are most of the bytes and the encoding
            # work and change rarely: our own go to every target every `gossip_full_every`
            # rounds; the whole view (everyone's) to one random target every
            # `gossip_sync_every` rounds (anti-entropy), and to new contacts.
            own = rounds % self.config.gossip_full_every == 0
            sync = rounds % self.config.gossip_sync_every == 0
            rounds += 1
            msg = self._gossip_message(full={self.node_id} if own else set())
            targets = self._gossip_targets()
            synced = next((p for p in targets if p not in self._contacts), None) if sync else None
            for peer in targets:
                if peer in self._contacts or peer == synced:
                    self._send_view(peer)
                else:
                    self._send_bg(peer, msg)
            # Jitter so rounds of many nodes do not synchronise.
            await asyncio.sleep(interval * self._rng.uniform(0.9, 1.1))

    def _gossip_targets(self) -> list[str]:
        ms = self._membership
        assert ms is not None
        live = [p for p in ms.with_state("alive", "suspect") if p != self.node_id]
        targets = self._rng.sample(live, min(self.config.gossip_fanout, len(live)))
        dead = ms.with_state("dead")
        if dead:
            # One dead member per round: after a partition heals, this is how sides meet again.
            targets.append(self._rng.choice(dead))
        for nid in list(self._contacts):
            if ms.get(nid) is not None and ms.state(nid) != "dead":
                del self._contacts[nid]
            elif nid not in targets:
                targets.append(nid)
        return targets

    def _entry(self, rec: MemberRecord, full: bool) -> MemberEntry | None:
        """`rec` as a gossip entry (with its member's credential when `full`); None for a
        record we cannot relay (unsigned, in signed mode)."""
        tr = self._trust
        if rec.node_id == self.node_id:
            return self._own_entry(full)
        if tr is None:
            return record_to_wire(rec, full)
        if not rec.signature:
            return None
        return record_to_wire(rec, full, (tr.credential_of(rec.node_id) or b"") if full else b"")

    def _gossip_message(self, full: Collection[str] | None = None) -> Gossip:
        """Our view; profiles and links only for the members in `full` (None: everyone: use
        `_view_messages` for a whole view, which may not fit one message). Our own entry always
        carries our credential, a full entry its member's."""
        ms = self._membership
        assert ms is not None
        entries = [e for r in ms.records()
                   if (e := self._entry(r, full is None or r.node_id in full)) is not None]
        return self._gossip_of(entries)

    def _gossip_of(self, entries: Sequence[MemberEntry]) -> Gossip:
        ms, el = self._membership, self._election
        assert ms is not None and el is not None
        leader = el.leader(time.monotonic())
        return Gossip(sender=self.node_id, members=tuple(entries), term=el.term,
                      leader=leader or "",
                      removals=tuple(Removal(node_id=n, signature=sig)
                                     for n, sig in sorted(ms.removed().items())))

    def _view_messages(self) -> list[Gossip]:
        """Our whole view, every member's profile and links (anti-entropy, a new contact, a
        peer that is behind), as Gossip messages of at most about `VIEW_PART_BYTES` each.

        A whole view grows with the square of the members (each one's links to all others):
        96 members' are above the CONTROL lane's bound. Every part carries every member's
        header (so each part alone says who is in the cluster, and no receiver takes a part
        for a sender that lacks members), and the members' bodies are shared out among the
        parts."""
        ms = self._membership
        assert ms is not None
        heads: list[MemberEntry] = []
        bodies: list[tuple[str, MemberEntry, int]] = []  # (node id, full entry, extra bytes)
        for r in ms.records():
            head = self._entry(r, False)
            if head is None:
                continue
            heads.append(head)
            if r.node_id == self.node_id:
                continue
            body = self._entry(r, True)
            assert body is not None
            bodies.append((r.node_id, body, wire_bytes(body) - wire_bytes(head)))
        own = self._entry(ms.me, True)
        assert own is not None
        base = wire_bytes(self._gossip_of([own, *heads])) - wire_bytes(
            next(h for h in heads if h.node_id == self.node_id))
        parts: list[dict[str, MemberEntry]] = [{}]
        used = base
        for nid, body, extra in bodies:
            if parts[-1] and used + extra > VIEW_PART_BYTES:
                parts.append({})
                used = base
            parts[-1][nid] = body
            used += extra
        return [self._gossip_of([own if h.node_id == self.node_id else part.get(h.node_id, h)
                                 for h in heads]) for part in parts]

    def _send_view(self, peer: str) -> None:
        """Our whole view to `peer`, in the background (`_view_messages`)."""
        for msg in self._view_messages():
            self._send_bg(peer, msg)

    def _own_entry(self, full: bool) -> MemberEntry:
        """Our record, signed: the header once per change (each heartbeat, a new term), the
        body when it changed since we last signed it."""
        ms, el = self._membership, self._election
        assert ms is not None and el is not None
        me, tr = ms.me, self._trust
        left = me.state == "left"
        key = (me.address, me.incarnation, me.heartbeat, left, el.term)
        if self._own_header is None or self._own_header[0] != key:
            sig = tr.sign(header_statement(self.cluster_id, self.node_id, me.address,
                                           me.incarnation, me.heartbeat, left, el.term)
                          ) if tr is not None else b""
            self._own_header = (key, sig)
        body_version, body_sig = 0, b""
        if full:  # a heartbeat-only entry carries no body: nothing to hash or sign
            digest = hashlib.sha256(body_bytes(me.profile, me.links)).digest()
            if self._own_body is None or self._own_body[0] != digest:
                sig = tr.sign(body_statement(self.cluster_id, self.node_id, me.incarnation,
                                             me.heartbeat, digest)) if tr is not None else b""
                self._own_body = (digest, me.heartbeat, sig)
            _, body_version, body_sig = self._own_body
        rec = dataclasses.replace(me, term=el.term, signature=self._own_header[1],
                                  body_version=body_version, body_signature=body_sig)
        return record_to_wire(rec, full, tr.credential if tr is not None else b"")

    async def _tick_loop(self) -> None:
        ms, el = self._membership, self._election
        assert ms is not None and el is not None
        while True:
            now = time.monotonic()
            before = (el.leader(now), el.term)
            transitions = ms.check(now)
            for t in transitions:
                self._log_transition(t)
            voters = ms.voters()

            def ranked(voters: frozenset[str] = voters) -> list[str]:
                alive = [r for r in (ms.get(v) for v in voters if ms.state(v) == "alive")
                         if r is not None]
                return rank_order(alive, ms.links())

            # Alone, but still dialling a bootstrap address or waiting to hear from a contact:
            # we are joining a cluster, so we never found one of our own meanwhile.
            joining = voters == {self.node_id} and bool(
                self._contacts or (self._dialer is not None and self._dialer.pending()))
            outs = el.tick(now, voters=voters, ranked_alive=ranked, reachable=self._reachable(),
                           campaign=not joining)
            self._persist_election()  # a campaign's new term and self-vote, before asking
            for dst, out in outs:
                self._send_bg(dst, out)
            self._log_leadership(now)
            if transitions or (el.leader(now), el.term) != before:
                self._notify()
            await asyncio.sleep(self.config.tick_s)

    async def _probe_loop(self) -> None:
        ms = self._membership
        assert ms is not None
        cfg = self.config
        await asyncio.sleep(self._rng.uniform(0.0, min(1.0, cfg.probe_interval_s)))
        while True:
            now = time.monotonic()
            due = [p for p in ms.with_state("alive")
                   if p != self.node_id and ms.me.state != "left"
                   and now - self._last_probe.get(p, -math.inf) >= cfg.probe_interval_s]
            self._rng.shuffle(due)
            measured = False
            for peer in due:
                # Spread rounds: the next one is due one interval (+-10 %) from now.
                self._last_probe[peer] = time.monotonic() + cfg.probe_interval_s * (
                    self._rng.uniform(-0.1, 0.1))
                try:
                    est = await self._prober.probe(peer)
                except ProbeFailed as exc:
                    log.debug("probe of %s failed: %s", peer, exc)
                    continue
                except LocalProtocolError as exc:  # our bug, not the peer's: say so loudly
                    log.error("probe of %s: cannot encode: %s", peer, exc)
                    continue
                except Exception as exc:  # unreachable peer etc.: membership will notice
                    log.info("probe of %s failed: %r", peer, exc)
                    continue
                if ms.state(peer) in ("left", None):
                    continue
                ms.set_link(peer, Link(est.bandwidth_bits_per_s or 0.0, est.rtt_s or 0.0,
                                       est.bandwidth_spread_ratio, est.measured_at))
                if est.bandwidth_bits_per_s:  # frame deadlines follow the measured link
                    self._net.set_link_rate(
                        peer, bytes_per_s_from_bits_per_s(est.bandwidth_bits_per_s))
                measured = True
                log.log(logging.INFO if est.changed and est.bandwidth_bits_per_s else
                        logging.DEBUG,
                        "link %s -> %s: %.1f Mbit/s (+-%.0f %%%s), rtt %.2f ms", self.node_id,
                        peer, (est.bandwidth_bits_per_s or 0) / 1e6,
                        est.bandwidth_spread_ratio * 100, ", a new figure" if est.changed else "",
                        (est.rtt_s or 0) * 1e3)
            if measured:
                self._notify(force=True)
            await asyncio.sleep(min(1.0, cfg.probe_interval_s / 4))

    # -- helpers -------------------------------------------------------------------------------

    def _persist_election(self) -> None:
        """Make the election's term and vote durable if they changed (synchronous: a few
        hundred bytes and an fsync, only when a term or vote changes)."""
        el = self._election
        if self._state_path is None or el is None:
            return
        state = ElectionState(el.term, el.voted_for)
        if state == self._persisted:
            return
        try:
            save_election_state(self._state_path, state, cluster_id=self.cluster_id,
                                node_id=self.node_id)
        except (OSError, ValueError) as exc:
            # Not fatal (the start grace still guards a restart); retried at the next call,
            # said once per distinct error rather than every tick.
            msg = f"cannot persist the election state to {self._state_path}: {exc}"
            if msg != self._persist_error:
                log.error("cluster: %s", msg)
                self._persist_error = msg
            return
        self._persisted = state
        self._persist_error = ""

    def _members_state(self) -> MembersState:
        ms = self._membership
        assert ms is not None
        tr = self._trust
        stored = []
        for nid in ms.ids():
            rec = ms.get(nid)
            if nid == self.node_id or rec is None or ms.is_removed(nid):
                continue
            stored.append(StoredMember(
                node_id=nid, address=rec.address, incarnation=rec.incarnation,
                heartbeat=rec.heartbeat, left=rec.state == "left", term=rec.term,
                signature=rec.signature,
                credential=(tr.credential_of(nid) or b"") if tr is not None else b""))
        return MembersState(tuple(stored), ms.removed(), ms.voters())

    def _members_changed(self) -> None:
        """Schedule a write of the member list if it changed in a way that matters after a
        restart (members, incarnations, addresses, left, voters, credentials, removals)."""
        ms = self._membership
        if self._members_path is None or ms is None or self._closing:
            return
        tr = self._trust
        key = (tuple((nid, rec.incarnation, rec.address, rec.state, ms.state(nid) == "left",
                      tr is not None and tr.credential_of(nid) is not None)
                     for nid in ms.ids() if (rec := ms.get(nid)) is not None),
               tuple(sorted(ms.removed())))
        if key == self._members_key:
            return
        self._members_key = key
        if self._members_saver is None or self._members_saver.done():
            self._members_saver = asyncio.ensure_future(self._members_save_soon())

    async def _members_save_soon(self) -> None:
        await asyncio.sleep(_MEMBERS_SAVE_DELAY_S)  # changes come in bursts: write them once
        await self._save_members()

    async def _save_members(self) -> None:
        """Write the member list now (in a thread: up to tens of KB and an fsync)."""
        assert self._members_path is not None
        state = self._members_state()
        try:
            await asyncio.to_thread(save_members_state, self._members_path, state,
                                    cluster_id=self.cluster_id, node_id=self.node_id)
        except OSError as exc:
            self._members_key = None  # retried at the next change
            log.error("cluster: cannot persist the member list to %s: %s", self._members_path,
                      exc)

    async def _restore_members(self, now: float) -> None:
        """Load the member list of our last run: those members count as voters (dead until
        heard from). Entries that do not verify are dropped, each with a warning."""
        ms, el, tr = self._membership, self._election, self._trust
        assert ms is not None and el is not None and self._members_path is not None
        try:
            saved = await asyncio.to_thread(
                load_members_state, self._members_path, cluster_id=self.cluster_id,
                node_id=self.node_id, max_members=self.config.max_members)
        except MembersStateError as exc:
            log.warning("cluster: ignoring the persisted member list: %s", exc)
            return
        if saved is None:
            return
        records = []
        for m in saved.members:
            if tr is not None:
                try:
                    tr.learn(m.node_id, m.credential)
                except TrustError as exc:
                    log.warning("cluster: persisted member %s dropped: %s", m.node_id, exc)
                    continue
                if not tr.verify_by(m.node_id, header_statement(
                        self.cluster_id, m.node_id, m.address, m.incarnation, m.heartbeat,
                        m.left, m.term), m.signature):
                    log.warning("cluster: persisted member %s dropped: its signature does "
                                "not verify", m.node_id)
                    continue
            records.append(MemberRecord(
                m.node_id, m.address, m.incarnation, m.heartbeat,
                "left" if m.left else "alive", NodeProfile(), {}, term=m.term,
                signature=m.signature,
                body_version=-1))
        removals = {n: sig for n, sig in saved.removals.items()
                    if tr is None or tr.verify_removal(n, sig)}
        restored = ms.restore(records, removals, now)
        for nid in restored:
            rec = ms.get(nid)
            if nid not in saved.voters and rec is not None:
                ms.left_by_message(nid, rec.incarnation, now)  # it was no voter any more
        el.set_reported_terms(ms.reported_terms())
        self._learn_addresses()
        voters = ms.voters()
        log.info("cluster: restored %d member(s) from %s: %d voters, %d needed for a "
                 "majority", len(restored), self._members_path, len(voters), majority(voters))

    def _safe_profile(self, fallback: NodeProfile) -> NodeProfile:
        try:
            profile = self._profile()
            problem = checked_profile(profile)
        except Exception as exc:  # a broken profile source must not stop gossip
            problem = repr(exc)
        if problem is None:
            return profile
        if not self._warned_profile:
            self._warned_profile = True
            log.warning("cluster: profile() gave no sendable profile (%s); gossiping the "
                        "previous one", problem)
        return fallback

    def _reachable(self) -> list[str]:
        ms = self._membership
        assert ms is not None
        return [p for p in ms.with_state("alive", "suspect") if p != self.node_id]

    def _learn_addresses(self) -> None:
        ms = self._membership
        assert ms is not None
        for nid in ms.ids():
            rec = ms.get(nid)
            if nid == self.node_id or rec is None:
                continue
            if self._addresses.get(nid) != rec.address:
                self._addresses[nid] = rec.address
                self._net.add_peer_address(nid, rec.address)

    def _on_found(self, node_id: str, address: Address, source: MemberSource) -> None:
        ms = self._membership
        if ms is None or self._closing or node_id == self.node_id:
            return
        ms.hint_source(node_id, source)
        if self._addresses.get(node_id) != address:
            self._addresses[node_id] = address
            self._net.add_peer_address(node_id, address)
        if ms.get(node_id) is None or ms.state(node_id) == "dead":
            if node_id not in self._contacts:
                log.info("cluster: found %s at %s:%d via %s", node_id, address[0], address[1],
                         source)
            self._contacts[node_id] = address
            self._send_view(node_id)

    async def _send_now(self, peer: str, msg: Message) -> None:
        try:
            await asyncio.wait_for(self._net.send(peer, msg), self.config.send_timeout_s)
        except asyncio.CancelledError:
            raise
        except LocalProtocolError as exc:  # we built something unsendable: a bug, say so
            log.error("cannot send %s to %s: %s", type(msg).__name__, peer, exc)
        except Exception as exc:  # a peer we cannot reach: membership will notice
            log.debug("send %s to %s failed: %r", type(msg).__name__, peer, exc)

    def _send_bg(self, peer: str, msg: Message) -> None:
        if self._closing:
            return
        if len(self._sends) >= _MAX_PENDING_SENDS:
            log.debug("send backlog full; dropping %s to %s", type(msg).__name__, peer)
            return
        task = asyncio.ensure_future(self._send_now(peer, msg))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _log_transition(self, t: Transition) -> None:
        if t.old is None:
            log.info("cluster: member %s joined (%s)", t.node_id, t.new)
        elif t.new in ("dead", "left"):
            log.warning("cluster: member %s %s -> %s", t.node_id, t.old, t.new)
        else:
            log.info("cluster: member %s %s -> %s", t.node_id, t.old, t.new)

    def _log_leadership(self, now: float) -> None:
        """One line for a change of the scheduler or the term since the last, with the reason
        the election gives (a heartbeat lost to the clock is noticed here too)."""
        el = self._election
        assert el is not None
        c = el.leadership_change(now)
        if c is None:
            return
        why = f": {c.reason}" if c.reason else ""
        if c.leader is None and c.was_leader is None:
            log.debug("cluster: term %d, no scheduler yet%s", c.term, why)
        elif c.leader is None:
            log.warning("cluster: no scheduler (term %d, was %s)%s", c.term, c.was_leader, why)
        else:
            log.info("cluster: scheduler is %s, term %d%s%s", c.leader, c.term,
                     " (this node)" if c.leader == self.node_id else "", why)

    def _notify(self, force: bool = False) -> None:
        if not self._callbacks:
            return
        view = self.view()
        signature = (view.leader, view.term, view.has_quorum,
                     tuple((m.node_id, m.state, m.incarnation) for m in view.members))
        if not force and signature == self._signature:
            return
        self._signature = signature
        for cb in list(self._callbacks):
            try:
                cb(view)
            except Exception:
                log.exception("cluster: on_change callback failed")


_CLUSTER_MESSAGES = (Gossip, Leave, PreVote, VoteRequest, Vote, Leader, LeaderAck, Ping, Pong,
                     ProbeData, ProbeAck)


def members_in(view: ClusterView, *states: MemberState) -> Collection[str]:
    """Node ids of `view`'s members in one of `states`."""
    return [m.node_id for m in view.members if m.state in states]


__all__ = ["Cluster", "ClusterConfig", "ClusterView", "MemberView", "Transport", "members_in"]
