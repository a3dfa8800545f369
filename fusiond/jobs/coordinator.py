"""The scheduler side of a running job: assign, wait for Ready, start, follow, finish or fail.

`JobCoordinator(...).run()` sends each machine its Assign, waits (bounded) for every Ready,
sends JobStart, merges the stages' StageStep reports into per-step `StepMetrics` (`on_step`
gets each), and ends with a `JobOutcome`: the gathered model state (ok), or a `FailureReport`
naming the machine, stage, step and cause of the FIRST failure (torchrun-style), after sending
JobCancel to every other stage. Failures come from a stage (JobResult not ok, an Error to the
Assign), from the membership layer (`node_failed`, e.g. a daemon died), from `cancel()`, or from
a bounded wait expiring. Route the job's Ready/Error/StageStep/JobResult to `handle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from fusiond.errors import LocalError
from fusiond.graph import CapturedModel, state_from_bytes
from fusiond.jobs.assign import Corpus, JobLayout, assign_parts
from fusiond.jobs.results import gather_state, save_model, write_metrics
from fusiond.jobs.worker import SendFn
from fusiond.tasks import cancel_and_wait
from fusiond.train.codec import EdgeCodec
from fusiond.train.data import make_source, source_from_arrays
from fusiond.train.evaluate import graph_heldout_loss
from fusiond.train.local import StepMetrics, merge_reports
from fusiond.train.spec import JobSpec, default_text_path
from fusiond.train.stage import StepReport
from protocol import ir
from protocol.messages import (
    Address,
    Error,
    JobCancel,
    JobDensities,
    JobResult,
    JobStart,
    Message,
    Ready,
    StageCheckpoint,
    StageStep,
)

__all__ = [
    "FAULT_JOB",
    "FAULT_MACHINE",
    "FAULT_REFUSED",
    "FAULT_SCHEDULER",
    "FAULT_STALE",
    "FailureReport",
    "JobCoordinator",
    "JobOutcome",
    "save_checkpoint",
    "write_outputs",
]

log = logging.getLogger(__name__)


ASSIGN_RESEND_MIN_S = 10.0
"""An Assign without a Ready is sent again every max(this, a quarter of the Ready timeout):
a failed dial drops the frames queued on it (the chaos check lost Assigns so), and the attempt
used to wait out the whole Ready timeout (120 s) before restarting. The worker takes a repeat
of an Assign it builds or runs as the same one (answering Ready again once built)."""

FAULT_MACHINE = "machine"
"""The named machine(s) failed: a restart plans the job without them."""
FAULT_JOB = "job"
"""The job's own deterministic error (its model or data raised): no machine is blamed, and no
restart is tried (it would fail the same way anywhere)."""
FAULT_REFUSED = "refused"
"""A machine refused its Assign (it cannot run the partition: an op its torch lacks, another
Python's corpus): a restart plans the job without it (the scheduler's own machine included)."""
FAULT_SCHEDULER = "scheduler"
"""The scheduler's side: cancelled, the scheduler stopping or losing its lease, a bug."""
FAULT_STALE = "stale"
"""A member refused the Assign because it does not take this scheduler for the scheduler (it
saw a newer term): no machine is at fault, and this side must not go on scheduling; the job
goes back to the next scheduler (a hand-back), it is not restarted here."""


@dataclass(frozen=True)
class FailureReport:
    """The first failure of a job. `fault` says whose (the `FAULT_*` constants); `others` the
    further machines at fault (a wait for Ready names every machine that never answered)."""

    node: str
    stage: int
    step: int
    cause: str
    fault: str = FAULT_MACHINE
    others: tuple[str, ...] = ()

    @property
    def machines(self) -> tuple[str, ...]:
        """The machines to leave out of a restart (none for the job's own error)."""
        if self.fault not in (FAULT_MACHINE, FAULT_REFUSED):
            return ()
        return (self.node, *self.others)

    def __str__(self) -> str:
        where = f"step {self.step}" if self.step >= 0 else "before the first step"
        if self.fault == FAULT_JOB:
            return (f"job failed at stage {self.stage} ({where}, on {self.node}): the job's own "
                    f"error, not the machine's (no machine is blamed; fix the job): {self.cause}")
        return f"job failed on {self.node} (stage {self.stage}, {where}): {self.cause}"


