"""The planner's own cost model: op costs, the cost graph, machines, the cluster, job settings.

Everything here is plain data and pure arithmetic (no I/O, no torch), so OP-Fence and AdaTopK
can be simulated and tested on synthetic graphs. `fusiond.plan.estimator` builds a `CostGraph`
from the captured IR; `fusiond.profile.calibrate` measures a `MachineProfile`.

Units: FLOPs, bytes, seconds, bytes per second. Per-sample quantities scale linearly with the
micro-batch size (a sample is one row of the batch dimension, e.g. one sequence).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fusiond.errors import LocalError

F64 = npt.NDArray[np.float64]

#: Op classes a machine is calibrated for. An op's class picks the FLOP rate it runs at.
OP_CLASSES: tuple[str, ...] = ("matmul", "conv", "other")


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


@dataclass(frozen=True, eq=False)
class CostGraph:
    """Ops in a topological order plus the tensors between them. Validated on construction."""

    ops: tuple[OpCost, ...]
    tensors: tuple[TensorEdge, ...]
    name: str = "graph"
    #: parameter name -> bytes (for de-duplicating tied weights); optional
    param_sizes: Mapping[str, float] = field(default_factory=dict)

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

    def runs(self, op: str) -> bool:
        """Whether this machine runs the op `op` (an unnamed op runs everywhere)."""
        return self.ops is None or not op or op in self.ops

    def __post_init__(self) -> None:
        if not self.flops or any(v <= 0 or not math.isfinite(v) for v in self.flops.values()):
            raise PlanError(f"machine {self.id!r}: flops must be positive and finite")
        if self.mem_bw <= 0 or self.op_overhead_s < 0 or self.memory_bytes <= 0:
            raise PlanError(f"machine {self.id!r}: mem_bw/memory must be > 0, overhead >= 0")
        for name in ("wire_s_per_byte", "msg_s", "wake_s"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise PlanError(f"machine {self.id!r}: {name} must be >= 0 and finite")

    def rate(self, op_class: str) -> float:
        r = self.flops.get(op_class)
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
        } | ({} if self.ops is None else {"ops": sorted(self.ops)})

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
                ops=None if d.get("ops") is None else frozenset(str(x) for x in d["ops"]),
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
        wake_s=m.wake_s, ops=m.ops)


def slower_of(a: MachineProfile, b: MachineProfile) -> MachineProfile:
    """`a` with every rate no faster than `b`'s and the dispatch cost no cheaper (id, memory
    and kind of `a`)."""
    flops = {k: min(v, b.rate(k)) for k, v in a.flops.items()}
    return MachineProfile(id=a.id, flops=flops, mem_bw=min(a.mem_bw, b.mem_bw),
                          op_overhead_s=max(a.op_overhead_s, b.op_overhead_s),
                          memory_bytes=a.memory_bytes, kind=a.kind,
                          wire_s_per_byte=max(a.wire_s_per_byte, b.wire_s_per_byte),
                          msg_s=max(a.msg_s, b.msg_s), ops=a.ops)


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


@dataclass(frozen=True)
class JobSettings:
    """What the planner needs to know about the job.

    `schedule`: "1f1b" keeps min(M, S - s) micro-batches of activations in flight on stage s;
    "gpipe" keeps all M. `optimizer_passes`: bytes touched per parameter byte by one optimizer
    step (Adam: read p, g, m, v and write p, m, v = 7). `memory_fraction`: the share of a
    machine's memory the job may use (the rest is runtime, allocator slack, buffers).
    `topk_*_bytes`: wire bytes per kept element (forward: fp16 value + delta-coded index; the
    backward only sends values, the sender knows the indices). `int8_edges`: every compressible
    cut tensor travels int8 block-quantized both ways (`int8_wire_bytes`), never top-k
    (AdaTopK does not apply).
    """

    micro_batch_size: int = 1
    num_micro_batches: int = 8
    schedule: Literal["1f1b", "gpipe"] = "1f1b"
    density_floor: float = 0.05
    exact_edges: frozenset[str] = field(default_factory=frozenset)
    optimizer_passes: float = 7.0
    memory_fraction: float = 0.9
    topk_fwd_bytes: float = 3.5
    topk_bwd_bytes: float = 2.0
    int8_edges: bool = False
    grad_density_floor: float = 1.0
    """The least share of a replicated stage's gradient bytes its reduction may send
    (low-rank, PowerSGD-style, with error feedback: rank r of an m x n gradient sends
    r (m + n) / (m n) of it); 1.0: gradients are reduced dense. The planner sends as much as
    the reduction can hide behind the drain, down to this floor."""
    recompute: bool = False
    """A stage whose kept activations would not fit its machine may recompute them instead
    (activation checkpointing of the whole stage, `fusiond.train.stage.StageConfig`): it
    keeps only its inputs per micro-batch in flight and one micro-batch's activations, and
    pays one more forward per micro-batch. The evaluator chooses it per stage, only where the
    plain stage does not fit."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.num_micro_batches < 1:
            raise PlanError("micro_batch_size and num_micro_batches must be >= 1")
        if not 0 < self.density_floor <= 1:
            raise PlanError(f"density_floor must be in (0, 1], got {self.density_floor}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise PlanError(f"schedule must be '1f1b' or 'gpipe', got {self.schedule!r}")
        if not 0 < self.memory_fraction <= 1:
            raise PlanError("memory_fraction must be in (0, 1]")
        if not 0 < self.grad_density_floor <= 1:
            raise PlanError(f"grad_density_floor must be in (0, 1], got "
                            f"{self.grad_density_floor}")


def op_times(graph: CostGraph, machine: MachineProfile, batch: int) -> F64:
    """Forward+backward seconds of each op for one micro-batch of `batch` samples on `machine`.

    Roofline per pass: max(FLOPs / class rate, bytes / memory bandwidth), plus the dispatch
    overhead per launch. Parameters are read once per pass (and the gradient written once in
    backward) whatever the batch.
    """
    a = _op_arrays(graph)
    rate = np.array([machine.rate(c) for c in a["classes"]])[a["cls"].astype(np.int64)]
    bw = machine.mem_bw
    f = np.maximum(batch * a["ff"] / rate, (batch * a["fb"] + a["pb"]) / bw)
    b = np.maximum(batch * a["bf"] / rate, (batch * a["bb"] + 2 * a["pb"]) / bw)
    out: F64 = f + b + machine.op_overhead_s * a["launch"]
    return out


def op_forward_times(graph: CostGraph, machine: MachineProfile, batch: int) -> F64:
    """The forward pass's part of `op_times` (its roofline and its own launches)."""
    a = _op_arrays(graph)
    rate = np.array([machine.rate(c) for c in a["classes"]])[a["cls"].astype(np.int64)]
    f = np.maximum(batch * a["ff"] / rate, (batch * a["fb"] + a["pb"]) / machine.mem_bw)
    out: F64 = f + machine.op_overhead_s * a["flaunch"]
    return out


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


def dense_wire_bytes(t: TensorEdge, batch: int) -> tuple[float, float]:
    """(forward, backward) bytes of tensor `t` sent uncompressed (its own dtype)."""
    dense_f = batch * t.nbytes
    return dense_f, dense_f if t.grad else 0.0


def wire_bytes(t: TensorEdge, batch: int, density: float, settings: JobSettings) -> tuple[
    float, float
]:
    """(forward, backward) bytes on the wire for tensor `t` at `density` (1.0 = dense); with
    `settings.int8_edges` a compressible tensor not in `exact_edges` is int8 both ways (the
    planner gives such a tensor no density: AdaTopK does not apply to int8 edges)."""
    dense_f, dense_b = dense_wire_bytes(t, batch)
    if settings.int8_edges and t.compressible and t.name not in settings.exact_edges:
        q = int8_wire_bytes(batch * t.numel)
        return q, q if t.grad else 0.0
    if density >= 1.0 or not t.compressible:
        return dense_f, dense_b
    kept = batch * t.numel * density
    f = min(dense_f, kept * settings.topk_fwd_bytes)
    b = min(dense_b, kept * settings.topk_bwd_bytes) if t.grad else 0.0
    return f, b
