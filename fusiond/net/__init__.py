"""fusiond.net: peer links (two lanes, backpressure, mutual TLS), the cluster PKI and joining.

    net = PeerNetwork(node_id=..., cluster_id=..., listen=("0.0.0.0", 7470), tls=material,
                      handler=on_message, config=NetConfig())
    await net.start(); await net.ready()
    await net.send(peer_id, Heartbeat(...))       # CONTROL lane
    await net.send(peer_id, Forward(...), enc.buffers())   # BULK lane, payload not copied

docs/security.md describes the trust model, the join exchange and plaintext mode.
"""

from fusiond.net.join import JoinFailed, JoinResult, join_cluster
from fusiond.net.pki import (
    ClusterCA,
    JoinAuthority,
    JoinToken,
    JoinTokenError,
    NodeIdentity,
    PKIError,
    TLSMaterial,
    create_cluster_ca,
    init_cluster,
    load_cluster_ca,
    load_or_create_node_identity,
    make_join_token,
    node_id_from_public_key,
    parse_join_token,
)
from fusiond.net.transport import (
    NetConfig,
    NetCounts,
    PeerNetwork,
    PeerRefused,
    PeerStats,
    PeerUnreachable,
    UnknownPeer,
)
from protocol.messages import Lane

__all__ = [
    "ClusterCA",
    "JoinAuthority",
    "JoinFailed",
    "JoinResult",
    "JoinToken",
    "JoinTokenError",
    "Lane",
    "NetConfig",
    "NetCounts",
    "NodeIdentity",
    "PKIError",
    "PeerNetwork",
    "PeerRefused",
    "PeerStats",
    "PeerUnreachable",
    "TLSMaterial",
    "UnknownPeer",
    "create_cluster_ca",
    "init_cluster",
    "join_cluster",
    "load_cluster_ca",
    "load_or_create_node_identity",
    "make_join_token",
    "node_id_from_public_key",
    "parse_join_token",
]
