"""Partitioned runs equal the unpartitioned eager model: loss, every gradient, BN buffers."""

from __future__ import annotations

import copy

import pytest
import torch

from fusiond.graph import (
    SINK,
    SOURCE,
    Driver,
    PartitionError,
    contiguous_assignment,
    interleaved_assignment,
    partition,
)
from protocol import ir
from tests.graph.models import assert_close_rel, case

MODELS = ["gpt2", "hf_gpt2", "resnet18", "fanout"]


def _assignments(g: ir.Graph, parts: int) -> list[tuple[str, dict[str, int]]]:
    out = [("contiguous", contiguous_assignment(g, parts))]
    if parts > 1:
        out.append(("interleaved", interleaved_assignment(g, parts, seed=parts)))
        # Contiguous runs with ids that do not follow graph order.
        rev = {k: parts - 1 - v for k, v in contiguous_assignment(g, parts).items()}
        out.append(("reversed-ids", rev))
    return out


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("model", MODELS)
def test_partitioned_equals_eager(model: str, parts: int) -> None:
    c = case(model)
    want_loss, want_grads = c.eager()
    for label, asg in _assignments(c.captured.graph, parts):
        d = Driver(c.captured.graph, asg, c.captured.state)
        assert len(d.partitions) == parts, label
        out = d.forward_backward(list(c.batch))
        assert_close_rel(out["loss"], want_loss, f"{model}/{parts}/{label} loss")
        got = d.named_grads()
        assert set(got) == set(want_grads), f"{model}/{parts}/{label}: gradient names differ"
        for name, g in want_grads.items():
            assert_close_rel(got[name], g, f"{model}/{parts}/{label} grad {name}")


def test_batchnorm_running_stats_follow_eager() -> None:
    c = case("resnet18")
    model = copy.deepcopy(c.model)
    model.load_state_dict(
        {
            **c.captured.state,
            **{a: c.captured.state[k] for a, k in c.captured.graph.aliases.items()},
        }
    )
    model(c.batch[0])
    d = Driver(c.captured.graph, interleaved_assignment(c.captured.graph, 3), c.captured.state)
    d.forward_backward(list(c.batch))
    got = d.state_dict()
    for name, buf in model.named_buffers():
        assert_close_rel(got[name].to(buf.dtype), buf, f"buffer {name}")


def test_boundary_fan_out_and_no_grad_edges() -> None:
    c = case("fanout")
    g = c.captured.graph
    # Everything before branch a (mask, stem, relu) -> 0, branch a -> 1, branch b -> 2, the
    # rest -> 3: the stem's output goes to 1, 2 and 3 (the long residual), the mask 0 -> 3.
    asg: dict[str, int] = {}
    branches = False
    for n in g.nodes:
        top = n.module_path.split(".")[0]
        branches = branches or top == "a"
        asg[n.id] = {"a": 1, "b": 2}.get(top, 3) if branches else 0
    parts = partition(g, asg)
    by_value: dict[str, set[int]] = {}
    for p in parts:
        for e in p.outputs:
            assert e.src == p.id
            by_value.setdefault(e.value, set()).add(e.dst)
        for e in p.inputs:
            assert e.dst == p.id
            assert e.src == SOURCE or e.src in {q.id for q in parts}
    assert max(len(d) for d in by_value.values()) == 3, "the stem output feeds 3 partitions"
    edges = [e for p in parts for e in (*p.inputs, *p.outputs)]
    mask = [e for e in edges if e.meta.dtype == "bool" and e.src != SOURCE]
    assert mask and not any(e.needs_grad for e in mask), "the mask crosses without a gradient"
    # And the run is still exact.
    want_loss, want_grads = case("fanout").eager()
    d = Driver(g, asg, case("fanout").captured.state)
    assert_close_rel(d.forward_backward(list(case("fanout").batch))["loss"], want_loss, "loss")
    got = d.named_grads()
    for name, gr in want_grads.items():
        assert_close_rel(got[name], gr, name)
    assert sum(e.dst == SINK for p in parts for e in p.outputs) == 1  # the loss leaves once
    # Each partition's sub-graph is a standalone, serialisable IR graph.
    for p in parts:
        assert ir.loads(ir.dumps(p.graph)) == p.graph


def test_cycle_between_partitions_is_refused() -> None:
    g = case("fanout").captured.graph
    asg = {n.id: i % 2 for i, n in enumerate(g.nodes)}  # ping-pong: 0 -> 1 -> 0
    with pytest.raises(PartitionError, match="cycle"):
        partition(g, asg)


def test_unassigned_node_is_named() -> None:
    g = case("fanout").captured.graph
    asg = contiguous_assignment(g, 2)
    victim = next(n for n in g.nodes if n.op == "aten.linear.default")
    del asg[victim.id]
    with pytest.raises(PartitionError, match=victim.id):
        partition(g, asg)


