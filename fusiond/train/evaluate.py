"""The held-out loss: one evaluator for every job, on the held-out split of its own data.

`heldout_loss(model, spec)` runs the model (eval mode, no gradients) over every held-out batch
of the job's data source (`heldout_batches`: examples, or the token stream's tail, never drawn
for training) and returns the job's objective averaged over what it scores: labelled positions
for the LM objectives and classification (positions labelled `ignore_index` count for
nothing), samples for regression. The model's training mode is restored.

`graph_heldout_loss(graph, state, spec, source)` is the same figure for a captured job graph
(its loss included) with a whole model's weights: what a scheduler, which holds the IR and the
weights but never the user's code, computes for a job's live held-out curve. It runs the
training graph, so a model with dropout scores with dropout on (seeded: the same masks for
the same weights), and a bounded number of held-out windows (`max_examples`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fusiond.errors import LocalError
from fusiond.train.data import Batch, make_source
from fusiond.train.model import Feed, feed_for, loss_fn
from fusiond.train.programs import build_stage_module, data_inputs, graph_data_names
from fusiond.train.spec import JobSpec
from protocol import ir

__all__ = ["EVAL_EXAMPLES", "graph_heldout_loss", "heldout_loss"]

EVAL_EXAMPLES = 64
"""Held-out examples (windows, rows, images) a live evaluation scores: a bounded cost per
evaluation whatever the split's size (the same examples every time)."""


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


def graph_heldout_loss(graph: ir.Graph, state: Mapping[str, torch.Tensor], spec: JobSpec,
                       source: Any, *, loss_name: str | None = None,
                       max_examples: int = EVAL_EXAMPLES, batch_size: int = 16) -> float:
    """The mean held-out loss of the captured job graph `graph` (which computes the job's
    loss: output `loss_name`, or its only output) with the weights `state`, over the first
    `max_examples` held-out examples of `source`, weighted as `heldout_loss` weighs them.
    `state` is left as it was: the buffers a training graph updates in place (BatchNorm's
    running statistics) are copied, the rest only read (no second copy of a big model).
    `LocalError` without a held-out split."""
    batches = getattr(source, "heldout_batches", None)
    if batches is None:
        raise LocalError(f"the data source {type(source).__name__} has no held-out split")
    updated = set(graph.buffer_updates)  # the only tensors a forward writes: copied
    program = build_stage_module(graph, {k: v.detach().clone() if k in updated else v.detach()
                                         for k, v in state.items()})
    out_name = loss_name if loss_name is not None else program.output_names[0]
    if out_name not in program.output_names:
        raise LocalError(f"the job graph has no output {out_name!r} "
                         f"(outputs {list(program.output_names)})")
    main, targets = graph_data_names(graph)
    feed = data_inputs(program.input_names, (), main, targets)  # batch key -> graph input
    ignore = spec.loss.ignore_index
    total, count, seen = 0.0, 0, 0
    with torch.no_grad():
        for i, b in enumerate(batches(batch_size)):
            if seen >= max_examples:
                break
            assert isinstance(b, Batch)
            seen += b.size
            n = b.size if spec.loss.kind == "regression" else int((b.targets != ignore).sum())
            if n == 0:
                continue
            if program.random is not None:  # dropout's masks: a function of the example
                program.random.set(spec.seed, -1, i)
            loss = program.run({name: b[key] for key, name in feed.items()})[out_name]
            total += float(loss) * n
            count += n
    if count == 0:
        raise LocalError("the held-out split is empty: set data.heldout > 0 (or give more data)")
    return total / count
