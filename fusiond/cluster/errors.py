"""Errors of the cluster service (discovery, membership, election)."""

from __future__ import annotations

from fusiond.errors import LocalError


class ClusterError(LocalError):
    """Root of the cluster service's errors."""


class DiscoveryError(ClusterError):
    """mDNS could not be started or this node could not be advertised; the message says why."""


class UnknownMemberError(ClusterError):
    """An operation named a node id that is not a member of this cluster."""
