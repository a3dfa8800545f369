"""What real daemons make of shaped links: the plan `fusionctl plan` shows on a testbed, and how
fast a link estimate follows a link reshaped mid-run.

- `fusionctl plan --json` against daemons in namespaces shows every link within 15 % of its
  shaped rate, and makes the plan (stages, machines, cut) the planner makes from the topology
  file with the same machine profiles. Probes once gossiped bits per second into the planner's
  bytes per second: a 20 Mbit/s link was planned as 160 Mbit/s (and the plan used 3 stages
  where the real links favour 2).
- A link reshaped from 100 to 20 Mbit/s (and back) is seen within two probe rounds, and each
  figure's accuracy and age are in `fusionctl links`; an EWMA of 0.3 per round alone took about
  ten rounds to come within 15 %.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from deploy.testbed import list_namespaces, testbed
from deploy.testbed.topology import parse_topology
from protocol.messages import NodeProfile
from tests.netns.conftest import (
    SETTLE_PROBE_INTERVAL_S,
    needs_delay_stage,
    needs_netns,
    wait_for_settled_links,
)

pytestmark = [pytest.mark.netns, pytest.mark.multidaemon, pytest.mark.slow, needs_netns]

ROOT = Path(__file__).resolve().parents[2]

JOB = """
[job]
name = "links-e2e"
steps = 5
seed = 3
output = "{out}"
[model]
zoo = "gpt2"
config = {{ size = "tiny", n_layer = 4, n_embd = 128, n_head = 4 }}
[data]
seq_len = 32
[batch]
size = 8
micro_batches = 4
[compression]
adatopk = true
"""
"""Compute-bound on three default machines (10 GFLOP/s: no benchmark in the testbed's daemons):
a pipeline pays, its cut after the second block is robust to link noise (the same plan with
every link 0.6-1.2x its rate), and over links 8x too fast the planner takes all three hosts."""

MEMORY_GIB = {"a": 64 / 1024, "b": 64 / 1024, "c": 9.3 / 1024}
"""What each host offers to jobs. c cannot hold the first stage of the 2-stage plan (8.9 MiB:
in 1F1B it keeps two micro-batches of activations; the second stage needs 7.9 MiB), so the
order over the symmetric b-c link is not a coin toss between two equal plans."""


def _fusionctl(socket: str, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run([sys.executable, "-m", "fusionctl", "--socket", socket, *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _wait(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _host_ids(cluster: Any) -> dict[str, str]:
    """node id -> testbed host."""
    ids = {}
    for host, node in cluster.nodes.items():
        st = node.status()
        assert st is not None
        ids[st["node"]["node_id"]] = host
    return ids


def test_fusionctl_plan_sees_the_shaped_links_and_plans_as_the_topology_file(
        state_dir: Path, tmp_path: Path) -> None:
    why = needs_delay_stage()
    if why:
        pytest.skip(why)
    from deploy.testbed.fusion import start_fusiond
    from fusiond.cluster.membership import Link
    from fusiond.jobs.planning import (
        cluster_for_planner,
        plan_job,
        reserve_for_scheduler,
        scheduler_reserve_bytes,
    )
    from fusiond.jobs.submit import prepare_job, restore_job
    from fusiond.plan import plan_summary
    from fusiond.plan.fence import plan_from_stages

    job_path = tmp_path / "job.toml"
    job_path.write_text(JOB.format(out=tmp_path / "out"))
    name = f"fzl{os.getpid() % 100000}p"
    with testbed("three-hosts", name=name, state_dir=state_dir) as tb:
        cluster = start_fusiond(tb, wait_s=60, settings={
            "cluster": {"probe_interval_s": SETTLE_PROBE_INTERVAL_S}}, host_settings={
            h: {"job_memory_gib": g} for h, g in MEMORY_GIB.items()})
        host_of = _host_ids(cluster)
        want = {(x, y) for x in host_of for y in host_of if x != y}

        # every daemon holds the whole matrix (the scheduler plans), each link settled
        wait_for_settled_links(list(cluster.nodes.values()), want)
        node = cluster.nodes["a"]
        res = _fusionctl(node.socket, "plan", str(job_path), "--json")
        assert res.returncode == 0, res.stderr[-3000:]
        plan = json.loads(res.stdout)
        summary = plan["plan_summary"]
        stages = [(host_of[s["machine_id"]], s["start_op"], s["stop_op"])
                  for s in summary["stages"]]
        print(plan["plan"])

        # (a) every link the plan shows is the shaped link, within 15 %
        topo = tb.topology
        lines, bad = [], []
        for lk in summary["links"]:
            src, dst = host_of[lk["src_machine_id"]], host_of[lk["dst_machine_id"]]
            shaped = topo.link(src, dst).bandwidth_bits_per_s
            for way, planned_bytes_per_s, shaped_way in (
                    ("fwd", lk["bandwidth_fwd_bytes_per_s"], f"{src}->{dst}"),
                    ("bwd", lk["bandwidth_bwd_bytes_per_s"], f"{dst}->{src}")):
                planned_bits_per_s = planned_bytes_per_s * 8  # by hand: not the code under test
                err = planned_bits_per_s / shaped - 1
                lines.append(f"{shaped_way} ({way}): planned "
                             f"{planned_bits_per_s / 1e6:.1f} Mbit/s, shaped {shaped / 1e6:g} "
                             f"({err:+.1%})")
                if abs(err) > 0.15:
                    bad.append(lines[-1])
        print("\n".join(lines))
        assert summary["links"], f"a one-machine plan shows no link: {stages}"
        assert not bad, "\n".join(bad)

        # (b) the plan the topology file makes: the daemons' gossiped profiles, the topology's
        # links, the planner run here on the job as the daemon restored it
        view = node.api("GET", "/v1/status")["cluster"]
        members = [SimpleNamespace(node_id=m["node_id"], state=m["state"],
                                   address=tuple(m["address"]),
                                   profile=NodeProfile.from_wire(m["profile"]))
                   for m in view["members"]]
        links = {(x, y): Link(topo.link(host_of[x], host_of[y]).bandwidth_bits_per_s,
                              topo.link(host_of[x], host_of[y]).rtt_s) for x, y in want}
        from_file, _, _ = cluster_for_planner(SimpleNamespace(members=members, links=links))
        job = prepare_job(job_path)
        spec, captured = restore_job(job.toml_text, job.base, job.out_base, job.graph_bytes,
                                     job.state_bytes)
        # the scheduler (whichever daemon was elected) keeps room for its own copies
        from_file = reserve_for_scheduler(from_file, view["leader"],
                                          scheduler_reserve_bytes(captured))
        ref_plan = plan_job(spec, captured, from_file)
        ref = plan_summary(ref_plan)
        ref_stages = [(host_of[s["machine_id"]], s["start_op"], s["stop_op"])
                      for s in ref["stages"]]
        print(f"daemons: {stages}\ntopology file: {ref_stages}")
        assert len(stages) >= 2
        if stages != ref_stages:
            # Only a tie may differ: the same cut on machines the topology file's planner rates
            # as fast (a and b are alike; with c elected, its memory goes to the scheduler's
            # reserve and the order over the a-b link is a coin toss decided by probe noise).
            assert [s[1:] for s in stages] == [s[1:] for s in ref_stages], (stages, ref_stages)
            index = {host_of[m]: i for i, m in enumerate(ref_plan.arrays.cluster.ids())}
            theirs = plan_from_stages(
                ref_plan.arrays.graph, from_file, ref_plan.arrays.settings,
                [dataclasses.replace(st, machine=index[host]) for st, (host, _, _)
                 in zip(ref_plan.stages, stages, strict=True)],
                compress=spec.compression.compress)
            ratio = theirs.evaluation.iteration_s / ref_plan.evaluation.iteration_s
            print(f"daemons' plan under the topology file: {ratio:.4f} x the reference's time")
            assert ratio <= 1.01, (stages, ref_stages, ratio)
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{name}-")]


TWO_HOSTS = """
name = "links-step"
description = "2 hosts, one link reshaped while the daemons run"
hosts = ["a", "b"]
[defaults]
bandwidth = "100mbit"
rtt = "10ms"
"""

PROBE_INTERVAL_S = 2.0


def test_a_reshaped_link_is_seen_within_two_probe_rounds(state_dir: Path) -> None:
    why = needs_delay_stage()
    if why:
        pytest.skip(why)
    from deploy.testbed.fusion import start_fusiond

    topo = parse_topology(tomllib.loads(TWO_HOSTS), "links-step", TWO_HOSTS)
    name = f"fzl{os.getpid() % 100000}s"
    with testbed(topo, name=name, state_dir=state_dir) as tb:
        cluster = start_fusiond(tb, wait_s=60, settings={
            "cluster": {"probe_interval_s": PROBE_INTERVAL_S}})
        host_of = _host_ids(cluster)
        nid = {h: n for n, h in host_of.items()}
        node = cluster.nodes["a"]

        def link() -> dict[str, Any] | None:
            got: dict[str, Any] | None = node.api("GET", "/v1/links")["links"].get(
                nid["a"], {}).get(nid["b"])
            return got

        def rounds_until(rate_bits_per_s: float, since: float, limit_s: float
                         ) -> tuple[int, list[str]]:
            """Probe rounds of a -> b (distinct measurement times after `since`) until the
            estimate is within 15 % of `rate_bits_per_s`."""
            seen: list[float] = []
            trail: list[str] = []
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                lk = link()
                at = (lk or {}).get("measured_at") or 0.0
                if lk is not None and at > since and at not in seen:
                    seen.append(at)
                    got = lk["bandwidth_bits_per_s"]
                    trail.append(f"round {len(seen)}: {got / 1e6:.1f} Mbit/s "
                                 f"±{lk['bandwidth_spread_ratio']:.1%}, "
                                 f"{at - since:.1f} s after the change")
                    if abs(got / rate_bits_per_s - 1) <= 0.15:
                        return len(seen), trail
                time.sleep(0.1)
            raise AssertionError(f"not within 15 % of {rate_bits_per_s / 1e6:g} Mbit/s after "
                                 f"{limit_s:g} s: " + "; ".join(trail))

        # settled at 100 Mbit/s, then one more round on the unchanged link
        rounds_until(100e6, 0.0, 60)
        steady = link()
        assert steady is not None
        rounds_until(100e6, steady["measured_at"], 30)
        report = []
        for rate in (20e6, 100e6):
            since = time.time()
            tb.reshape("a", "b", int(rate))
            rounds, trail = rounds_until(rate, since, 60)
            report.append(f"{rate / 1e6:g} Mbit/s: seen after {rounds} round(s): "
                          + "; ".join(trail))
            assert rounds <= 2, report[-1]
        print("\n".join(report))

        # accuracy and age, as `fusionctl links` shows them
        res = _fusionctl(node.socket, "links", "--json", timeout=30)
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)["links"][nid["a"]][nid["b"]]
        assert 0 <= data["bandwidth_spread_ratio"] < 0.5
        assert 0 <= data["age_s"] < 30 and data["measured_at"] > 0
        res = _fusionctl(node.socket, "links", timeout=30)
        assert res.returncode == 0, res.stderr
        assert "Mbit/s ±" in res.stdout and "age of the measurement" in res.stdout
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{name}-")]
