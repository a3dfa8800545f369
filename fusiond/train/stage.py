"""The stage executor: one partition's forward/backward tasks, its optimizer, its links.

A `StageExecutor` owns one built partition (`StageProgram`) and its optimizer. Per iteration it
runs its tasks in the pipeline schedule's order (`fusiond.train.schedule`); each task starts
when its inputs are there:

- forward of micro-batch m: every incoming edge's tensor for m has arrived (plus the local data
  if this stage reads it). Received tensors become leaves that require grad (remote autodiff).
- backward of m: every outgoing edge's gradient for m has arrived (the loss stage starts the
  backward from `loss / M`, so gradients accumulate into the mean over micro-batches, exactly as
  gradient accumulation in one process).

A whole step runs as one loop on the stage's compute thread (issue 15): it waits for a task's
inputs on a condition variable that `deliver` (on the event loop) signals, decodes, runs,
encodes and hands the results to the event loop, which only moves bytes. The loop keeps
receiving while a task runs, and a task starts a wake-up after its last input arrived instead
of after a chain of futures, executor submissions and coroutine resumptions (docs/runtime.md
has the measurements). Results leave through one bounded outbound queue per destination stage
and a sender task that calls `StageLink.send`: computing micro-batch m overlaps sending m-1, and
a full queue (a slow link) blocks the compute loop (backpressure).

After the last backward, parameters that several stages hold (tied weights such as GPT-2's
embedding and LM head) exchange gradients, each holder sums them in stage order (so every copy
stays bit-identical), and the optimizer steps.

Top-k edges: forward sends TOPK and the sender keeps the kept indices per (edge, micro-batch); the
receiver learns them from the payload and answers with a VALUES gradient at those indices only.
Quantized edges (`EdgeSpec.encoding`: "bf16", "int8", "int4"): forward sends the activation so
encoded (nearest rounding), the receiver decodes it dense and answers with the gradient at the
decoded activation encoded the same way (straight-through), int8 and int4 with stochastic
rounding so the gradient that arrives is unbiased (`codec.encode_edge`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import inspect
import logging
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from fusiond.errors import LocalError, RemoteError
from fusiond.graph import mutated_buffers
from fusiond.heap import near_limit
from fusiond.plan.model import bucket_bytes
from fusiond.tasks import cancel_and_wait
from fusiond.train import codec
from fusiond.train.data import Batch, DataSource, split_micro_batches
from fusiond.train.device import DeviceError, StagePlace
from fusiond.train.lowrank import LowRankState, compressed
from fusiond.train.offload import (
    DiskOptimizerState,
    DiskParameters,
    OffloadError,
    step_in_chunks,
    trim_heap,
)
from fusiond.train.optim import lr_at, make_optimizer, set_lr
from fusiond.train.schedule import Phase, Task
from fusiond.train.segments import SegmentRunner
from fusiond.train.spec import OptimizerSpec
from protocol.errors import LocalProtocolError
from protocol.messages import (
    MAX_STEP_BUCKETS,
    MAX_STEP_TASKS,
    MAX_TASK_NAME_BYTES,
    EdgeFigures,
    StepFigures,
)

__all__ = [
    "FAULT_JOB",
    "FAULT_MACHINE",
    "EdgeSpec",
    "EdgeStats",
    "Packet",
    "PacketKind",
    "StageConfig",
    "StageError",
    "StageExecutor",
    "StageLink",
    "StageProgram",
    "StepReport",
    "TaskTiming",
    "fault_of",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


FAULT_JOB = "job"
"""A failure that is the job's own: its model's computation or its data raised (a shape, an
index, a dtype error). It would fail on any machine: no machine is to blame, no restart helps."""
FAULT_MACHINE = "machine"
"""A failure of a machine or a link: a timeout, a lost or misbehaving peer, out of memory."""


PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}
"""A stage's compute precisions -> the autocast dtype (None: float32 throughout). fp16 runs
with a dynamic loss scale every stage of the job agrees on (`LossScale`)."""


@dataclass
class LossScale:
    """fp16's dynamic loss scale, as torch's GradScaler keeps it, held by every stage of a job
    and kept identical on all of them: the loss stage scales the loss by `scale` before its
    backward (the gradients that cross the cut edges are scaled with it); after a step's last
    backward every stage tells every other whether its parameters' gradients are all finite
    (`StageExecutor._agree_overflow`), and all of them then skip the step together (gradients
    dropped, scale x `backoff`) or unscale their gradients and step (the scale x `growth`
    after `interval` steps in a row without one). The defaults are GradScaler's."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000
    good: int = 0
    """Steps since the last overflow or growth."""
    skipped: int = 0
    """Steps skipped for an overflow, in all."""

    def update(self, overflow: bool) -> None:
        """After a step: every stage calls it with the same agreed `overflow`."""
        if overflow:
            self.scale *= self.backoff
            self.good = 0
            self.skipped += 1
            return
        self.good += 1
        if self.good >= self.interval:
            self.scale *= self.growth
            self.good = 0


STEP_CHUNK_TENSORS = 4
"""Parameters a stage without segments steps together when its optimizer state is on disk."""

RUN_AHEAD_STEPS = 2
"""How many steps the compute thread may finish before the event loop has handled their
reports (`StageExecutor.run`): it goes on to the next step at once instead of handing the
turn to the loop and back (two cross-thread wake-ups and the report's send on every stage's
step boundary, docs/runtime.md), and stops here when the loop falls this far behind."""


class StageError(LocalError):
    """A stage task failed or waited too long; the message names the stage, step and task.
    `fault` says whose fault it is (`FAULT_JOB` or `FAULT_MACHINE`)."""

    def __init__(self, message: str, fault: str = FAULT_MACHINE) -> None:
        super().__init__(message)
        self.fault = fault


_INPUT_TIMEOUT = re.compile(r"stage \d+, step \d+, \S+: no (forward|backward) on edge '.*' "
                            r"within [0-9.e+]+s")
"""The message of a stage that waited too long for an input (`Stage._recv`)."""


def is_input_timeout(cause: str) -> bool:
    """Whether a failure's cause is a stage that waited too long for an input: its machine
    is alive (it reported); a neighbour, or the link to it, failed."""
    return _INPUT_TIMEOUT.search(cause) is not None


_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def fault_of(exc: BaseException) -> str:
    """Whose fault an exception raised while running a stage is: a `StageError` says so; out
    of memory (MemoryError, torch's OutOfMemoryError, the CPU allocator's RuntimeError), a
    peer's bad bytes (RemoteError, a protocol error) and OS/connection errors are the
    machine's; anything else the job's computation raised (IndexError, a shape mismatch, ...)
    is the job's own."""
    from protocol.errors import RemoteProtocolError

    if isinstance(exc, StageError):
        return exc.fault
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError, RemoteError, RemoteProtocolError,
                        OSError, TimeoutError)):
        return FAULT_MACHINE
    if isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT):
        return FAULT_MACHINE
    return FAULT_JOB


class PacketKind(enum.StrEnum):
    """What a packet carries."""

    FORWARD = "forward"  # an activation on an edge, src -> dst
    BACKWARD = "backward"  # the gradient of an edge, dst -> src
    PARAM_GRAD = "param_grad"  # the gradient of a parameter several stages hold


