"""The members' op sets, as the scheduler learns them: digest by gossip, names on request.

Every member gossips the digest of its op set (`fusiond.opsets`, profile key `ops_digest`).
Before planning, the scheduler resolves each live member's digest to the names: from its cache
(one entry per digest; its own set is there from the start, and most members share a digest),
else by asking one member that gossips it (`OpSetRequest` -> `OpSetReply`, control lane; the
reply is checked: names well formed, at most `MAX_OPS`, hashing to the digest asked for). A
member whose digest cannot be resolved (no answer in time, a bad reply) is left out of that
job's plan, with the reason in the job's log; a member that gossips no digest (an older
daemon) counts as running every op, and its stage's own check at Assign is the last word.

Pure helpers (`lack_reason`, `graph_ops`, `refuse_unrunnable`, `refuse_stages`) turn the sets
into the refusals `Scheduling.submit` raises, naming the op and the machines.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fusiond.errors import RemoteError, describe
from fusiond.opsets import (
    MAX_OPS,
    OpSet,
    check_op_names,
    digest_of_profile,
    ops_digest,
    unrunnable_message,
)
from fusiond.tasks import cancel_and_wait
from protocol import ir
from protocol.messages import Message, NodeProfile, OpSetReply, OpSetRequest

if TYPE_CHECKING:  # the cluster's view types, for annotations only
    from fusiond.cluster import ClusterView, MemberView

__all__ = ["MemberOpSets", "OpSetService", "check_reply", "graph_ops", "lack_reason",
           "refuse_stages", "refuse_unrunnable", "software_line"]

log = logging.getLogger("fusiond.jobs.opsets")

SendFn = Callable[[str, Message, Sequence[Any]], Awaitable[None]]

CACHE_DIGESTS = 64
"""Op sets kept by digest (a cluster has a handful: one per torch version and per operator
who disabled something)."""
FETCH_MIN_S = 5.0
"""The least a request for an op list waits: the member's event loop may be busy training."""
FETCH_RTTS = 20.0
"""... and at least this many of the measured round trips to that member."""


@dataclass(frozen=True)
class MemberOpSets:
    """What the scheduler knows of the live members' op sets, for one planning.

    `ops`: member -> its op names, or None where it gossips no digest (counted as running
    everything); `unknown`: member -> why its set could not be learned (left out of the plan);
    `profiles`: member -> its gossiped profile (versions, disabled ops: for the messages)."""

    ops: Mapping[str, frozenset[str] | None] = field(default_factory=dict)
    unknown: Mapping[str, str] = field(default_factory=dict)
    profiles: Mapping[str, NodeProfile] = field(default_factory=dict)
    """Read them with `profile(member)`."""

    def profile(self, member: str) -> NodeProfile:
        """`member`'s gossiped profile (an empty one when unknown)."""
        return self.profiles.get(member) or NodeProfile()


def lack_reason(op: str, profile: NodeProfile) -> str:
    """Why a member lacks `op`: its operator disabled it, or its torch's registry has none."""
    if op in profile.ops_disabled:
        return "disabled by its jobs.disabled_ops"
    tv = profile.torch_version
    return f"not in torch {tv}'s registry" if tv else "not in its op registry"


def graph_ops(graph: ir.Graph, node_ids: Iterable[str] | None = None) -> set[str]:
    """The op names of `graph` (of the nodes `node_ids` only, when given)."""
    if node_ids is None:
        return {n.op for n in graph.nodes}
    nm = graph.node_map
    return {nm[n].op for n in node_ids if n in nm}


def refuse_unrunnable(graph: ir.Graph, sets: MemberOpSets, machines: Iterable[str]
                      ) -> str | None:
    """None when every op of `graph` runs on one of `machines` at least; else the refusal,
    naming each op no machine runs and why each machine lacks it."""
    ms = list(machines)
    captured, _ = graph.captured_with
    msg = unrunnable_message(graph_ops(graph), {m: sets.ops.get(m) for m in ms},
                             lambda op, m: lack_reason(op, sets.profile(m)))
    if msg is None:
        return None
    head = f"the graph (captured with torch {captured}) " if captured else "the graph "
    return head + "cannot run on this cluster: " + msg


