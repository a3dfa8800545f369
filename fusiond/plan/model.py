"""The planner's own cost model: op costs, the cost graph, machines, the cluster, job settings.

Everything here is plain data and pure arithmetic (no I/O, no torch), so OP-Fence and AdaTopK
can be simulated and tested on synthetic graphs. `fusiond.plan.estimator` builds a `CostGraph`
from the captured IR; `fusiond.profile.calibrate` measures a `MachineProfile`.

Units: FLOPs, bytes, seconds, bytes per second. Per-sample quantities scale linearly with the
micro-batch size (a sample is one row of the batch dimension, e.g. one sequence).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import numpy as np
import numpy.typing as npt

from fusiond.errors import LocalError

F64 = npt.NDArray[np.float64]

#: Op classes a machine is calibrated for. An op's class picks the FLOP rate it runs at.
OP_CLASSES: tuple[str, ...] = ("matmul", "conv", "attention", "other")
SMALL_MATMUL = "matmul_small"
TINY_MATMUL = "matmul_tiny"
"""Rates a profile may carry beside its op classes: the "matmul" class's rate at smaller
products (`MATMUL_SHAPES`). No op has these classes; `op_times` interpolates a matmul-class
op's rate between the products a profile carries by the op's FLOPs per call."""
MATMUL_SHAPES: Mapping[str, tuple[int, int, int]] = {
    TINY_MATMUL: (256, 32, 96),
    SMALL_MATMUL: (256, 256, 768),
    "matmul": (1024, 768, 2304),
}
"""The linear layers (rows, in features, out features) the calibration times forward and
backward for each matmul rate, smallest first: GPT-2 tiny's micro-batch of 256 tokens through
its 32-wide attention projection, a 256-wide model's, and a GPT-2 small projection over 1024
tokens. On one core of an Intel Xeon they run at about 0.4, 0.86 and 1x the big one's rate
per FLOP (68, 137 and 160 GFLOP/s), on a GPU the small ones at a few percent of it: a planner
that priced every product at the big rate saw small models' steps 15-40 % too short here."""
_CLASS_FALLBACK = {"attention": "matmul", SMALL_MATMUL: "matmul", TINY_MATMUL: "matmul"}
"""The class whose rate stands in for a class a profile does not carry (an older daemon's
profile has no "attention"; its products were matmul-class then; nor the smaller products'
rates: its products all ran at the one rate). Any other: "other"."""


def matmul_flops_per_call(shape: tuple[int, int, int]) -> float:
    """Forward + backward FLOPs of a linear layer (rows, in, out): 2 m k n forward, twice that
    backward (the input's and the weight's gradient), as the estimator counts them."""
    m, k, n = shape
    return 6.0 * m * k * n


class PlanError(LocalError):
    """A planning input is invalid or no plan satisfies the constraints (the message says which)."""


@dataclass(frozen=True)
class OpCost:
    """Cost of one operator. Per-sample fields scale with the micro-batch size.

    `fwd_flops`/`bwd_flops`: arithmetic work; `fwd_bytes`/`bwd_bytes`: memory traffic (the
    roofline's other side, what elementwise ops are bound by); `param_bytes`: parameters the op
    owns (counted once per op; tied weights are de-duplicated per stage via `params`);
    `opt_state_bytes`: optimizer state for those parameters; `saved_bytes`: activations kept for
    backward; `out_bytes`: the op's outputs (what a cut on its outgoing edges would carry);
    `fwd_launches`/`bwd_launches`: kernel dispatches (each costs the machine's per-op overhead).
    """

    name: str
    op: str = ""
    op_class: str = "other"
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    param_bytes: float = 0.0
    opt_state_bytes: float = 0.0
    saved_bytes: float = 0.0
    out_bytes: float = 0.0
    fwd_launches: float = 1.0
    bwd_launches: float = 0.0
    params: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorEdge:
    """A tensor produced by op `src` and consumed by ops `dsts` (indices into `CostGraph.ops`).

    `nbytes`/`numel` are per sample, dense. `grad`: a gradient of the same size flows back.
    `compressible`: top-k may be applied (floating point and not marked exact by the user).
    """

    name: str
    src: int
    dsts: tuple[int, ...]
    nbytes: float
    numel: float
    grad: bool = True
    compressible: bool = True
    last_dim: float = 0.0
    """Size of the last axis (the features of a token or pixel: what a low-rank codec
    factorizes over); 0: unknown or a tensor of rank < 2."""


