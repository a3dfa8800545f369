"""Membership by gossip, with a heartbeat failure detector (sans-IO: time is passed in).

Each member *authors* its own record — address, incarnation, heartbeat, profile, measured
links — and the record travels by gossip. Records are ordered by ``(incarnation, heartbeat)``:
a newer one replaces an older one and refreshes the local "last heard" time of that member.

- Failure detector: every node judges freshness itself. A member whose record has not advanced
  for ``suspect_after_s`` is *suspect*, for ``dead_after_s`` *dead*. Suspect/dead are local
  judgements, so they are not authoritative in gossip, except that a member first learned from
  gossip starts in the state the sender reported (a newcomer must not believe a long-dead
  member alive).
- Incarnation: the node's start time in milliseconds, so a restarted node's records supersede
  its old ones and it is alive again at once.
- Profiles and links change rarely, so most gossip entries leave them out (`ELIDED`); a
  newer record without them keeps the ones already known.
- ``left`` is authoritative and sticky for an incarnation: set by the member itself (leave) or
  by an operator (remove). A node that learns it was removed accepts it and stops voting; it
  rejoins only by restarting (a new incarnation).
- A member counts as a voter until it has left or been removed, dead or not.
"""

from __future__ import annotations

import dataclasses
import time
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

Address = tuple[str, int]
MemberState = Literal["alive", "suspect", "dead", "left"]
MemberSource = Literal["mdns", "bootstrap", "gossip", "self"]


class Link(NamedTuple):
    """One measured link, as its measurer gossips it (`protocol.messages.LinkMeasurement`)."""

    bandwidth_bits_per_s: float
    """Goodput in bits per second (0: RTT measured, no bandwidth sample counted yet)."""
    rtt_s: float
    """Round trip in seconds."""
    bandwidth_spread_ratio: float = 0.0
    """Accuracy of the last probe round: the relative half-range of its samples
    ((max - min) / 2 / median; 0.05 = +-5 %); 0 when unknown."""
    measured_at: float = 0.0
    """Unix time (the measurer's clock) of the last probe round; 0 when unknown."""


ELIDED: Mapping[str, Any] = types.MappingProxyType({})
"""Marks a record that carried no profile and no links (a heartbeat-only gossip entry): merging
it keeps the profile and links already known. Compare with ``is``."""

_SOURCE_RANK: dict[MemberSource, int] = {"gossip": 0, "bootstrap": 1, "mdns": 2, "self": 3}


def new_incarnation() -> int:
    """An incarnation for a node starting now: wall-clock milliseconds (grows across restarts)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class MemberRecord:
    """What gossip carries about one member; authored by that member (``left`` excepted)."""

    node_id: str
    address: Address
    incarnation: int
    heartbeat: int
    state: MemberState
    """The sender's local judgement; only ``left`` is authoritative."""
    profile: Mapping[str, Any] = field(default_factory=dict)
    links: Mapping[str, Link] = field(default_factory=dict)
    """peer id -> the link this member measured to it."""

    def version(self) -> tuple[int, int]:
        """The order in which records of one member supersede each other."""
        return (self.incarnation, self.heartbeat)


@dataclass
class _Member:
    record: MemberRecord
    state: MemberState
    source: MemberSource
    last_update: float


@dataclass(frozen=True)
class Transition:
    """A member's state changed (or it appeared: ``old`` is None)."""

    node_id: str
    old: MemberState | None
    new: MemberState


@dataclass(frozen=True)
class MergeResult:
    """What one merge changed, and whether the sender's view was behind ours."""

    transitions: tuple[Transition, ...]
    updated: bool
    """Some record advanced (the views moved closer)."""
    sender_behind: bool
    """The sender lacks a member we know, or holds an older incarnation or a missing ``left``:
    worth replying with our view (heartbeat lag alone is not, or replies would ping-pong)."""
    self_removed: bool


