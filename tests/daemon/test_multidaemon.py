"""Must-hold properties on real daemons: separate fusiond processes on loopback.

Discovery by mDNS alone and by one bootstrap address alone, failure detection, re-election,
restart, a 2/3 partition through the transport's test-only drop switch, and refusal of peers
without credentials, of another cluster, of another protocol version, and of garbage.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fusionctl.cli import EXIT_NOT_SERVING
from fusionctl.local import agreement, merge, summary
from tests.daemon.harness import AGREE_S, TIMERS, Cluster, iter_members, state_of

pytestmark = [pytest.mark.multidaemon, pytest.mark.timeout(180)]

DEAD_AFTER_S = TIMERS["cluster"]["dead_after_s"]


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """Clusters under a short temporary directory (Unix socket paths max out at 108 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="fzmd"))
    made: list[Cluster] = []

    def make(n: int, settings: dict[str, Any] | None = None, tls: bool = True,
             credentials: bool = True) -> Cluster:
        c = Cluster(root / f"c{len(made)}", n, settings, tls, credentials)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _start_by_bootstrap(c: Cluster) -> str:
    """Start node0, then every other node with node0's address as its only bootstrap."""
    c.start(c.nodes[:1])
    c.wait_up(c.nodes[:1])
    addr = c.address(c.nodes[0])
    for n in c.nodes[1:]:
        n.settings = merge(n.settings, {"cluster": {"bootstrap": [addr]}})
    c.start(c.nodes[1:])
    c.wait_up()
    return addr


