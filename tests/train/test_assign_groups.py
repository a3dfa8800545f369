"""The plan's hierarchical and two-level reductions reach the stages: the layout names a
replicated stage's machines in bandwidth groups (and whether they reduce two-level), the
Assign carries them as slots, checked."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from fusiond.errors import FusionError

pytestmark = pytest.mark.compute_only


def _one_stage(captured_tiny: Any, replicas: list[str], route: list[int]) -> tuple[Any, Any]:
    """A replicas job's spec (8 samples, micro-batches of 2) and GPT-2 tiny as one stage on
    machine "a" and `replicas`, micro-batches routed by `route`."""
    from fusiond.graph import contiguous_assignment
    from fusiond.jobs.assign import layout_job
    from fusiond.train.spec import parse_job

    _, cap = captured_tiny
    spec = parse_job('[job]\nname = "g"\nsteps = 2\n[model]\nzoo = "gpt2"\n'
                     'config = { size = "tiny" }\n[batch]\nsize = 8\nmicro_batch_size = 2\n'
                     'replicas = true\n[data]\nseq_len = 64\n')
    cut = contiguous_assignment(cap.graph, 1)
    return spec, layout_job("j", cap.graph, cap.state, dict.fromkeys(cut, "a"),
                            replicas={"a": replicas}, routes={"a": route})


def test_the_assign_carries_the_groups_as_slots_and_refuses_bad_ones(captured_tiny: Any
                                                                     ) -> None:
    from fusiond.jobs.assign import assign_messages
    from fusiond.train.remote import decode_assign

    _, cap = captured_tiny
    spec, layout = _one_stage(captured_tiny, ["b", "c", "d"], [0, 1, 2, 3])
    layout = dataclasses.replace(layout, grad_groups={"a": (("a", "c"), ("b", "d"))},
                                 grad_two_level=frozenset({"a"}))
    names = ("a", "b", "c", "d")
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses={n: ("127.0.0.1", i + 1) for i, n in enumerate(names)})
    slot = {n: s for s, n in layout.slot_nodes.items()}
    want = ((slot["a"], slot["c"]), (slot["b"], slot["d"]))
    for n in names:
        m, p = msgs[n]
        assert m.config is not None and m.config.grad_groups == {"0": want}
        assert m.config.grad_two_level == (0,)
        got = decode_assign(m, p)
        assert got.grad_groups == want and got.grad_two_level
    m, p = msgs["b"]
    assert m.config is not None
    for value, why in (({"0": ((0, 1, 2, 3),)}, "is not two or more groups"),
                       ({"0": ((0, 1), (1, 2, 3))}, "is not two or more groups"),
                       ({"0": ((0, 1), (2,))}, "exactly the stage's slots"),
                       ({"9": ((0, 1), (2, 3))}, "'9' is not a stage")):
        bad = dataclasses.replace(m, config=dataclasses.replace(m.config, grad_groups=value))
        with pytest.raises(FusionError, match=why):
            decode_assign(bad, p)
    bad = dataclasses.replace(m, config=dataclasses.replace(m.config, grad_two_level=(3,)))
    with pytest.raises(FusionError, match=r"grad_two_level.*names a stage without grad_groups"):
        decode_assign(bad, p)


def test_the_planner_sends_a_third_of_the_gradient_between_groups() -> None:
    """Six replicas in two sites of three (1 GB/s inside, 10 MB/s between): one ring crosses
    the slow link with 2 (n - 1) / n of the gradient per step's chunk; the hierarchical
    scheme with the whole gradient once between the first replicas, then the total back
    inside each site; the two-level one with a third of it between each shard's owners (three
    shards, three pairs of links at once), inside the sites the group's all-reduce: the
    planner picks the last, its time the runtime's phases."""
    from fusiond.plan import Cluster
    from fusiond.plan.model import MachineProfile
    from fusiond.plan.pipeline import gradient_sync, sync_groups

    k = 6
    site = [0, 0, 0, 1, 1, 1]
    bw = np.array([[1e9 if site[a] == site[b] else 1e7 for b in range(k)] for a in range(k)])
    c = Cluster.build([MachineProfile(f"m{i}", {"matmul": 1e12}, 1e11, 0.0, 1e12)
                       for i in range(k)], bw, np.full((k, k), 0.01))
    assert sorted(map(sorted, sync_groups(c, range(k)))) == [[0, 1, 2], [3, 4, 5]]
    sync = gradient_sync(c, list(range(k)))
    g = 1e8
    t, _, scheme = sync.time_s(g)
    assert scheme == "two-level" and sync.shards == 3
    inner = max(r.time_s(g) for r in sync.inner)
    assert sync.outer is not None
    assert t == pytest.approx(inner + sync.outer.time_s(g / 3), rel=1e-9)
    back = g / 1e9 + 0.01 / 2  # to both other members at once, on their own links
    hierarchical = inner + sync.outer.time_s(g) + back  # 1 gradient over the slow link
    assert t < 0.4 * hierarchical
    assert hierarchical < 0.65 * sync.flat.time_s(g)  # not 5/3 of one


