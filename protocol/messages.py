"""Messages: one frozen dataclass per kind, msgpack-encoded in the frame's message header.

Every message class has a fixed `TYPE_ID` (the frame's type field) and a `lane` (CONTROL or
BULK). Every message whose payload or header can be large is BULK (Assign, Forward, Backward,
ProbeData, JobResult, StageCheckpoint, JobSubmit, JobUpdate, JobOutput, JobsAnswer); the rest
are CONTROL,
and a CONTROL frame is at most `Limits.max_control_frame_bytes` (`encode_message` refuses a
larger one), so heartbeats and votes never wait behind a partition's weights. Its fields are
validated from their annotations (protocol/_schema.py): unknown fields are ignored, missing or
mistyped fields raise RemoteProtocolError naming the message and the field path. A tensor or
other bulk data never goes into msgpack: it travels in the frame payload (`msg.payload`).

Adding a message: append a frozen dataclass subclass of `Message` at the end of this file (or in
another module imported before use) with a new, never reused `TYPE_ID`; give new fields of
existing messages a default so older peers' messages still decode. docs/protocol.md lists them.

Correlation: a message that expects a reply carries `request_id` (a u64 the requester picks,
unique among its outstanding requests to that peer); the reply (Vote, LeaderAck, Ack, Ready,
Error, Pong, JoinResponse) echoes it. 0 means "no reply expected" where a field is optional.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from protocol import PROTOCOL_VERSION
from protocol._schema import WIRE, Struct, packb, unpackb
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.frames import FIXED_HEADER_SIZE, Buffer, Frame, encode_frame
from protocol.limits import DEFAULT_LIMITS, Limits

_EMPTY: Final = memoryview(b"")


class Lane(enum.Enum):
    """Which queue a message travels on: CONTROL frames never wait behind BULK frames."""

    CONTROL = "control"
    BULK = "bulk"


_REGISTRY: dict[int, type[Message]] = {}


@dataclass(frozen=True)
class Message(Struct):
    """Base of all messages. Subclasses set `TYPE_ID` (u16, unique) and maybe `lane`.

    `payload` is the frame payload (a memoryview; empty for most messages); it is not part of
    the msgpack header and not compared by `==`.
    """

    TYPE_ID: ClassVar[int] = -1
    lane: ClassVar[Lane] = Lane.CONTROL
    payload: memoryview = field(
        default=_EMPTY, kw_only=True, compare=False, repr=False, metadata={WIRE: False}
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        type_id = cls.__dict__.get("TYPE_ID")
        if type_id is None:
            return  # an abstract intermediate class
        if not isinstance(type_id, int) or not 0 < type_id < 1 << 16:
            raise TypeError(f"{cls.__name__}.TYPE_ID must be an int in 1..65535")
        old = _REGISTRY.get(type_id)
        if old is not None and old.__qualname__ != cls.__qualname__:
            raise TypeError(f"type id {type_id} of {cls.__name__} is taken by {old.__name__}")
        _REGISTRY[type_id] = cls


MESSAGE_TYPES: Mapping[int, type[Message]] = _REGISTRY
"""Type id -> message class, for every registered message (read-only use)."""


def message_class(type_id: int) -> type[Message]:
    """The class for a frame's type id; RemoteProtocolError if unknown."""
    cls = _REGISTRY.get(type_id)
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {type_id}")
    return cls


def encode_header(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The msgpack message header of `msg`; LocalProtocolError naming a bad field."""
    if type(msg).__dict__.get("TYPE_ID") is None:
        raise LocalProtocolError(f"{type(msg).__name__} has no TYPE_ID of its own")
    header = packb(msg.to_wire(limits))
    if len(header) > limits.max_header_bytes:
        raise LocalProtocolError(
            f"{type(msg).__name__} header is {len(header)} bytes, "
            f"limit is {limits.max_header_bytes}"
        )
    return header


def wire_bytes(value: Struct, limits: Limits = DEFAULT_LIMITS) -> int:
    """Bytes of `value`'s msgpack encoding: what it adds to a message header (to size a
    message before building it)."""
    return len(packb(value.to_wire(limits)))


def encode_message(
    msg: Message,
    payload: Sequence[Buffer] = (),
    *,
    version: int = PROTOCOL_VERSION,
    payload_check: bool = True,
    limits: Limits = DEFAULT_LIMITS,
) -> list[bytes | memoryview]:
    """One frame carrying `msg`, as a gather list for `writelines` (payload not copied).

    The payload is `payload` if given, else `msg.payload`. `payload_check=False` skips the
    payload checksum (only on links that already guarantee integrity, such as TLS).
    """
    if not payload and msg.payload.nbytes:
        payload = (msg.payload,)
    header = encode_header(msg, limits)
    if msg.lane is Lane.CONTROL:
        size = FIXED_HEADER_SIZE + len(header) + sum(memoryview(p).nbytes for p in payload)
        if size > limits.max_control_frame_bytes:
            raise LocalProtocolError(
                f"{type(msg).__name__} is a CONTROL message of {size} bytes, above the control "
                f"lane's bound of {limits.max_control_frame_bytes}: large data must travel in a "
                "BULK message"
            )
    return encode_frame(
        msg.TYPE_ID,
        header,
        payload,
        version=version,
        payload_check=payload_check,
        limits=limits,
    )


def decode_message(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The message in `frame`, validated; `msg.payload` is the frame's payload (no copy).

    Raises RemoteProtocolError (unknown type, malformed msgpack, missing or mistyped field).
    """
    cls = message_class(frame.msg_type)
    value = unpackb(frame.header, f"{cls.__name__} header", limits)
    msg = cls.from_wire(value, payload=frame.payload)
    assert isinstance(msg, cls)
    return msg


# --- nested records ------------------------------------------------------------------------

Address = tuple[str, int]
"""(host, port): a msgpack array [str, int]."""


