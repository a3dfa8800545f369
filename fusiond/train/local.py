"""A whole pipelined job in one process, and the single-process reference trainer.

`run_pipeline` runs one `StageExecutor` per `StageProgram`, connected by `MemoryLinks` (one
bounded asyncio queue per ordered pair of stages, each drained by a pump task that delivers to the
destination executor): the same executor code the daemon hosts, with the network replaced by
queues. Payloads are the real `protocol.tensors` encodings, so byte counts are what the wire
would carry. `ReferenceTrainer` is plain eager training of the same model on the same batches
with the same optimizer: the yardstick the pipeline must match.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fusiond.errors import LocalError
from fusiond.tasks import cancel_and_wait
from fusiond.train.data import DataSource, split_micro_batches
from fusiond.train.model import Feed, LossFn, WithLoss
from fusiond.train.optim import lr_at, make_optimizer, set_lr
from fusiond.train.schedule import replica_slots, replica_tasks, schedule
from fusiond.train.spec import OptimizerSpec
from fusiond.train.stage import (
    Packet,
    PacketKind,
    StageConfig,
    StageExecutor,
    StageProgram,
    StepReport,
)

__all__ = [
    "EdgeFigures",
    "MemoryLinks",
    "PipelineResult",
    "ReferenceTrainer",
    "ReplicatedResult",
    "StepMetrics",
    "merge_reports",
    "replica_programs",
    "run_pipeline",
    "run_replicated",
]


class MemoryLinks:
    """In-memory links between stages: bounded queue per (src, dst) plus a delivering pump.

    `link(stage)` is that stage's `StageLink`. Register executors with `attach` before `start`.
    `latency_s`: each packet arrives that long after it was queued (one way; packets in
    flight do not wait on each other), as over a link with that much latency and no limit on
    its bandwidth: what latency costs a schedule or a reduction, without a network.
    """

    def __init__(self, maxsize: int = 4, latency_s: float = 0.0) -> None:
        if latency_s < 0:
            raise LocalError(f"latency_s must be >= 0, got {latency_s}")
        self.maxsize = maxsize
        self.latency_s = latency_s
        self._executors: dict[int, StageExecutor] = {}
        self._queues: dict[tuple[int, int], asyncio.Queue[tuple[float, Packet]]] = {}
        self._pumps: list[asyncio.Task[None]] = []
        self.bytes_sent: dict[tuple[int, int], int] = {}

    def attach(self, executor: StageExecutor) -> None:
        """Route packets addressed to `executor.slot` (its stage, without replicas) to it."""
        self._executors[executor.slot] = executor

    def link(self, stage: int) -> _Link:
        """The link stage `stage` sends through."""
        return _Link(self, stage)

    async def _queue(self, src: int, dst: int) -> asyncio.Queue[tuple[float, Packet]]:
        key = (src, dst)
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = asyncio.Queue(maxsize=self.maxsize)
            self._pumps.append(asyncio.create_task(self._pump(dst, q), name=f"pump {src}->{dst}"))
        return q

    async def _pump(self, dst: int, q: asyncio.Queue[tuple[float, Packet]]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due, pkt = await q.get()
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            try:
                target = self._executors.get(dst)
                if target is None:
                    raise LocalError(f"no stage {dst} attached")
                target.deliver(pkt)
            except Exception as e:
                for ex in self._executors.values():
                    ex.fail(e)
            finally:
                q.task_done()

    async def send(self, packet: Packet) -> None:
        """Queue a packet (awaits while the pair's queue is full)."""
        q = await self._queue(packet.src, packet.dst)
        key = (packet.src, packet.dst)
        self.bytes_sent[key] = self.bytes_sent.get(key, 0) + packet.nbytes
        await q.put((asyncio.get_running_loop().time() + self.latency_s, packet))

    async def close(self) -> None:
        """Cancel and await the pumps; idempotent."""
        await cancel_and_wait(self._pumps, what="pump")
        self._pumps.clear()


@dataclass
class _Link:
    hub: MemoryLinks
    stage: int

    async def send(self, packet: Packet) -> None:
        await self.hub.send(packet)


@dataclass
class EdgeFigures:
    """One edge's bytes in one step: forward (activation) and backward (gradient) directions."""

    edge: str
    src: int
    dst: int
    density: float | None
    forward_wire: int = 0
    forward_dense: int = 0
    backward_wire: int = 0
    backward_dense: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return dict(self.__dict__)


@dataclass
class StepMetrics:
    """One step of a whole job, merged over its stages."""

    step: int
    loss: float | None
    lr: float
    wall_s: float
    samples: int
    tokens: int
    stage_busy: dict[int, float]
    edges: list[EdgeFigures]
    shared_bytes: int = 0
    stage_wait: dict[int, float] = field(default_factory=dict)
    """Per stage, the share of the step it waited for inputs (`StepReport.wait_s`)."""
    reports: dict[int, StepReport] = field(default_factory=dict, repr=False)
    """The stages' own reports (their task timelines), for diagnostics; not in `as_dict`."""
    held_out_loss: float | None = None
    """The whole model's held-out loss after this step, where the scheduler evaluated it
    (`job.eval_interval`, checkpoints); in `as_dict` only then."""

    @property
    def wire_bytes(self) -> int:
        """Activation and gradient bytes on the wire this step (cut edges only)."""
        return sum(e.forward_wire + e.backward_wire for e in self.edges)

    @property
    def dense_bytes(self) -> int:
        """What those bytes would have been uncompressed."""
        return sum(e.forward_dense + e.backward_dense for e in self.edges)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the metrics history entry)."""
        return {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "wall_s": self.wall_s,
            "samples_per_s": self.samples / self.wall_s if self.wall_s > 0 else None,
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s > 0 and self.tokens else None,
            "stage_busy": {str(k): v for k, v in sorted(self.stage_busy.items())},
            "stage_wait": {str(k): v for k, v in sorted(self.stage_wait.items())},
            "wire_bytes": self.wire_bytes,
            "dense_bytes": self.dense_bytes,
            "shared_bytes": self.shared_bytes,
            "edges": [e.as_dict() for e in self.edges],
        } | ({} if self.held_out_loss is None else {"held_out_loss": self.held_out_loss})


def merge_reports(reports: Sequence[StepReport], *, samples: int, tokens: int,
                  wall_s: float | None = None) -> StepMetrics:
    """Merge one step's per-stage reports into job-level figures."""
    if not reports:
        raise LocalError("no stage reports to merge")
    step = reports[0].step
    # each loss-stage replica reports its share of the iteration's mean loss
    shares = [r.loss for r in reports if r.loss is not None]
    loss = sum(shares) if shares else None
    edges: dict[str, EdgeFigures] = {}
    shared = 0
    for r in reports:
        for st in r.edges:
            if st.kind == PacketKind.PARAM_GRAD:
                shared += st.wire_bytes
                continue
            if st.kind == PacketKind.FORWARD:
                src, dst = r.stage, st.peer
            else:
                src, dst = st.peer, r.stage
            fig = edges.setdefault(st.edge, EdgeFigures(st.edge, src, dst, None))
            if st.kind == PacketKind.FORWARD:
                fig.density = st.density  # the sender owns the density
                fig.forward_wire += st.wire_bytes
                fig.forward_dense += st.dense_bytes
            else:
                fig.backward_wire += st.wire_bytes
                fig.backward_dense += st.dense_bytes
    return StepMetrics(
        step=step,
        loss=loss,
        lr=reports[0].lr,
        wall_s=wall_s if wall_s is not None else max(r.wall_s for r in reports),
        samples=samples,
        tokens=tokens,
        stage_busy={r.stage: r.busy_fraction for r in reports},
        edges=sorted(edges.values(), key=lambda e: e.edge),
        shared_bytes=shared,
        stage_wait={r.stage: r.wait_s / r.wall_s if r.wall_s > 0 else 0.0 for r in reports},
        reports={r.stage: r for r in reports},
    )


