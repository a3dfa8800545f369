"""Cluster state on disk: the election's term and vote, and the member list.

- ``election.json``: Raft's rule, a node makes its term and its vote durable before it answers
  (a VoteRequest, or its own campaign's requests), so a restarted node never votes twice in
  one term. A term above MAX_TERM (written by the old overflow bug) is refused on load.
- ``members.json``: every member this node knew, with its last signed header and its
  credential (node certificate), the operator removals, and the voter set, so a restarted node
  counts the voters it knew and never takes itself for a majority of one.

Both are small JSON written to a temporary name, fsynced and renamed over the old one, so a
crash leaves either the old or the new state, never a torn one. Each names the cluster and
node it belongs to; a file of another cluster or node (a state directory reused after
`fusionctl init`) is ignored. Everything read is validated and bounded.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fusiond import durable
from fusiond.cluster.election import MAX_TERM
from fusiond.cluster.errors import ClusterError

VERSION = 1
MEMBERS_VERSION = 1
MAX_MEMBERS_FILE_BYTES = 64 << 20


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
    if term > MAX_TERM:
        raise ElectionStateError(f"{path}: term {term} is absurd (above {MAX_TERM}; a peer "
                                 "once could push one); starting from the cluster's term")
    if voted_for is not None and not isinstance(voted_for, str):
        raise ElectionStateError(f"{path}: voted_for must be a string or null, got "
                                 f"{voted_for!r}")
    return ElectionState(term, voted_for)


def save_election_state(path: Path, state: ElectionState, *, cluster_id: str,
                        node_id: str) -> None:
    """Durably replace the state at `path` (temporary file, fsync, rename, fsync of the
    directory). OSError propagates; ValueError for an absurd term (never written)."""
    if not 0 <= state.term <= MAX_TERM:
        raise ValueError(f"refusing to persist the absurd term {state.term}")
    body = json.dumps({"version": VERSION, "cluster_id": cluster_id, "node_id": node_id,
                       "term": state.term, "voted_for": state.voted_for}).encode()
    _write_atomically(path, body)


def _write_atomically(path: Path, body: bytes) -> None:
    durable.write_bytes(path, body, mode=0o600)


# -- the member list ------------------------------------------------------------------------


class MembersStateError(ClusterError):
    """The persisted member list is unreadable or malformed (the message names the file)."""


@dataclass(frozen=True)
class StoredMember:
    """One member as persisted: its last signed header and its credential."""

    node_id: str
    address: tuple[str, int]
    incarnation: int
    heartbeat: int
    left: bool
    term: int
    signature: bytes = b""
    credential: bytes = b""


@dataclass(frozen=True)
class MembersState:
    """The member list, the operator removals, and the voter set (ids) at the time."""

    members: tuple[StoredMember, ...] = ()
    removals: Mapping[str, bytes] = field(default_factory=dict)
    voters: frozenset[str] = frozenset()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str) or len(value) > 16384:
        raise ValueError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64") from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TERM:
        raise ValueError(f"{what} must be an integer in 0..{MAX_TERM}, got {value!r}")
    return value


def _str(value: Any, what: str, limit: int = 253) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ValueError(f"{what} must be a non-empty string of at most {limit} characters")
    return value


def _member_from_json(m: Any) -> StoredMember:
    if not isinstance(m, dict):
        raise ValueError("a member must be a JSON object")
    address = m.get("address")
    if (not isinstance(address, list) or len(address) != 2
            or isinstance(address[1], bool) or not isinstance(address[1], int)
            or not 0 < address[1] < 65536):
        raise ValueError(f"member address must be [host, port], got {address!r}")
    left = m.get("left")
    if not isinstance(left, bool):
        raise ValueError("member 'left' must be true or false")
    return StoredMember(
        node_id=_str(m.get("node_id"), "member node_id", 64),
        address=(_str(address[0], "member host"), address[1]),
        incarnation=_int(m.get("incarnation"), "member incarnation"),
        heartbeat=_int(m.get("heartbeat"), "member heartbeat"),
        left=left,
        term=_int(m.get("term"), "member term"),
        signature=_unb64(m.get("signature", ""), "member signature"),
        credential=_unb64(m.get("credential", ""), "member credential"),
    )


def load_members_state(path: Path, *, cluster_id: str, node_id: str,
                       max_members: int) -> MembersState | None:
    """The member list persisted at `path` for this cluster and node; None if there is none
    (no file, or one of another cluster or node). MembersStateError if it cannot be read, is
    malformed, or holds more than `max_members` members."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_MEMBERS_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise MembersStateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_MEMBERS_FILE_BYTES:
        raise MembersStateError(f"{path}: larger than {MAX_MEMBERS_FILE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MembersStateError(f"{path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MembersStateError(f"{path}: expected a JSON object")
    if data.get("version") != MEMBERS_VERSION:
        raise MembersStateError(f"{path}: version {data.get('version')!r}, expected "
                                f"{MEMBERS_VERSION}")
    if data.get("cluster_id") != cluster_id or data.get("node_id") != node_id:
        return None
    members, removals, voters = data.get("members"), data.get("removals"), data.get("voters")
    if not isinstance(members, list) or not isinstance(removals, dict) or not isinstance(
            voters, list):
        raise MembersStateError(f"{path}: members and voters must be lists, removals a map")
    if len(members) > max_members or len(removals) > max_members or len(voters) > max_members:
        raise MembersStateError(f"{path}: more than {max_members} members (cluster.max_members)")
    try:
        stored = tuple(_member_from_json(m) for m in members)
        gone = {_str(k, "removed node id", 64): _unb64(v, "removal signature")
                for k, v in removals.items()}
        voter_ids = frozenset(_str(v, "voter id", 64) for v in voters)
    except ValueError as exc:
        raise MembersStateError(f"{path}: {exc}") from None
    known = {m.node_id for m in stored} | {node_id}
    if not voter_ids <= known:
        raise MembersStateError(f"{path}: voters {sorted(voter_ids - known)} are not members")
    return MembersState(stored, gone, voter_ids)


def save_members_state(path: Path, state: MembersState, *, cluster_id: str,
                       node_id: str) -> None:
    """Durably replace the member list at `path` (like save_election_state). OSError
    propagates."""
    members: Sequence[dict[str, Any]] = [
        {"node_id": m.node_id, "address": [m.address[0], m.address[1]],
         "incarnation": m.incarnation, "heartbeat": m.heartbeat, "left": m.left, "term": m.term,
         "signature": _b64(m.signature), "credential": _b64(m.credential)}
        for m in state.members]
    body = json.dumps({"version": MEMBERS_VERSION, "cluster_id": cluster_id,
                       "node_id": node_id, "members": members,
                       "removals": {k: _b64(v) for k, v in sorted(state.removals.items())},
                       "voters": sorted(state.voters)}, indent=1).encode()
    _write_atomically(path, body)