def test_micro_batches_accumulate_like_one_batch() -> None:
    """Two half-batches with loss_scale 1/2 give the full batch's mean-loss gradients."""
    c = case("fanout")
    _, want = c.eager()
    d = Driver(c.captured.graph, interleaved_assignment(c.captured.graph, 2), c.captured.state)
    x, y = c.batch
    # FanOutNet's loss is a mean over the batch; equal halves make the average exact.
    x4, y4 = x[:4], y[:4]
    full = Driver(c.captured.graph, contiguous_assignment(c.captured.graph, 1), c.captured.state)
    full.forward_backward([x4, y4])
    runners = d.runners
    for k, sl in enumerate((slice(0, 2), slice(2, 4))):
        feeds: list[dict[str, torch.Tensor]] = [{} for _ in runners]
        outs = []
        for i, r in enumerate(runners):
            p = d.partitions[i]
            feed = {
                **feeds[i],
                **{
                    e.value: {"input": x4, "targets": y4}[e.value][sl]
                    for e in p.inputs
                    if e.src == SOURCE
                },
            }
            o = r.forward(feed, key=k)
            outs.append(o)
            for e in p.outputs:
                if e.dst != SINK:
                    j = [q.id for q in d.partitions].index(e.dst)
                    feeds[j][e.value] = o[e.value].detach()
        gbox: list[dict[str, torch.Tensor]] = [{} for _ in runners]
        for i in range(len(runners) - 1, -1, -1):
            gi = runners[i].backward(gbox[i], key=k, loss_scale=0.5)
            for e in d.partitions[i].inputs:
                if e.src != SOURCE and gi.get(e.value) is not None:
                    j = [q.id for q in d.partitions].index(e.src)
                    prev = gbox[j].get(e.value)
                    gval = gi[e.value]
                    assert gval is not None
                    gbox[j][e.value] = gval if prev is None else prev + gval
    got, ref = d.named_grads(), full.named_grads()
    assert set(got) == set(ref)
    for name in ref:
        assert_close_rel(got[name], ref[name], f"micro-batched grad {name}")
    assert want  # the eager reference ran


class _Transposer(torch.nn.Module):
    """Sends a transposed activation across a cut; the receiver transposes back and views."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).transpose(1, 2)  # (B, 6, 4), non-contiguous
        z = y.transpose(1, 2)  # contiguous again here, but not on a contiguous copy of y
        out: torch.Tensor = self.b(z.reshape(z.shape[0], -1))
        return out


def test_received_tensors_need_not_keep_traced_strides() -> None:
    from fusiond.graph import capture
    from fusiond.models.resnet import classification_loss

    torch.manual_seed(0)
    m = _Transposer()
    c = capture(
        m, (torch.randn(2, 4, 6),), targets=torch.randint(0, 3, (2,)), loss=classification_loss
    )
    g = c.graph
    first_b = next(i for i, n in enumerate(g.nodes) if n.module_path == "b")
    cut = next(
        i
        for i, n in enumerate(g.nodes)
        if n.op == "aten.permute.default" or n.op == "aten.transpose.int"
    )
    asg = {n.id: 0 if i <= cut else 1 for i, n in enumerate(g.nodes)}
    assert first_b > cut
    x, y = torch.randn(3, 4, 6), torch.randint(0, 3, (3,))
    loss = classification_loss(m(x), y)
    loss.backward()
    d = Driver(g, asg, c.state)
    assert_close_rel(d.forward_backward([x, y])["loss"], loss.detach(), "loss")
    got = d.named_grads()
    for n, p in m.named_parameters():
        assert p.grad is not None
        assert_close_rel(got[n], p.grad, n)


def test_edges_name_their_producer() -> None:
    g = case("gpt2").captured.graph
    parts = partition(g, interleaved_assignment(g, 3, seed=1))
    nodes_of = {p.id: set(p.node_ids) for p in parts}
    for p in parts:
        for e in (*p.inputs, *p.outputs):
            assert e.producer is not None
            assert g.meta_of(e.producer) == e.meta
            if e.src == SOURCE:
                assert e.producer == ir.Ref(ir.RefKind.INPUT, e.value)
            else:
                assert e.producer.name in nodes_of[e.src]


@pytest.mark.parametrize("seed", range(6))
def test_random_scattered_assignments_stay_exact(seed: int) -> None:
    c = case("fanout")
    want_loss, want_grads = c.eager()
    g = c.captured.graph
    for parts in (2, 4, 6):
        d = Driver(g, interleaved_assignment(g, parts, seed=seed), c.captured.state)
        assert_close_rel(d.forward_backward(list(c.batch))["loss"], want_loss, "loss")
        got = d.named_grads()
        for name, w in want_grads.items():
            assert_close_rel(got[name], w, f"seed {seed}, {parts} parts: {name}")