class Membership:
    """This node's view of the cluster. Not thread-safe; owned by one event loop."""

    def __init__(
        self,
        *,
        node_id: str,
        address: Address,
        incarnation: int,
        profile: Mapping[str, Any],
        now: float,
        suspect_after_s: float,
        dead_after_s: float,
        max_members: int = 4096,
    ) -> None:
        if not 0 < suspect_after_s < dead_after_s:
            raise ValueError("need 0 < suspect_after_s < dead_after_s")
        self.node_id = node_id
        self._max_members = max_members
        self.refused = 0
        """Members not added because the table was full (a bound on what peers can make us
        hold; a real cluster that large needs a larger `max_members`)."""
        self._suspect_after = suspect_after_s
        self._dead_after = dead_after_s
        me = MemberRecord(node_id, address, incarnation, 0, "alive", dict(profile), {})
        self._members: dict[str, _Member] = {node_id: _Member(me, "alive", "self", now)}
        self._hints: dict[str, MemberSource] = {}

    # -- this node's own record -----------------------------------------------------------------

    @property
    def me(self) -> MemberRecord:
        """This node's current record."""
        return self._members[self.node_id].record

    def _set_me(self, record: MemberRecord) -> None:
        self._members[self.node_id].record = record

    def beat(self, now: float, profile: Mapping[str, Any] | None = None) -> None:
        """Advance our heartbeat (once per gossip round), optionally with a fresh profile."""
        me = self.me
        if me.state == "left":
            return
        self._set_me(
            MemberRecord(
                me.node_id, me.address, me.incarnation, me.heartbeat + 1, "alive",
                dict(profile) if profile is not None else me.profile, me.links,
            )
        )
        self._members[self.node_id].last_update = now

    def set_link(self, peer: str, link: Link) -> None:
        """Record a measurement of our link to `peer` (gossiped with our next heartbeat)."""
        me = self.me
        links = dict(me.links)
        links[peer] = Link(float(link.bandwidth_bits_per_s), float(link.rtt_s),
                           float(link.bandwidth_spread_ratio), float(link.measured_at))
        self._set_me(
            MemberRecord(me.node_id, me.address, me.incarnation, me.heartbeat, me.state,
                         me.profile, links)
        )

    def leave(self, now: float) -> None:
        """Mark this node as left (sticky for this incarnation); gossip spreads it."""
        me = self.me
        self._set_me(
            MemberRecord(me.node_id, me.address, me.incarnation, me.heartbeat + 1, "left",
                         me.profile, me.links)
        )
        member = self._members[self.node_id]
        member.state = "left"
        member.last_update = now

    def remove(self, node_id: str, now: float) -> Transition | None:
        """Operator removal: mark `node_id` left at its known incarnation; None if unknown."""
        member = self._members.get(node_id)
        if member is None:
            return None
        if node_id == self.node_id:
            self.leave(now)
            return Transition(node_id, "alive", "left")
        rec = member.record
        member.record = MemberRecord(rec.node_id, rec.address, rec.incarnation, rec.heartbeat,
                                     "left", rec.profile, rec.links)
        old = member.state
        member.state = "left"
        return Transition(node_id, old, "left") if old != "left" else None

    # -- discovery hints ------------------------------------------------------------------------

    def hint_source(self, node_id: str, source: MemberSource) -> None:
        """Remember how discovery found `node_id` (shown once it is a member)."""
        if node_id == self.node_id:
            return
        member = self._members.get(node_id)
        if member is not None:
            if _SOURCE_RANK[source] > _SOURCE_RANK[member.source]:
                member.source = source
            return
        old = self._hints.get(node_id)
        if old is None or _SOURCE_RANK[source] > _SOURCE_RANK[old]:
            self._hints[node_id] = source

    # -- gossip ---------------------------------------------------------------------------------

    def merge(self, records: Iterable[MemberRecord], now: float) -> MergeResult:
        """Merge a peer's records into our view; see the module docstring for the rules."""
        transitions: list[Transition] = []
        updated = False
        behind = False
        self_removed = False
        seen: set[str] = set()
        for rec in records:
            seen.add(rec.node_id)
            if rec.node_id == self.node_id:
                me = self.me
                if rec.state == "left" and rec.incarnation == me.incarnation and me.state != "left":
                    self.leave(now)
                    transitions.append(Transition(self.node_id, "alive", "left"))
                    self_removed = True
                    updated = True
                elif rec.version() < me.version() or (me.state == "left" and rec.state != "left"):
                    behind = True
                continue
            member = self._members.get(rec.node_id)
            if rec.profile is ELIDED:
                rec = dataclasses.replace(
                    rec, profile=member.record.profile if member else {},
                    links=member.record.links if member else {})
            if member is None and len(self._members) >= self._max_members:
                self.refused += 1
                continue
            if member is None:
                state: MemberState
                if rec.state == "left":
                    state, last = "left", now
                elif rec.state == "dead":
                    state, last = "dead", now - self._dead_after
                elif rec.state == "suspect":
                    state, last = "suspect", now - self._suspect_after
                else:
                    state, last = "alive", now
                source = self._hints.pop(rec.node_id, "gossip")
                self._members[rec.node_id] = _Member(rec, state, source, last)
                transitions.append(Transition(rec.node_id, None, state))
                updated = True
                continue
            cur = member.record
            if rec.incarnation > cur.incarnation or (
                rec.incarnation == cur.incarnation and rec.heartbeat > cur.heartbeat
                and cur.state != "left"
            ):
                # Newer record (a restart if the incarnation grew): alive again unless left.
                member.record = rec
                new_state: MemberState = "left" if rec.state == "left" else "alive"
                member.last_update = now
                if member.state != new_state:
                    transitions.append(Transition(rec.node_id, member.state, new_state))
                    member.state = new_state
                updated = True
            elif rec.incarnation == cur.incarnation and rec.state == "left" and cur.state != "left":
                member.record = MemberRecord(cur.node_id, cur.address, cur.incarnation,
                                             max(cur.heartbeat, rec.heartbeat), "left",
                                             cur.profile, cur.links)
                transitions.append(Transition(rec.node_id, member.state, "left"))
                member.state = "left"
                updated = True
            elif rec.incarnation < cur.incarnation or (
                cur.state == "left" and rec.state != "left"
                and rec.incarnation == cur.incarnation
            ):
                behind = True
        if any(nid not in seen for nid in self._members):
            behind = True
        return MergeResult(tuple(transitions), updated, behind, self_removed)

    def records(self) -> list[MemberRecord]:
        """Our view as gossip records, each carrying our local judgement of its state."""
        out = []
        for member in self._members.values():
            rec = member.record
            if rec.state != member.state:
                rec = MemberRecord(rec.node_id, rec.address, rec.incarnation, rec.heartbeat,
                                   member.state, rec.profile, rec.links)
            out.append(rec)
        return out

    def check(self, now: float) -> list[Transition]:
        """Run the failure detector: alive -> suspect -> dead by silence; returns changes."""
        out = []
        for nid, member in self._members.items():
            if nid == self.node_id or member.state == "left":
                continue
            age = now - member.last_update
            state: MemberState
            if age < self._suspect_after:
                state = "alive"
            elif age < self._dead_after:
                state = "suspect"
            else:
                state = "dead"
            if state != member.state:
                out.append(Transition(nid, member.state, state))
                member.state = state
        return out

    # -- queries --------------------------------------------------------------------------------

    def get(self, node_id: str) -> MemberRecord | None:
        """The latest record of `node_id`, or None."""
        member = self._members.get(node_id)
        return member.record if member is not None else None

    def state(self, node_id: str) -> MemberState | None:
        """Our judgement of `node_id`, or None if it is not a member."""
        member = self._members.get(node_id)
        return member.state if member is not None else None

    def source(self, node_id: str) -> MemberSource | None:
        """How we first learned of `node_id` (upgraded to the most direct discovery source)."""
        member = self._members.get(node_id)
        return member.source if member is not None else None

    def ids(self) -> list[str]:
        """Every member id we know, including left ones and ourselves, sorted."""
        return sorted(self._members)

    def with_state(self, *states: MemberState) -> list[str]:
        """Member ids (sorted, ourselves included) whose state is one of `states`."""
        return sorted(n for n, m in self._members.items() if m.state in states)

    def voters(self) -> frozenset[str]:
        """Members that count toward a majority: everyone who has not left or been removed."""
        return frozenset(n for n, m in self._members.items() if m.state != "left")

    def links(self) -> dict[tuple[str, str], Link]:
        """The cluster's measured link matrix: (measurer, peer) -> its `Link`."""
        out: dict[tuple[str, str], Link] = {}
        for nid, member in self._members.items():
            for peer, link in member.record.links.items():
                out[(nid, peer)] = link
        return out
