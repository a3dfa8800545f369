"""Membership by gossip, with a heartbeat failure detector (sans-IO: time is passed in).

Each member *authors* its own record — address, incarnation, heartbeat, left or not, the term
it has seen, profile, measured links — and signs it (fusiond.cluster.trust; the service checks
every signature before it calls `merge`, so this module only ever sees records their members
signed). The record travels by gossip. Headers are ordered by ``(incarnation, heartbeat)``: a
newer one replaces an older one and refreshes the local "last heard" time of that member. The
body (profile and links) has its own version, the member's heartbeat when it signed it, so a
relay forwards the member's signed body verbatim however many heartbeats later.

- Failure detector: every node judges freshness itself. A member whose record has not advanced
  for ``suspect_after_s`` is *suspect*, for ``dead_after_s`` *dead*. Suspect/dead are local
  judgements, so they are not authoritative in gossip, except that a member first learned from
  gossip starts in the state the sender reported (a newcomer must not believe a long-dead
  member alive).
- Incarnation: the node's start time in milliseconds, so a restarted node's records supersede
  its old ones and it is alive again at once.
- Profiles and links change rarely, so most gossip entries leave them out (`ELIDED`); a
  newer record without them keeps the ones already known.
- ``left`` is a member's own signed claim, sticky for its incarnation (a ``Leave`` message
  over the member's authenticated link has the same effect locally). A *removal* is an
  operator's statement (signed with the cluster CA key, checked by the service): the member is
  gone for good, all incarnations, and its records are never merged again.
- A member counts as a voter until it has left or been removed, dead or not. The member list
  survives a restart (`restore`), so a restarted node counts the voters it knew.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from protocol.messages import NodeProfile

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


ELIDED: NodeProfile = NodeProfile()
"""Marks a record that carried no profile and no links (a heartbeat-only gossip entry): merging
it keeps the profile and links already known. Compare with ``is``."""

_SOURCE_RANK: dict[MemberSource, int] = {"gossip": 0, "bootstrap": 1, "mdns": 2, "self": 3}


def new_incarnation() -> int:
    """An incarnation for a node starting now: wall-clock milliseconds (grows across restarts)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class MemberRecord:
    """What gossip carries about one member, authored and signed by that member."""

    node_id: str
    address: Address
    incarnation: int
    heartbeat: int
    state: MemberState
    """The sender's local judgement; only ``left`` is authoritative."""
    profile: NodeProfile = field(default_factory=NodeProfile)
    links: Mapping[str, Link] = field(default_factory=dict)
    """peer id -> the link this member measured to it."""
    term: int = 0
    """The highest election term the member has seen (signed with its header)."""
    signature: bytes = b""
    """The member's signature over its header (empty in plaintext dev mode)."""
    body_version: int = 0
    """The member's heartbeat when it signed its profile and links; -1: the body we hold is
    from an older incarnation (shown, never relayed)."""
    body_signature: bytes = b""
    """The member's signature over its body."""

    def version(self) -> tuple[int, int]:
        """The order in which records of one member supersede each other."""
        return (self.incarnation, self.heartbeat)


