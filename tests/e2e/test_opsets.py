"""Op sets on real daemons (separate fusiond processes, loopback, mutual TLS), one torch: node2
runs with `jobs.disabled_ops = ["aten.linear.default"]`, as an operator would turn off an op
broken on that machine (tests/e2e/test_mixed_torch.py adds a second torch).

- every member gossips its op set (digest, size, what is disabled) and `fusionctl status`
  shows it;
- the scheduler fetches node2's op list (its digest differs) and plans no stage that uses
  linear on node2; the planned job trains;
- a `--stages 3` cut, which gives node2 a stage with linear, is refused at submit naming the
  op, the stage and node2;
- with node2 the only live member, a job using linear is refused at submit naming the op and
  why node2 lacks it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusiond.jobs.submit import prepare_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other, start_cluster
from tests.e2e.test_jobs import GPT2, _write

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(300)]

LINEAR = "aten.linear.default"


@pytest.fixture(scope="module")
def cluster_lacking() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="fzo"))
    c = start_cluster(root, node_settings={2: {"jobs": {"disabled_ops": [LINEAR]}}})
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _job(tmp_path: Path, steps: int = 3) -> Path:
    return _write(tmp_path, GPT2.replace("steps = 20", f"steps = {steps}"))


def test_status_shows_each_members_op_set(cluster_lacking: Cluster,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    c = cluster_lacking
    rc, st, err = ctl(c.nodes[0], "status", "--json", capsys=capsys)
    assert rc == 0, err
    rows = {r["node_id"]: r for r in st["software"]["nodes"]}
    ids = [c.node_id(n) for n in c.nodes]
    assert set(rows) == set(ids) and st["software"]["warning"] is None  # one torch
    lacking, full = rows[ids[2]], rows[ids[0]]
    assert lacking["ops_disabled"] == [LINEAR] and full["ops_disabled"] == []
    assert lacking["ops_count"] == full["ops_count"] - 1
    assert lacking["ops_digest"] != full["ops_digest"] == rows[ids[1]]["ops_digest"]


def test_the_planner_keeps_linear_off_the_node_that_disabled_it(
        cluster_lacking: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = cluster_lacking
    node2 = c.node_id(c.nodes[2])
    job = _job(tmp_path)
    rc, res, err = ctl(c.nodes[0], "plan", str(job), "--json", capsys=capsys)
    assert rc == 0, err + c.explain("plan")
    graph = prepare_job(job).captured.graph  # what fusionctl captured (same torch, same ids)
    order = [n.op for n in graph.nodes]
    stages = res["plan_summary"]["stages"]
    assert {s["machine_id"] for s in stages} <= {c.node_id(n) for n in c.nodes}
    for s in stages:
        ops = set(order[s["start_op"]:s["stop_op"]])
        assert s["machine_id"] != node2 or LINEAR not in ops, (s, res["plan"])
    assert f"note: {node2} cannot run {LINEAR}" in res["plan"]
    # the planned job trains, and its log says what the planner knew
    lead, _ = leader_and_other(c)
    rc, res, err = ctl(lead, "submit", str(job), "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err + c.explain("planned job")
    lines = lead.api("GET", f"/v1/jobs/{res['job_id']}/logs")["lines"]
    assert any(f"{node2} disables {LINEAR}" in x for x in lines), lines
    losses = [s["loss"] for s in json.loads((tmp_path / "out" / "metrics.json").read_text())
              ["steps"]]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses)


def test_a_stages_cut_onto_the_node_is_refused_naming_the_op(
        cluster_lacking: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = cluster_lacking
    node2 = c.node_id(c.nodes[2])
    before = c.nodes[0].api("GET", "/v1/jobs")["jobs"]
    rc, _, err = ctl(c.nodes[0], "submit", str(_job(tmp_path)), "--stages", "3", capsys=capsys)
    assert rc == 1, err
    assert "--stages 3: stage " in err and f"goes to {node2}, which cannot run op '{LINEAR}' " \
        "(disabled by its jobs.disabled_ops)" in err, err
    assert "without --stages" in err
    assert c.nodes[0].api("GET", "/v1/jobs")["jobs"] == before  # nothing started


def test_an_op_no_live_machine_runs_is_refused_at_submit(
        cluster_lacking: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Last in this module: it stops node0 and node1."""
    c = cluster_lacking
    node2 = c.nodes[2]
    me = c.node_id(node2)
    for n in c.nodes[:2]:
        n.stop()

    def alone() -> tuple[bool, str]:
        st = node2.status(2.0) or {}
        states = {m["node_id"]: m["state"] for m in (st.get("cluster") or {}).get("members", [])}
        others = [s for n, s in states.items() if n != me]
        return bool(others) and all(s == "dead" for s in others), str(states)

    c.wait_for(alone, 30.0, "node0 and node1 declared dead")
    before = node2.api("GET", "/v1/jobs")["jobs"]  # an earlier test's job, if it led one
    rc, _, err = ctl(node2, "submit", str(_job(tmp_path)), capsys=capsys)
    assert rc == 1, err
    assert f"op '{LINEAR}' runs on no live machine ({me} (disabled by its " \
        "jobs.disabled_ops))" in err, err
    assert "captured with torch" in err
    assert node2.api("GET", "/v1/jobs")["jobs"] == before  # nothing started
