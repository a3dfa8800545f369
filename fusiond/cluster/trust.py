"""Signed cluster facts: each member asserts only facts about itself, signed with its node key.

Every fact about a member that gossip relays is a *statement* the member signed with its own
ECDSA P-256 node key; a receiver checks the signature against the member's public key, which
it trusts only from a credential the cluster's authority issued (in a daemon: the member's
node certificate, signed by the cluster CA, whose CN is the node id derived from the key). A
relay can therefore forward a member's facts but not alter or invent them.

Statements (msgpack arrays, each tagged with its kind and the cluster id, so a signature for
one kind or one cluster is never valid for another):

- header  ``["fusion-member/1", cluster, node, host, port, incarnation, heartbeat, left, term]``:
  where the member listens, that it is alive (each heartbeat) or left, and the highest term it
  has seen. Signed by the member once per gossip round (and when its term changes).
- body    ``["fusion-body/2", cluster, node, incarnation, body_version, sha256(profile, links)]``:
  its profile (the `NodeProfile` schema's wire map) and measured links as of heartbeat
  `body_version`. Signed when they change. (`/1` covered the free-form profile map that
  travelled in `NodeProfile.extra`; a `/1` signature never verifies as `/2`.)
- support ``["fusion-support/1", cluster, term, leader, voter]``: `voter` supports `leader` as
  the scheduler of `term` (a granted vote, or an accepted leader heartbeat). A majority of
  them is a leader's proof.
- removal ``["fusion-removal/1", cluster, node]``: an operator removed `node` for good. Signed
  with the cluster CA key (the *operator key*): only a member holding ``ca.key`` can issue one.

`Trust` holds this node's key and credential, the authority, and a bounded cache of verified
credentials (node id -> public key). Nothing here does I/O; the service calls it.

Cost (cryptography/OpenSSL, this 2-core machine): sign 39 us, verify 70 us per statement;
docs/cluster.md has the per-round figures.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from fusiond.cluster.errors import NotAuthorizedError, TrustError
from protocol.messages import MemberEntry, NodeProfile

MAX_COUNTER = (1 << 53) - 1
"""Bound on every term, incarnation and heartbeat a peer may assert (exact in a float64 and in
JSON, and 285 000 years of milliseconds): a larger one is absurd and refused."""
MAX_NODE_ID_CHARS = 64
MAX_HOST_CHARS = 253
MAX_SIGNATURE_BYTES = 80
"""A DER ECDSA P-256 signature is at most 72 bytes."""
MAX_CREDENTIAL_BYTES = 4096
"""A node certificate is about 500 bytes (DER)."""
MAX_BODY_BYTES = 64 << 10
"""A member's profile and links, encoded (a 13-key profile with 48 links is about 3 KB)."""

_ECDSA = ec.ECDSA(hashes.SHA256())


def _pack(value: list[Any]) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def header_statement(cluster_id: str, node_id: str, address: tuple[str, int],
                     incarnation: int, heartbeat: int, left: bool, term: int) -> bytes:
    """The bytes a member signs for its header."""
    return _pack(["fusion-member/1", cluster_id, node_id, address[0], int(address[1]),
                  incarnation, heartbeat, bool(left), term])


def body_bytes(profile: NodeProfile, links: Mapping[str, tuple[float, ...]]) -> bytes:
    """A member's profile and links, canonically encoded: the profile as its schema writes it
    on the wire (fields in declaration order, each of its declared kind), so a receiver that
    decoded it re-encodes exactly the bytes the member signed."""
    return _pack([profile.to_wire(), [[peer, *link] for peer, link in sorted(links.items())]])


def body_digest(profile: NodeProfile, links: Mapping[str, tuple[float, ...]]) -> bytes:
    """SHA-256 of `body_bytes`: what a body signature covers."""
    return hashlib.sha256(body_bytes(profile, links)).digest()


def body_statement(cluster_id: str, node_id: str, incarnation: int, body_version: int,
                   digest: bytes) -> bytes:
    """The bytes a member signs for its body."""
    return _pack(["fusion-body/2", cluster_id, node_id, incarnation, body_version, digest])


def support_statement(cluster_id: str, term: int, leader: str, voter: str) -> bytes:
    """The bytes `voter` signs to support `leader` in `term`."""
    return _pack(["fusion-support/1", cluster_id, term, leader, voter])


def removal_statement(cluster_id: str, node_id: str) -> bytes:
    """The bytes the operator key signs to remove `node_id` for good."""
    return _pack(["fusion-removal/1", cluster_id, node_id])