@dataclass
class PipelineResult:
    """What `run_pipeline` returns: merged metrics per step and each stage's final state."""

    metrics: list[StepMetrics]
    states: dict[int, dict[str, torch.Tensor]]
    wall_s: float
    reports: dict[int, list[StepReport]] = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        """The loss of every step."""
        return [m.loss for m in self.metrics if m.loss is not None]


async def run_pipeline(
    programs: Sequence[StageProgram],
    *,
    data: DataSource,
    batch_size: int,
    micro_batches: int,
    optimizer: OptimizerSpec,
    steps: int,
    pipeline: str = "1f1b",
    first_step: int = 0,
    tokens_per_sample: int = 0,
    config: StageConfig | None = None,
    queue_size: int = 4,
    on_step: Callable[[StepMetrics], Any] | None = None,
    on_executors: Callable[[Sequence[StageExecutor]], Any] | None = None,
    devices: Sequence[str] | None = None,
    in_flight: Mapping[int, int] | None = None,
) -> PipelineResult:
    """Train `steps` steps of a pipelined model in this process; stage i is `programs[i]`,
    computing on `devices[i]` (default: `config`'s device for every stage; its program's
    module must be there already); 1F1B keeps `in_flight[i]` micro-batches in flight on
    stage i where given (`fusiond.train.schedule.one_f_one_b`).

    `on_executors(executors)` is called once they exist (e.g. to change densities mid-run).

    Every stage draws the same deterministic batches from `data` (only the stages whose program
    reads data use them). The first stage failure cancels the others and is raised.
    """
    tasks = schedule(pipeline, len(programs), micro_batches, in_flight)
    hub = MemoryLinks(queue_size)
    base = config or StageConfig()
    configs = ([base] * len(programs) if devices is None else
               [dataclasses.replace(base, device=d) for d in devices])
    execs = [
        StageExecutor(
            stage=i,
            program=p,
            link=hub.link(i),
            tasks=tasks[i],
            micro_batches=micro_batches,
            optimizer=optimizer,
            total_steps=first_step + steps,
            data=data if p.data_inputs else None,
            batch_size=batch_size,
            config=configs[i],
            job_slots=range(len(programs)),
        )
        for i, p in enumerate(programs)
    ]
    for ex in execs:
        hub.attach(ex)
    if on_executors is not None:
        on_executors(execs)
    per_step: dict[int, dict[int, StepReport]] = {}
    metrics: list[StepMetrics] = []
    t_prev = [time.perf_counter()]

    def collect(rep: StepReport) -> None:
        got = per_step.setdefault(rep.step, {})
        got[rep.stage] = rep
        if len(got) == len(execs):
            now = time.perf_counter()
            m = merge_reports(
                list(got.values()), samples=batch_size, tokens=batch_size * tokens_per_sample,
                wall_s=now - t_prev[0],
            )
            t_prev[0] = now
            metrics.append(m)
            del per_step[rep.step]
            if on_step is not None:
                on_step(m)

    t0 = time.perf_counter()
    try:
        for ex in execs:
            await ex.start()
        async with asyncio.TaskGroup() as tg:
            runs = [tg.create_task(ex.run(first_step, steps, collect)) for ex in execs]
        reports = {i: r.result() for i, r in enumerate(runs)}
    finally:
        for ex in execs:
            await ex.close()
        await hub.close()
    states = {ex.stage: ex.state_dict() for ex in execs}
    return PipelineResult(metrics, states, time.perf_counter() - t0, reports)


