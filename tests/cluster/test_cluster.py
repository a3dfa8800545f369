"""Cluster instances on an in-memory network: convergence, failure detection, restarts,
election, partitions, leave/remove (intervals ~10x shorter than the defaults)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator

import pytest

from fusiond.cluster import Cluster, UnknownMemberError
from protocol.messages import Leader
from tests.cluster.fakes import FAST, FakeHub, LoopLag, Swarm, agreed_leader, until

IDS = ["n1", "n2", "n3", "n4", "n5"]


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    s = Swarm(FakeHub())
    try:
        yield s
    finally:
        await s.close()


async def start_five(swarm: Swarm) -> None:
    """n1 first; the others bootstrap from n1's address alone."""
    await swarm.add("n1")
    for nid in IDS[1:]:
        await swarm.add(nid, bootstrap=[swarm.addresses["n1"]])


def all_alive(swarm: Swarm, ids: list[str], members: list[str]) -> bool:
    for v in swarm.views(ids).values():
        states = v.states()
        if any(states.get(m) != "alive" for m in members):
            return False
    return True


async def test_five_nodes_converge_on_members_and_one_leader(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: all_alive(swarm, IDS, IDS), 5, "5 nodes to see 5 alive members")
    await until(lambda: agreed_leader(swarm.views()) is not None, 5, "one agreed leader")
    views = swarm.views()
    leader = agreed_leader(views)
    assert leader in IDS
    for v in views.values():
        assert v.has_quorum and v.voters == 5 and v.alive_voters == 5 and v.needed == 3
        assert v.term >= 1
        roles = {m.node_id: m.role for m in v.members}
        assert roles[leader] == "scheduler"
        assert sum(r == "scheduler" for r in roles.values()) == 1
        me = v.member(v.node_id)
        assert me is not None and me.source == "self"
    # How n1 heard of the others (gossip or their bootstrap contact) vs how they found n1.
    n2 = views["n2"].member("n1")
    assert n2 is not None and n2.source == "bootstrap"
    # Profiles travel with gossip.
    n3 = views["n1"].member("n3")
    assert n3 is not None and n3.profile.gflops == 10.0


async def test_crashed_worker_is_suspected_then_dead_on_time(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: all_alive(swarm, IDS, IDS), 5, "convergence")
    await until(lambda: agreed_leader(swarm.views()) is not None, 5, "a leader")
    leader = agreed_leader(swarm.views())
    victim = next(n for n in IDS if n != leader)
    survivors = [n for n in IDS if n != victim]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    suspect_at: dict[str, float] = {}
    dead_at: dict[str, float] = {}
    async with LoopLag() as lag:
        await swarm.crash(victim)
        while len(dead_at) < len(survivors) and loop.time() - t0 < 5:
            for nid, v in swarm.views(survivors).items():
                state = v.states()[victim]
                if state in ("suspect", "dead"):
                    suspect_at.setdefault(nid, loop.time() - t0)
                if state == "dead":
                    dead_at.setdefault(nid, loop.time() - t0)
            await asyncio.sleep(0.01)
    assert set(dead_at) == set(survivors), f"not all survivors saw {victim} dead: {dead_at}"
    # Suspect no earlier than suspect_after minus one gossip round (the last heartbeat it
    # sent may have reached a peer up to one round before the crash), dead within dead_after
    # plus propagation slack, plus however long this process was starved (a loaded machine
    # delays every timer; the lower bounds need no such allowance).
    slack = FAST.gossip_interval_s * 3 + 0.3 + lag.total
    for nid in survivors:
        assert suspect_at[nid] >= FAST.suspect_after_s - FAST.gossip_interval_s * 2, nid
        assert FAST.dead_after_s - FAST.gossip_interval_s * 2 <= dead_at[nid], nid
        assert dead_at[nid] <= FAST.dead_after_s + slack, (nid, dead_at[nid])
    # A dead member still counts as a voter; the 4 survivors keep their scheduler.
    views = swarm.views(survivors)
    assert all(v.voters == 5 and v.has_quorum for v in views.values())
    assert agreed_leader(views) == leader


