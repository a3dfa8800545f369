"""The daemon side of a job: host the stages the scheduler assigns to this node.

`JobWorker.handle(peer, msg) -> handled` takes the job messages addressed to this node (plug it
into the daemon's message dispatch):

- Assign -> build the partition (off the event loop) and answer Ready, or Error naming what was
  wrong (`code="assign_failed"`);
- JobStart -> run every step; after each, StageStep to the scheduler (and every
  `checkpoint_interval` or `eval_interval` steps a StageCheckpoint with the partition's
  state); at the end JobResult (ok + the partition's final weights as safetensors payload, or
  not ok + the failure);
- Forward / Backward -> the stage's executor;
- JobDensities -> new top-k densities for edges this stage sends (AdaTopK re-adaptation);
- JobCancel -> stop the stage and free it. Assign travels on BULK and JobCancel on CONTROL, so
  a cancel can overtake its Assign: the worker remembers the last `CANCELLED_MEMORY` cancelled
  (job, plan version)s and drops an Assign of a version it saw cancelled (no zombie stage).

Authority (`leadership`, the cluster's view of its scheduler): an Assign is taken only from the
current term's scheduler (its `term` is the cluster's term and its sender the view's leader; a
newer term, or a view that has no leader yet, is waited on for `authority_wait_s`); JobStart,
JobDensities and JobCancel of a job only from the node that assigned it (a newer term's
scheduler takes a job over by assigning it again). Anything else is ignored, logged once per
job, sender and kind. Without `leadership` (in-process tools, no cluster) any sender may
assign; only the assigner controls a job either way.

`send(peer, msg, payload)` is how the worker talks: `PeerNetwork.send`, or `local_sender(...)`,
which hands messages for this node itself (a scheduler that also runs a stage) straight to a
local dispatch function instead of the network.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusiond.errors import FusionError
from fusiond.graph import state_to_bytes, state_to_parts
from fusiond.heap import trim_heap
from fusiond.tasks import cancel_and_wait
from fusiond.train.codec import EDGE_ENCODINGS
from fusiond.train.remote import PeerSender, StageHost
from fusiond.train.stage import StageConfig, StageError, StepReport, fault_of
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    Assign,
    Backward,
    Error,
    Forward,
    JobCancel,
    JobDensities,
    JobResult,
    JobStart,
    Message,
    Ready,
    StageCheckpoint,
    StageStep,
)

if TYPE_CHECKING:  # the cluster's view type, for annotations only
    from fusiond.cluster import ClusterView

__all__ = ["AUTHORITY_WAIT_S", "JobWorker", "Leadership", "LeadershipFn", "SendFn",
           "local_sender"]

log = logging.getLogger(__name__)

CANCELLED_MEMORY = 1024
"""Cancelled jobs remembered (job id -> highest plan version cancelled) to drop late Assigns."""
AUTHORITY_WAIT_S = 3.0
"""How long an Assign from a newer term (or while this node's view has no scheduler yet) waits
for the view to confirm its sender as the scheduler: a new scheduler's first Assigns can
overtake its election's news."""

SendFn = Callable[[str, Message, Sequence[Any]], Awaitable[None]]
"""`send(peer, msg, payload)`: queue a message for a peer (awaits under backpressure)."""
DispatchFn = Callable[[str, Message], Awaitable[Any]]


SendNowFn = Callable[[str, Message, Sequence[Any]], bool]
"""`PeerNetwork.send_now`: write a message at once if its lane is idle, else False."""


def local_send_now(node_id: str, net_send_now: SendNowFn) -> SendNowFn:
    """`net_send_now`, except for messages to `node_id` itself (False: they go through
    `local_sender`'s dispatch)."""

    def send_now(peer: str, msg: Message, payload: Sequence[Any] = ()) -> bool:
        return peer != node_id and net_send_now(peer, msg, payload)

    return send_now


def local_sender(node_id: str, net_send: SendFn, dispatch: DispatchFn) -> SendFn:
    """A `SendFn` that delivers messages for `node_id` itself to `dispatch(node_id, msg)`
    (with the payload attached as `msg.payload`) and everything else to `net_send`."""

    async def send(peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        if peer != node_id:
            await net_send(peer, msg, payload)
            return
        data = b"".join(bytes(p) for p in payload)
        await dispatch(node_id, dataclasses.replace(msg, payload=memoryview(data)))

    return send


@dataclass(frozen=True)
class Leadership:
    """Who schedules, as this node's cluster view says: the scheduler of the current term (None
    while there is none), the term, and whether a majority of voters is alive."""

    leader: str | None
    term: int
    has_quorum: bool

    @classmethod
    def of(cls, view: ClusterView | None) -> Leadership | None:
        """From a `ClusterView` (None: not in a cluster)."""
        if view is None:
            return None
        return cls(view.leader, view.term, view.has_quorum)


LeadershipFn = Callable[[], "Leadership | None"]
"""This node's current view of the scheduler (None: not in a cluster: nobody is refused)."""


@dataclass
class _Job:
    host: StageHost
    scheduler: str
    term: int = 0
    task: asyncio.Task[None] | None = None
    steps_done: int = 0
    started: float = field(default=0.0)


class _WorkerNet:
    """The worker's `send` as the `PeerSender` a stage host takes: looked up at each call, so
    a `JobWorker.send` replaced later (a test's lossy link) applies to running stages too."""

    def __init__(self, worker: JobWorker) -> None:
        self._worker = worker

    async def send(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        await self._worker.send(peer, msg, payload)

    def send_now(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> bool:
        now = self._worker.send_now
        return now is not None and now(peer, msg, payload)


def _build_stage(msg: Assign, payload: memoryview, net: PeerSender, *,
                 config: StageConfig | None,
                 limits: Limits, offload_root: Path | None) -> StageHost:
    """A stage from its Assign (its weights read as views of the payload, copied once into
    the module), and the heap's free pages given back: building the module and its program
    frees what the heap keeps otherwise (measured before the views: 100 MiB resident after
    building a 21 MB stage, 71 after the trim)."""
    host = StageHost(msg, payload, net, config=config, limits=limits,
                     offload_root=offload_root)
    trim_heap()
    return host


class JobWorker:
    """Hosts this node's stages; a service (start/ready/close)."""

    def __init__(self, *, node_id: str, send: SendFn, stage_config: StageConfig | None = None,
                 limits: Limits = DEFAULT_LIMITS, leadership: LeadershipFn | None = None,
                 authority_wait_s: float = AUTHORITY_WAIT_S,
                 send_now: SendNowFn | None = None, offload_root: Path | None = None) -> None:
        self.node_id = node_id
        self.offload_root = offload_root
        """Where a stage the planner told to keep its optimizer state on disk keeps it
        (`<state_dir>/offload` in a daemon; None: a directory under the system's temp)."""
        self.send = send
        self.send_now = send_now
        """The transport's `send_now` (`local_send_now`): stages write a packet at once when
        its lane is idle; None: every packet goes through `send`."""
        self.stage_config = stage_config
        self.limits = limits
        self.leadership = leadership
        self.authority_wait_s = authority_wait_s
        self._jobs: dict[str, _Job] = {}
        self._building: dict[str, int] = {}
        """Job id -> plan version of an Assign whose stage is being built here."""
        self._cancelled: OrderedDict[str, int] = OrderedDict()
        self._ignored: set[tuple[str, str, str]] = set()
        """(job, sender, message kind) already logged as ignored (logged once each)."""
        self._ready = asyncio.Event()
        self._closed = False
        self._by_type = self._handlers()

    async def start(self) -> None:
        """Nothing to open: jobs arrive as messages."""
        self._ready.set()

    async def ready(self) -> None:
        """Return once started."""
        await self._ready.wait()

    async def close(self) -> None:
        """Cancel every running job (tasks cancelled and awaited) and free them; idempotent."""
        if self._closed:
            return
        self._closed = True
        for job_id in list(self._jobs):
            await self._drop(job_id)

    def jobs(self) -> dict[str, dict[str, Any]]:
        """job id -> {stage, scheduler, running, steps_done}: for the local API."""
        return {
            j: {"stage": s.host.assignment.stage, "scheduler": s.scheduler,
                "running": s.task is not None and not s.task.done(), "steps_done": s.steps_done}
            for j, s in self._jobs.items()
        }

    async def handle(self, peer: str, msg: Message) -> bool:
        """Take a job message (by its type, `_handlers`); False if it is not one (someone
        else's)."""
        handler = self._by_type.get(type(msg))
        if handler is None:
            return False
        await handler(peer, msg)
        return True

    def _handlers(self) -> dict[type[Message], Callable[[str, Any], Awaitable[None]]]:
        """The stage side of the job protocol, by message type (`handle`)."""
        return {Forward: self._on_tensor, Backward: self._on_tensor, Assign: self._assign,
                JobStart: self._on_start, JobDensities: self._on_densities,
                JobCancel: self._on_cancel}

    async def _on_tensor(self, peer: str, msg: Forward | Backward) -> None:
        self._tensor(peer, msg)

    def receive_now(self, peer: str, msg: Message) -> bool:
        """A Forward or Backward as its bytes arrive (`PeerNetwork.set_receive_now`): to its
        stage's inbox without a turn of the connection's reader task; False for any other
        message. A packet the stage refuses is logged, as the reader's handler would."""
        if not isinstance(msg, (Forward, Backward)):
            return False
        try:
            self._tensor(peer, msg)
        except FusionError as e:
            log.warning("%s from %s refused: %s", type(msg).__name__, peer, e)
        return True

    def _tensor(self, peer: str, msg: Forward | Backward) -> None:
        job = self._jobs.get(msg.job_id)
        if job is None:
            log.debug("%s for unknown job %s from %s dropped", type(msg).__name__,
                      msg.job_id, peer)
        elif msg.plan_version != job.host.assignment.plan_version:
            # In flight from the job's previous plan (before a restart): not ours any more.
            log.debug("%s of job %s v%d from %s dropped (the stage runs v%d)",
                      type(msg).__name__, msg.job_id, msg.plan_version, peer,
                      job.host.assignment.plan_version)
        else:
            job.host.on_message(peer, msg)

    async def _on_start(self, peer: str, msg: JobStart) -> None:
        if self._from_assigner(peer, msg, msg.job_id):
            self._start(peer, msg)

    async def _on_densities(self, peer: str, msg: JobDensities) -> None:
        job = self._jobs.get(msg.job_id)
        if job is not None and self._from_assigner(peer, msg, msg.job_id):
            try:
                ex = job.host.executor
                for edge, enc in msg.encodings.items():
                    if enc not in EDGE_ENCODINGS:
                        raise StageError(f"edge {edge!r}: encoding {enc!r} is not one of "
                                         f"{list(EDGE_ENCODINGS)}")
                    ex.set_codec(edge, next(e for e in EDGE_ENCODINGS if e == enc),
                                 msg.densities.get(edge))
                for edge, d in msg.densities.items():
                    if edge not in msg.encodings:
                        ex.set_density(edge, d)
            except FusionError as e:
                log.warning("JobDensities for job %s from %s refused: %s", msg.job_id, peer, e)

    async def _on_cancel(self, peer: str, msg: JobCancel) -> None:
        job = self._jobs.get(msg.job_id)
        if job is None:
            # Its Assign may not have arrived yet (CONTROL overtakes BULK): remember the
            # version, from the current scheduler only, so the late Assign is dropped.
            if self._may_control_unassigned(peer):
                self._note_cancelled(msg.job_id, msg.plan_version)
            return
        running = job.host.assignment.plan_version
        if not self._from_assigner(peer, msg, msg.job_id):
            return
        self._note_cancelled(msg.job_id, msg.plan_version or running)
        if msg.plan_version != 0 and msg.plan_version < running:
            log.info("JobCancel of job %s v%d from %s ignored: the stage runs v%d", msg.job_id,
                     msg.plan_version, peer, running)
        else:
            log.info("job %s cancelled by %s: %s", msg.job_id, peer, msg.reason or "-")
            await self._drop(msg.job_id)

    def _note_cancelled(self, job_id: str, plan_version: int) -> None:
        if plan_version <= 0:
            return  # a version we cannot know: nothing to remember
        before = self._cancelled.pop(job_id, 0)
        self._cancelled[job_id] = max(before, plan_version)
        while len(self._cancelled) > CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)

    def _cancelled_already(self, msg: Assign) -> bool:
        return self._cancelled.get(msg.job_id, 0) >= msg.plan_version

    def _ignore(self, peer: str, msg: Message, job_id: str, why: str) -> None:
        key = (job_id, peer, type(msg).__name__)
        if key not in self._ignored:
            if len(self._ignored) >= 4096:  # bounded: a flood of fake ids is not remembered
                self._ignored.clear()
            self._ignored.add(key)
            log.warning("%s for job %s from %s ignored: %s (logged once)", type(msg).__name__,
                        job_id, peer, why)

    def _from_assigner(self, peer: str, msg: Message, job_id: str) -> bool:
        """Whether `peer` assigned the job hosted here (only it controls the job)."""
        job = self._jobs.get(job_id)
        if job is None or job.scheduler == peer:
            return True
        self._ignore(peer, msg, job_id, f"the job was assigned here by {job.scheduler}")
        return False

    async def _authority(self, peer: str, msg: Assign) -> str | None:
        """Why `peer` may not assign work here (None: it may): it must be the scheduler of the
        current term. A newer term, or no scheduler in our view yet, waits (bounded) for the
        view to catch up with an election that just happened."""
        if self.leadership is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.authority_wait_s
        while True:
            lead = self.leadership()
            if lead is None:
                return None  # not in a cluster (a lone node's own jobs)
            if msg.term < lead.term:
                return f"its term {msg.term} is stale (the cluster is at term {lead.term})"
            if msg.term == lead.term and lead.leader == peer:
                return None
            if msg.term == lead.term and lead.leader is not None:
                return f"the scheduler of term {lead.term} is {lead.leader}, not {peer}"
            if loop.time() >= deadline:
                return (f"{peer} is not the scheduler here (term {lead.term}, scheduler "
                        f"{lead.leader or 'none'}; the Assign says term {msg.term}) after "
                        f"{self.authority_wait_s:g}s")
            await asyncio.sleep(0.05)

    def _may_control_unassigned(self, peer: str) -> bool:
        """Whether `peer` may control a job not hosted here (yet): the current scheduler."""
        lead = self.leadership() if self.leadership is not None else None
        return lead is None or lead.leader == peer

    async def _assign(self, peer: str, msg: Assign) -> None:
        why = await self._authority(peer, msg)
        if why is not None:
            self._ignore(peer, msg, msg.job_id, why)
            await self.send(peer, Error(code="not_scheduler", request_id=msg.request_id,
                                        job_id=msg.job_id, plan_version=msg.plan_version,
                                        message=f"{self.node_id}: Assign refused: {why}"), ())
            return
        if self._cancelled_already(msg):
            # Its JobCancel overtook it (CONTROL vs BULK): the scheduler has given up on this
            # version and waits for no Ready; building it would leave a zombie stage.
            log.info("Assign of job %s v%d from %s dropped: that version was cancelled",
                     msg.job_id, msg.plan_version, peer)
            return
        if self._building.get(msg.job_id) == msg.plan_version:
            # A repeat of the Assign being built (the scheduler sends it again when no Ready
            # came in time): the first one's Ready answers both.
            log.info("Assign of job %s v%d from %s repeated while it is built", msg.job_id,
                     msg.plan_version, peer)
            return
        old = self._jobs.get(msg.job_id)
        if (old is not None and old.host.assignment.plan_version == msg.plan_version
                and old.scheduler == peer):
            # A repeat of the Assign this stage runs: our Ready was lost, or is late.
            await self.send(peer, Ready(request_id=msg.request_id, job_id=msg.job_id,
                                        plan_version=msg.plan_version,
                                        partition=msg.partition, node_id=self.node_id), ())
            return
        if old is not None and old.host.assignment.plan_version < msg.plan_version:
            # The scheduler restarted the job on a new plan: the old stage is superseded (its
            # JobCancel rides the control lane and may arrive after this Assign).
            log.info("job %s: plan v%d supersedes v%d here", msg.job_id, msg.plan_version,
                     old.host.assignment.plan_version)
            await self._drop(msg.job_id)
        if msg.job_id in self._jobs:
            await self.send(peer, Error(code="already_running", request_id=msg.request_id,
                                        job_id=msg.job_id, plan_version=msg.plan_version,
                                        message=f"job {msg.job_id} already runs here"), ())
            return
        self._building[msg.job_id] = msg.plan_version
        try:
            # Decoding the IR and building the partition can take seconds: off the loop.
            host = await asyncio.to_thread(
                _build_stage, msg, msg.payload, self._net_for_stage(),
                config=self.stage_config, limits=self.limits, offload_root=self.offload_root,
            )
            await host.start()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("Assign of job %s refused: %s", msg.job_id, e)
            await self.send(peer, Error(code="assign_failed", request_id=msg.request_id,
                                        job_id=msg.job_id, plan_version=msg.plan_version,
                                        message=f"{self.node_id}: {e}"), ())
            return
        finally:
            if self._building.get(msg.job_id) == msg.plan_version:
                del self._building[msg.job_id]
        if self._cancelled_already(msg):  # cancelled while it was being built
            log.info("job %s v%d cancelled while its stage was built; dropped", msg.job_id,
                     msg.plan_version)
            await host.close()
            return
        self._jobs[msg.job_id] = _Job(host, peer, msg.term)
        await self.send(peer, Ready(request_id=msg.request_id, job_id=msg.job_id,
                                    plan_version=msg.plan_version, partition=msg.partition,
                                    node_id=self.node_id), ())

    def _net_for_stage(self) -> _WorkerNet:
        return _WorkerNet(self)

    def _start(self, peer: str, msg: JobStart) -> None:
        job = self._jobs.get(msg.job_id)
        if job is None or job.task is not None:
            log.warning("JobStart for %s job %s from %s ignored",
                        "unknown" if job is None else "running", msg.job_id, peer)
            return
        job.task = asyncio.create_task(self._run(msg.job_id, job, msg.first_step),
                                       name=f"job {msg.job_id}")

    async def _run(self, job_id: str, job: _Job, first: int) -> None:
        host = job.host
        sa = host.assignment

        async def progress(rep: StepReport) -> None:
            job.steps_done += 1
            await self.send(job.scheduler, StageStep(
                job_id=job_id, plan_version=sa.plan_version, partition=sa.own_slot, step=rep.step,
                figures=rep.to_figures()), ())
            if sa.sends_state(rep.step):  # a checkpoint, or the scheduler's held-out evaluation
                # the state as this step left it: the report's copy, or (the executor holds the
                # next step for this callback) the stage's own
                parts: Sequence[bytes | memoryview]
                if rep.state is not None:  # private copies: sent as they are, no copy
                    state, rep.state = rep.state, None
                    parts = state_to_parts(state)
                else:
                    parts = (await asyncio.to_thread(state_to_bytes, host.state_dict()),)
                await self.send(job.scheduler, StageCheckpoint(
                    job_id=job_id, plan_version=sa.plan_version, partition=sa.own_slot,
                    step=rep.step), parts)

        result: JobResult
        payload: bytes = b""
        try:
            # the serialisation and the send of a step's state (tens of ms on a small host)
            # stay off the steps' path where the stage can copy it (StageHost.run)
            await host.run(progress, first=first, reads_state=sa.sends_state)
            payload = await asyncio.to_thread(state_to_bytes, host.state_dict())
            result = JobResult(job_id=job_id, plan_version=sa.plan_version, partition=sa.own_slot,
                               ok=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            fault = fault_of(e)
            log.warning("job %s stage %d failed (%s's fault): %s", job_id, sa.stage, fault, e)
            result = JobResult(job_id=job_id, plan_version=sa.plan_version, partition=sa.own_slot,
                               ok=False, message=f"{self.node_id}: {e}",
                               step=host.executor.current_step, fault=fault)
        try:
            await self.send(job.scheduler, result, (payload,) if payload else ())
        finally:
            self._jobs.pop(job_id, None)
            await host.close()

    async def _drop(self, job_id: str) -> None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        if job.task is not None:
            await cancel_and_wait([job.task], what="stage")
        await job.host.close()
