"""Top-k edges: density 1.0 is exact; below, backward equals autograd through y = mask * x."""

from __future__ import annotations

import torch

from fusiond.graph import SINK, SOURCE, Driver, contiguous_assignment, partition
from fusiond.graph.wire import to_numpy
from protocol import tensors as wire
from tests.graph.models import assert_close_rel, case


def _float_cut_values(d: Driver) -> list[str]:
    return sorted(
        {e.value for p in d.partitions for e in p.outputs if e.dst != SINK and e.meta.is_float}
    )


def test_density_one_equals_uncompressed() -> None:
    c = case("gpt2")
    g, state = c.captured.graph, c.captured.state
    asg = contiguous_assignment(g, 3)
    plain = Driver(g, asg, state)
    values = _float_cut_values(plain)
    assert values
    topk = Driver(g, asg, state, topk={v: 1.0 for v in values}, value_dtype="fp32")
    a = plain.forward_backward(list(c.batch))
    b = topk.forward_backward(list(c.batch))
    assert torch.equal(a["loss"], b["loss"])
    ga, gb = plain.named_grads(), topk.named_grads()
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k
    assert topk.traffic and all(t.backward_bytes > 0 for t in topk.traffic.values())


def test_lower_density_backward_matches_explicit_mask() -> None:
    c = case("fanout")
    g, state = c.captured.graph, c.captured.state
    asg = contiguous_assignment(g, 2)
    density = 0.3
    d = Driver(g, asg, state)
    values = _float_cut_values(d)
    d = Driver(g, asg, state, topk={v: density for v in values}, value_dtype="fp32")
    got_loss = d.forward_backward(list(c.batch))["loss"]
    got = d.named_grads()
    for t in d.traffic.values():
        assert t.forward_bytes < t.dense_bytes

    # Reference: the same two partitions in one autograd graph, each cut value multiplied by
    # the explicit mask of its top-k indices.
    p0, p1 = partition(g, asg)
    m0, m1 = p0.build(state), p1.build(state)
    feed = dict(zip(("input", "targets"), c.batch, strict=True))
    out0 = m0.run({e.value: feed[e.value] for e in p0.inputs})
    into1: dict[str, torch.Tensor] = {}
    for e in p1.inputs:
        if e.src == SOURCE:
            into1[e.value] = feed[e.value]
            continue
        x = out0[e.value]
        if e.value in values:
            enc = wire.encode(to_numpy(x), "topk", density=density, value_dtype="fp32")
            assert enc.indices is not None
            mask = torch.zeros(x.numel(), dtype=x.dtype)
            mask[torch.from_numpy(enc.indices)] = 1.0
            x = x * mask.view_as(x)
        into1[e.value] = x
    loss = m1.run(into1)["loss"]
    loss.backward()
    assert_close_rel(got_loss, loss.detach(), "loss")
    want = {n: p.grad for m in (m0, m1) for n, p in m.named_parameters() if p.grad is not None}
    assert want.keys() == got.keys()
    for n, w in want.items():
        assert_close_rel(got[n], w, f"grad {n}")
