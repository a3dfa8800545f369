"""Mutual TLS peer links: members talk; anyone without the cluster's credentials is refused."""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest

from fusiond.net import PeerRefused, PeerUnreachable
from fusiond.net import tls as tlsmod
from fusiond.net.transport import TLS_REFUSAL_CHECKS
from protocol.messages import Hello, Ping, ProbeData, encode_message
from tests.net.conftest import Inbox, NetFactory, make_cluster, make_node, until


async def test_mutual_tls_exchange(tmp_path: Path, net_factory: NetFactory) -> None:
    ca = make_cluster(tmp_path)
    ida, ma = make_node(tmp_path, ca, "a")
    idb, mb = make_node(tmp_path, ca, "b")
    ia, ib = Inbox(), Inbox()
    a = await net_factory(ida, ca.cluster_id, tls=ma, handler=ia)
    b = await net_factory(idb, ca.cluster_id, tls=mb, handler=ib)
    assert not a.plaintext
    assert await a.connect(b.address) == idb
    data = memoryview(bytearray(range(256)) * 8192)  # 2 MiB: two chunks on the BULK lane
    await a.send(idb, ProbeData(probe_id=1, seq=0, count=1), [data])
    await a.send(idb, Ping(request_id=9, sent_at=0.0))
    items = await ib.wait_for(2)
    assert {type(m).__name__ for _, m in items} == {"ProbeData", "Ping"}
    probe = next(m for _, m in items if isinstance(m, ProbeData))
    assert bytes(probe.payload) == bytes(data)
    await b.send(ida, Ping(request_id=10, sent_at=0.0))  # b dials back over TLS
    ((peer, _),) = await ia.wait_for(1)
    assert peer == idb


