"""Cluster PKI: the cluster CA, node identities and certificates, and join tokens.

Pure functions over files in a state directory; no networking (the join exchange lives in
`fusiond.net.join`). Keys are ECDSA P-256 (Python's `ssl` accepts them everywhere OpenSSL does).

Identities:
- node id    = "n" + first 20 hex digits of SHA-256(node public key, SubjectPublicKeyInfo DER)
- cluster id = "c" + first 20 hex digits of SHA-256(CA public key, SubjectPublicKeyInfo DER)
- CA fingerprint (what a join token pins) = SHA-256 of the CA certificate DER (32 bytes)

A node certificate carries the node id as its subject CN and as a DNS SAN, and the cluster id
as its subject O, so a TLS peer's identity can be read off the verified certificate.

Join tokens ("fusion1." + base64url(msgpack map)) carry the member addresses to contact, the CA
fingerprint to pin, a token id, an expiry, a one-time flag and a secret. The secret is
HMAC-SHA256(token key, id|expiry|one_time) where the token key is derived from the CA private
key, so any holder of the CA key can check a token without a token database (one-time tokens
additionally record their id as used). The joiner never sends the secret itself: it sends
HMAC(secret, its CSR), which binds the proof to its own key pair.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fusiond import durable
from fusiond.errors import ConfigError, LocalError, RemoteError

NODE_KEY_FILE = "node.key"
NODE_CERT_FILE = "node.crt"
CA_CERT_FILE = "ca.crt"
CA_KEY_FILE = "ca.key"
USED_TOKENS_FILE = "used-join-tokens.json"
TOKEN_PREFIX = "fusion1."
PRESENTATION_PREFIX = "fusion1p."

CA_VALIDITY = dt.timedelta(days=3650)
NODE_VALIDITY = dt.timedelta(days=825)
DEFAULT_TOKEN_TTL_S = 24 * 3600.0


class PKIError(LocalError):
    """Key or certificate material on this machine is missing, unreadable or inconsistent."""


class JoinTokenError(RemoteError):
    """A join token (or a proof made from one) is malformed, expired, used, or forged;
    `reason` says which in one word (`JOIN_REFUSAL_REASONS`: a metric's label)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


JOIN_REFUSAL_REASONS = ("invalid", "expired", "used", "malformed", "error")
"""Why a member refuses a join request: a token not of this cluster (bad proof), expired, a
one-time token already used, a malformed request (token presentation or CSR), or this
member could not check or sign it (`PKIError`)."""


# --------------------------------------------------------------------------------------------
# identities


def _spki_der(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def node_id_from_public_key(key: ec.EllipticCurvePublicKey) -> str:
    """The node id derived from a node's public key (stable for the key's lifetime)."""
    return "n" + hashlib.sha256(_spki_der(key)).hexdigest()[:20]


def cluster_id_from_public_key(key: ec.EllipticCurvePublicKey) -> str:
    """The cluster id derived from the cluster CA's public key."""
    return "c" + hashlib.sha256(_spki_der(key)).hexdigest()[:20]


def cert_fingerprint(cert: x509.Certificate) -> bytes:
    """SHA-256 of the certificate's DER encoding (what join tokens pin)."""
    return cert.fingerprint(hashes.SHA256())


def generate_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 private key."""
    return ec.generate_private_key(ec.SECP256R1())


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` durably, with mode 0600 from the first byte (never
    world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    durable.write_bytes(path, data, mode=0o600)


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    durable.write_bytes(path, data, mode=0o644)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise PKIError(f"cannot load private key {path}: {e}") from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PKIError(f"{path} is not an EC private key")
    return key


def load_cert(path: Path) -> x509.Certificate:
    """Load a PEM certificate, naming the file on failure."""
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as e:
        raise PKIError(f"cannot load certificate {path}: {e}") from e


@dataclass(frozen=True)
class NodeIdentity:
    """This node's key pair (persisted as `node.key`, 0600) and the node id derived from it."""

    key: ec.EllipticCurvePrivateKey
    node_id: str
    key_path: Path


def load_or_create_node_identity(state_dir: Path) -> NodeIdentity:
    """Load `state_dir/node.key`, creating it (0600) on first start; the id survives restarts."""
    path = Path(state_dir) / NODE_KEY_FILE
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise PKIError(f"{path} has mode {mode:o}; it must not be group/world accessible")
        key = _load_key(path)
    else:
        key = generate_key()
        _write_private(path, _key_pem(key))
    return NodeIdentity(key=key, node_id=node_id_from_public_key(key.public_key()), key_path=path)


# --------------------------------------------------------------------------------------------
# the cluster CA


@dataclass(frozen=True)
class ClusterCA:
    """The cluster certificate authority: only members holding `ca.key` can issue certificates."""

    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    cluster_id: str

    @property
    def fingerprint(self) -> bytes:
        return cert_fingerprint(self.cert)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def token_key(self) -> bytes:
        """The HMAC key for join tokens, derived from (never equal to) the CA private key."""
        d = self.key.private_numbers().private_value.to_bytes(32, "big")
        return hmac.new(d, b"fusion join token key v1", hashlib.sha256).digest()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def create_cluster_ca(state_dir: Path) -> ClusterCA:
    """Create a new cluster CA in `state_dir` (ca.key 0600, ca.crt). Refuses to overwrite one."""
    state = Path(state_dir)
    if (state / CA_KEY_FILE).exists() or (state / CA_CERT_FILE).exists():
        raise ConfigError(f"{state} already holds a cluster CA; refusing to overwrite it")
    key = generate_key()
    cluster_id = cluster_id_from_public_key(key.public_key())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, f"fusion cluster CA {cluster_id}"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, cluster_id),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(state / CA_KEY_FILE, _key_pem(key))
    _write_public(state / CA_CERT_FILE, cert.public_bytes(serialization.Encoding.PEM))
    return ClusterCA(key=key, cert=cert, cluster_id=cluster_id)


def load_cluster_ca(state_dir: Path) -> ClusterCA | None:
    """The CA in `state_dir` if this member holds its private key, else None."""
    state = Path(state_dir)
    if not (state / CA_KEY_FILE).exists():
        return None
    key = _load_key(state / CA_KEY_FILE)
    cert = load_cert(state / CA_CERT_FILE)
    if _spki_der(cert.public_key()) != _spki_der(key.public_key()):  # type: ignore[arg-type]
        raise PKIError(f"{state / CA_KEY_FILE} does not match {state / CA_CERT_FILE}")
    return ClusterCA(key=key, cert=cert, cluster_id=cluster_id_from_public_key(key.public_key()))


def cluster_id_of_ca_cert(cert: x509.Certificate) -> str:
    """The cluster id of a CA certificate (from its public key)."""
    pub = cert.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey):
        raise PKIError("the cluster CA certificate does not hold an EC key")
    return cluster_id_from_public_key(pub)


