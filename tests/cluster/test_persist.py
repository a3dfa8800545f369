"""The election's term and vote survive a restart (fusiond.cluster.persist and the service)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fusiond.cluster.persist import (
    ElectionState,
    ElectionStateError,
    load_election_state,
    save_election_state,
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
