"""Errors of the cluster service (discovery, membership, election)."""

from __future__ import annotations

from fusiond.errors import LocalError


class ClusterError(LocalError):
    """Root of the cluster service's errors."""


class DiscoveryError(ClusterError):
    """mDNS could not be started or this node could not be advertised; the message says why."""


class UnknownMemberError(ClusterError):
    """An operation named a node id that is not a member of this cluster."""


class TrustError(ClusterError):
    """A credential or signature did not verify (the message says which and why)."""


class NotAuthorizedError(ClusterError):
    """This node may not assert that (e.g. remove a member without the cluster CA key)."""
