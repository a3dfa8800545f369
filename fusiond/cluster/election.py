"""Scheduler election: a deterministic rank picks the candidate, a majority of voters elects it.

Sans-IO: every method takes the current (monotonic) time and returns the messages to send as
``(peer, message)`` pairs; the service does the sending. Raft's election without a log:

- Terms only grow. Any election message carrying a term below ours is refused with our term
  (the sender then adopts it); a higher term is adopted (a leader or candidate steps down).
- Rank (`rank_order`, a pure function of gossiped records) orders the live voters. After the
  leader has been silent for ``election_timeout_s``, the node at position k waits
  ``k * stagger_s`` (+ a little jitter) before campaigning, so normally only the best-ranked
  live node campaigns and elections do not split.
- A campaign first runs a *pre-vote* (no state changes anywhere) and only then increments the
  term and asks for real votes. Voters that still hear a live leader refuse both, so a node in
  a minority partition, or one rejoining after a partition, never inflates terms and never
  disrupts a working leader. A node also only campaigns while it sees a majority of voters
  alive.
- A leader needs votes from a majority of the voter set (every member not left or removed,
  dead ones included). It then sends ``Leader`` heartbeats; each ack renews a lease. Without
  acks from a majority within ``lease_s`` (< ``election_timeout_s``, so an old leader lets go
  before the others can elect a new one) it steps down: a minority never keeps a working
  scheduler.
- Two leaders of one term (only possible while views of the voter set differ, e.g. two groups
  that formed apart and then met) both step down when one hears the other, and nobody follows a
  leader of that term again; the next term elects one.

Trust (docs/security.md, threat model). Election messages travel directly over the sender's
authenticated link (`peer` is the node id its certificate proves), so every claim in them must
be the sender's own: ``PreVote.candidate``, ``VoteRequest.candidate``, ``Vote.voter``,
``Leader.leader`` and ``LeaderAck.node_id`` must equal `peer`, and a vote counts only from a
voter. Beyond that, with an `Endorser` (signed mode):

- a granted vote and an accepted leader heartbeat carry the voter's signed *support* of the
  leader for the term; a leader's heartbeat carries a majority of them (its *proof*) until the
  follower has accepted it, and nobody follows (or adopts the term of) an unproven leader;
- a term is adopted only by the rules: from a proven leader, when granting a vote, or from a
  refusal answering our own campaign; and a term claimed without proof (a vote request, a
  pre-vote, a refusal) is bounded by `TERM_LEAD_MAX` above the *quorum term*, the highest term
  a majority of voters reported in their own signed records (a refusal beyond it moves us to
  the bound, no further: this is how a group that fell behind catches up, a few terms per
  campaign). One member's word never deposes a leader: a leader steps down on a proven leader
  of a higher term or on losing its lease, not on an ack naming a higher term;
- terms stay below `MAX_TERM`: an absurd one is refused and never persisted.

Every change of the leader or the term records why (`leadership_change`): an election won
with k of n votes, a heartbeat of a new leader, a vote request or a refusal naming a higher
term, a lease that lapsed (quorum lost), heartbeats that stopped, a conflicting leader, a
member that left.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from fusiond.cluster.membership import Address, Link, MemberRecord
from protocol.messages import (
    Endorsement,
    Leader,
    LeaderAck,
    Message,
    NodeProfile,
    PreVote,
    Vote,
    VoteRequest,
)

Role = Literal["follower", "precandidate", "candidate", "leader"]
CONFLICT = "conflicting leader"
"""LeaderAck reason: the receiver leads the same term too; both step down."""
UNPROVEN = "unproven leader"
"""LeaderAck reason: the heartbeat's proof lacks a majority's valid signed support."""
FORGED_PROOF = "forged proof"
"""LeaderAck reason: endorsements in the proof do not verify (a forgery, or a bug)."""
PROOF_NEEDED = "proof needed"
"""LeaderAck reason: the heartbeat carried no proof and we have not checked one yet."""
Out = tuple[str, Message]

MAX_TERM = (1 << 53) - 1
"""No term beyond this is ever adopted, campaigned for or persisted (the overflow attack)."""
TERM_LEAD_MAX = 8
"""How far above the quorum term an unproven term may be (an honest candidate is at most a
term or two ahead of what the majority reported; the margin covers lost messages)."""


class Endorser(Protocol):
    """Signs our support of a leader and checks others' (fusiond.cluster.trust.Trust)."""

    def sign_support(self, term: int, leader: str) -> bytes: ...

    def verify_support(self, voter: str, term: int, leader: str, signature: bytes) -> bool: ...


