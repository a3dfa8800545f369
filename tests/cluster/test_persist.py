"""The election's term and vote survive a restart (fusiond.cluster.persist and the service)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from fusiond.cluster import Cluster
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
from tests.cluster.fakes import FakeHub, Swarm, agreed_leader, until


def test_save_then_load_round_trips_and_belongs_to_one_cluster_and_node(tmp_path: Path) -> None:
    path = tmp_path / "election.json"
    assert load_election_state(path, cluster_id="c", node_id="n") is None  # nothing yet
    save_election_state(path, ElectionState(7, "m"), cluster_id="c", node_id="n")
    assert load_election_state(path, cluster_id="c", node_id="n") == ElectionState(7, "m")
    save_election_state(path, ElectionState(8, None), cluster_id="c", node_id="n")
    assert load_election_state(path, cluster_id="c", node_id="n") == ElectionState(8, None)
    assert [p.name for p in tmp_path.iterdir()] == ["election.json"]  # no temporary left
    assert path.stat().st_mode & 0o077 == 0
    # Another cluster's or node's state (a reused state directory) is not ours.
    assert load_election_state(path, cluster_id="other", node_id="n") is None
    assert load_election_state(path, cluster_id="c", node_id="other") is None


@pytest.mark.parametrize(("body", "says"), [
    (b"{not json", "not JSON"),
    (b"[1]", "JSON object"),
    (b'{"version": 99}', "version 99"),
    (b'{"version": 1, "cluster_id": "c", "node_id": "n", "term": -1}', "term"),
    (b'{"version": 1, "cluster_id": "c", "node_id": "n", "term": true}', "term"),
    (b'{"version": 1, "cluster_id": "c", "node_id": "n", "term": 1, "voted_for": 3}',
     "voted_for"),
])
def test_a_malformed_file_is_an_error_naming_it(tmp_path: Path, body: bytes, says: str) -> None:
    path = tmp_path / "election.json"
    path.write_bytes(body)
    with pytest.raises(ElectionStateError, match=says) as info:
        load_election_state(path, cluster_id="c", node_id="n")
    assert str(path) in str(info.value)


def stored(path: str) -> dict[str, object]:
    """The persisted JSON (a blocking read: tiny, in a test)."""
    data = json.loads(Path(path).read_text())
    assert isinstance(data, dict)
    return data


async def test_a_restarted_node_resumes_its_term_and_vote(tmp_path: Path) -> None:
    swarm = Swarm(FakeHub())
    paths = {n: str(tmp_path / f"{n}.json") for n in ("a", "b", "c")}
    try:
        for n in ("a", "b", "c"):
            await swarm.add(n, bootstrap=[swarm.addresses["a"]] if n != "a" else [],
                            state_path=paths[n])
        await until(lambda: agreed_leader(swarm.views()) is not None, 5, "a leader")
        leader = agreed_leader(swarm.views())
        assert leader is not None
        term = swarm.nodes[leader].view().term
        # Every node's file holds the term; the leader voted for itself in it.
        await until(lambda: all(stored(p)["term"] == term for p in paths.values()), 2,
                    "every node to persist the term")
        assert stored(paths[leader])["voted_for"] == leader
        follower = next(n for n in paths if n != leader)
        await swarm.crash(follower)
        node = await swarm.add(follower, bootstrap=[swarm.addresses[leader]],
                               state_path=paths[follower])
        # Before any message: the term comes from the file, not from gossip.
        assert node.view().term == term
    finally:
        await swarm.close()


async def test_an_unreadable_state_file_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "election.json"
    path.write_bytes(b"garbage")
    swarm = Swarm(FakeHub())
    try:
        with caplog.at_level(logging.WARNING, logger="fusiond.cluster.service"):
            node = await swarm.add("solo", state_path=str(path))
        assert node.view().term == 0
        assert any("ignoring the election state" in r.getMessage() and str(path) in
                   r.getMessage() for r in caplog.records)
        # It still leads alone, and then the file is valid again.
        await until(lambda: node.view().leader == "solo", 5, "solo to lead")
        await until(lambda: load_election_state(path, cluster_id="test", node_id="solo")
                    is not None, 2, "the state to be rewritten")
    finally:
        await swarm.close()


# -- the member list ------------------------------------------------------------------------


def members(tmp_path: Path) -> tuple[Path, MembersState]:
    state = MembersState(
        members=(StoredMember("a", ("10.0.0.1", 7), 5, 9, False, 3, b"sig", b"cert"),
                 StoredMember("b", ("10.0.0.2", 7), 6, 1, True, 2)),
        removals={"z": b"operator-sig"}, voters=frozenset({"me", "a"}))
    return tmp_path / "members.json", state


def test_the_member_list_round_trips_and_belongs_to_one_cluster_and_node(
        tmp_path: Path) -> None:
    path, state = members(tmp_path)
    assert load_members_state(path, cluster_id="c", node_id="me", max_members=10) is None
    save_members_state(path, state, cluster_id="c", node_id="me")
    assert load_members_state(path, cluster_id="c", node_id="me", max_members=10) == state
    assert load_members_state(path, cluster_id="c", node_id="other", max_members=10) is None
    assert path.stat().st_mode & 0o077 == 0
    with pytest.raises(MembersStateError, match="more than 1 members"):
        load_members_state(path, cluster_id="c", node_id="me", max_members=1)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d.update(members=7), "must be lists"),
    (lambda d: d["members"][0].update(incarnation=2**64), "incarnation"),
    (lambda d: d["members"][0].update(address=["h", 0]), "address"),
    (lambda d: d["members"][0].update(signature="!!"), "base64"),
    (lambda d: d["members"][0].update(left="yes"), "left"),
    (lambda d: d.update(voters=["me", "ghost"]), "ghost"),
    (lambda d: d.update(version=9), "version 9"),
])
def test_a_malformed_member_list_is_an_error_naming_it(tmp_path: Path, edit: object,
                                                       says: str) -> None:
    path, state = members(tmp_path)
    save_members_state(path, state, cluster_id="c", node_id="me")
    data = json.loads(path.read_text())
    edit(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))
    with pytest.raises(MembersStateError, match=says) as info:
        load_members_state(path, cluster_id="c", node_id="me", max_members=10)
    assert str(path) in str(info.value)


def test_an_absurd_persisted_term_is_refused_and_never_written(tmp_path: Path) -> None:
    # The old overflow bug persisted 2**64 - 1 in every node's election.json.
    path = tmp_path / "election.json"
    path.write_text(json.dumps({"version": 1, "cluster_id": "c", "node_id": "n",
                                "term": 2**64 - 1, "voted_for": None}))
    with pytest.raises(ElectionStateError, match="absurd"):
        load_election_state(path, cluster_id="c", node_id="n")
    with pytest.raises(ValueError, match="absurd"):
        save_election_state(path, ElectionState(2**60, None), cluster_id="c", node_id="n")


async def test_a_node_whose_file_holds_an_absurd_term_recovers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    swarm = Swarm(FakeHub())
    paths = {n: tmp_path / f"{n}.json" for n in ("a", "b", "c")}
    for p in paths.values():
        p.write_text(json.dumps({"version": 1, "cluster_id": "test", "node_id": p.stem,
                                 "term": 2**64 - 1, "voted_for": None}))
    try:
        with caplog.at_level(logging.WARNING, logger="fusiond.cluster.service"):
            for n in ("a", "b", "c"):
                await swarm.add(n, bootstrap=[swarm.addresses["a"]] if n != "a" else [],
                                state_path=str(paths[n]))
        assert any("absurd" in r.getMessage() for r in caplog.records)
        await until(lambda: agreed_leader(swarm.views()) is not None, 5, "a leader")
        assert all(v.term < 10 for v in swarm.views().values())
        await until(lambda: all(stored(str(p))["term"] < 10 for p in paths.values()), 2,
                    "the files to hold a sane term again")
    finally:
        await swarm.close()


def leaders_by_term(log: list[tuple[int, str]]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for term, leader in log:
        out.setdefault(term, set()).add(leader)
    return out


async def test_a_restarted_node_that_cannot_reach_its_peers_never_leads_alone(
        tmp_path: Path) -> None:
    # The reproduction: the seed restarts while its bootstrap peers do not answer.
    # Without a persisted member list it formed a one-node cluster, elected itself, reported
    # "quorum yes (1 of 1)", and its term collided with the real leader's.
    swarm = Swarm(FakeHub())
    ids = ("a", "b", "c")
    files = {n: (str(tmp_path / f"{n}.election.json"), str(tmp_path / f"{n}.members.json"))
             for n in ids}
    seen: list[tuple[int, str]] = []

    def watch(node: Cluster) -> None:
        node.on_change(lambda v: seen.append((v.term, v.leader)) if v.leader else None)

    try:
        for n in ids:
            watch(await swarm.add(n, bootstrap=[swarm.addresses["a"]] if n != "a" else [],
                                  state_path=files[n][0], members_path=files[n][1]))
        await until(lambda: agreed_leader(swarm.views()) is not None
                    and all(v.alive_voters == 3 for v in swarm.views().values()), 5,
                    "3 members and a leader")
        await until(lambda: Path(files["a"][1]).exists()
                    and len(json.loads(Path(files["a"][1]).read_text())["voters"]) == 3, 2,
                    "a's member list on disk")
        await swarm.crash("a")
        swarm.hub.partition({"a"}, {"b", "c"})
        seed = await swarm.add("a", bootstrap=[swarm.addresses["b"]],
                               state_path=files["a"][0], members_path=files["a"][1])
        watch(seed)
        for _ in range(40):  # 2 s: grace, several election timeouts
            v = seed.view()
            assert v.voters == 3 and v.needed == 2 and not v.has_quorum, v
            assert v.leader is None and seed.view().quorum_advice() is not None
            await asyncio.sleep(0.05)
        assert "no quorum: 1 of 3 voters alive" in (seed.view().quorum_advice() or "")
        swarm.hub.heal()
        await until(lambda: agreed_leader(swarm.views()) is not None
                    and all(v.alive_voters == 3 for v in swarm.views().values()), 5,
                    "the seed back, one leader")
        await asyncio.sleep(0.5)
        terms = leaders_by_term(seen)
        assert all(len(leaders) == 1 for leaders in terms.values()), terms
    finally:
        await swarm.close()