def test_a_hierarchical_plan_puts_its_groups_in_the_layout(captured_tiny: Any) -> None:
    """GPT-2 tiny on six replicas in two sites of three, 1.25 MB/s between them: the plan
    reduces two-level, and the layout names each site's machines, first machine first."""
    from fusiond.jobs.planning import job_settings, layout_from_plan
    from fusiond.plan import Cluster, StageSpec, batch_symbol, cost_graph_from_ir
    from fusiond.plan.fence import plan_from_stages
    from fusiond.plan.model import MachineProfile

    spec, cap = captured_tiny
    spec = dataclasses.replace(spec, batch=dataclasses.replace(spec.batch, size=12,
                                                               micro_batches=6, replicas=True))
    sym = batch_symbol(cap.graph)
    cost = cost_graph_from_ir(cap.graph, {sym: spec.batch.micro_batch_size} if sym else {})
    k = 6
    site = [0, 0, 0, 1, 1, 1]
    bw = np.array([[1.25e9 if site[a] == site[b] else 1.25e6 for b in range(k)]
                   for a in range(k)])
    c = Cluster.build([MachineProfile(f"n{i}", {"matmul": 2e9, "other": 2e9}, 2e9, 1e-6, 8e9)
                       for i in range(k)], bw, np.full((k, k), 2e-3))
    plan = plan_from_stages(cost, c, job_settings(spec, cap.graph),
                            [StageSpec(0, 0, len(cost.ops), (1, 2, 3, 4, 5))])
    assert [x.scheme for x in plan.evaluation.syncs] == ["two-level"]
    layout = layout_from_plan("j", cap.graph, cap.state, plan, spec)
    assert dict(layout.grad_groups) == {"n0": (("n0", "n1", "n2"), ("n3", "n4", "n5"))}
    assert layout.grad_two_level == {"n0"}


def test_two_replicas_exchange_in_one_step_as_the_runtime_does() -> None:
    """Two holders send each other the whole gradient at once (`StageExecutor._exchange`,
    under `RING_MIN_HOLDERS`): one one-way latency per round, not a ring's two; three go by
    a ring of 2 (n - 1) steps."""
    from fusiond.plan import Cluster
    from fusiond.plan.model import MachineProfile
    from fusiond.plan.pipeline import RING_MIN_HOLDERS, gradient_sync

    assert RING_MIN_HOLDERS == 3
    k = 3
    c = Cluster.build([MachineProfile(f"m{i}", {"matmul": 1e12}, 1e11, 0.0, 1e12)
                       for i in range(k)], np.full((k, k), 1e7), np.full((k, k), 0.06))
    g = 1e6
    pair = gradient_sync(c, [0, 1])
    assert pair.time_s(g)[0] == pytest.approx(g / 1e7 + 0.03, rel=1e-9)
    three = gradient_sync(c, [0, 1, 2])
    assert three.time_s(g)[0] == pytest.approx(4 / 3 * g / 1e7 + 4 * 0.03, rel=1e-9)


def test_the_assign_carries_the_micro_batch_sizes_and_refuses_bad_ones(captured_tiny: Any
                                                                       ) -> None:
    """The plan's micro-batch sizes reach every stage's executor; sizes that do not make the
    job's micro-batches and batch are refused, naming the field, at layout and at decode."""
    from fusiond.jobs.assign import LayoutError, assign_messages
    from fusiond.train.remote import decode_assign

    _, cap = captured_tiny
    spec, layout = _one_stage(captured_tiny, ["b"], [0, 1, 0, 0])
    layout = dataclasses.replace(layout, micro_batch_sizes=(2, 2, 3, 1))
    addresses = {n: ("127.0.0.1", i + 1) for i, n in enumerate("ab")}
    msgs = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                           addresses=addresses)
    for n in "ab":
        m, p = msgs[n]
        assert m.config is not None and m.config.micro_batch_sizes == (2, 2, 3, 1)
        assert decode_assign(m, p).micro_batch_sizes == (2, 2, 3, 1)
    m, p = msgs["b"]
    assert m.config is not None
    for value in ((2, 2, 2, 1), (2, 2, 4), (4, 4, 0, 0)):
        bad = dataclasses.replace(m, config=dataclasses.replace(m.config,
                                                                micro_batch_sizes=value))
        with pytest.raises(FusionError, match="micro_batch_sizes"):
            decode_assign(bad, p)
        with pytest.raises(LayoutError, match="micro-batch sizes"):
            assign_messages(dataclasses.replace(layout, micro_batch_sizes=value), spec,
                            cap.state, term=1, plan_version=1, addresses=addresses)