# -- rank ---------------------------------------------------------------------------------------


def _bucket(value: float) -> int:
    """log2 bucket: values within a factor of 2 rank alike, so measurement noise is ignored.
    Not a finite positive number: -1 (an infinite bandwidth once crashed every node's rank)."""
    return math.floor(math.log2(value)) if value > 0 and math.isfinite(value) else -1


def _finite(value: float) -> float:
    return float(value) if math.isfinite(value) else 0.0


def capability(profile: NodeProfile) -> tuple[float, float]:
    """(FLOP/s, device memory bytes) from a profile: `gflops` * 1e9, and
    `device_memory_bytes` or else `memory_bytes`; 0 where not measured or not finite."""
    flops_per_s = _finite(profile.gflops) * 1e9
    memory_bytes = float(profile.device_memory_bytes or profile.memory_bytes)
    return flops_per_s, memory_bytes


def connectivity(node_id: str, links: Mapping[tuple[str, str], Link],
                 among: Collection[str]) -> float:
    """Median measured bandwidth (bit/s) between `node_id` and the others in `among`.

    A link counts if either end measured it (the better of the two directions); 0 if none.
    """
    values = []
    for peer in among:
        if peer == node_id:
            continue
        measured = [links[k][0] for k in ((node_id, peer), (peer, node_id)) if k in links]
        if measured:
            values.append(max(measured))
    if not values:
        return 0.0
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def rank_key(record: MemberRecord, links: Mapping[tuple[str, str], Link],
             among: Collection[str]) -> tuple[int, int, int, int, str]:
    """Sort key, best first: well connected, capable (FLOP/s, memory), stable (older start),
    then node id. Bandwidth, FLOP/s and memory compare by log2 bucket."""
    flops, memory = capability(record.profile)
    return (
        -_bucket(connectivity(record.node_id, links, among)),
        -_bucket(flops),
        -_bucket(memory),
        record.incarnation,
        record.node_id,
    )


def rank_order(records: Iterable[MemberRecord],
               links: Mapping[tuple[str, str], Link]) -> list[str]:
    """Node ids of `records`, best scheduler candidate first (deterministic)."""
    recs = list(records)
    among = {r.node_id for r in recs}
    return [r.node_id for r in sorted(recs, key=lambda r: rank_key(r, links, among))]


# -- election state machine --------------------------------------------------------------------


@dataclass(frozen=True)
class ElectionTiming:
    """Timeouts of the election (seconds)."""

    election_timeout_s: float = 1.0
    """A follower that has not heard its leader for this long considers it lost."""
    heartbeat_s: float = 0.25
    """How often the leader sends Leader heartbeats."""
    lease_s: float = 0.8
    """The leader steps down without acks from a majority for this long (< election timeout)."""
    stagger_s: float = 0.3
    """Extra wait per rank position before campaigning."""
    jitter_s: float = 0.1
    """Random extra wait (uniform in [0, jitter_s]) so equal ranks do not collide forever."""
    grace_s: float = 1.5
    """After start, neither campaign nor vote for this long: learn the cluster first, and never
    vote twice in a term we may have voted in before a restart."""


@dataclass(frozen=True)
class LeadershipChange:
    """The leader or the term changed (`Election.leadership_change`), and why."""

    leader: str | None
    term: int
    was_leader: str | None
    was_term: int
    reason: str


def majority(voters: Collection[str]) -> int:
    """Votes needed out of `voters`."""
    return len(voters) // 2 + 1


