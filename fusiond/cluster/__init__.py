"""fusiond.cluster: discovery, gossip membership, link probes and scheduler election.

The daemon builds one `Cluster` on top of its PeerNetwork; see docs/cluster.md.
"""

from fusiond.cluster.election import rank_order
from fusiond.cluster.errors import (
    ClusterError,
    DiscoveryError,
    NotAuthorizedError,
    TrustError,
    UnknownMemberError,
)
from fusiond.cluster.service import Cluster, ClusterConfig, ClusterView, MemberView, Transport
from fusiond.cluster.trust import Trust, X509Authority

__all__ = [
    "Cluster",
    "ClusterConfig",
    "ClusterError",
    "ClusterView",
    "DiscoveryError",
    "MemberView",
    "NotAuthorizedError",
    "Transport",
    "Trust",
    "TrustError",
    "UnknownMemberError",
    "X509Authority",
    "rank_order",
]
