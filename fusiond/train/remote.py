"""Hosting a stage in a daemon: Assign in, a `StageExecutor` over the peer network out.

The scheduler side (`fusiond.jobs.assign`) sends every machine an `Assign`: its partition's
sub-graph (`protocol.ir` bytes), its boundary edges (`EdgeRoute`: edge id, src/dst partition and
node, density, encoding: "raw", "bf16", "int8" or "int4"), the address of every node in the
job, and `config`, the job settings below (a msgpack map); the partition's initial weights
travel in the frame payload as safetensors bytes.
Partition ids ARE pipeline stage numbers (0 reads the data; edges go from lower to higher).

`StageHost(assign, payload, net)` validates all of that (a `RemoteError` names the bad field),
builds the partition, and runs it; the daemon routes each Forward/Backward of the job to
`StageHost.on_message(peer, msg)`. On the wire:

- Forward(job_id, plan_version, iteration=step, microbatch, edge=<edge id>) + tensor payload.
- Backward(... edge=<edge id>) + gradient payload (VALUES on a top-k edge).
- Backward(... microbatch=0, edge="param:<name>") + a tied parameter's gradient, exchanged by
  every stage holding a copy before the optimizer step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from fusiond.errors import RemoteError
from fusiond.graph import state_views
from fusiond.graph.registry import check_ops
from fusiond.plan.model import DEVICE_RE
from fusiond.train.codec import EDGE_ENCODINGS
from fusiond.train.data import (
    DATA_PREFIX,
    DataError,
    DataSource,
    TextWindows,
    check_arrays,
    corpus_digest,
    dataset_digest,
    make_source,
    source_from_arrays,
)
from fusiond.train.device import check_device
from fusiond.train.programs import build_stage_module, data_inputs, random_seeder
from fusiond.train.schedule import default_in_flight, replica_tasks, schedule
from fusiond.train.segments import SegmentPlan, SegmentRunner
from fusiond.train.spec import (
    AUGMENTS,
    DATA_KINDS,
    FIELD_RE,
    MAX_GRAD_RANK,
    OBJECTIVES,
    BatchSpec,
    DataSpec,
    JobSpec,
    OptimizerSpec,
    default_text_path,
)
from fusiond.train.stage import (
    PRECISIONS,
    EdgeSpec,
    Packet,
    PacketKind,
    StageConfig,
    StageExecutor,
    StageProgram,
    StepReport,
)
from protocol import ir
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    MAX_GRAD_BUCKETS,
    Assign,
    AssignConfig,
    Backward,
    DataConfig,
    Forward,
    Message,
    OptimizerConfig,
)

__all__ = [
    "CONFIG_VERSION",
    "DATA_TOKENS_KEY",
    "PARAM_PREFIX",
    "NetStageLink",
    "PeerSender",
    "StageAssignment",
    "StageHost",
    "decode_assign",
    "job_config",
    "raising_op",
]

log = logging.getLogger(__name__)

CONFIG_VERSION = 1
"""Version of the `Assign.config` record (`protocol.messages.AssignConfig`) `job_config`
writes."""
DATA_TOKENS_KEY = DATA_PREFIX + "tokens"
"""Entry of an Assign's safetensors payload carrying a shipped token stream (token ids); the
other arrays of shipped data are `DATA_PREFIX + name` too (rows, images, tokenizer meta)."""
PARAM_PREFIX = "param:"
"""Edge name prefix of a Backward carrying a shared (tied) parameter's gradient."""
MIN_RECV_TIMEOUT_S = 1.0
MAX_RECV_TIMEOUT_S = 86_400.0
"""Bounds on a scheduler's `recv_timeout_s` in an Assign (seconds)."""