@dataclass
class _Member:
    record: MemberRecord
    state: MemberState
    source: MemberSource
    last_update: float
    left_incarnation: int = -1
    """Incarnations up to this one left (a Leave over the member's own link)."""

    def left(self) -> bool:
        rec = self.record
        return rec.state == "left" or rec.incarnation <= self.left_incarnation


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
        profile: NodeProfile,
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
        """Members (or removals) not added because the table was full (a bound on what peers
        can make us hold; a real cluster that large needs a larger `max_members`)."""
        self._suspect_after = suspect_after_s
        self._dead_after = dead_after_s
        me = MemberRecord(node_id, address, incarnation, 0, "alive", profile, {})
        self._members: dict[str, _Member] = {node_id: _Member(me, "alive", "self", now)}
        self._hints: dict[str, MemberSource] = {}
        self._removed: dict[str, bytes] = {}
        """Node id -> the operator's signature of its removal (for good)."""

    # -- this node's own record -----------------------------------------------------------------

    @property
    def me(self) -> MemberRecord:
        """This node's current record."""
        return self._members[self.node_id].record

    def _set_me(self, record: MemberRecord) -> None:
        self._members[self.node_id].record = record

    def beat(self, now: float, profile: NodeProfile | None = None) -> None:
        """Advance our heartbeat (once per gossip round), optionally with a fresh profile."""
        me = self.me
        if me.state == "left":
            return
        self._set_me(
            MemberRecord(
                me.node_id, me.address, me.incarnation, me.heartbeat + 1, "alive",
                profile if profile is not None else me.profile, me.links,
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

    def left_by_message(self, node_id: str, incarnation: int, now: float) -> Transition | None:
        """`node_id` said over its own authenticated link that incarnation `incarnation` leaves:
        left here at once (its signed left record follows by gossip). None if unknown or not
        its current incarnation."""
        member = self._members.get(node_id)
        if node_id == self.node_id or member is None or incarnation < member.record.incarnation:
            return None
        member.left_incarnation = max(member.left_incarnation, incarnation)
        return self._set_state(node_id, member, "left", now)

    def remove(self, node_id: str, now: float, signature: bytes = b"") -> Transition | None:
        """An operator removed `node_id` for good (`signature`: the operator's, already
        checked by the caller). Remembered even for a stranger, so its records are never merged
        later; returns its transition if it was a member and not left yet."""
        if node_id not in self._removed:
            if len(self._removed) >= self._max_members:
                self.refused += 1
                return None
            self._removed[node_id] = signature
        if node_id == self.node_id:
            if self.me.state == "left":
                return None
            self.leave(now)
            return Transition(node_id, "alive", "left")
        member = self._members.get(node_id)
        if member is None:
            return None
        return self._set_state(node_id, member, "left", now)

    def removed(self) -> dict[str, bytes]:
        """Removed node ids and the operator's signature of each removal."""
        return dict(self._removed)

    def is_removed(self, node_id: str) -> bool:
        return node_id in self._removed

    def _set_state(self, node_id: str, member: _Member, state: MemberState,
                   now: float) -> Transition | None:
        old = member.state
        if old == state:
            return None
        member.state = state
        member.last_update = now
        return Transition(node_id, old, state)

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
        if len(self._hints) >= self._max_members and node_id not in self._hints:
            return
        old = self._hints.get(node_id)
        if old is None or _SOURCE_RANK[source] > _SOURCE_RANK[old]:
            self._hints[node_id] = source

    # -- gossip ---------------------------------------------------------------------------------

    def header_is_news(self, node_id: str, incarnation: int, heartbeat: int, left: bool) -> bool:
        """Whether `merge` would take a header with these fields (so it is worth verifying):
        an unknown member, a newer version, or a member's own left claim we lack. Records of
        removed members never are."""
        if node_id in self._removed:
            return False
        if node_id == self.node_id:
            me = self.me
            return left and incarnation == me.incarnation and me.state != "left"
        member = self._members.get(node_id)
        if member is None:
            return len(self._members) < self._max_members
        cur = member.record
        if incarnation != cur.incarnation:
            return incarnation > cur.incarnation
        return (heartbeat > cur.heartbeat and cur.state != "left") or (
            left and cur.state != "left")

    def body_is_news(self, node_id: str, incarnation: int, body_version: int) -> bool:
        """Whether `merge` would take a body of this version (so it is worth verifying)."""
        if node_id == self.node_id or node_id in self._removed:
            return False
        member = self._members.get(node_id)
        if member is None:
            return True
        cur = member.record
        return (incarnation, body_version) > (cur.incarnation, cur.body_version)

    def merge(self, records: Iterable[MemberRecord], now: float,
              removals: Mapping[str, bytes] | None = None) -> MergeResult:
        """Merge a peer's records (each checked by the caller: signed by its member) and its
        removals (checked: signed by the operator) into our view; see the module docstring."""
        transitions: list[Transition] = []
        updated = False
        behind = False
        self_removed = False
        seen: set[str] = set()
        for nid, signature in (removals or {}).items():
            t = self.remove(nid, now, signature)
            if nid == self.node_id and t is not None:
                self_removed = True
            if t is not None:
                transitions.append(t)
                updated = True
        if any(nid not in (removals or {}) for nid in self._removed):
            behind = True
        for rec in records:
            if rec.node_id in seen:
                continue  # one entry per member and message: the first
            seen.add(rec.node_id)
            if rec.node_id in self._removed:
                continue
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
            if member is None:
                if len(self._members) >= self._max_members:
                    self.refused += 1
                    continue
                state: MemberState
                if rec.state == "left":
                    state, last = "left", now
                elif rec.state == "dead":
                    state, last = "dead", now - self._dead_after
                elif rec.state == "suspect":
                    state, last = "suspect", now - self._suspect_after
                else:
                    state, last = "alive", now
                if rec.profile is ELIDED:
                    rec = dataclasses.replace(rec, profile=NodeProfile(), links={}, body_version=-1,
                                              body_signature=b"")
                source = self._hints.pop(rec.node_id, "gossip")
                self._members[rec.node_id] = _Member(_signed_claim(rec), state, source, last)
                transitions.append(Transition(rec.node_id, None, state))
                updated = True
                continue
            cur = member.record
            new = cur
            heard = False
            if self.header_is_news(rec.node_id, rec.incarnation, rec.heartbeat,
                                   rec.state == "left"):
                # Newer header (a restart if the incarnation grew): alive again unless left.
                # The header is kept exactly as signed, so it can be relayed verbatim.
                new = dataclasses.replace(
                    cur, address=rec.address, incarnation=rec.incarnation,
                    heartbeat=rec.heartbeat, state="left" if rec.state == "left" else "alive",
                    term=rec.term, signature=rec.signature)
                if rec.incarnation != cur.incarnation:
                    new = dataclasses.replace(new, body_version=-1, body_signature=b"")
                heard = True
            elif rec.incarnation < cur.incarnation or (
                cur.state == "left" and rec.state != "left"
                and rec.incarnation == cur.incarnation
            ):
                behind = True
            if rec.profile is not ELIDED and (rec.incarnation, rec.body_version) > (
                    new.incarnation, new.body_version):
                new = dataclasses.replace(new, profile=rec.profile, links=rec.links,
                                          body_version=rec.body_version,
                                          body_signature=rec.body_signature)
            if new is not cur:
                member.record = new
                updated = True
            if heard:  # a newer body alone is no sign of life: it may be relayed from long ago
                member.last_update = now
                t = self._set_state(rec.node_id, member,
                                    "left" if member.left() else "alive", now)
                if t is not None:
                    transitions.append(t)
        if any(nid not in seen for nid in self._members if nid not in self._removed):
            behind = True
        return MergeResult(tuple(transitions), updated, behind, self_removed)

    def records(self) -> list[MemberRecord]:
        """Our view as gossip records (removed members left out: their removal travels instead).
        A record keeps its member's signed claim (alive or left); for a member that is alive
        in its own claim, our local judgement (suspect, dead) goes in its place, and a member
        that left only by a Leave message shows as dead."""
        out = []
        for nid, member in self._members.items():
            if nid in self._removed:
                continue
            rec = member.record
            if rec.state != "left" and member.state != "alive":
                rec = dataclasses.replace(
                    rec, state="dead" if member.state == "left" else member.state)
            out.append(rec)
        return out

    def restore(self, records: Iterable[MemberRecord], removals: Mapping[str, bytes],
                now: float) -> list[str]:
        """Members known before a restart (each checked by the caller), as dead until heard
        from: they count as voters, so this node cannot form a majority on its own. Returns
        the ids restored."""
        for nid, sig in removals.items():
            self.remove(nid, now, sig)
        out = []
        for rec in records:
            if (rec.node_id == self.node_id or rec.node_id in self._members
                    or rec.node_id in self._removed or len(self._members) >= self._max_members):
                continue
            claim = _signed_claim(rec)
            state: MemberState = "left" if claim.state == "left" else "dead"
            self._members[rec.node_id] = _Member(claim, state, "gossip", now - self._dead_after)
            out.append(rec.node_id)
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

    def reported_terms(self) -> dict[str, int]:
        """Member id -> the highest term it reported in its own signed record."""
        return {n: m.record.term for n, m in self._members.items() if n != self.node_id}

    def links(self) -> dict[tuple[str, str], Link]:
        """The cluster's measured link matrix: (measurer, peer) -> its `Link`."""
        out: dict[tuple[str, str], Link] = {}
        for nid, member in self._members.items():
            for peer, link in member.record.links.items():
                out[(nid, peer)] = link
        return out


def _signed_claim(rec: MemberRecord) -> MemberRecord:
    """`rec` with its state as its member claims it (alive or left), not a relay's judgement."""
    if rec.state in ("alive", "left"):
        return rec
    return dataclasses.replace(rec, state="alive")