@dataclass(frozen=True, eq=False)
class CostGraph:
    """Ops in a topological order plus the tensors between them. Validated on construction."""

    ops: tuple[OpCost, ...]
    tensors: tuple[TensorEdge, ...]
    name: str = "graph"
    #: parameter name -> bytes (for de-duplicating tied weights); optional
    param_sizes: Mapping[str, float] = field(default_factory=dict)
    #: positions where a block begins (`protocol.ir.block_starts`): the units of the memory
    #: planner's per-block decisions (`fusiond.plan.memory`); empty: one block per op
    block_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        names = [o.name for o in self.ops]
        if len(set(names)) != len(names):
            raise PlanError("CostGraph: duplicate op names")
        n = len(self.ops)
        for t in self.tensors:
            if not 0 <= t.src < n or any(not t.src < d < n for d in t.dsts):
                raise PlanError(
                    f"CostGraph: tensor {t.name!r} edge {t.src}->{t.dsts} is out of range "
                    "or not in topological order"
                )
            if t.nbytes < 0 or t.numel < 0:
                raise PlanError(f"CostGraph: tensor {t.name!r} has a negative size")

    def __len__(self) -> int:
        return len(self.ops)

    def index(self) -> dict[str, int]:
        """Op name -> position in the topological order."""
        return {o.name: i for i, o in enumerate(self.ops)}

    def total_params(self) -> float:
        return float(sum(o.param_bytes for o in self.ops))


DEVICE_RE: Final = re.compile(r"cpu|cuda:[0-9]{1,2}")
"""The devices a stage may compute on: the CPU, or a CUDA device by index."""