async def test_peer_without_credentials_refused(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ca = make_cluster(tmp_path)
    idb, mb = make_node(tmp_path, ca, "b")
    ida, ma = make_node(tmp_path, ca, "a")
    ib = Inbox()
    b = await net_factory(idb, ca.cluster_id, tls=mb, handler=ib)
    plain = await net_factory("intruder", ca.cluster_id)
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        with pytest.raises(PeerUnreachable):
            await plain.connect(b.address)
        await until(lambda: any("TLS handshake failed" in r.getMessage() for r in caplog.records))
    await until(lambda: b.counts().tls_refusals["handshake"] == 1)  # /metrics counts it
    # A TLS client with no certificate that tries to speak (not join) is refused too.
    reader, writer = await asyncio.open_connection(
        *b.address, ssl=tlsmod.join_client_context(), server_hostname="x"
    )
    hello = Hello(node_id=ida, cluster_id=ca.cluster_id, min_version=1, max_version=1)
    writer.writelines(encode_message(hello))
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        async with asyncio.timeout(3):
            rest = await reader.read()
    writer.close()
    assert b"client certificate" in rest or rest == b""
    assert not ib.items
    # ... and b still serves a member.
    a = await net_factory(ida, ca.cluster_id, tls=ma)
    await a.connect(b.address)
    await a.send(idb, Ping(request_id=1, sent_at=0.0))
    await ib.wait_for(1)


async def test_certificate_from_another_cluster_refused(
    tmp_path: Path, net_factory: NetFactory
) -> None:
    ca1 = make_cluster(tmp_path / "one")
    ca2 = make_cluster(tmp_path / "two")
    idb, mb = make_node(tmp_path / "one", ca1, "b")
    idx, mx = make_node(tmp_path / "two", ca2, "x")
    b = await net_factory(idb, ca1.cluster_id, tls=mb)
    # Even claiming the right cluster id, a certificate from a foreign CA cannot connect.
    x = await net_factory(idx, ca1.cluster_id, tls=mx)
    assert b.counts().tls_refusals == dict.fromkeys(TLS_REFUSAL_CHECKS, 0)
    with pytest.raises((PeerUnreachable, PeerRefused)):
        await x.connect(b.address)
    # Each side refused the other's certificate in the handshake, and counted it.
    assert x.counts().tls_refusals["handshake"] == 1
    await until(lambda: b.counts().tls_refusals["handshake"] == 1)


async def test_member_cannot_impersonate_another_node(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ca = make_cluster(tmp_path)
    _ida, ma = make_node(tmp_path, ca, "a")
    idb, mb = make_node(tmp_path, ca, "b")
    ib = Inbox()
    b = await net_factory(idb, ca.cluster_id, tls=mb, handler=ib)
    liar = await net_factory("n" + "0" * 20, ca.cluster_id, tls=ma)  # a's cert, another id
    with caplog.at_level(logging.WARNING, "fusiond.net"), pytest.raises(PeerRefused):
        await liar.connect(b.address)
    assert any("does not match the certificate" in r.getMessage() for r in caplog.records)
    assert b.counts().tls_refusals == {**dict.fromkeys(TLS_REFUSAL_CHECKS, 0), "identity": 1}
    assert not ib.items


def test_contexts_require_tls13_and_client_certs(tmp_path: Path) -> None:
    ca = make_cluster(tmp_path)
    _, m = make_node(tmp_path, ca, "a")
    srv = tlsmod.server_context(m)
    assert srv.verify_mode is ssl.CERT_REQUIRED
    assert srv.minimum_version is ssl.TLSVersion.TLSv1_3
    assert tlsmod.server_context(m, allow_join=True).verify_mode is ssl.CERT_OPTIONAL
    assert tlsmod.client_context(m).verify_mode is ssl.CERT_REQUIRED


async def test_denied_member_is_refused_despite_valid_certificate(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    ca = make_cluster(tmp_path)
    ida, ma = make_node(tmp_path, ca, "a")
    idb, mb = make_node(tmp_path, ca, "b")
    ib = Inbox()
    a = await net_factory(ida, ca.cluster_id, tls=ma)
    b = await net_factory(idb, ca.cluster_id, tls=mb, handler=ib)
    await a.connect(b.address)
    await a.send(idb, Ping(request_id=1, sent_at=0.0))
    await ib.wait_for(1)
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        b.set_denied({ida})
        await until(lambda: b.stats()[ida].inbound == 0)
        with pytest.raises(PeerRefused, match="removed"):
            await a.connect(b.address)
    assert any("removed from the cluster" in r.getMessage() for r in caplog.records)
    assert b.counts().tls_refusals["removed"] == 1
    await b.send(ida, Ping(request_id=2, sent_at=0.0))  # dropped, never dialed
    assert b.stats()[ida].dropped == 1


async def test_join_enabled_member_admits_only_join_requests_without_a_cert(
    tmp_path: Path, net_factory: NetFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """CERT_OPTIONAL on a CA holder: no cert -> one JoinRequest only; a foreign cert -> no TLS."""
    from fusiond.net import JoinAuthority
    from fusiond.net.pki import init_cluster
    from protocol.frames import FrameDecoder
    from protocol.messages import Refuse, decode_message

    ca, ident, material = init_cluster(tmp_path / "m")
    ib = Inbox()
    b = await net_factory(ident.node_id, ca.cluster_id, tls=material, handler=ib,
                          join_authority=JoinAuthority(ca, tmp_path / "m"))
    reader, writer = await asyncio.open_connection(
        *b.address, ssl=tlsmod.join_client_context(), server_hostname="x"
    )
    hello = Hello(node_id=ident.node_id, cluster_id=ca.cluster_id, min_version=1, max_version=1)
    with caplog.at_level(logging.WARNING, "fusiond.net"):
        writer.writelines(encode_message(hello))
        async with asyncio.timeout(3):
            rest = await reader.read()
    writer.close()
    (frame,) = FrameDecoder().feed(rest)
    refusal = decode_message(frame)
    assert isinstance(refusal, Refuse) and refusal.code == "auth"
    assert "JoinRequest" in refusal.reason
    assert any("only a JoinRequest" in r.getMessage() for r in caplog.records)
    assert b.counts().tls_refusals["no_certificate"] == 1
    # A certificate from another CA fails the TLS handshake even though certs are optional.
    other = make_cluster(tmp_path / "other")
    idx, mx = make_node(tmp_path / "other", other, "x")
    x = await net_factory(idx, ca.cluster_id, tls=mx)
    with pytest.raises((PeerUnreachable, PeerRefused)):
        await x.connect(b.address)
    assert not ib.items
