"""TLS contexts for peer links: mutual TLS 1.3 with the cluster CA.

- `server_context(m, allow_join=...)`: the listener. With `allow_join`, a client certificate is
  OPTIONAL at the TLS layer; the transport then lets a connection without one send exactly one
  JoinRequest and closes it after the reply (see docs/security.md). A presented certificate must
  chain to the cluster CA or the TLS handshake fails.
- `client_context(m)`: dialing a member; the server's certificate must chain to the cluster CA.
  Hostnames are not checked (members are addressed by IP); the node id is read off the verified
  certificate and compared with the one the peer claims in Hello.
- `join_client_context()`: a joiner has no CA yet, only its fingerprint from the token; it
  accepts any server certificate at the TLS layer and verifies the chain to the pinned CA itself
  (`fusiond.net.join`) before it trusts anything the server sends.
"""

from __future__ import annotations

import ssl
from typing import Any

from cryptography import x509

from fusiond.net.pki import PKIError, TLSMaterial, node_id_of_cert


def _base(purpose: int) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def server_context(m: TLSMaterial, *, allow_join: bool = False) -> ssl.SSLContext:
    """The listener's context: our node certificate, client certificates verified by the CA."""
    ctx = _base(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(m.cert), str(m.key))
    ctx.load_verify_locations(cafile=str(m.ca_cert))
    ctx.verify_mode = ssl.CERT_OPTIONAL if allow_join else ssl.CERT_REQUIRED
    return ctx


def client_context(m: TLSMaterial) -> ssl.SSLContext:
    """Dialing a member: present our certificate, require theirs to chain to the cluster CA."""
    ctx = _base(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(str(m.cert), str(m.key))
    ctx.load_verify_locations(cafile=str(m.ca_cert))
    return ctx


def join_client_context() -> ssl.SSLContext:
    """Joiner without credentials: encryption only; the caller pins the CA by fingerprint."""
    ctx = _base(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def peer_node_id(ssl_object: Any) -> str | None:
    """The node id in the peer's verified certificate, or None when it presented none.

    `ssl_object` is the transport's `ssl_object` extra (ssl.SSLObject or uvloop's equivalent).
    """
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    try:
        return node_id_of_cert(x509.load_der_x509_certificate(der))
    except (PKIError, ValueError):
        return None
