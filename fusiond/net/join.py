"""The joining side of `fusionctl join TOKEN`: trade a join token for a node certificate.

The joiner has no certificate and no CA yet, only the CA fingerprint the token pins. It dials a
member the token names over TLS (encryption only at the TLS layer: `tls.join_client_context`),
sends one JoinRequest (its CSR and a proof bound to that CSR; never the token secret), and
reads one JoinResponse. Before storing anything it checks, itself:
- SHA-256 of the returned CA certificate equals the pinned fingerprint;
- the member's TLS server certificate was issued by that CA (so it talked to a member);
- the returned node certificate was issued by that CA, for its own public key.
Only then are node.crt and ca.crt written to the state directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from fusiond.errors import RemoteError, describe
from fusiond.net import tls as tlsmod
from fusiond.net.pki import (
    JoinTokenError,
    PKIError,
    TLSMaterial,
    cert_fingerprint,
    load_or_create_node_identity,
    make_csr,
    node_id_of_cert,
    parse_join_token,
    present_token,
    store_node_credentials,
    verify_issued_by,
)
from protocol.errors import ProtocolError
from protocol.frames import FrameDecoder
from protocol.limits import DEFAULT_LIMITS
from protocol.messages import JoinRequest, JoinResponse, decode_message, encode_message

log = logging.getLogger("fusiond.net.join")


class JoinFailed(RemoteError):
    """No member named by the token gave us a certificate; the message lists each reason."""


@dataclass(frozen=True)
class JoinResult:
    """What a successful join stored and learned."""

    tls: TLSMaterial
    node_id: str
    cluster_id: str
    member: tuple[str, int]
    """The member that issued the certificate."""
    bootstrap: tuple[tuple[str, int], ...]
    """Member addresses to dial first (the token's, plus what the member suggested)."""


async def _exchange(
    address: tuple[str, int], request: JoinRequest, timeout_s: float
) -> tuple[JoinResponse, bytes]:
    """One JoinRequest/JoinResponse over TLS; returns the response and the server cert DER."""
    host, port = address
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(
            host, port, ssl=tlsmod.join_client_context(), server_hostname=host,
            ssl_handshake_timeout=timeout_s,
        ),
        timeout_s,
    )
    try:
        sslobj = writer.get_extra_info("ssl_object")
        server_der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        if not server_der:
            raise JoinFailed(f"{host}:{port} presented no TLS certificate")
        writer.writelines(encode_message(request, limits=DEFAULT_LIMITS.for_preauth()))
        await writer.drain()
        decoder = FrameDecoder(DEFAULT_LIMITS.for_preauth())  # a stranger's answer: small
        async with asyncio.timeout(timeout_s):
            while True:
                data = await reader.read(65536)
                if not data:
                    raise JoinFailed(f"{host}:{port} closed the connection without an answer")
                frames = decoder.feed(data)
                if frames:
                    msg = decode_message(frames[0])
                    if not isinstance(msg, JoinResponse):
                        raise JoinFailed(
                            f"{host}:{port} answered with {type(msg).__name__}: "
                            f"{getattr(msg, 'reason', '')}"
                        )
                    return msg, server_der
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def join_cluster(
    token: str, state_dir: Path, *, timeout_s: float = 10.0, hostname: str = ""
) -> JoinResult:
    """Obtain a node certificate with `token` from any member it names; store it in state_dir.

    Idempotent for the same cluster: the node key in `state_dir` is reused. Raises
    JoinTokenError for a malformed token, JoinFailed when every member refused or failed.
    """
    tok = parse_join_token(token)
    ident = load_or_create_node_identity(state_dir)
    csr = make_csr(ident)
    request = JoinRequest(
        request_id=secrets.randbits(63),
        token=present_token(tok, csr),
        node_id=ident.node_id,
        csr=csr,
        hostname=hostname,
    )
    errors: list[str] = []
    for address in tok.addresses:
        try:
            resp, server_der = await _exchange(address, request, timeout_s)
        except (OSError, TimeoutError, ssl.SSLError, ProtocolError, JoinFailed) as e:
            errors.append(f"{address[0]}:{address[1]}: {describe(e)}")
            continue
        if not resp.ok:
            errors.append(f"{address[0]}:{address[1]}: {resp.reason}")
            continue
        try:
            ca = x509.load_pem_x509_certificate(resp.ca_certificate)
            cert = x509.load_pem_x509_certificate(resp.certificate)
        except ValueError as e:
            errors.append(f"{address[0]}:{address[1]}: malformed certificate: {e}")
            continue
        if cert_fingerprint(ca) != tok.ca_fingerprint:
            errors.append(
                f"{address[0]}:{address[1]}: its CA does not match the token's fingerprint "
                "(not a member of this cluster, or someone in between)"
            )
            continue
        try:
            verify_issued_by(x509.load_der_x509_certificate(server_der), ca)
            verify_issued_by(cert, ca)
            if node_id_of_cert(cert) != ident.node_id:
                raise PKIError("the issued certificate is not for this node's key")
        except PKIError as e:
            errors.append(f"{address[0]}:{address[1]}: {e}")
            continue
        material = store_node_credentials(state_dir, cert, ca)
        cluster_id = material.cluster_id()
        bootstrap = tuple(dict.fromkeys((*tok.addresses, *resp.bootstrap)))
        log.info("joined cluster %s as node %s via %s:%s", cluster_id, ident.node_id, *address)
        return JoinResult(material, ident.node_id, cluster_id, address, bootstrap)
    raise JoinFailed("join failed; " + "; ".join(errors))


__all__ = ["JoinFailed", "JoinResult", "JoinTokenError", "join_cluster"]
