"""The election rank (a pure function) and the election state machine, driven by hand."""

from __future__ import annotations

import math

from fusiond.cluster.election import (
    CONFLICT,
    TERM_LEAD_MAX,
    Election,
    ElectionTiming,
    Role,
    capability,
    connectivity,
    majority,
    rank_order,
)
from fusiond.cluster.membership import MemberRecord
from protocol.messages import Leader, LeaderAck, NodeProfile, PreVote, Vote, VoteRequest

T = ElectionTiming(election_timeout_s=1.0, heartbeat_s=0.25, lease_s=0.8, stagger_s=0.3,
                   jitter_s=0.0, grace_s=0.5)
VOTERS = frozenset({"a", "b", "c"})


def role(el: Election) -> Role:
    """The role now (read through a call: mypy would keep an earlier assert's narrowing)."""
    return el.role


def rec(node_id: str, incarnation: int = 1, **profile: float) -> MemberRecord:
    return MemberRecord(node_id, ("127.0.0.1", 1), incarnation, 0, "alive",
                        NodeProfile(**profile))  # type: ignore[arg-type]


# -- rank -----------------------------------------------------------------------------------


def test_rank_prefers_well_connected_then_capable_then_stable_then_node_id() -> None:
    links = {("a", "b"): (1e9, 0.001), ("a", "c"): (1e9, 0.001), ("b", "c"): (1e7, 0.05)}
    recs = [rec("b", gflops=100), rec("c", gflops=100), rec("a", gflops=1)]
    # a has the fastest links: first despite being the slowest machine.
    assert rank_order(recs, links)[0] == "a"
    # Without link measurements: capability decides.
    assert rank_order([rec("a", gflops=1), rec("b", gflops=100)], {}) == ["b", "a"]
    # Equal capability: the older incarnation (started earlier, more stable) first.
    assert rank_order([rec("a", 20, gflops=8), rec("b", 10, gflops=8)], {}) == ["b", "a"]
    # All equal: node id.
    assert rank_order([rec("b", 5), rec("a", 5)], {}) == ["a", "b"]


def test_rank_ignores_noise_within_a_factor_of_two() -> None:
    # 10 vs 12 GFLOP/s land in one log2 bucket: stability (incarnation) decides instead.
    assert rank_order([rec("a", 2, gflops=12), rec("b", 1, gflops=10)], {}) == ["b", "a"]
    # 10 vs 40 do not.
    assert rank_order([rec("a", 2, gflops=40), rec("b", 1, gflops=10)], {}) == ["a", "b"]


def test_rank_is_deterministic_whatever_the_input_order() -> None:
    links = {("a", "b"): (5e8, 0.001), ("c", "a"): (2e8, 0.002)}
    recs = [rec("a", 3, gflops=50), rec("b", 2, gflops=50), rec("c", 1, gflops=5)]
    orders = {tuple(rank_order(p, links)) for p in (recs, recs[::-1], [recs[1], recs[2],
                                                                        recs[0]])}
    assert len(orders) == 1


def test_connectivity_uses_the_better_direction_and_the_median() -> None:
    links = {("a", "b"): (1e6, 0.01), ("b", "a"): (3e6, 0.01), ("a", "c"): (5e6, 0.01),
             ("a", "d"): (7e6, 0.01)}
    assert connectivity("a", links, {"a", "b", "c", "d"}) == 5e6
    assert connectivity("a", links, {"a", "b"}) == 3e6
    assert connectivity("x", links, {"x", "a"}) == 0.0


def test_capability_reads_the_daemon_profile_keys() -> None:
    assert capability(NodeProfile(gflops=2.0, device_memory_bytes=10)) == (2e9, 10.0)
    assert capability(NodeProfile(memory_bytes=3)) == (0.0, 3.0)
    assert capability(NodeProfile(gflops=math.inf)) == (0.0, 0.0)


def test_majority() -> None:
    assert [majority(range(n)) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]  # type: ignore[arg-type]


# -- state machine --------------------------------------------------------------------------


