"""A member's authority is bounded to itself: the attacks of the trust-boundaries issue, each
made by a real member ("r", which joined with a valid credential) over its own authenticated
link, on Cluster instances in one process (tests/cluster/fakes.py). Each failed on the code
before signed membership (docs/security.md, threat model)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fusiond.cluster import Cluster
from fusiond.cluster.election import Election, ElectionTiming
from fusiond.cluster.membership import Link
from protocol.messages import (
    Endorsement,
    Gossip,
    Leader,
    Leave,
    MemberState,
    Message,
    PreVote,
    Removal,
    Vote,
    VoteRequest,
)
from tests.cluster.fakes import Swarm, agreed_leader, until

HONEST = ["a", "b", "c"]
T = ElectionTiming(election_timeout_s=1.0, heartbeat_s=0.25, lease_s=0.8, stagger_s=0.3,
                   jitter_s=0.0, grace_s=0.5)
VOTERS = frozenset({"a", "b", "c"})
VOTERS3 = frozenset({"v", "x", "y"})
STRONG = {"gflops": 100.0, "memory_bytes": 1 << 30}
WEAK = {"gflops": 1.0, "memory_bytes": 1 << 20}
"""The rogue ranks last, so the leader is an honest node (a member may get itself elected:
the threat model says so; these attacks are about what it can do without)."""


@pytest.fixture
async def swarm(tmp_path: Path) -> AsyncIterator[Swarm]:
    s = Swarm()
    try:
        for n in HONEST:
            await s.add(n, profile=STRONG, state_path=str(tmp_path / f"{n}.json"),
                        bootstrap=[s.addresses["a"]] if n != "a" else [])
        await s.add("r", profile=WEAK, bootstrap=[s.addresses["a"]], operator=False)
        await until(lambda: agreed_leader(s.views()) is not None
                    and all(v.alive_voters == 4 for v in s.views().values()), 8,
                    "4 members and one leader")
        yield s
    finally:
        await s.close()


async def send(swarm: Swarm, msg: Message, to: list[str] | None = None) -> None:
    """The rogue sends `msg` over its own link (the receiver sees it come from "r")."""
    for peer in to or HONEST:
        await swarm.nets["r"].send(peer, msg)


def rogue_gossip(swarm: Swarm) -> Gossip:
    """What the rogue would gossip now: its own entry is genuine and signed."""
    return swarm.nodes["r"]._gossip_message()


def leader_and_term(swarm: Swarm) -> tuple[str, int]:
    views = swarm.views(HONEST)
    leader = agreed_leader(views)
    assert leader is not None, {n: (v.leader, v.term) for n, v in views.items()}
    return leader, views[leader].term


async def settle(seconds: float = 0.6) -> None:
    await asyncio.sleep(seconds)


async def still_one_leader(swarm: Swarm, leader: str, term: int) -> None:
    """The honest nodes keep `leader` and `term` (checked over a few gossip rounds)."""
    for _ in range(5):
        await settle(0.15)
        for n in HONEST:
            v = swarm.nodes[n].view()
            assert (v.leader, v.term) == (leader, term), (n, v.leader, v.term)
            assert v.voters == 4 and v.has_quorum, (n, v.voters, v.has_quorum)


async def re_election_works(swarm: Swarm, old_leader: str, old_term: int) -> None:
    """Crash the leader: the others elect a new one, in the next term or so."""
    await swarm.crash(old_leader)
    rest = [n for n in HONEST if n != old_leader]
    await until(lambda: agreed_leader(swarm.views(rest)) not in (None, old_leader), 8,
                "a new leader after the old one crashed")
    new_term = swarm.nodes[rest[0]].view().term
    assert old_term < new_term < old_term + 10, (old_term, new_term)


def persisted_terms(tmp_path: Path) -> dict[str, int]:
    out = {}
    for n in HONEST:
        p = tmp_path / f"{n}.json"
        if p.exists():
            out[n] = json.loads(p.read_text())["term"]
    return out


# -- 1: one Gossip with term = 2**64 - 1 ------------------------------------------------------


async def test_a_gossiped_term_of_2_64_minus_1_is_not_adopted(swarm: Swarm,
                                                               tmp_path: Path) -> None:
    leader, term = leader_and_term(swarm)
    await send(swarm, dataclasses.replace(rogue_gossip(swarm), term=2**64 - 1, leader="r"))
    await still_one_leader(swarm, leader, term)
    assert all(swarm.nodes[n].rejected.get("absurd gossip term") == 1 for n in HONEST)
    assert all(t < 2**53 for t in persisted_terms(tmp_path).values())
    # The next term is one above, not an overflow: a scheduler can still be elected.
    await re_election_works(swarm, leader, term)


async def test_a_member_reporting_an_absurd_term_in_its_own_record_moves_nobody(
        swarm: Swarm, tmp_path: Path) -> None:
    # Its own signed record may say what it likes about itself: the quorum term is what a
    # majority reported, so one liar cannot lift the bound.
    leader, term = leader_and_term(swarm)
    rogue = swarm.nodes["r"]
    assert rogue._election is not None
    rogue._election.term = 2**53 - 10
    await send(swarm, rogue_gossip(swarm))
    await send(swarm, VoteRequest(request_id=7, term=2**53 - 9, candidate="r"))
    await still_one_leader(swarm, leader, term)
    assert all(t < term + 10 for t in persisted_terms(tmp_path).values())
    # It can withhold its vote (every member can), so with it and one more member gone 2 of
    # 4 are left: the operator removes it, and the others elect as usual.
    await swarm.nodes[next(n for n in HONEST if n != leader)].remove("r")
    await until(lambda: all(swarm.nodes[n].view().voters == 3 for n in HONEST), 3,
                "the removal everywhere")
    await re_election_works(swarm, leader, term)


# -- 2: twelve invented members -----------------------------------------------------------------


async def test_invented_members_are_never_added_and_never_vote(swarm: Swarm) -> None:
    leader, term = leader_and_term(swarm)
    real = rogue_gossip(swarm)
    own = next(e for e in real.members if e.node_id == "r")
    invented = []
    for i in range(12):
        # Unsigned ones, ones signed by the rogue with its own credential attached, and ones
        # copying a real member's signed header under another id.
        base = dataclasses.replace(own, node_id=f"x{i}", address=("127.0.0.1", 20000 + i),
                                   state=MemberState.ALIVE)
        if i % 3 == 0:
            base = dataclasses.replace(base, signature=b"", credential=b"")
        invented.append(base)
    await send(swarm, dataclasses.replace(real, members=(own, *invented)))
    await still_one_leader(swarm, leader, term)
    for n in HONEST:
        v = swarm.nodes[n].view()
        assert not any(m.node_id.startswith("x") for m in v.members), n
        # (the rogue itself may look suspect: its forgeries got its gossip ignored a while)
        assert (v.voters, v.needed) == (4, 3) and v.has_quorum, (v.voters, v.alive_voters)


# -- 3: a forged "left" for the leader ---------------------------------------------------------


async def test_a_forged_left_record_for_the_leader_does_not_evict_it(swarm: Swarm) -> None:
    leader, term = leader_and_term(swarm)
    real = rogue_gossip(swarm)
    target = next(e for e in real.members if e.node_id == leader)  # its genuine signed header
    forged = dataclasses.replace(target, state=MemberState.LEFT, heartbeat=target.heartbeat + 1)
    others = tuple(e for e in real.members if e.node_id != leader)
    await send(swarm, dataclasses.replace(real, members=(*others, forged)))
    await send(swarm, Leave(node_id=leader, incarnation=target.incarnation))
    await still_one_leader(swarm, leader, term)
    for n in HONEST:
        assert swarm.nodes[n].view().states()[leader] == "alive", n


async def test_only_the_operator_key_removes_a_member(swarm: Swarm) -> None:
    from fusiond.cluster import NotAuthorizedError

    leader, term = leader_and_term(swarm)
    rogue = swarm.nodes["r"]
    with pytest.raises(NotAuthorizedError, match=r"ca\.key"):
        await rogue.remove(leader)
    # A removal signed with a member's own key, or with none, is refused everywhere.
    tr = swarm.trust("r", operator=False)
    from fusiond.cluster.trust import removal_statement

    forged = tr.sign(removal_statement("test", leader))
    await send(swarm, dataclasses.replace(
        rogue_gossip(swarm), removals=(Removal(node_id=leader, signature=forged),
                                       Removal(node_id="b", signature=b""))))
    await still_one_leader(swarm, leader, term)
    assert all(swarm.nodes[n].rejected.get("forged removal", 0) >= 1 for n in HONEST)
    # The operator's own removal holds (a holds the CA key here): gossiped, and the removed
    # member learns it and stops voting.
    await swarm.nodes["a" if leader != "a" else "b"].remove("r")
    await until(lambda: all(swarm.nodes[n].view().states()["r"] == "left"
                            for n in (*HONEST, "r")), 3, "the removal to reach everyone")
    assert all(swarm.nodes[n].view().voters == 3 for n in HONEST)


# -- 4: votes and leadership claims that are not the sender's own ------------------------------


async def test_a_leadership_claim_without_a_majoritys_signed_support_is_not_followed(
        swarm: Swarm) -> None:
    leader, term = leader_and_term(swarm)
    # The rogue claims the next term for itself: no proof at all ...
    for _ in range(4):
        await send(swarm, Leader(request_id=1, term=term + 1, leader="r"))
        await settle(0.05)
    await still_one_leader(swarm, leader, term)
    # ... then a proof of endorsements it signed itself in the others' names.
    tr = swarm.trust("r", operator=False)
    from fusiond.cluster.trust import support_statement

    fake = tuple(Endorsement(voter=v, signature=tr.sign(support_statement("test", term + 1, "r",
                                                                           v)))
                 for v in (*HONEST, "r"))
    for _ in range(4):
        await send(swarm, Leader(request_id=2, term=term + 1, leader="r", proof=fake))
        await settle(0.05)
    await still_one_leader(swarm, leader, term)
    refusals = [swarm.nodes[n].election_refusals for n in HONEST if n != leader]
    assert all(r.get("proof needed", 0) >= 1 and r.get("forged proof", 0) >= 1
               for r in refusals), refusals


async def test_claims_relayed_for_another_node_are_refused(swarm: Swarm) -> None:
    leader, term = leader_and_term(swarm)
    follower = next(n for n in HONEST if n != leader)
    # A leader heartbeat "from" the real leader, and a vote request "for" a follower, both
    # sent by the rogue with a term far ahead.
    await send(swarm, Leader(request_id=1, term=term + 50, leader=leader))
    await send(swarm, VoteRequest(request_id=2, term=term + 50, candidate=follower))
    await still_one_leader(swarm, leader, term)


def test_a_vote_relayed_by_a_third_party_does_not_count() -> None:
    # x is not a voter; it sends a grant "from b". Only b's own vote, over b's own link,
    # counts for b (and a non-voter's counts for nobody).
    a = Election("a", timing=T, now=0.0)
    out = a.tick(0.6, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"])
    pre = out[0][1]
    assert isinstance(pre, PreVote)
    for peer in ("x", "c"):
        a.on_vote(peer, Vote(request_id=pre.request_id, term=1, voter="b", granted=True), 0.6,
                  VOTERS, ["b", "c"])
    assert a.term == 0 and a.role == "precandidate"


def test_a_vote_request_relayed_for_another_candidate_is_refused() -> None:
    v = Election("v", timing=T, now=0.0)
    out = v.on_vote_request("y", VoteRequest(request_id=1, term=40, candidate="x"), 1.0, VOTERS3)
    vote = out[0][1]
    assert isinstance(vote, Vote) and not vote.granted
    assert v.term == 0 and v.voted_for is None
    out = v.on_prevote("y", PreVote(request_id=2, term=1, candidate="x"), 1.0, VOTERS3)
    assert isinstance(out[0][1], Vote) and not out[0][1].granted


# -- 5: absurd numbers ---------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["heartbeat", "incarnation", "term", "port"])
async def test_absurd_integers_in_an_entry_are_refused(swarm: Swarm, field: str) -> None:
    leader, term = leader_and_term(swarm)
    real = rogue_gossip(swarm)
    out = []
    for e in real.members:
        if field == "port":  # its own address, in a newer heartbeat
            if e.node_id == "r":
                e = dataclasses.replace(e, address=(e.address[0], 0),
                                        heartbeat=e.heartbeat + 10**6)
        else:
            e = dataclasses.replace(e, **{field: 2**64 - 1})
        out.append(e)
    await send(swarm, dataclasses.replace(real, members=tuple(out)))
    await still_one_leader(swarm, leader, term)
    for n in HONEST:
        v = swarm.nodes[n].view()
        assert all(m.heartbeat < 2**53 and m.incarnation < 2**53 and 0 < m.address[1] < 65536
                   for m in v.members), n
    await re_election_works(swarm, leader, term)


async def test_an_infinite_link_measurement_does_not_crash_the_rank(swarm: Swarm) -> None:
    # A buggy (or hostile) member measures an infinite bandwidth and signs it in its own
    # record: the others' next election ranked it and crashed every node's timer loop.
    leader, term = leader_and_term(swarm)
    ms = swarm.nodes["r"]._membership
    assert ms is not None
    ms.set_link("a", Link(math.inf, math.nan))
    await settle()  # its own gossip carries it (every few rounds) to everyone
    # The next election ranks the live members: it must not meet an infinite bandwidth.
    await re_election_works(swarm, leader, term)
    for n in HONEST:
        if n in swarm.nodes:
            assert not swarm.nodes[n]._done.done(), n  # type: ignore[union-attr]


async def test_a_flood_of_forgeries_costs_a_bounded_number_of_checks(swarm: Swarm) -> None:
    # 4000 forged entries for real members per message: the first few bad signatures end the
    # message and silence the sender for a while, so its forgeries cannot eat the event loop.
    # (Handed to the receiver directly: encoding them in the fake network is the test's cost.)
    leader, term = leader_and_term(swarm)
    real = rogue_gossip(swarm)
    own = next(e for e in real.members if e.node_id == "r")
    victims = [e for e in real.members if e.node_id != "r"]
    flood = dataclasses.replace(real, members=(own, *(
        dataclasses.replace(victims[i % len(victims)], heartbeat=10**6 + i)
        for i in range(4000))))
    target = swarm.nodes[next(n for n in HONEST if n != leader)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(50):
        await target.handle("r", flood)
    took = loop.time() - t0
    print(f"50 messages of 4000 forged entries: {took * 1e3:.1f} ms, refused {target.rejected}")
    assert target.rejected.get("bad header signature", 0) <= 8, target.rejected
    assert target.rejected.get("quarantined", 0) == 49, target.rejected
    assert took < 0.5, took
    await still_one_leader(swarm, leader, term)


async def test_an_unsigned_swarm_still_works_and_says_it_is_unsigned(
        caplog: pytest.LogCaptureFixture) -> None:
    s = Swarm(signed=False)
    try:
        with caplog.at_level("WARNING", logger="fusiond.cluster.service"):
            nodes: list[Cluster] = [await s.add("u1")]
            nodes.append(await s.add("u2", bootstrap=[s.addresses["u1"]]))
        await until(lambda: agreed_leader(s.views()) is not None
                    and all(v.alive_voters == 2 for v in s.views().values()), 5, "agreement")
        assert not nodes[0].signed
        assert any("UNSIGNED membership" in r.getMessage() for r in caplog.records)
    finally:
        await s.close()
