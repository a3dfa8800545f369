"""Signed cluster facts with the real cluster CA (fusiond.cluster.trust.X509Authority over
fusiond.net.pki certificates): what verifies, what does not, and what it costs."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from fusiond.cluster import NotAuthorizedError, Trust, TrustError, X509Authority
from fusiond.cluster.membership import Link, MemberRecord
from fusiond.cluster.service import record_from_wire, record_to_wire
from fusiond.cluster.trust import (
    body_digest,
    body_statement,
    entry_problem,
    header_statement,
    removal_statement,
)
from fusiond.net import pki
from protocol.frames import FrameDecoder
from protocol.messages import (
    Gossip,
    LinkMeasurement,
    MemberEntry,
    MemberState,
    NodeProfile,
    decode_message,
    encode_message,
)


def der(cert: object) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)  # type: ignore[attr-defined]


def node(tmp_path: Path, name: str, ca: pki.ClusterCA, operator: bool = False) -> Trust:
    ident = pki.load_or_create_node_identity(tmp_path / name)
    cert = pki.issue_node_certificate(ca, ident.key.public_key())
    return Trust(cluster_id=ca.cluster_id, node_id=ident.node_id, key=ident.key,
                 credential=der(cert), authority=X509Authority(ca.cert),
                 operator_key=ca.key if operator else None)


@pytest.fixture
def ca(tmp_path: Path) -> pki.ClusterCA:
    return pki.create_cluster_ca(tmp_path / "ca")


def test_a_members_header_verifies_only_unaltered_and_only_by_its_key(
        tmp_path: Path, ca: pki.ClusterCA) -> None:
    a, b = node(tmp_path, "a", ca), node(tmp_path, "b", ca)
    stmt = header_statement(ca.cluster_id, a.node_id, ("10.0.0.1", 7420), 5, 9, False, 3)
    sig = a.sign(stmt)
    b.learn(a.node_id, a.credential)
    assert b.verify_by(a.node_id, stmt, sig)
    for changed in (header_statement(ca.cluster_id, a.node_id, ("10.0.0.1", 7420), 5, 9, True, 3),
                    header_statement(ca.cluster_id, a.node_id, ("10.0.0.1", 7420), 5, 10, False, 3),
                    header_statement(ca.cluster_id, a.node_id, ("10.0.0.1", 7420), 5, 9, False, 99),
                    header_statement("c-other", a.node_id, ("10.0.0.1", 7420), 5, 9, False, 3)):
        assert not b.verify_by(a.node_id, changed, sig)
    # b's own key cannot speak for a, and a stranger's credential is unknown.
    assert not b.verify_by(a.node_id, stmt, b.sign(stmt))
    assert not b.verify_by("n-stranger", stmt, sig)


def test_credentials_must_come_from_the_cluster_ca_and_name_their_key(
        tmp_path: Path, ca: pki.ClusterCA) -> None:
    a, b = node(tmp_path, "a", ca), node(tmp_path, "b", ca)
    other = pki.create_cluster_ca(tmp_path / "other-ca")
    foreign = node(tmp_path, "f", other)
    with pytest.raises(TrustError, match=r"not issued by the cluster CA|does not verify"):
        b.learn(foreign.node_id, foreign.credential)
    with pytest.raises(TrustError, match="names node"):
        b.learn("n" + "0" * 20, a.credential)  # a's certificate under another id
    with pytest.raises(TrustError, match="not a DER certificate"):
        b.learn(a.node_id, b"garbage")
    assert not b.knows(foreign.node_id)
    # This node's own credential must be for its own key.
    ident = pki.load_or_create_node_identity(tmp_path / "a")
    with pytest.raises(TrustError, match=r"not for its key|names node"):
        Trust(cluster_id=ca.cluster_id, node_id=ident.node_id, key=ident.key,
              credential=b.credential, authority=X509Authority(ca.cert))


def test_removals_need_the_ca_key(tmp_path: Path, ca: pki.ClusterCA) -> None:
    op, member = node(tmp_path, "op", ca, operator=True), node(tmp_path, "m", ca)
    assert op.is_operator and not member.is_operator
    sig = op.sign_removal(member.node_id)
    assert member.verify_removal(member.node_id, sig)
    assert not member.verify_removal(op.node_id, sig)  # bound to the node it names
    with pytest.raises(NotAuthorizedError, match=r"ca\.key"):
        member.sign_removal(op.node_id)
    forged = member.sign(removal_statement(ca.cluster_id, op.node_id))
    assert not op.verify_removal(op.node_id, forged)


def test_support_signatures_name_term_leader_and_voter(tmp_path: Path,
                                                       ca: pki.ClusterCA) -> None:
    a, b = node(tmp_path, "a", ca), node(tmp_path, "b", ca)
    b.learn(a.node_id, a.credential)
    sig = a.sign_support(4, b.node_id)
    assert a.sign_support(4, b.node_id) is sig  # made once per term and leader
    assert b.verify_support(a.node_id, 4, b.node_id, sig)
    assert not b.verify_support(a.node_id, 5, b.node_id, sig)
    assert not b.verify_support(a.node_id, 4, a.node_id, sig)
    assert not b.verify_support(b.node_id, 4, b.node_id, sig)


def test_body_digest_survives_the_wire() -> None:

    profile = NodeProfile(gflops=12.5, cpu_count=4, memory_bytes=(1 << 64) - 1,
                          ops_disabled=("aten.relu", "aten.gelu"), labels={"rack": "r1"},
                          cpu_quota_cores=3)  # an int for a float field: encoded as a float
    links = {"b": Link(1e9, 0.002, 0.05, 1.7e9), "c": Link(0.0, 0.5)}
    rec = MemberRecord("a", ("h", 1), 1, 2, "alive", profile, links)
    entry = record_to_wire(rec)
    wire = b"".join(bytes(x) for x in encode_message(Gossip(sender="a", members=(entry,))))
    got = decode_message(FrameDecoder().feed(wire)[0])
    assert isinstance(got, Gossip)
    back = record_from_wire(got.members[0])
    assert got.members[0].profile is not None
    assert got.members[0].profile == profile and back.profile == profile
    assert body_digest(got.members[0].profile, back.links) == body_digest(profile, links)
    assert body_digest(profile, links) == body_digest(
        NodeProfile(gflops=12.5, cpu_count=4, memory_bytes=(1 << 64) - 1,
                    ops_disabled=("aten.relu", "aten.gelu"), labels={"rack": "r1"},
                    cpu_quota_cores=3.0), links)


def entry(**kw: object) -> MemberEntry:
    base: dict[str, object] = dict(node_id="n1", address=("10.0.0.1", 7420), incarnation=1,
                                   heartbeat=1, state=MemberState.ALIVE)
    base.update(kw)
    return MemberEntry(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "says"), [
    ({"heartbeat": 2**53}, "heartbeat"),
    ({"incarnation": 2**64 - 1}, "incarnation"),
    ({"term": 2**63}, "term"),
    ({"address": ("", 7)}, "address"),
    ({"address": ("h", 0)}, "address"),
    ({"address": ("h", 70000)}, "address"),
    ({"node_id": "x" * 65}, "node id"),
    ({"node_id": ""}, "node id"),
    ({"signature": b"s" * 200}, "signature"),
    ({"links": (LinkMeasurement(peer="b", bandwidth_bits_per_s=float("inf"), rtt_s=0.1),)}, "link"),
    ({"links": (LinkMeasurement(peer="b", bandwidth_bits_per_s=1.0, rtt_s=float("nan")),)}, "link"),
    ({"links": (LinkMeasurement(peer="b", bandwidth_bits_per_s=-1.0, rtt_s=0.1),)}, "link"),
])
def test_absurd_entries_are_named(kw: dict[str, object], says: str) -> None:
    assert says in entry_problem(entry(**kw), max_links=16)
    assert entry_problem(entry(), max_links=16) == ""


def test_sign_and_verify_cost_per_entry(tmp_path: Path, ca: pki.ClusterCA) -> None:
    """The figures in docs/cluster.md: one header signature per round (ours), one check per
    new header of each other member."""
    a, b = node(tmp_path, "a", ca), node(tmp_path, "b", ca)
    b.learn(a.node_id, a.credential)
    stmts = [header_statement(ca.cluster_id, a.node_id, ("10.0.0.1", 7420), 1, i, False, 3)
             for i in range(300)]
    t0 = time.perf_counter()
    sigs = [a.sign(s) for s in stmts]
    sign_s = (time.perf_counter() - t0) / len(stmts)
    t0 = time.perf_counter()
    assert all(b.verify_by(a.node_id, s, sig) for s, sig in zip(stmts, sigs, strict=True))
    verify_s = (time.perf_counter() - t0) / len(stmts)
    others = [node(tmp_path, f"c{i}", ca) for i in range(20)]
    t0 = time.perf_counter()
    for c in others:
        b.learn(c.node_id, c.credential)
    learn_s = (time.perf_counter() - t0) / len(others)
    body = body_statement(ca.cluster_id, a.node_id, 1, 1, body_digest(NodeProfile(gflops=1.0), {}))
    assert b.verify_by(a.node_id, body, a.sign(body))
    print(f"sign {sign_s * 1e6:.0f} us, verify {verify_s * 1e6:.0f} us per entry; "
          f"certificate check {learn_s * 1e6:.0f} us (once per member)")
    # Generous bounds (a loaded 2-core machine): what matters is that it is not milliseconds.
    assert sign_s < 2e-3 and verify_s < 2e-3