async def test_restarted_node_comes_back_with_higher_incarnation(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: all_alive(swarm, IDS, IDS), 5, "convergence")
    old_inc = swarm.nodes["n1"].view().member("n4").incarnation  # type: ignore[union-attr]
    await swarm.crash("n4")
    others = [n for n in IDS if n != "n4"]
    await until(lambda: all(v.states()["n4"] == "dead" for v in swarm.views(others).values()),
                5, "n4 dead everywhere")
    await swarm.add("n4", bootstrap=[swarm.addresses["n2"]], incarnation=old_inc + 1000)
    await until(lambda: all_alive(swarm, IDS, IDS), 5, "n4 alive again everywhere")
    for v in swarm.views().values():
        m = v.member("n4")
        assert m is not None and m.incarnation == old_inc + 1000
    await until(lambda: agreed_leader(swarm.views()) is not None, 5, "agreement after restart")


async def test_leader_death_elects_a_new_leader_with_a_higher_term(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: agreed_leader(swarm.views()) is not None and all_alive(swarm, IDS, IDS),
                5, "a leader")
    views = swarm.views()
    old = agreed_leader(views)
    assert old is not None
    old_term = views[old].term
    await swarm.crash(old)
    survivors = [n for n in IDS if n != old]
    took = await until(
        lambda: agreed_leader(swarm.views(survivors)) not in (None, old), 5,
        "a new agreed leader")
    views = swarm.views(survivors)
    new = agreed_leader(views)
    assert new is not None and new != old
    assert all(v.term > old_term for v in views.values())
    # Detection is one election timeout; the campaign adds stagger + jitter + a few RTTs.
    assert took < 10 * FAST.election_timeout_s, took