class MemberState(enum.StrEnum):
    """A member's state in the membership table (SWIM-style)."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


@dataclass(frozen=True)
class LinkMeasurement(Struct):
    """One measured link from the reporting node to `peer`."""

    peer: str
    bandwidth_bits_per_s: float
    """Measured goodput in bits per second (0 if unknown)."""
    rtt_s: float
    """Round-trip time in seconds."""
    measured_at: float = 0.0
    """Unix time (the measurer's clock) of the probe round that set the figure (0: unknown)."""
    bandwidth_spread_ratio: float = 0.0
    """Accuracy of that round: the relative half-range of its bandwidth samples
    ((max - min) / 2 / median; 0.05 = +-5 %; 0: unknown or a single sample)."""


MAX_PROFILE_TEXT_BYTES: Final = 256
"""Bound on each text field of a NodeProfile (a version, a device name, a cgroup path)."""
MAX_PROFILE_LABELS: Final = 64
"""Bound on the entries of `NodeProfile.labels`."""
MAX_PROFILE_DISABLED_OPS: Final = 4096
"""Bound on `NodeProfile.ops_disabled` (an op registry has about 2000 ops)."""
MAX_PROFILE_DEVICES: Final = 16
"""Bound on `NodeProfile.devices` (the accelerators a machine offers)."""
MAX_DEVICE_RATES: Final = 16
"""Bound on `DeviceProfile.flop_per_s` (one rate per op class)."""


@dataclass(frozen=True)
class DeviceProfile(Struct):
    """One accelerator a machine offers (`NodeProfile.devices`): what it is and how fast,
    measured on it by the daemon that owns it (`fusiond.profile.devices`)."""

    kind: str
    """"cuda"."""
    index: int
    """Its index on the machine: stages placed on it run on f"{kind}:{index}"."""
    name: str = ""
    memory_bytes: int = 0
    """Total memory of the device."""
    free_bytes: int = 0
    """Free memory of the device when the profile was computed."""
    flop_per_s: dict[str, float] = field(default_factory=dict)
    """The planner's float32 rate per op class on the device (the keys of
    `fusiond.plan.model.MachineProfile.flops`: "matmul", "matmul_small", "other", ...), FLOP
    per second."""
    matmul_bf16_flop_per_s: float = 0.0
    """Its bfloat16 rate on the calibration's largest product, FLOP per second (0: not
    measured; a bf16 job is then priced at the float32 rates)."""
    matmul_fp16_flop_per_s: float = 0.0
    """Its float16 rate on the same product (0: not measured)."""
    mem_bw_bytes_per_s: float = 0.0
    """Its calibrated memory bandwidth."""
    op_overhead_s: float = 0.0
    """Fixed cost of launching one op on it, seconds."""
    h2d_bytes_per_s: float = 0.0
    """Host-to-device copy rate from pinned memory (0: not measured)."""
    d2h_bytes_per_s: float = 0.0
    """Device-to-host copy rate into pinned memory (0: not measured)."""
    error: str = ""
    """Why the device cannot be used ("": it can): a driver that fails, a calibration that
    raised. A job that allows it runs on the machine's CPU instead (`job.device`)."""

    def __post_init__(self) -> None:
        for f in ("kind", "name", "error"):
            _bounded_text(f, getattr(self, f))
        if len(self.flop_per_s) > MAX_DEVICE_RATES:
            raise ValueError(f"flop_per_s has {len(self.flop_per_s)} entries, limit is "
                             f"{MAX_DEVICE_RATES}")
        for k in self.flop_per_s:
            _bounded_text(f"flop_per_s key {k[:32]!r}", k)

    @property
    def device(self) -> str:
        """The torch device string a stage placed on it runs on, e.g. "cuda:1"."""
        return f"{self.kind}:{self.index}"

    @property
    def usable(self) -> bool:
        """A CUDA device by a plausible index, measured, without an error (a peer's profile
        that says otherwise is not planned on)."""
        rates = [*self.flop_per_s.values(), self.mem_bw_bytes_per_s]
        return (self.kind == "cuda" and 0 <= self.index < 100 and not self.error
                and self.flop_per_s.get("other", 0.0) > 0 and self.mem_bw_bytes_per_s > 0
                and all(math.isfinite(r) and r >= 0 for r in rates)
                and math.isfinite(self.op_overhead_s) and self.op_overhead_s >= 0)


@dataclass(frozen=True)
class NodeProfile(Struct):
    """What a node can do, as it gossips it (built by fusiond.profile, signed as part of the
    member's body by fusiond.cluster.trust): the one schema of the profile.

    The field names are the keys users see in `fusionctl status --json` and `/v1/status`
    (`node.profile`, `cluster.members[].profile`); 0 / "" / () mean "not measured" or "not
    known" (a daemon without benchmark, an older daemon). Every text field is at most
    MAX_PROFILE_TEXT_BYTES; a profile that breaks a bound does not decode (RemoteProtocolError
    naming the field).
    """

    device_kind: str = "cpu"
    """The device training uses: "cpu" or "cuda"."""
    device_name: str = ""
    device_memory_bytes: int = 0
    """Total memory of that device (the host's memory on a CPU node)."""
    device_free_bytes: int = 0
    """Free memory of that device when the profile was computed."""
    device_count: int = 0
    """GPUs on a CUDA node; CPUs on a CPU node."""
    memory_bytes: int = 0
    """Total memory of the host, or the daemon's cgroup memory limit where that is less."""
    free_memory_bytes: int = 0
    """Available memory (MemAvailable, or what is left under the daemon's cgroup memory limit
    where that is less), re-read on every profile."""
    job_memory_bytes: int = 0
    """Memory the operator offers to jobs (config `job_memory_gib`); 0: its free memory."""
    cpu_count: int = 0
    """CPUs of the host (os.cpu_count)."""
    cpu_cores: float = 0.0
    """Cores this process may keep busy (min of the cgroup quota and the affinity mask)."""
    cpu_quota_cores: float = 0.0
    """The tightest cgroup CPU quota in cores (0: none seen)."""
    cpu_quota_period_s: float = 0.0
    """The CFS period of that quota (0: none)."""
    cpu_limit: str = ""
    """Where the binding CPU limit comes from ("affinity", "cgroup2:/path", ...)."""
    threads: int = 0
    """torch's thread count (0: not benchmarked)."""
    gflops: float = 0.0
    """Sustained float32 matmul speed, in GFLOP per second (0: not measured)."""
    gflops_per_cpu_s: float = 0.0
    """The same per CPU second of one thread (CPU nodes)."""
    plan_flops_matmul: float = 0.0
    """The planner's calibrated rate of matmul-class ops, FLOP per second (0: none)."""
    plan_flops_matmul_small: float = 0.0
    """Of matmul-class ops at a small product (`fusiond.plan.model.MATMUL_SHAPES`), FLOP per
    second (0: not measured; the planner then prices every product at `plan_flops_matmul`)."""
    plan_flops_matmul_tiny: float = 0.0
    """Of matmul-class ops at a tiny product (`fusiond.plan.model.MATMUL_SHAPES`), FLOP per
    second (0: not measured)."""
    plan_flops_conv: float = 0.0
    """Of conv-class ops, FLOP per second."""
    plan_flops_other: float = 0.0
    """Of the other ops, FLOP per second (0: the node is not calibrated)."""
    plan_flops_attention: float = 0.0
    """Of scaled dot-product attention, FLOP per second (0: not measured; the planner then
    uses the matmul rate)."""
    plan_matmul_bf16_flop_per_s: float = 0.0
    """Of a bfloat16 matmul at the calibration's largest product on the CPU, FLOP per second
    (0: not measured; a bf16 job is then priced at the float32 rates)."""
    plan_matmul_fp16_flop_per_s: float = 0.0
    """The same in float16 (0: not measured)."""
    plan_mem_bw: float = 0.0
    """Calibrated memory bandwidth, bytes per second."""
    plan_op_overhead_s: float = 0.0
    """Fixed cost of dispatching one op, seconds."""
    plan_wire_s_per_byte: float = 0.0
    """CPU seconds the transport spends per byte sent."""
    plan_msg_s: float = 0.0
    """CPU seconds the transport spends per message."""
    plan_wake_s: float = 0.0
    """Average wake-up latency a CPU quota adds to a hand-off, seconds."""
    plan_disk_bytes_per_s: float = 0.0
    """The local disk's rate for state a stage keeps there (written, synced, read back), bytes
    per second (0: not measured)."""
    disk_free_bytes: int = 0
    """Free bytes of the filesystem holding the daemon's state directory, where a stage keeps
    what the planner puts on disk (optimizer state, weights); re-read on every profile (0: not
    known)."""
    torch_version: str = ""
    python_version: str = ""
    fusiond_version: str = ""
    protocol_version: int = 0
    ops_digest: str = ""
    """sha256 hex of the sorted op names this node runs ("": none gossiped)."""
    ops_count: int = 0
    """How many ops that set holds."""
    ops_disabled: tuple[str, ...] = ()
    """Ops the operator disabled (config `jobs.disabled_ops`)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Free-form operator labels (at most MAX_PROFILE_LABELS)."""
    devices: tuple[DeviceProfile, ...] = ()
    """The accelerators this machine offers, each measured on itself (at most
    MAX_PROFILE_DEVICES). The `plan_*` rates above are the machine's CPU's; the planner prices
    a stage on a device by that device's own rates."""
    device_error: str = ""
    """Why this machine's accelerators cannot be used ("": none fails), e.g. a GPU whose
    driver does not load; `fusionctl status` shows it."""

    def __post_init__(self) -> None:
        for f in _PROFILE_TEXT_FIELDS:
            _bounded_text(f, getattr(self, f))
        if len(self.devices) > MAX_PROFILE_DEVICES:
            raise ValueError(f"devices has {len(self.devices)} items, limit is "
                             f"{MAX_PROFILE_DEVICES}")
        if len(self.ops_disabled) > MAX_PROFILE_DISABLED_OPS:
            raise ValueError(f"ops_disabled has {len(self.ops_disabled)} items, limit is "
                             f"{MAX_PROFILE_DISABLED_OPS}")
        for i, op in enumerate(self.ops_disabled):
            _bounded_text(f"ops_disabled[{i}]", op)
        if len(self.labels) > MAX_PROFILE_LABELS:
            raise ValueError(f"labels has {len(self.labels)} entries, limit is "
                             f"{MAX_PROFILE_LABELS}")
        for k, v in self.labels.items():
            _bounded_text(f"labels key {k[:32]!r}", k)
            _bounded_text(f"labels[{k[:32]!r}]", v)

    @property
    def software(self) -> dict[str, str]:
        """The software versions it gossips, e.g. {"torch": "2.13.0", "python": "3.11.7"}."""
        out = {"torch": self.torch_version, "python": self.python_version,
               "fusiond": self.fusiond_version,
               "protocol": str(self.protocol_version) if self.protocol_version else ""}
        return {k: v for k, v in out.items() if v}


_PROFILE_TEXT_FIELDS: Final = ("device_kind", "device_name", "cpu_limit", "torch_version",
                               "python_version", "fusiond_version", "ops_digest",
                               "device_error")


def _bounded_text(name: str, value: object) -> None:
    if isinstance(value, str) and len(value.encode("utf-8", "replace")) > MAX_PROFILE_TEXT_BYTES:
        raise ValueError(f"{name} is {len(value.encode('utf-8', 'replace'))} bytes, limit is "
                         f"{MAX_PROFILE_TEXT_BYTES}")


@dataclass(frozen=True)
class MemberEntry(Struct):
    """One member as gossiped: newer (incarnation, heartbeat) wins.

    Authored and signed by the member itself (fusiond.cluster.trust): the *header* (address,
    incarnation, heartbeat, left or not, `term`) by `signature`, the *body* (profile and
    links, as of the member's heartbeat `body_version`) by `body_signature`, so a relay can
    forward either verbatim but alter neither. `state` SUSPECT/DEAD is the relaying node's own
    judgement (hearsay, unsigned); LEFT is the member's signed claim. The signature fields are
    empty in plaintext dev mode.
    """

    node_id: str
    address: Address
    incarnation: int
    heartbeat: int
    state: MemberState
    profile: NodeProfile | None = None
    links: tuple[LinkMeasurement, ...] = ()
    term: int = 0
    """The highest election term this member has seen (part of its signed header)."""
    signature: bytes = b""
    """The member's ECDSA P-256 signature over its header."""
    body_version: int = 0
    """The member's heartbeat when it signed `profile` and `links` (with a profile only)."""
    body_signature: bytes = b""
    """The member's signature over its body (with a profile only)."""
    credential: bytes = b""
    """The member's node certificate (DER), so a receiver can check the signatures: in the
    sender's own entry always, in other entries with a profile."""


@dataclass(frozen=True)
class Removal(Struct):
    """An operator removed `node_id` from the cluster for good, signed with the cluster CA key
    (only a member holding ca.key can issue one; fusiond.cluster.trust)."""

    node_id: str
    signature: bytes = b""


@dataclass(frozen=True)
class Endorsement(Struct):
    """`voter` supports the sender as leader of a term: its signature over that statement, from
    its Vote (granted) or LeaderAck (accepted). A majority of them proves a leadership claim."""

    voter: str
    signature: bytes


@dataclass(frozen=True)
class EdgeRoute(Struct):
    """Where a cut edge of a job's graph goes, and how it is compressed."""

    edge: str
    src_partition: int
    dst_partition: int
    src_node: str
    dst_node: str
    density: float = 1.0
    """Top-k density of the forward tensor; 1.0 = dense (no top-k)."""
    encoding: str = "raw"
    """How the edge travels when not top-k: "raw" (exact), "bf16", "int8", "int4" (forward and
    backward so encoded) or "lowrank" (rank-r factors forward, the gradient on their basis
    back); never with density < 1."""


MAX_ASSIGN_STAGES: Final = 4096
"""Bound on `AssignConfig.stage_nodes` and `AssignConfig.shared` entries (stages of a job)."""

MAX_GRAD_BUCKETS: Final = 1024
"""Bound on one slot's `AssignConfig.grad_buckets`."""


@dataclass(frozen=True)
class OptimizerConfig(Struct):
    """A job's optimizer, as its Assign carries it (fusiond.train.spec.OptimizerSpec)."""

    kind: str
    """"adamw" or "sgd"."""
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    momentum: float
    schedule: str
    warmup_steps: int
    min_lr: float


@dataclass(frozen=True)
class DataConfig(Struct):
    """A job's data, as its Assign carries it (fusiond.train.spec.DataSpec)."""

    kind: str
    tokenizer: str
    seq_len: int
    image_size: int
    channels: int
    num_classes: int
    path: str | None = None
    """The corpus path on the submitting machine (None: no file)."""
    digest: str = ""
    """The submitter's corpus hash ("": unchecked)."""
    default_corpus: bool = False
    """The stages read the default corpus from their own standard library, not `path`."""
    objective: str = "causal_lm"
    """What the data path makes of the samples (the job's loss kind: causal_lm, masked_lm,
    seq2seq_lm, classification, regression)."""
    layout: str = "windows"
    """Text as one token stream cut into windows, or as rows (one example per record)."""
    heldout: float = 0.0
    """The fraction of the data never trained on (the held-out split)."""
    ignore_index: int = -100
    """The label of positions that count for nothing."""
    mask_probability: float = 0.15
    """Masked LM: the chance that a token is masked."""
    mask_token_id: int | None = None
    """Masked LM: the job's mask token (None: the shipped tokenizer's)."""
    decoder_start_token_id: int | None = None
    """Seq2seq: the decoder's first input (None: the padding id)."""
    augment: tuple[str, ...] = ()
    """Image transforms drawn per step (hflip, crop)."""
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    """Image normalisation per channel."""


@dataclass(frozen=True)
class AssignConfig(Struct):
    """A job's settings, the same in every stage's Assign (built by fusiond.jobs.assign, read
    by fusiond.train.remote.decode_assign). Validated on decode: a missing or mistyped field
    is a RemoteProtocolError naming its path (`Assign.config.optimizer.lr: expected float`);
    the checks across fields (batch_size / micro_batches, first_step < steps, the stages'
    nodes) are decode_assign's, naming the field too."""

    version: int
    """The layout of this record (fusiond.train.remote.CONFIG_VERSION)."""
    steps: int
    seed: int
    batch_size: int
    micro_batches: int
    pipeline: str
    optimizer: OptimizerConfig
    data: DataConfig
    input_name: str
    loss_name: str
    stage_nodes: dict[str, str]
    """Slot (decimal str) -> node id, for every slot: a slot is what a node runs and what
    its messages name as `partition`; without replicas slot = stage."""
    shared: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    """Slot (decimal str) -> {parameter -> the other slots holding it}: a tied parameter's
    other stages, and every parameter of a replicated stage with its other replicas; each
    holder sums every holder's gradient in slot order before its optimizer step."""
    first_step: int = 0
    """The step this attempt starts at (> 0 when it resumes)."""
    checkpoint_interval: int = 0
    """Steps between checkpoints (0: none)."""
    per_row: bool = True
    targets_name: str | None = None
    recv_timeout_s: float | None = None
    """The scheduler's bound on one wait for a task's inputs (None: the stage's own)."""
    slot_stages: dict[str, int] = field(default_factory=dict)
    """Slot (decimal str) -> the stage it runs, for every replica beyond a stage's first (a
    slot absent runs the stage numbered like it)."""
    routes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Stage (decimal str) -> the slot that runs each micro-batch of an iteration, for every
    replicated stage (one entry per micro-batch)."""
    grad_rank: int | None = None
    """The summed gradients (replicas, tied parameters) of matrices travel as rank-`grad_rank`
    factors with error feedback (PowerSGD, two rounds a step), the same on every stage;
    None: dense."""
    grad_warmup_steps: int = 0
    """With `grad_rank`: the job's first steps reduce dense (steps 0 .. this - 1)."""
    eval_interval: int = 0
    """Steps between the stages' states sent for a held-out evaluation (0: none beyond the
    checkpoints); sent as `StageCheckpoint`s."""
    precision: str = "fp32"
    """The stages' compute dtype: "fp32", "bf16" or "fp16" (autocast forward, float32
    weights; fp16 with a loss scale every slot agrees on each step)."""
    recompute_slots: tuple[int, ...] = ()
    """The slots that recompute their activations in the backward (activation checkpointing
    of the stage: the planner's choice where its activations would not fit)."""
    offload_slots: tuple[int, ...] = ()
    """The slots that keep their optimizer state on their machine's disk (the planner's
    choice where it would not fit in memory)."""
    checkpoint_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Slot (decimal str) -> the blocks of its partition (`protocol.ir.block_starts`, by
    index) it checkpoints: the per-block memory planner's choice."""
    offload_param_slots: tuple[int, ...] = ()
    """The slots that keep their weights and gradients on disk too (with `offload_slots`)."""
    slot_devices: dict[str, str] = field(default_factory=dict)
    """Slot (decimal str) -> the device it computes on ("cuda:0"); a slot absent computes on
    its machine's CPU."""
    grad_buckets: dict[str, int] = field(default_factory=dict)
    """Slot (decimal str) -> how many buckets its shared gradients are reduced in, one after
    another and during its last backward where it can (the plan's choice, the same on every
    replica of a stage; at most `MAX_GRAD_BUCKETS`); a slot absent splits them by size."""
    grad_groups: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Replicated stage (decimal str) -> its slots in bandwidth groups, where the plan reduces
    its gradients hierarchically (inside each group, then among the groups' first slots);
    a stage absent reduces by one ring."""
    grad_two_level: tuple[int, ...] = ()
    """The stages of `grad_groups` whose gradients the plan reduces two-level instead
    (shards summed inside each group by their owners, each shard across the groups by a ring
    of its owners, sent back inside)."""
    in_flight: dict[str, int] = field(default_factory=dict)
    """Stage (decimal str) -> the micro-batches 1F1B keeps in flight there (the plan's choice
    where a slow link's round trip would leave the stage waiting; at most `micro_batches`,
    never more than an earlier stage's); a stage absent keeps 1F1B's min(S - i, M)."""
    micro_batch_sizes: tuple[int, ...] = ()
    """The samples of each micro-batch of an iteration, where the plan gives a one-stage
    job's replicas micro-batches of their own sizes (one entry per micro-batch, adding up to
    `batch_size`; each micro-batch's loss counts by its size); empty: equal micro-batches."""

    def __post_init__(self) -> None:
        for name in ("stage_nodes", "shared", "slot_stages", "routes", "checkpoint_blocks",
                     "slot_devices", "grad_buckets", "in_flight", "grad_groups",
                     "grad_two_level"):
            n = len(getattr(self, name))
            if n > MAX_ASSIGN_STAGES:
                raise ValueError(f"{name} has {n} entries, limit is {MAX_ASSIGN_STAGES}")


# --- handshake (type ids 1..3; layout frozen for every protocol version) ---------------------


@dataclass(frozen=True)
class Hello(Message):
    """First message on a connection, from the connecting side: who I am, what I speak."""

    TYPE_ID: ClassVar[int] = 1
    node_id: str
    cluster_id: str
    min_version: int
    max_version: int
    capabilities: tuple[str, ...] = ()
    address: Address | None = None
    """The sender's listening address, so the acceptor can gossip and dial it back."""
    software: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HelloAck(Message):
    """The acceptor's answer to Hello: the agreed `version` (highest common)."""

    TYPE_ID: ClassVar[int] = 2
    node_id: str
    cluster_id: str
    version: int
    capabilities: tuple[str, ...] = ()
    address: Address | None = None


@dataclass(frozen=True)
class Refuse(Message):
    """Either side refuses the connection; it is closed after this frame.

    `code`: "version" (no common version), "cluster" (other cluster), "auth", "busy",
    "protocol" (bad handshake), "self" (the dialer is this very node). Carries the refuser's
    version range and the peer's as seen.
    """

    TYPE_ID: ClassVar[int] = 3
    code: str
    reason: str
    min_version: int
    max_version: int
    peer_min_version: int = 0
    peer_max_version: int = 0


# --- membership ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Heartbeat(Message):
    """Liveness, sent periodically to peers; also carries the sender's view of the leader."""

    TYPE_ID: ClassVar[int] = 4
    node_id: str
    incarnation: int
    heartbeat: int
    term: int = 0
    leader: str = ""


@dataclass(frozen=True)
class Profile(Message):
    """A node's own profile and link measurements (pushed on change and on request)."""

    TYPE_ID: ClassVar[int] = 5
    profile: NodeProfile
    links: tuple[LinkMeasurement, ...] = ()


@dataclass(frozen=True)
class Gossip(Message):
    """A batch of membership entries (the sender's view, or a digest of changes)."""

    TYPE_ID: ClassVar[int] = 6
    sender: str
    members: tuple[MemberEntry, ...]
    term: int = 0
    """The sender's term: hearsay, shown for debugging, never adopted by the receiver (each
    member's own term travels signed in its MemberEntry)."""
    leader: str = ""
    """Hearsay too: never followed."""
    removals: tuple[Removal, ...] = ()
    """Operator removals the sender knows (each verified by every receiver)."""


@dataclass(frozen=True)
class Leave(Message):
    """Graceful departure: the sender is leaving the cluster."""

    TYPE_ID: ClassVar[int] = 7
    node_id: str
    incarnation: int


# --- election (a stale `term` is refused everywhere) -----------------------------------------


@dataclass(frozen=True)
class VoteRequest(Message):
    """A candidate asks for votes for `term`. Reply: Vote."""

    TYPE_ID: ClassVar[int] = 8
    request_id: int
    term: int
    candidate: str
    priority: float = 0.0
    """Higher = better scheduler (e.g. more memory, better links); tie-break by node id."""


@dataclass(frozen=True)
class Vote(Message):
    """Reply to VoteRequest."""

    TYPE_ID: ClassVar[int] = 9
    request_id: int
    term: int
    voter: str
    granted: bool
    reason: str = ""
    signature: bytes = b""
    """A granted VoteRequest vote: the voter's signed support of the candidate for `term`
    (an Endorsement); empty for pre-votes, refusals and in plaintext dev mode."""


@dataclass(frozen=True)
class Leader(Message):
    """The elected leader (scheduler) announces itself for `term`. Reply: LeaderAck."""

    TYPE_ID: ClassVar[int] = 10
    request_id: int
    term: int
    leader: str
    address: Address | None = None
    proof: tuple[Endorsement, ...] = ()
    """Signed support from a majority of voters for `leader` in `term`: sent until the receiver
    has accepted this leader for this term; a follower follows no unproven leader."""


@dataclass(frozen=True)
class LeaderAck(Message):
    """Reply to Leader: accepted, or refused (stale term) with the reason."""

    TYPE_ID: ClassVar[int] = 11
    request_id: int
    term: int
    node_id: str
    accepted: bool
    reason: str = ""
    signature: bytes = b""
    """With `accepted`: the follower's signed support of the leader for `term` (the leader adds
    it to its proof, so members that join later can check the claim)."""


# --- jobs and training -----------------------------------------------------------------------


@dataclass(frozen=True)
class Assign(Message):
    """The scheduler assigns one partition of a job to the receiver. Reply: Ready or Error.

    `graph` is the partition's IR (protocol.ir bytes); initial weights, if sent, travel in the
    payload (safetensors bytes).
    """

    TYPE_ID: ClassVar[int] = 12
    lane: ClassVar[Lane] = Lane.BULK
    """BULK: the payload is a partition's weights and the header its IR (megabytes either), so
    on CONTROL it would hold back heartbeats and votes for as long as it takes to send. It may
    therefore arrive after a JobCancel sent later (the worker remembers cancelled versions)."""
    request_id: int
    term: int
    job_id: str
    plan_version: int
    partition: int
    graph: bytes
    edges: tuple[EdgeRoute, ...] = ()
    nodes: dict[str, Address] = field(default_factory=dict)
    """node id -> address of every node taking part in the job."""
    config: AssignConfig | None = None
    """The job's settings (the same in every stage's Assign); None only in a malformed one."""


@dataclass(frozen=True)
class Ready(Message):
    """Reply to Assign: the partition is built and waits for tensors."""

    TYPE_ID: ClassVar[int] = 13
    request_id: int
    job_id: str
    plan_version: int
    partition: int
    node_id: str


@dataclass(frozen=True)
class Forward(Message):
    """An activation crossing a cut edge; the tensor (protocol.tensors) is the payload."""

    TYPE_ID: ClassVar[int] = 14
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    plan_version: int
    iteration: int
    microbatch: int
    edge: str


@dataclass(frozen=True)
class Backward(Message):
    """The gradient of a cut edge's activation, sent back; the tensor is the payload."""

    TYPE_ID: ClassVar[int] = 15
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    plan_version: int
    iteration: int
    microbatch: int
    edge: str


@dataclass(frozen=True)
class Ack(Message):
    """Generic positive (or negative, ok=False) reply to a request."""

    TYPE_ID: ClassVar[int] = 16
    request_id: int
    ok: bool = True
    detail: str = ""


@dataclass(frozen=True)
class Error(Message):
    """Something the sender could not do; `request_id` names the request (0 = none).

    A refused Assign also names its job and plan version (`job_id`, `plan_version`), so the
    scheduler matches the refusal to the attempt that sent it and to no other."""

    TYPE_ID: ClassVar[int] = 17
    code: str
    message: str
    request_id: int = 0
    job_id: str = ""
    plan_version: int = 0


# --- link probes -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ping(Message):
    """RTT probe. Reply: Pong echoing `request_id` and `sent_at`."""

    TYPE_ID: ClassVar[int] = 18
    request_id: int
    sent_at: float
    """The sender's monotonic clock, echoed back so it needs no state per ping."""


@dataclass(frozen=True)
class Pong(Message):
    """Reply to Ping."""

    TYPE_ID: ClassVar[int] = 19
    request_id: int
    sent_at: float


@dataclass(frozen=True)
class ProbeData(Message):
    """One of `count` bulk frames of a bandwidth probe; the payload is filler bytes."""

    TYPE_ID: ClassVar[int] = 20
    lane: ClassVar[Lane] = Lane.BULK
    probe_id: int
    seq: int
    count: int


@dataclass(frozen=True)
class ProbeAck(Message):
    """Reply after the last ProbeData: what the receiver saw, timed on its clock."""

    TYPE_ID: ClassVar[int] = 21
    probe_id: int
    received: int
    """ProbeData frames received."""
    nbytes: int
    """Payload bytes received."""
    elapsed_s: float
    """From the first to the last ProbeData frame's arrival."""


# --- joining ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinRequest(Message):
    """A new node trades a join token for a node certificate. Reply: JoinResponse."""

    TYPE_ID: ClassVar[int] = 22
    request_id: int
    token: str
    node_id: str
    csr: bytes
    """PEM certificate signing request for the node's key."""
    hostname: str = ""


@dataclass(frozen=True)
class JoinResponse(Message):
    """Reply to JoinRequest: the signed certificate and the cluster's CA, or the reason."""

    TYPE_ID: ClassVar[int] = 23
    request_id: int
    ok: bool
    cluster_id: str = ""
    certificate: bytes = b""
    ca_certificate: bytes = b""
    bootstrap: tuple[Address, ...] = ()
    reason: str = ""


# --- election, continued (appended by the cluster service) -----------------------------------


@dataclass(frozen=True)
class PreVote(Message):
    """Would you vote for `candidate` in `term`? Changes no state on either side. Reply: Vote
    (granted = would grant). A candidate increments its term only after a majority would, so a
    node cut off in a minority never inflates terms and never disrupts a working leader."""

    TYPE_ID: ClassVar[int] = 24
    request_id: int
    term: int
    candidate: str


# --- training job control (appended by the training helper; ids 40.. keep clear of others) -----


@dataclass(frozen=True)
class JobStart(Message):
    """Scheduler -> every stage of a job, once all answered Assign with Ready: run from
    `first_step` to the job's last step."""

    TYPE_ID: ClassVar[int] = 40
    job_id: str
    plan_version: int
    first_step: int = 0


MAX_STEP_TASKS: Final = 4096
"""The most task timings one step report may carry."""
MAX_STEP_EDGES: Final = 4096
"""The most cut edges one step report may carry."""
MAX_STEP_BUCKETS: Final = 65536
"""The most gradient buckets one step report may count (all of a stage's sets of holders)."""
MAX_TASK_NAME_BYTES: Final = 64
"""The longest task name in a step report's timeline."""


@dataclass(frozen=True)
class EdgeFigures(Struct):
    """One cut edge's bytes in one step, as a stage sent them (fusiond.train.stage.EdgeStats)."""

    edge: str
    kind: str
    """"forward", "backward" or "param_grad" (fusiond.train.stage.PacketKind)."""
    peer: int
    """The other stage."""
    wire_bytes: int
    dense_bytes: int
    density: float | None = None
    """The top-k density it was sent at (None: exact or int8)."""


@dataclass(frozen=True)
class StepFigures(Struct):
    """What one stage did in one step (fusiond.train.stage.StepReport on the wire): seconds
    from the step's start in `timeline` rows (task, ready_s, start_s, end_s, wait_s)."""

    lr: float
    wall_s: float
    busy_s: float
    loss: float | None = None
    """The step's loss (the loss stage only)."""
    edges: tuple[EdgeFigures, ...] = ()
    timeline: tuple[tuple[str, float, float, float, float], ...] = ()
    start_mono: float | None = None
    """The step's start on the stage host's monotonic clock (lines up hosts of one machine)."""
    wait_s: float = 0.0
    """Seconds the stage sat waiting for its inputs over the step's tasks."""
    costs: tuple[tuple[float, float, float, float], ...] = ()
    """Per `timeline` row, where its time went: (cpu_s, kernel_s, codec_s, send_s) (empty from
    a stage that does not measure them)."""
    buckets_early: int = 0
    """Gradient buckets whose reduction began while the step's last backward still ran."""
    reduce_exposed_s: float = 0.0
    """Seconds the step spent reducing its replicas' gradients after its last task (what the
    backward did not hide)."""
    reduce_cpu_s: float = 0.0
    """CPU seconds the stage's reducer thread spent on the step's gradient reduction (during
    the last backward and after it)."""

    def __post_init__(self) -> None:
        if len(self.costs) > MAX_STEP_TASKS:
            raise ValueError(f"costs: {len(self.costs)} rows, more than {MAX_STEP_TASKS}")
        if len(self.timeline) > MAX_STEP_TASKS:
            raise ValueError(f"timeline: {len(self.timeline)} tasks, more than {MAX_STEP_TASKS}")
        if len(self.edges) > MAX_STEP_EDGES:
            raise ValueError(f"edges: {len(self.edges)}, more than {MAX_STEP_EDGES}")
        for row in self.timeline:
            if len(row[0].encode()) > MAX_TASK_NAME_BYTES:
                raise ValueError(f"timeline: task name of {len(row[0].encode())} bytes, more "
                                 f"than {MAX_TASK_NAME_BYTES}")
        # Ranges (times >= 0, densities in (0, 1]) are the reader's checks:
        # fusiond.train.stage.StepReport.from_figures.


@dataclass(frozen=True)
class StageStep(Message):
    """Stage -> scheduler after each step: its `figures` (loss on the loss stage only, lr,
    wall_s, busy_s, per-edge bytes, the task timeline)."""

    TYPE_ID: ClassVar[int] = 41
    job_id: str
    plan_version: int
    partition: int
    step: int
    figures: StepFigures


@dataclass(frozen=True)
class JobCancel(Message):
    """Scheduler -> stages: stop the job and free its memory (a failure elsewhere, or the user)."""

    TYPE_ID: ClassVar[int] = 42
    job_id: str
    reason: str = ""
    plan_version: int = 0
    """The attempt to stop (0: whichever runs): a stale cancel never stops a newer attempt.
    JobCancel is CONTROL and Assign BULK, so a cancel can overtake its Assign: a worker drops
    an Assign of a version it saw cancelled by the current scheduler."""


@dataclass(frozen=True)
class JobResult(Message):
    """Stage -> scheduler when its part of the job ends. ok: the payload is the partition's final
    state (safetensors bytes); not ok: `message` says what failed (stage, step, task, cause)."""

    TYPE_ID: ClassVar[int] = 43
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    plan_version: int
    partition: int
    ok: bool
    message: str = ""
    step: int = -1
    """The step the stage was in when it failed (-1: not applicable)."""
    fault: str = ""
    """Who is at fault when not ok: "job" (the job's own deterministic error: its model's
    computation or its data raised; no machine is to blame) or "machine" (a timeout, a lost
    peer, out of memory); "" counts as "machine"."""


@dataclass(frozen=True)
class JobDensities(Message):
    """Scheduler -> a stage: new codecs for edges it sends (re-adaptation from measured link
    throughput), from its next forward on: edge id -> top-k density (1.0 = not top-k), and
    edge id -> encoding ("raw", "bf16", "int8", "int4") for the edges whose encoding changes
    (the per-link codec choice; an edge in `encodings` with a density < 1 is refused)."""

    TYPE_ID: ClassVar[int] = 44
    job_id: str
    plan_version: int
    densities: dict[str, float] = field(default_factory=dict)
    encodings: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StageCheckpoint(Message):
    """Stage -> scheduler every `checkpoint_interval` steps: the partition's state after `step`
    (safetensors bytes in the payload); the scheduler writes the whole model once every stage's
    checkpoint of that step arrived."""

    TYPE_ID: ClassVar[int] = 45
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    plan_version: int
    partition: int
    step: int


# --- job submission through the scheduler (appended by the jobs helper; ids 46..49) ---------


@dataclass(frozen=True)
class JobSubmit(Message):
    """Submitting daemon -> the elected scheduler: run (or with `dry_run` only plan) a job. The
    payload is the job upload (fusiond.jobs.upload: job file text, IR, initial weights)."""

    TYPE_ID: ClassVar[int] = 46
    lane: ClassVar[Lane] = Lane.BULK
    request_id: str
    dry_run: bool = False


@dataclass(frozen=True)
class JobSubmitReply(Message):
    """Scheduler -> submitting daemon: the job started (`summary`: id, stages, plan) or was
    refused (`message` says why; nothing started)."""

    TYPE_ID: ClassVar[int] = 47
    request_id: str
    ok: bool
    message: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    code: str = ""
    """Why refused, for the submitter's logic: "not_scheduler" (the receiver is not, or no
    longer, the scheduler: ask the next one), "" otherwise."""


@dataclass(frozen=True)
class JobUpdate(Message):
    """Scheduler -> submitting daemon: the job's status (what `GET /v1/jobs/ID` shows, with its
    log lines), about twice a second and once at the end, after its outputs. BULK so it stays
    behind the JobOutput frames sent before it."""

    TYPE_ID: ClassVar[int] = 48
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    status: dict[str, Any] = field(default_factory=dict)
    steps: tuple[dict[str, Any], ...] = ()
    """The step records (`StepMetrics.as_dict`) since the previous update, oldest first, a
    bounded number per message (`fusiond.jobs.scheduling.MAX_UPDATE_STEPS`); a record for a step
    the submitter already has supersedes it and every later one (a restarted or failed-over
    attempt redoes them)."""
    handed_back: str = ""
    """Not empty: the scheduler gave the job up (it lost its lease) and says why; the
    submitting daemon resubmits it to the next scheduler (failover)."""
    after: int = -2
    """The last step of the records the scheduler sent before these (-1: none yet; -2: not
    said, an older sender). The submitting daemon takes `steps` only if it holds everything
    up to `after` from this scheduler; otherwise some update was lost on the way (a failed
    dial drops what was queued) and it asks for them again (`JobQuery.through`)."""


@dataclass(frozen=True)
class JobOutput(Message):
    """Scheduler -> submitting daemon: one output file of the job (`name`: model.safetensors,
    metrics.json, checkpoint-N.safetensors); the payload is its bytes, written under the job's
    output directory on the submitting machine."""

    TYPE_ID: ClassVar[int] = 49
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    name: str
    request_id: str = ""
    """Non-empty: the submitter answers `JobOutputAck` once the file is durably stored (or
    could not be)."""


# --- op sets (appended by the hetero helper; ids 60..61) -------------------------------------


@dataclass(frozen=True)
class OpSetRequest(Message):
    """Scheduler -> a member: the op names of your op set `digest` (gossiped in your profile
    as `ops_digest`), please. Reply: OpSetReply."""

    TYPE_ID: ClassVar[int] = 60
    request_id: int
    digest: str


@dataclass(frozen=True)
class OpSetReply(Message):
    """Reply to OpSetRequest: `ops` (sorted names) hash to `digest`; not `ok` (the member's
    op set is another one now) with `reason`. The requester checks the names and the hash."""

    TYPE_ID: ClassVar[int] = 61
    request_id: int
    digest: str
    ok: bool
    ops: tuple[str, ...] = ()
    reason: str = ""


# --- outputs stored by the submitting daemon (outputs helper; ids 56..57) ----------------------


@dataclass(frozen=True)
class JobOutputAck(Message):
    """The answer about a job's outputs. Submitting daemon -> scheduler: the `JobOutput` with
    `request_id` is durably stored in the submitter's output store (`ok`), or not (`message`:
    why, e.g. no space left). Scheduler -> submitting daemon: the `JobFetch` with `request_id`
    is done (the held outputs were sent and stored) or cannot be (`message`)."""

    TYPE_ID: ClassVar[int] = 56
    job_id: str
    request_id: str
    ok: bool
    message: str = ""


@dataclass(frozen=True)
class JobFetch(Message):
    """Submitting daemon -> the scheduler holding a job's outputs that could not be stored
    before: send them again (`JobOutput` with request ids, then a final `JobUpdate`)."""

    TYPE_ID: ClassVar[int] = 57
    job_id: str
    request_id: str


# --- job status queries (appended by the job-correctness helper; ids 64..67) -----------------


@dataclass(frozen=True)
class JobQuery(Message):
    """Submitting daemon -> the scheduler of a job it took, when the job's `JobUpdate`s stopped
    coming: does the scheduler still run it? Reply: JobQueryReply. CONTROL, so the answer does
    not wait behind the job's outputs on the BULK lane."""

    TYPE_ID: ClassVar[int] = 64
    job_id: str
    through: int = -2
    """The last step the submitting daemon holds of the scheduler's step records (-1: none):
    the scheduler sends it the records after it again, and the job's status (so a lost final
    update comes again too). -2: only asking."""


@dataclass(frozen=True)
class JobQueryReply(Message):
    """Scheduler -> submitting daemon: whether it knows the job (`known`) and, if so, its
    state ("running", "done", "failed", "cancelled", "handed_back")."""

    TYPE_ID: ClassVar[int] = 65
    job_id: str
    known: bool
    state: str = ""


# --- cluster-wide job views (appended by the operations helper; ids 80..81) ------------------

MAX_JOBS_ANSWER_HISTORY: Final = 2000
"""A `JobsQuery` asks for at most this many step records of a job."""


@dataclass(frozen=True)
class JobsQuery(Message):
    """Any member -> the scheduler: the jobs it coordinates (`job_id` empty), or one of them
    with its newest `history` step records and its log lines (`fusionctl jobs`, `job ID`,
    `logs ID` on a member that did not take the job's submission). Reply: JobsAnswer."""

    TYPE_ID: ClassVar[int] = 80
    request_id: int
    job_id: str = ""
    history: int = 0
    """Step records wanted (the scheduler sends at most `MAX_JOBS_ANSWER_HISTORY`)."""
    cancel: bool = False
    """With `job_id`: cancel it first (`fusionctl cancel ID` from that member's operator)."""


@dataclass(frozen=True)
class JobsAnswer(Message):
    """Scheduler -> the member that asked (`request_id` echoed): `jobs`, one brief per job it
    coordinates, or `job`, the one asked for (empty and `known` false when it has none such).
    BULK: a job's step records can be large."""

    TYPE_ID: ClassVar[int] = 81
    lane: ClassVar[Lane] = Lane.BULK
    request_id: int
    known: bool = True
    jobs: tuple[dict[str, Any], ...] = ()
    job: dict[str, Any] = field(default_factory=dict)