def replica_programs(programs: Sequence[Sequence[StageProgram]],
                     slots: Mapping[tuple[int, int], int]) -> dict[int, StageProgram]:
    """slot -> its program, each parameter of a replicated stage shared with the stage's
    other replicas, and a tied parameter with every replica of every stage holding it: the
    gradient exchange (`StageExecutor` sums every holder's gradient in slot order) is the
    replicas' all-reduce, bit-identical on every holder."""
    out: dict[int, StageProgram] = {}
    for s, reps in enumerate(programs):
        for r, prog in enumerate(reps):
            shared: dict[str, tuple[int, ...]] = {}
            for name, _ in prog.module.named_parameters():
                holders = [slots[(s, r2)] for r2 in range(len(reps)) if r2 != r]
                for s2 in prog.shared.get(name, ()):
                    holders += [slots[(s2, r2)] for r2 in range(len(programs[s2]))]
                if holders:
                    shared[name] = tuple(sorted(holders))
            out[slots[(s, r)]] = dataclasses.replace(prog, shared=shared)
    return out


@dataclass
class ReplicatedResult:
    """What `run_replicated` returns: the loss of every step (the mean over the whole
    iteration's micro-batches), every slot's final state, and every slot's step reports."""

    losses: list[float]
    states: dict[int, dict[str, torch.Tensor]]
    slots: dict[tuple[int, int], int]
    reports: dict[int, list[StepReport]] = dataclasses.field(default_factory=dict)