class Authority(Protocol):
    """Who vouches for node keys and operator statements (the cluster CA in a daemon)."""

    def verify_credential(self, node_id: str,
                          credential: bytes) -> tuple[ec.EllipticCurvePublicKey, float]:
        """(the public key of `node_id`, Unix time the credential expires); TrustError unless
        the authority issued `credential` to `node_id` and it is valid now."""
        ...

    def verify_operator(self, statement: bytes, signature: bytes) -> bool:
        """Whether the operator key signed `statement`."""
        ...


def _verify(key: ec.EllipticCurvePublicKey, signature: bytes, statement: bytes) -> bool:
    try:
        key.verify(signature, statement, _ECDSA)
    except (InvalidSignature, ValueError):
        return False
    return True


class X509Authority:
    """The cluster CA: a credential is a node certificate (DER) it signed, for a P-256 key whose
    derived node id is the certificate's CN; operator statements are signed with the CA key."""

    def __init__(self, ca_cert: x509.Certificate) -> None:
        pub = ca_cert.public_key()
        if not isinstance(pub, ec.EllipticCurvePublicKey):
            raise TrustError("the cluster CA certificate does not hold an EC key")
        self._ca = ca_cert
        self._ca_key = pub

    def verify_credential(self, node_id: str,
                          credential: bytes) -> tuple[ec.EllipticCurvePublicKey, float]:
        from fusiond.net import pki

        try:
            cert = x509.load_der_x509_certificate(credential)
        except ValueError as e:
            raise TrustError(f"credential of {node_id} is not a DER certificate: {e}") from None
        try:
            pki.verify_issued_by(cert, self._ca)
            cn = pki.node_id_of_cert(cert)
        except pki.PKIError as e:
            raise TrustError(f"credential of {node_id}: {e}") from None
        if cn != node_id:
            raise TrustError(f"credential names node {cn}, not {node_id}")
        pub = cert.public_key()
        if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.name != "secp256r1":
            raise TrustError(f"credential of {node_id} does not hold a P-256 key")
        return pub, cert.not_valid_after_utc.timestamp()

    def verify_operator(self, statement: bytes, signature: bytes) -> bool:
        return _verify(self._ca_key, signature, statement)


@dataclass
class _Known:
    key: ec.EllipticCurvePublicKey
    credential: bytes
    expires_at: float


class Trust:
    """This node's signing key and credential, and what it has verified of the others'."""

    def __init__(self, *, cluster_id: str, node_id: str, key: ec.EllipticCurvePrivateKey,
                 credential: bytes, authority: Authority,
                 operator_key: ec.EllipticCurvePrivateKey | None = None,
                 max_known: int = 8192, clock: Callable[[], float] = time.time) -> None:
        """`operator_key`: the cluster CA key where this member holds it (it may then remove
        members). `max_known`: bound on cached credentials."""
        self.cluster_id = cluster_id
        self.node_id = node_id
        self._key = key
        self.credential = credential
        self._authority = authority
        self._operator_key = operator_key
        self._max_known = max_known
        self._clock = clock
        self._known: OrderedDict[str, _Known] = OrderedDict()
        self._support: tuple[int, str, bytes] | None = None
        pub, expires = authority.verify_credential(node_id, credential)  # our own must verify
        if _spki(pub) != _spki(key.public_key()):
            raise TrustError(f"this node's credential is not for its key ({node_id})")
        self._known[node_id] = _Known(pub, credential, expires)

    @property
    def is_operator(self) -> bool:
        """Whether this node holds the operator (cluster CA) key."""
        return self._operator_key is not None

    # -- signing (our own facts) -----------------------------------------------------------

    def sign(self, statement: bytes) -> bytes:
        """Sign `statement` with this node's key."""
        return self._key.sign(statement, _ECDSA)

    def sign_support(self, term: int, leader: str) -> bytes:
        """Our signed support of `leader` for `term` (made once per term and leader)."""
        if self._support is not None and self._support[:2] == (term, leader):
            return self._support[2]
        sig = self.sign(support_statement(self.cluster_id, term, leader, self.node_id))
        self._support = (term, leader, sig)
        return sig

    def sign_removal(self, node_id: str) -> bytes:
        """A removal of `node_id` signed with the operator key; NotAuthorizedError without it."""
        if self._operator_key is None:
            raise NotAuthorizedError(
                "only a member holding the cluster CA key (ca.key) can remove members: run "
                "`fusionctl remove` on the member where `fusionctl init` ran (or copy ca.key, "
                "mode 0600, to this one)")
        return self._operator_key.sign(removal_statement(self.cluster_id, node_id), _ECDSA)

    # -- credentials -------------------------------------------------------------------------

    def learn(self, node_id: str, credential: bytes) -> None:
        """Verify and cache `node_id`'s credential (a no-op for the one already cached);
        TrustError if it does not verify."""
        known = self._known.get(node_id)
        if known is not None and known.credential == credential:
            return
        if node_id == self.node_id:
            raise TrustError(f"a relay sent a credential for this node ({node_id}) other than "
                             "its own")
        if len(credential) > MAX_CREDENTIAL_BYTES:
            raise TrustError(f"credential of {node_id} is {len(credential)} bytes, limit "
                             f"{MAX_CREDENTIAL_BYTES}")
        pub, expires = self._authority.verify_credential(node_id, credential)
        self._known[node_id] = _Known(pub, credential, expires)
        self._known.move_to_end(node_id)
        while len(self._known) > self._max_known:
            oldest = next(iter(self._known))
            if oldest == self.node_id:
                self._known.move_to_end(oldest)
                continue
            del self._known[oldest]

    def credential_of(self, node_id: str) -> bytes | None:
        """The verified credential of `node_id`, or None."""
        known = self._known.get(node_id)
        return known.credential if known is not None else None

    def knows(self, node_id: str) -> bool:
        """Whether we hold a verified, unexpired credential of `node_id`."""
        return self._key_of(node_id) is not None

    def _key_of(self, node_id: str) -> ec.EllipticCurvePublicKey | None:
        known = self._known.get(node_id)
        if known is None:
            return None
        if self._clock() > known.expires_at:
            del self._known[node_id]
            return None
        return known.key

    # -- verifying (others' facts) -----------------------------------------------------------

    def verify_by(self, node_id: str, statement: bytes, signature: bytes) -> bool:
        """Whether `node_id` (credential known) signed `statement`."""
        key = self._key_of(node_id)
        if key is None or not signature or len(signature) > MAX_SIGNATURE_BYTES:
            return False
        return _verify(key, signature, statement)

    def verify_support(self, voter: str, term: int, leader: str, signature: bytes) -> bool:
        """Whether `voter` signed its support of `leader` for `term`."""
        return self.verify_by(voter, support_statement(self.cluster_id, term, leader, voter),
                              signature)

    def verify_removal(self, node_id: str, signature: bytes) -> bool:
        """Whether the operator key signed the removal of `node_id`."""
        if not signature or len(signature) > MAX_SIGNATURE_BYTES:
            return False
        return self._authority.verify_operator(removal_statement(self.cluster_id, node_id),
                                               signature)


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.DER,
                            serialization.PublicFormat.SubjectPublicKeyInfo)