def make_csr(identity: NodeIdentity) -> bytes:
    """A PEM certificate signing request for this node (CN = node id); proves key possession."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id)]))
        .sign(identity.key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def issue_node_certificate(
    ca: ClusterCA, public_key: ec.EllipticCurvePublicKey
) -> x509.Certificate:
    """Sign a node certificate for `public_key`; the node id derives from the key, never asked."""
    node_id = node_id_from_public_key(public_key)
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, node_id),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, ca.cluster_id),
                ]
            )
        )
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + NODE_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )


def sign_csr(ca: ClusterCA, csr_pem: bytes) -> x509.Certificate:
    """Check a node's CSR (well-formed, self-signed, EC P-256) and issue its certificate."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as e:
        raise JoinTokenError(f"join request carries a malformed CSR: {e}") from e
    if not csr.is_signature_valid:
        raise JoinTokenError("join request CSR signature is invalid")
    pub = csr.public_key()
    if not isinstance(pub, ec.EllipticCurvePublicKey) or pub.curve.name != "secp256r1":
        raise JoinTokenError("join request CSR must hold an ECDSA P-256 key")
    return issue_node_certificate(ca, pub)


def node_id_of_cert(cert: x509.Certificate) -> str:
    """The node id a certificate was issued to (its CN), checked against its public key."""
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    pub = cert.public_key()
    if not cns or not isinstance(pub, ec.EllipticCurvePublicKey):
        raise PKIError("certificate has no CN or no EC key")
    cn = str(cns[0].value)
    if cn != node_id_from_public_key(pub):
        raise PKIError(f"certificate CN {cn!r} does not match its public key")
    return cn


def verify_issued_by(cert: x509.Certificate, ca_cert: x509.Certificate) -> None:
    """Raise PKIError unless `cert` is signed by `ca_cert` and valid now."""
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError) as e:
        raise PKIError(f"certificate is not issued by the cluster CA: {e}") from e
    except Exception as e:  # cryptography raises InvalidSignature (not a ValueError)
        raise PKIError(f"certificate signature does not verify against the cluster CA: {e}") from e
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise PKIError("certificate is not valid now")


