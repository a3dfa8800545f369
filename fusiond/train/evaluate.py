"""The held-out loss: one evaluator for every job, on the held-out split of its own data.

`heldout_loss(model, spec)` runs the model (eval mode, no gradients) over every held-out batch
of the job's data source (`heldout_batches`: examples, or the token stream's tail, never drawn
for training) and returns the job's objective averaged over what it scores: labelled positions
for the LM objectives and classification (positions labelled `ignore_index` count for
nothing), samples for regression. The model's training mode is restored.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fusiond.errors import LocalError
from fusiond.train.data import Batch, make_source
from fusiond.train.model import Feed, feed_for, loss_fn
from fusiond.train.spec import JobSpec

__all__ = ["heldout_loss"]


def heldout_loss(model: nn.Module, spec: JobSpec, *, source: Any = None,
                 feed: Feed | None = None, batch_size: int = 32) -> float:
    """The mean held-out loss of `model` on `spec`'s data (`source`: the job's data source,
    built here when None). `LocalError` when the source has no held-out split
    (`data.heldout = 0`)."""
    if source is None:
        source = make_source(spec.data, spec.seed)
    batches = getattr(source, "heldout_batches", None)
    if batches is None:
        raise LocalError(f"the data source {type(source).__name__} has no held-out split")
    lossf = loss_fn(spec.loss)
    ignore = spec.loss.ignore_index
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in batches(batch_size):
                assert isinstance(b, Batch)
                if feed is None:
                    feed = feed_for(model, b, spec)
                n = b.size if spec.loss.kind == "regression" else int((b.targets != ignore).sum())
                if n == 0:
                    continue
                total += float(lossf(feed.call(model, b), b.targets)) * n
                count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise LocalError("the held-out split is empty: set data.heldout > 0 (or give more data)")
    return total / count
