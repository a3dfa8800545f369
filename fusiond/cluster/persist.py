"""The election's term and vote on disk, so a restarted node never votes twice in one term.

Raft's rule: a node makes its term and its vote durable before it answers (a VoteRequest,
or its own campaign's requests). The file is small JSON written to a temporary name, fsynced
and renamed over the old one, so a crash leaves either the old or the new state, never a torn
one. It names the cluster and node it belongs to; a file of another cluster or node (a state
directory reused after `fusionctl init`) is ignored with a warning.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from fusiond.cluster.errors import ClusterError

VERSION = 1


class ElectionStateError(ClusterError):
    """The persisted election state is unreadable or malformed (the message names the file)."""


@dataclass(frozen=True)
class ElectionState:
    """The durable part of the election: the current term and whom we voted for in it."""

    term: int = 0
    voted_for: str | None = None


def load_election_state(path: Path, *, cluster_id: str, node_id: str) -> ElectionState | None:
    """The state persisted at `path` for this cluster and node; None if there is none (no file,
    or one of another cluster or node). ElectionStateError if it cannot be read or parsed."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ElectionStateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ElectionStateError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ElectionStateError(f"{path}: expected a JSON object")
    if data.get("version") != VERSION:
        raise ElectionStateError(f"{path}: version {data.get('version')!r}, expected {VERSION}")
    if data.get("cluster_id") != cluster_id or data.get("node_id") != node_id:
        return None
    term, voted_for = data.get("term"), data.get("voted_for")
    if isinstance(term, bool) or not isinstance(term, int) or term < 0:
        raise ElectionStateError(f"{path}: term must be an integer >= 0, got {term!r}")
    if voted_for is not None and not isinstance(voted_for, str):
        raise ElectionStateError(f"{path}: voted_for must be a string or null, got "
                                 f"{voted_for!r}")
    return ElectionState(term, voted_for)


def save_election_state(path: Path, state: ElectionState, *, cluster_id: str,
                        node_id: str) -> None:
    """Durably replace the state at `path` (temporary file, fsync, rename, fsync of the
    directory). OSError propagates."""
    body = json.dumps({"version": VERSION, "cluster_id": cluster_id, "node_id": node_id,
                       "term": state.term, "voted_for": state.voted_for}).encode()
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(body)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open a directory: the rename is still atomic
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