@dataclass(frozen=True)
class TLSMaterial:
    """Paths of the PEM files a node needs for mutual TLS (see `fusiond.net.tls`)."""

    ca_cert: Path
    cert: Path
    key: Path

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> TLSMaterial:
        s = Path(state_dir)
        return cls(ca_cert=s / CA_CERT_FILE, cert=s / NODE_CERT_FILE, key=s / NODE_KEY_FILE)

    def exists(self) -> bool:
        return self.ca_cert.exists() and self.cert.exists() and self.key.exists()

    def cluster_id(self) -> str:
        return cluster_id_of_ca_cert(load_cert(self.ca_cert))

    def node_id(self) -> str:
        return node_id_of_cert(load_cert(self.cert))


def store_node_credentials(
    state_dir: Path, node_cert: x509.Certificate, ca_cert: x509.Certificate
) -> TLSMaterial:
    """Write node.crt and ca.crt into `state_dir` (the key is already there)."""
    s = Path(state_dir)
    _write_public(s / NODE_CERT_FILE, node_cert.public_bytes(serialization.Encoding.PEM))
    if not (s / CA_CERT_FILE).exists():
        _write_public(s / CA_CERT_FILE, ca_cert.public_bytes(serialization.Encoding.PEM))
    elif cert_fingerprint(load_cert(s / CA_CERT_FILE)) != cert_fingerprint(ca_cert):
        raise PKIError(f"{s / CA_CERT_FILE} belongs to another cluster; refusing to replace it")
    return TLSMaterial.in_state_dir(s)


def init_cluster(state_dir: Path) -> tuple[ClusterCA, NodeIdentity, TLSMaterial]:
    """`fusionctl init`: create the CA, this node's key, and its certificate in `state_dir`."""
    ca = create_cluster_ca(state_dir)
    ident = load_or_create_node_identity(state_dir)
    cert = issue_node_certificate(ca, ident.key.public_key())
    return ca, ident, store_node_credentials(state_dir, cert, ca.cert)


# --------------------------------------------------------------------------------------------
# join tokens


@dataclass(frozen=True)
class JoinToken:
    """A parsed join token. `secret` never leaves the joining machine (only a proof does)."""

    addresses: tuple[tuple[str, int], ...]
    ca_fingerprint: bytes
    token_id: bytes
    expires: int
    one_time: bool
    secret: bytes


def _token_mac_input(token_id: bytes, expires: int, one_time: bool) -> bytes:
    flag = b"|1" if one_time else b"|0"
    return b"fusion join v1|" + token_id + b"|" + str(expires).encode() + flag


