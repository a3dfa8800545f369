"""Cluster PKI: identities, certificates, join tokens and their proofs (no networking)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from cryptography.x509.oid import NameOID

from fusiond.errors import ConfigError
from fusiond.net.pki import (
    JoinAuthority,
    JoinTokenError,
    PKIError,
    TLSMaterial,
    create_cluster_ca,
    init_cluster,
    load_cluster_ca,
    load_or_create_node_identity,
    make_csr,
    make_join_token,
    node_id_of_cert,
    parse_join_token,
    present_token,
    verify_issued_by,
)


def test_node_identity_persists_with_private_mode(tmp_path: Path) -> None:
    a = load_or_create_node_identity(tmp_path)
    b = load_or_create_node_identity(tmp_path)
    assert a.node_id == b.node_id and a.node_id.startswith("n") and len(a.node_id) == 21
    assert stat.S_IMODE((tmp_path / "node.key").stat().st_mode) == 0o600
    assert load_or_create_node_identity(tmp_path / "other").node_id != a.node_id


def test_world_readable_key_is_refused(tmp_path: Path) -> None:
    load_or_create_node_identity(tmp_path)
    (tmp_path / "node.key").chmod(0o644)
    with pytest.raises(PKIError, match="644"):
        load_or_create_node_identity(tmp_path)


def test_init_cluster_issues_a_certificate_for_the_node(tmp_path: Path) -> None:
    ca, ident, material = init_cluster(tmp_path)
    assert material == TLSMaterial.in_state_dir(tmp_path) and material.exists()
    assert material.node_id() == ident.node_id
    assert material.cluster_id() == ca.cluster_id
    assert stat.S_IMODE((tmp_path / "ca.key").stat().st_mode) == 0o600
    loaded = load_cluster_ca(tmp_path)
    assert loaded is not None and loaded.cluster_id == ca.cluster_id
    with pytest.raises(ConfigError, match="already"):
        create_cluster_ca(tmp_path)
    assert load_cluster_ca(tmp_path / "nothing") is None


def test_token_round_trip_and_proof(tmp_path: Path) -> None:
    ca = create_cluster_ca(tmp_path / "ca")
    token = make_join_token(ca, [("127.0.0.1", 7470), ("::1", 7471)], ttl_s=60)
    assert token.startswith("fusion1.") and len(token) < 300
    tok = parse_join_token(token)
    assert tok.addresses == (("127.0.0.1", 7470), ("::1", 7471))
    assert tok.ca_fingerprint == ca.fingerprint and tok.one_time
    ident = load_or_create_node_identity(tmp_path / "joiner")
    csr = make_csr(ident)
    auth = JoinAuthority(ca, tmp_path / "ca")
    cert = auth.authorize_request(token=present_token(tok, csr), csr_pem=csr)
    verify_issued_by(cert, ca.cert)
    assert node_id_of_cert(cert) == ident.node_id
    org = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value
    assert org == ca.cluster_id
    with pytest.raises(JoinTokenError, match="already used"):
        auth.authorize_request(token=present_token(tok, csr), csr_pem=csr)


def test_reusable_token(tmp_path: Path) -> None:
    ca = create_cluster_ca(tmp_path)
    tok = parse_join_token(make_join_token(ca, [("h", 1)], one_time=False))
    auth = JoinAuthority(ca, tmp_path)
    for name in ("x", "y"):
        csr = make_csr(load_or_create_node_identity(tmp_path / name))
        auth.authorize_request(token=present_token(tok, csr), csr_pem=csr)


def test_expired_forged_and_rebound_tokens_refused(tmp_path: Path) -> None:
    ca = create_cluster_ca(tmp_path / "ca")
    auth = JoinAuthority(ca, tmp_path / "ca")
    csr = make_csr(load_or_create_node_identity(tmp_path / "j"))
    old = parse_join_token(make_join_token(ca, [("h", 1)], ttl_s=10, now=time.time() - 100))
    with pytest.raises(JoinTokenError, match="expired"):
        auth.authorize_request(token=present_token(old, csr), csr_pem=csr)
    # Extending the expiry without the CA's key breaks the proof.
    tok = parse_join_token(make_join_token(ca, [("h", 1)]))
    forged = type(tok)(tok.addresses, tok.ca_fingerprint, tok.token_id, tok.expires + 10**6,
                       tok.one_time, tok.secret)
    with pytest.raises(JoinTokenError, match="bad proof"):
        auth.authorize_request(token=present_token(forged, csr), csr_pem=csr)
    # A token from another cluster's CA.
    other = create_cluster_ca(tmp_path / "other")
    foreign = parse_join_token(make_join_token(other, [("h", 1)]))
    with pytest.raises(JoinTokenError, match="bad proof"):
        auth.authorize_request(token=present_token(foreign, csr), csr_pem=csr)
    # A proof made for one CSR cannot be replayed with another key's CSR.
    csr2 = make_csr(load_or_create_node_identity(tmp_path / "k"))
    with pytest.raises(JoinTokenError, match="bad proof"):
        auth.authorize_request(token=present_token(tok, csr), csr_pem=csr2)


@pytest.mark.parametrize(
    "bad",
    ["", "fusion1.", "fusion2.AAAA", "fusion1.!!!!", "fusion1.kA", "fusion1." + "A" * 5000],
)
def test_malformed_tokens(bad: str) -> None:
    with pytest.raises(JoinTokenError):
        parse_join_token(bad)


def test_malformed_presentations(tmp_path: Path) -> None:
    ca = create_cluster_ca(tmp_path)
    auth = JoinAuthority(ca, tmp_path)
    csr = make_csr(load_or_create_node_identity(tmp_path / "j"))
    for bad in ["", "fusion1p.", "fusion1p.gA", "fusion1.abc"]:
        with pytest.raises(JoinTokenError):
            auth.authorize_request(token=bad, csr_pem=csr)
    tok = parse_join_token(make_join_token(ca, [("h", 1)]))
    with pytest.raises(JoinTokenError, match="CSR"):
        auth.authorize_request(token=present_token(tok, b"junk"), csr_pem=b"junk")
