"""Run a captured job over real peer links on loopback, in one process (benchmarks, demos).

Each stage gets its own plaintext `PeerNetwork` on 127.0.0.1 and a `StageHost` built from the
`Assign` the scheduler side (`fusiond.jobs.assign`) makes for it: the daemon's code path minus
the daemon (membership, election, API). Tensors cross real TCP sockets through the frame codec.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from fusiond.graph import CapturedModel, contiguous_assignment
from fusiond.jobs.assign import JobLayout, assign_messages, layout_job
from fusiond.jobs.results import gather_state
from fusiond.net.transport import NetConfig, PeerNetwork
from fusiond.train.local import StepMetrics, merge_reports
from fusiond.train.remote import StageHost
from fusiond.train.spec import JobSpec
from fusiond.train.stage import StageConfig, StepReport
from protocol.messages import Message

__all__ = ["LoopbackResult", "run_loopback"]


@dataclass
class LoopbackResult:
    """Per-step merged metrics, socket bytes per step, the gathered model state, the layout."""

    metrics: list[StepMetrics]
    socket_bytes: list[int]
    """Bytes all peers wrote to their sockets during each step (frames, headers included)."""
    state: dict[str, torch.Tensor]
    layout: JobLayout
    wall_s: float


async def run_loopback(
    spec: JobSpec,
    captured: CapturedModel,
    *,
    stages: int = 3,
    op_nodes: Mapping[str, str] | None = None,
    density: float | None = None,
    steps: int | None = None,
    tokens_per_sample: int = 0,
    stage_config: StageConfig | None = None,
    on_step: Callable[[StepMetrics], Any] | None = None,
) -> LoopbackResult:
    """Train `spec` (or `steps` of it) on `stages` loopback peers; contiguous cut by default."""
    names = [f"node{i}" for i in range(stages)]
    if op_nodes is None:
        cut = contiguous_assignment(captured.graph, stages)
        op_nodes = {op: names[p] for op, p in cut.items()}
    layout = layout_job("loopback", captured.graph, captured.state, op_nodes, density=density,
                        exact=spec.compression.exact_edges, encoding=spec.compression.edge_encoding)
    if steps is not None:
        spec = replace(spec, steps=steps)
    hosts: dict[str, StageHost] = {}

    def handler_for(me: str) -> Callable[[str, Message], Any]:
        async def handler(peer: str, msg: Message) -> None:
            hosts[me].on_message(peer, msg)

        return handler

    used = sorted(set(op_nodes.values()))
    cfg = NetConfig(connect_timeout_s=10, handshake_timeout_s=10)
    nets = {n: PeerNetwork(node_id=n, cluster_id="loopback", listen=("127.0.0.1", 0), tls=None,
                           handler=handler_for(n), config=cfg) for n in used}
    per_step: dict[int, dict[int, StepReport]] = {}
    metrics: list[StepMetrics] = []
    socket_bytes: list[int] = []
    t_prev = [time.perf_counter()]

    def sent() -> int:
        return sum(s.bytes_sent for net in nets.values() for s in net.stats().values())

    b_prev = [0]

    def collect(rep: StepReport) -> None:
        got = per_step.setdefault(rep.step, {})
        got[rep.stage] = rep
        if len(got) == len(layout.stages):
            now = time.perf_counter()
            m = merge_reports(list(got.values()), samples=spec.batch.size,
                              tokens=spec.batch.size * tokens_per_sample, wall_s=now - t_prev[0])
            t_prev[0] = now
            b = sent()
            socket_bytes.append(b - b_prev[0])
            b_prev[0] = b
            metrics.append(m)
            del per_step[rep.step]
            if on_step is not None:
                on_step(m)

    t0 = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        for net in nets.values():
            await net.start()
            stack.push_async_callback(net.close)
        addresses = {n: net.address for n, net in nets.items()}
        for a in nets.values():
            for n, addr in addresses.items():
                a.add_peer_address(n, addr)
        assigns = assign_messages(layout, spec, captured.state, term=1, plan_version=1,
                                  addresses=addresses)
        for n, (msg, payload) in assigns.items():
            hosts[n] = StageHost(msg, payload, nets[n], config=stage_config)
            stack.push_async_callback(hosts[n].close)
            await hosts[n].start()
        t_prev[0] = time.perf_counter()
        b_prev[0] = sent()
        async with asyncio.TaskGroup() as tg:
            for h in hosts.values():
                tg.create_task(h.run(collect))
        state = gather_state(captured.graph, [h.state_dict() for h in hosts.values()])
    return LoopbackResult(metrics, socket_bytes, state, layout, time.perf_counter() - t0)
