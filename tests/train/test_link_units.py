"""Link rates from the cluster view to the planner: measured and gossiped in bits per second,
planned in bytes per second, converted once (`cluster_for_planner`). A 20 Mbit/s link once
reached the planner as 20e6 bytes/s (8x too fast) and `fusionctl plan` showed 160 Mbit/s."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fusiond.cluster.membership import Link
from fusiond.jobs.planning import DEFAULT_LINK_BYTES_PER_S, cluster_for_planner, link_bytes_per_s
from fusiond.plan import (
    CostGraph,
    JobSettings,
    OpCost,
    StageSpec,
    TensorEdge,
    plan_from_stages,
    plan_summary,
    render_plan,
)
from fusiond.units import bits_per_s_from_bytes_per_s, bytes_per_s_from_bits_per_s
from protocol.messages import NodeProfile

pytestmark = pytest.mark.compute_only  # in one process: no daemon, no socket, no clock


def _view(links: dict[tuple[str, str], Link]) -> SimpleNamespace:
    members = [SimpleNamespace(node_id=f"m{i}", state="alive", address=("127.0.0.1", 7420 + i),
                               profile=NodeProfile(gflops=100.0, memory_bytes=10**10))
               for i in range(3)]
    return SimpleNamespace(members=members, links=links)


def test_the_conversion_is_exact_both_ways() -> None:
    assert bytes_per_s_from_bits_per_s(20e6) == 2.5e6
    assert bits_per_s_from_bytes_per_s(2.5e6) == 20e6
    assert DEFAULT_LINK_BYTES_PER_S == 125e6  # an unmeasured link counts as 1 Gbit/s
    assert link_bytes_per_s(Link(8e6, 0.01)) == 1e6
    assert link_bytes_per_s(Link(0.0, 0.01)) is None  # RTT measured, no bandwidth yet
    assert link_bytes_per_s(Link(float("nan"), 0.01)) is None


def test_a_20_mbit_link_reaches_the_planner_as_2_5_megabytes_per_second() -> None:
    view = _view({("m0", "m1"): Link(20e6, 0.03, 0.02, 1.7e9),
                  ("m2", "m1"): Link(100e6, 0.004),
                  ("m0", "m2"): Link(0.0, 0.01)})  # probed RTT only
    cluster, addresses, _ = cluster_for_planner(view)
    assert cluster.ids() == ["m0", "m1", "m2"] and addresses["m2"] == ("127.0.0.1", 7422)
    bw = cluster.bandwidth_bytes_per_s
    assert bw[0, 1] == bw[1, 0] == 2.5e6  # either end's measurement serves both directions
    assert bw[1, 2] == bw[2, 1] == 12.5e6
    assert bw[0, 2] == DEFAULT_LINK_BYTES_PER_S
    assert cluster.rtt_s[0, 1] == 0.03 and cluster.rtt_s[0, 2] == 0.01


def test_the_plan_shows_the_link_at_its_measured_rate() -> None:
    """What `fusionctl plan` prints for a 20 Mbit/s link is 20 Mbit/s, and its JSON summary
    carries the planner's 2.5e6 bytes/s, with the stages' machines and op ranges."""
    view = _view({("m0", "m1"): Link(20e6, 0.03), ("m1", "m2"): Link(20e6, 0.03),
                  ("m0", "m2"): Link(20e6, 0.03)})
    cluster, _, _ = cluster_for_planner(view)
    ops = tuple(OpCost(f"op{i}", fwd_flops=1e9, bwd_flops=2e9) for i in range(4))
    edges = (TensorEdge("a", 0, (1,), 1e6, 1e5), TensorEdge("b", 1, (2,), 1e6, 1e5),
             TensorEdge("c", 2, (3,), 1e6, 1e5))
    plan = plan_from_stages(CostGraph(ops, edges), cluster, JobSettings(num_micro_batches=4),
                            [StageSpec(0, 0, 2), StageSpec(1, 2, 4)])
    table = render_plan(plan)
    row = next(line for line in table.splitlines() if line.startswith("0:m0 -> 1:m1"))
    assert float(row.split()[3]) == pytest.approx(20.0), table
    summary = plan_summary(plan)
    json.dumps(summary)  # plain data
    assert [(s["machine_id"], s["start_op"], s["stop_op"]) for s in summary["stages"]] == [
        ("m0", 0, 2), ("m1", 2, 4)]
    (link,) = [lk for lk in summary["links"] if lk["src_stage"] == 0]
    assert link["src_machine_id"] == "m0" and link["dst_machine_id"] == "m1"
    assert link["bandwidth_fwd_bytes_per_s"] == link["bandwidth_bwd_bytes_per_s"] == 2.5e6
    assert link["rtt_s"] == 0.03 and summary["machines"] == ["m0", "m1", "m2"]