def test_best_ranked_campaigns_after_grace_and_wins_with_a_majority() -> None:
    a = Election("a", timing=T, now=0.0)
    assert a.tick(0.1, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"]) == []
    out = a.tick(0.6, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"])
    assert {p for p, _ in out} == {"b", "c"}
    pre = out[0][1]
    assert isinstance(pre, PreVote) and pre.term == 1 and a.term == 0  # pre-vote: no change
    # b would vote: the real election starts at term 1.
    out = a.on_vote("b", Vote(request_id=pre.request_id, term=1, voter="b", granted=True), 0.6,
                    VOTERS, ["b", "c"])
    req = out[0][1]
    assert isinstance(req, VoteRequest) and a.term == 1 and role(a) == "candidate"
    out = a.on_vote("c", Vote(request_id=req.request_id, term=1, voter="c", granted=True), 0.61,
                    VOTERS, ["b", "c"])
    assert role(a) == "leader" and a.leader(0.61) == "a"
    assert all(isinstance(m, Leader) and m.term == 1 for _, m in out)


def test_lower_ranked_node_waits_its_stagger() -> None:
    b = Election("b", timing=T, now=0.0)
    ranked = ["a", "b", "c"]
    # Position 1: campaign no earlier than grace + 1 * stagger.
    assert b.tick(0.6, voters=VOTERS, ranked_alive=ranked, reachable=["a", "c"]) == []
    assert b.tick(0.81, voters=VOTERS, ranked_alive=ranked, reachable=["a", "c"])


def test_no_campaign_without_a_visible_majority() -> None:
    a = Election("a", timing=T, now=0.0)
    # 5 voters, only 2 alive in our view: a minority never even asks.
    voters = frozenset("abcde")
    assert a.tick(5.0, voters=voters, ranked_alive=["a", "b"], reachable=["b"]) == []
    assert role(a) == "follower"


def test_one_vote_per_term_and_stale_terms_refused() -> None:
    v = Election("v", timing=T, now=0.0)
    voters = frozenset({"v", "x", "y"})
    out = v.on_vote_request("x", VoteRequest(request_id=1, term=3, candidate="x"), 1.0, voters)
    assert isinstance(out[0][1], Vote) and out[0][1].granted and v.term == 3
    out = v.on_vote_request("y", VoteRequest(request_id=2, term=3, candidate="y"), 1.0, voters)
    assert not out[0][1].granted and "voted for x" in out[0][1].reason  # type: ignore[attr-defined]
    out = v.on_vote_request("y", VoteRequest(request_id=3, term=2, candidate="y"), 1.0, voters)
    vote = out[0][1]
    assert isinstance(vote, Vote) and not vote.granted and vote.term == 3
    assert vote.reason == "stale term"
    # A stale Leader heartbeat is refused with our term, and changes nothing.
    out = v.on_leader("y", Leader(request_id=4, term=2, leader="y"), 1.0, voters)
    ack = out[0][1]
    assert isinstance(ack, LeaderAck) and not ack.accepted and ack.term == 3
    assert v.leader(1.0) is None and v.term == 3


def test_a_restored_vote_is_not_granted_twice_in_its_term() -> None:
    voters = frozenset({"v", "x", "y"})
    v = Election("v", timing=T, now=0.0)
    v.restore(3, "x")  # voted for x in term 3 before a restart
    assert v.term == 3 and v.voted_for == "x"
    out = v.on_vote_request("y", VoteRequest(request_id=1, term=3, candidate="y"), 1.0, voters)
    vote = out[0][1]
    assert isinstance(vote, Vote) and not vote.granted and vote.reason == "voted for x"
    out = v.on_vote_request("x", VoteRequest(request_id=2, term=3, candidate="x"), 1.0, voters)
    assert isinstance(out[0][1], Vote) and out[0][1].granted  # the same candidate again: yes
    out = v.on_vote_request("y", VoteRequest(request_id=3, term=4, candidate="y"), 1.0, voters)
    assert isinstance(out[0][1], Vote) and out[0][1].granted and v.voted_for == "y"
    # Restoring never lowers a term.
    w = Election("w", timing=T, now=0.0)
    w.restore(5, None)
    w.restore(2, "x")
    assert w.term == 5 and w.voted_for is None


def test_no_vote_during_grace_nor_for_strangers_nor_while_a_leader_lives() -> None:
    v = Election("v", timing=T, now=0.0)
    voters = frozenset({"v", "x", "y"})
    out = v.on_vote_request("x", VoteRequest(request_id=1, term=1, candidate="x"), 0.1, voters)
    assert not out[0][1].granted  # type: ignore[attr-defined]
    out = v.on_vote_request("z", VoteRequest(request_id=2, term=1, candidate="z"), 1.0, voters)
    assert not out[0][1].granted  # type: ignore[attr-defined]
    v.on_leader("x", Leader(request_id=3, term=1, leader="x"), 1.0, voters)
    assert v.leader(1.0) == "x"
    out = v.on_prevote("y", PreVote(request_id=4, term=2, candidate="y"), 1.2, voters)
    assert not out[0][1].granted  # type: ignore[attr-defined]
    out = v.on_vote_request("y", VoteRequest(request_id=5, term=2, candidate="y"), 1.2, voters)
    assert not out[0][1].granted and v.term == 1  # type: ignore[attr-defined]
    # Once the leader has been silent for the election timeout, y may have the vote.
    out = v.on_prevote("y", PreVote(request_id=6, term=2, candidate="y"), 2.1, voters)
    assert out[0][1].granted and v.term == 1  # type: ignore[attr-defined]


def test_leader_without_majority_acks_steps_down_within_its_lease() -> None:
    a = Election("a", timing=T, now=0.0)
    voters = VOTERS
    out = a.tick(0.6, voters=voters, ranked_alive=["a", "b", "c"], reachable=["b", "c"])
    pre = out[0][1]
    out = a.on_vote("b", Vote(request_id=pre.request_id, term=1, voter="b",  # type: ignore[attr-defined]
                              granted=True), 0.6, voters, ["b", "c"])
    req = out[0][1]
    out = a.on_vote("b", Vote(request_id=req.request_id, term=1, voter="b",  # type: ignore[attr-defined]
                              granted=True), 0.6, voters, ["b", "c"])
    assert role(a) == "leader"
    hb = next(m for _, m in out if isinstance(m, Leader))
    a.on_leader_ack("b", LeaderAck(request_id=hb.request_id, term=1, node_id="b",
                                   accepted=True), 0.61)
    a.tick(1.2, voters=voters, ranked_alive=["a"], reachable=["b", "c"])
    assert role(a) == "leader"  # b's ack (sent at 0.6) still within the 0.8 s lease
    a.tick(1.45, voters=voters, ranked_alive=["a"], reachable=["b", "c"])
    assert role(a) == "follower" and a.leader(1.45) is None


def test_a_higher_term_in_an_ack_does_not_depose_the_leader_its_lease_does() -> None:
    # One follower's word (it may be a compromised member) must not depose a leader that a
    # majority still acks; a real new leader means the majority stopped acking: the lease ends.
    a = Election("a", timing=T, now=0.0)
    a.tick(0.6, voters={"a"}, ranked_alive=["a"], reachable=[])
    assert role(a) == "leader" and a.term == 1
    a.on_leader_ack("b", LeaderAck(request_id=1, term=7, node_id="b", accepted=False), 1.0)
    assert role(a) == "leader" and a.term == 1
    a.tick(5.0, voters={"a", "b", "c"}, ranked_alive=["a"], reachable=["b", "c"])
    a.tick(5.9, voters={"a", "b", "c"}, ranked_alive=["a"], reachable=["b", "c"])
    assert role(a) == "follower" and a.leader(5.9) is None


def test_two_leaders_of_one_term_both_step_down_and_follow_neither() -> None:
    a = Election("a", timing=T, now=0.0)
    b = Election("b", timing=T, now=0.0)
    for e in (a, b):
        assert e.tick(0.6, voters={e.node_id}, ranked_alive=[e.node_id], reachable=[]) == []
        assert role(e) == "leader" and e.term == 1
    # They meet: b's heartbeat reaches a.
    out = a.on_leader("b", Leader(request_id=1, term=1, leader="b"), 2.0, VOTERS)
    assert role(a) == "follower" and a.leader(2.0) is None
    ack = out[0][1]
    assert isinstance(ack, LeaderAck) and not ack.accepted and ack.reason == CONFLICT
    b.on_leader_ack("a", ack, 2.0)
    assert role(b) == "follower" and b.leader(2.0) is None
    # A later heartbeat of term 1 (from either) is not followed.
    out = a.on_leader("b", Leader(request_id=2, term=1, leader="b"), 2.1, VOTERS)
    assert a.leader(2.1) is None and not out[0][1].accepted  # type: ignore[attr-defined]
    # Term 2 is.
    a.on_leader("b", Leader(request_id=3, term=2, leader="b"), 2.2, VOTERS)
    assert a.leader(2.2) == "b"


def test_disabled_node_neither_votes_nor_campaigns() -> None:
    a = Election("a", timing=T, now=0.0)
    a.disable(0.0)
    assert a.tick(5.0, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"]) == []
    out = a.on_vote_request("b", VoteRequest(request_id=1, term=1, candidate="b"), 5.0, VOTERS)
    assert not out[0][1].granted  # type: ignore[attr-defined]


def test_a_joining_voter_gets_one_lease_to_ack_before_it_counts_against_the_leader() -> None:
    a = Election("a", timing=T, now=0.0)
    out = a.tick(0.6, voters={"a"}, ranked_alive=["a"], reachable=[])
    assert role(a) == "leader" and out == []
    # b joins: majority of {a, b} is 2, b has not acked yet, but it is new.
    a.tick(5.0, voters={"a", "b"}, ranked_alive=["a", "b"], reachable=["b"])
    assert role(a) == "leader"
    a.tick(5.7, voters={"a", "b"}, ranked_alive=["a", "b"], reachable=["b"])
    assert role(a) == "leader"
    a.tick(5.9, voters={"a", "b"}, ranked_alive=["a", "b"], reachable=["b"])
    assert role(a) == "follower"  # b never acked within the lease


def test_a_late_pre_vote_grant_does_not_inflate_the_term() -> None:
    a = Election("a", timing=T, now=0.0)
    out = a.tick(0.6, voters=frozenset("abcde"), ranked_alive=list("abcde"),
                 reachable=list("bcde"))
    pre = out[0][1]
    assert isinstance(pre, PreVote) and pre.term == 1
    a.tick(2.0, voters=frozenset("abcde"), ranked_alive=list("abcde"), reachable=list("bcde"))
    assert role(a) == "follower"  # the pre-vote round timed out
    a.on_vote("b", Vote(request_id=pre.request_id, term=1, voter="b", granted=True), 2.1,
              frozenset("abcde"), list("bcde"))
    assert a.term == 0
    # A stray refusal after the round is one member's word: it does not move our term.
    a.on_vote("c", Vote(request_id=pre.request_id, term=4, voter="c", granted=False), 2.2,
              frozenset("abcde"), list("bcde"))
    assert a.term == 0


def test_a_refusal_of_a_running_campaign_moves_the_term_up_to_the_ceiling() -> None:
    a = Election("a", timing=T, now=0.0)
    voters = frozenset("abcde")
    out = a.tick(0.6, voters=voters, ranked_alive=list("abcde"), reachable=list("bcde"))
    pre = out[0][1]
    assert isinstance(pre, PreVote)
    # The refusal carries the voter's real term: adopted (it is within the bound).
    a.on_vote("c", Vote(request_id=pre.request_id, term=4, voter="c", granted=False), 0.7,
              voters, list("bcde"))
    assert a.term == 4 and role(a) == "follower"
    # One far ahead (nobody reported anything near it): only up to the quorum term + the
    # bound, so a lagging group catches up a few terms per campaign and a liar gets no further.
    out = a.tick(3.0, voters=voters, ranked_alive=list("abcde"), reachable=list("bcde"))
    pre = out[0][1]
    assert isinstance(pre, PreVote) and pre.term == 5
    a.on_vote("d", Vote(request_id=pre.request_id, term=1 << 60, voter="d", granted=False),
              3.1, voters, list("bcde"))
    # The quorum term is the 3rd highest of (4 (ours), 0, 0, 0, 0): 0.
    assert a.term == TERM_LEAD_MAX and a.refused["term too far ahead"] == 1
    # b and c report 20 in their signed records: the 3rd highest is now ours (8).
    a.set_reported_terms({"b": 20, "c": 20})
    assert a.quorum_term(voters) == 8
    out = a.tick(6.0, voters=voters, ranked_alive=list("abcde"), reachable=list("bcde"))
    pre = out[0][1]
    assert isinstance(pre, PreVote)
    a.on_vote("b", Vote(request_id=pre.request_id, term=20, voter="b", granted=False),
              6.1, voters, list("bcde"))
    assert a.term == 2 * TERM_LEAD_MAX


class NameEndorser:
    """Support 'signatures' that name their signer (the state machine only needs the rule)."""

    def __init__(self, me: str) -> None:
        self.me = me

    def sign_support(self, term: int, leader: str) -> bytes:
        return f"{self.me}|{term}|{leader}".encode()

    def verify_support(self, voter: str, term: int, leader: str, signature: bytes) -> bool:
        return signature == f"{voter}|{term}|{leader}".encode()


def test_a_member_that_joins_later_checks_the_proof_which_acks_complete() -> None:
    a = Election("a", timing=T, now=0.0, endorser=NameEndorser("a"))
    b = Election("b", timing=T, now=0.0, endorser=NameEndorser("b"))
    c = Election("c", timing=T, now=0.0, endorser=NameEndorser("c"))
    out = a.tick(0.6, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"])
    pre = out[0][1]
    vote = b.on_prevote("a", pre, 0.6, VOTERS)[0][1]  # type: ignore[arg-type]
    out = a.on_vote("b", vote, 0.6, VOTERS, ["b", "c"])  # type: ignore[arg-type]
    req = out[0][1]
    vote = b.on_vote_request("a", req, 0.6, VOTERS)[0][1]  # type: ignore[arg-type]
    assert isinstance(vote, Vote) and vote.granted and vote.signature == b"b|1|a"
    out = a.on_vote("b", vote, 0.61, VOTERS, ["b", "c"])
    assert role(a) == "leader"
    beat = dict(out)["c"]
    assert isinstance(beat, Leader) and {e.voter for e in beat.proof} == {"a", "b"}
    d = Election("d", timing=T, now=0.0, endorser=NameEndorser("d"))
    four = frozenset("abcd")
    # d joined: 4 voters need 3 supports; the proof holds 2.
    ack = d.on_leader("a", beat, 1.0, four)[0][1]
    assert isinstance(ack, LeaderAck) and not ack.accepted and "2 of 3" in ack.reason
    # c (a voter all along) accepts with 2 of its 3 voters, and signs its support.
    ack = c.on_leader("a", beat, 1.0, VOTERS)[0][1]
    assert isinstance(ack, LeaderAck) and ack.accepted and ack.signature == b"c|1|a"
    a.on_leader_ack("c", ack, 1.0)
    beats = dict(a.tick(1.3, voters=four, ranked_alive=["a"], reachable=["c", "d"]))
    beat = beats["d"]
    assert isinstance(beat, Leader) and {e.voter for e in beat.proof} == {"a", "b", "c"}
    assert not beats["c"].proof  # type: ignore[attr-defined]  # c accepted: no proof needed
    ack = d.on_leader("a", beat, 2.1, four)[0][1]  # after its earlier failure's back-off
    assert isinstance(ack, LeaderAck) and ack.accepted and d.leader(2.1) == "a"
    # An ack whose signature is not its sender's is not added to the proof.
    a.on_leader_ack("b", LeaderAck(request_id=1, term=1, node_id="b", accepted=True,
                                   signature=b"forged"), 1.4)
    assert a.refused == {} or "bad ack signature" not in a.refused  # b is in the proof already
    a.on_leader_ack("d", LeaderAck(request_id=1, term=1, node_id="d", accepted=True,
                                   signature=b"forged"), 1.4)
    assert a.refused["bad ack signature"] == 1


def test_a_vote_whose_signature_is_not_the_voters_does_not_count() -> None:
    a = Election("a", timing=T, now=0.0, endorser=NameEndorser("a"))
    out = a.tick(0.6, voters=VOTERS, ranked_alive=["a", "b", "c"], reachable=["b", "c"])
    pre = out[0][1]
    out = a.on_vote("b", Vote(request_id=pre.request_id, term=1, voter="b", granted=True),  # type: ignore[attr-defined]
                    0.6, VOTERS, ["b", "c"])
    req = out[0][1]
    assert isinstance(req, VoteRequest) and role(a) == "candidate"
    a.on_vote("b", Vote(request_id=req.request_id, term=1, voter="b", granted=True,
                        signature=b"c|1|a"), 0.61, VOTERS, ["b", "c"])
    assert role(a) == "candidate" and a.refused["bad vote signature"] == 1
    a.on_vote("c", Vote(request_id=req.request_id, term=1, voter="c", granted=True,
                        signature=b"c|1|a"), 0.62, VOTERS, ["b", "c"])
    assert role(a) == "leader"


def test_a_leader_that_led_alone_re_elects_itself_with_the_members_that_joined() -> None:
    # Led alone, its proof is its own support; b joins (2 voters need 2 supports) and cannot
    # check it. Rather than wait out its lease, the leader re-elects itself with b at once.
    a = Election("a", timing=T, now=0.0, endorser=NameEndorser("a"))
    b = Election("b", timing=T, now=0.0, endorser=NameEndorser("b"))
    two = frozenset("ab")
    a.tick(0.6, voters={"a"}, ranked_alive=["a"], reachable=[])
    assert role(a) == "leader" and a.term == 1
    beat = dict(a.tick(1.0, voters=two, ranked_alive=["a", "b"], reachable=["b"]))["b"]
    ack = b.on_leader("a", beat, 1.0, two)[0][1]  # type: ignore[arg-type]
    assert isinstance(ack, LeaderAck) and not ack.accepted and "1 of 2" in ack.reason
    a.on_leader_ack("b", ack, 1.0)
    pre = dict(a.tick(1.05, voters=two, ranked_alive=["a", "b"], reachable=["b"]))["b"]
    assert isinstance(pre, PreVote) and pre.term == 2
    vote = b.on_prevote("a", pre, 1.05, two)[0][1]
    req = dict(a.on_vote("b", vote, 1.05, two, ["b"]))["b"]  # type: ignore[arg-type]
    vote = b.on_vote_request("a", req, 1.05, two)[0][1]  # type: ignore[arg-type]
    beat = dict(a.on_vote("b", vote, 1.06, two, ["b"]))["b"]  # type: ignore[arg-type]
    assert role(a) == "leader" and a.term == 2
    ack = b.on_leader("a", beat, 1.06, two)[0][1]  # type: ignore[arg-type]
    assert isinstance(ack, LeaderAck) and ack.accepted and b.leader(1.06) == "a"


def test_a_campaign_runs_above_a_term_one_voter_led_alone() -> None:
    # The seed of a new cluster led term 1 alone (its voters then: itself); two nodes joined it
    # at term 0. A campaign by one of them at term 1 gave term 1 a second scheduler (seen on
    # real daemons: tests/daemon/test_multidaemon.py). The seed's signed record says term 1:
    # the campaign runs at term 2.
    c = Election("c", timing=T, now=0.0)
    c.set_reported_terms({"a": 1, "b": 0})
    out = c.tick(0.6, voters=VOTERS, ranked_alive=["c", "b", "a"], reachable=["a", "b"])
    pre = out[0][1]
    assert isinstance(pre, PreVote) and pre.term == 2 and c.term == 0
    out = c.on_vote("b", Vote(request_id=pre.request_id, term=2, voter="b", granted=True), 0.6,
                    VOTERS, ["a", "b"])
    req = out[0][1]
    assert isinstance(req, VoteRequest) and req.term == 2 and c.term == 2
    # A member's word moves a campaign no further than the ceiling (it deposes nobody).
    d = Election("d", timing=T, now=0.0)
    d.set_reported_terms({"a": 10**6, "b": 0})
    out = d.tick(0.6, voters={"a", "b", "d"}, ranked_alive=["d", "b", "a"], reachable=["a", "b"])
    pre = out[0][1]
    assert isinstance(pre, PreVote) and pre.term == 1


# -- why leadership changed -----------------------------------------------------------------


def _win(a: Election, now: float, voters: frozenset[str] = VOTERS) -> list[tuple[str, Leader]]:
    """`a` campaigns at `now` and wins with b's votes; the heartbeats it sends."""
    reach = sorted(voters - {a.node_id})
    out = a.tick(now, voters=voters, ranked_alive=sorted(voters), reachable=reach)
    pre = out[0][1]
    assert isinstance(pre, PreVote)
    out = a.on_vote("b", Vote(request_id=pre.request_id, term=pre.term, voter="b",
                              granted=True), now, voters, reach)
    req = out[0][1]
    assert isinstance(req, VoteRequest)
    out = a.on_vote("b", Vote(request_id=req.request_id, term=req.term, voter="b",
                              granted=True), now, voters, reach)
    assert role(a) == "leader"
    return [(p, m) for p, m in out if isinstance(m, Leader)]


def test_each_change_of_leader_or_term_says_why() -> None:
    a = Election("a", timing=T, now=0.0)
    assert a.leadership_change(0.1) is None
    beats = _win(a, 0.6)
    c = a.leadership_change(0.6)
    assert c is not None and (c.leader, c.term, c.was_leader, c.was_term) == ("a", 1, None, 0)
    assert c.reason == "won the election of term 1 with 2 of 3 votes"
    assert a.leadership_change(0.6) is None  # reported once
    # Nobody acks: the lease runs out and the leader says it lost its quorum.
    a.tick(1.45, voters=VOTERS, ranked_alive=["a"], reachable=["b", "c"])
    c = a.leadership_change(1.45)
    assert c is not None and c.leader is None and c.was_leader == "a"
    assert c.reason.startswith("lease lapsed: 1 of 3 voters acked within 0.8 s, 2 needed")
    assert "quorum lost" in c.reason

    # A follower: a heartbeat makes a its leader; the clock alone loses it (before any tick).
    b = Election("b", timing=T, now=0.0)
    b.on_leader("a", beats[0][1], 0.6, VOTERS)
    c = b.leadership_change(0.6)
    assert c is not None and c.leader == "a" and c.reason == "heartbeat from a, leader of term 1"
    c = b.leadership_change(1.7)
    assert c is not None and c.leader is None and c.was_leader == "a"
    assert c.reason == "no heartbeat from a for 1.1 s (election timeout 1 s)"
    # A candidate's vote request of a higher term moves the term.
    b.on_vote_request("c", VoteRequest(request_id=9, term=2, candidate="c"), 1.8, VOTERS)
    c = b.leadership_change(1.8)
    assert c is not None and (c.term, c.was_term) == (2, 1)
    assert c.reason == "c asked for votes in term 2"
    # Lost to the clock and a term moved in one report: both are said.
    b.on_leader("c", Leader(request_id=11, term=2, leader="c"), 1.9, VOTERS)
    assert b.leadership_change(1.9) is not None
    b.on_vote_request("d", VoteRequest(request_id=12, term=3, candidate="d"), 3.0, VOTERS | {"d"})
    c = b.leadership_change(3.0)
    assert c is not None and (c.leader, c.was_leader, c.term) == (None, "c", 3)
    assert c.reason == ("no heartbeat from c for 1.1 s (election timeout 1 s); then d asked "
                        "for votes in term 3")
    # The leader left: lost at once, and said so.
    b.on_leader("c", Leader(request_id=10, term=3, leader="c"), 3.1, VOTERS)
    assert b.leadership_change(3.1) is not None
    b.forget("c", 3.2)
    c = b.leadership_change(3.2)
    assert c is not None and c.was_leader == "c" and c.reason == "c left or was removed"


def test_a_deposed_leader_says_by_whom() -> None:
    a = Election("a", timing=T, now=0.0)
    _win(a, 0.6)
    a.leadership_change(0.6)
    # A proven heartbeat of a higher term (plaintext mode: within the ceiling) deposes it.
    a.on_leader("c", Leader(request_id=5, term=2, leader="c"), 0.7, VOTERS)
    c = a.leadership_change(0.7)
    assert c is not None and (c.leader, c.was_leader, c.term) == ("c", "a", 2)
    assert c.reason == "heartbeat from c, leader of term 2"
    # Two leaders of one term meet.
    x = Election("x", timing=T, now=0.0)
    x.tick(0.6, voters={"x"}, ranked_alive=["x"], reachable=[])
    c = x.leadership_change(0.6)
    assert c is not None and c.reason == "won the election of term 1 with 1 of 1 votes"
    x.on_leader("y", Leader(request_id=1, term=1, leader="y"), 2.0, {"x", "y"})
    c = x.leadership_change(2.0)
    assert c is not None and c.leader is None
    assert c.reason == "y leads term 1 too (two leaders of one term: neither is followed)"