async def test_leadership_changes_are_logged_with_their_reason(
    swarm: Swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """The winner says with how many votes it won; a survivor of a crashed scheduler says it
    lost it and why (its heartbeats stopped) before the next one is elected."""
    ids = IDS[:3]
    with caplog.at_level(logging.INFO, "fusiond.cluster"):
        await swarm.add("n1")
        for nid in ids[1:]:
            await swarm.add(nid, bootstrap=[swarm.addresses["n1"]])
        await until(lambda: agreed_leader(swarm.views()) is not None
                    and all_alive(swarm, ids, ids), 5, "a leader")
        old = agreed_leader(swarm.views())
        assert old is not None
        won = [r.getMessage() for r in caplog.records if "(this node): won the election of "
               "term" in r.getMessage()]
        assert won and re.search(r"with [23] of 3 votes$", won[-1]), won
        await swarm.crash(old)
        rest = [n for n in ids if n != old]
        await until(lambda: agreed_leader(swarm.views(rest)) not in (None, old), 5,
                    "a new leader")
    lost = [r.getMessage() for r in caplog.records
            if "no scheduler (term" in r.getMessage() and f"was {old})" in r.getMessage()]
    assert any(f": no heartbeat from {old} for " in m for m in lost), lost
    new = agreed_leader(swarm.views(rest))
    assert any(m.startswith(f"cluster: scheduler is {new}, term ") and (
        ": won the election" in m or f": heartbeat from {new}, leader of term" in m)
        for m in (r.getMessage() for r in caplog.records))


async def test_partition_minority_has_no_leader_majority_keeps_one_heal_gives_one(
        swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: agreed_leader(swarm.views()) is not None and all_alive(swarm, IDS, IDS),
                5, "a leader")
    leader = agreed_leader(swarm.views())
    # Put the leader in the minority: the harder case (it must let go).
    assert leader is not None
    minority = [leader, next(n for n in IDS if n != leader)]
    majority_ids = [n for n in IDS if n not in minority]
    swarm.hub.partition(set(minority), set(majority_ids))

    def minority_lost() -> bool:
        return all(v.leader is None and not v.has_quorum
                   for v in swarm.views(minority).values())

    def majority_led() -> bool:
        views = swarm.views(majority_ids)
        new = agreed_leader(views)
        return new in majority_ids and all(v.has_quorum for v in views.values())

    await until(lambda: minority_lost() and majority_led(), 6, "2 leaderless, 3 led")
    # It stays that way: the minority never gets a working scheduler, its term stays put
    # (pre-votes fail), and the majority keeps its leader. Keeping it needs this process to
    # run: a stall longer than the lease (a loaded machine) legitimately deposes a leader, so
    # then only the safety half is judged.
    minority_terms = {n: v.term for n, v in swarm.views(minority).items()}
    majority_leader = agreed_leader(swarm.views(majority_ids))
    async with LoopLag() as lag:
        for _ in range(int(1.5 / 0.05)):
            await asyncio.sleep(0.05)
            assert minority_lost()
            if lag.worst < FAST.leader_lease_s / 2:
                assert agreed_leader(swarm.views(majority_ids)) == majority_leader, lag.worst
        assert {n: v.term for n, v in swarm.views(minority).items()} == minority_terms
        swarm.hub.heal()
        await until(lambda: all_alive(swarm, IDS, IDS)
                    and agreed_leader(swarm.views()) is not None, 8, "one leader after healing")
    views = swarm.views()
    if lag.worst < FAST.leader_lease_s / 2:
        # Pre-vote: the rejoiners did not depose it.
        assert agreed_leader(views) == majority_leader, lag.worst
    assert all(v.has_quorum for v in views.values())


async def test_stale_leader_message_is_refused(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: agreed_leader(swarm.views()) is not None and all_alive(swarm, IDS, IDS),
                5, "a leader")
    views = swarm.views()
    leader = agreed_leader(views)
    term = views["n1"].term
    impostor = next(n for n in IDS if n != leader)
    target = next(n for n in IDS if n not in (leader, impostor))
    before = swarm.hub.sent["LeaderAck"]
    consumed = await swarm.nodes[target].handle(
        impostor, Leader(request_id=99, term=term - 1 if term > 1 else 0, leader=impostor))
    assert consumed
    await asyncio.sleep(0.05)
    v = swarm.nodes[target].view()
    assert v.leader == leader and v.term == term
    assert swarm.hub.sent["LeaderAck"] > before


async def test_quorum_lost_for_good_is_recovered_by_remove(swarm: Swarm) -> None:
    for nid in ["a", "b", "c"]:
        await swarm.add(nid, bootstrap=[swarm.addresses["a"]] if nid != "a" else [])
    await until(lambda: all_alive(swarm, ["a", "b", "c"], ["a", "b", "c"])
                and agreed_leader(swarm.views()) is not None, 5, "3 nodes, a leader")
    await swarm.crash("b")
    await swarm.crash("c")
    await until(lambda: not swarm.nodes["a"].view().has_quorum
                and swarm.nodes["a"].view().leader is None, 5, "a alone without quorum")
    await until(lambda: swarm.nodes["a"].view().states()["c"] == "dead", 5, "c dead")
    await asyncio.sleep(2 * FAST.election_timeout_s)
    assert swarm.nodes["a"].view().leader is None  # never by guesswork
    advice = swarm.nodes["a"].view().quorum_advice()
    assert advice is not None and "1 of 3 voters alive, 2 needed" in advice
    assert "fusionctl remove b; fusionctl remove c" in advice
    with pytest.raises(UnknownMemberError):
        await swarm.nodes["a"].remove("nobody")
    await swarm.nodes["a"].remove("b")
    await swarm.nodes["a"].remove("c")
    v = swarm.nodes["a"].view()
    assert v.voters == 1 and v.states()["b"] == "left" and v.quorum_advice() is None
    await until(lambda: swarm.nodes["a"].view().leader == "a", 5, "a leads alone")


async def test_leave_drops_the_node_from_the_voters(swarm: Swarm) -> None:
    await start_five(swarm)
    await until(lambda: agreed_leader(swarm.views()) is not None and all_alive(swarm, IDS, IDS),
                5, "a leader")
    leaver = next(n for n in IDS if n != agreed_leader(swarm.views()))
    await swarm.nodes[leaver].leave()
    rest = [n for n in IDS if n != leaver]
    await until(lambda: all(v.states()[leaver] == "left" and v.voters == 4
                            for v in swarm.views(rest).values()), 3, "everyone saw the leave")
    # Left is sticky: the leaver keeps gossiping nothing that revives it.
    await asyncio.sleep(0.5)
    assert all(v.states()[leaver] == "left" for v in swarm.views(rest).values())


async def test_on_change_reports_leader_and_membership(swarm: Swarm) -> None:
    seen: list[tuple[str | None, int, int]] = []
    node: Cluster = await swarm.add("x")
    node.on_change(lambda v: seen.append((v.leader, v.term, len(v.members))))
    await swarm.add("y", bootstrap=[swarm.addresses["x"]])
    await until(lambda: any(m == 2 for _, _, m in seen), 3, "a change with 2 members")
    await until(lambda: any(lead is not None for lead, _, _ in seen), 5, "a leader change")


async def test_other_cluster_messages_are_not_consumed(swarm: Swarm) -> None:
    node = await swarm.add("z")
    from protocol.messages import Ack
    assert not await node.handle("peer", Ack(request_id=1))


async def test_bootstrap_is_retried_until_the_seed_answers(swarm: Swarm) -> None:
    seed_address = swarm.hub.address()  # nobody listens there yet
    late = await swarm.add("late")
    late.add_bootstrap(seed_address)
    late.add_bootstrap(seed_address)  # a duplicate is ignored
    await asyncio.sleep(3 * FAST.bootstrap_retry_s)
    assert [m.node_id for m in late.view().members] == ["late"]
    swarm.addresses["seed"] = seed_address
    await swarm.add("seed")
    await until(lambda: all_alive(swarm, ["late", "seed"], ["late", "seed"]), 5,
                "late to reach the seed once it is up")
    m = late.view().member("seed")
    assert m is not None and m.source == "bootstrap"


async def test_a_crashed_loop_surfaces_in_wait(swarm: Swarm) -> None:
    node = await swarm.add("w")

    def boom() -> list[str]:
        raise RuntimeError("injected")

    node._gossip_targets = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        await asyncio.wait_for(node.wait(), 5)


async def test_two_groups_formed_apart_merge_under_one_leader_of_a_new_term(
        swarm: Swarm) -> None:
    a = await swarm.add("ga")
    b = await swarm.add("gb")
    await until(lambda: a.view().leader == "ga" and b.view().leader == "gb", 5,
                "each alone leads its own term 1")
    assert a.view().term == b.view().term == 1
    a.add_bootstrap(swarm.addresses["gb"])
    await until(lambda: agreed_leader(swarm.views()) is not None
                and all_alive(swarm, ["ga", "gb"], ["ga", "gb"]), 8, "one leader after merging")
    assert all(v.term >= 2 for v in swarm.views().values())


async def test_a_leaving_leader_is_replaced_without_waiting_out_the_timeout() -> None:
    # A long election timeout: waiting it out would take 3 s, a replacement on the Leave
    # message takes a few ticks, so a loaded machine cannot blur the two.
    timeout = 3.0
    swarm = Swarm(FakeHub(), dataclasses.replace(FAST, election_timeout_s=timeout))
    try:
        await start_five(swarm)
        await until(lambda: agreed_leader(swarm.views()) is not None
                    and all_alive(swarm, IDS, IDS), 5, "a leader")
        old = agreed_leader(swarm.views())
        assert old is not None
        rest = [n for n in IDS if n != old]
        await swarm.nodes[old].leave()
        took = await until(lambda: agreed_leader(swarm.views(rest)) not in (None, old),
                           2 * timeout, "a new leader after the leader left")
        views = swarm.views(rest)
        assert all(v.voters == 4 and v.states()[old] == "left" for v in views.values())
        # Leave tells everyone at once: no election timeout to wait out first (a crash
        # needs one).
        assert took < timeout, took
    finally:
        await swarm.close()