class Election:
    """One node's election state (see the module docstring)."""

    def __init__(self, node_id: str, *, timing: ElectionTiming, now: float,
                 address: Address | None = None, rng: random.Random | None = None,
                 endorser: Endorser | None = None) -> None:
        """`endorser`: signs and checks support (signed mode); None: plaintext dev mode, where
        leadership claims cannot be checked and are taken on the sender's word."""
        self.node_id = node_id
        self.timing = timing
        self._address = address
        self._rng = rng or random.Random()
        self._endorser = endorser
        self._started = now
        self.term = 0
        self.voted_for: str | None = None
        self.role: Role = "follower"
        self._leader: str | None = None
        self._leader_seen = -math.inf
        self._lost_leader: str | None = None
        # Campaign scheduling: earliest time, plus this round's jitter.
        self._no_leader_since = now + timing.grace_s
        self._jitter = self._rng.uniform(0.0, timing.jitter_s)
        self._campaign_started = 0.0
        self._request_id = 0
        self._pending_rid = 0
        self._pending_term = 0
        self._grants: set[str] = set()
        self._supports: dict[str, bytes] = {}
        """Signed support for our campaign (then our proof as leader): voter -> signature."""
        # Leader state.
        self._lead_since = 0.0
        self._next_heartbeat = 0.0
        self._acks: dict[str, float] = {}
        self._voters_seen: set[str] = set()
        self._sent: dict[int, float] = {}
        self._accepted: set[str] = set()
        """Followers that accepted us in this term (they need no proof any more)."""
        self._unproven_by: set[str] = set()
        """Voters that found our proof short of a majority of their voters (joined later)."""
        self._poisoned_term = -1
        """A term in which two leaders met: no leader of it is followed."""
        self._proven: tuple[int, str] | None = None
        """(term, leader) whose proof we checked."""
        self._proof_failed: dict[str, tuple[int, float]] = {}
        """Peer -> (term, when) its leadership proof last failed: not checked again in that
        term for a while (a forged proof costs one signature check per endorsement)."""
        self._reported: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        """Reason -> how many election messages were refused for it (claims not the sender's
        own, unproven leaders, terms too far ahead, bad signatures)."""
        self.enabled = True
        """False once this node has left or been removed: it neither campaigns nor votes."""
        self._why = ""
        """Why the leader or the term last changed (`leadership_change` reports it)."""
        self._last_change: tuple[str | None, int] = (None, 0)
        """(leader, term) as `leadership_change` last reported it."""

    def restore(self, term: int, voted_for: str | None) -> bool:
        """Resume from a term and vote made durable before a restart (call before anything
        else): the node then never grants a second vote in a term it already voted in. An
        absurd term (above MAX_TERM: the overflow attack) is not restored; False then."""
        if not 0 <= term <= MAX_TERM:
            return False
        if term > self.term:
            self.term = term
            self.voted_for = voted_for
            self._why = f"term {term} restored from disk"
        return True

    def set_reported_terms(self, terms: Mapping[str, int]) -> None:
        """The highest term each member reported in its own signed record (its gossip)."""
        self._reported = dict(terms)

    # -- queries -----------------------------------------------------------------------------

    def leader(self, now: float) -> str | None:
        """The leader as far as we know now: us while our lease holds, else one heard lately."""
        if self.role == "leader":
            return self.node_id
        if self._leader is not None and now - self._leader_seen <= self.timing.election_timeout_s:
            return self._leader
        return None

    def leadership_change(self, now: float) -> LeadershipChange | None:
        """The change of (leader, term) since the last call, with why; None if neither changed.
        The shell calls it after each message and tick, and logs what it returns."""
        leader = self.leader(now)
        was_leader, was_term = self._last_change
        if (leader, self.term) == (was_leader, was_term):
            return None
        reason = self._why
        if (leader is None and was_leader is not None and self.role == "follower"
                and self._leader == was_leader):
            # Lost to the clock (the tick that notices it has not run yet), and maybe then
            # a higher term.
            lapsed = self._lapsed(was_leader, now)
            reason = lapsed if self.term == was_term else f"{lapsed}; then {reason}"
        self._last_change = (leader, self.term)
        return LeadershipChange(leader, self.term, was_leader, was_term, reason)

    def accepts_term(self, term: int) -> bool:
        """Whether a message of `term` is current (not stale)."""
        return term >= self.term

    def quorum_term(self, voters: Collection[str]) -> int:
        """The highest term a majority of `voters` has reported (us: our term)."""
        if not voters:
            return self.term
        terms = sorted((self.term if v == self.node_id else self._reported.get(v, 0)
                        for v in voters), reverse=True)
        return terms[majority(voters) - 1]

    def term_ceiling(self, voters: Collection[str]) -> int:
        """The highest unproven term we accept now."""
        return min(MAX_TERM, self.quorum_term(voters) + TERM_LEAD_MAX)

    def campaign_floor(self, voters: Collection[str]) -> int:
        """The highest term any voter reported in its own signed record, within
        `term_ceiling`: a campaign runs above it. A term only one voter saw may have had a
        leader (a node that led alone before the others joined it, its voter set then being
        just itself); campaigning in it would give that term a second scheduler. A member's
        word moves our campaign no further than the ceiling, and deposes nobody."""
        ceiling = self.term_ceiling(voters)
        seen = [t for v, t in self._reported.items() if v in voters and t <= ceiling]
        return max([self.term, *seen])

    # -- internal transitions ----------------------------------------------------------------

    def _refuse(self, reason: str) -> None:
        key = reason.split(":")[0]
        if key.startswith("voted for "):
            key = "voted for"
        elif key.startswith("leader ") and key.endswith(" is alive"):
            key = "leader is alive"
        self.refused[key] = self.refused.get(key, 0) + 1

    def _next_rid(self) -> int:
        self._request_id += 1
        return self._request_id

    def _lapsed(self, leader: str, now: float) -> str:
        return (f"no heartbeat from {leader} for {now - self._leader_seen:.1f} s "
                f"(election timeout {self.timing.election_timeout_s:g} s)")

    def _lose_leader(self, now: float, why: str, backoff: float = 0.0) -> None:
        self._why = why
        self._lost_leader = self._leader
        self._leader = None
        self._no_leader_since = now + backoff
        self._jitter = self._rng.uniform(0.0, self.timing.jitter_s)

    def _step_down(self, now: float, why: str, backoff: float = 0.0) -> None:
        was_leader = self.role == "leader"
        self.role = "follower"
        self._grants = set()
        self._supports = {}
        self._pending_rid = 0
        self._acks = {}
        self._sent = {}
        self._accepted = set()
        if was_leader:
            self._leader = self.node_id
        self._lose_leader(now, why, backoff)

    def _adopt(self, term: int, now: float, why: str) -> None:
        """A higher term exists (`why`: who says so): follow it (not having voted in it)."""
        if term <= self.term or term > MAX_TERM:
            return
        self.term = term
        self.voted_for = None
        self._why = why
        if self.role != "follower":
            self._step_down(now, why)

    def _adopt_hearsay(self, term: int, now: float, voters: Collection[str]) -> None:
        """A refusal of our campaign names a higher term: move to it, but no further than the
        ceiling (one member's word; a real higher term is reached in steps)."""
        ceiling = self.term_ceiling(voters)
        if term > ceiling:
            self._refuse("term too far ahead")
        self._adopt(min(term, ceiling), now, f"a refusal of this node's campaign named term "
                    f"{term}")

    def _live_leader_other_than(self, candidate: str, now: float) -> bool:
        leader = self.leader(now)
        return leader is not None and leader != candidate

    def disable(self, now: float) -> None:
        """This node left or was removed: stop leading, campaigning and voting."""
        self.enabled = False
        if self.role != "follower":
            self._step_down(now, "this node left or was removed")

    def _support(self, term: int, leader: str) -> bytes:
        return self._endorser.sign_support(term, leader) if self._endorser is not None else b""

    # -- periodic ------------------------------------------------------------------------------

    def tick(self, now: float, *, voters: Collection[str],
             ranked_alive: Sequence[str] | Callable[[], Sequence[str]],
             reachable: Collection[str], campaign: bool = True) -> list[Out]:
        """Advance timers. `ranked_alive`: live voters best first (us included if alive), or a
        function computing it only when needed; `reachable`: voters worth sending to;
        `campaign` False: do not start a campaign now (e.g. a node alone that still dials a
        bootstrap address: it is joining a cluster, not founding one)."""
        out: list[Out] = []
        t = self.timing
        if self.role == "leader":
            for v in voters:
                if v not in self._voters_seen:
                    # A voter that just joined gets one lease period to ack before it counts
                    # against us: otherwise every join would depose the leader.
                    self._voters_seen.add(v)
                    self._acks.setdefault(v, now)
            fresh = 1 + sum(1 for v in voters if v != self.node_id
                            and self._acks.get(v, -math.inf) >= now - t.lease_s)
            if fresh < majority(voters) and now - self._lead_since >= t.lease_s:
                self._step_down(now, f"lease lapsed: {fresh} of {len(voters)} voters acked "
                                f"within {t.lease_s:g} s, {majority(voters)} needed "
                                "(quorum lost)", backoff=t.election_timeout_s)
                return out
            if self._outgrown(voters):
                # Members joined, and voters who cannot check our proof are needed for a
                # majority (a node that led alone, then was joined): our lease would run out;
                # re-elect ourselves at once with them instead.
                self._step_down(now, "re-electing itself with the members that joined (its "
                                f"proof no longer reaches a majority of {len(voters)} voters)")
                return self._start_prevote(now, voters, reachable)
            if now >= self._next_heartbeat:
                out.extend(self._heartbeat(now, reachable))
            return out
        if self.role in ("precandidate", "candidate"):
            if now - self._campaign_started > t.election_timeout_s:
                # Failed round (split or not enough answers): back off, then maybe try again.
                self._step_down(now, f"campaign for term {self._pending_term} failed: "
                                f"{len(self._grants)} of {len(voters)} votes",
                                backoff=t.election_timeout_s)
            return out
        # Follower.
        if self._leader is not None and now - self._leader_seen > t.election_timeout_s:
            self._lose_leader(now, self._lapsed(self._leader, now))
        if not self.enabled or self._leader is not None or self.node_id not in voters:
            return out
        if not campaign or now < self._started + t.grace_s or self.term >= MAX_TERM:
            return out
        # The leader that just went silent is probably dead though still "alive" in gossip:
        # rank without it (but never without ourselves, e.g. a leader that lost its lease).
        ranked = ranked_alive() if callable(ranked_alive) else ranked_alive
        candidates = [n for n in ranked if n != self._lost_leader or n == self.node_id]
        if self.node_id not in candidates or len(ranked) < majority(voters):
            return out  # not alive in our own view (left) or no quorum visible: never campaign
        position = candidates.index(self.node_id)
        if now < self._no_leader_since + position * t.stagger_s + self._jitter:
            return out
        return self._start_prevote(now, voters, reachable)

    def _start_prevote(self, now: float, voters: Collection[str],
                       reachable: Collection[str]) -> list[Out]:
        self.role = "precandidate"
        self._campaign_started = now
        self._pending_rid = self._next_rid()
        self._pending_term = self.campaign_floor(voters) + 1
        self._grants = {self.node_id}
        if len(self._grants) >= majority(voters):
            return self._start_election(now, voters, reachable)
        msg = PreVote(request_id=self._pending_rid, term=self._pending_term,
                      candidate=self.node_id)
        return [(p, msg) for p in reachable if p != self.node_id and p in voters]

    def _start_election(self, now: float, voters: Collection[str],
                        reachable: Collection[str]) -> list[Out]:
        self.role = "candidate"
        self.term = max(self.campaign_floor(voters), self._pending_term - 1) + 1
        self.voted_for = self.node_id
        self._why = f"campaigning for term {self.term}"
        self._campaign_started = now
        self._pending_rid = self._next_rid()
        self._pending_term = self.term
        self._grants = {self.node_id}
        self._supports = {self.node_id: self._support(self.term, self.node_id)}
        if len(self._grants) >= majority(voters):
            return self._become_leader(now, voters, reachable)
        msg = VoteRequest(request_id=self._pending_rid, term=self.term, candidate=self.node_id)
        return [(p, msg) for p in reachable if p != self.node_id and p in voters]

    def _become_leader(self, now: float, voters: Collection[str],
                       reachable: Collection[str]) -> list[Out]:
        self.role = "leader"
        self._leader = self.node_id
        self._why = (f"won the election of term {self.term} with {len(self._grants)} of "
                     f"{len(voters)} votes")
        self._lost_leader = None
        self._lead_since = now
        self._acks = {v: now for v in self._grants}
        self._voters_seen = set(voters)
        self._accepted = set()
        self._unproven_by = set()
        self._proven = (self.term, self.node_id)
        return self._heartbeat(now, reachable)

    def _outgrown(self, voters: Collection[str]) -> bool:
        """Whether our proof can no longer reach a majority of `voters`: the supporters plus
        the voters that may still add their support are fewer than a majority."""
        if self._endorser is None:
            return False
        could = sum(1 for v in voters if v in self._supports or v not in self._unproven_by)
        return could < majority(voters)

    def _heartbeat(self, now: float, reachable: Collection[str]) -> list[Out]:
        self._next_heartbeat = now + self.timing.heartbeat_s
        rid = self._next_rid()
        self._sent[rid] = now
        horizon = now - 2 * self.timing.lease_s
        for old in [r for r, sent in self._sent.items() if sent < horizon]:
            del self._sent[old]
        msg = Leader(request_id=rid, term=self.term, leader=self.node_id, address=self._address)
        if self._endorser is None:
            return [(p, msg) for p in reachable if p != self.node_id]
        # Followers that have not accepted us in this term get the proof: a majority's signed
        # support (votes, then acks), so a member that joined later can check it too.
        proven = dataclasses.replace(msg, proof=tuple(
            Endorsement(voter=v, signature=sig) for v, sig in sorted(self._supports.items())))
        return [(p, msg if p in self._accepted else proven) for p in reachable
                if p != self.node_id]

    # -- messages ------------------------------------------------------------------------------

    def _vote_refusal(self, peer: str, rid: int, reason: str) -> list[Out]:
        self._refuse(reason)
        return [(peer, Vote(request_id=rid, term=self.term, voter=self.node_id, granted=False,
                            reason=reason))]

    def _may_vote(self, candidate: str, now: float, voters: Collection[str]) -> str:
        """Why we must not vote for `candidate` now ('' if we may)."""
        if not self.enabled or self.node_id not in voters:
            return "not a voter"
        if now < self._started + self.timing.grace_s:
            return "just started"
        if candidate not in voters:
            return "candidate is not a voter"
        if self._live_leader_other_than(candidate, now):
            return f"leader {self.leader(now)} is alive"
        return ""

    def on_prevote(self, peer: str, msg: PreVote, now: float,
                   voters: Collection[str]) -> list[Out]:
        """Would we vote for the candidate in `msg.term`? Changes no state."""
        if msg.candidate != peer:
            return self._vote_refusal(peer, msg.request_id, "a candidate asks for itself")
        if msg.term <= self.term:
            return self._vote_refusal(peer, msg.request_id, "stale term")
        if msg.term > self.term_ceiling(voters):
            return self._vote_refusal(peer, msg.request_id, "term too far ahead")
        reason = self._may_vote(msg.candidate, now, voters)
        if reason:
            return self._vote_refusal(peer, msg.request_id, reason)
        return [(peer, Vote(request_id=msg.request_id, term=msg.term, voter=self.node_id,
                            granted=True))]

    def on_vote_request(self, peer: str, msg: VoteRequest, now: float,
                        voters: Collection[str]) -> list[Out]:
        """Grant at most one vote per term, to a voter, while no other live leader is heard."""
        if msg.candidate != peer:
            return self._vote_refusal(peer, msg.request_id, "a candidate asks for itself")
        if msg.term < self.term:
            return self._vote_refusal(peer, msg.request_id, "stale term")
        reason = self._may_vote(msg.candidate, now, voters)
        if reason:
            return self._vote_refusal(peer, msg.request_id, reason)
        if msg.term > self.term and msg.term > self.term_ceiling(voters):
            return self._vote_refusal(peer, msg.request_id, "term too far ahead")
        self._adopt(msg.term, now, f"{msg.candidate} asked for votes in term {msg.term}")
        if self.voted_for not in (None, msg.candidate):
            return self._vote_refusal(peer, msg.request_id, f"voted for {self.voted_for}")
        self.voted_for = msg.candidate
        # Having voted, give the candidate time to win before campaigning ourselves.
        self._no_leader_since = now + self.timing.election_timeout_s
        return [(peer, Vote(request_id=msg.request_id, term=msg.term, voter=self.node_id,
                            granted=True, signature=self._support(msg.term, msg.candidate)))]

    def on_vote(self, peer: str, msg: Vote, now: float, voters: Collection[str],
                reachable: Collection[str]) -> list[Out]:
        """Count a (pre-)vote for our campaign; a refusal of it may move our term (bounded)."""
        if msg.voter != peer or peer not in voters:
            self._refuse("vote not from a voter itself")
            return []
        if msg.request_id != self._pending_rid or self.role not in ("precandidate",
                                                                      "candidate"):
            # Not an answer to the campaign we run now: a late grant echoes a term nobody
            # holds, and a stray refusal is one member's word (it must not move our term).
            return []
        if not msg.granted:
            if msg.term > self.term:
                self._adopt_hearsay(msg.term, now, voters)
            return []
        if msg.term != self._pending_term:
            return []
        if self.role == "candidate" and self._endorser is not None:
            if not self._endorser.verify_support(peer, msg.term, self.node_id, msg.signature):
                self._refuse("bad vote signature")
                return []
            self._supports[peer] = msg.signature
        self._grants.add(peer)
        if len(self._grants) < majority(voters):
            return []
        if self.role == "precandidate":
            return self._start_election(now, voters, reachable)
        return self._become_leader(now, voters, reachable)

    def _proof_holds(self, peer: str, msg: Leader, now: float, voters: Collection[str]) -> str:
        """Why `msg`'s leadership claim is not proven ('' if it is)."""
        if self._endorser is None or self._proven == (msg.term, msg.leader):
            return ""
        if not msg.proof:
            # A leader that does not know we need it yet (we restarted, or it just won): the
            # refusal makes it send the proof with its next heartbeat.
            return PROOF_NEEDED
        failed = self._proof_failed.get(peer)
        if (failed is not None and failed[0] == msg.term
                and now - failed[1] < self.timing.election_timeout_s):
            return f"{UNPROVEN}: an earlier proof failed"
        need = majority(voters)
        valid: set[str] = set()
        forged = 0
        for e in msg.proof[:len(voters)]:
            if e.voter not in voters or e.voter in valid:
                continue
            if not self._endorser.verify_support(e.voter, msg.term, msg.leader, e.signature):
                forged += 1
                continue
            valid.add(e.voter)
            if len(valid) >= need:
                self._proven = (msg.term, msg.leader)
                return ""
        self._proof_failed[peer] = (msg.term, now)
        if len(self._proof_failed) > 4 * len(voters) + 16:
            self._proof_failed = {p: f for p, f in self._proof_failed.items()
                                  if now - f[1] < self.timing.election_timeout_s}
        if forged:
            return f"{FORGED_PROOF}: {forged} endorsements do not verify"
        # All valid, too few: a member that joined after the election (routine).
        return f"{UNPROVEN}: {len(valid)} of {need} supports"

    def on_leader(self, peer: str, msg: Leader, now: float,
                  voters: Collection[str]) -> list[Out]:
        """A leader's heartbeat: follow it if proven and its term is not stale; always answer."""

        def ack(accepted: bool, reason: str = "") -> list[Out]:
            if not accepted:
                self._refuse(reason)
            return [(peer, LeaderAck(request_id=msg.request_id, term=self.term,
                                     node_id=self.node_id, accepted=accepted, reason=reason,
                                     signature=self._support(msg.term, msg.leader)
                                     if accepted else b""))]

        if msg.leader != peer:
            return ack(False, "leader must announce itself")
        if msg.term < self.term:
            return ack(False, "stale term")
        if msg.term > MAX_TERM:
            return ack(False, "absurd term")
        why = self._proof_holds(peer, msg, now, voters)
        if why:
            return ack(False, why)
        if (self._endorser is None and msg.term > self.term
                and msg.term > self.term_ceiling(voters)):
            return ack(False, "term too far ahead")  # plaintext mode: nothing proves it
        heard = f"heartbeat from {msg.leader}, leader of term {msg.term}"
        self._adopt(msg.term, now, heard)
        if self.role == "leader":
            # Same term, two leaders: views of the voter set differed (groups that formed
            # apart). Step down, tell the other (it steps down too), and follow neither: the
            # next election gives the merged cluster a leader with a term of its own.
            self._step_down(now, f"{msg.leader} leads term {msg.term} too (two leaders of "
                            "one term: neither is followed)",
                            backoff=self.timing.election_timeout_s)
            self._poisoned_term = msg.term
            return ack(False, CONFLICT)
        if msg.term == self._poisoned_term:
            return ack(False, CONFLICT)
        if self.role != "follower":
            self._step_down(now, heard)
        self._why = heard  # what changes here (if anything) is this heartbeat's doing
        self._leader = msg.leader
        self._leader_seen = now
        self._lost_leader = None
        return ack(True)

    def on_leader_ack(self, peer: str, msg: LeaderAck, now: float) -> list[Out]:
        """Renew our lease from an ack (and add its signed support to our proof). An ack naming
        a higher term does not depose us: that is one member's word, and a real new leader
        means a majority stopped acking, so the lease runs out."""
        if msg.node_id != peer:
            self._refuse("ack not from the follower itself")
            return []
        if self.role != "leader":
            return []
        if not msg.accepted and msg.request_id in self._sent and msg.term <= self.term:
            # A refusal of one of our heartbeats (it carries the follower's own term, which is
            # lower while it has not accepted us).
            self._accepted.discard(peer)
            if msg.reason.startswith(UNPROVEN):
                self._unproven_by.add(peer)
        if msg.term != self.term:
            return []
        if not msg.accepted:
            if msg.reason == CONFLICT and self._endorser is None:
                # Plaintext mode: the other leader's word. Signed mode: we step down when its
                # own proven heartbeat reaches us (on_leader), not on a claim we cannot check.
                self._step_down(now, f"{peer} says it leads term {msg.term} too (two leaders "
                                "of one term: neither is followed)",
                                backoff=self.timing.election_timeout_s)
                self._poisoned_term = msg.term
            return []
        if self._endorser is not None and peer not in self._supports:
            if self._endorser.verify_support(peer, msg.term, self.node_id, msg.signature):
                self._supports[peer] = msg.signature
            else:
                self._refuse("bad ack signature")
                return []
        self._accepted.add(peer)
        self._unproven_by.discard(peer)
        sent = self._sent.get(msg.request_id)
        if sent is not None and sent > self._acks.get(peer, -math.inf):
            self._acks[peer] = sent
        return []

    def forget(self, node_id: str, now: float) -> None:
        """`node_id` left or was removed: if it was our leader, it is lost now (no need to wait
        out the election timeout)."""
        if self.role != "leader" and self._leader == node_id:
            self._lose_leader(now, f"{node_id} left or was removed")