@dataclass(frozen=True)
class MachineProfile:
    """A machine's calibrated speed and memory (gossiped in its profile as `to_dict()`).

    `flops`: FLOP/s per op class (a missing class falls back to "other"); `mem_bw`: bytes/s of
    memory traffic; `op_overhead_s`: fixed cost per kernel dispatch; `memory_bytes`: what a job
    may use; `wire_s_per_byte`: this machine's own time per byte a stage sends or receives
    (encoding, TLS, the kernel's socket copies: half a measured send + receive), which a host
    on a small CPU share pays beside its compute (0: not calibrated, free); `msg_s`: its own
    fixed time per message a stage sends or receives (framing, the event loop, a TLS record,
    measured on the real transport by `fusiond.profile`; 0: not calibrated); `wake_s`: how long
    a thread of this machine that is woken (a tensor arrived, a task finished) waits on average
    before it runs, when the machine has used up its CPU share: (1 - share) x the CFS period
    under a cgroup CPU quota of `share` of a core per busy thread, 0 without a quota. Every
    hand-off between stages pays it at both ends (`fusiond.plan.pipeline.evaluate`).
    `ops`: the op names this machine runs (its torch's registry less the ops its operator
    disabled, `fusiond.opsets`); None: every op. The planner places a stage on it only if it
    runs every op of the stage (an op of a cost graph without a name, `OpCost.op == ""`, runs
    anywhere).
    """

    id: str
    flops: Mapping[str, float]
    mem_bw: float
    op_overhead_s: float
    memory_bytes: float
    kind: str = ""
    wire_s_per_byte: float = 0.0
    msg_s: float = 0.0
    wake_s: float = 0.0
    ops: frozenset[str] | None = None
    disk_bytes_per_s: float = 0.0
    """Its local disk's rate for the optimizer state a stage keeps there (read and written
    once per step; `JobSettings.offload`), as its daemon measured it
    (`fusiond.profile.disk_bytes_per_s`); 0: not measured, `DEFAULT_DISK_BYTES_PER_S`."""
    disk_free_bytes: float = 0.0
    """Free bytes on that disk (where its daemon keeps a stage's files); 0: not known, no
    bound. The memory planner puts no more there than `DISK_FREE_SHARE` of it."""
    device: str = "cpu"
    """The torch device a stage placed here computes on: "cpu", or an accelerator of the
    machine ("cuda:0"), whose rates and memory these are (`fusiond.profile.stage_device`)."""

    @property
    def disk_rate_bytes_per_s(self) -> float:
        """The disk rate the planner uses."""
        return self.disk_bytes_per_s or DEFAULT_DISK_BYTES_PER_S

    @property
    def disk_room_bytes(self) -> float:
        """What the planner may put on its disk: `DISK_FREE_SHARE` of the free bytes (inf: not
        known)."""
        return self.disk_free_bytes * DISK_FREE_SHARE if self.disk_free_bytes > 0 else math.inf

    def runs(self, op: str) -> bool:
        """Whether this machine runs the op `op` (an unnamed op runs everywhere)."""
        return self.ops is None or not op or op in self.ops

    def __post_init__(self) -> None:
        if not self.flops or any(v <= 0 or not math.isfinite(v) for v in self.flops.values()):
            raise PlanError(f"machine {self.id!r}: flops must be positive and finite")
        if self.mem_bw <= 0 or self.op_overhead_s < 0 or self.memory_bytes <= 0:
            raise PlanError(f"machine {self.id!r}: mem_bw/memory must be > 0, overhead >= 0")
        for name in ("wire_s_per_byte", "msg_s", "wake_s", "disk_bytes_per_s", "disk_free_bytes"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise PlanError(f"machine {self.id!r}: {name} must be >= 0 and finite")
        if not DEVICE_RE.fullmatch(self.device):
            raise PlanError(f"machine {self.id!r}: device {self.device[:32]!r} is not \"cpu\" "
                            "or \"cuda:N\"")

    def rate(self, op_class: str) -> float:
        r = self.flops.get(op_class)
        if r is None:
            r = self.flops.get(_CLASS_FALLBACK.get(op_class, "other"))
        if r is None:
            r = self.flops.get("other", min(self.flops.values()))
        return r

    def to_dict(self) -> dict[str, Any]:
        """JSON/msgpack-safe form (for the gossiped profile)."""
        return {
            "id": self.id,
            "flops": dict(self.flops),
            "mem_bw": self.mem_bw,
            "op_overhead_s": self.op_overhead_s,
            "memory_bytes": self.memory_bytes,
            "kind": self.kind,
            "wire_s_per_byte": self.wire_s_per_byte,
            "msg_s": self.msg_s,
            "wake_s": self.wake_s,
            "disk_bytes_per_s": self.disk_bytes_per_s,
            "disk_free_bytes": self.disk_free_bytes,
        } | ({} if self.ops is None else {"ops": sorted(self.ops)}) | (
            {} if self.device == "cpu" else {"device": self.device})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MachineProfile:
        """Inverse of `to_dict`; raises PlanError naming a missing or mistyped field."""
        try:
            flops = {str(k): float(v) for k, v in dict(d["flops"]).items()}
            return cls(
                id=str(d["id"]),
                flops=flops,
                mem_bw=float(d["mem_bw"]),
                op_overhead_s=float(d["op_overhead_s"]),
                memory_bytes=float(d["memory_bytes"]),
                kind=str(d.get("kind", "")),
                wire_s_per_byte=float(d.get("wire_s_per_byte", 0.0)),
                msg_s=float(d.get("msg_s", 0.0)),
                wake_s=float(d.get("wake_s", 0.0)),
                disk_bytes_per_s=float(d.get("disk_bytes_per_s", 0.0)),
                disk_free_bytes=float(d.get("disk_free_bytes", 0.0)),
                ops=None if d.get("ops") is None else frozenset(str(x) for x in d["ops"]),
                device=str(d.get("device", "cpu")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"machine profile: bad or missing field ({e!r})") from e


def scale_machine(m: MachineProfile, *, parallel: float, serial: float,
                  note: str = "") -> MachineProfile:
    """`m` on a CPU share: FLOP rates and memory bandwidth x `parallel` (the cores its threads
    may keep busy), the per-dispatch, per-wire-byte and per-message costs / `serial` (the share
    of one core the dispatching thread gets). Both must be > 0. With rates per CPU second and
    the shares from the host's quota and thread count, the planner's compute time of a stage is
    its work over the speed the host really has (`fusiond.profile.calibrate.at_allowance`).
    `note` is appended to `kind`."""
    if not (parallel > 0 and serial > 0 and math.isfinite(parallel) and math.isfinite(serial)):
        raise PlanError(f"machine {m.id!r}: CPU shares must be positive, got {parallel}, {serial}")
    return MachineProfile(
        id=m.id, flops={k: v * parallel for k, v in m.flops.items()},
        mem_bw=m.mem_bw * parallel, op_overhead_s=m.op_overhead_s / serial,
        memory_bytes=m.memory_bytes,
        kind=f"{m.kind}@{note}" if note and m.kind else (m.kind or note),
        # the event loop, the TLS record layer and the socket copies run on one thread
        wire_s_per_byte=m.wire_s_per_byte / serial, msg_s=m.msg_s / serial,
        wake_s=m.wake_s, ops=m.ops, device=m.device)


def slower_of(a: MachineProfile, b: MachineProfile) -> MachineProfile:
    """`a` with every rate no faster than `b`'s and the dispatch cost no cheaper (id, memory
    and kind of `a`)."""
    flops = {k: min(v, b.rate(k)) for k, v in a.flops.items()}
    return MachineProfile(id=a.id, flops=flops, mem_bw=min(a.mem_bw, b.mem_bw),
                          op_overhead_s=max(a.op_overhead_s, b.op_overhead_s),
                          memory_bytes=a.memory_bytes, kind=a.kind,
                          wire_s_per_byte=max(a.wire_s_per_byte, b.wire_s_per_byte),
                          msg_s=max(a.msg_s, b.msg_s), ops=a.ops, device=a.device)


@dataclass(frozen=True, eq=False)
class Cluster:
    """Machines plus the measured links: `bandwidth_bytes_per_s[i][j]` from machine i to j
    (bytes, not bits: `fusiond.units` converts a measured link once), `rtt_s[i][j]` the round
    trip in seconds."""

    machines: tuple[MachineProfile, ...]
    bandwidth_bytes_per_s: F64
    rtt_s: F64

    def __post_init__(self) -> None:
        k = len(self.machines)
        if k == 0:
            raise PlanError("cluster has no machines")
        if len({m.id for m in self.machines}) != k:
            raise PlanError("cluster: duplicate machine ids")
        for name, arr in (("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s),
                          ("rtt_s", self.rtt_s)):
            if arr.shape != (k, k):
                raise PlanError(f"cluster: {name} must be {k}x{k}, got {arr.shape}")
        off = ~np.eye(k, dtype=bool)
        if k > 1 and (not np.all(np.isfinite(self.bandwidth_bytes_per_s[off]))
                      or np.any(self.bandwidth_bytes_per_s[off] <= 0)):
            raise PlanError("cluster: bandwidth_bytes_per_s must be positive and finite off "
                            "the diagonal")
        if np.any(self.rtt_s < 0):
            raise PlanError("cluster: rtt_s must be >= 0")

    @classmethod
    def build(
        cls,
        machines: Sequence[MachineProfile],
        bandwidth_bytes_per_s: Sequence[Sequence[float]] | F64,
        rtt_s: Sequence[Sequence[float]] | F64 | None = None,
    ) -> Cluster:
        bw = np.array(bandwidth_bytes_per_s, dtype=np.float64)
        k = len(machines)
        r = np.zeros((k, k)) if rtt_s is None else np.array(rtt_s, dtype=np.float64)
        if bw.shape == (k, k):
            np.fill_diagonal(bw, np.inf)  # a machine talking to itself costs nothing
        return cls(tuple(machines), bw, r)

    def __len__(self) -> int:
        return len(self.machines)

    def ids(self) -> list[str]:
        return [m.id for m in self.machines]

    def with_bandwidth(self, bandwidth_bytes_per_s: F64, rtt_s: F64 | None = None) -> Cluster:
        """Same machines, newly measured links (for AdaTopK re-adaptation)."""
        return Cluster.build(self.machines, bandwidth_bytes_per_s,
                             self.rtt_s if rtt_s is None else rtt_s)


DEFAULT_DISK_BYTES_PER_S = 2e8
"""An unmeasured disk counts as 200 MB/s for optimizer state kept on it (a SATA SSD writes
400-500 MB/s, a spinning disk 100-200); daemons measure their own (`plan_disk_bytes_per_s`)."""

DISK_FREE_SHARE = 0.8
"""The share of a disk's free bytes the memory planner may fill with a stage's files (the rest
for the machine's own use, logs, checkpoints, and what else frees or fills meanwhile)."""

DEFAULT_DENSITY_FLOOR = 0.05
"""The least top-k density a cut edge may get: the one floor, read by the job file's default
(`compression.density_floor`) and the planner's (issue 22: they were 0.01 and 0.05)."""

EdgeEncoding = Literal["raw", "bf16", "int8", "int4", "lowrank"]
"""How a cut edge travels when it is not top-k, both directions, decoded dense: exact, or
bfloat16, or int8 / int4 block-quantized, or as rank-r factors P Q^T over its last axis
(`fusiond.train.codec.encode_edge`)."""

LOWRANK_DIVISOR = 8
"""A low-rank edge keeps rank max(1, features // 8) of its last axis (features)."""


def lowrank_rank(features: int) -> int:
    """The rank a low-rank edge keeps of a tensor whose last axis has `features` elements."""
    return max(1, features // LOWRANK_DIVISOR)
EDGE_ENCODINGS: tuple[EdgeEncoding, ...] = get_args(EdgeEncoding)


BUCKET_MIN_BYTES = 1 << 20
BUCKET_MAX_BYTES = 25 << 20
BUCKETS_PER_SET = 8
"""A dense gradient reduction goes in buckets, as DDP's does: the gradients a set of holders
shares, split into about `BUCKETS_PER_SET` buckets of `BUCKET_MIN_BYTES` to
`BUCKET_MAX_BYTES` (DDP's 25 MiB), each reduced as soon as its gradients are final
(`fusiond.train.stage.StageExecutor`)."""


def bucket_bytes(grad_bytes: float) -> float:
    """The bucket size the runtime aims at for a set of `grad_bytes` of gradients."""
    return min(float(BUCKET_MAX_BYTES), max(float(BUCKET_MIN_BYTES),
                                            grad_bytes / BUCKETS_PER_SET))


REDUCE_MSG_OPS = 100.0
"""What one message of fusion's gradient reduction costs each of its two ends beyond its bytes and
its socket, in op dispatches (`MachineProfile.op_overhead_s`): the reducer's Python per
message (its packet built and parsed, the flat chunk encoded, decoded and added, the turn
that resumes its bucket). Measured 2026-12-07 on this 2-core machine (op dispatch 4.2 us),
the reducer thread's CPU per step (`StepReport.reduce_cpu_s`) of GPT-2 mini's 19 MB on 2
and 4 replicas in one process, 1, 4 and 16 buckets: 0.40-0.51 ms more per message at the
same bytes, dense or low-rank, ring or two-level (4 replicas, a ring, rank 4: 22 ms a step
in one bucket, 114 ms in 16); on the emulated WAN's 0.4-core hosts, 94 ms of the reducer's
CPU a step for 16 buckets two-level where bytes and compression account for 15. (Priced at
2 x `msg_s` alone until then, about 0.12 ms: the plan saw buckets as nearly free, gave the
WAN's replicas 16 and predicted a step 0.63 of what they took.)"""



@dataclass(frozen=True)
class JobSettings:
    """What the planner needs to know about the job.

    `schedule`: "1f1b" keeps min(M, S - s) micro-batches of activations in flight on stage s;
    "gpipe" keeps all M. `optimizer_passes`: bytes touched per parameter byte by one optimizer
    step (Adam: read p, g, m, v and write p, m, v = 7). `memory_fraction`: the share of a
    machine's memory the job may use (the rest is runtime, allocator slack, buffers).
    `topk_value_bytes`: wire bytes per kept value (fp16), both ways; the forward also sends
    the kept positions (`topk_index_bytes`), the backward does not (the sender knows them).
    `edge_encoding`: every compressible cut tensor travels so encoded both ways
    (`encoded_wire_bytes`; "int8" is the SWARM-style job), never top-k (AdaTopK does not
    apply). `codec_choice`: the planner picks each compressed link's codec
    (`fusiond.plan.codecs`, AdaTopK's successor) among those whose measured held-out loss
    cost is within `accuracy_budget` (a fraction of the loss).
    """

    micro_batch_size: int = 1
    num_micro_batches: int = 8
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    density_floor: float = DEFAULT_DENSITY_FLOOR
    exact_edges: frozenset[str] = field(default_factory=frozenset)
    optimizer_passes: float = 7.0
    memory_fraction: float = 0.9
    topk_value_bytes: float = 2.0
    edge_encoding: EdgeEncoding = "raw"
    codec_choice: bool = False
    accuracy_budget: float = 0.01
    grad_density_floor: float = 1.0
    """The least share of a replicated stage's gradient bytes its reduction may send
    (low-rank, PowerSGD-style, with error feedback: rank r of an m x n gradient sends
    r (m + n) / (m n) of it); 1.0: gradients are reduced dense. The planner sends as much as
    the reduction can hide behind the drain, down to this floor."""
    grad_rank: int = 4
    """The rank the runtime compresses a reduction at when the plan compresses it (the job's
    `compression.grad_rank`): what the compression's own work costs (`lowrank_s_per_byte`)."""
    offload: bool = False
    """A stage whose state would not fit its machine may keep its optimizer state on the
    machine's disk (`fusiond.train.offload`): it then needs no memory for it and pays reading
    and writing it once per step at the disk's rate. The evaluator chooses it per stage, only
    where the stage does not fit otherwise, or where it costs less time than recomputing."""
    offload_params: bool = True
    """With `offload`: a stage may keep its weights and gradients on disk too, as a last
    resort (an fp16 job may not: its stages unscale their gradients in memory). Stages on an
    accelerator (`MachineProfile.device`) never offload to disk."""
    recompute: bool = False
    """A stage whose kept activations would not fit its machine may recompute them instead
    (activation checkpointing of the whole stage, `fusiond.train.stage.StageConfig`): it
    keeps only its inputs per micro-batch in flight and one micro-batch's activations, and
    pays one more forward per micro-batch. The evaluator chooses it per stage, only where the
    plain stage does not fit."""
    reduce_in_backward: bool = True
    """A replicated stage's gradient reduction runs by buckets during its last backward (each
    bucket once the backward has finished its gradients, as many as the plan chooses, dense or
    low-rank), as the stage runtime and DDP's comm hooks do; not in an fp16 job (its stages
    agree on an overflow first), nor on a stage with its weights on disk."""
    sized_micro_batches: bool = False
    """A one-stage plan's replicas (data parallelism) take micro-batches of their own sizes:
    each keeps its whole-micro-batch count (`micro_batch_shares`) and the global batch is
    dealt out in samples so that they finish together (`sized_shares`); each micro-batch's
    loss is weighted by its size, so the step is the global batch's mean as before. Off: every
    micro-batch has `micro_batch_size` samples (what DDP runs: one batch size per rank)."""
    reduce_msg_ops: float = REDUCE_MSG_OPS
    """What each message of a replicated stage's gradient reduction costs each end beyond the
    transport's `msg_s`, in op dispatches (`MachineProfile.op_overhead_s`): the stage
    runtime's reducer (`REDUCE_MSG_OPS`, measured). A baseline whose collectives run in C++
    (DDP's gloo or NCCL) is scored with 0."""
    snapshots: bool = False
    """The job sends its stages' state (checkpoints, held-out evaluations): each stage's first
    replica holds a copy of its weights from its step's end until the copy is sent
    (`StageExecutor`'s snapshot), one more parameter's worth of memory."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise PlanError("micro_batch_size and num_micro_batches must be >= 1")
        if not 0 < self.density_floor <= 1:
            raise PlanError(f"density_floor must be in (0, 1], got {self.density_floor}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise PlanError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if not 0 < self.memory_fraction <= 1:
            raise PlanError("memory_fraction must be in (0, 1]")
        if self.edge_encoding not in EDGE_ENCODINGS:
            raise PlanError(f"edge_encoding must be one of {list(EDGE_ENCODINGS)}, got "
                            f"{self.edge_encoding!r}")
        if self.codec_choice and self.edge_encoding != "raw":
            raise PlanError("codec_choice picks each link's codec: give no edge_encoding")
        if not 0 <= self.accuracy_budget < 1:
            raise PlanError(f"accuracy_budget must be in [0, 1), got {self.accuracy_budget}")
        if not 0 < self.grad_density_floor <= 1:
            raise PlanError(f"grad_density_floor must be in (0, 1], got "
                            f"{self.grad_density_floor}")
        if not 0 <= self.reduce_msg_ops < 1e6:
            raise PlanError(f"reduce_msg_ops must be in [0, 1e6), got {self.reduce_msg_ops}")
        if not 1 <= self.grad_rank <= 1024:
            raise PlanError(f"grad_rank must be in [1, 1024], got {self.grad_rank}")


    @property
    def int8_edges(self) -> bool:
        """Whether every compressible cut edge travels int8 (the SWARM-style job)."""
        return self.edge_encoding == "int8"


def op_times(graph: CostGraph, machine: MachineProfile, batch: int) -> F64:
    """Forward+backward seconds of each op for one micro-batch of `batch` samples on `machine`.

    Roofline per pass: max(FLOPs / class rate, bytes / memory bandwidth), plus the dispatch
    overhead per launch. Parameters are read once per pass (and the gradient written once in
    backward) whatever the batch.
    """
    a = _op_arrays(graph)
    rate = _op_rates(a, machine, batch)
    bw = machine.mem_bw
    f = np.maximum(batch * a["ff"] / rate, (batch * a["fb"] + a["pb"]) / bw)
    b = np.maximum(batch * a["bf"] / rate, (batch * a["bb"] + 2 * a["pb"]) / bw)
    out: F64 = f + b + machine.op_overhead_s * a["launch"]
    return out


def op_forward_times(graph: CostGraph, machine: MachineProfile, batch: int) -> F64:
    """The forward pass's part of `op_times` (its roofline and its own launches)."""
    a = _op_arrays(graph)
    rate = _op_rates(a, machine, batch)
    f = np.maximum(batch * a["ff"] / rate, (batch * a["fb"] + a["pb"]) / machine.mem_bw)
    out: F64 = f + machine.op_overhead_s * a["flaunch"]
    return out


def matmul_rates(machine: MachineProfile, flops_per_call: F64) -> F64:
    """The FLOP rate of matmul-class ops of `flops_per_call` each (forward + backward) on
    `machine`: the rates of the calibration products it carries ("matmul", and
    `SMALL_MATMUL` / `TINY_MATMUL` where measured) interpolated linearly in the log of the
    FLOPs per call between the products' sizes (`MATMUL_SHAPES`), held at the nearest one
    beyond them; one rate alone prices every product. Linear, not geometric: the rate rises
    steeply with size and then levels off (on an Intel Xeon 37, 68, 109, 129, 138 and 161
    GFLOP/s at 1.6, 4.7, 19, 101, 302 and 10 872 MFLOP per call), so between two products it
    is above their geometric mean."""
    anchors = [(math.log(matmul_flops_per_call(shape)), machine.flops[name])
               for name, shape in MATMUL_SHAPES.items() if name in machine.flops]
    if len(anchors) < 2:
        return np.full(flops_per_call.shape, machine.rate("matmul"))
    anchors.sort()
    xs = np.array([x for x, _ in anchors])
    ys = np.array([y for _, y in anchors])
    out: F64 = np.interp(np.log(np.maximum(flops_per_call, 1.0)), xs, ys)
    return out


def _op_rates(a: dict[str, Any], machine: MachineProfile, batch: int) -> F64:
    """Each op's FLOP rate on `machine` for micro-batches of `batch` samples: its class's,
    matmul-class ops by their size (`matmul_rates`)."""
    rate: F64 = np.array([machine.rate(c) for c in a["classes"]])[a["cls"].astype(np.int64)]
    mm = a["cls"] == a["classes"].index("matmul")
    if mm.any():
        rate[mm] = matmul_rates(machine, batch * (a["ff"][mm] + a["bf"][mm]))
    return rate


_ARRAYS_CACHE: dict[int, tuple[CostGraph, dict[str, Any]]] = {}


def _op_arrays(graph: CostGraph) -> dict[str, Any]:
    """Column arrays of a graph's op costs (cached per graph object: graphs are immutable)."""
    hit = _ARRAYS_CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1]
    classes = sorted({o.op_class for o in graph.ops} | set(OP_CLASSES))
    ci = {c: i for i, c in enumerate(classes)}
    ops = graph.ops
    arr: dict[str, Any] = {
        "classes": classes,
        "cls": np.array([ci[o.op_class] for o in ops], dtype=np.float64),
        "ff": np.array([o.fwd_flops for o in ops], dtype=np.float64),
        "bf": np.array([o.bwd_flops for o in ops], dtype=np.float64),
        "fb": np.array([o.fwd_bytes for o in ops], dtype=np.float64),
        "bb": np.array([o.bwd_bytes for o in ops], dtype=np.float64),
        "pb": np.array([o.param_bytes for o in ops], dtype=np.float64),
        "launch": np.array([o.fwd_launches + o.bwd_launches for o in ops], dtype=np.float64),
        "flaunch": np.array([o.fwd_launches for o in ops], dtype=np.float64),
    }
    if len(_ARRAYS_CACHE) > 64:
        _ARRAYS_CACHE.clear()
    _ARRAYS_CACHE[id(graph)] = (graph, arr)
    return arr


INT8_BLOCK_ELEMENTS = 256
"""Elements per float32 scale of an int8 edge (`protocol.tensors.DEFAULT_BLOCK_SIZE`)."""
INT8_SCALE_BYTES = 4


def int8_wire_bytes(numel: float) -> float:
    """Bytes of `numel` elements int8 block-quantized: one byte each plus a float32 scale per
    block of `INT8_BLOCK_ELEMENTS` (the last block may be partial): (1 + 4/256) / 4 = 0.2539
    of the fp32 bytes."""
    return numel + INT8_SCALE_BYTES * math.ceil(numel / INT8_BLOCK_ELEMENTS)


def encoded_wire_bytes(numel: float, encoding: EdgeEncoding, itemsize: float = 4.0,
                       last_dim: float = 0.0) -> float:
    """Bytes of `numel` elements of `itemsize` bytes under `encoding`: as they are ("raw"),
    2 each (bf16), int8 (`int8_wire_bytes`), or half a byte each plus a float32 scale per
    block of `INT8_BLOCK_ELEMENTS` (int4), or for "lowrank" over a last axis of `last_dim`
    features (m = numel / last_dim rows, rank r = `lowrank_rank`): P, m x r bfloat16, and Q,
    last_dim x r float32 (the forward; `lowrank_backward_bytes` for the backward); never more
    than raw (a tensor without a last axis to factor travels raw)."""
    raw = numel * itemsize
    if encoding == "lowrank":
        if last_dim < 2:
            return raw
        r = lowrank_rank(int(last_dim))
        return min(raw, numel / last_dim * r * 2.0 + last_dim * r * 4.0)
    if encoding == "bf16":
        q = 2.0 * numel
    elif encoding == "int8":
        q = int8_wire_bytes(numel)
    elif encoding == "int4":
        q = math.ceil(numel / 2) + INT8_SCALE_BYTES * math.ceil(numel / INT8_BLOCK_ELEMENTS)
    else:
        q = raw
    return min(raw, q)


def dense_wire_bytes(t: TensorEdge, batch: int) -> tuple[float, float]:
    """(forward, backward) bytes of tensor `t` sent uncompressed (its own dtype)."""
    dense_f = batch * t.nbytes
    return dense_f, dense_f if t.grad else 0.0


def wire_bytes(t: TensorEdge, batch: int, density: float, settings: JobSettings,
               encoding: EdgeEncoding | None = None) -> tuple[float, float]:
    """(forward, backward) bytes on the wire for tensor `t` at `density` (1.0 = dense); with
    an `encoding` (default: `settings.edge_encoding`) other than "raw" a compressible tensor
    not in `exact_edges` travels so encoded both ways (never also top-k)."""
    dense_f, dense_b = dense_wire_bytes(t, batch)
    enc = settings.edge_encoding if encoding is None else encoding
    if enc != "raw" and t.compressible and t.name not in settings.exact_edges:
        n = batch * t.numel
        q = encoded_wire_bytes(n, enc, dense_f / n if n else 4.0, t.last_dim)
        if enc == "lowrank" and q < dense_f:  # back: G Q, m x r bfloat16 (the sender has Q)
            return q, (n / t.last_dim * lowrank_rank(int(t.last_dim)) * 2.0 if t.grad else 0.0)
        return q, q if t.grad else 0.0
    if density >= 1.0 or not t.compressible:
        return dense_f, dense_b
    n = batch * t.numel
    kept = n * density
    f = min(dense_f, kept * settings.topk_value_bytes + topk_index_bytes(n, density))
    b = min(dense_b, kept * settings.topk_value_bytes) if t.grad else 0.0
    return f, b


def topk_index_bytes(numel: float, density: float) -> float:
    """Bytes of a top-k forward's kept positions, as `protocol.tensors` sends them: varint
    gaps (one byte while the mean gap 1/density is under 64, two under 8192, else three) or
    a bitmap of numel/8 bytes, whichever is smaller. Measured within 3 % on GPT-2
    activations at densities 0.1-0.5 (bench/compress.py; the old flat 1.5 bytes per kept
    element counted 55 % too many at 0.5)."""
    gap = 1.0 / max(density, 1e-12)
    per_kept = 1.0 if gap <= 64 else 2.0 if gap <= 8192 else 3.0
    return min(numel * density * per_kept, math.ceil(numel / 8))