class PeerSender(Protocol):
    """What a stage needs of `fusiond.net.PeerNetwork`."""

    async def send(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> None:
        """Queue `msg` for `peer` (awaits while the peer's lane is full)."""
        ...

    def send_now(self, peer: str, msg: Message, payload: Sequence[Any] = ()) -> bool:
        """Write `msg` at once if its lane is idle; False: `send` it."""
        ...


def job_config(spec: JobSpec, *, stage_nodes: Mapping[int, str],
               shared: Mapping[int, Mapping[str, Sequence[int]]],
               input_name: str, targets_name: str | None, loss_name: str,
               corpus_digest: str = "", default_corpus: bool = False,
               recv_timeout_s: float | None = None, first_step: int = 0,
               slot_stages: Mapping[int, int] | None = None,
               routes: Mapping[int, Sequence[int]] | None = None,
               grad_rank: int | None = None, grad_warmup_steps: int = 0,
               recompute_slots: Sequence[int] = (),
               offload_slots: Sequence[int] = (),
               checkpoint_blocks: Mapping[int, Sequence[int]] | None = None,
               offload_param_slots: Sequence[int] = (),
               slot_devices: Mapping[int, str] | None = None,
               grad_buckets: Mapping[int, int] | None = None,
               in_flight: Mapping[int, int] | None = None,
               grad_groups: Mapping[int, Sequence[Sequence[int]]] | None = None,
               grad_two_level: Sequence[int] = (),
               micro_batch_sizes: Sequence[int] = ()
               ) -> AssignConfig:
    """The `Assign.config` record for a job (the same for every stage).

    `stage_nodes`: stage -> node id for every stage; `shared`: stage -> {tied parameter -> the
    other stages holding it}; the names say which sub-graph inputs are data and which output
    is the loss. `corpus_digest`: the content hash of the submitter's corpus (a stage reading
    data checks its tokens against it); `default_corpus`: the stages read the default corpus
    from their own standard library (not from the path written here). `recv_timeout_s`: the
    scheduler's bound on one wait for a task's inputs, from the plan's predicted iteration on
    the measured links (a stage waits at least its own configured bound). `first_step`: the
    step this attempt starts at (> 0 when it resumes), so a stage is at that step from its
    Assign on and keeps a neighbour's first tensors that arrive before its JobStart.
    With replicas, `stage_nodes` and `shared` are keyed by slot (`AssignConfig`), and
    `slot_stages` (replica slot -> stage) and `routes` (replicated stage -> the slot of each
    micro-batch) say who runs what. `grad_rank`: the summed gradients travel low-rank at
    this rank (None: dense), after `grad_warmup_steps` dense steps. `recompute_slots`: the
    slots that recompute their activations (`StageConfig.recompute`); `offload_slots`: the
    slots that keep their optimizer state on disk (`StageConfig.offload_dir`);
    `checkpoint_blocks`: slot -> the blocks of its partition it checkpoints;
    `offload_param_slots`: the slots whose weights and gradients live on disk too;
    `slot_devices`: slot -> its accelerator; `grad_buckets`: slot -> the buckets its shared
    gradients are reduced in (the plan's choice); `in_flight`: stage -> the micro-batches
    1F1B keeps in flight there (the plan's choice; absent: the schedule's own);
    `grad_groups`: replicated stage -> its slots in bandwidth groups (a hierarchical
    reduction, the plan's choice); `grad_two_level`: those of them reduced two-level;
    `micro_batch_sizes`: each micro-batch's samples where the plan sizes them (empty: equal).
    """
    o = spec.optimizer
    d = spec.data
    return AssignConfig(
        version=CONFIG_VERSION,
        steps=spec.steps,
        first_step=int(first_step),
        seed=spec.seed,
        checkpoint_interval=spec.checkpoint_interval,
        batch_size=spec.batch.size,
        micro_batches=spec.batch.micro_batches,
        pipeline=spec.batch.pipeline,
        per_row=spec.compression.per_row,
        optimizer=OptimizerConfig(
            kind=o.kind, lr=float(o.lr), weight_decay=float(o.weight_decay),
            betas=(float(o.betas[0]), float(o.betas[1])), eps=float(o.eps),
            momentum=float(o.momentum), schedule=o.schedule, warmup_steps=o.warmup_steps,
            min_lr=float(o.min_lr)),
        data=DataConfig(
            kind=d.kind, path=None if d.path is None else str(d.path),
            tokenizer=d.tokenizer, seq_len=d.seq_len, image_size=d.image_size,
            channels=d.channels, num_classes=d.num_classes,
            digest=corpus_digest, default_corpus=default_corpus,
            objective=d.objective, layout=d.layout, heldout=float(d.heldout),
            ignore_index=d.ignore_index, mask_probability=float(d.mask_probability),
            mask_token_id=d.mask_token_id, decoder_start_token_id=d.decoder_start_token_id,
            augment=tuple(d.augment), mean=tuple(float(x) for x in d.mean),
            std=tuple(float(x) for x in d.std)),
        input_name=input_name,
        targets_name=targets_name,
        loss_name=loss_name,
        stage_nodes={str(s): n for s, n in stage_nodes.items()},
        shared={str(s): {k: tuple(int(x) for x in v) for k, v in m.items()}
                for s, m in shared.items()},
        recv_timeout_s=None if recv_timeout_s is None else float(recv_timeout_s),
        slot_stages={str(k): int(v) for k, v in (slot_stages or {}).items()},
        routes={str(k): tuple(int(x) for x in v) for k, v in (routes or {}).items()},
        grad_rank=None if grad_rank is None else int(grad_rank),
        grad_warmup_steps=int(grad_warmup_steps),
        eval_interval=spec.eval_interval,
        recompute_slots=tuple(sorted(int(s) for s in recompute_slots)),
        offload_slots=tuple(sorted(int(s) for s in offload_slots)),
        checkpoint_blocks={str(k): tuple(sorted(int(b) for b in v))
                           for k, v in (checkpoint_blocks or {}).items() if v},
        offload_param_slots=tuple(sorted(int(s) for s in offload_param_slots)),
        precision=spec.precision,
        slot_devices={str(k): str(v) for k, v in (slot_devices or {}).items()},
        grad_buckets={str(k): int(v) for k, v in (grad_buckets or {}).items()},
        in_flight={str(k): int(v) for k, v in (in_flight or {}).items()},
        grad_groups={str(k): tuple(tuple(int(s) for s in g) for g in v)
                     for k, v in (grad_groups or {}).items()},
        grad_two_level=tuple(sorted(int(s) for s in grad_two_level)),
        micro_batch_sizes=tuple(int(x) for x in micro_batch_sizes),
    )


@dataclass(frozen=True)
class StageAssignment:
    """A validated Assign: everything a daemon needs to run its stage."""

    job_id: str
    plan_version: int
    stage: int
    graph: ir.Graph
    state: dict[str, torch.Tensor]
    edges: tuple[EdgeSpec, ...]
    stages: int
    """How many stages the pipeline has."""
    stage_nodes: dict[int, str]
    """stage -> node id of every stage this one talks to."""
    steps: int
    seed: int
    checkpoint_interval: int
    batch: BatchSpec
    optimizer: OptimizerSpec
    data: DataSpec
    per_row: bool
    input_name: str
    targets_name: str | None
    loss_name: str
    shared: dict[str, tuple[int, ...]]
    data_arrays: dict[str, np.ndarray] | None = None
    """The data shipped by the submitter (a token stream, rows, images), when it is not the
    default corpus or synthetic."""
    data_digest: str = ""
    """The submitter's corpus hash ("" = unchecked): the stage's tokens must match it."""
    recv_timeout_s: float | None = None
    """The scheduler's bound on one wait for inputs (None: the stage's own config)."""
    first_step: int = 0
    """The step the attempt starts at (the JobStart's `first_step` says the same)."""
    slot: int = -1
    """What this node runs and is addressed as (the stage itself without replicas; -1:
    the stage)."""
    slot_nodes: dict[int, str] | None = None
    """Every slot of the job -> its node (None: `stage_nodes`)."""
    routes: dict[int, tuple[int, ...]] | None = None
    """Replicated stage -> the slot running each micro-batch."""
    slot_stages: dict[int, int] | None = None
    """Replica slot -> its stage (slots absent run the stage numbered like them)."""
    grad_rank: int | None = None
    """Summed gradients travel as rank-`grad_rank` factors (None: dense)."""
    grad_warmup_steps: int = 0
    """... after this many dense steps."""
    eval_interval: int = 0
    """Steps between states sent for the scheduler's held-out evaluation (0: none)."""
    recompute: bool = False
    """This slot recomputes its activations in the backward (`StageConfig.recompute`)."""
    offload: bool = False
    """This slot keeps its optimizer state on disk (`StageConfig.offload_dir`)."""
    checkpoint_blocks: tuple[int, ...] = ()
    """The blocks of its partition (`protocol.ir.block_starts`) this slot checkpoints."""
    offload_params: bool = False
    """This slot keeps its weights and gradients on disk too (`StageConfig.offload_params`)."""
    precision: str = "fp32"
    """The compute dtype (`StageConfig.precision`)."""
    device: str = "cpu"
    """The device this slot computes on (`StageConfig.device`)."""
    grad_buckets: int = 0
    """The buckets this slot's shared gradients are reduced in (`StageConfig.grad_buckets`;
    0: split by size)."""
    in_flight: int = 0
    """The micro-batches this slot's 1F1B keeps in flight (0: the schedule's min(S - i, M))."""
    grad_groups: tuple[tuple[int, ...], ...] = ()
    """This slot's stage's replicas in bandwidth groups (`StageConfig.grad_groups`)."""
    grad_two_level: bool = False
    """Those groups reduce two-level (`StageConfig.grad_two_level`)."""
    micro_batch_sizes: tuple[int, ...] = ()
    """Each micro-batch's samples where the plan sizes them (empty: equal)."""

    @property
    def is_replica(self) -> bool:
        """This slot is a replica beyond its stage's first: its parameters equal the first's
        after every step, so its state is never sent (`sends_state`)."""
        return self.slot_stages is not None and self.own_slot in self.slot_stages

    def sends_state(self, step: int) -> bool:
        """Whether the state after `step` goes to the scheduler (a checkpoint, or a held-out
        evaluation), not after the last step (its state is the result). Only the first
        replica of a stage sends it: the others hold the same parameters, and a replica of
        the whole model would otherwise serialise and send it again each time (on a 0.4-core
        host that held the next step's first forward for a third of a second)."""
        done = step + 1
        return not self.is_replica and done < self.steps and any(
            every > 0 and done % every == 0
            for every in (self.checkpoint_interval, self.eval_interval))

    @property
    def own_slot(self) -> int:
        return self.stage if self.slot < 0 else self.slot

    def stage_of_slot(self, slot: int) -> int:
        return (self.slot_stages or {}).get(slot, slot)


def decode_assign(msg: Assign, payload: bytes | memoryview, *,
                  limits: Limits = DEFAULT_LIMITS) -> StageAssignment:
    """Validate an Assign and its weights; `RemoteError` names the bad field."""
    cfg = msg.config
    if cfg is None:
        raise RemoteError("Assign.config: missing")
    if cfg.version != CONFIG_VERSION:
        raise RemoteError(f"Assign.config.version: {cfg.version!r}, want {CONFIG_VERSION}")
    try:
        graph = ir.loads(msg.graph, limits)
    except Exception as e:
        raise RemoteError(f"Assign.graph: {e}") from e
    try:
        # views of the payload: the stage's module copies the weights once, and the payload
        # goes when the Assign does (no second and third copy on the way)
        state = state_views(payload)
    except Exception as e:
        raise RemoteError(f"Assign payload (safetensors weights): {e}") from e
    data_arrays: dict[str, np.ndarray] | None = None
    for key in [k for k in state if k.startswith(DATA_PREFIX)]:
        data_arrays = data_arrays if data_arrays is not None else {}
        data_arrays[key[len(DATA_PREFIX):]] = state.pop(key).clone().numpy()
    if data_arrays is not None:
        try:
            check_arrays(data_arrays, "Assign payload")
        except DataError as e:
            raise RemoteError(str(e)) from e
    slot = msg.partition
    try:
        slot_stages = {int(k): int(v) for k, v in cfg.slot_stages.items()}
    except ValueError as e:
        raise RemoteError(f"Assign.config.slot_stages: {e}") from e
    stage = slot_stages.get(slot, slot)
    edges: list[EdgeSpec] = []
    stage_nodes: dict[int, str] = {}
    for r in msg.edges:
        if stage not in (r.src_partition, r.dst_partition):
            raise RemoteError(f"Assign.edges: {r.edge!r} does not touch partition {stage}")
        if r.src_partition >= r.dst_partition:
            raise RemoteError(f"Assign.edges: {r.edge!r} goes backwards in the pipeline")
        if not 0.0 < r.density <= 1.0:
            raise RemoteError(f"Assign.edges: {r.edge!r} density {r.density} not in (0, 1]")
        if r.encoding not in EDGE_ENCODINGS:
            raise RemoteError(f"Assign.edges: {r.edge!r} encoding {r.encoding!r} is not one of "
                              f"{list(EDGE_ENCODINGS)}")
        density = None if r.density >= 1.0 else r.density
        if r.encoding != "raw" and density is not None:
            raise RemoteError(f"Assign.edges: {r.edge!r} is {r.encoding} and top-k (density "
                              f"{r.density}): a quantized edge is never top-k")
        encoding = next(e for e in EDGE_ENCODINGS if e == r.encoding)
        edges.append(EdgeSpec(r.edge, r.src_partition, r.dst_partition, density,
                              encoding=encoding))
        for s, node in ((r.src_partition, r.src_node), (r.dst_partition, r.dst_node)):
            if stage_nodes.setdefault(s, node) != node:
                raise RemoteError(f"Assign.edges: partition {s} on two nodes")
            if node not in msg.nodes:
                raise RemoteError(f"Assign.nodes: no address for {node!r}")
    o, d = cfg.optimizer, cfg.data
    shared = {k: tuple(v) for k, v in cfg.shared.get(str(slot), {}).items()}
    stage_map = cfg.stage_nodes
    stages = len(stage_map) - len(slot_stages)
    if not 0 <= stage < stages:
        raise RemoteError(f"Assign.partition: {stage} is not a stage of {stages}")
    for k, v in slot_stages.items():
        if str(k) not in stage_map or k < stages or not 0 <= v < stages:
            raise RemoteError(f"Assign.config.slot_stages: slot {k} -> stage {v} is not a "
                              f"replica slot (>= {stages}, with a node) of a stage")
    routes: dict[int, tuple[int, ...]] = {}
    for key, route in cfg.routes.items():
        try:
            rs = int(key)
        except ValueError as e:
            raise RemoteError(f"Assign.config.routes: {e}") from e
        if not 0 <= rs < stages or len(route) != cfg.micro_batches or any(
                str(x) not in stage_map or slot_stages.get(x, x) != rs for x in route):
            raise RemoteError(f"Assign.config.routes: stage {key} must name one of its own "
                              f"slots for each of the {cfg.micro_batches} micro-batches")
        routes[rs] = tuple(route)
    for s in {x for v in shared.values() for x in v} | set(stage_nodes):
        on = stage_map.get(str(s))
        if on is None or on not in msg.nodes:
            raise RemoteError(f"Assign.config.stage_nodes: no node for stage {s}")
        if stage_nodes.setdefault(s, on) != on:
            raise RemoteError(f"Assign: stage {s} is on {on!r} and {stage_nodes[s]!r}")
    try:
        optimizer = OptimizerSpec(
            kind=o.kind,  # type: ignore[arg-type]  # checked below
            lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps,
            momentum=o.momentum, schedule=o.schedule,  # type: ignore[arg-type]
            warmup_steps=o.warmup_steps, min_lr=o.min_lr,
        )
        path = str(default_text_path()) if d.default_corpus else d.path  # the stage's own
        data = _data_spec(d, path)
        size, micro = cfg.batch_size, cfg.micro_batches
        if size < 1 or micro < 1 or size % micro:
            raise RemoteError(f"Assign.config: batch_size {size} / micro_batches {micro}")
        sizes = cfg.micro_batch_sizes
        if sizes and (len(sizes) != micro or min(sizes) < 1 or sum(sizes) != size):
            raise RemoteError(f"Assign.config.micro_batch_sizes: {list(sizes)[:8]} are not "
                              f"{micro} positive sizes adding up to batch_size {size}")
        batch = BatchSpec(size=size, micro_batches=micro,
                          pipeline=cfg.pipeline)  # type: ignore[arg-type]
    except (IndexError, ValueError) as e:
        raise RemoteError(f"Assign.config: {e}") from e
    if optimizer.kind not in ("adamw", "sgd"):
        raise RemoteError(f"Assign.config.optimizer.kind: {optimizer.kind!r}")
    recv_timeout = cfg.recv_timeout_s
    if recv_timeout is not None and not MIN_RECV_TIMEOUT_S <= recv_timeout <= MAX_RECV_TIMEOUT_S:
        raise RemoteError(f"Assign.config.recv_timeout_s: {recv_timeout!r} is not a number of "
                          f"seconds in [{MIN_RECV_TIMEOUT_S:g}, {MAX_RECV_TIMEOUT_S:g}]")
    grad_rank = cfg.grad_rank
    if grad_rank is not None and not 1 <= grad_rank <= MAX_GRAD_RANK:
        raise RemoteError(f"Assign.config.grad_rank: {grad_rank!r} is not a rank in "
                          f"[1, {MAX_GRAD_RANK}]")
    steps, first_step = cfg.steps, cfg.first_step
    if not 0 <= cfg.grad_warmup_steps <= max(0, steps):
        raise RemoteError(f"Assign.config.grad_warmup_steps: {cfg.grad_warmup_steps!r} is not "
                          f"a step count in [0, {steps}]")
    if cfg.precision not in PRECISIONS:
        raise RemoteError(f"Assign.config.precision: {cfg.precision[:16]!r} is not one of "
                          f"{sorted(PRECISIONS)}")
    own = slot if slot >= 0 else stage
    blocks = len(ir.block_starts(graph))
    for key, chosen in cfg.checkpoint_blocks.items():
        if not key.isdigit() or int(key) not in {int(k) for k in stage_map}:
            raise RemoteError(f"Assign.config.checkpoint_blocks: {key[:16]!r} is not a slot of "
                              f"the job ({len(stage_map)} slots)")
        if int(key) == own and any(not 0 <= b < blocks for b in chosen):
            raise RemoteError(f"Assign.config.checkpoint_blocks[{key}]: {list(chosen)[:4]} "
                              f"are not blocks of this partition (it has {blocks})")
    for field_name in ("recompute_slots", "offload_slots", "offload_param_slots"):
        unknown = sorted(set(getattr(cfg, field_name)) - {int(k) for k in stage_map})
        if unknown:
            raise RemoteError(f"Assign.config.{field_name}: {unknown[:4]} are not slots of "
                              f"the job ({len(stage_map)} slots)")
    for key, dev in cfg.slot_devices.items():
        if not key.isdigit() or int(key) not in {int(k) for k in stage_map}:
            raise RemoteError(f"Assign.config.slot_devices: {key[:16]!r} is not a slot of the "
                              f"job ({len(stage_map)} slots)")
        if not DEVICE_RE.fullmatch(dev):
            raise RemoteError(f"Assign.config.slot_devices[{key}]: {dev[:16]!r} is not "
                              "\"cpu\" or \"cuda:N\"")
    for key, count in cfg.grad_buckets.items():
        if not key.isdigit() or int(key) not in {int(k) for k in stage_map}:
            raise RemoteError(f"Assign.config.grad_buckets: {key[:16]!r} is not a slot of the "
                              f"job ({len(stage_map)} slots)")
        if not isinstance(count, int) or not 1 <= count <= MAX_GRAD_BUCKETS:
            raise RemoteError(f"Assign.config.grad_buckets[{key}]: {count!r} is not a bucket "
                              f"count in [1, {MAX_GRAD_BUCKETS}]")
    _check_in_flight(cfg, stages)
    groups = _check_grad_groups(cfg, stage_map, slot_stages or {})
    if not 0 <= cfg.eval_interval <= 10**9:
        raise RemoteError(f"Assign.config.eval_interval: {cfg.eval_interval!r} is not a step "
                          "count in [0, 10**9]")
    if not 0 <= first_step < max(1, steps):
        raise RemoteError(f"Assign.config.first_step: {first_step!r} is not a step of the job's "
                          f"{steps}")
    return StageAssignment(
        job_id=msg.job_id, plan_version=msg.plan_version, stage=stage, graph=graph, state=state,
        edges=tuple(edges), stages=stages, stage_nodes=stage_nodes,
        steps=steps, first_step=first_step, seed=cfg.seed,
        checkpoint_interval=cfg.checkpoint_interval,
        batch=batch, optimizer=optimizer, data=data,
        per_row=cfg.per_row, input_name=cfg.input_name, targets_name=cfg.targets_name,
        loss_name=cfg.loss_name, shared=shared, data_arrays=data_arrays, data_digest=d.digest,
        recv_timeout_s=recv_timeout, slot=slot,
        slot_nodes={int(k): v for k, v in stage_map.items()},
        routes=routes, slot_stages=slot_stages, grad_rank=grad_rank,
        grad_warmup_steps=cfg.grad_warmup_steps, eval_interval=cfg.eval_interval,
        recompute=(slot if slot >= 0 else stage) in cfg.recompute_slots,
        offload=own in cfg.offload_slots or own in cfg.offload_param_slots,
        checkpoint_blocks=tuple(cfg.checkpoint_blocks.get(str(own), ())),
        offload_params=own in cfg.offload_param_slots,
        precision=cfg.precision,
        device=cfg.slot_devices.get(str(own), "cpu"),
        grad_buckets=cfg.grad_buckets.get(str(own), 0),
        in_flight=cfg.in_flight.get(str(stage), 0),
        grad_groups=groups.get(stage, ()),
        grad_two_level=stage in cfg.grad_two_level,
        micro_batch_sizes=tuple(cfg.micro_batch_sizes),
    )


def _check_grad_groups(cfg: AssignConfig, stage_map: Mapping[str, str],
                       slot_stages: Mapping[int, int]) -> dict[int, tuple[tuple[int, ...], ...]]:
    """`Assign.config.grad_groups`: per replicated stage, two or more disjoint groups whose
    slots are exactly that stage's (its first slot and its replicas')."""
    out: dict[int, tuple[tuple[int, ...], ...]] = {}
    slots = {int(k) for k in stage_map}
    for key, groups in cfg.grad_groups.items():
        if not key.isdigit() or int(key) not in slots:
            raise RemoteError(f"Assign.config.grad_groups: {key[:16]!r} is not a stage of the "
                              "job")
        st = int(key)
        mine = {st} | {s for s, x in slot_stages.items() if x == st}
        flat = [s for g in groups for s in g]
        if len(groups) < 2 or any(not g for g in groups) or len(flat) != len(set(flat)) \
                or set(flat) != mine:
            raise RemoteError(f"Assign.config.grad_groups[{key}]: {[list(g) for g in groups][:4]}"
                              f" is not two or more groups of exactly the stage's slots "
                              f"{sorted(mine)[:8]}")
        out[st] = tuple(tuple(g) for g in groups)
    if any(not isinstance(st, int) or st not in out for st in cfg.grad_two_level):
        raise RemoteError(f"Assign.config.grad_two_level: {list(cfg.grad_two_level)[:8]} "
                          f"names a stage without grad_groups (those: {sorted(out)[:8]})")
    return out


def _check_in_flight(cfg: AssignConfig, stages: int) -> None:
    """`Assign.config.in_flight`: stages of the job, counts in [1, micro_batches], and never
    more on a stage than on an earlier one (the schedule would deadlock:
    `fusiond.train.schedule`)."""
    counts: dict[int, int] = {}
    for key, count in cfg.in_flight.items():
        if not key.isdigit() or not 0 <= int(key) < stages:
            raise RemoteError(f"Assign.config.in_flight: {key[:16]!r} is not a stage of the "
                              f"job ({stages} stages)")
        if not isinstance(count, int) or not 1 <= count <= cfg.micro_batches:
            raise RemoteError(f"Assign.config.in_flight[{key}]: {count!r} is not a number of "
                              f"micro-batches in [1, {cfg.micro_batches}]")
        counts[int(key)] = count
    if counts and cfg.pipeline != "1f1b":
        raise RemoteError(f"Assign.config.in_flight: given for a {cfg.pipeline!r} pipeline; "
                          "only 1F1B keeps a number of micro-batches in flight")
    eff = [counts.get(i, default_in_flight(stages, i, cfg.micro_batches))
           for i in range(stages)]
    for i in range(1, stages):
        if eff[i] > eff[i - 1]:
            raise RemoteError(f"Assign.config.in_flight: stage {i} keeps {eff[i]} micro-batches "
                              f"in flight, more than stage {i - 1}'s {eff[i - 1]}: the "
                              "pipeline would deadlock")


def _data_spec(d: DataConfig, path: str | None) -> DataSpec:
    """The `DataSpec` an Assign's data config describes; `RemoteError` naming a bad field."""
    def bad(field: str, value: Any, want: str) -> RemoteError:
        return RemoteError(f"Assign.config.data.{field}: {value!r} is not {want}")

    if d.kind not in DATA_KINDS:
        raise bad("kind", d.kind, f"one of {list(DATA_KINDS)}")
    if d.objective not in OBJECTIVES:
        raise bad("objective", d.objective, f"one of {list(OBJECTIVES)}")
    if d.layout not in ("windows", "rows"):
        raise bad("layout", d.layout, "'windows' or 'rows'")
    if not 0.0 <= d.heldout <= 0.5:
        raise bad("heldout", d.heldout, "a fraction in [0, 0.5]")
    if not 0.0 < d.mask_probability <= 1.0:
        raise bad("mask_probability", d.mask_probability, "in (0, 1]")
    if any(a not in AUGMENTS for a in d.augment):
        raise bad("augment", d.augment, f"a list of {list(AUGMENTS)}")
    if len(d.mean) > 64 or len(d.std) > 64 or any(x <= 0 for x in d.std):
        raise bad("std", d.std, "at most 64 positive numbers")
    for field in ("mask_token_id", "decoder_start_token_id"):
        v = getattr(d, field)
        if v is not None and not 0 <= v < (1 << 31):
            raise bad(field, v, "a token id")
    if not 1 <= d.seq_len <= (1 << 20):
        raise bad("seq_len", d.seq_len, "in [1, 2**20]")
    return DataSpec(
        kind=d.kind,
        path=None if path is None else Path(path), tokenizer=d.tokenizer, seq_len=d.seq_len,
        image_size=d.image_size, channels=d.channels, num_classes=d.num_classes,
        objective=d.objective,
        layout=d.layout,  # type: ignore[arg-type]  # checked above
        heldout=d.heldout, ignore_index=d.ignore_index, mask_probability=d.mask_probability,
        mask_token_id=d.mask_token_id, decoder_start_token_id=d.decoder_start_token_id,
        augment=tuple(d.augment), mean=tuple(d.mean), std=tuple(d.std))


def _value(edge_id: str) -> str:
    """The sub-graph value name of an edge id `<value>-><dst>`."""
    return edge_id.rsplit("->", 1)[0]


def program_from_assignment(sa: StageAssignment) -> StageProgram:
    """Build the partition module and describe its boundary for the executor (its weights
    copied from `sa.state`: the decoded tensors share the read-only bytes they came from)."""
    module = build_stage_module(sa.graph, sa.state,
                                device=None if sa.device == "cpu" else sa.device)
    runner: SegmentRunner | None = None
    if sa.checkpoint_blocks or sa.offload_params:  # the memory plan goes block by block
        starts = ir.block_starts(sa.graph)
        chosen = set(sa.checkpoint_blocks)
        runner = SegmentRunner(sa.graph, module, SegmentPlan(
            tuple(starts), tuple(i in chosen for i in range(len(starts)))))
    forward = runner.run if runner is not None else module.run
    in_edges = tuple(
        replace(e, per_row=sa.per_row) for e in sa.edges if e.dst == sa.stage
    )
    out_edges = tuple(
        replace(e, per_row=sa.per_row) for e in sa.edges if e.src == sa.stage
    )
    names = [i.name for i in sa.graph.inputs]
    has_loss = any(o.name == sa.loss_name for o in sa.graph.outputs)
    in_value = {e.edge_id: _value(e.edge_id) for e in in_edges}
    out_value = {e.edge_id: _value(e.edge_id) for e in out_edges}
    # every input no edge feeds is data: the main input, the labels, or a named field
    data_map = data_inputs(names, set(in_value.values()), sa.input_name, sa.targets_name)
    bad = [k for k in data_map if k not in ("inputs", "targets") and not FIELD_RE.match(k)]
    if bad:
        raise RemoteError(f"Assign: partition input {bad[0]!r} is neither an edge nor a data "
                          "field")
    # what `run` reads of the assignment, and nothing more: a closure over `sa` would keep
    # its decoded weights alive beside the module's copy
    graph, loss_name = sa.graph, sa.loss_name

    def run(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        feed: dict[str, torch.Tensor] = {}
        for key, t in inputs.items():
            feed[in_value.get(key) or data_map[key]] = t
        try:
            outs = forward(feed)
        except Exception as e:  # name the op and module that raised (the executor reports it)
            where = raising_op(e, graph)
            if where is not None:
                e.fusion_where = where  # type: ignore[attr-defined]
            raise
        result = {eid: outs[v] for eid, v in out_value.items()}
        if has_loss:
            result["loss"] = outs[loss_name]
        return result

    return StageProgram(
        module=module, run=run, in_edges=in_edges, out_edges=out_edges,
        data_inputs=tuple(sorted(data_map)), has_loss=has_loss, shared=sa.shared,
        seed_random=random_seeder(module, sa.seed), segments=runner,
    )


def raising_op(exc: BaseException, graph: ir.Graph) -> str | None:
    """The IR op of `graph` that raised `exc` while a module built from it ran forward, e.g.
    "op aten.embedding.default (node 'embedding', module 'transformer.wte')", from the frame of
    the generated forward in the traceback; None if no such frame (e.g. autograd raised)."""
    import linecache

    from fusiond.graph.program import _ident

    by_name = {_ident(n.id): n for n in graph.nodes}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith("<eval_with_key"):
            line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
            name = line.split("=", 1)[0].strip() if "=" in line else ""
            node = by_name.get(name)
            if node is not None:
                found = node
        tb = tb.tb_next
    if found is None:
        return None
    module = f", module {found.module_path!r}" if found.module_path else ""
    return f"op {found.op} (node {found.id!r}{module})"


class NetStageLink:
    """A `StageLink` over the peer network: packets become Forward/Backward messages."""

    def __init__(self, net: PeerSender, job_id: str, plan_version: int,
                 stage_nodes: Mapping[int, str]) -> None:
        self.net = net
        self.job_id = job_id
        self.plan_version = plan_version
        self.stage_nodes = dict(stage_nodes)

    async def send(self, packet: Packet) -> None:
        """Send one packet to the node running `packet.dst` (awaits under backpressure)."""
        node, msg = self._message(packet)
        await self.net.send(node, msg, packet.buffers())

    def send_now(self, packet: Packet) -> bool:
        """Write the packet at once when its lane to the node is idle (no turn of a sender
        or writer task); False: nothing was done, `send` it."""
        node, msg = self._message(packet)
        return self.net.send_now(node, msg, packet.buffers())

    def _message(self, packet: Packet) -> tuple[str, Message]:
        node = self.stage_nodes[packet.dst]
        msg: Message
        if packet.kind == PacketKind.FORWARD:
            msg = Forward(job_id=self.job_id, plan_version=self.plan_version,
                          iteration=packet.step, microbatch=packet.micro, edge=packet.edge)
        elif packet.kind == PacketKind.BACKWARD:
            msg = Backward(job_id=self.job_id, plan_version=self.plan_version,
                           iteration=packet.step, microbatch=packet.micro, edge=packet.edge)
        else:
            msg = Backward(job_id=self.job_id, plan_version=self.plan_version,
                           iteration=packet.step, microbatch=0, edge=PARAM_PREFIX + packet.edge)
        return node, msg


def _remove_offload_dir(where: Path) -> None:
    """`<root>/<job>/v<version>` and, once empty, `<root>/<job>` (never the root)."""
    shutil.rmtree(where, ignore_errors=True)
    with contextlib.suppress(OSError):
        where.parent.rmdir()


def _safe_name(job_id: str) -> str:
    """A job id as one path component (it comes from the network): letters, digits, '.', '_'
    and '-' kept, anything else '_', at most 64 characters, never '.' or '..'."""
    name = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_"
                   for c in job_id[:64])
    return name if name.strip(".") else "_" + name


def _own_corpus_only(sa: StageAssignment) -> None:
    """A stage reads no path an Assign names except this machine's default corpus (its own
    standard library): any other text travels in the Assign (the submitter read it as the
    user). RemoteError otherwise, so a daemon never reads a file on a job's say-so."""
    d = sa.data
    if d.kind != "images" and (d.kind != "text" or d.path is None or Path(d.path).resolve()
                               != default_text_path().resolve()):
        raise RemoteError(f"job {sa.job_id} stage {sa.stage}: the Assign names the corpus "
                          f"{d.path} but does not carry it; a stage reads only its own "
                          "standard library, any other data comes with the job")


def _stage_data(sa: StageAssignment) -> DataSource:
    """The data source of a stage that reads data: from the data its Assign carries, or its
    own default corpus or synthetic images; checked against the submitter's hash."""
    try:
        if sa.data_arrays is not None:
            data = source_from_arrays(sa.data, sa.data_arrays, sa.seed)
            here = dataset_digest(sa.data_arrays)
        else:
            _own_corpus_only(sa)
            data = make_source(sa.data, sa.seed)
            here = corpus_digest(data.tokens) if isinstance(data, TextWindows) else ""
    except DataError as e:
        raise RemoteError(f"job {sa.job_id} stage {sa.stage}: its data: {e}") from e
    if sa.data_digest and here != sa.data_digest:
        where = "shipped" if sa.data_arrays is not None else \
            f"{sa.data.path} (Python {platform.python_version()})"
        raise RemoteError(
            f"job {sa.job_id} stage {sa.stage}: the corpus here, {where}, is not the "
            f"submitter's (hash {here[:12]} vs {sa.data_digest[:12]}): the default "
            "corpus differs between Python versions; give the job a data.path "
            "(shipped from the submitter) to train on the same tokens everywhere")
    return data


def _fields_of(data: DataSource, sa: StageAssignment) -> list[str]:
    """The field names of the stage's batches (one small batch, drawn for the check)."""
    try:
        return list(data.batch(sa.first_step, 1).fields)
    except Exception as e:
        raise RemoteError(f"job {sa.job_id} stage {sa.stage}: its data fails: {e!r}") from e


class StageHost:
    """One stage of one job inside a daemon: build from an Assign, run, report, close.

    `on_message(peer, msg)` must receive every Forward/Backward of this job addressed here;
    `run(on_step)` trains every step and returns the per-step reports.
    """

    def __init__(self, assign: Assign, payload: bytes | memoryview, net: PeerSender, *,
                 config: StageConfig | None = None, limits: Limits = DEFAULT_LIMITS,
                 data: DataSource | None = None, offload_root: Path | None = None) -> None:
        self.assignment = decode_assign(assign, payload, limits=limits)
        sa = self.assignment
        config = config or StageConfig()
        if sa.recompute:  # the planner's choice for this slot, beside the daemon's knobs
            config = replace(config, recompute=True)
        if sa.offload:  # under the daemon's state directory (`offload_root`), per attempt
            root = offload_root or Path(tempfile.gettempdir()) / f"fusion-offload-{os.getuid()}"
            config = replace(config, offload_dir=root / _safe_name(sa.job_id)
                             / f"v{sa.plan_version}")
        config = replace(config, precision=sa.precision, offload_params=sa.offload_params,
                         device=sa.device, grad_buckets=sa.grad_buckets,
                         grad_groups=sa.grad_groups, grad_two_level=sa.grad_two_level)
        # every op of the partition must run here (UnsupportedOpError names the one that does
        # not), and its device must be here (DeviceError), before anything is built
        check_ops(sa.graph, config.disabled_ops)
        check_device(sa.device)
        self.program = program_from_assignment(sa)
        # the module holds its own copy of the weights now; the decoded state would keep a
        # second one in memory for the job's life (with the weights on disk, all of them)
        self.assignment = sa = replace(sa, state={})
        slot_nodes = sa.slot_nodes if sa.slot_nodes is not None else dict(sa.stage_nodes)
        holders = {x for h in sa.shared.values() for x in h}
        # the nodes this one exchanges tensors with: every replica of the stages it talks to,
        # and every holder of a parameter it shares
        # (fp16: every slot of the job, which agree on the loss scale each step)
        self._node_stage = {n: s for s, n in slot_nodes.items() if s != sa.own_slot and (
            s in holders or sa.stage_of_slot(s) in sa.stage_nodes or sa.precision == "fp16")}
        if self.program.data_inputs and data is None:
            data = _stage_data(sa)
            fields = _fields_of(data, sa)
            missing = [k for k in self.program.data_inputs
                       if k not in ("inputs", "targets") and k not in fields]
            if missing:
                raise RemoteError(f"job {sa.job_id} stage {sa.stage}: the partition reads the "
                                  f"data field {missing[0]!r}, which the job's data does not "
                                  f"give (it gives {sorted(fields)})")
        route = (sa.routes or {}).get(sa.stage)
        own_in_flight = sa.in_flight or None
        if route is None:
            tasks = schedule(sa.batch.pipeline, sa.stages, sa.batch.micro_batches,
                             None if own_in_flight is None else {sa.stage: own_in_flight}
                             )[sa.stage]
        else:
            tasks = replica_tasks(sa.batch.pipeline, sa.stage, sa.stages,
                                  [m for m, x in enumerate(route) if x == sa.own_slot],
                                  own_in_flight)
        if sa.recv_timeout_s is not None and sa.recv_timeout_s > config.recv_timeout_s:
            # slow links: the plan says a step takes this long; never time out before it
            config = replace(config, recv_timeout_s=sa.recv_timeout_s)
        self.executor = StageExecutor(
            stage=sa.stage, program=self.program,
            link=NetStageLink(net, sa.job_id, sa.plan_version, slot_nodes),
            tasks=tasks,
            micro_batches=sa.batch.micro_batches, optimizer=sa.optimizer, total_steps=sa.steps,
            data=data, batch_size=sa.batch.size, config=config, first_step=sa.first_step,
            slot=sa.own_slot, routes=sa.routes, grad_rank=sa.grad_rank, grad_seed=sa.seed,
            grad_warmup_steps=sa.grad_warmup_steps, job_slots=sorted(slot_nodes),
            micro_batch_sizes=sa.micro_batch_sizes,
        )

    async def start(self) -> None:
        """Start the executor (compute thread, senders)."""
        await self.executor.start()

    async def ready(self) -> None:
        """Return once the stage can take tensors."""
        await self.executor.ready()

    async def close(self) -> None:
        """Stop and free the stage; idempotent. Its optimizer state's directory (with
        offload) is removed, and the job's above it once empty."""
        await self.executor.close()
        where = self.executor.config.offload_dir
        if where is not None:
            await asyncio.to_thread(_remove_offload_dir, where)

    def on_message(self, peer: str, msg: Message) -> None:
        """Route a Forward/Backward of this job to the executor; `RemoteError` if it is not."""
        if not isinstance(msg, (Forward, Backward)):
            raise RemoteError(f"stage host got {type(msg).__name__}")
        sa = self.assignment
        if msg.job_id != sa.job_id or msg.plan_version != sa.plan_version:
            raise RemoteError(f"{type(msg).__name__} for job {msg.job_id!r} v{msg.plan_version}")
        src = self._node_stage.get(peer)
        if src is None:
            raise RemoteError(f"{type(msg).__name__} from {peer!r}, not a neighbour stage")
        kind = PacketKind.FORWARD if isinstance(msg, Forward) else PacketKind.BACKWARD
        edge = msg.edge
        if kind == PacketKind.BACKWARD and edge.startswith(PARAM_PREFIX):
            kind, edge = PacketKind.PARAM_GRAD, edge[len(PARAM_PREFIX):]
        # Own the bytes: the frame buffer may be reused once the handler returns. A bytearray,
        # so the decoded tensor can live in it without a second copy (codec._tensor).
        payload = memoryview(bytearray(msg.payload))
        self.executor.deliver(
            Packet(kind, msg.iteration, msg.microbatch, edge, src, sa.own_slot, payload)
        )

    def fail(self, exc: BaseException) -> None:
        """Abort the stage (e.g. a neighbour died): its pending waits raise `exc`."""
        self.executor.fail(exc)

    async def run(self, on_step: Callable[[StepReport], Any] | None = None,
                  first: int = 0, *, reads_state: Callable[[int], bool] | None = None
                  ) -> list[StepReport]:
        """Train steps `first .. steps-1`; `on_step` gets each step's report, and after a step
        for which `reads_state(step)` is true (None: every step) it sees the state that step
        left: as a copy in the report (`StepReport.state`), taken on the compute thread, which
        goes on; or, under a memory plan, whose budget has no room for a second copy of the
        weights, as the stage's own (`state_dict`) with the next step held until `on_step` is
        done. Every other step runs ahead (`StageExecutor.run`)."""
        cfg = self.executor.config
        planned = (cfg.recompute or cfg.offload_dir is not None or cfg.offload_params
                   or self.program.segments is not None)
        count = self.assignment.steps - first
        if planned or reads_state is None:
            return await self.executor.run(first, count, on_step, hold=reads_state)
        return await self.executor.run(first, count, on_step, hold=lambda _: False,
                                       snapshot=reads_state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's parameters and buffers under graph names."""
        return self.executor.state_dict()
