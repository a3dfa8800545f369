"""Version negotiation and the connection handshake, sans-IO.

The connecting side (CLIENT) sends Hello with its version range; the accepting side (SERVER)
answers HelloAck with the highest version both speak, or Refuse naming both ranges (or the
cluster mismatch). Both then pin their FrameDecoder to the agreed version and encode every
later frame with it. Authentication is the transport's business (mutual TLS); this machine
only checks versions and the cluster id.

    client = Handshake(Role.CLIENT, node_id="a", cluster_id="c")
    send(client.start())                       # Hello
    server = Handshake(Role.SERVER, node_id="b", cluster_id="c")
    reply = server.receive(hello)              # HelloAck (or Refuse: send it, then close)
    client.receive(reply)                      # ESTABLISHED; raises HandshakeRefused on Refuse
    client.version == server.version
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.messages import Address, Hello, HelloAck, Message, Refuse


class HandshakeRefused(RemoteProtocolError):
    """The handshake failed: the peer refused us, or we refused the peer.

    `code` is the Refuse code ("version", "cluster", "protocol", ...); `refuse` is the
    Refuse message (received, or the one we must send before closing).
    """

    def __init__(self, refuse: Refuse, *, by_peer: bool) -> None:
        who = "peer refused the connection" if by_peer else "refused the peer"
        super().__init__(f"{who} ({refuse.code}): {refuse.reason}")
        self.refuse = refuse
        self.code = refuse.code
        self.by_peer = by_peer


def negotiate_version(local_min: int, local_max: int, peer_min: int, peer_max: int) -> int | None:
    """The highest version in both ranges [min, max], or None if they do not overlap.

    An inverted range (min > max) never overlaps anything.
    """
    high = min(local_max, peer_max)
    low = max(local_min, peer_min)
    if local_min > local_max or peer_min > peer_max or high < low:
        return None
    return high


def version_refusal(
    local_min: int,
    local_max: int,
    peer_min: int,
    peer_max: int,
    *,
    local_name: str = "this node",
    peer_name: str = "the peer",
) -> Refuse:
    """The Refuse to send when `negotiate_version` found no common version (names both)."""
    return Refuse(
        code="version",
        reason=(
            f"no common protocol version: {local_name} speaks {local_min}..{local_max}, "
            f"{peer_name} speaks {peer_min}..{peer_max}"
        ),
        min_version=local_min,
        max_version=local_max,
        peer_min_version=peer_min,
        peer_max_version=peer_max,
    )


class Role(enum.Enum):
    CLIENT = "client"
    """Dialled the connection; speaks first."""
    SERVER = "server"
    """Accepted the connection; answers."""


class State(enum.Enum):
    START = "start"
    HELLO_SENT = "hello-sent"
    ESTABLISHED = "established"
    REFUSED = "refused"


class Handshake:
    """The handshake of one connection, as a small state machine with no I/O.

    CLIENT: `start()` -> Hello to send; `receive(HelloAck)` -> ESTABLISHED, returns None;
    `receive(Refuse)` raises HandshakeRefused (by_peer=True).
    SERVER: `receive(Hello)` -> the reply to send: HelloAck (ESTABLISHED) or Refuse (REFUSED;
    send it, then close; `refusal` holds the error to log).
    Any other message, or a message out of order, raises RemoteProtocolError; calling a
    method in the wrong role or state raises LocalProtocolError.
    """

    def __init__(
        self,
        role: Role,
        *,
        node_id: str,
        cluster_id: str,
        min_version: int = MIN_PROTOCOL_VERSION,
        max_version: int = PROTOCOL_VERSION,
        capabilities: Sequence[str] = (),
        address: Address | None = None,
    ) -> None:
        if not 0 < min_version <= max_version < 256:
            raise LocalProtocolError(f"bad version range {min_version}..{max_version}")
        self.role = role
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.min_version = min_version
        self.max_version = max_version
        self.capabilities = tuple(capabilities)
        self.address = address
        self.state = State.START
        self.version: int | None = None
        """The agreed version, once ESTABLISHED."""
        self.peer_node_id: str | None = None
        self.peer_capabilities: tuple[str, ...] = ()
        self.peer_address: Address | None = None
        self.refusal: HandshakeRefused | None = None

    @property
    def established(self) -> bool:
        return self.state is State.ESTABLISHED

    def start(self) -> Hello:
        """CLIENT only: the Hello to send first."""
        if self.role is not Role.CLIENT or self.state is not State.START:
            raise LocalProtocolError(f"start() is for a CLIENT in START, not {self._where()}")
        self.state = State.HELLO_SENT
        return Hello(
            node_id=self.node_id,
            cluster_id=self.cluster_id,
            min_version=self.min_version,
            max_version=self.max_version,
            capabilities=self.capabilities,
            address=self.address,
        )

    def receive(self, msg: Message) -> Message | None:
        """Feed the peer's handshake message; returns the reply to send, if any."""
        if self.state in (State.ESTABLISHED, State.REFUSED):
            raise LocalProtocolError(f"handshake already finished ({self._where()})")
        if self.role is Role.SERVER:
            return self._server_receive(msg)
        if self.state is not State.HELLO_SENT:
            raise LocalProtocolError("CLIENT must call start() before receive()")
        if isinstance(msg, Refuse):
            self.state = State.REFUSED
            self.refusal = HandshakeRefused(msg, by_peer=True)
            raise self.refusal
        if not isinstance(msg, HelloAck):
            raise self._protocol_error(f"expected HelloAck or Refuse, got {type(msg).__name__}")
        if not self.min_version <= msg.version <= self.max_version:
            raise self._protocol_error(
                f"peer chose version {msg.version}, outside our {self.min_version}.."
                f"{self.max_version}"
            )
        if msg.cluster_id != self.cluster_id:
            raise self._protocol_error(
                f"peer is in cluster {msg.cluster_id!r}, we are in {self.cluster_id!r}"
            )
        self._establish(msg.version, msg.node_id, msg.capabilities, msg.address)
        return None

    def _server_receive(self, msg: Message) -> Message:
        if not isinstance(msg, Hello):
            return self._refuse(
                Refuse(
                    code="protocol",
                    reason=f"expected Hello, got {type(msg).__name__}",
                    min_version=self.min_version,
                    max_version=self.max_version,
                )
            )
        version = negotiate_version(
            self.min_version, self.max_version, msg.min_version, msg.max_version
        )
        if version is None:
            return self._refuse(
                version_refusal(
                    self.min_version,
                    self.max_version,
                    msg.min_version,
                    msg.max_version,
                    local_name=f"node {self.node_id!r}",
                    peer_name=f"node {msg.node_id!r}",
                )
            )
        if msg.cluster_id != self.cluster_id:
            return self._refuse(
                Refuse(
                    code="cluster",
                    reason=(
                        f"node {msg.node_id!r} is in cluster {msg.cluster_id!r}, "
                        f"this node is in {self.cluster_id!r}"
                    ),
                    min_version=self.min_version,
                    max_version=self.max_version,
                    peer_min_version=msg.min_version,
                    peer_max_version=msg.max_version,
                )
            )
        self._establish(version, msg.node_id, msg.capabilities, msg.address)
        return HelloAck(
            node_id=self.node_id,
            cluster_id=self.cluster_id,
            version=version,
            capabilities=self.capabilities,
            address=self.address,
        )

    def _establish(
        self, version: int, node_id: str, caps: tuple[str, ...], address: Address | None
    ) -> None:
        self.state = State.ESTABLISHED
        self.version = version
        self.peer_node_id = node_id
        self.peer_capabilities = caps
        self.peer_address = address

    def _refuse(self, refuse: Refuse) -> Refuse:
        self.state = State.REFUSED
        self.refusal = HandshakeRefused(refuse, by_peer=False)
        return refuse

    def _protocol_error(self, what: str) -> RemoteProtocolError:
        self.state = State.REFUSED
        return RemoteProtocolError(f"handshake: {what}")

    def _where(self) -> str:
        return f"{self.role.name} in {self.state.name}"