def make_join_token(
    ca: ClusterCA,
    addresses: list[tuple[str, int]],
    *,
    ttl_s: float = DEFAULT_TOKEN_TTL_S,
    one_time: bool = True,
    now: float | None = None,
) -> str:
    """A join token naming member `addresses` (that hold the CA key), valid for `ttl_s` seconds."""
    if not addresses:
        raise ConfigError("a join token must name at least one member address")
    token_id = secrets.token_bytes(12)
    expires = int((time.time() if now is None else now) + ttl_s)
    secret = hmac.new(
        ca.token_key(), _token_mac_input(token_id, expires, one_time), hashlib.sha256
    ).digest()
    body = {
        "a": [f"{h}:{p}" for h, p in addresses],
        "f": ca.fingerprint,
        "i": token_id,
        "e": expires,
        "o": one_time,
        "s": secret,
    }
    raw = msgpack.packb(body, use_bin_type=True)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _parse_addr(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise JoinTokenError(f"join token address {s!r} is not host:port")
    return host.strip("[]"), int(port)


def parse_join_token(token: str) -> JoinToken:
    """Parse a join token; raise JoinTokenError naming what is malformed."""
    token = token.strip()
    if not token.startswith(TOKEN_PREFIX):
        raise JoinTokenError(f"a join token starts with {TOKEN_PREFIX!r}")
    b64 = token[len(TOKEN_PREFIX) :]
    if len(b64) > 4096:
        raise JoinTokenError("join token is too long")
    try:
        raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        body = msgpack.unpackb(raw, raw=False, max_bin_len=1024, max_str_len=1024)
    except Exception as e:  # binascii.Error, msgpack's several exception types
        raise JoinTokenError(f"join token is not valid base64url msgpack: {e}") from e
    if not isinstance(body, dict):
        raise JoinTokenError("join token body is not a map")
    try:
        addrs = body["a"]
        fp, tid, exp, one, sec = body["f"], body["i"], body["e"], body["o"], body["s"]
    except KeyError as e:
        raise JoinTokenError(f"join token lacks field {e.args[0]!r}") from e
    if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
        raise JoinTokenError("join token field 'a' must be a non-empty list of host:port")
    if not (isinstance(fp, bytes) and len(fp) == 32):
        raise JoinTokenError("join token field 'f' must be a 32-byte CA fingerprint")
    if not (isinstance(tid, bytes) and 8 <= len(tid) <= 32):
        raise JoinTokenError("join token field 'i' must be an 8-32 byte id")
    if not isinstance(exp, int) or isinstance(exp, bool):
        raise JoinTokenError("join token field 'e' must be an integer expiry")
    if not isinstance(one, bool):
        raise JoinTokenError("join token field 'o' must be a boolean")
    if not (isinstance(sec, bytes) and len(sec) == 32):
        raise JoinTokenError("join token field 's' must be a 32-byte secret")
    return JoinToken(
        addresses=tuple(_parse_addr(a) for a in addrs),
        ca_fingerprint=fp,
        token_id=tid,
        expires=exp,
        one_time=one,
        secret=sec,
    )


def join_proof(secret: bytes, csr_pem: bytes) -> bytes:
    """The proof a joiner sends: binds knowledge of the token secret to its own CSR."""
    return hmac.new(secret, b"fusion join proof v1|" + csr_pem, hashlib.sha256).digest()


def present_token(token: JoinToken, csr_pem: bytes) -> str:
    """What a joiner puts in JoinRequest.token: id, expiry, one-time flag and the proof.

    The secret itself never leaves the joiner; the proof is bound to its CSR, so a member that
    is impersonated, or an eavesdropper, cannot reuse it for another key.
    """
    body = {
        "i": token.token_id,
        "e": token.expires,
        "o": token.one_time,
        "p": join_proof(token.secret, csr_pem),
    }
    raw = msgpack.packb(body, use_bin_type=True)
    return PRESENTATION_PREFIX + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _parse_presentation(s: str) -> tuple[bytes, int, bool, bytes]:
    if not s.startswith(PRESENTATION_PREFIX) or len(s) > 1024:
        raise JoinTokenError("join request does not carry a token presentation")
    b64 = s[len(PRESENTATION_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
        body = msgpack.unpackb(raw, raw=False, max_bin_len=256, max_str_len=256)
        tid, exp, one, proof = body["i"], body["e"], body["o"], body["p"]
    except Exception as e:  # binascii, msgpack, KeyError, TypeError: all mean "malformed"
        raise JoinTokenError(f"join request token presentation is malformed: {e}") from e
    if not (
        isinstance(tid, bytes)
        and isinstance(exp, int)
        and isinstance(one, bool)
        and isinstance(proof, bytes)
    ):
        raise JoinTokenError("join request token presentation has mistyped fields")
    return tid, exp, one, proof


class JoinAuthority:
    """Checks join requests and issues node certificates; lives on members holding the CA key.

    One-time token ids are recorded in `state_dir/used-join-tokens.json` (with their expiry, so
    the file is pruned as they lapse); a replayed one-time token is refused.
    """

    def __init__(self, ca: ClusterCA, state_dir: Path) -> None:
        self.ca = ca
        self._used_path = Path(state_dir) / USED_TOKENS_FILE

    def _load_used(self) -> dict[str, int]:
        try:
            data = json.loads(self._used_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise PKIError(f"cannot read {self._used_path}: {e}") from e
        if not isinstance(data, dict):
            raise PKIError(f"{self._used_path} is not a JSON object")
        return {str(k): int(v) for k, v in data.items()}

    def authorize(
        self,
        *,
        token_id: bytes,
        expires: int,
        one_time: bool,
        proof: bytes,
        csr_pem: bytes,
        now: float | None = None,
    ) -> x509.Certificate:
        """Verify the proof and expiry, spend a one-time token, and sign the CSR.

        Raises JoinTokenError (the caller refuses the joiner with its message).
        """
        t = time.time() if now is None else now
        secret = hmac.new(
            self.ca.token_key(), _token_mac_input(token_id, expires, one_time), hashlib.sha256
        ).digest()
        if not hmac.compare_digest(join_proof(secret, csr_pem), proof):
            raise JoinTokenError("join token is not valid for this cluster (bad proof)",
                                 "invalid")
        if t > expires:
            raise JoinTokenError(f"join token expired {int(t - expires)} s ago", "expired")
        cert = sign_csr(self.ca, csr_pem)
        if one_time:
            used = {k: v for k, v in self._load_used().items() if v >= t}
            key = token_id.hex()
            if key in used:
                raise JoinTokenError("join token was already used (it is one-time)", "used")
            used[key] = expires
            _write_private(self._used_path, json.dumps(used).encode())
        return cert

    def authorize_request(
        self, *, token: str, csr_pem: bytes, now: float | None = None
    ) -> x509.Certificate:
        """`authorize` for the `token` string of a JoinRequest (see `present_token`)."""
        tid, exp, one, proof = _parse_presentation(token)
        return self.authorize(
            token_id=tid, expires=exp, one_time=one, proof=proof, csr_pem=csr_pem, now=now
        )
