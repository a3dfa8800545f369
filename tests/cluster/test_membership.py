"""Membership merge rules and the failure detector, with time passed in by hand."""

from __future__ import annotations

import pytest

from fusiond.cluster.membership import ELIDED, Link, MemberRecord, Membership
from fusiond.cluster.service import checked_profile, record_from_wire, record_to_wire
from protocol.messages import NodeProfile


def mk(now: float = 0.0) -> Membership:
    return Membership(node_id="me", address=("127.0.0.1", 1), incarnation=100,
                      profile=NodeProfile(),
                      now=now, suspect_after_s=2.0, dead_after_s=5.0)


def r(node_id: str, inc: int = 1, hb: int = 0, state: str = "alive",
      links: dict[str, Link] | None = None) -> MemberRecord:
    return MemberRecord(node_id, ("10.0.0.1", 7), inc, hb, state,  # type: ignore[arg-type]
                        NodeProfile(gflops=1.0), links or {})


def test_failure_detector_alive_suspect_dead_by_silence() -> None:
    m = mk()
    m.merge([r("a", hb=1)], 0.0)
    assert m.check(1.9) == [] and m.state("a") == "alive"
    assert [(t.old, t.new) for t in m.check(2.0)] == [("alive", "suspect")]
    assert [(t.old, t.new) for t in m.check(5.0)] == [("suspect", "dead")]
    # A newer heartbeat revives it.
    res = m.merge([r("a", hb=2)], 6.0)
    assert [(t.old, t.new) for t in res.transitions] == [("dead", "alive")]
    assert m.voters() == {"me", "a"}  # dead or alive, a voter


def test_stale_heartbeat_does_not_refresh() -> None:
    m = mk()
    m.merge([r("a", hb=5)], 0.0)
    m.merge([r("a", hb=5)], 1.5)
    m.merge([r("a", hb=3)], 1.9)
    assert m.check(2.1)[0].new == "suspect"


def test_higher_incarnation_wins_even_with_a_lower_heartbeat() -> None:
    m = mk()
    m.merge([r("a", inc=1, hb=50)], 0.0)
    m.check(10.0)
    assert m.state("a") == "dead"
    m.merge([r("a", inc=2, hb=0)], 10.0)
    rec = m.get("a")
    assert m.state("a") == "alive" and rec is not None and rec.incarnation == 2
    # The old incarnation's records are ignored from now on, and mark the sender behind.
    res = m.merge([r("a", inc=1, hb=99), r("me", inc=100)], 10.5)
    assert not res.updated and res.sender_behind
    assert m.get("a").incarnation == 2  # type: ignore[union-attr]


def test_left_is_sticky_for_the_incarnation() -> None:
    m = mk()
    m.merge([r("a", hb=1)], 0.0)
    m.merge([r("a", hb=1, state="left")], 0.1)
    assert m.state("a") == "left" and m.voters() == {"me"}
    m.merge([r("a", hb=9)], 0.2)  # later heartbeats of the same incarnation do not revive it
    assert m.state("a") == "left"
    assert m.check(100.0) == []  # the failure detector leaves it alone
    m.merge([r("a", inc=2)], 0.3)  # a restart does
    assert m.state("a") == "alive"


def test_newcomer_adopts_the_reported_dead_state() -> None:
    m = mk()
    m.merge([r("old", hb=3, state="dead")], 0.0)
    assert m.state("old") == "dead"
    m.merge([r("sus", hb=3, state="suspect")], 0.0)
    assert m.state("sus") == "suspect" and m.check(3.0)[0].new == "dead"


def test_self_removal_is_accepted_and_reported() -> None:
    m = mk()
    res = m.merge([r("me", inc=100, hb=0, state="left")], 1.0)
    assert res.self_removed and m.me.state == "left" and "me" not in m.voters()
    # A left record of an older incarnation of ours is not us.
    m2 = mk()
    assert not m2.merge([r("me", inc=99, state="left")], 1.0).self_removed