def refuse_stages(graph: ir.Graph, stages: Mapping[int, tuple[str, Iterable[str]]],
                  sets: MemberOpSets, count: int) -> str | None:
    """None when each stage's machine runs every op of its nodes; else the refusal of the
    `--stages` cut (`stages`: stage -> (machine, node ids)), naming the stage, its machine and
    the ops it lacks, and what to run instead."""
    bad = []
    for s, (machine, nodes) in sorted(stages.items()):
        have = sets.ops.get(machine)
        if have is None:
            continue
        missing = sorted(graph_ops(graph, nodes) - have)
        if missing:
            prof = sets.profile(machine)
            shown = ", ".join(f"{op!r} ({lack_reason(op, prof)})" for op in missing[:4])
            more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            bad.append(f"stage {s} goes to {machine}, which cannot run op {shown}{more}")
    if not bad:
        return None
    return (f"--stages {count}: " + "; ".join(bad) + ". Submit without --stages so that the "
            "planner places each stage on a machine that runs its ops")


def software_line(graph: ir.Graph, sets: MemberOpSets) -> str:
    """A job log line: the torch (and Python) that captured the graph, the torch versions the
    members run, and the members whose op set is restricted."""
    torch_v, py = graph.captured_with
    by_version: dict[str, list[str]] = {}
    profiles = {m: sets.profile(m) for m in sorted(sets.profiles)}
    for m, prof in profiles.items():
        by_version.setdefault(prof.torch_version or "?", []).append(m)
    runs = "; ".join(f"torch {v} on {', '.join(ms)}" for v, ms in sorted(by_version.items()))
    off = [f"{m} disables {', '.join(prof.ops_disabled[:4])}"
           for m, prof in profiles.items() if prof.ops_disabled]
    return (f"graph captured with torch {torch_v or '?'} (Python {py or '?'}); members run "
            f"{runs or 'nothing known'}" + (f"; {'; '.join(off)}" if off else "")
            + ("; the planner places each stage only where every op of it runs"
               if len(by_version) > 1 or off else ""))


