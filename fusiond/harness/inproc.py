"""Several nodes in one process: a PeerNetwork (plaintext, loopback) and a JobWorker each, the
first also the scheduler. The daemon's job path without the daemon (membership, election, API):
for tests, benchmarks and the single-command local run (`python -m fusiond.train JOB.toml`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from fusiond.graph import CapturedModel, contiguous_assignment
from fusiond.jobs.assign import layout_job
from fusiond.jobs.coordinator import JobCoordinator, JobOutcome
from fusiond.jobs.worker import JobWorker, LeadershipFn, SendFn, local_send_now, local_sender
from fusiond.net.transport import NetConfig, PeerNetwork
from fusiond.train.local import StepMetrics
from fusiond.train.spec import JobSpec
from fusiond.train.stage import StageConfig
from protocol.messages import Message

__all__ = ["InProcNode", "inproc_cluster", "run_job"]


@dataclass
class InProcNode:
    """One node: its network, its worker, and the coordinators it runs as scheduler."""

    name: str
    net: PeerNetwork
    worker: JobWorker
    coordinators: list[JobCoordinator] = field(default_factory=list)

    async def dispatch(self, peer: str, msg: Message) -> None:
        """Offer a message to this node's coordinators, then its worker."""
        for c in self.coordinators:
            if await c.handle(peer, msg):
                return
        await self.worker.handle(peer, msg)

    def send_fn(self) -> SendFn:
        """This node's `send(peer, msg, payload)` (messages to itself skip the network)."""
        return local_sender(self.name, self.net.send, self.dispatch)


@contextlib.asynccontextmanager
async def inproc_cluster(n: int, *, stage_config: StageConfig | None = None,
                         net_config: NetConfig | None = None, prefix: str = "node",
                         leadership: LeadershipFn | None = None,
                         ) -> AsyncIterator[dict[str, InProcNode]]:
    """Start `n` nodes (`{prefix}0`.. `{prefix}{n-1}`) that know each other; close them on
    exit. `leadership`: every worker's view of the scheduler (None: any sender may assign)."""
    nodes: dict[str, InProcNode] = {}
    cfg = net_config or NetConfig(connect_timeout_s=5, handshake_timeout_s=5, backoff_max_s=1.0)

    def handler_for(me: str) -> Callable[[str, Message], Any]:
        async def handler(peer: str, msg: Message) -> None:
            await nodes[me].dispatch(peer, msg)

        return handler

    async with contextlib.AsyncExitStack() as stack:
        for i in range(n):
            name = f"{prefix}{i}"
            net = PeerNetwork(node_id=name, cluster_id="inproc", listen=("127.0.0.1", 0),
                              tls=None, handler=handler_for(name), config=cfg)
            await net.start()
            stack.push_async_callback(net.close)
            send = local_sender(name, net.send, handler_for(name))
            node = InProcNode(name, net, JobWorker(
                node_id=name, send=send, stage_config=stage_config, leadership=leadership,
                send_now=local_send_now(name, net.send_now)))
            net.set_receive_now(node.worker.receive_now)
            await node.worker.start()
            stack.push_async_callback(node.worker.close)
            nodes[name] = node
        for a in nodes.values():
            for b in nodes.values():
                a.net.add_peer_address(b.name, b.net.address)
        yield nodes


async def run_job(
    nodes: Mapping[str, InProcNode],
    spec: JobSpec,
    captured: CapturedModel,
    *,
    job_id: str,
    op_nodes: Mapping[str, str] | None = None,
    density: float | None = None,
    tokens_per_sample: int = 0,
    on_step: Callable[[StepMetrics], Any] | None = None,
    device: str = "cpu",
    **coordinator_kw: Any,
) -> JobOutcome:
    """Run one job with the first node as scheduler; contiguous cut over all nodes by default.

    `density` (or the spec's `compression.density`) forces top-k on every float cut edge.
    `device`: where every stage computes ("cuda:0": all on this machine's first GPU).
    """
    names = list(nodes)
    if op_nodes is None:
        cut = contiguous_assignment(captured.graph, len(names))
        op_nodes = {op: names[p] for op, p in cut.items()}
    if density is None:
        density = spec.compression.density
    layout = layout_job(job_id, captured.graph, captured.state, op_nodes, density=density,
                        exact=spec.compression.exact_edges, encoding=spec.compression.edge_encoding)
    if device != "cpu":
        layout = replace(layout, devices={n: device for n in names})
    sched = nodes[names[0]]
    coord = JobCoordinator(
        send=sched.send_fn(), spec=spec, captured=captured, layout=layout,
        addresses={n: x.net.address for n, x in nodes.items()}, term=1,
        tokens_per_sample=tokens_per_sample, on_step=on_step, **coordinator_kw,
    )
    sched.coordinators.append(coord)
    try:
        return await coord.run()
    finally:
        sched.coordinators.remove(coord)