@pytest.mark.slow
def test_five_daemons_agree_by_mdns_alone(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(5, {"cluster": {"mdns": True, "mdns_interfaces": ["127.0.0.1"]}})
    c.start()
    c.wait_up()
    agreed, took = c.wait_agreement(timeout=AGREE_S)
    assert took <= AGREE_S and agreed["leader"] in agreed["alive"]
    sources = {m["source"] for n in c.nodes for m in iter_members(n.status())}
    assert "bootstrap" not in sources and "mdns" in sources, sources


@pytest.mark.slow
def test_five_daemons_agree_by_one_bootstrap_address(
        make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(5)
    for n in c.nodes:  # a mixed cluster: both event loops, in one run
        n.settings["loop"] = "asyncio" if n.index % 2 else "auto"
    _start_by_bootstrap(c)
    agreed, _took = c.wait_agreement(timeout=AGREE_S)
    assert len(agreed["alive"]) == 5
    sources = {m["source"] for n in c.nodes for m in iter_members(n.status())}
    assert "mdns" not in sources, sources
    loops = {line.split(" event loop")[0].rsplit(" ", 1)[-1] for n in c.nodes
             for line in n.log_text().splitlines() if "event loop" in line}
    assert loops == {"asyncio", "uvloop"} or loops == {"asyncio"}, loops  # uvloop if installed


@pytest.mark.slow
def test_kill_worker_then_scheduler_then_restart(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(5)
    _start_by_bootstrap(c)
    agreed, _ = c.wait_agreement()
    ids = {c.node_id(n): n for n in c.nodes}
    leader = agreed["leader"]

    # a worker dies: every survivor marks it dead within the configured timeout
    worker = next(n for nid, n in ids.items() if nid != leader and n.index != 0)
    worker_id = c.node_id(worker)
    worker.kill()
    t0 = time.monotonic()
    survivors = [n for n in c.nodes if n is not worker]
    took = c.wait_for(lambda: (all(state_of(n.status(), worker_id) == "dead" for n in survivors),
                               "not dead everywhere"), DEAD_AFTER_S + 5, "worker marked dead")
    assert took <= DEAD_AFTER_S + 1.0, f"marked dead after {took:.2f} s"
    assert time.monotonic() - t0 >= TIMERS["cluster"]["suspect_after_s"]  # not instant: a timeout
    # the scheduler is unaffected
    assert {summary(n.status())["leader"] for n in survivors} == {leader}

    # the scheduler dies: the 3 left (of 5 voters) elect a new one and agree within 10 s
    old = ids[leader]
    old.kill()
    rest = [n for n in survivors if n is not old]
    new, took = c.wait_agreement(rest, timeout=AGREE_S, not_leader=leader)
    assert new["leader"] != leader and new["term"] > agreed["term"]

    # both come back (same identity, new incarnation) and all five agree again
    addr = c.address(rest[0])
    for n in (worker, old):
        n.settings = merge(n.settings, {"cluster": {"bootstrap": [addr]}})
        n.start()
    c.wait_up()
    again, _ = c.wait_agreement(timeout=AGREE_S + 5)
    assert set(again["alive"]) == set(ids)


@pytest.mark.slow
def test_partition_minority_has_no_scheduler(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(5)
    _start_by_bootstrap(c)
    agreed, _ = c.wait_agreement()
    ids = {c.node_id(n): n for n in c.nodes}
    # the minority holds the current scheduler: the hard case
    minority_ids = [agreed["leader"], next(i for i in ids if i != agreed["leader"])]
    majority_ids = [i for i in ids if i not in minority_ids]
    minority = [ids[i] for i in minority_ids]
    majority = [ids[i] for i in majority_ids]
    for n in minority:
        c.block(n, majority_ids)
    for n in majority:
        c.block(n, minority_ids)

    def split() -> tuple[bool, str]:
        maj = [n.status() for n in majority]
        mino = [summary(n.status()) for n in minority]
        ok, why = agreement(maj, 3)
        if not ok:
            return False, f"majority: {why}"
        if any(s["leader"] is not None or s["quorum"] for s in mino):
            return False, f"minority still has a scheduler: {mino}"
        return True, "split"

    c.wait_for(split, AGREE_S, "3 keep a scheduler, 2 have none")
    time.sleep(1.0)  # and it stays that way: the minority never elects one
    ok, why = split()
    assert ok, c.explain(why)
    for n in c.nodes:
        c.block(n, [])
    healed, _ = c.wait_agreement(timeout=AGREE_S)
    assert len(healed["alive"]) == 5


async def _wrong_version(addr: tuple[str, int], state: Path, ca_dir: Path) -> str:
    from fusiond.net import NetConfig, PeerNetwork, PeerRefused, pki

    ca = pki.load_cluster_ca(ca_dir)
    assert ca is not None
    ident = pki.load_or_create_node_identity(state)
    pki.store_node_credentials(state, pki.issue_node_certificate(ca, ident.key.public_key()),
                               ca.cert)

    async def drop(peer: str, msg: object) -> None:
        return None

    net = PeerNetwork(node_id=ident.node_id, cluster_id=ca.cluster_id, listen=("127.0.0.1", 0),
                      tls=pki.TLSMaterial.in_state_dir(state), handler=drop,
                      config=NetConfig(versions=(99, 99), connect_timeout_s=2.0,
                                       handshake_timeout_s=2.0))
    await net.start()
    try:
        with pytest.raises(PeerRefused) as e:
            await net.connect(addr)
        return str(e.value)
    finally:
        await net.close()


async def _raw(addr: tuple[str, int], data: bytes, ctx: ssl.SSLContext | None) -> None:
    """Open a connection (TLS with a valid cluster certificate when `ctx`), send `data`, and
    hang up without finishing the frame."""
    _reader, writer = await asyncio.open_connection(addr[0], addr[1], ssl=ctx)
    writer.write(data)
    await writer.drain()
    await asyncio.sleep(0.3)
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError):
        await writer.wait_closed()


@pytest.mark.slow
def test_intruders_are_refused_and_the_cluster_keeps_serving(
        make_cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    from fusiond.net import pki, tls

    c = make_cluster(3)
    addr_s = _start_by_bootstrap(c)
    host, port = addr_s.rsplit(":", 1)
    addr = (host, int(port))
    c.wait_agreement()
    target = c.nodes[0]

    # a daemon without credentials (plaintext) and a daemon of another cluster both dial in
    plain = make_cluster(1, {"cluster": {"bootstrap": [addr_s]}}, tls=False)
    other = make_cluster(1, {"cluster": {"bootstrap": [addr_s]}})
    plain.start()
    other.start()
    plain.wait_up()
    other.wait_up()

    # a peer of this cluster speaking another protocol version
    refusal = asyncio.run(_wrong_version(addr, tmp_path / "v99", target.state_dir))
    assert "99" in refusal and "version" in refusal.lower()

    # garbage before TLS, garbage after a valid TLS handshake, and a frame cut short
    material = pki.TLSMaterial.in_state_dir(tmp_path / "v99")
    ctx = tls.client_context(material)
    asyncio.run(_raw(addr, os.urandom(512), None))
    asyncio.run(_raw(addr, b"\x00" * 8 + os.urandom(200), ctx))
    from protocol.messages import Ping, encode_message

    frame = b"".join(bytes(p) for p in encode_message(Ping(request_id=1, sent_at=1.0)))
    asyncio.run(_raw(addr, frame[: len(frame) // 2], ctx))

    def logged() -> tuple[bool, str]:
        text = target.log_text()
        wanted = {
            "no credentials": "TLS handshake failed",
            "wrong version": "refused connection from",
            "garbage": "bad frame from",
        }
        missing = [k for k, v in wanted.items() if v not in text]
        return not missing, f"no log line for {missing}"

    c.wait_for(logged, 5.0, "refusal log lines")
    text = target.log_text()
    assert "version" in text and ("mid-frame" in text or "bad frame" in text)
    # the refused are not members anywhere, and the cluster still agrees and serves
    time.sleep(1.0)
    agreed, _ = c.wait_agreement(timeout=5.0)
    assert len(agreed["alive"]) == 3
    for outsider in (plain.nodes[0], other.nodes[0]):
        st = outsider.status()
        assert st is not None
        assert [m["node_id"] for m in iter_members(st)] in ([], [st["node"]["node_id"]])
        assert outsider.alive()  # refused, not crashed
    for n in c.nodes:
        assert n.alive()


@pytest.mark.slow
def test_lost_majority_is_recovered_by_removing_the_dead(
        make_cluster: Callable[..., Cluster], capsys: pytest.CaptureFixture[str]) -> None:
    from fusionctl.cli import run as fusionctl

    c = make_cluster(3)
    _start_by_bootstrap(c)
    c.wait_agreement()
    survivor, *gone = c.nodes
    gone_ids = [c.node_id(n) for n in gone]
    for n in gone:
        n.kill()

    def stuck() -> tuple[bool, str]:
        st = survivor.status()
        s = summary(st)
        dead = all(state_of(st, nid) == "dead" for nid in gone_ids)
        return (s["leader"] is None and not s["quorum"] and dead), f"survivor: {s}"

    c.wait_for(stuck, DEAD_AFTER_S + 5, "the survivor loses its scheduler")
    assert fusionctl(["--socket", survivor.socket, "status"]) == EXIT_NOT_SERVING
    out = capsys.readouterr().out
    assert "NO QUORUM" in out and f"fusionctl remove {gone_ids[0]}" in out
    # no guesswork: it stays without a scheduler until an operator removes the dead
    time.sleep(1.0)
    assert stuck()[0]
    for nid in gone_ids:
        assert fusionctl(["--socket", survivor.socket, "remove", nid]) == 0
    agreed, _ = c.wait_agreement([survivor], timeout=AGREE_S)
    assert agreed["leader"] == c.node_id(survivor)
    # a removed member that comes back with its still-valid certificate is refused here
    back = gone[0]
    back.settings = merge(back.settings, {"cluster": {"bootstrap": [c.address(survivor)]}})
    back.start()
    c.wait_for(lambda: (f"node {gone_ids[0]} was removed" in survivor.log_text(), "not yet"),
               AGREE_S, "the removed node refused")
    again = summary(survivor.status())
    assert again["alive"] == [c.node_id(survivor)] and again["leader"] == c.node_id(survivor)
    st = survivor.status()
    assert st is not None and gone_ids[0] in st["node"]["denied"]


def _leaders_by_term(c: Cluster) -> dict[int, set[str]]:
    """Every "scheduler is X, term T" line in every node's log (all runs): term -> leaders."""
    out: dict[int, set[str]] = {}
    for n in c.nodes:
        for m in re.finditer(r"cluster: scheduler is (\S+), term (\d+)", n.log_text()):
            out.setdefault(int(m.group(2)), set()).add(m.group(1))
    return out


@pytest.mark.slow
def test_a_restarted_seed_whose_peers_do_not_answer_never_leads(
        make_cluster: Callable[..., Cluster]) -> None:
    # The issue's reproduction: restarted with its peers unreachable, the seed formed a
    # one-node cluster, reported "quorum yes (1 of 1)" and led a term the real leader also
    # held; later three leaders existed at once.
    c = make_cluster(3)
    _start_by_bootstrap(c)
    c.wait_agreement()
    seed, *others = c.nodes
    seed_id = c.node_id(seed)
    members_file = seed.state_dir / "members.json"

    def persisted() -> tuple[bool, str]:
        try:
            voters = json.loads(members_file.read_text())["voters"]
        except (OSError, ValueError, KeyError):
            return False, "no member list yet"
        return len(voters) == 3, f"voters {voters}"

    c.wait_for(persisted, AGREE_S, "the seed's member list on disk")
    seed.kill()
    for n in others:
        c.block(n, [seed_id])  # from now on they drop everything to and from the seed
    c.wait_agreement(others, timeout=AGREE_S + 5)
    seed.start()
    c.wait_up([seed])
    t_end = time.monotonic() + 3 * TIMERS["cluster"]["election_timeout_s"] + TIMERS[
        "cluster"]["election_grace_s"] + 2.0
    while time.monotonic() < t_end:
        st = seed.status()
        assert st is not None and st["cluster"] is not None
        view = st["cluster"]
        assert view["voters"] == 3 and view["needed"] == 2, view
        assert not view["has_quorum"] and view["leader"] is None, summary(st)
        time.sleep(0.2)
    # fusionctl status says why: no quorum, 1 of 3 voters alive.
    from fusionctl.cli import run as fusionctl

    assert fusionctl(["--socket", seed.socket, "status"]) in (0, 1, EXIT_NOT_SERVING)
    for n in others:
        c.block(n, [])
    agreed, _ = c.wait_agreement(timeout=AGREE_S + 5)
    assert seed_id in agreed["alive"]
    time.sleep(1.0)
    terms = _leaders_by_term(c)
    assert terms and all(len(leaders) == 1 for leaders in terms.values()), terms
    lines = [line for line in seed.log_text().splitlines()
             if "restored 2 member(s)" in line and "3 voters, 2 needed" in line]
    assert lines, "the seed did not say it restored its member list"
    # Only a member holding the CA key removes members: node1 has none.
    from fusionctl.client import ApiFailure

    with pytest.raises(ApiFailure) as refused:
        others[0].api("POST", "/v1/remove", {"node_id": seed_id})
    assert refused.value.status == 403 and "ca.key" in refused.value.message
    assert all(summary(n.status())["quorum"] for n in c.nodes)


@pytest.mark.slow
def test_sighup_adds_bootstrap_addresses(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(2)
    c.start()
    c.wait_up()
    a, b = c.nodes
    assert len(list(iter_members(b.status()))) == 1  # alone: no mDNS, no bootstrap
    b.settings = merge(b.settings, {"cluster": {"bootstrap": [c.address(a)]}})
    b.write_config()
    b.signal(1)  # SIGHUP
    agreed, _ = c.wait_agreement(timeout=AGREE_S)
    assert len(agreed["alive"]) == 2
    assert "SIGHUP: added bootstrap addresses" in b.log_text()


@pytest.mark.slow
def test_init_then_join_with_a_token(make_cluster: Callable[..., Cluster],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The production path: daemons without credentials, `fusionctl init` on one, `fusionctl
    join TOKEN` on the others (certificate issued over the peer port, CA pinned by the token)."""
    import json

    from fusionctl.cli import run as fusionctl

    c = make_cluster(3, credentials=False)  # TLS mode without certificates: "unconfigured"
    c.start()
    c.wait_for(lambda: (all((n.status(1.0) or {}).get("node", {}).get("phase")
                            == "unconfigured" for n in c.nodes), "starting"), 30, "start")
    a, b, third = c.nodes
    assert fusionctl(["--socket", a.socket, "init", "--one-time", "--json"]) == 0
    token = json.loads(capsys.readouterr().out)["token"]
    assert fusionctl(["--socket", b.socket, "join", token]) == 0
    assert "joined cluster c" in capsys.readouterr().out
    assert fusionctl(["--socket", b.socket, "join", token]) == 0  # idempotent
    assert "already a member" in capsys.readouterr().out
    # the token was one-time: a third node cannot use it, and is told why
    assert fusionctl(["--socket", third.socket, "join", token]) == 1
    assert "already used" in capsys.readouterr().err
    agreed, _ = c.wait_agreement([a, b], timeout=AGREE_S)
    assert len(agreed["alive"]) == 2
    st = a.status()
    assert st is not None and st["node"]["security"] == "tls"