async def run_replicated(
    programs: Sequence[Sequence[StageProgram]],
    routes: Sequence[Sequence[int]],
    *,
    data: DataSource,
    batch_size: int,
    micro_batches: int,
    optimizer: OptimizerSpec,
    steps: int,
    pipeline: str = "1f1b",
    config: StageConfig | None = None,
    queue_size: int = 4,
    grad_rank: int | None = None,
    grad_warmup_steps: int = 0,
    grad_groups: Mapping[int, Sequence[Sequence[int]]] | None = None,
    grad_two_level: bool = False,
    latency_s: float = 0.0,
    micro_batch_sizes: Sequence[int] = (),
) -> ReplicatedResult:
    """Train `steps` steps of a pipeline whose stage s runs on `len(programs[s])` replicas
    (each program its own copy of the stage, with the same initial weights); `routes[s][m]`
    is the replica of stage s that runs micro-batch m (`fusiond.plan.route_micro_batches`).
    Each replica runs its share; a replicated stage's gradients are summed over its replicas
    before every optimizer step (rank-`grad_rank` factors with error feedback where a
    gradient is a matrix worth it, `fusiond.train.lowrank`; else dense). `grad_rank` is the
    job's, on every stage: every holder of a parameter must agree on how it travels.
    `grad_groups[s]`: stage s's replicas (by index) in bandwidth groups, reduced
    hierarchically (`StageConfig.grad_groups`), or two-level with `grad_two_level`
    (`StageConfig.grad_two_level`). `latency_s`: every link's one-way latency
    (`MemoryLinks`). `micro_batch_sizes`: each micro-batch's samples where they differ
    (`fusiond.plan.Plan.micro_batch_sizes`; empty: equal)."""
    S = len(programs)
    if len(routes) != S or any(len(r) != micro_batches for r in routes):
        raise LocalError(f"routes must give each of the {S} stages a replica per micro-batch")
    for s, route in enumerate(routes):
        if any(not 0 <= x < len(programs[s]) for x in route):
            raise LocalError(f"stage {s}: a route names a replica it does not have")
    slots = replica_slots([len(p) for p in programs])
    route_slots = {s: [slots[(s, x)] for x in routes[s]] for s in range(S)}
    progs = replica_programs(programs, slots)
    hub = MemoryLinks(queue_size, latency_s)
    execs: list[StageExecutor] = []
    for (s, r), slot in sorted(slots.items()):
        micros = [m for m in range(micro_batches) if routes[s][m] == r]
        p = progs[slot]
        cfg = config
        if grad_groups and s in grad_groups:  # replica indices -> slots
            cfg = dataclasses.replace(config or StageConfig(), grad_groups=tuple(
                tuple(slots[(s, x)] for x in g) for g in grad_groups[s]),
                grad_two_level=grad_two_level)
        execs.append(StageExecutor(
            stage=s, program=p, link=hub.link(slot),
            tasks=replica_tasks(pipeline, s, S, micros), micro_batches=micro_batches,
            optimizer=optimizer, total_steps=steps, data=data if p.data_inputs else None,
            batch_size=batch_size, config=cfg, slot=slot, routes=route_slots,
            grad_rank=grad_rank, grad_warmup_steps=grad_warmup_steps,
            job_slots=sorted(slots.values()), micro_batch_sizes=micro_batch_sizes))
    for ex in execs:
        hub.attach(ex)
    try:
        for ex in execs:
            await ex.start()
        async with asyncio.TaskGroup() as tg:
            runs = {ex.slot: tg.create_task(ex.run(0, steps)) for ex in execs}
    finally:
        for ex in execs:
            await ex.close()
        await hub.close()
    last = S - 1
    losses: list[float] = []
    for step in range(steps):
        shares = [runs[slots[(last, r)]].result()[step].loss for r in range(len(programs[last]))]
        losses.append(sum(x for x in shares if x is not None))
    return ReplicatedResult(losses, {ex.slot: ex.state_dict() for ex in execs}, slots,
                            {slot: task.result() for slot, task in runs.items()})


class ReferenceTrainer:
    """Eager single-process training: the same batches, micro-batch accumulation and optimizer.

    `feed`: how a named batch reaches the model (`fusiond.train.model.resolve_feed`; None: the
    main input by position).

    Each micro-batch's loss is scaled by 1/M before backward, as the pipeline does, so the
    accumulated gradient is the mean over micro-batches.
    """

    def __init__(self, model: nn.Module, loss: LossFn, optimizer: OptimizerSpec, *,
                 data: DataSource, batch_size: int, micro_batches: int, total_steps: int,
                 feed: Feed | None = None) -> None:
        self.net = WithLoss(model, loss, feed)
        self.model = model
        self.opt_spec = optimizer
        self.optimizer = make_optimizer(optimizer, self.net.parameters())
        self.data = data
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.total_steps = total_steps

    def step(self, step: int) -> float:
        """Train one step; returns the mean micro-batch loss."""
        batch = self.data.batch(step, self.batch_size)
        losses: list[float] = []
        for mb in split_micro_batches(batch, self.micro_batches):
            loss = self.net.on(mb)
            torch.autograd.backward(loss / self.micro_batches)
            losses.append(float(loss.detach()))
        set_lr(self.optimizer, lr_at(self.opt_spec, step, self.total_steps))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum(losses) / len(losses)

    def train(self, first: int, count: int) -> list[float]:
        """Train steps `first .. first+count-1`; the loss of each."""
        return [self.step(s) for s in range(first, first + count)]

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """The bare model's state dict."""
        return self.model.state_dict()