def test_sender_behind_only_for_missing_members_or_older_incarnations() -> None:
    m = mk()
    m.merge([r("a", hb=5), r("b", hb=5)], 0.0)
    # Lagging heartbeats alone: not behind (replying would ping-pong every round).
    res = m.merge([r("me", inc=100), r("a", hb=4), r("b", hb=4)], 0.1)
    assert not res.sender_behind
    res = m.merge([r("me", inc=100), r("a", hb=6)], 0.2)  # lacks b
    assert res.sender_behind


def test_operator_remove_and_own_links() -> None:
    m = mk()
    m.merge([r("a")], 0.0)
    assert m.remove("zz", 0.0) is None
    t = m.remove("a", 0.0)
    assert t is not None and t.new == "left" and m.voters() == {"me"}
    m.set_link("a", Link(1e8, 0.01, 0.03, 1.7e9))
    m.beat(1.0)
    assert m.me.links == {"a": Link(1e8, 0.01, 0.03, 1.7e9)} and m.me.heartbeat == 1
    assert m.links()[("me", "a")] == (1e8, 0.01, 0.03, 1.7e9)
    assert m.links()[("me", "a")].bandwidth_bits_per_s == 1e8


def test_hint_source_upgrades_to_the_most_direct() -> None:
    m = mk()
    m.hint_source("a", "bootstrap")
    m.merge([r("a")], 0.0)
    assert m.source("a") == "bootstrap"
    m.hint_source("a", "mdns")
    assert m.source("a") == "mdns"
    m.hint_source("a", "gossip")
    assert m.source("a") == "mdns"
    m.merge([r("b")], 0.0)
    assert m.source("b") == "gossip" and m.source("me") == "self"


def test_timeouts_validated() -> None:
    with pytest.raises(ValueError):
        Membership(node_id="x", address=("h", 1), incarnation=1,
                   profile=NodeProfile(), now=0.0,
                   suspect_after_s=5.0, dead_after_s=5.0)


def test_wire_round_trip_keeps_profile_links_and_state() -> None:
    rec = MemberRecord("a", ("10.0.0.2", 7420), 7, 3, "suspect",
                       NodeProfile(gflops=12.5, device_kind="cpu", torch_version="2.13.0",
                                   free_memory_bytes=123),
                       {"b": Link(1e9, 0.002, 0.04, 1.7e9)})
    entry = record_to_wire(rec)
    assert entry.profile is not None and entry.profile.gflops == 12.5
    assert entry.profile.software["torch"] == "2.13.0"
    assert entry.links[0].bandwidth_bits_per_s == 1e9
    assert entry.links[0].bandwidth_spread_ratio == 0.04 and entry.links[0].measured_at == 1.7e9
    back = record_from_wire(entry)
    assert back == rec


def test_heartbeat_only_entries_keep_the_known_profile_and_links() -> None:
    m = mk()
    m.merge([r("a", hb=1, links={"me": Link(5e7, 0.01)})], 0.0)
    full = m.get("a")
    slim = record_from_wire(record_to_wire(r("a", hb=2), full=False))
    assert slim.profile is ELIDED
    m.merge([slim], 0.5)
    got = m.get("a")
    assert got is not None and full is not None
    assert got.heartbeat == 2 and got.profile == full.profile and got.links == full.links
    # A member first heard of through a heartbeat-only entry starts with an empty profile.
    m.merge([record_from_wire(record_to_wire(r("b"), full=False))], 0.5)
    assert m.get("b").profile == NodeProfile()  # type: ignore[union-attr]
    assert m.get("b").profile is not ELIDED  # type: ignore[union-attr]


