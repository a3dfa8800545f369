"""The eager reference a distributed job's losses are held to."""

from __future__ import annotations

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