def _finite_nonnegative(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and (
        math.isfinite(value) and value >= 0)


def entry_problem(entry: MemberEntry, *, max_links: int) -> str:
    """Why a gossip entry is malformed beyond what the schema checks ('' if it is not): every
    integer within MAX_COUNTER, a usable address, bounded ids, signatures and links, and
    finite non-negative link measurements. Such an entry is dropped, never merged."""
    nid = entry.node_id
    if not nid or len(nid) > MAX_NODE_ID_CHARS or not nid.isprintable():
        return f"node id {nid[:MAX_NODE_ID_CHARS]!r} is empty, too long or not printable"
    host, port = entry.address
    if not host or len(host) > MAX_HOST_CHARS or not 0 < port < 65536:
        return f"address {host[:MAX_HOST_CHARS]!r}:{port} is not a host and a port 1-65535"
    for name in ("incarnation", "heartbeat", "term", "body_version"):
        value = getattr(entry, name)
        if not 0 <= value <= MAX_COUNTER:
            return f"{name} {value} is outside 0..{MAX_COUNTER}"
    if len(entry.signature) > MAX_SIGNATURE_BYTES or len(
            entry.body_signature) > MAX_SIGNATURE_BYTES:
        return "signature too long"
    if len(entry.credential) > MAX_CREDENTIAL_BYTES:
        return f"credential is {len(entry.credential)} bytes, limit {MAX_CREDENTIAL_BYTES}"
    if len(entry.links) > max_links:
        return f"{len(entry.links)} links, limit {max_links}"
    for link in entry.links:
        if not link.peer or len(link.peer) > MAX_NODE_ID_CHARS:
            return "a link names no peer or a too long one"
        # Generic over the measurement's fields (whatever their names): every number is a
        # finite quantity >= 0. An infinite bandwidth once crashed every node's rank.
        for f in fields(link):
            value = getattr(link, f.name)
            if (isinstance(value, int | float) and not isinstance(value, bool)
                    and not _finite_nonnegative(value)):
                return f"link to {link.peer[:MAX_NODE_ID_CHARS]}: {f.name} = {value!r}"
    return ""


__all__ = [
    "MAX_COUNTER",
    "Authority",
    "NotAuthorizedError",
    "Trust",
    "TrustError",
    "X509Authority",
    "body_bytes",
    "body_digest",
    "body_statement",
    "entry_problem",
    "header_statement",
    "removal_statement",
    "support_statement",
]