@dataclass
class JobOutcome:
    """How a job ended."""

    job_id: str
    ok: bool
    metrics: list[StepMetrics]
    state: dict[str, torch.Tensor] | None
    failure: FailureReport | None
    wall_s: float
    stage_nodes: dict[int, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (for metrics.json and the API)."""
        losses = [m.loss for m in self.metrics if m.loss is not None]
        held = [m.held_out_loss for m in self.metrics if m.held_out_loss is not None]
        return {
            "job_id": self.job_id, "ok": self.ok, "steps": len(self.metrics),
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
            "last_held_out_loss": held[-1] if held else None, "wall_s": self.wall_s,
            "failure": None if self.failure is None else str(self.failure),
            "stages": {str(s): n for s, n in sorted(self.stage_nodes.items())},
        }


def _gather(graph: ir.Graph, parts: Mapping[int, bytes]) -> dict[str, torch.Tensor]:
    """The whole model from each partition's state bytes (in partition order); run in a
    thread: it decodes and copies a model's worth of bytes."""
    return gather_state(graph, [state_from_bytes(parts[p]) for p in sorted(parts)])


EVAL_END_WAIT_S = 30.0
"""How long the end of an attempt waits for its held-out evaluations still running."""
MAX_HELD_STEPS = 256
"""Steps that may wait for a held-out figure: past them the oldest goes on without it (a
state that never came, an evaluation slower than the pipeline), so the live curve never
stalls for long (a record is a few hundred bytes)."""
MAX_HELD_WAIT_S = 10.0
"""... nor may the oldest wait longer than this. Counting steps alone dropped figures where
steps are fast: 32 steps of GPT-2 tiny on loopback are 1.3 s, less than building the model
for one evaluation on a loaded 2-core machine."""


class JobCoordinator:
    """Runs one job from the scheduler's node."""

    def __init__(
        self,
        *,
        send: SendFn,
        spec: JobSpec,
        captured: CapturedModel,
        layout: JobLayout,
        addresses: Mapping[str, Address],
        term: int,
        plan_version: int = 1,
        first_step: int = 0,
        ready_timeout_s: float = 120.0,
        failure_grace_s: float = 2.0,
        tokens_per_sample: int = 0,
        on_step: Callable[[StepMetrics], Any] | None = None,
        on_checkpoint: Callable[[int, dict[str, torch.Tensor]], Any] | None = None,
        on_running: Callable[[], Any] | None = None,
        corpus: Corpus | None = None,
        recv_timeout_s: float | None = None,
    ) -> None:
        self.send = send
        self.corpus = corpus  # what the submitter read (None: read a shipped corpus here)
        self.recv_timeout_s = recv_timeout_s  # the stages' input wait (None: their own)
        self.spec = spec
        self.captured: CapturedModel | None = captured
        """The job's graph and initial weights (None once `release`d)."""
        self.layout = layout
        self.job_id = layout.job_id
        self.addresses = dict(addresses)
        self.term = term
        self.plan_version = plan_version
        self.first_step = first_step
        self.ready_timeout_s = ready_timeout_s
        self.failure_grace_s = failure_grace_s
        self.tokens_per_sample = tokens_per_sample
        self.on_step = on_step
        self.on_checkpoint = on_checkpoint
        self.on_running = on_running
        """Called once every stage is Ready (weights shipped) and JobStart is out: the start of
        training, apart from start-up."""
        self._checkpoints: dict[int, dict[int, bytes]] = {}
        self._encodings: dict[str, str] = {}
        """Edge -> the encoding the last re-adaptation (`set_codecs`) sent its stage."""
        self._held: list[tuple[StepMetrics, float]] = []
        """Steps merged but not yet handed to `on_step`: from the first whose held-out
        evaluation is still to come, in step order (the history is append-only)."""
        self._evaluated: set[int] = set()
        self._eval_source: Any = None  # the held-out data, built on the first evaluation
        self._eval_warned = False
        self._eval_tasks: set[asyncio.Task[None]] = set()
        """Held-out evaluations running: apart from the message handler, so a big model's
        evaluation never holds up the messages behind it."""
        self.stage_nodes = layout.slot_nodes  # slot -> node (slot = stage without replicas)
        # the slots that send their state (a checkpoint, a held-out evaluation's): each
        # stage's first replica (`StageAssignment.sends_state`)
        self._state_slots = frozenset(self.stage_nodes) - frozenset(layout.slot_stages())
        self._node_stage = {n: s for s, n in self.stage_nodes.items()}
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._results: dict[int, bytes] = {}
        self._done = asyncio.Event()
        self._failure: FailureReport | None = None
        self._per_step: dict[int, dict[int, StepReport]] = {}
        self._metrics: list[StepMetrics] = []
        self._last_step_t = 0.0
        self._step_of: dict[int, int] = {}
        self._request_ids: dict[int, str] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}  # (edge, dir) -> [wire, dense]
        self._state = "created"
        self._reported: set[int] = set()  # stages that sent a JobResult (ok or not)
        self._result_arrived = asyncio.Event()
        self._blame_silent = True  # False once the failure's cause is known for sure

    # -- inputs ---------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        """Whether `run()` has returned (a finished attempt takes no message any more)."""
        return self._state in ("done", "failed")

    async def handle(self, peer: str, msg: Message) -> bool:
        """Take this attempt's Ready/Error/StageStep/StageCheckpoint/JobResult; False for
        anything else, and for everything once the attempt has finished. Messages of the job's
        other plan versions (a stage of the attempt before a restart) are taken and dropped,
        and so are those from a machine that does not run the stage they name."""
        if self.finished:
            return False
        if isinstance(msg, Error):
            # A refusal names its job and plan version, and its request id is unique in this
            # process: only this attempt's own Assigns are answered here.
            if (msg.job_id != self.job_id or msg.plan_version != self.plan_version
                    or self._request_ids.get(msg.request_id) != peer):
                return False
            # assign_failed: it cannot run the partition (an op, its corpus): plan without it.
            # not_scheduler: it does not take us for the scheduler: nobody's machine is at
            # fault, and this side must not go on scheduling (no restart: a hand-back).
            fault = {"assign_failed": FAULT_REFUSED,
                     "not_scheduler": FAULT_STALE}.get(msg.code, FAULT_MACHINE)
            self._fail(peer, -1, f"refused its Assign ({msg.code}): {msg.message}",
                       fault=fault)
            self._blame_silent = False
            fut = self._ready.get(peer)
            if fut is not None and not fut.done():
                fut.set_result(None)
            return True
        if not isinstance(msg, (Ready, StageStep, StageCheckpoint, JobResult)) \
                or msg.job_id != self.job_id:
            return False
        if msg.plan_version != self.plan_version:
            log.debug("%s of job %s v%d from %s dropped (running v%d)", type(msg).__name__,
                      self.job_id, msg.plan_version, peer, self.plan_version)
            return True
        if self.stage_nodes.get(msg.partition) != peer:
            log.warning("%s of job %s for stage %d from %s dropped: %s runs that stage",
                        type(msg).__name__, self.job_id, msg.partition, peer,
                        self.stage_nodes.get(msg.partition))
            return True
        if isinstance(msg, Ready):
            fut = self._ready.get(peer)
            if fut is not None and not fut.done():
                fut.set_result(None)
            return True
        if isinstance(msg, StageStep):
            self._on_step(peer, msg)
            return True
        if isinstance(msg, StageCheckpoint):
            if msg.partition not in self._state_slots:
                log.warning("job %s: a state from replica slot %d ignored (only each stage's "
                            "first replica sends one)", self.job_id, msg.partition)
                return True
            got = self._checkpoints.setdefault(msg.step, {})
            got[msg.partition] = bytes(msg.payload)
            if len(got) == len(self._state_slots):
                del self._checkpoints[msg.step]
                if self.captured is not None:
                    # A whole model's bytes: decoded and gathered off the event loop.
                    state = await asyncio.to_thread(_gather, self.captured.graph, got)
                    every = self.spec.checkpoint_interval
                    if self.on_checkpoint is not None and every > 0 \
                            and (msg.step + 1) % every == 0:
                        self.on_checkpoint(msg.step, state)
                    if self._evaluates(msg.step):
                        task = asyncio.create_task(self._evaluate(msg.step, state),
                                                   name=f"job {self.job_id} held-out {msg.step}")
                        self._eval_tasks.add(task)
                        task.add_done_callback(self._eval_tasks.discard)
            return True
        self._reported.add(msg.partition)
        self._result_arrived.set()
        if msg.ok:
            self._results[msg.partition] = bytes(msg.payload)
            if len(self._results) == len(self.stage_nodes):
                self._done.set()
        elif msg.fault == FAULT_JOB:
            # The stage says its own computation or data raised: the job's error, on any
            # machine. Nobody is blamed, not even a neighbour that then stays silent.
            if self._failure is None:
                self._blame_silent = False
            self._fail(peer, msg.step, msg.message, fault=FAULT_JOB)
        else:
            self._fail(peer, msg.step, msg.message)
        return True

    def node_failed(self, node: str, cause: str) -> None:
        """The membership layer says `node` is gone: fail the job if it runs a stage."""
        if node in self._node_stage:
            if self._failure is None:
                self._blame_silent = False
            self._fail(node, self._step_of.get(self._node_stage[node], -1), cause)

    async def set_densities(self, densities: Mapping[str, float]) -> None:
        """Re-adapt top-k densities while the job runs (edge id -> density, 1.0 = exact), e.g.
        from `fusiond.plan.adatopk.readapt` after links were re-measured. Each edge's sending
        stage switches at its next forward; receivers need no notice."""
        by_node: dict[str, dict[str, float]] = {}
        src_of = {e.edge: e.src_node for e in self.layout.edges()}
        for edge, d in densities.items():
            if edge not in src_of:
                raise LocalError(f"edge {edge!r} is not a cut edge of job {self.job_id}")
            if not 0.0 < d <= 1.0:
                raise LocalError(f"edge {edge!r}: density {d} not in (0, 1]")
            by_node.setdefault(src_of[edge], {})[edge] = float(d)
        for node, dens in by_node.items():
            await self.send(node, JobDensities(job_id=self.job_id,
                                               plan_version=self.plan_version,
                                               densities=dens), ())

    async def set_codecs(self, codecs: Mapping[str, EdgeCodec]) -> None:
        """Re-adapt each edge's codec while the job runs (the per-link codec choice after
        links were re-measured): edge id -> its encoding or top-k density. Each edge's
        sending stage switches at its next forward; receivers answer as each forward came."""
        by_node: dict[str, tuple[dict[str, float], dict[str, str]]] = {}
        src_of = {e.edge: e.src_node for e in self.layout.edges()}
        for edge, c in codecs.items():
            if edge not in src_of:
                raise LocalError(f"edge {edge!r} is not a cut edge of job {self.job_id}")
            dens, encs = by_node.setdefault(src_of[edge], ({}, {}))
            dens[edge] = 1.0 if c.density is None else float(c.density)
            encs[edge] = c.encoding
        for node, (dens, encs) in by_node.items():
            await self.send(node, JobDensities(job_id=self.job_id,
                                               plan_version=self.plan_version,
                                               densities=dens, encodings=encs), ())
            self._encodings.update(encs)

    async def cancel(self, reason: str = "cancelled by the user") -> None:
        """Stop the job: every stage gets JobCancel; `run()` returns a failed outcome."""
        if self._failure is None:
            self._blame_silent = False
        self._fail("scheduler", -1, reason, stage=-1, fault=FAULT_SCHEDULER)

    def _fail(self, node: str, step: int, cause: str, stage: int | None = None,
              fault: str = FAULT_MACHINE, others: tuple[str, ...] = ()) -> None:
        if self._failure is None:
            st = self._node_stage.get(node, -1) if stage is None else stage
            self._failure = FailureReport(node, st, step, cause, fault, others)
            log.warning("%s", self._failure)
        self._done.set()

    def _on_step(self, peer: str, msg: StageStep) -> None:
        expected = self._step_of.get(msg.partition, self.first_step)
        if msg.step != expected:
            # A stage reports its steps in order, on one connection: a report of a later step
            # means earlier ones were lost on the way (a failed dial drops what was queued).
            # The history would have a hole: this attempt ends, and the restart resumes from
            # a checkpoint before it.
            if msg.step > expected:
                self._blame_silent = False  # the cause is known: no neighbour to blame
                self._fail(peer, expected, f"its reports of steps {expected}..{msg.step - 1} "
                           "never reached the scheduler (lost on the way)")
            return
        rep = StepReport.from_figures(msg.partition, msg.step, msg.figures)
        self._step_of[msg.partition] = msg.step + 1
        got = self._per_step.setdefault(msg.step, {})
        got[msg.partition] = rep
        if len(got) < len(self.stage_nodes):
            return
        now = time.perf_counter()
        m = merge_reports(list(got.values()), samples=self.spec.batch.size,
                          tokens=self.spec.batch.size * self.tokens_per_sample,
                          wall_s=now - self._last_step_t)
        self._last_step_t = now
        del self._per_step[msg.step]
        self._metrics.append(m)
        for e in m.edges:
            for direction, wire, dense in (("forward", e.forward_wire, e.forward_dense),
                                           ("backward", e.backward_wire, e.backward_dense)):
                tot = self._totals.setdefault((e.edge, direction), [0, 0])
                tot[0] += wire
                tot[1] += dense
        if self.on_step is not None:  # its owner logs the step (once: the job's record)
            self._held.append((m, time.monotonic()))
            self._hand_on()
            return
        every = max(1, self.spec.steps // 20)
        if (m.step + 1) % every == 0 or m.step + 1 == self.spec.steps:
            d = m.as_dict()
            rate = d["tokens_per_s"] or d["samples_per_s"] or 0.0
            log.info("job %s step %d/%d loss %s %.0f %s/s busy %s wire %d B/step", self.job_id,
                     m.step + 1, self.spec.steps, "-" if m.loss is None else f"{m.loss:.4f}",
                     rate, "tokens" if d["tokens_per_s"] else "samples",
                     " ".join(f"{v:.2f}" for _, v in sorted(m.stage_busy.items())),
                     m.wire_bytes)

    # -- the live held-out curve ---------------------------------------------------------

    def _evaluates(self, step: int) -> bool:
        """Whether the whole model after `step` is scored on the held-out split: the stages
        send their states then (`StageAssignment.sends_state`: checkpoints, `eval_interval`)
        and the job's data has a held-out split."""
        done = step + 1
        return (self.spec.data.heldout > 0 and done < self.spec.steps and not self._eval_warned
                and any(every > 0 and done % every == 0
                        for every in (self.spec.checkpoint_interval, self.spec.eval_interval)))

    def _hand_on(self, final: bool = False) -> None:
        """Hand the held steps to `on_step` in order, up to the first whose evaluation is still
        to come (`final`: all of them, evaluated or not: the attempt ended)."""
        while self._held:
            m, since = self._held[0]
            if not final and self._evaluates(m.step) and m.step not in self._evaluated \
                    and len(self._held) <= MAX_HELD_STEPS \
                    and time.monotonic() - since < MAX_HELD_WAIT_S:
                return
            self._held.pop(0)
            if self.on_step is not None:
                self.on_step(m)

    async def _end_evaluations(self) -> None:
        """Let the evaluations still running finish (at most `EVAL_END_WAIT_S`: the last
        points of the curve), then cancel and await the rest."""
        if self._eval_tasks:
            await asyncio.wait(set(self._eval_tasks), timeout=EVAL_END_WAIT_S)
        await cancel_and_wait(self._eval_tasks)

    def _heldout(self, state: Mapping[str, torch.Tensor]) -> float:
        """The held-out loss of the whole model `state` (off the event loop). The data is what
        the stages read: the arrays the submitter shipped, or this machine's own default
        corpus or synthetic images; never a path the job names."""
        if self._eval_source is None:
            d, c = self.spec.data, self.corpus
            arrays = None if c is None else c.shipped()
            if arrays is not None:
                source: Any = source_from_arrays(d, {k: v.numpy() for k, v in arrays.items()},
                                                 self.spec.seed)
            elif d.kind == "images" or c is None:  # synthetic, or in process (the submitter)
                source = make_source(d, self.spec.seed)
            elif c.default:
                source = make_source(replace(d, path=default_text_path()), self.spec.seed)
            else:
                raise LocalError("the job's data was not shipped to the scheduler")
            self._eval_source = source
        graph = self.captured.graph if self.captured is not None else None
        if graph is None:
            raise LocalError("the attempt was released")
        return graph_heldout_loss(graph, state, self.spec, self._eval_source,
                                  loss_name=self.layout.loss_name)

    async def _evaluate(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        """Score the model after `step` on the held-out split, put the figure in that step's
        record and hand on the steps it held. A failure is logged once and ends the job's
        evaluations, never the job."""
        try:
            loss: float | None = await asyncio.to_thread(self._heldout, state)
        except Exception as e:
            log.warning("job %s: no held-out evaluation after step %d (none from now on): %s",
                        self.job_id, step + 1, e)
            self._eval_warned = True
            loss = None
        for m in reversed(self._metrics):
            if m.step == step:
                m.held_out_loss = loss
                break
        if loss is not None:
            log.info("job %s step %d/%d held-out loss %.4f", self.job_id, step + 1,
                     self.spec.steps, loss)
        self._evaluated.add(step)
        self._hand_on()

    def release(self) -> None:
        """Drop what only a running attempt needs: the captured graph and initial weights,
        the corpus, the partitions' results and any half-gathered checkpoint. `status` still
        answers (its figures stay). For an attempt that ended (a finished job's record keeps
        its last coordinator for `fusionctl job`; idempotent)."""
        self.captured = None
        self.corpus = None
        self._eval_source = None
        self._results.clear()
        self._checkpoints.clear()

    def status(self) -> dict[str, Any]:
        """Live figures for `fusionctl job ID` and Prometheus (JSON-ready)."""
        last = self._metrics[-1] if self._metrics else None
        d = last.as_dict() if last is not None else {}
        # 1.0 = exact (as on the wire in EdgeRoute); the last step's figures win (re-adaptation)
        densities: dict[str, float] = {e.edge: e.density for e in self.layout.edges()}
        if last is not None:
            densities.update({e.edge: 1.0 if e.density is None else e.density
                              for e in last.edges})
        held = next((m for m in reversed(self._metrics) if m.held_out_loss is not None), None)
        return {
            "job_id": self.job_id,
            "state": self._state,
            "steps": self.spec.steps,
            "step": None if last is None else last.step,
            "loss": None if last is None else last.loss,
            "held_out_loss": None if held is None else held.held_out_loss,
            "held_out_step": None if held is None else held.step,
            "tokens_per_s": d.get("tokens_per_s"),
            "samples_per_s": d.get("samples_per_s"),
            "stages": [
                {"stage": s, "node": n,
                 "busy": None if last is None else last.stage_busy.get(s),
                 "wait": None if last is None else last.stage_wait.get(s)}
                for s, n in sorted(self.stage_nodes.items())
            ],
            "edges": [
                {"edge": e.edge, "src": e.src_partition, "dst": e.dst_partition,
                 "density": densities.get(e.edge),
                 "encoding": self._encodings.get(e.edge, e.encoding),
                 "wire_bytes": {k[1]: v[0] for k, v in self._totals.items() if k[0] == e.edge},
                 "dense_bytes": {k[1]: v[1] for k, v in self._totals.items() if k[0] == e.edge}}
                for e in self.layout.edges()
            ],
            "failure": None if self._failure is None else str(self._failure),
        }

    # -- the run --------------------------------------------------------------------------

    async def run(self) -> JobOutcome:
        """Assign, wait for Ready, start, and wait for the end (or the first failure)."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        captured = self.captured
        if captured is None:
            raise LocalError(f"job {self.job_id}: this attempt's coordinator was released; "
                             "a new attempt needs a new coordinator")
        self._state = "assigning"
        assigns = assign_parts(self.layout, self.spec, captured.state, term=self.term,
                               plan_version=self.plan_version, addresses=self.addresses,
                               corpus=self.corpus, recv_timeout_s=self.recv_timeout_s,
                               first_step=self.first_step)
        for node, (msg, _) in assigns.items():
            self._ready[node] = loop.create_future()
            self._request_ids[msg.request_id] = node
        try:
            for node, (msg, payload) in assigns.items():
                await self.send(node, msg, payload)
            ready_all: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.wait(list(self._ready.values())))
            done_wait: asyncio.Future[Any] = asyncio.ensure_future(self._done.wait())
            resend_s = max(ASSIGN_RESEND_MIN_S, self.ready_timeout_s / 4)
            deadline = loop.time() + self.ready_timeout_s
            try:  # every Ready in, the first failure, or the timeout
                while True:
                    left = deadline - loop.time()
                    done, _ = await asyncio.wait({ready_all, done_wait},
                                                 timeout=min(resend_s, max(0.0, left)),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if done or loop.time() >= deadline:
                        break
                    for node, (msg, payload) in assigns.items():
                        if not self._ready[node].done():
                            log.info("job %s v%d: no Ready from %s after %.0fs: its Assign "
                                     "again", self.job_id, self.plan_version, node,
                                     loop.time() - deadline + self.ready_timeout_s)
                            await self.send(node, msg, payload)
            finally:
                done_wait.cancel()
                ready_all.cancel()
            if self._failure is None:
                # Listed before anything is cancelled: every machine that never answered.
                late = sorted((n for n, f in self._ready.items() if not f.done()),
                              key=lambda n: self._node_stage.get(n, -1))
                if late:
                    self._blame_silent = False
                    self._fail(late[0], -1, f"no Ready within {self.ready_timeout_s:g}s from "
                               + ", ".join(f"{n} (stage {self._node_stage[n]})" for n in late)
                               + ": never answered its Assign", others=tuple(late[1:]))
            for f in self._ready.values():
                if not f.done():
                    f.cancel()
            if self._failure is None:
                log.info("job %s v%d: every stage Ready in %.2fs", self.job_id,
                         self.plan_version, time.perf_counter() - t0)
                self._state = "running"
                self._last_step_t = time.perf_counter()
                for node in assigns:
                    await self.send(node, JobStart(job_id=self.job_id,
                                                   plan_version=self.plan_version,
                                                   first_step=self.first_step), ())
                if self.on_running is not None:
                    self.on_running()
                await self._done.wait()
        except asyncio.CancelledError:
            await cancel_and_wait(self._eval_tasks)
            await self._cancel_all("the scheduler stopped")
            raise
        except Exception as e:
            log.exception("job %s: the scheduler's side of the attempt failed", self.job_id)
            self._fail("scheduler", -1, f"{type(e).__name__}: {e}", stage=-1,
                       fault=FAULT_SCHEDULER)
        await self._end_evaluations()
        self._hand_on(final=True)  # steps still waiting for an evaluation go on without it
        if self._failure is None:
            # Every stage finished: every step's reports must have come (a lost last report
            # would leave the history without the job's last steps).
            short = sorted(s for s in self.stage_nodes
                           if self._step_of.get(s, self.first_step) < self.spec.steps)
            if short:
                s = short[0]
                got = self._step_of.get(s, self.first_step)
                self._blame_silent = False
                self._fail(self.stage_nodes[s], got, f"it finished, but its reports of steps "
                           f"{got}..{self.spec.steps - 1} never reached the scheduler (lost on "
                           "the way)")
        if self._failure is not None and self._blame_silent and self._failure.stage >= 0:
            await self._find_silent()
        if self._failure is not None:
            self._state = "failed"
            await self._cancel_all(self._failure.cause)
            return JobOutcome(self.job_id, False, self._metrics, None, self._failure,
                              time.perf_counter() - t0, dict(self.stage_nodes))
        try:
            state = await asyncio.to_thread(_gather, captured.graph, dict(self._results))
        except Exception as e:  # the results make no model (bad bytes, copies that diverged)
            self._fail("scheduler", -1, f"gathering the stages' results failed: {e}", stage=-1,
                       fault=FAULT_SCHEDULER)
            assert self._failure is not None
            self._state = "failed"
            return JobOutcome(self.job_id, False, self._metrics, None, self._failure,
                              time.perf_counter() - t0, dict(self.stage_nodes))
        self._state = "done"
        return JobOutcome(self.job_id, True, self._metrics, state, None,
                          time.perf_counter() - t0, dict(self.stage_nodes))

    async def _find_silent(self) -> None:
        """A stage that times out waiting may only be a victim: its neighbour (or the one behind
        it) died. Give the others `failure_grace_s` to report; if some stage stays silent while
        every other one failed, the silent one is the first failure."""
        deadline = time.perf_counter() + self.failure_grace_s
        stages = set(self.stage_nodes)
        while len(self._reported) < len(stages) - 1:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self._result_arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._result_arrived.wait()
        silent = sorted(stages - self._reported)
        if len(silent) == 1 and self._failure is not None:
            s = silent[0]
            first = self._failure
            self._failure = FailureReport(
                self.stage_nodes[s], s, self._step_of.get(s, first.step),
                f"stopped responding (its neighbours timed out; first: {first.cause})",
            )
            log.warning("%s", self._failure)

    async def _cancel_all(self, reason: str) -> None:
        # The failed node too: if the failure detector was wrong, it must not keep a zombie
        # stage; if it is dead, the send is dropped (bounded by the timeout below).
        for node in self.stage_nodes.values():
            try:
                async with asyncio.timeout(5.0):
                    await self.send(node, JobCancel(job_id=self.job_id, reason=reason,
                                                    plan_version=self.plan_version), ())
            except (TimeoutError, LocalError, OSError) as e:
                log.info("JobCancel to %s not sent: %s", node, e)


def save_checkpoint(output: Path, step: int, state: Mapping[str, torch.Tensor]) -> Path:
    """Write the whole model after `step` as `checkpoint-<steps done>.safetensors`."""
    return save_model(output / f"checkpoint-{step + 1}.safetensors", state,
                      metadata={"step": str(step)})


def write_outputs(outcome: JobOutcome, output: Path) -> dict[str, Path]:
    """Write `model.safetensors` (if the job succeeded) and `metrics.json` under `output`."""
    paths: dict[str, Path] = {}
    if outcome.state is not None:
        paths["model"] = save_model(output / "model.safetensors", outcome.state,
                                    metadata={"job_id": outcome.job_id})
    paths["metrics"] = write_metrics(output / "metrics.json",
                                     [m.as_dict() for m in outcome.metrics], outcome.summary())
    return paths