@dataclass(frozen=True)
class Packet:
    """One tensor between two stages. `edge` is the edge id, or the parameter name for
    PARAM_GRAD; `payload` is a `protocol.tensors` encoding: one buffer as received, or the
    sender's gather list (`codec.Encoded.parts`, no copy) on its way out."""

    kind: PacketKind
    step: int
    micro: int
    edge: str
    src: int
    dst: int
    payload: bytes | memoryview | tuple[memoryview, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the encoding."""
        if isinstance(self.payload, tuple):
            return sum(p.nbytes for p in self.payload)
        return memoryview(self.payload).nbytes

    def buffers(self) -> tuple[bytes | memoryview, ...]:
        """The encoding as a gather list for `PeerNetwork.send` (no copy)."""
        return self.payload if isinstance(self.payload, tuple) else (self.payload,)

    def data(self) -> bytes | memoryview:
        """The encoding as one buffer, for decoding (joins a gather list: a copy)."""
        return b"".join(self.payload) if isinstance(self.payload, tuple) else self.payload


class StageLink(Protocol):
    """How a stage reaches the others: in-memory queues in tests, `PeerNetwork` in the daemon.

    `send` returns once the packet is queued for the destination; it awaits (backpressure) while
    the link's queue is full. The link delivers incoming packets to `StageExecutor.deliver`.
    """

    async def send(self, packet: Packet) -> None:
        """Queue `packet` for `packet.dst`."""
        ...


SendNow = Callable[[Packet], bool]
"""A link's optional `send_now(packet)`: write the packet at once when its way is idle (True),
or do nothing (False: `send` it)."""


@dataclass(frozen=True)
class EdgeSpec:
    """A cut edge from stage `src` to stage `dst`; `density` None means not top-k: the edge
    travels as `encoding` says, "raw" (exact) or "bf16", "int8", "int4" (activation and
    gradient so encoded, decoded dense; straight-through). A quantized edge is never top-k.

    `per_row`: top-k per row of the last axis rather than over the whole tensor.
    """

    edge_id: str
    src: int
    dst: int
    density: float | None = None
    per_row: bool = True
    encoding: codec.EdgeEncoding = "raw"

    def __post_init__(self) -> None:
        if self.encoding not in codec.EDGE_ENCODINGS:
            raise StageError(f"edge {self.edge_id!r}: encoding {self.encoding!r} is not one of "
                             f"{list(codec.EDGE_ENCODINGS)}")
        if self.encoding != "raw" and self.density is not None:
            raise StageError(f"edge {self.edge_id!r}: a {self.encoding} edge cannot also be top-k "
                             f"(density {self.density})")


def _grad_seed(step: int, micro: int, edge_id: str) -> int:
    """The stochastic rounding seed of a gradient: fixed per (step, micro-batch, edge), so a
    run repeats bit for bit and no two gradients share their draws."""
    return zlib.crc32(f"{step}:{micro}:{edge_id}".encode())


RunFn = Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]]


@dataclass
class StageProgram:
    """A runnable partition and its boundary.

    `run(inputs)` takes the incoming edge ids (plus "inputs"/"targets", or a field's name
    such as "attention_mask", for the data this stage reads) and returns the outgoing edge
    ids (plus "loss" on the loss stage). Two outgoing edges may map to the same tensor
    (fan-out); their gradients are summed by autograd.
    `shared` maps a parameter name of `module` to the other stages holding a copy of it.
    """

    module: nn.Module
    run: RunFn
    in_edges: tuple[EdgeSpec, ...]
    out_edges: tuple[EdgeSpec, ...]
    data_inputs: tuple[str, ...] = ()
    has_loss: bool = False
    shared: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    seed_random: Callable[[int, int], None] | None = None
    """Called with (step, micro-batch) before each forward: keys the module's random ops."""
    segments: SegmentRunner | None = None
    """Where `run` goes segment by segment (per-block checkpointing): its hooks let the
    parameter offload follow the forward and the backward."""


@dataclass(frozen=True)
class StageConfig:
    """Knobs of one executor; every wait is bounded."""

    recv_timeout_s: float = 120.0
    """Longest wait for one task's inputs before the job fails naming the missing edges."""
    send_queue: int = 8
    """Outbound packets queued per destination stage before compute waits (backpressure)."""
    disabled_ops: frozenset[str] = frozenset()
    """Ops this daemon's operator disabled (`jobs.disabled_ops`): an Assign whose partition
    uses one is refused, naming it (`fusiond.graph.registry.check_ops`)."""
    inbox_bytes: int = 2 << 30
    """Most bytes of received packets waiting for their task (early ones included: a
    neighbour may start a step before this stage has); beyond it the attempt fails."""
    inbox_slack: int = 64
    """Packets allowed to wait beyond two steps' worth of this stage's inputs (the most a
    correct neighbour can send ahead); beyond it the attempt fails."""
    precision: str = "fp32"
    """The compute dtype of the stage's forward: "fp32", "bf16" or "fp16" (mixed precision:
    the forward under `torch.autocast` to that dtype, the weights, their gradients and the
    optimizer in float32; bf16 and fp16 activations travel in their 16 bits). fp16 keeps a
    dynamic loss scale every stage agrees on (`LossScale`; the executor's `job_slots`)."""
    loss_scale: float = 2.0**16
    """fp16: the loss scale the job starts at (`LossScale.scale`)."""
    recompute: bool = False
    """Activation checkpointing of the whole stage: a forward keeps only its inputs (no
    autograd graph, none of its activations); the backward runs the forward again with
    autograd first, keyed to the same random draws and from the buffers as they were, so
    losses, gradients and updates are those of the plain run. Costs one more forward per
    micro-batch; holds one micro-batch's activations at a time instead of every in-flight
    one's."""
    offload_dir: Path | None = None
    """Keep the optimizer's state (AdamW's moments, SGD's momentum) in memory-mapped files
    under this directory instead of memory (`fusiond.train.offload`): the same updates, bit
    for bit; the state is read and written once per step and costs no memory between steps.
    None: in memory."""
    grad_buckets: int = 0
    """The buckets a set of replicas' shared gradients are reduced in, one after another and
    during the step's last backward where it can (the plan's `SyncReport.buckets`; about
    equal bytes each, whole parameters); 0: `fusiond.plan.model.bucket_bytes` each."""
    grad_groups: tuple[tuple[int, ...], ...] = ()
    """The bandwidth groups of the slots that replicate this stage (the plan's
    "hierarchical" reduction, `SyncReport.scheme`): their shared gradients are summed inside
    each group, then among the groups' first slots, which send the total back to their
    group (`_hier_sum`); empty: one ring over every holder."""
    grad_two_level: bool = False
    """With `grad_groups`: reduce them two-level instead (the plan's "two-level" scheme,
    `_two_level_sum`): the gradient cut in as many shards as the smallest group has slots,
    each shard summed inside each group by its owner there, then across the groups by a ring
    of its owners (each shard on its own slots' links), then sent back inside the groups."""
    offload_params: bool = False
    """Keep the parameters and their gradients in memory-mapped files under `offload_dir`
    too (`fusiond.train.offload.DiskParameters`; with the optimizer state there): with a
    segmented program (`StageProgram.segments`) only the segments next to the running one are
    resident, and the optimizer steps one segment at a time. Bit-exact."""
    trim_heap: bool = False
    """Give the C heap's free pages back after every backward task and update
    (`fusiond.train.offload.trim_heap`), so the stage's peak is the training state the
    memory planner counts, not that plus the allocator's fragmentation. On whenever a memory
    decision is (recompute, segments, offload)."""
    device: str = "cpu"
    """Where the stage computes (`fusiond.train.device.StagePlace`): "cpu", or "cuda:N" (its
    weights, optimizer state and received tensors there; copies on their own streams). The
    program's module must already be on it."""
    memory_limit_bytes: float | None = None
    """The memory this process may hold before the kernel kills it (its cgroup's limit,
    `fusiond.profile.memory_allowance`; None: none known). Without `trim_heap`, the stage
    trims the heap after a backward or an update only when the process's resident anonymous
    memory is past `fusiond.heap.HIGH_WATER` of it: free where there is room (trimmed pages
    fault in again, 15 % of a step when trimmed after every task), within the plan where
    there is not."""


@dataclass
class EdgeStats:
    """Bytes this stage sent on one edge in one direction during one step."""

    edge: str
    kind: PacketKind
    peer: int
    wire_bytes: int = 0
    dense_bytes: int = 0
    density: float | None = None


MAX_TIMELINE = MAX_STEP_TASKS
"""The most task timings one step report may carry (a StageStep from the network)."""


@dataclass(frozen=True)
class TaskTiming:
    """One task of one step on one stage, in seconds from the step's start."""

    task: str
    ready_s: float
    """Its inputs were all in (its turn came, or the last input arrived)."""
    start_s: float
    """The compute thread began it."""
    end_s: float
    """The compute thread finished it (its outputs encoded; queuing them is `send_s`)."""
    wait_s: float
    """How long the stage waited for this task's inputs with nothing else to do."""
    cpu_s: float = 0.0
    """CPU time of the compute thread during the task (start to end); `end_s - start_s - cpu_s`
    is time the thread could not run: the GIL held elsewhere, or no core free."""
    kernel_s: float = 0.0
    """Seconds in the model's own computation: the partition's forward, or autograd's backward."""
    codec_s: float = 0.0
    """Seconds decoding the inputs and encoding the outputs (`fusiond.train.codec`)."""
    send_s: float = 0.0
    """Seconds after `end_s` that handing the outputs to the outbound queues took (blocked
    while a queue was full: a slow link's backpressure)."""

    @property
    def dispatch_s(self) -> float:
        """From the inputs being in (or the stage free) to the compute thread starting it."""
        return max(0.0, self.start_s - self.ready_s)

    @property
    def overhead_s(self) -> float:
        """The runtime's own cost of this task: everything from its inputs being in to its
        outputs being queued that is not the model's computation (dispatch, decode, encode,
        bookkeeping, waiting for the GIL or a core, backpressure)."""
        return max(0.0, self.end_s - self.ready_s + self.send_s - self.kernel_s)


@dataclass
class StepReport:
    """What one stage did in one step."""

    stage: int
    step: int
    loss: float | None
    lr: float
    wall_s: float
    busy_s: float
    edges: list[EdgeStats]
    timeline: list[TaskTiming] = field(default_factory=list)
    """Per task, in run order: when its inputs were in, when it ran (seconds from the step's
    start); the first `MAX_TIMELINE` tasks of a step; empty when a report came without one."""
    start_mono: float | None = None
    """The step's start on this host's monotonic clock (`time.perf_counter`): lines up the
    timelines of stages that share a clock (hosts of one machine, as in the testbed)."""
    wait_s: float = 0.0
    """Seconds this stage sat waiting for its inputs (from the previous task's end, or the
    step's start, until the last input arrived), over all of the step's tasks."""
    buckets_early: int = 0
    """Gradient buckets whose reduction began while the step's last backward still ran."""
    reduce_exposed_s: float = 0.0
    """Seconds the step spent reducing its shared gradients after its last task (what the
    backward did not hide)."""
    reduce_cpu_s: float = 0.0
    """CPU seconds the reducer thread spent on the step's reduction (`time.thread_time`: that
    thread's own, not torch's intra-op workers'): where it ran beside the last backward, what
    it took from that backward's cores."""
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    """A copy of the partition's parameters and buffers as this step left them, taken on the
    compute thread before the next step (`StageExecutor.run`'s `snapshot`); never sent in
    `to_figures`."""

    @property
    def busy_fraction(self) -> float:
        """Share of the step's wall time this stage's worker spent computing."""
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_figures(self) -> StepFigures:
        """This report as `StageStep.figures` (the typed wire schema)."""
        return StepFigures(
            lr=self.lr, wall_s=self.wall_s, busy_s=self.busy_s, loss=self.loss,
            edges=tuple(EdgeFigures(e.edge, str(e.kind), e.peer, e.wire_bytes, e.dense_bytes,
                                    e.density) for e in self.edges),
            timeline=tuple((t.task.encode()[:MAX_TASK_NAME_BYTES].decode(errors="ignore"),
                            round(t.ready_s, 6), round(t.start_s, 6), round(t.end_s, 6),
                            round(t.wait_s, 6)) for t in self.timeline[:MAX_TIMELINE]),
            start_mono=self.start_mono, wait_s=self.wait_s,
            costs=tuple((round(t.cpu_s, 6), round(t.kernel_s, 6), round(t.codec_s, 6),
                         round(t.send_s, 6)) for t in self.timeline[:MAX_TIMELINE]),
            buckets_early=self.buckets_early, reduce_exposed_s=self.reduce_exposed_s,
            reduce_cpu_s=self.reduce_cpu_s)

    @classmethod
    def from_figures(cls, stage: int, step: int, figures: StepFigures) -> StepReport:
        """Rebuild a report from `StageStep.figures` (the schema checked types and bounds on
        decode); `RemoteError` names an edge kind that is not one."""
        where = f"StageStep.figures from stage {stage}"
        for name in ("wall_s", "busy_s", "wait_s", "reduce_exposed_s", "reduce_cpu_s"):
            v = getattr(figures, name)
            if not 0.0 <= v < float("inf"):
                raise RemoteError(f"{where}: {name} is {v}, not a duration")
        if not 0 <= figures.buckets_early <= MAX_STEP_BUCKETS:
            raise RemoteError(f"{where}: buckets_early is {figures.buckets_early}, not a count "
                              f"in [0, {MAX_STEP_BUCKETS}]")
        for e in figures.edges:
            if e.wire_bytes < 0 or e.dense_bytes < 0:
                raise RemoteError(f"{where}: edge {e.edge!r} has negative byte counts")
            if e.density is not None and not 0.0 < e.density <= 1.0:
                raise RemoteError(f"{where}: edge {e.edge!r} density {e.density} not in (0, 1]")
        try:
            edges = [EdgeStats(e.edge, PacketKind(e.kind), e.peer, e.wire_bytes, e.dense_bytes,
                               e.density) for e in figures.edges]
        except ValueError as e:
            raise RemoteError(f"{where}: bad edge kind: {e}") from e
        if figures.costs and len(figures.costs) != len(figures.timeline):
            raise RemoteError(f"{where}: costs has {len(figures.costs)} rows for "
                              f"{len(figures.timeline)} timeline rows")
        for row in figures.costs:
            if not all(0.0 <= v < float("inf") for v in row):
                raise RemoteError(f"{where}: costs row {row} holds a value that is not a duration")
        costs = figures.costs or ((0.0, 0.0, 0.0, 0.0),) * len(figures.timeline)
        timeline = [TaskTiming(*row, *c) for row, c in zip(figures.timeline, costs, strict=True)]
        return cls(stage, step, figures.loss, figures.lr, figures.wall_s, figures.busy_s, edges,
                   timeline, figures.start_mono, figures.wait_s,
                   buckets_early=figures.buckets_early,
                   reduce_exposed_s=figures.reduce_exposed_s,
                   reduce_cpu_s=figures.reduce_cpu_s)


@dataclass
class _Ctx:
    """What a forward keeps for its backward."""

    leaves: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    recv_idx: dict[str, np.ndarray]
    sent_idx: dict[str, np.ndarray]
    grad_edges: set[str]  # outgoing edges whose receiver answers with a gradient
    inputs: dict[str, torch.Tensor] | None = None
    """With recompute: the forward's inputs, to run it again in the backward."""
    buffers_before: list[torch.Tensor] | None = None
    """With recompute: the updated buffers as the forward found them."""
    recv_enc: dict[str, codec.EdgeEncoding] = field(default_factory=dict)
    """Incoming dense edges that arrived quantized: the gradient goes back the same way."""
    recv_basis: dict[str, np.ndarray] = field(default_factory=dict)
    """Incoming low-rank edges: their basis Q (the gradient goes back as G Q)."""
    sent_basis: dict[str, np.ndarray] = field(default_factory=dict)
    """Outgoing low-rank edges: the basis Q sent (the answer G Q comes back as G Q Q^T)."""


_Key = tuple[PacketKind, int, int, str]
"""(kind, step, micro-batch (or sending stage for PARAM_GRAD), edge or parameter name)."""


@dataclass(frozen=True)
class _Need:
    """What a reduction in progress waits for: every packet of `keys`, by `deadline`
    (`time.monotonic()`); `what` names the reduction in the error where they do not come."""

    keys: tuple[_Key, ...]
    what: str
    deadline: float


_Red = Generator[_Need, list[bytes | memoryview], T]
"""A gradient reduction as the reducer thread runs it (`StageExecutor._reduce_buckets`): it
yields each set of packets it needs and is sent their payloads, in the keys' order, and
returns its result. Several run interleaved on that one thread, each resumed once its
packets are in, so one bucket's wait on a slow link is another's turn at the CPU."""


def _is_float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


@dataclass
class _Cost:
    """Where one task's compute time went (seconds)."""

    kernel_s: float = 0.0
    codec_s: float = 0.0


class _Outbound:
    """One destination's outbound packets: put by the compute thread, which blocks while
    `capacity` packets are queued or being sent (backpressure), and sent by the destination's
    sender task on the event loop."""

    def __init__(self, capacity: int) -> None:
        self._slots = threading.Semaphore(max(1, capacity))
        self._lock = threading.Lock()
        self._queue: deque[Packet] = deque()
        self._aborted = False
        self.pending = 0
        """Packets queued or being sent."""
        self.sending = False
        """The sender task holds a popped packet it has not handed to the link yet."""
        self.ready = asyncio.Event()
        """Set (on the event loop) when packets wait for the sender."""
        self.drained = asyncio.Event()
        """Set when the last pending packet has been handed to the link."""

    def put(self, pkt: Packet, wake: Callable[[], None] | None = None) -> bool:
        """Queue `pkt` (compute thread); False once aborted. When the queue is full, `wake`
        is called before blocking (the sender must be woken for the packets already queued,
        or a task with more packets for one peer than the queue holds waits for ever)."""
        if not self._slots.acquire(blocking=False):
            if wake is not None:
                wake()
            while not self._slots.acquire(timeout=_ABORT_POLL_S):
                if self._aborted:
                    return False
        if self._aborted:
            self._slots.release()
            return False
        with self._lock:
            self._queue.append(pkt)
            self.pending += 1
        return True

    def pop(self) -> Packet | None:
        """The next packet to send (event loop), or None."""
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def unpop(self, pkt: Packet) -> None:
        """Put a popped packet back first in line (event loop): it was not sent."""
        with self._lock:
            self._queue.appendleft(pkt)

    def done(self) -> None:
        """A popped packet was handed to the link (or failed to be)."""
        with self._lock:
            self.pending -= 1
            left = self.pending
        self._slots.release()
        if left == 0:
            self.drained.set()

    def abort(self) -> None:
        """Stop taking packets: a blocked `put` returns False (within `_ABORT_POLL_S`), and a
        `flush` waiting for the queue to drain stops waiting (event loop)."""
        self._aborted = True
        self.drained.set()


_Q_ROUND = "q"
"""The suffix of a bucket's round name for its low-rank Q factors (the P factors and the
dense gradients go in the bucket's own round)."""
BUCKETS_IN_FLIGHT = 32
"""Buckets a stage reduces at once, interleaved on its reducer thread
(`StageExecutor._reduce_buckets`): `fusiond.plan.pipeline`'s constant of the same name (a
test holds them equal)."""
RING_MIN_HOLDERS = 3
"""A shared parameter with at least this many holders is summed by a ring (two holders: one
exchange of the whole gradient each way is already the least)."""


@dataclass(frozen=True)
class _Bucket:
    """Gradients one set of holders sums in one round (`_exchange`), named `round` on the
    wire; the same on every holder (the order of the names, the split, the name)."""

    round: str
    holders: tuple[int, ...]
    names: tuple[str, ...]


@dataclass
class _Overlap:
    """A step's reduction running beside its last backward (`StageExecutor._start_overlap`):
    the reducer's future, an event per bucket (its gradients final), the gradient hooks, and
    the backward's end."""

    future: Future[tuple[dict[str, torch.Tensor], int, float]]
    ready: list[threading.Event]
    hooks: list[Any]
    done: threading.Event
    wake: Callable[[], None]
    """Wakes the reducer where it waits (`StageExecutor._next_turn`)."""

    def backward_ended(self) -> None:
        """Every gradient is final (also after a failed task: the reducer must not wait)."""
        self.done.set()
        for h in self.hooks:
            h.remove()
        for ev in self.ready:
            ev.set()
        self.wake()


def _flatten(ts: Mapping[str, torch.Tensor], names: Sequence[str]) -> torch.Tensor:
    """The names' tensors one after another, flat in float32 (a copy: `_unflatten`'s input)."""
    return torch.cat([ts[n].detach().reshape(-1).to(torch.float32) for n in names])


def _unflatten(flat: torch.Tensor, names: Sequence[str], like: Mapping[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """`flat` (the names' tensors one after another, float32) as each name's tensor, in the
    shape and dtype of `like[name]` (views where the dtype matches)."""
    out: dict[str, torch.Tensor] = {}
    at = 0
    for n in names:
        k = like[n].numel()
        out[n] = flat[at:at + k].view_as(like[n]).to(like[n].dtype)
        at += k
    return out


def _hier_tags(groups: tuple[tuple[int, ...], ...]) -> list[str]:
    """Every round-name suffix a hierarchical sum over `groups` sends: each group's ring
    (`_ring_tag`), the ring of the groups' first slots, the totals sent back."""
    leaders = tuple(g[0] for g in groups)
    tags = [_ring_tag(g, k) for g in groups if len(g) > 1 for k in range(2 * (len(g) - 1))]
    tags += [_ring_tag(leaders, k) for k in range(2 * (len(leaders) - 1))]
    return [*tags, _bcast_tag(groups)]


def _two_level_tags(groups: tuple[tuple[int, ...], ...]) -> list[str]:
    """Every round-name suffix a two-level sum over `groups` sends: the shards to their
    owners and back inside the groups, and each shard's ring among its owners."""
    rs, ag = _shard_tags(groups)
    tags = [rs, ag]
    for owners in _shard_owners(groups):
        tags += [_ring_tag(owners, k) for k in range(2 * (len(owners) - 1))]
    return tags


def _shard_owners(groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    """A two-level sum's shard j (as many as the smallest group has slots): its owner in each
    group (the group's j-th slot), in slot order."""
    shards = min(len(g) for g in groups)
    return [tuple(sorted(g[j] for g in groups)) for j in range(shards)]


def _shard_tags(groups: tuple[tuple[int, ...], ...]) -> tuple[str, str]:
    """The round-name suffixes of a two-level sum's shards sent to their owners, and of the
    totals sent back."""
    crc = zlib.crc32("|".join(",".join(map(str, g)) for g in groups).encode())
    return f"@t{crc:08x}>", f"@t{crc:08x}<"


def _bcast_tag(groups: tuple[tuple[int, ...], ...]) -> str:
    """The round-name suffix of a hierarchical sum's totals sent back inside the groups."""
    crc = zlib.crc32("|".join(",".join(map(str, g)) for g in groups).encode())
    return f"@h{crc:08x}"


def _ring_tag(holders: tuple[int, ...], k: int) -> str:
    """The round-name suffix of step `k` of the ring over `holders`: the same on every
    holder, distinct per ring (their count and a CRC-32 of their slots: short however many
    there are) and per step."""
    crc = zlib.crc32(",".join(map(str, holders)).encode())
    return f"@{len(holders)}x{crc:08x}/{k}"


_OVERFLOW = "#fp16"
"""The PARAM_GRAD round in which every slot of an fp16 job says whether its gradients
overflowed this step."""
"""A PARAM_GRAD packet's name is otherwise its bucket's round (`_Bucket.round`: the dense
gradients and low-rank P factors, then `_Q_ROUND` for the Q factors), with a ring's step
tag where the bucket's holders are 3 or more."""

_ABORT_POLL_S = 0.05
"""How often a compute thread blocked on a full outbound queue checks for an abort."""


class StageExecutor:
    """Runs one partition's tasks for a number of steps; a service (start/ready/close).

    The host (test harness or daemon) delivers every packet addressed to this stage with
    `deliver`, and calls `run_step(step)` for each step, or `run(first, count)`.
    """

    def __init__(
        self,
        *,
        stage: int,
        program: StageProgram,
        link: StageLink,
        tasks: Sequence[Task],
        micro_batches: int,
        optimizer: OptimizerSpec,
        total_steps: int,
        data: DataSource | None = None,
        batch_size: int = 0,
        config: StageConfig | None = None,
        first_step: int = 0,
        slot: int | None = None,
        routes: Mapping[int, Sequence[int]] | None = None,
        grad_rank: int | None = None,
        grad_seed: int = 0,
        grad_warmup_steps: int = 0,
        job_slots: Sequence[int] = (),
        micro_batch_sizes: Sequence[int] = (),
    ) -> None:
        if program.data_inputs and (data is None or batch_size <= 0):
            raise StageError(f"stage {stage} reads {program.data_inputs} but has no data source")
        self.stage = stage
        self.slot = stage if slot is None else slot
        """Where packets for this executor are addressed: the stage itself, or with replicas
        (several executors running one stage, each on its share of the micro-batches) an id
        of its own; `routes[stage][micro]` is the slot that runs `micro` of `stage` (a stage
        absent from `routes` runs everything in the slot numbered like it). `tasks` name the
        micro-batches of the whole iteration this executor runs; a replicated stage's
        parameters are in `program.shared` with its other replicas' slots."""
        if grad_rank is not None and grad_rank < 1:
            raise StageError(f"stage {stage}: grad_rank {grad_rank} is not >= 1 (None: shared "
                             "gradients travel dense)")
        self.grad_rank = grad_rank
        """Shared (replicated, tied) gradients of matrices travel as rank-`grad_rank` factors
        with error feedback (`fusiond.train.lowrank`: two rounds a step); None: dense."""
        self._lowrank = LowRankState(grad_rank, grad_seed) if grad_rank is not None else None
        self.grad_warmup_steps = max(0, grad_warmup_steps)
        """Steps before low-rank starts: the first ones reduce dense (the start of training is
        the most sensitive to inexact gradients; torch's PowerSGD hook's start_powerSGD_iter).
        Every holder counts the same steps, so they agree on how each step travels."""
        self._routes = {k: tuple(v) for k, v in (routes or {}).items()}
        for k, v in self._routes.items():
            if len(v) != micro_batches:
                raise StageError(f"stage {stage}: the route of stage {k} names {len(v)} "
                                 f"micro-batches, not {micro_batches}")
        mine = {t.micro for t in tasks}
        if any(self._slot_of(stage, m) != self.slot for m in mine):
            raise StageError(f"stage {stage} (slot {self.slot}): its tasks include micro-batches "
                             "its route gives another replica")
        self.program = program
        self.link = link
        self._send_now: SendNow | None = getattr(link, "send_now", None)
        self.tasks = list(tasks)
        self.micro_batches = micro_batches
        if micro_batch_sizes and (len(micro_batch_sizes) != micro_batches
                                  or min(micro_batch_sizes) < 1
                                  or (batch_size and sum(micro_batch_sizes) != batch_size)):
            raise StageError(f"stage {stage}: micro-batch sizes {list(micro_batch_sizes)[:8]} "
                             f"are not {micro_batches} positive sizes adding up to the batch")
        self.micro_batch_sizes = tuple(int(x) for x in micro_batch_sizes)
        """Each micro-batch's samples, where the plan gives the replicas sizes of their own
        (empty: equal). A micro-batch's loss then counts by its size (`weigh_loss`), so the
        step's gradient and loss are the global batch's mean, as with equal ones."""
        self.opt_spec = optimizer
        self.total_steps = total_steps
        self.data = data
        self.batch_size = batch_size
        self.config = config or StageConfig()
        try:
            self._place = StagePlace(self.config.device)
        except DeviceError as e:
            raise StageError(f"stage {stage}: {e}", fault=FAULT_MACHINE) from e
        if self.config.precision == "fp16" and self.config.offload_params:
            raise StageError(f"stage {stage}: fp16 unscales its gradients in memory; its "
                             "weights cannot be on disk (offload_params)", fault=FAULT_JOB)
        if self._place.cuda and (self.config.offload_dir is not None
                                 or self.config.offload_params):
            raise StageError(f"stage {stage}: offloading to disk runs on the CPU, not on "
                             f"{self.config.device}", fault=FAULT_JOB)
        params = list(program.module.parameters())
        # A partition may hold no parameters (e.g. only elementwise ops): nothing to step.
        self.optimizer = make_optimizer(optimizer, params) if params else None
        self._offload: DiskOptimizerState | None = None
        if self.optimizer is not None and self.config.offload_dir is not None:
            self._offload = DiskOptimizerState(self.optimizer,
                                               self.config.offload_dir / f"slot-{self.slot}")
        self._params = dict(program.module.named_parameters())
        runner = program.segments
        names = list(self._params)
        self._step_chunks = ([[self._params[n] for n in g] for g in runner.param_names()]
                             if runner is not None else
                             [[self._params[n] for n in names[i:i + STEP_CHUNK_TENSORS]]
                              for i in range(0, len(names), STEP_CHUNK_TENSORS)])
        """With the optimizer state on disk: the parameters it steps together (a segment's,
        or a few tensors), so one chunk of its state is in memory at a time."""
        self._trim = (self.config.trim_heap or self.config.recompute or runner is not None
                      or self.config.offload_dir is not None)
        """Trim the C heap after each backward and update (`StageConfig.trim_heap`)."""
        if runner is not None and self._trim and any(runner.recompute):
            ckpt = runner.recompute

            def trim_after(i: int) -> None:
                # a checkpointed segment's forward freed its intermediates: give them back
                # before the next segment allocates around its kept input
                if ckpt[i] and torch.is_grad_enabled():
                    trim_heap()
            runner.after_forward = trim_after
        self._disk_params: DiskParameters | None = None
        if self.config.offload_params and self._params:
            if self.config.offload_dir is None:
                raise StageError(f"stage {stage}: parameter offload needs an offload directory")
            groups = runner.param_names() if runner is not None else [list(self._params)]
            try:
                self._disk_params = DiskParameters(
                    self._params, groups, self.config.offload_dir / f"slot-{self.slot}-params")
            except BaseException:
                if self._offload is not None:
                    self._offload.close()
                raise
            if runner is not None:
                runner.on_forward = self._disk_params.use
                runner.on_backward = self._disk_params.backward_done
        for name in program.shared:
            if name not in self._params:
                raise StageError(f"stage {stage}: shared parameter {name!r} is not in the module")
        self._lowrank_names = frozenset(
            name for name in program.shared if grad_rank is not None
            and self._params[name].is_floating_point()
            and compressed(tuple(self._params[name].shape), grad_rank))
        """Shared parameters whose gradient travels low-rank (the rest dense)."""
        self._scaler: LossScale | None = None
        self._scale_peers: tuple[int, ...] = ()
        if self.config.precision == "fp16":
            self._scaler = LossScale(scale=self.config.loss_scale)
            self._scale_peers = tuple(sorted(set(job_slots) - {self.slot}))
            if self.slot not in set(job_slots) and job_slots:
                raise StageError(f"stage {stage}: its slot {self.slot} is not among the job's "
                                 f"slots {sorted(job_slots)[:8]}")
        """fp16: the loss scale, and every other slot of the job, which agree on it."""
        self._shared_wire: frozenset[str] = frozenset(
            {_OVERFLOW} if self._scaler is not None else set())
        """Every name a PARAM_GRAD packet to this stage may carry."""
        rings: dict[tuple[int, ...], list[str]] = {}
        for name in sorted(program.shared):
            holders = tuple(sorted({self.slot, *program.shared[name]}))
            if len(holders) >= RING_MIN_HOLDERS:
                rings.setdefault(holders, []).append(name)
        self._rings = rings
        """Holders (in slot order) -> the shared parameters all of them hold, for every set of
        at least `RING_MIN_HOLDERS`: summed by a ring (`_ring_sum`), each holder sending
        2 (n - 1) / n of the gradient instead of n - 1 copies of it."""
        hgroups = tuple(sorted(tuple(sorted(g)) for g in self.config.grad_groups if g))
        self._hier: dict[tuple[int, ...], tuple[tuple[int, ...], ...]] = {}
        """Holders -> their bandwidth groups, for the set the plan reduces hierarchically
        (`StageConfig.grad_groups`: every holder in exactly one group, at least two
        groups); other sets go by one ring."""
        if hgroups:
            flat = [s for g in hgroups for s in g]
            if len(flat) != len(set(flat)) or len(hgroups) < 2 or self.slot not in flat:
                raise StageError(f"stage {stage}: grad_groups {list(hgroups)[:4]} are not two "
                                 f"or more disjoint groups of slots holding slot {self.slot}",
                                 fault=FAULT_JOB)
            for holders in rings:
                if set(holders) == set(flat):
                    self._hier[holders] = hgroups
        elif self.config.grad_two_level:
            raise StageError(f"stage {stage}: grad_two_level needs grad_groups (the bandwidth "
                             "groups it reduces over)", fault=FAULT_JOB)
        in_ring = {n for names in rings.values() for n in names}
        by_peer: dict[int, list[str]] = {}
        for name in sorted(program.shared):
            if name in in_ring:
                continue
            for peer in program.shared[name]:
                by_peer.setdefault(peer, []).append(name)
        self._shared_by_peer = by_peer
        """Each other holder -> the shared parameters it holds too (those not summed by a
        ring), in name order: what one bucket to it carries (the same order on both
        sides)."""
        self._buckets = self._make_buckets()
        rounds: list[str] = []
        for b in self._buckets:
            for r in (b.round, f"{b.round}{_Q_ROUND}"):
                if b.holders in self._hier:
                    tags = (_two_level_tags if self.config.grad_two_level
                            else _hier_tags)(self._hier[b.holders])
                    rounds += [f"{r}{t}" for t in tags]
                elif len(b.holders) >= RING_MIN_HOLDERS:
                    rounds += [f"{r}{_ring_tag(b.holders, k)}"
                               for k in range(2 * (len(b.holders) - 1))]
                else:
                    rounds.append(r)
        self._shared_wire = self._shared_wire | frozenset(rounds)
        self._reducer: ThreadPoolExecutor | None = None
        """The thread that reduces a step's buckets while its last backward runs."""
        self._stats_lock = threading.Lock()
        self._mutated = mutated_buffers(program.module) if self.config.recompute else []
        if self.config.precision not in PRECISIONS:
            raise StageError(f"stage {stage}: precision {self.config.precision!r} is not one of "
                             f"{sorted(PRECISIONS)}")
        """With recompute: the buffers a forward updates (restored around the second one)."""
        self._in = {e.edge_id: e for e in program.in_edges}
        self._out = {e.edge_id: e for e in program.out_edges}
        self._density: dict[str, float | None] = {e.edge_id: e.density for e in program.out_edges}
        self._encoding: dict[str, codec.EdgeEncoding] = {e.edge_id: e.encoding
                                                         for e in program.out_edges}
        self._pool: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outq: dict[int, _Outbound] = {}
        self._senders: list[asyncio.Task[None]] = []
        self._cond = threading.Condition()
        """Guards the inbox, `_failed` and `_step` between the event loop (deliver, fail) and
        the compute thread (which waits on it for a task's inputs)."""
        self._inbox: dict[_Key, tuple[bytes | memoryview, float]] = {}
        """Received packets not yet taken by their task: payload and arrival time."""
        self._failed: BaseException | None = None
        self._handled = first_step - 1
        """The last step whose report `run`'s callback has handled (`RUN_AHEAD_STEPS`)."""
        self._step = first_step
        """The step being run; packets for it and later steps are kept until their task (a
        resumed attempt starts here, so its first tensors are never mistaken for stale)."""
        self._inbox_bytes = 0
        per_step = (micro_batches * (len(program.in_edges) + len(program.out_edges))
                    + len(self._scale_peers) + len(rounds))
        self._inbox_max = 2 * per_step + self.config.inbox_slack
        self._ready = asyncio.Event()
        self._closed = False
        self._stats: dict[tuple[str, PacketKind], EdgeStats] = {}

    def _slot_of(self, stage: int, micro: int) -> int:
        """The slot that runs micro-batch `micro` of stage `stage`."""
        route = self._routes.get(stage)
        return stage if route is None else route[micro]

    # -- service --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the compute thread and one sender task per destination stage."""
        if self._pool is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage{self.slot}")
        micros = {t.micro for t in self.tasks}
        peers = {self._slot_of(e.dst, m) for e in self.program.out_edges for m in micros}
        peers |= {self._slot_of(e.src, m) for e in self.program.in_edges for m in micros}
        for holders in self.program.shared.values():
            peers.update(holders)
        peers.update(self._scale_peers)  # fp16: every slot hears this one's overflow flag
        for peer in sorted(peers - {self.slot}):
            out = self._outq[peer] = _Outbound(self.config.send_queue)
            self._senders.append(
                asyncio.create_task(self._sender(peer, out), name=f"stage{self.slot}->stage{peer}")
            )
        self._ready.set()

    async def ready(self) -> None:
        """Return once started."""
        await self._ready.wait()

    async def close(self) -> None:
        """Stop senders (cancelled and awaited) and the compute thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        # a step still running on the compute thread ends at its next wait
        self.fail(StageError(f"stage {self.stage} closed"))
        await cancel_and_wait(self._senders, what="sender")
        self._senders.clear()
        if self._pool is not None:
            # Waiting for a running task (seconds on a big model) must not block the loop.
            await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)
        if self._reducer is not None:
            await asyncio.to_thread(self._reducer.shutdown, wait=True, cancel_futures=True)
        with self._cond:
            self._inbox.clear()
            self._inbox_bytes = 0
        if self._offload is not None:
            self._offload.close()
        if self._disk_params is not None:
            self._disk_params.close()

    async def flush(self) -> None:
        """Wait until every queued outbound packet has been handed to the link; the stage's
        failure if it fails (or closes) first."""
        for out in self._outq.values():
            while out.pending:
                if self._failed is not None:
                    raise self._failed
                out.drained.clear()
                await out.drained.wait()

    # -- receiving (event loop) -----------------------------------------------------------

    def deliver(self, packet: Packet) -> None:
        """Accept a packet addressed to this stage (from the link). Never blocks.

        A packet this stage cannot expect (wrong stage, unknown edge, a step already finished,
        a duplicate) is a `RemoteError` naming it; the stage keeps running.
        """
        if packet.dst != self.slot:
            raise RemoteError(f"stage {self.stage} (slot {self.slot}) got a packet for "
                              f"{packet.dst}")
        if packet.step < self._step or packet.step >= self.total_steps:
            raise RemoteError(
                f"stage {self.stage} at step {self._step} got {packet.kind} for step {packet.step}"
            )
        if not 0 <= packet.micro < self.micro_batches and packet.kind != PacketKind.PARAM_GRAD:
            raise RemoteError(f"stage {self.stage}: micro-batch {packet.micro} out of range")
        known = {
            PacketKind.FORWARD: self._in,
            PacketKind.BACKWARD: self._out,
            PacketKind.PARAM_GRAD: self._shared_wire,
        }[packet.kind]
        if packet.edge not in known:
            raise RemoteError(f"stage {self.stage}: unexpected {packet.kind} on {packet.edge!r}")
        key = (packet.kind, packet.step, packet.micro, packet.edge)
        if packet.kind == PacketKind.PARAM_GRAD:
            key = (packet.kind, packet.step, packet.src, packet.edge)
        size = packet.nbytes
        with self._cond:
            if key in self._inbox:
                raise RemoteError(f"stage {self.stage}: duplicate {key}")
            # Kept until its task takes it (early ones too: a neighbour may start a step before
            # this stage has), within bounds; past them the attempt fails loudly instead of
            # dropping it.
            if (len(self._inbox) >= self._inbox_max
                    or self._inbox_bytes + size > self.config.inbox_bytes):
                failure = StageError(
                    f"stage {self.stage} at step {self._step}: {len(self._inbox) + 1} packets "
                    f"({self._inbox_bytes + size} bytes) arrived ahead of their tasks, more than "
                    f"the bound ({self._inbox_max} packets, {self.config.inbox_bytes} bytes; "
                    f"StageConfig.inbox_slack / inbox_bytes); the last: {packet.kind} for step "
                    f"{packet.step} on {packet.edge!r}")
            else:
                self._inbox[key] = (packet.data(), time.perf_counter())
                self._inbox_bytes += size
                self._cond.notify_all()
                return
        self.fail(failure)

    def set_density(self, edge_id: str, density: float | None) -> None:
        """Change an outgoing edge's top-k density (None: exact) from the next forward on.

        Only the sender needs to know: receivers decode whatever encoding arrives, and each
        backward uses the indices of its own forward. AdaTopK re-adaptation calls this when
        measured link throughput changes.
        """
        if edge_id not in self._out:
            raise StageError(f"stage {self.stage} sends no edge {edge_id!r}")
        enc = self._encoding[edge_id]
        if enc != "raw" and density is not None and density < 1.0:
            raise StageError(f"edge {edge_id!r} travels {enc}: top-k (density {density}) does "
                             "not apply to it")
        if density is not None and not 0.0 < density <= 1.0:
            raise StageError(f"edge {edge_id!r}: density {density} not in (0, 1]")
        self._density[edge_id] = None if density is not None and density >= 1.0 else density

    def set_codec(self, edge_id: str, encoding: codec.EdgeEncoding,
                  density: float | None = None) -> None:
        """Change how an outgoing edge travels from the next forward on: top-k at `density`
        (then `encoding` must be "raw"), or `encoding`. The per-link codec choice's
        re-adaptation calls this; receivers answer as each forward arrived."""
        if edge_id not in self._out:
            raise StageError(f"stage {self.stage} sends no edge {edge_id!r}")
        if encoding not in codec.EDGE_ENCODINGS:
            raise StageError(f"edge {edge_id!r}: encoding {encoding!r} is not one of "
                             f"{list(codec.EDGE_ENCODINGS)}")
        if encoding != "raw" and density is not None and density < 1.0:
            raise StageError(f"edge {edge_id!r}: a {encoding} edge cannot also be top-k "
                             f"(density {density})")
        self._encoding[edge_id] = "raw"
        self.set_density(edge_id, density)
        self._encoding[edge_id] = encoding

    @property
    def encodings(self) -> dict[str, codec.EdgeEncoding]:
        """Outgoing edge id -> its current encoding when not top-k."""
        return dict(self._encoding)

    @property
    def densities(self) -> dict[str, float | None]:
        """Outgoing edge id -> current density (None: exact)."""
        return dict(self._density)

    @property
    def current_step(self) -> int:
        """The step being run (or last run)."""
        return self._step

    def fail(self, exc: BaseException) -> None:
        """Abort: every pending and future wait raises `exc` (e.g. a peer stage died). The
        first failure is kept."""
        with self._cond:
            if self._failed is None:
                self._failed = exc
            self._cond.notify_all()
        for out in self._outq.values():
            out.abort()

    # -- the compute thread's waits -------------------------------------------------------

    def _take(self, key: _Key, deadline: float, what: str) -> tuple[bytes | memoryview, float]:
        """Wait (on the compute thread) for the packet `key`: its payload and arrival time."""
        with self._cond:
            while True:
                if self._failed is not None:
                    raise self._failed
                if key in self._inbox:
                    return self._pop(key)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(
                        f"stage {self.stage}, step {key[1]}, {what}: no {key[0]} on edge "
                        f"{key[3]!r} within {self.config.recv_timeout_s:g}s")
                self._cond.wait(left)

    def _pop(self, key: _Key) -> tuple[bytes | memoryview, float]:
        """Take the packet `key` out of the inbox (the caller holds `_cond` and knows it is
        there): its payload and arrival time, its bytes off the inbox's count."""
        got = self._inbox.pop(key)
        self._inbox_bytes -= memoryview(got[0]).nbytes
        return got

    # -- sending --------------------------------------------------------------------------

    async def _sender(self, peer: int, out: _Outbound) -> None:
        while True:
            await out.ready.wait()
            out.ready.clear()
            while (pkt := out.pop()) is not None:
                out.sending = True
                try:
                    await self.link.send(pkt)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    self._send_failed(peer, e)
                finally:
                    out.sending = False
                    out.done()

    def _send_failed(self, peer: int, e: Exception) -> None:
        self.fail(StageError(f"stage {self.stage}: sending to stage {peer} failed: {e}"))

    def _emit(self, packets: Sequence[tuple[Packet, codec.Encoded, float | None]]) -> float:
        """Queue `packets` for their senders (on the compute thread; blocks while a queue is
        full); the seconds it blocked."""
        t0 = time.perf_counter()
        loop = self._loop
        assert loop is not None or not packets

        def wake() -> None:
            assert loop is not None
            loop.call_soon_threadsafe(self._wake_senders)

        for pkt, enc, density in packets:
            key = (pkt.edge, pkt.kind)
            with self._stats_lock:  # the compute thread's and the reducer's
                st = self._stats.get(key)
                if st is None:
                    st = self._stats[key] = EdgeStats(pkt.edge, pkt.kind, pkt.dst,
                                                      density=density)
                st.wire_bytes += enc.nbytes
                st.dense_bytes += enc.dense_nbytes
            if not self._outq[pkt.dst].put(pkt, wake):
                with self._cond:
                    failed = self._failed
                raise failed or StageError(f"stage {self.stage}: sender to {pkt.dst} stopped")
        if packets:
            # one wake-up of the event loop for all of a task's packets
            wake()
        return time.perf_counter() - t0

    def _wake_senders(self) -> None:
        """On the event loop, once a task queued packets: write each destination's at once
        where its link's way is idle (`send_now`: no turn of the sender or the transport's
        writer task, the hand-off's own cost, docs/runtime.md), else wake its sender. A
        destination whose sender is busy or already woken keeps its order through it."""
        now = self._send_now
        for peer, out in self._outq.items():
            if not out.pending:
                continue
            if now is not None and not out.sending and not out.ready.is_set():
                while (pkt := out.pop()) is not None:
                    try:
                        sent = now(pkt)
                    except Exception as e:
                        self._send_failed(peer, e)
                        out.done()
                        continue
                    if not sent:
                        out.unpop(pkt)
                        break
                    out.done()
            if out.pending:
                out.ready.set()

    # -- compute (the compute thread) -----------------------------------------------------

    def _forward(self, step: int, micro: int, payloads: Mapping[str, bytes | memoryview],
                 mb: Batch | None, cost: _Cost
                 ) -> tuple[_Ctx, list[tuple[Packet, codec.Encoded, float | None]]]:
        t0 = time.perf_counter()
        leaves: dict[str, torch.Tensor] = {}
        recv_idx: dict[str, np.ndarray] = {}
        recv_enc: dict[str, codec.EdgeEncoding] = {}
        recv_basis: dict[str, np.ndarray] = {}
        for edge_id, payload in payloads.items():
            # Follow the payload, not our config: the sender owns the edge's codec.
            t, idx, basis, came = codec.decode_edge(payload)
            if idx is not None:
                recv_idx[edge_id] = idx
            elif basis is not None:
                recv_basis[edge_id] = basis
            elif came != "raw":
                recv_enc[edge_id] = came
            if t.dtype == torch.bfloat16 and self.config.precision != "bf16":
                t = t.float()  # a bf16 edge rounded the value; the stage computes in fp32
            leaves[edge_id] = t
        data = {key: mb[key] for key in self.program.data_inputs} if mb is not None else {}
        if self._place.cuda:  # one batch of copies on the copy stream; compute waits on it
            moved = self._place.onto({**{f"e:{k}": t for k, t in leaves.items()},
                                      **{f"d:{k}": t for k, t in data.items()}})
            leaves = {k: moved[f"e:{k}"] for k in leaves}
            data = {k: moved[f"d:{k}"] for k in data}
        for t in leaves.values():
            if _is_float(t):
                t.requires_grad_(True)
        inputs: dict[str, torch.Tensor] = dict(leaves)
        inputs.update(data)  # "inputs", "targets" or a named field
        if self.program.seed_random is not None:
            self.program.seed_random(step, micro)
        recompute = self.config.recompute
        before = [b.clone() for b in self._mutated] if recompute else None
        t1 = time.perf_counter()
        if recompute:
            with torch.no_grad(), self._autocast():  # no graph: the backward builds it again
                out = dict(self.program.run(inputs))
        else:
            with self._autocast():
                out = dict(self.program.run(inputs))
        t2 = time.perf_counter()
        loss = out.pop("loss", None) if self.program.has_loss else None
        if self.program.has_loss and loss is None:
            raise StageError(f"stage {self.stage}: the loss stage's module returned no 'loss'",
                             fault=FAULT_JOB)
        packets: list[tuple[Packet, codec.Encoded, float | None]] = []
        sent_idx: dict[str, np.ndarray] = {}
        sent_basis: dict[str, np.ndarray] = {}
        grad_edges: set[str] = set()
        for edge_id in self._out:
            if edge_id not in out:
                raise StageError(f"stage {self.stage}: module produced no output for {edge_id!r}",
                                 fault=FAULT_JOB)
        # what the codec reads, in host memory (the outputs themselves on the CPU); on a GPU,
        # top-k and int8 edges are compressed there and only their compressed arrays come over
        here = {k for k in self._out if codec.reduces_on_device(
            out[k], self._density[k], self._encoding[k])} if self._place.cuda else set()
        sending = self._place.host({k: out[k] for k in self._out if k not in here})
        for edge_id, e in self._out.items():
            density = self._density[edge_id]
            if edge_id in here:
                t = out[edge_id]
                if density is not None:
                    enc, sent_idx[edge_id] = codec.encode_topk_torch(t, density, e.per_row,
                                                                     self._place.host)
                else:
                    enc = self._overflow_safe(
                        functools.partial(codec.encode_int8_torch, t, self._place.host), t)
                grad_edges.add(edge_id)
                packets.append((Packet(PacketKind.FORWARD, step, micro, edge_id, self.slot,
                                       self._slot_of(e.dst, micro), enc.parts), enc, density))
                continue
            t = sending[edge_id]
            if not _is_float(t):
                enc = codec.encode_dense(t)
            elif density is None and self._encoding[edge_id] == "lowrank":
                if codec.lowrank_applies(t):
                    enc, sent_basis[edge_id] = codec.encode_lowrank(
                        t, seed=_grad_seed(step, micro, edge_id))
                else:
                    enc = codec.encode_dense(t)
            elif density is None:
                enc = self._overflow_safe(
                    functools.partial(codec.encode_edge, t, self._encoding[edge_id]), t)
            else:
                enc, sent_idx[edge_id] = codec.encode_topk(t, density, e.per_row)
            if _is_float(t):
                grad_edges.add(edge_id)
            pkt = Packet(PacketKind.FORWARD, step, micro, edge_id, self.slot,
                         self._slot_of(e.dst, micro), enc.parts)
            packets.append((pkt, enc, density))
        cost.kernel_s += t2 - t1
        cost.codec_s += (t1 - t0) + (time.perf_counter() - t2)
        if recompute:  # keep only what runs the forward again: its inputs
            ctx = _Ctx(leaves, {}, loss, recv_idx, sent_idx, grad_edges, inputs, before,
                       recv_enc, recv_basis, sent_basis)
        else:
            ctx = _Ctx(leaves, out, loss, recv_idx, sent_idx, grad_edges, recv_enc=recv_enc,
                       recv_basis=recv_basis, sent_basis=sent_basis)
        return ctx, packets

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's mixed precision (`StageConfig.precision`), on the weights' device."""
        dtype = PRECISIONS[self.config.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self._place.device.type, dtype=dtype)

    def _recompute(self, step: int, micro: int, ctx: _Ctx) -> None:
        """The forward of a recomputed task again, with autograd, as it ran the first time
        (same random keys, the buffers as it found them; their updated values kept)."""
        assert ctx.inputs is not None
        after = [b.clone() for b in self._mutated]
        # through .data, as the program's own buffer updates: the recomputed forward may save
        # a buffer for its backward, and a version bump would fail that backward
        for b, was in zip(self._mutated, ctx.buffers_before or (), strict=True):
            b.data.copy_(was)
        if self.program.seed_random is not None:
            self.program.seed_random(step, micro)
        with self._autocast():
            out = dict(self.program.run(ctx.inputs))
        for b, now in zip(self._mutated, after, strict=True):
            b.data.copy_(now)
        ctx.loss = out.pop("loss", None) if self.program.has_loss else None
        ctx.outputs = out
        ctx.inputs = ctx.buffers_before = None

    def _backward(self, step: int, micro: int, ctx: _Ctx,
                  payloads: Mapping[str, bytes | memoryview], cost: _Cost
                  ) -> list[tuple[Packet, codec.Encoded, float | None]]:
        t0 = time.perf_counter()
        if ctx.inputs is not None:
            t_re = time.perf_counter()
            self._recompute(step, micro, ctx)
            cost.kernel_s += time.perf_counter() - t_re
            t0 = time.perf_counter()
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for edge_id, payload in payloads.items():
            out = ctx.outputs[edge_id]
            if edge_id in ctx.sent_idx:
                g = codec.decode_values(payload, ctx.sent_idx[edge_id])
            elif edge_id in ctx.sent_basis:
                g = codec.unproject(codec.decode_dense(payload), ctx.sent_basis[edge_id],
                                    out.shape)
            else:
                g = codec.decode_dense(payload)
            if out.requires_grad:
                roots.append(out)
                grads.append(self._place.onto_one(g.view_as(out)).to(out.dtype))
        if ctx.loss is not None:
            roots.append(self.weigh_loss(ctx.loss, micro))
            grads.append(torch.ones_like(ctx.loss) if self._scaler is None
                         else torch.full_like(ctx.loss, self._scaler.scale))
        t1 = time.perf_counter()
        if roots:
            torch.autograd.backward(roots, grads)
        t2 = time.perf_counter()
        packets: list[tuple[Packet, codec.Encoded, float | None]] = []
        grads_in = {edge_id: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                    for edge_id, leaf in ctx.leaves.items() if leaf.requires_grad}
        # on a GPU a top-k edge's gradient is gathered at its indices there (only the values
        # come over); the rest comes back whole
        gathered = {k for k in grads_in if self._place.cuda and k in ctx.recv_idx}
        back = self._place.host({k: g for k, g in grads_in.items() if k not in gathered})
        for edge_id in grads_in:
            e = self._in[edge_id]
            if edge_id in gathered:
                enc = codec.encode_values_torch(grads_in[edge_id], ctx.recv_idx[edge_id],
                                                self._place.host)
                packets.append((Packet(PacketKind.BACKWARD, step, micro, edge_id, self.slot,
                                       self._slot_of(e.src, micro), enc.parts), enc, e.density))
                continue
            g = back[edge_id]
            if edge_id in ctx.recv_idx:
                enc = codec.encode_values(g, ctx.recv_idx[edge_id])
            elif edge_id in ctx.recv_basis:  # G Q, in the precision P came in
                enc = dataclasses.replace(
                    codec.encode_bf16(codec.project(g, ctx.recv_basis[edge_id])),
                    dense_nbytes=g.numel() * g.element_size())
            else:  # as the forward came; a quantized gradient rounds stochastically: unbiased
                enc = self._overflow_safe(functools.partial(
                    codec.encode_edge, g, ctx.recv_enc.get(edge_id, "raw"), stochastic=True,
                    seed=_grad_seed(step, micro, edge_id)), g)
            pkt = Packet(PacketKind.BACKWARD, step, micro, edge_id, self.slot,
                         self._slot_of(e.src, micro), enc.parts)
            packets.append((pkt, enc, e.density))
        cost.kernel_s += t2 - t1
        cost.codec_s += (t1 - t0) + (time.perf_counter() - t2)
        return packets

    def _own_grad(self, name: str) -> torch.Tensor:
        p = self._params[name]
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _exchange(self, step: int, round_name: str, own: Mapping[str, torch.Tensor],
                  what: str) -> _Red[dict[str, torch.Tensor]]:
        """Sum `own[parameter]` over the parameter's holders: one packet per other holder
        with every tensor of `own` that holder also holds, flat float32 in name order (a
        bucket: not one frame per tensor), then each sum in slot order on every holder, so
        the copies stay bit-identical."""
        names_of = {peer: [n for n in names if n in own]
                    for peer, names in self._shared_by_peer.items()}
        names_of = {peer: names for peer, names in names_of.items() if names}
        ringed = {h: [n for n in names if n in own] for h, names in self._rings.items()}

        # the tensors go out as they are, no bucket copied (one gradient's worth of memory
        # less, issue 21): nothing writes them after this; the parameters' `.grad` become the
        # sums. Where that does not hold (weights and gradients in files, whose pages the
        # next step reuses; another dtype), the copy.
        in_place = self._disk_params is None and all(
            t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
            for t in own.values())

        def bucket(names: Sequence[str]) -> codec.Encoded:
            ts = [own[n].detach() for n in names]
            if in_place:
                return codec.encode_concat(ts)
            return codec.encode_dense(torch.cat([t.reshape(-1).to(torch.float32) for t in ts]))

        packets = []
        for peer, names in names_of.items():
            enc = self._guard(what, step, functools.partial(bucket, names))
            packets.append((Packet(PacketKind.PARAM_GRAD, step, 0, round_name, self.slot, peer,
                                   enc.parts), enc, None))
        self._emit(packets)
        deadline = time.monotonic() + self.config.recv_timeout_s
        totals: dict[str, torch.Tensor] = {}
        for holders, names in ringed.items():
            if names and holders in self._hier:
                sum_groups = (self._two_level_sum if self.config.grad_two_level
                              else self._hier_sum)
                totals.update((yield from sum_groups(step, round_name, self._hier[holders],
                                                     names, own, what, deadline)))
            elif names:
                totals.update((yield from self._ring_sum(step, round_name, holders, names, own,
                                                         what, deadline)))
        keys = tuple((PacketKind.PARAM_GRAD, step, peer, round_name) for peer in names_of)
        got = (yield _Need(keys, what, deadline)) if keys else []
        parts: dict[str, dict[int, torch.Tensor]] = {n: {self.slot: t} for n, t in own.items()
                                                     if n not in totals}
        for (peer, names), payload in zip(names_of.items(), got, strict=True):
            sent = self._bucket_from(step, what, peer, "its bucket", payload, names, own)
            for n, t in sent.items():
                parts[n][peer] = t
        for n, by_slot in parts.items():
            total = torch.zeros_like(own[n])
            for s in sorted(by_slot):
                total += by_slot[s]
            totals[n] = total
        return totals

    def _hier_sum(self, step: int, round_name: str, groups: tuple[tuple[int, ...], ...],
                  names: Sequence[str], own: Mapping[str, torch.Tensor], what: str,
                  deadline: float) -> _Red[dict[str, torch.Tensor]]:
        """Sum `own[name]` over every slot of `groups` hierarchically (the plan's scheme for
        replicas in several bandwidth groups): a ring inside this slot's group, then a ring
        among the groups' first slots over the slow links (the whole gradient crosses them
        once per group, not 2 (n - 1) / n of it per ring step), then each first slot sends the
        total to the rest of its group. Every holder ends with the same bits: the first
        slots' ring gives them one total, which the others copy."""
        group = next(g for g in groups if self.slot in g)
        leaders = tuple(g[0] for g in groups)
        inner = ((yield from self._ring_sum(step, round_name, group, names, own, what,
                                            deadline))
                 if len(group) > 1 else {n: own[n] for n in names})
        tag = f"{round_name}{_bcast_tag(groups)}"
        if self.slot == group[0]:
            totals = yield from self._ring_sum(step, round_name, leaders, names, inner, what,
                                               deadline)
            if len(group) > 1:
                flat = _flatten(totals, names)
                self._send_flat(step, what, tag, [(peer, flat) for peer in group[1:]])
            return totals
        want = sum(own[n].numel() for n in names)
        got = yield from self._take_flat(step, what, tag, [(group[0], want)], "as the total",
                                         deadline)
        return _unflatten(got[0], names, own)

    def _two_level_sum(self, step: int, round_name: str, groups: tuple[tuple[int, ...], ...],
                       names: Sequence[str], own: Mapping[str, torch.Tensor], what: str,
                       deadline: float) -> _Red[dict[str, torch.Tensor]]:
        """Sum `own[name]` over every slot of `groups` two-level (the plan's scheme where it
        beats `_hier_sum`): the names' tensors flat in float32, cut in as many shards as the
        smallest group has slots; shard j's owner in each group (its j-th slot) sums the
        group's shard j (in slot order), the owners of shard j sum their group totals by a
        ring (`_ring_flat`: the slow links carry 1 / shards of the gradient each, every
        shard on its own slots' links at once), and each owner sends its shard's total to the
        rest of its group. Every holder ends with the same bits: each shard's total is
        summed once, by the ring, and copied."""
        group = next(g for g in groups if self.slot in g)
        owners = _shard_owners(groups)
        mine = group.index(self.slot)
        to_owner, back = (f"{round_name}{t}" for t in _shard_tags(groups))
        flat = _flatten(own, names)
        shards = list(torch.tensor_split(flat, len(owners)))
        theirs = [j for j in range(len(owners)) if j != mine]
        # each shard to its owner in this group (a slot past the smallest group's size owns
        # none and sends them all)
        self._send_flat(step, what, to_owner, [(group[j], shards[j]) for j in theirs])
        total = torch.empty_like(flat)
        done = list(torch.tensor_split(total, len(owners)))
        if mine < len(owners):
            others = [x for x in group if x != self.slot]
            parts = dict(zip(others, (yield from self._take_flat(
                step, what, to_owner, [(x, shards[mine].numel()) for x in others],
                "as its share of this slot's shard", deadline)), strict=True))
            parts[self.slot] = shards[mine]
            inside = torch.zeros_like(shards[mine])
            for x in sorted(parts):
                inside += parts[x]
            done[mine].copy_((yield from self._ring_flat(step, round_name, owners[mine],
                                                         inside, what, deadline)))
            self._send_flat(step, what, back, [(x, done[mine]) for x in others])
        got = yield from self._take_flat(step, what, back,
                                         [(group[j], done[j].numel()) for j in theirs],
                                         "as its shard's total", deadline)
        for j, t in zip(theirs, got, strict=True):
            done[j].copy_(t)
        return _unflatten(total, names, own)

    def _send_flat(self, step: int, what: str, tag: str,
                   to: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Queue each flat float32 tensor of `to` for its slot, in PARAM_GRAD round `tag`."""
        packets = []
        for peer, t in to:
            enc = self._guard(what, step, functools.partial(codec.encode_dense, t))
            packets.append((Packet(PacketKind.PARAM_GRAD, step, 0, tag, self.slot, peer,
                                   enc.parts), enc, None))
        self._emit(packets)

    def _take_flat(self, step: int, what: str, tag: str, senders: Sequence[tuple[int, int]],
                   as_what: str, deadline: float) -> _Red[list[torch.Tensor]]:
        """Wait for the flat float32 tensor each (slot, size) of `senders` sends in PARAM_GRAD
        round `tag`; `StageError` naming the slot whose payload is not that many values."""
        keys = tuple((PacketKind.PARAM_GRAD, step, peer, tag) for peer, _ in senders)
        got = (yield _Need(keys, what, deadline)) if keys else []
        return [self._flat_from(step, what, peer, payload, want, as_what)
                for (peer, want), payload in zip(senders, got, strict=True)]

    def _flat_from(self, step: int, what: str, sender: int, payload: bytes | memoryview,
                   want: int, as_what: str) -> torch.Tensor:
        """`payload` decoded: `want` float32 values in one dimension, else `StageError`
        naming `sender`."""
        t = codec.decode_dense(payload)
        if t.dim() != 1 or t.numel() != want or t.dtype != torch.float32:
            raise StageError(f"stage {self.stage}, step {step}, {what}: slot {sender} sent "
                             f"{tuple(t.shape)} {t.dtype} {as_what}, not {want} float32 "
                             "values")
        return t

    def _bucket_from(self, step: int, what: str, sender: int, as_what: str,
                     payload: bytes | memoryview, names: Sequence[str],
                     own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A received bucket (the names' tensors flat in float32) as each name's tensor;
        `StageError` naming `sender` where it is not that."""
        want = sum(own[n].numel() for n in names)
        return _unflatten(self._flat_from(step, what, sender, payload, want, as_what),
                          names, own)

    def _ring_sum(self, step: int, round_name: str, holders: tuple[int, ...],
                  names: Sequence[str], own: Mapping[str, torch.Tensor], what: str,
                  deadline: float) -> _Red[dict[str, torch.Tensor]]:
        """Sum `own[name]` over `holders` (this slot among them) by a ring all-reduce: the
        names' tensors flat in float32, cut in n chunks; n - 1 reduce-scatter steps (each
        holder adds what its predecessor sends to its own chunk and passes it on), after
        which holder i has the whole sum of chunk i + 1; n - 1 all-gather steps pass the
        sums round. Each chunk is summed once, by one holder, and copied to the others: the
        holders end bit-identical.

        Memory beyond the gradients: the flat copy, the result and a chunk in flight
        (`fusiond.plan.pipeline.exchange_bytes`). The reduce-scatter adds into the flat copy
        in place (a chunk is changed only before it is first sent, and a packet's bytes are
        the chunk's own memory until written); the all-gather writes the result apart."""
        flat = _flatten(own, names)
        total = yield from self._ring_flat(step, round_name, holders, flat, what, deadline)
        return _unflatten(total, names, own)

    def _ring_flat(self, step: int, round_name: str, holders: tuple[int, ...],
                   flat: torch.Tensor, what: str, deadline: float) -> _Red[torch.Tensor]:
        """`_ring_sum` of one flat float32 tensor (changed in place: its reduce-scatter
        adds into it); the total, bit-identical on every holder. Two holders send each other
        the whole tensor at once instead (the ring's bytes in one latency, not two) and both
        add the two in slot order."""
        n = len(holders)
        i = holders.index(self.slot)
        if n == 2:
            other = holders[1 - i]
            tag = f"{round_name}{_ring_tag(holders, 0)}"
            self._send_flat(step, what, tag, [(other, flat)])
            got = (yield from self._take_flat(step, what, tag, [(other, flat.numel())],
                                              "as its whole share", deadline))[0]
            return flat + got if i == 0 else got + flat
        nxt, prev = holders[(i + 1) % n], holders[(i - 1) % n]
        chunks = list(torch.tensor_split(flat, n))
        total = torch.empty_like(flat)
        done = list(torch.tensor_split(total, n))

        def exchange(k: int, send_chunk: int) -> _Red[torch.Tensor]:
            tag = f"{round_name}{_ring_tag(holders, k)}"
            self._send_flat(step, what, tag, [(nxt, chunks[send_chunk])])
            want = chunks[(send_chunk - 1) % n].numel()
            return (yield from self._take_flat(step, what, tag, [(prev, want)],
                                               f"in the ring's step {k}", deadline))[0]

        for k in range(n - 1):  # reduce-scatter
            c = (i - k) % n
            got = yield from exchange(k, c)
            chunks[(c - 1) % n].add_(got)  # == got + chunk, bit for bit
        whole = (i + 1) % n
        done[whole].copy_(chunks[whole])
        for k in range(n - 1):  # all-gather: holder i starts with chunk i + 1, whole
            c = (i + 1 - k) % n
            done[(c - 1) % n].copy_((yield from exchange(n - 1 + k, c)))
            chunks[(c - 1) % n] = done[(c - 1) % n]
        return total

    def _make_buckets(self) -> list[_Bucket]:
        """The reduction's buckets, in the order every holder reduces them (holder set, then
        bucket). The gradients of a set held only by this stage's replicas (which run
        the same partition) go last-used first, as a backward finishes them, split by size;
        a set that spans stages (a tied weight) is one bucket in name order, since its
        holders' partitions order their parameters differently."""
        mine = {self.slot, *self._routes.get(self.stage, ())}
        by_set: dict[tuple[int, ...], list[str]] = {}
        for name in reversed(self._params):
            if name in self.program.shared:
                holders = tuple(sorted({self.slot, *self.program.shared[name]}))
                by_set.setdefault(holders, []).append(name)
        out: list[_Bucket] = []
        for holders in sorted(by_set):
            names = by_set[holders]
            if not set(holders) <= mine:
                groups = [sorted(names)]
            else:
                sizes = [self._params[n].numel() * 4 for n in names]
                # the plan's count, about equal bytes each; else the runtime's own size
                cap = (sum(sizes) / self.config.grad_buckets if self.config.grad_buckets > 0
                       else bucket_bytes(sum(sizes)))
                groups, size = [[]], 0
                for n, b in zip(names, sizes, strict=True):
                    if groups[-1] and size + b > cap:
                        groups.append([])
                        size = 0
                    groups[-1].append(n)
                    size += b
            for g in groups:
                out.append(_Bucket(f"#b{len(out)}", holders, tuple(g)))
        return out

    def _overlaps(self, step: int) -> bool:
        """Whether this step's buckets are reduced while its last backward runs: not in an
        fp16 job (the overflow agreement comes first) or with weights in files (their pages
        are the step's). On a GPU a gradient's hook fires once its accumulation is queued on
        the compute stream; the reducer's copy to the host (`StagePlace.host`, on the
        reducer's thread bound to the device) waits for what that stream has queued."""
        return bool(self._buckets) and self._scaler is None and self._disk_params is None

    def _lowrank_now(self, step: int) -> bool:
        return (self._lowrank is not None and step >= self.grad_warmup_steps
                and bool(self._lowrank_names))

    def _reduce_buckets(self, step: int, ready: Sequence[threading.Event] | None,
                        deadline: float, done: threading.Event | None = None
                        ) -> tuple[dict[str, torch.Tensor], int, float]:
        """Sum each bucket's gradients over its holders, each once its `ready` event is set
        (None: all are), up to `BUCKETS_IN_FLIGHT` at once; the sums (host memory), how
        many buckets began before `done` (the backward's end) was set, and the CPU seconds
        this thread spent on it.

        At once, on this one thread: each bucket's reduction is a generator (`_Red`) that
        yields the packets it needs next; the loop resumes whichever has all of its packets
        in, and starts the next bucket once its gradients are final. A bucket waiting on a
        slow link's round trip lets the others compute and send, so a reduction in B buckets
        pays a link's latency about once per round, not B times, and its CPU is that of one
        bucket after another. (Each on a thread of its own, tried 2026-12-07, cost 3-4x the
        CPU per step on this machine for the same work: GPT-2 mini, 2 replicas, rank 4,
        12 ms with one bucket, 52 ms with eight on threads, about 22 ms in turn.) Every
        bucket's sums are those of one bucket alone, bit for bit (each in slot order)."""
        self._place.bind()  # the reducer's thread too
        cpu0 = time.thread_time()
        lr = self._lowrank if self._lowrank_now(step) else None
        totals: dict[str, torch.Tensor] = {}
        early = 0
        active: list[tuple[int, _Red[dict[str, torch.Tensor]], _Need]] = []
        nxt = 0
        try:
            while nxt < len(self._buckets) or active:
                turn = self._next_turn(step, active, ready, nxt, deadline)
                sent: list[bytes | memoryview] | None = None
                if turn is None:  # the next bucket's gradients are final: it starts
                    i, b = nxt, self._buckets[nxt]
                    nxt += 1
                    early += done is not None and not done.is_set()
                    # summed in host memory (the wire's side); `_set_grads` puts them back
                    own = self._place.host({n: self._own_grad(n) for n in b.names})
                    red = self._reduce_bucket(step, b, own, lr)
                else:
                    i, red, _ = active.pop(turn[0])
                    sent = turn[1]
                try:
                    need = next(red) if sent is None else red.send(sent)
                except StopIteration as fin:
                    totals.update(fin.value)
                else:
                    active.append((i, red, need))
                    active.sort(key=lambda x: x[0])  # the oldest bucket first
        finally:
            for _, red, _ in active:
                red.close()
        return totals, early, time.thread_time() - cpu0

    def _next_turn(self, step: int,
                   active: Sequence[tuple[int, _Red[dict[str, torch.Tensor]], _Need]],
                   ready: Sequence[threading.Event] | None, nxt: int, deadline: float
                   ) -> tuple[int, list[bytes | memoryview]] | None:
        """Wait until a reduction of `active` has all its packets in (its index there and
        their payloads, taken from the inbox) or bucket `nxt` may start (None). Raises the
        stage's failure, or `StageError` where packets or a bucket's gradients are late."""
        with self._cond:
            while True:
                if self._failed is not None:
                    raise self._failed
                for j, (_, _, need) in enumerate(active):
                    if all(k in self._inbox for k in need.keys):
                        return j, [self._pop(k)[0] for k in need.keys]
                startable = nxt < len(self._buckets) and len(active) < BUCKETS_IN_FLIGHT
                if startable and (ready is None or ready[nxt].is_set()):
                    return None
                now = time.monotonic()
                for _, _, need in active:
                    if now > need.deadline:
                        k = next(k for k in need.keys if k not in self._inbox)
                        raise StageError(
                            f"stage {self.stage}, step {step}, {need.what}: no {k[0]} from "
                            f"slot {k[2]} on {k[3]!r} within {self.config.recv_timeout_s:g}s")
                if startable and now > deadline:
                    raise StageError(f"stage {self.stage}, step {step}: the gradients of "
                                     f"bucket {self._buckets[nxt].round} were not ready "
                                     f"within {self.config.recv_timeout_s:g}s")
                # `deliver` and the gradient hooks notify; the timeout is a backstop
                self._cond.wait(_ABORT_POLL_S)

    def _wake_reducer(self) -> None:
        """Wake the reducer where it waits in `_next_turn` (a bucket's gradients are final)."""
        with self._cond:
            self._cond.notify_all()

    def _reduce_bucket(self, step: int, b: _Bucket, own: Mapping[str, torch.Tensor],
                       lr: LowRankState | None) -> _Red[dict[str, torch.Tensor]]:
        """One bucket's sums over its holders: dense in one round, or, with `lr`, its
        low-rank gradients' P factors beside the dense ones, then their Q factors."""
        if lr is None:
            return (yield from self._exchange(step, b.round, own, "shared grads"))
        totals: dict[str, torch.Tensor] = {}
        first = {n: self._guard("low-rank P", step, functools.partial(lr.p_factor, n, g))
                 if n in self._lowrank_names else g for n, g in own.items()}
        second: dict[str, torch.Tensor] = {}
        summed = yield from self._exchange(step, b.round, first, "shared grads")
        for n, total in summed.items():
            if n in self._lowrank_names:
                second[n] = self._guard("low-rank Q", step,
                                        functools.partial(lr.q_factor, n, total))
            else:
                totals[n] = total
        if second:
            summed = yield from self._exchange(step, f"{b.round}{_Q_ROUND}", second,
                                               "shared grads (low-rank Q)")
            for n, total in summed.items():
                # into the holder's gradient (its values are in the P factor's M now):
                # memory already touched, no new pages to fault in
                totals[n] = lr.gradient(n, total, self._params[n].shape, out=own[n])
        return totals

    def _start_overlap(self, step: int) -> _Overlap:
        """Before the step's last backward: a hook per shared parameter counts its bucket
        down as autograd finishes its gradient (once per backward: autograd sums every use
        of a leaf before accumulating it), and the reducer thread sums each bucket once it
        is complete, while the backward goes on."""
        if self._reducer is None:
            self._reducer = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix=f"reduce{self.slot}")
        ready = [threading.Event() for _ in self._buckets]
        left = [len(b.names) for b in self._buckets]
        where = {n: i for i, b in enumerate(self._buckets) for n in b.names}
        handles = []
        for name, i in where.items():
            def hook(_: torch.Tensor, i: int = i) -> None:
                left[i] -= 1
                if left[i] == 0:
                    ready[i].set()
                    self._wake_reducer()
            handles.append(self._params[name].register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                hook))
        deadline = time.monotonic() + self.config.recv_timeout_s
        done = threading.Event()
        fut = self._reducer.submit(self._reduce_buckets, step, ready, deadline, done)
        return _Overlap(fut, ready, handles, done, self._wake_reducer)

    def _set_grads(self, totals: Mapping[str, torch.Tensor]) -> None:
        for name, total in totals.items():
            p = self._params[name]
            p.grad = self._place.onto_one(total).to(p.dtype)

    def _reduce_shared(self, step: int) -> float:
        """Sum every shared gradient over its holders, bucket by bucket
        (`_reduce_buckets`), after the step's tasks; the CPU seconds it took."""
        totals, _, cpu_s = self._reduce_buckets(
            step, None, time.monotonic() + self.config.recv_timeout_s)
        self._set_grads(totals)
        return cpu_s

    def _overflow_safe(self, encode: Callable[[], codec.Encoded], t: torch.Tensor
                       ) -> codec.Encoded:
        """`encode()`, or, in an fp16 job, `t` raw where it holds inf or nan (a quantizer
        refuses them): an overflow is what the loss scale expects now and then, and it must
        reach the step's agreement (the receiver reads the encoding off the payload), not
        fail the job."""
        try:
            return encode()
        except LocalProtocolError:
            if self._scaler is None or bool(torch.isfinite(t).all()):
                raise
            return codec.encode_dense(self._place.host_one(t))

    def _fp16_unscale(self, step: int) -> bool:
        """fp16, after the step's last backward: agree with every other slot on whether any
        gradient overflowed; unless one did, unscale this stage's gradients. Returns whether
        the step is skipped (everywhere); the scale moves the same way on every stage."""
        assert self._scaler is not None
        grads = [p.grad for p in self._params.values() if p.grad is not None]
        local = bool(grads) and not bool(
            torch.stack([g.isfinite().all() for g in grads]).all())
        overflow = self._agree_overflow(step, local)
        if not overflow:
            inv = 1.0 / self._scaler.scale  # a power of two: exact
            for g in grads:
                g.mul_(inv)
        self._scaler.update(overflow)
        return overflow

    def _agree_overflow(self, step: int, local: bool) -> bool:
        """Tell every other slot of the job whether this one's gradients overflowed, hear
        theirs: true if any did."""
        if not self._scale_peers:
            return local
        flag = codec.encode_dense(torch.tensor([1.0 if local else 0.0]))
        self._emit([(Packet(PacketKind.PARAM_GRAD, step, 0, _OVERFLOW, self.slot, peer,
                            flag.parts), flag, None) for peer in self._scale_peers])
        deadline = time.monotonic() + self.config.recv_timeout_s
        got, _ = self._take_all([(PacketKind.PARAM_GRAD, step, peer, _OVERFLOW)
                                 for peer in self._scale_peers], deadline, "fp16 overflow")
        anyone = local
        for (_, _, peer, _), payload in got.items():
            t = codec.decode_dense(payload)
            if t.numel() != 1 or not t.dtype.is_floating_point:
                raise StageError(f"stage {self.stage}, step {step}: slot {peer} sent "
                                 f"{tuple(t.shape)} {t.dtype} as its fp16 overflow flag")
            anyone = anyone or bool(t.item() != 0.0)
        return anyone

    @property
    def loss_scale(self) -> LossScale | None:
        """fp16: the loss scale (its `skipped` steps included); None otherwise."""
        return self._scaler

    def _opt_step(self, lr: float) -> None:
        if self.optimizer is None:
            return
        set_lr(self.optimizer, lr)
        if self._disk_params is not None:
            self._disk_params.step(self.optimizer, self._offload)
            self._disk_params.flush()
            return
        # Under a memory plan the gradients stay allocated, zeroed, from one step to the
        # next: allocated anew in each backward they land between its activations, and the
        # heap stays fragmented around them (measured: 24 GPT-2 layers, everything in memory,
        # peaked 40 MiB over the plan; 0 + g is g, so the values are the same)
        none = not self._trim
        if self._offload is not None:  # a chunk of the state in memory at a time
            # each chunk's state read ahead while the one before steps, and written back
            # behind it (`DiskOptimizerState.release_behind`): transfers under the compute
            try:
                step_in_chunks(self.optimizer, self._step_chunks, self._offload.release_behind,
                               self._offload.prefetch)
            except BaseException:
                with contextlib.suppress(OffloadError):  # the first failure is the one raised
                    self._offload.drain()
                raise
            self._offload.drain()
            self.optimizer.zero_grad(set_to_none=none)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=none)

    # -- the iteration --------------------------------------------------------------------

    async def run_step(self, step: int) -> StepReport:
        """Run every task of `step` in schedule order on the compute thread, then step the
        optimizer. Cancelling it stops the thread at its next wait."""
        if self._pool is None:
            await self.start()
        assert self._pool is not None
        with self._cond:
            if self._failed is not None:
                raise self._failed
            self._step = step
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._run_step, step)
        try:
            return await fut
        except asyncio.CancelledError:
            self.fail(StageError(f"stage {self.stage}, step {step}: cancelled"))
            raise

    def _guard(self, what: str, step: int, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except StageError:
            raise
        except Exception as e:  # classified here, where we know what raised it
            where = getattr(e, "fusion_where", None)  # the op that raised (StageHost's run)
            raise StageError(f"stage {self.stage}, step {step}, {what}: {e!r}"
                             + (f" in {where}" if where else ""), fault=fault_of(e)) from e

    def _run_task(self, step: int, task: Task, mbs: list[Batch] | None,
                  ctxs: dict[int, _Ctx], losses: list[torch.Tensor],
                  timeline: list[TaskTiming], t0: float, busy: float, waited: float,
                  free: float) -> tuple[float, float, float]:
        """One task of the step (on the compute thread): wait for its inputs, run it, queue
        its outputs; the step's busy and waited seconds and when the stage was last free."""
        deadline = time.monotonic() + self.config.recv_timeout_s
        m = task.micro
        what = f"{task}"
        cost = _Cost()
        if task.phase is Phase.F:
            got, arrived = self._take_all(
                [(PacketKind.FORWARD, step, m, e) for e in self._in], deadline, what)
            payloads = {k[3]: payload for k, payload in got.items()}
            ready = max(free, arrived)
            start, cpu0 = time.perf_counter(), time.thread_time()
            mb = mbs[m] if mbs is not None else None
            ctx, packets = self._guard(
                what, step, functools.partial(self._forward, step, m, payloads, mb, cost))
            if ctx.loss is not None:  # read once a step (on a device: no wait per task)
                losses.append(ctx.loss.detach())
            ctxs[m] = ctx
        else:
            ctx = ctxs.pop(m)
            got, arrived = self._take_all(
                [(PacketKind.BACKWARD, step, m, e) for e in sorted(ctx.grad_edges)],
                deadline, what)
            payloads = {k[3]: payload for k, payload in got.items()}
            ready = max(free, arrived)
            start, cpu0 = time.perf_counter(), time.thread_time()
            packets = self._guard(
                what, step, functools.partial(self._backward, step, m, ctx, payloads, cost))
            del ctx
            if self._trim or near_limit(self.config.memory_limit_bytes):
                trim_heap()
        end, cpu = time.perf_counter(), time.thread_time() - cpu0
        busy += end - start
        waited += max(0.0, ready - free)
        send_s = self._emit(packets)
        if len(timeline) < MAX_TIMELINE:  # a bounded report, however many micro-batches
            timeline.append(TaskTiming(what, ready - t0, start - t0, end - t0,
                                       max(0.0, ready - free), cpu, cost.kernel_s,
                                       cost.codec_s, send_s))
        free = time.perf_counter()
        return busy, waited, free

    def _run_step(self, step: int) -> StepReport:
        """One step, on the compute thread."""
        self._place.bind()
        t0 = time.perf_counter()
        busy = 0.0
        self._stats = {}
        mbs: list[Batch] | None = None
        if self.program.data_inputs:
            assert self.data is not None
            data = self.data
            mbs = self._guard("data", step, lambda: split_micro_batches(
                data.batch(step, self.batch_size), self.micro_batches,
                self.micro_batch_sizes))
        ctxs: dict[int, _Ctx] = {}
        losses: list[torch.Tensor] = []
        timeline: list[TaskTiming] = []
        waited = 0.0
        free = time.perf_counter()  # when the stage last had nothing to do but wait
        last_b = max((i for i, t in enumerate(self.tasks) if t.phase is not Phase.F),
                     default=None)
        overlap = last_b is not None and self._overlaps(step)
        reducing: _Overlap | None = None
        try:
            for i, task in enumerate(self.tasks):
                if overlap and i == last_b:
                    reducing = self._start_overlap(step)
                try:
                    busy, waited, free = self._run_task(
                        step, task, mbs, ctxs, losses, timeline, t0, busy, waited, free)
                finally:
                    if reducing is not None and i == last_b:
                        reducing.backward_ended()
        except BaseException as e:
            if reducing is not None:  # the reducer's waits end with the task's own error
                self.fail(e)
            raise
        skip = False
        if self._scaler is not None:
            tb = time.perf_counter()
            skip = self._fp16_unscale(step)
            busy += time.perf_counter() - tb
        early, exposed, reduce_cpu = 0, 0.0, 0.0
        if reducing is not None:
            tb = time.perf_counter()  # what the reduction did not hide
            totals, early, reduce_cpu = reducing.future.result()
            self._set_grads(totals)
            exposed = time.perf_counter() - tb
        elif self.program.shared and not skip:
            tb = time.perf_counter()
            reduce_cpu = self._reduce_shared(step)
            exposed = time.perf_counter() - tb
        busy += exposed
        lr = lr_at(self.opt_spec, step, self.total_steps)
        to = time.perf_counter()
        if skip:  # an overflow somewhere in the job: every stage drops this step's gradients
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=not self._trim)
        else:
            self._guard("optimizer step", step, lambda: self._opt_step(lr))
        if self._trim or near_limit(self.config.memory_limit_bytes):
            trim_heap()
        busy += time.perf_counter() - to
        wall = time.perf_counter() - t0
        # this executor's share of the iteration's mean loss (all of it without replicas:
        # it ran every micro-batch); the loss stage's replicas' shares add up
        values = ([float(x) for x in self._place.host_one(torch.stack(losses).float())]
                  if self._place.cuda and losses else [float(x) for x in losses])
        loss = None
        if values and self.micro_batch_sizes:
            micros = [t.micro for t in self.tasks if t.phase is Phase.F]
            total = sum(self.micro_batch_sizes)
            loss = sum(v * self.micro_batch_sizes[m] / total
                       for v, m in zip(values, micros, strict=True))
        elif values:
            loss = sum(values) / self.micro_batches
        return StepReport(self.stage, step, loss, lr, wall, busy, list(self._stats.values()),
                          timeline, t0, waited, buckets_early=early, reduce_exposed_s=exposed,
                          reduce_cpu_s=reduce_cpu)

    def weigh_loss(self, loss: torch.Tensor, micro: int) -> torch.Tensor:
        """Micro-batch `micro`'s (mean) loss as it counts in the step's: over M, or times its
        share of the batch's samples where the micro-batches have sizes of their own."""
        if self.micro_batch_sizes:
            return loss * self.micro_batch_sizes[micro] / sum(self.micro_batch_sizes)
        return loss / self.micro_batches

    def _take_all(self, keys: Sequence[_Key], deadline: float, what: str
                  ) -> tuple[dict[_Key, bytes | memoryview], float]:
        """Wait for every packet of `keys`: their payloads, and the last one's arrival."""
        got: dict[_Key, bytes | memoryview] = {}
        last = 0.0
        for k in keys:
            got[k], arrived = self._take(k, deadline, what)
            last = max(last, arrived)
        return got, last

    async def run(self, first: int, count: int,
                  on_step: Callable[[StepReport], Any] | None = None, *,
                  hold: Callable[[int], bool] | None = None,
                  snapshot: Callable[[int], bool] | None = None) -> list[StepReport]:
        """Run steps `first .. first+count-1`; then flush the outbound queues.

        The compute thread runs the steps back to back. `on_step(report)` is called on the
        event loop after each step, in step order; if it returns an awaitable (e.g. sending the
        report to the scheduler), it is awaited before the next report's call. After a step
        for which `hold(step)` is true (None: every step), the compute thread waits for that
        step's `on_step` to finish before it starts the next, so the callback sees the state
        the step left (a checkpoint); after any other step it runs ahead, at most
        `RUN_AHEAD_STEPS` steps beyond the last report the loop has handled. A callback that
        raises stops the stage (its next wait raises) and the error is raised here.

        After a step for which `snapshot(step)` is true, the compute thread copies the
        partition's state into the report (`StepReport.state`) before it goes on: a callback
        that saves it need not hold the next step (a memory copy of the state per snapshot,
        at most `RUN_AHEAD_STEPS` + 1 of them alive).
        """
        if self._pool is None:
            await self.start()
        assert self._pool is not None and self._loop is not None
        loop = self._loop
        with self._cond:
            if self._failed is not None:
                raise self._failed
            self._step = first  # packets for `first` may arrive before its step starts
            self._handled = first - 1
        # at most RUN_AHEAD_STEPS + 1 reports, then None once the thread has ended (its
        # posts and its future's completion reach the loop in the order they were made)
        reports: asyncio.Queue[StepReport | None] = asyncio.Queue()

        def post(rep: StepReport) -> None:
            loop.call_soon_threadsafe(reports.put_nowait, rep)

        holds = (lambda _: True) if hold is None else hold
        if on_step is None:
            holds = lambda _: False  # noqa: E731 - nothing to wait for
        work = loop.run_in_executor(self._pool, self._run_steps, first, count, post, holds,
                                    snapshot or (lambda _: False))
        work.add_done_callback(lambda _: reports.put_nowait(None))
        done: list[StepReport] = []
        try:
            while (rep := await reports.get()) is not None:
                done.append(rep)
                if on_step is not None:
                    res = on_step(rep)
                    if inspect.isawaitable(res):
                        await res
                with self._cond:
                    self._handled = rep.step
                    self._cond.notify_all()
            await work  # the compute thread's failure, if it had one
        except asyncio.CancelledError:
            self.fail(StageError(f"stage {self.stage}, step {self._step}: cancelled"))
            # the thread stops at its next wait; its error then is nobody's to retrieve
            work.cancel()
            raise
        except BaseException as e:
            self.fail(e if isinstance(e, Exception) else StageError(f"stage {self.stage}: {e!r}"))
            with contextlib.suppress(Exception):
                await work  # the compute thread stops at its next wait
            raise
        await self.flush()
        return done

    def _run_steps(self, first: int, count: int, post: Callable[[StepReport], None],
                   hold: Callable[[int], bool], snapshot: Callable[[int], bool]) -> None:
        """The compute thread's loop over steps (`run`)."""
        for step in range(first, first + count):
            with self._cond:
                # a step that holds waits for its own report; any other, for the report
                # RUN_AHEAD_STEPS steps back
                behind = 0 if step > first and hold(step - 1) else RUN_AHEAD_STEPS
                while self._failed is None and self._handled < step - 1 - behind:
                    self._cond.wait()
                if self._failed is not None:
                    raise self._failed
                self._step = step
            rep = self._run_step(step)
            if snapshot(step):
                rep.state = {k: v.detach().to("cpu", copy=True)
                             for k, v in self.program.module.state_dict().items()}
            post(rep)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The partition's parameters and buffers (detached, CPU)."""
        return {k: v.detach().cpu() for k, v in self.program.module.state_dict().items()}