def test_the_table_is_bounded() -> None:
    m = Membership(node_id="me", address=("h", 1), incarnation=1,
                   profile=NodeProfile(), now=0.0,
                   suspect_after_s=1.0, dead_after_s=2.0, max_members=3)
    m.merge([r(f"x{i}") for i in range(10)], 0.0)
    assert len(m.ids()) == 3 and m.refused == 8
    m.merge([r("x0", hb=5)], 0.1)  # known members still update
    assert m.get("x0").heartbeat == 5  # type: ignore[union-attr]


def test_profiles_the_schema_cannot_carry_are_refused_naming_the_field() -> None:
    assert checked_profile(NodeProfile(gflops=1.0, ops_disabled=("aten.relu",))) is None
    problem = checked_profile(NodeProfile(memory_bytes=1 << 70))
    assert problem is not None and "NodeProfile.memory_bytes" in problem
    problem = checked_profile(NodeProfile(torch_version=7))  # type: ignore[arg-type]
    assert problem is not None and "torch_version: expected str" in problem


def test_a_newer_body_alone_does_not_revive_a_silent_member() -> None:
    # A relay may forward a member's body long after the member died: liveness comes from
    # headers only (a body revival kept dead daemons "alive" 2 s too long).
    m = mk()
    m.merge([r("a", hb=5)], 0.0)
    m.check(3.0)
    assert m.state("a") == "suspect"
    body = MemberRecord("a", ("10.0.0.1", 7), 1, 4, "alive", NodeProfile(gflops=9.0), {},
                        body_version=4)
    res = m.merge([body], 3.0)
    assert m.state("a") == "suspect" and not res.transitions
    assert m.get("a").profile == NodeProfile(gflops=9.0)  # type: ignore[union-attr]
    assert [t.new for t in m.check(5.0)] == ["dead"]


def test_a_removal_is_for_good_and_travels_with_its_signature() -> None:
    m = mk()
    m.merge([r("a", hb=1), r("b", hb=1)], 0.0)
    res = m.merge([r("me", inc=100), r("a", hb=2), r("b", hb=2)], 0.1, {"a": b"sig"})
    assert [(t.node_id, t.new) for t in res.transitions] == [("a", "left")]
    assert m.voters() == {"me", "b"} and m.removed() == {"a": b"sig"}
    # Not revived by a later heartbeat nor by a new incarnation, and not gossiped as a record.
    m.merge([r("a", hb=9), r("a", inc=5)], 0.2)
    assert m.state("a") == "left" and "a" not in {x.node_id for x in m.records()}
    assert not m.header_is_news("a", 5, 0, False)
    # A sender that lacks the removal is behind (it gets our view).
    assert m.merge([r("me", inc=100), r("b", hb=3)], 0.3).sender_behind
    assert not m.merge([r("me", inc=100), r("b", hb=4)], 0.3, {"a": b"sig"}).sender_behind


def test_only_a_members_own_left_claim_is_news() -> None:
    m = mk()
    m.merge([r("a", hb=5)], 0.0)
    assert m.header_is_news("a", 1, 5, True)  # its own left claim (checked by the service)
    assert not m.header_is_news("a", 1, 5, False) and not m.header_is_news("a", 1, 4, False)
    assert m.header_is_news("me", 100, 0, True) and not m.header_is_news("me", 99, 0, True)
    # A relay's judgement (suspect, dead) is never stored as the member's claim.
    m.merge([r("b", hb=1, state="dead")], 0.0)
    assert m.state("b") == "dead" and m.get("b").state == "alive"  # type: ignore[union-attr]


def test_restored_members_count_as_voters_until_heard() -> None:
    m = mk()
    restored = m.restore([r("a", hb=3), r("b", hb=3, state="left")], {"z": b"s"}, 10.0)
    assert restored == ["a", "b"] and m.state("a") == "dead" and m.state("b") == "left"
    assert m.voters() == {"me", "a"} and m.is_removed("z")
    assert m.check(10.1) == []  # dead until heard from
    m.merge([r("a", hb=4)], 10.2)
    assert m.state("a") == "alive"
