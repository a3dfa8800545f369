"""The eager reference a distributed job's losses are held to."""

from __future__ import annotations

import asyncio
from typing import Any

from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer
from fusiond.train.model import build_model, loss_fn
from fusiond.train.spec import JobSpec


def spec_losses(spec: JobSpec) -> list[float]:
    """Single-process eager training of `spec` on its whole batch (the same micro-batches,
    optimizer and data): its loss per step."""
    model = build_model(spec.model, seed=spec.seed)
    rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                          data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                          micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
    return rt.train(0, spec.steps)


async def run_on_inproc_daemons(spec: JobSpec, captured: Any, layout: Any, nodes_count: int
                                ) -> tuple[Any, list[float]]:
    """Run `layout` of `spec` by the scheduler's coordinator on `nodes_count` in-process
    daemons ("n0", "n1", ...) over loopback TLS: the job's outcome and its loss per step."""
    from fusiond.harness.inproc import inproc_cluster
    from fusiond.jobs.coordinator import JobCoordinator
    from fusiond.jobs.worker import local_sender
    from fusiond.net.transport import NetConfig

    cfg = NetConfig(connect_timeout_s=2, handshake_timeout_s=2, backoff_max_s=0.5)
    async with inproc_cluster(nodes_count, net_config=cfg, prefix="n") as nodes:
        losses: list[float] = []
        n0 = nodes["n0"]
        c = JobCoordinator(send=local_sender("n0", n0.net.send, n0.dispatch), spec=spec,
                           captured=captured, layout=layout,
                           addresses={n: x.net.address for n, x in nodes.items()}, term=1,
                           on_step=lambda m: losses.append(m.loss))
        n0.coordinators.append(c)
        out = await asyncio.wait_for(c.run(), 120)
    return out, losses
