"""`fusionctl join` end to end on loopback: a token buys a certificate, then mutual TLS."""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path

import msgpack
import pytest

from fusiond.net import JoinAuthority, JoinFailed, join_cluster, make_join_token
from fusiond.net.pki import JOIN_REFUSAL_REASONS, init_cluster, parse_join_token
from protocol.messages import Ping
from tests.net.conftest import Inbox, NetFactory


async def test_join_then_talk(tmp_path: Path, net_factory: NetFactory) -> None:
    ca, ident, material = init_cluster(tmp_path / "first")
    inbox = Inbox()
    first = await net_factory(ident.node_id, ca.cluster_id, tls=material, handler=inbox,
                              join_authority=JoinAuthority(ca, tmp_path / "first"))
    token = make_join_token(ca, [first.address])
    res = await join_cluster(token, tmp_path / "second", timeout_s=5)
    assert res.cluster_id == ca.cluster_id and res.member == first.address
    assert res.tls.node_id() == res.node_id and res.tls.exists()
    second = await net_factory(res.node_id, res.cluster_id, tls=res.tls)
    assert await second.connect(first.address) == ident.node_id
    await second.send(ident.node_id, Ping(request_id=1, sent_at=0.0))
    ((peer, _),) = await inbox.wait_for(1)
    assert peer == res.node_id
    # The token was one-time: a third machine cannot reuse it.
    with pytest.raises(JoinFailed, match="already used"):
        await join_cluster(token, tmp_path / "third", timeout_s=5)
    assert first.counts().join_refusals == {**dict.fromkeys(JOIN_REFUSAL_REASONS, 0), "used": 1}


async def test_invalid_and_expired_tokens_refused(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ca, ident, material = init_cluster(tmp_path / "first")
    first = await net_factory(ident.node_id, ca.cluster_id, tls=material,
                              join_authority=JoinAuthority(ca, tmp_path / "first"))
    expired = make_join_token(ca, [first.address], ttl_s=1, now=time.time() - 10)
    with caplog.at_level(logging.WARNING, "fusiond.net"), pytest.raises(JoinFailed, match="exp"):
        await join_cluster(expired, tmp_path / "x", timeout_s=5)
    assert any("refused join" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "x" / "node.crt").exists()
    # A token minted by another cluster's CA pins the wrong fingerprint and has a bad proof.
    other, _, _ = init_cluster(tmp_path / "other")
    with pytest.raises(JoinFailed, match="bad proof"):
        await join_cluster(make_join_token(other, [first.address]), tmp_path / "y", timeout_s=5)
    # /metrics: fusion_cluster_join_refusals_total{reason}
    assert first.counts().join_refusals == {**dict.fromkeys(JOIN_REFUSAL_REASONS, 0),
                                            "expired": 1, "invalid": 1}


async def test_joiner_rejects_a_member_of_another_cluster(
    tmp_path: Path, net_factory: NetFactory
) -> None:
    """A valid-looking response from a CA that does not match the pinned fingerprint."""
    ca1, _, _ = init_cluster(tmp_path / "real")
    ca2, ident2, m2 = init_cluster(tmp_path / "impostor")
    impostor = await net_factory(ident2.node_id, ca2.cluster_id, tls=m2,
                                 join_authority=JoinAuthority(ca2, tmp_path / "impostor"))
    # Build a token pinning ca1 but whose secret ca2 can verify (the impostor knows nothing of
    # ca1's key, so this is the best case for it): swap the fingerprint in a ca2 token.
    tok2 = make_join_token(ca2, [impostor.address])
    t = parse_join_token(tok2)
    body = {"a": [f"{h}:{p}" for h, p in t.addresses], "f": ca1.fingerprint, "i": t.token_id,
            "e": t.expires, "o": t.one_time, "s": t.secret}
    token = "fusion1." + base64.urlsafe_b64encode(msgpack.packb(body)).rstrip(b"=").decode()
    with pytest.raises(JoinFailed, match="fingerprint"):
        await join_cluster(token, tmp_path / "victim", timeout_s=5)
    assert not (tmp_path / "victim" / "node.crt").exists()


async def test_join_unreachable_member(tmp_path: Path) -> None:
    ca, _, _ = init_cluster(tmp_path / "first")
    with pytest.raises(JoinFailed, match=r"127\.0\.0\.1:9"):
        await join_cluster(make_join_token(ca, [("127.0.0.1", 9)]), tmp_path / "j", timeout_s=2)
