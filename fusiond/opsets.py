"""Which ops a node can run: its op set, its digest, and the checks a scheduler makes with it.

A node runs the ops of its torch's op registry (`fusiond.graph.registry.supported_ops`) less
the ones its operator disabled (`jobs.disabled_ops`: an op that is broken on that machine).
Nodes on different torch versions can have different registries, and a graph is captured with
the submitter's torch, so the scheduler must know every member's op set to place a stage only
where every op of it runs.

The profile a node gossips carries the set's digest (`ops_digest`: sha256 of the sorted names),
its size and the disabled names; the whole list (about 200 names, 4 kB) travels only on request
(`OpSetRequest`/`OpSetReply`, `fusiond.jobs.opsets`), once per digest, so gossip stays small.
Everything here is pure (no torch, no I/O): the digest, the validation of names and digests
from the network, and the check of a graph's ops against the members' sets.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.messages import NodeProfile

__all__ = [
    "DIGEST_RE",
    "MAX_OPS",
    "OP_NAME_RE",
    "OpSet",
    "check_op_names",
    "digest_of_profile",
    "lacking_ops",
    "ops_digest",
    "unrunnable_message",
]

OP_NAME_RE = re.compile(r"aten\.[A-Za-z0-9_]{1,96}\.[A-Za-z0-9_]{1,48}|sym\.[a-z_]{1,24}")
"""An IR op name: `aten.<name>.<overload>` or `sym.<op>` (docs/ir.md)."""
MAX_OPS = 4096
"""The most op names an op set may hold (torch 2.13.0's registry holds 223)."""
DIGEST_RE = re.compile(r"[0-9a-f]{64}")
"""An op set digest: sha256, lower-case hex."""


def ops_digest(ops: Iterable[str]) -> str:
    """The digest of an op set: sha256 of its distinct names, sorted, one per line. Equal sets
    give equal digests on every machine and Python version."""
    return hashlib.sha256("\n".join(sorted(set(ops))).encode()).hexdigest()


def check_op_names(names: Iterable[Any], what: str, *, limit: int = MAX_OPS) -> frozenset[str]:
    """`names` as a set of well-formed op names; `ValueError` naming `what` and the first bad
    entry (not a string, not an op name, or more than `limit` of them)."""
    out: set[str] = set()
    for i, name in enumerate(names):
        if i >= limit:
            raise ValueError(f"{what}: more than {limit} op names")
        if not isinstance(name, str) or not OP_NAME_RE.fullmatch(name):
            raise ValueError(f"{what}: entry {i} ({str(name)[:60]!r}) is not an op name like "
                             "'aten.gelu.default' or 'sym.mul'")
        out.add(name)
    return frozenset(out)


@dataclass(frozen=True)
class OpSet:
    """What one node runs: `ops` (its registry less `disabled`), `disabled` (what its operator
    turned off that its registry has), `unknown` (disabled names its registry does not have:
    a typo or another torch's op; they change nothing)."""

    ops: frozenset[str]
    disabled: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()

    @classmethod
    def build(cls, registry: Iterable[str], disabled: Iterable[str] = ()) -> OpSet:
        """The op set of a node whose registry holds `registry`, with `disabled` turned off."""
        reg = frozenset(registry)
        off = sorted(set(disabled))
        return cls(frozenset(reg - set(off)), tuple(n for n in off if n in reg),
                   tuple(n for n in off if n not in reg))

    @property
    def digest(self) -> str:
        return ops_digest(self.ops)

    def profile_fields(self) -> dict[str, Any]:
        """The keys a node gossips in its profile for this set."""
        return {"ops_digest": self.digest, "ops_count": len(self.ops),
                "ops_disabled": list(self.disabled)}


def digest_of_profile(profile: NodeProfile) -> str | None:
    """The op set digest a member gossips, or None when it gossips none (an older daemon) or a
    malformed one."""
    d = profile.ops_digest
    return d if DIGEST_RE.fullmatch(d) else None


def lacking_ops(graph_ops: Iterable[str], machines: Mapping[str, frozenset[str] | None]
                ) -> dict[str, list[str]]:
    """For each op of `graph_ops`, the machines (ids, sorted) whose op set lacks it; ops every
    machine runs are left out. A machine with set None runs everything (its set is unknown
    to the check; the stage's own check at Assign is the last word)."""
    out: dict[str, list[str]] = {}
    for op in sorted(set(graph_ops)):
        missing = sorted(m for m, ops in machines.items() if ops is not None and op not in ops)
        if missing:
            out[op] = missing
    return out


def unrunnable_message(graph_ops: Iterable[str], machines: Mapping[str, frozenset[str] | None],
                       why: Callable[[str, str], str] | None = None, limit: int = 6
                       ) -> str | None:
    """None when every op of `graph_ops` runs on at least one of `machines`; else a sentence
    naming each op no machine runs and the machines that lack it (`why(op, machine)`: why,
    e.g. "disabled by its jobs.disabled_ops"), and what to do."""
    lack = lacking_ops(graph_ops, machines)
    nowhere = {op: ms for op, ms in lack.items() if len(ms) == len(machines)}
    if not nowhere:
        return None
    parts = []
    for op, ms in list(nowhere.items())[:limit]:
        named = [f"{m} ({why(op, m)})" if why is not None else m for m in ms]
        parts.append(f"op {op!r} runs on no live machine ({', '.join(named)})")
    more = len(nowhere) - limit
    tail = f"; and {more} more ops" if more > 0 else ""
    return ("; ".join(parts) + tail + ". Start a daemon whose torch runs it, remove it from "
            "jobs.disabled_ops where an operator disabled it, or capture the model with the "
            "members' torch version")
