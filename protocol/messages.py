"""Messages: one frozen dataclass per kind, msgpack-encoded in the frame's message header.

Every message class has a fixed `TYPE_ID` (the frame's type field) and a `lane` (CONTROL or
BULK: Forward, Backward and ProbeData are BULK, the rest CONTROL). Its fields are validated
from their annotations (protocol/_schema.py): unknown fields are ignored, missing or mistyped
fields raise RemoteProtocolError naming the message and the field path. A tensor or other bulk
data never goes into msgpack: it travels in the frame payload, available as `msg.payload`.

Adding a message: append a frozen dataclass subclass of `Message` at the end of this file (or in
another module imported before use) with a new, never reused `TYPE_ID`; give new fields of
existing messages a default so older peers' messages still decode. docs/protocol.md lists them.

Correlation: a message that expects a reply carries `request_id` (a u64 the requester picks,
unique among its outstanding requests to that peer); the reply (Vote, LeaderAck, Ack, Ready,
Error, Pong, JoinResponse) echoes it. 0 means "no reply expected" where a field is optional.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from protocol import PROTOCOL_VERSION
from protocol._schema import WIRE, Struct, packb, unpackb
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.frames import Buffer, Frame, encode_frame
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
    return encode_frame(
        msg.TYPE_ID,
        encode_header(msg, limits),
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
    bandwidth_bps: float
    """Measured goodput in bits per second (0 if unknown)."""
    rtt_s: float
    """Round-trip time in seconds."""
    measured_at: float = 0.0
    """Unix time of the measurement."""


@dataclass(frozen=True)
class NodeProfile(Struct):
    """What a node can do: device, measured speed, memory, software versions."""

    node_id: str
    hostname: str = ""
    device: str = "cpu"
    """torch device string, e.g. "cpu" or "cuda:0"."""
    device_name: str = ""
    flops: float = 0.0
    """Measured FLOP/s of this node on a calibration workload."""
    memory_bytes: int = 0
    """Memory available for training on `device`."""
    host_memory_bytes: int = 0
    cores: int = 0
    software: dict[str, str] = field(default_factory=dict)
    """e.g. {"python": "3.11.7", "torch": "2.13.0", "fusion": "0.1.0"}."""
    labels: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """The daemon's full profile map (free memory now, device count, ...), kept as given."""


@dataclass(frozen=True)
class MemberEntry(Struct):
    """One member as gossiped: newer (incarnation, heartbeat) wins."""

    node_id: str
    address: Address
    incarnation: int
    heartbeat: int
    state: MemberState
    profile: NodeProfile | None = None
    links: tuple[LinkMeasurement, ...] = ()


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
    """Tensor encoding (protocol.tensors.Encoding value) for the dense case."""


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
    "protocol" (bad handshake). Carries the refuser's version range and the peer's as seen.
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
    leader: str = ""


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


@dataclass(frozen=True)
class Leader(Message):
    """The elected leader (scheduler) announces itself for `term`. Reply: LeaderAck."""

    TYPE_ID: ClassVar[int] = 10
    request_id: int
    term: int
    leader: str
    address: Address | None = None


@dataclass(frozen=True)
class LeaderAck(Message):
    """Reply to Leader: accepted, or refused (stale term) with the reason."""

    TYPE_ID: ClassVar[int] = 11
    request_id: int
    term: int
    node_id: str
    accepted: bool
    reason: str = ""


# --- jobs and training -----------------------------------------------------------------------


@dataclass(frozen=True)
class Assign(Message):
    """The scheduler assigns one partition of a job to the receiver. Reply: Ready or Error.

    `graph` is the partition's IR (protocol.ir bytes); initial weights, if sent, travel in the
    payload (safetensors bytes).
    """

    TYPE_ID: ClassVar[int] = 12
    request_id: int
    term: int
    job_id: str
    plan_version: int
    partition: int
    graph: bytes
    edges: tuple[EdgeRoute, ...] = ()
    nodes: dict[str, Address] = field(default_factory=dict)
    """node id -> address of every node taking part in the job."""
    config: dict[str, Any] = field(default_factory=dict)
    """Job settings (micro-batches, optimizer, schedule, ...), a msgpack map."""


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


@dataclass(frozen=True)
class StageStep(Message):
    """Stage -> scheduler after each step: `figures` holds loss (loss stage only), lr, wall_s,
    busy_s and per-edge bytes (see fusiond.train.stage.StepReport)."""

    TYPE_ID: ClassVar[int] = 41
    job_id: str
    plan_version: int
    partition: int
    step: int
    figures: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JobCancel(Message):
    """Scheduler -> stages: stop the job and free its memory (a failure elsewhere, or the user)."""

    TYPE_ID: ClassVar[int] = 42
    job_id: str
    reason: str = ""
    plan_version: int = 0
    """The attempt to stop (0: whichever runs): a stale cancel never stops a newer attempt."""


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
    """Scheduler -> a stage: new top-k densities for edges it sends (AdaTopK re-adaptation from
    measured link throughput), edge id -> density (1.0 = exact), from its next forward on."""

    TYPE_ID: ClassVar[int] = 44
    job_id: str
    plan_version: int
    densities: dict[str, float] = field(default_factory=dict)


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
    handed_back: str = ""
    """Not empty: the scheduler gave the job up (it lost its lease) and says why; the
    submitting daemon resubmits it to the next scheduler (failover)."""


@dataclass(frozen=True)
class JobOutput(Message):
    """Scheduler -> submitting daemon: one output file of the job (`name`: model.safetensors,
    metrics.json, checkpoint-N.safetensors); the payload is its bytes, written under the job's
    output directory on the submitting machine."""

    TYPE_ID: ClassVar[int] = 49
    lane: ClassVar[Lane] = Lane.BULK
    job_id: str
    name: str


# --- job status queries (appended by the job-correctness helper; ids 64..67) -----------------


@dataclass(frozen=True)
class JobQuery(Message):
    """Submitting daemon -> the scheduler of a job it took, when the job's `JobUpdate`s stopped
    coming: does the scheduler still run it? Reply: JobQueryReply. CONTROL, so the answer does
    not wait behind the job's outputs on the BULK lane."""

    TYPE_ID: ClassVar[int] = 64
    job_id: str


@dataclass(frozen=True)
class JobQueryReply(Message):
    """Scheduler -> submitting daemon: whether it knows the job (`known`) and, if so, its
    state ("running", "done", "failed", "cancelled", "handed_back")."""

    TYPE_ID: ClassVar[int] = 65
    job_id: str
    known: bool
    state: str = ""