class OpSetService:
    """Answers other members' requests for our op list and resolves theirs; a service
    (start/ready/close). `send(peer, msg, payload)` is the peer network's send."""

    def __init__(self, *, node_id: str, local: OpSet, send: SendFn,
                 cache_digests: int = CACHE_DIGESTS) -> None:
        self.node_id = node_id
        self.local = local
        self.send = send
        self._cache: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._cache_digests = max(1, cache_digests)
        self._remember(local.digest, local.ops)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, str, asyncio.Future[OpSetReply]]] = {}
        self._inflight: dict[str, asyncio.Task[frozenset[str]]] = {}
        self._closed = False
        self.fetched = 0
        """Op lists fetched from members and accepted (for tests and logs)."""

    async def start(self) -> None:
        """Nothing to open: requests arrive as messages."""

    async def ready(self) -> None:
        """Ready at once."""

    async def close(self) -> None:
        """Cancel the fetches in flight (and await them); idempotent."""
        self._closed = True
        await cancel_and_wait(list(self._inflight.values()), what="op-set fetch")
        for _, _, fut in self._pending.values():
            if not fut.done():
                fut.cancel()
        self._pending.clear()

    def cached(self, digest: str) -> frozenset[str] | None:
        """The op names of `digest`, if known here."""
        return self._cache.get(digest)

    def _remember(self, digest: str, ops: frozenset[str]) -> None:
        self._cache[digest] = ops
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_digests:
            self._cache.popitem(last=False)

    # -- messages -------------------------------------------------------------------------

    async def handle(self, peer: str, msg: Message) -> bool:
        """Take OpSetRequest (answer it) and OpSetReply (to its waiting request)."""
        if isinstance(msg, OpSetRequest):
            if msg.digest == self.local.digest:
                reply = OpSetReply(request_id=msg.request_id, digest=msg.digest, ok=True,
                                   ops=tuple(sorted(self.local.ops)))
            else:
                reply = OpSetReply(request_id=msg.request_id, digest=msg.digest, ok=False,
                                   reason=f"{self.node_id} runs op set {self.local.digest[:12]}, "
                                          f"not {msg.digest[:12]}")
            try:
                await self.send(peer, reply, ())
            except Exception as e:  # the requester times out and tries another member
                log.info("op set reply to %s not sent: %r", peer, e)
            return True
        if isinstance(msg, OpSetReply):
            got = self._pending.get(msg.request_id)
            if got is not None and got[0] == peer and not got[2].done():
                got[2].set_result(msg)
            else:
                log.debug("unexpected OpSetReply %d from %s dropped", msg.request_id, peer)
            return True
        return False

    # -- resolving ------------------------------------------------------------------------

    async def resolve(self, view: ClusterView) -> MemberOpSets:
        """The op sets of `view`'s alive members: cached ones at once, the others fetched
        (concurrently, one request per digest, from the members that gossip it in turn)."""
        members = [m for m in view.members if m.state == "alive"]
        profiles: dict[str, NodeProfile] = {m.node_id: m.profile for m in members}
        digests: dict[str, str | None] = {m.node_id: digest_of_profile(profiles[m.node_id])
                                          for m in members}
        holders: dict[str, list[MemberView]] = {}
        for m in members:
            d = digests[m.node_id]
            if d is not None and d not in self._cache:
                holders.setdefault(d, []).append(m)
        errors: dict[str, str] = {}
        if holders:
            results = await asyncio.gather(*(self._fetch(d, ms) for d, ms in holders.items()),
                                           return_exceptions=True)
            for d, res in zip(holders, results, strict=True):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    errors[d] = str(res) or type(res).__name__
        ops: dict[str, frozenset[str] | None] = {}
        unknown: dict[str, str] = {}
        for node, d in digests.items():
            if d is None:
                ops[node] = None
            elif d in self._cache:
                ops[node] = self._cache[d]
            else:
                unknown[node] = f"its op list (digest {d[:12]}) could not be fetched: " \
                                f"{errors.get(d, 'evicted')}"
        return MemberOpSets(ops, unknown, profiles)

    async def _fetch(self, digest: str, holders: Sequence[MemberView]) -> frozenset[str]:
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.create_task(self._fetch_from(digest, holders),
                                       name=f"opset {digest[:12]}")
            self._inflight[digest] = task
            task.add_done_callback(lambda _t: self._inflight.pop(digest, None))
        return await asyncio.shield(task)

    async def _fetch_from(self, digest: str, holders: Sequence[MemberView]) -> frozenset[str]:
        why: list[str] = []
        for m in holders:
            if self._closed:
                raise RemoteError("the op set service is closing")
            try:
                ops = await self._ask(m.node_id, digest, _timeout_s(m.rtt_s))
            except (RemoteError, TimeoutError, OSError) as e:
                why.append(f"{m.node_id}: {describe(e)}")
                continue
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a send that failed in the network layer
                why.append(f"{m.node_id}: {type(e).__name__}: {e}")
                continue
            self._remember(digest, ops)
            self.fetched += 1
            return ops
        raise RemoteError("; ".join(why) or "no member gossips it")

    async def _ask(self, peer: str, digest: str, timeout_s: float) -> frozenset[str]:
        rid = next(self._ids)
        fut: asyncio.Future[OpSetReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (peer, digest, fut)
        try:
            await self.send(peer, OpSetRequest(request_id=rid, digest=digest), ())
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await fut
            except TimeoutError:
                raise RemoteError(f"no answer within {timeout_s:.3g}s") from None
        finally:
            self._pending.pop(rid, None)
        return check_reply(reply, digest)


def check_reply(reply: OpSetReply, digest: str) -> frozenset[str]:
    """The op names of a reply to a request for `digest`; `RemoteError` naming what is wrong
    (refused, another digest, malformed names, too many, names that do not hash to it)."""
    if not reply.ok:
        raise RemoteError(f"refused: {reply.reason[:200]}")
    if reply.digest != digest:
        raise RemoteError(f"answered for digest {reply.digest[:12]!r}, not {digest[:12]}")
    try:
        ops = check_op_names(reply.ops, "OpSetReply.ops", limit=MAX_OPS)
    except ValueError as e:
        raise RemoteError(str(e)) from None
    if ops_digest(ops) != digest:
        raise RemoteError(f"its {len(ops)} op names hash to {ops_digest(ops)[:12]}, not "
                          f"{digest[:12]}")
    return ops


def _timeout_s(rtt_s: float | None) -> float:
    if rtt_s is None or not (isinstance(rtt_s, int | float) and math.isfinite(rtt_s)):
        return FETCH_MIN_S
    return max(FETCH_MIN_S, FETCH_RTTS * float(rtt_s))
