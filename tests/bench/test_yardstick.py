"""Issue 14's harness parts: one held-out evaluator of dense weights for every system, and the
verdict (a missing or failed baseline fails the bench; out of memory and out of regime are
outcomes of their own; medians and min-max over runs; the strongest baseline named)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from bench.wan_common import (
    FAILED,
    OK,
    OUT_OF_MEMORY,
    OUT_OF_REGIME,
    HeldoutPoint,
    RunResult,
    at_fixed_points,
    loss_at,
    time_to_heldout_target,
    verdict,
)
from bench.wan_eval import (
    SnapshotClock,
    evaluate_snapshots,
    heldout_batch,
    heldout_loss,
    save_snapshot,
    split_tokens,
)

V = 4


class Bigram(nn.Module):
    """logits(next | current) = weight[current]: a model whose loss is known in closed form."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(V, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table(x)


def lm_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


P = np.array([[0.7, 0.1, 0.1, 0.1],
              [0.25, 0.25, 0.25, 0.25],
              [0.05, 0.05, 0.8, 0.1],
              [0.4, 0.3, 0.2, 0.1]])


def known_model() -> Bigram:
    m = Bigram()
    with torch.no_grad():
        m.table.weight.copy_(torch.from_numpy(np.log(P)).float())
    return m


def test_split_is_disjoint_deterministic_and_sized() -> None:
    tokens = np.arange(100 * 64)  # every token unique: overlap would show
    train, held = split_tokens(tokens, seed=3, train_tokens=60 * 64, heldout_tokens=10 * 64,
                               chunk_tokens=64)
    assert train.size == 60 * 64 and held.size == 10 * 64
    assert not set(train.tolist()) & set(held.tolist())
    again = split_tokens(tokens, seed=3, train_tokens=60 * 64, heldout_tokens=10 * 64,
                         chunk_tokens=64)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], held)
    other = split_tokens(tokens, seed=4, train_tokens=60 * 64, heldout_tokens=10 * 64,
                         chunk_tokens=64)
    assert not np.array_equal(other[1], held)
    with pytest.raises(ValueError, match="cannot give"):
        split_tokens(tokens, seed=3, train_tokens=95 * 64, heldout_tokens=10 * 64,
                     chunk_tokens=64)


def test_heldout_loss_of_known_weights_is_the_closed_form() -> None:
    rng = np.random.default_rng(0)
    held = rng.integers(0, V, size=2000)
    batch = heldout_batch(held, seq_len=16, count=40)
    # the windows are the held-out tokens themselves, non-overlapping, evenly spaced
    stride = held.size // 40
    for i in (0, 17, 39):
        assert batch.inputs[i].tolist() == held[i * stride:i * stride + 16].tolist()
        assert batch.targets[i].tolist() == held[i * stride + 1:i * stride + 17].tolist()
    x, y = batch.inputs.numpy(), batch.targets.numpy()
    expected = float(np.mean(-np.log(P[x, y])))
    m = known_model()
    m.train()
    got = heldout_loss(m, batch, lm_ce, eval_batch=7)  # batches of 7 weigh windows equally
    assert got == pytest.approx(expected, rel=1e-5)
    assert m.training  # mode restored
    uniform = Bigram()
    with torch.no_grad():
        uniform.table.weight.zero_()
    assert heldout_loss(uniform, batch, lm_ce) == pytest.approx(math.log(V), rel=1e-6)


def test_snapshots_are_evaluated_on_their_dense_weights(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    batch = heldout_batch(rng.integers(0, V, size=1000), seq_len=8, count=20)
    dense = known_model().state_dict()
    zero = {k: torch.zeros_like(v) for k, v in dense.items()}
    save_snapshot(tmp_path, 1, 2.0, 10, dense)
    save_snapshot(tmp_path, 0, 1.0, 4, zero)
    curve = evaluate_snapshots(tmp_path, Bigram, batch, lm_ce)
    assert [(p.t_s, p.step) for p in curve] == [(1.0, 4), (2.0, 10)]
    assert curve[0].loss == pytest.approx(math.log(V), rel=1e-6)
    assert curve[1].loss == pytest.approx(heldout_loss(known_model(), batch, lm_ce))
    # a state missing an entry is refused, not evaluated half-loaded
    save_snapshot(tmp_path, 2, 3.0, 12, {})
    with pytest.raises(RuntimeError, match="Missing key"):
        evaluate_snapshots(tmp_path, Bigram, batch, lm_ce)


def test_snapshot_clock_fires_once_per_interval() -> None:
    c = SnapshotClock(1.0)
    got = [t for t in (0.5, 1.0, 1.5, 3.2, 3.9, 4.0, 4.1) if c.due(t)]
    assert got == [1.0, 3.2, 4.0]
    with pytest.raises(ValueError):
        SnapshotClock(0.0)


def test_curve_at_fixed_points_and_time_to_target() -> None:
    curve = [HeldoutPoint(1.2, 3, 4.0), HeldoutPoint(2.4, 7, 3.0), HeldoutPoint(3.1, 9, 2.5)]
    assert loss_at(curve, 1.0) is None
    assert loss_at(curve, 2.4) == 3.0
    assert at_fixed_points(curve, 1.0, 4.0) == [(1.0, None), (2.0, 4.0), (3.0, 3.0),
                                                 (4.0, 2.5)]
    assert time_to_heldout_target(curve, 3.0) == 2.4
    # between snapshots: interpolated from the one before (4.0 at 1.2 s) to the first below
    assert time_to_heldout_target(curve, 3.5) == pytest.approx(1.8)
    assert time_to_heldout_target(curve[1:], 3.5) == 2.4  # none before: the snapshot's time
    assert time_to_heldout_target(curve, 1.0) is None
    assert time_to_heldout_target([HeldoutPoint(1.0, 1, math.nan)], 3.0) is None


LABELS = {"opfence": "(2)", "adatopk": "(3)", "single": "(0)", "ddp_fp16": "(4a)",
          "ddp_powersgd": "(4b)", "hivemind": "(5)"}
EXPECTED = ("opfence", "adatopk", "single", "ddp_fp16", "ddp_powersgd")


def ok(system: str, t: float | None, final: float = 2.0) -> RunResult:
    return RunResult(system, OK, t, final)


def full(**times: list[float | None]) -> list[RunResult]:
    return [ok(s, t) for s, ts in times.items() for t in ts]


def test_a_missing_baseline_fails_the_bench() -> None:
    runs = full(opfence=[10.0], adatopk=[9.0], single=[20.0], ddp_fp16=[30.0])
    v = verdict("four-groups", "fits", runs, EXPECTED)
    assert not v.ok
    assert any(p.startswith("ddp_powersgd: missing") for p in v.problems), v.problems
    assert v.line(LABELS).startswith("FAIL")


def test_a_failed_baseline_fails_the_bench() -> None:
    runs = full(opfence=[10.0], adatopk=[9.0], single=[20.0], ddp_fp16=[30.0],
                ddp_powersgd=[25.0])
    runs.append(RunResult("ddp_powersgd", FAILED, reason="gloo timeout"))
    v = verdict("t", "fits", runs, EXPECTED)
    assert not v.ok and "gloo timeout" in " ".join(v.problems)
    # nor can a bench with no baseline at all pass
    assert not verdict("t", "fits", full(opfence=[1.0]), ("opfence",)).ok


def test_strongest_baseline_is_named_with_median_and_range() -> None:
    runs = full(opfence=[40.0, 44.0, 41.0], adatopk=[50.0, 52.0, None], single=[30.0, 12.0, 10.0],
                ddp_fp16=[35.0, 36.0, 37.0], ddp_powersgd=[20.0, 21.0, 22.0])
    v = verdict("four-groups", "fits", runs, EXPECTED)
    assert v.ok
    assert v.baseline is not None and v.baseline.system == "single"  # median 12 < 21
    assert v.fusion is not None and v.fusion.system == "opfence"  # (3) median 52
    assert v.fusion_wins is False
    line = v.line(LABELS)
    assert "fusion best (2): time to target 41.0 s [40.0 s .. 44.0 s] (3 runs)" in line
    assert "strongest baseline (0): time to target 12.0 s [10.0 s .. 30.0 s] (3 runs)" in line
    assert line.endswith("fusion loses")
    s3 = v.summaries["adatopk"].time_to_target
    assert s3 is not None and s3.median == 52.0 and math.isinf(s3.hi)  # one run never got there


def test_out_of_memory_and_out_of_regime_are_distinct_outcomes() -> None:
    runs = full(opfence=[10.0], adatopk=[12.0])
    runs += [RunResult("single", OUT_OF_MEMORY, reason="host a1 killed at 600 MiB"),
             RunResult("ddp_fp16", OUT_OF_MEMORY, reason="host a1 killed at 600 MiB"),
             RunResult("ddp_powersgd", OUT_OF_MEMORY, reason="host a1 killed at 600 MiB")]
    v = verdict("t", "does not fit", runs, EXPECTED)
    assert v.ok and v.baseline is None
    assert v.summaries["single"].outcome == OUT_OF_MEMORY
    assert v.fusion_wins is True  # fusion trained where no baseline could
    assert "out of memory" in v.line(LABELS)
    # an out-of-regime baseline is no fusion win
    runs2 = full(opfence=[10.0], adatopk=[12.0])
    runs2.append(RunResult("hivemind", OUT_OF_REGIME, reason="needs thousands of samples"))
    v2 = verdict("t", "fits", runs2, ("opfence", "adatopk", "hivemind"))
    assert v2.ok and v2.fusion_wins is None
    assert v2.summaries["hivemind"].outcome == OUT_OF_REGIME
    assert "no baseline trained" in v2.line(LABELS)
    # a run that trained but missed the target is neither
    v3 = verdict("t", "fits", full(opfence=[None], adatopk=[None], single=[None],
                                   ddp_fp16=[5.0], ddp_powersgd=[None]), EXPECTED)
    assert v3.summaries["single"].outcome == OK
    assert v3.summaries["single"].time_to_target is not None
    assert "not reached" in v3.summaries["single"].time_to_target.text()
    assert v3.baseline is not None and v3.baseline.system == "ddp_fp16"
    assert v3.fusion_wins is False
    # fusion out of memory while a baseline trained: a loss, not a failure of the bench
    runs4 = [RunResult("opfence", OUT_OF_MEMORY, reason="x"),
             RunResult("adatopk", OUT_OF_MEMORY, reason="x"), ok("single", 3.0),
             ok("ddp_fp16", 4.0), ok("ddp_powersgd", 5.0)]
    v4 = verdict("t", "fits", runs4, EXPECTED)
    assert v4.ok and v4.fusion_wins is False


def test_unknown_outcome_is_refused() -> None:
    with pytest.raises(ValueError, match="outcome"):
        RunResult("single", "did not reach the target")


def test_the_torch_pipeline_runs_on_the_stage_count_and_hosts_its_model_favours() -> None:
    """(1)'s hosts: equal blocks per stage, the order with the least predicted 1F1B step:
    fast hosts on a fast link, a stage count that stops where a hop costs more than the
    compute it spreads."""
    from bench.wan import pipeline_hosts
    from bench.wan_ddp import pipeline_bounds
    from deploy.testbed.topology import load_topology

    assert pipeline_bounds(6, 4) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert pipeline_bounds(6, 1) == [(0, 6)]
    with pytest.raises(SystemExit):
        pipeline_bounds(2, 3)
    topo = load_topology("mixed-slow")  # f1, f2, s1 (0.5), s2 (0.25) on a LAN; r1 remote
    # compute-heavy: spread over the LAN's fast hosts, never over the 20 Mbit/s uplink
    hosts = pipeline_hosts(topo, 6, 0.05, 16, 4, 64 * 256 * 4.0)
    assert "r1" not in hosts and len(hosts) >= 2 and {"f1", "f2"} <= set(hosts), hosts
    # never more stages than micro-batches (torch's 1F1B refuses them): 2 micro-batches
    assert len(pipeline_hosts(load_topology("two-groups"), 6, 0.05, 16, 2,
                              64 * 256 * 4.0)) == 2
    # activations too big for any link to pay: two stages at most, on the fastest pair
    assert pipeline_hosts(topo, 6, 1e-4, 16, 4, 1e9) in (["f1", "f2"], ["f2", "f1"])


def test_swarm_is_fusions_pipeline_with_int8_cuts_where_the_planner_puts_them() -> None:
    from bench.wan import FUSION_RUNS, NOT_YET, expected_systems
    from bench.wan_common import Workload
    from bench.wan_fusion import job_toml, layout_for, make_plan
    from fusiond.plan.topology import cluster_from_topology
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import parse_job

    assert "swarm" not in NOT_YET and "swarm" in FUSION_RUNS
    assert all("swarm" in expected_systems(r) for r in ("fits", "nofit"))
    wl = Workload(size="tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16, batch=8,
                  micro_batches=2)
    modes = {m: parse_job(job_toml(wl, m)).compression for m in ("swarm", "opfence", "adatopk")}
    assert modes["swarm"].int8 and not modes["swarm"].adatopk
    assert not modes["opfence"].int8 and not modes["opfence"].adatopk
    assert not modes["adatopk"].int8 and modes["adatopk"].adatopk
    spec = parse_job(job_toml(wl, "swarm"))
    _, captured = capture_job(spec)
    kind = {"flops": {"matmul": 1e9, "conv": 1e9, "other": 2e8}, "mem_bw": 5e9,
            "op_overhead_s": 1e-5, "memory_gib": 4}
    cluster, _ = cluster_from_topology({
        "name": "t", "kinds": {"cpu": kind},
        "groups": [{"name": "g", "kind_counts": {"cpu": 3}, "mbit": 1000}],
        "inter_mbit": [[0]]})
    plan = make_plan(spec, captured, cluster)
    assert plan.method == "op-fence+int8" and not plan.densities
    node_of = {m: f"node-{m}" for m in cluster.ids()}
    layout = layout_for(plan, spec, captured, node_of)
    # the daemon's own layout of the plan, on the hosts' node ids
    assert set(layout.stage_nodes.values()) <= set(node_of.values())
    routes = layout.edges()
    assert len(plan.stages) >= 2 and routes
    assert layout.int8_edges and not layout.densities
    assert {r.edge for r in routes if r.encoding == "int8"} == set(layout.int8_edges)
    assert plan.evaluation.links[0].fwd_bytes < 0.3 * plan.evaluation.links[0].dense_fwd_bytes


def test_the_plots_redraw_from_the_committed_traces(tmp_path: Path) -> None:
    import json

    from bench.wan_plot import redraw

    doc = {"topology": "four-groups", "regime": "fits", "target_loss": 2.6, "runs": [
        {"system": "single", "heldout": [[5.0, 3, 3.5], [10.0, 7, 3.0]]},
        {"system": "opfence", "heldout": [[5.0, 4, 3.4], [10.0, 9, 2.9]]},
        {"system": "hivemind", "heldout": []}]}
    (tmp_path / "four-groups-fits.json").write_text(json.dumps(doc))
    out = redraw(tmp_path, tmp_path)
    assert out == [tmp_path / "benchmarks-four-groups-fits.png"]
    assert out[0].stat().st_size > 1000


def test_fsdp_shards_are_reassembled_into_the_dense_model(tmp_path: Path) -> None:
    """Each FSDP rank writes the dim-0 chunks it holds (torch.chunk, as fully_shard splits);
    the evaluator puts the steps at its wall-clock points and the last back together."""
    import argparse

    import safetensors.torch

    from bench.wan import make_evaluator, prepare_data
    from bench.wan_common import Trace, Workload
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import parse_job

    wl = Workload(size="tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    args = argparse.Namespace(seed=0, train_mb=0.25, heldout_kb=16.0, seq=16, eval_windows=8)
    data = prepare_data(args, tmp_path / "corpus")
    spec = parse_job(wl.job_toml(adatopk=False))
    models = [build_model(spec.model, seed=s) for s in (1, 2, 3)]
    snap = tmp_path / "snap"
    snap.mkdir()
    world = 3
    for step, m in enumerate(models):
        for r in range(world):
            part = {k: (torch.chunk(v, world)[r] if v.dim() and r < len(torch.chunk(v, world))
                        else v[:0] if v.dim() else v).contiguous().clone()
                    for k, v in m.state_dict().items()}
            safetensors.torch.save_file(
                part, str(snap / f"fsdp-rank{r:03d}-step{step:07d}.safetensors"))
    trace = Trace("fsdp", [(0.5, 0, 5.0, 1), (1.2, 1, 4.0, 2), (1.4, 2, 3.9, 3)],
                  {"world": world})
    evaluator = make_evaluator(wl, data, 1.0, tmp_path / "captured")
    curve = evaluator("fsdp", snap, trace)
    # the initial weights at t = 0, then the step at t = 1 s and the last
    assert [(p.t_s, p.step) for p in curve] == [(0.0, -1), (1.2, 1), (1.4, 2)]
    from bench.wan_eval import heldout_loss
    lossf = loss_fn(spec.loss)
    initial = build_model(spec.model, seed=spec.seed)
    assert curve[0].loss == pytest.approx(heldout_loss(initial, data.heldout, lossf))
    assert curve[1].loss == pytest.approx(heldout_loss(models[1], data.heldout, lossf))
    assert curve[2].loss == pytest.approx(heldout_loss(models[2], data.heldout, lossf))
    # a run that finished no step in its budget has the initial point alone; a run that left
    # no trace has none
    empty = tmp_path / "empty"
    assert evaluator("opfence", empty, Trace("opfence", [], {})) == curve[:1]
    assert make_evaluator(wl, data, 1.0, tmp_path / "captured")("opfence", empty,
                                         Trace("opfence", [], {}, "no trace")) == []
    assert not list(snap.glob("fsdp-rank*"))  # the shards are gone once assembled


def test_the_lead_reads_the_capture_the_submitting_side_wrote(tmp_path: Path) -> None:
    """bench/wan.py captures once, as `fusionctl submit` does, outside every host's limit; a
    fusion lead restores the same IR and weights from the files (no torch.export in it)."""
    from bench.wan_common import Workload
    from bench.wan_fusion import load_captured, save_captured
    from fusiond.train.programs import capture_job
    from fusiond.train.spec import parse_job
    from protocol import ir

    wl = Workload(size="tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    spec = parse_job(wl.job_toml(adatopk=False))
    assert save_captured(spec, tmp_path / "cap") > 0
    got = load_captured(tmp_path / "cap")
    _, want = capture_job(spec)
    assert ir.dumps(got.graph) == ir.dumps(want.graph)
    assert got.state.keys() == want.state.keys()
    assert all(torch.equal(got.state[k], want.state[k]) for k in want.state)


def test_the_torch_pipeline_baseline_trains_the_single_process_model(tmp_path: Path) -> None:
    """(1) is torch.distributed.pipelining itself (2 ranks over gloo on loopback, equal blocks,
    1F1B, the tied embedding's gradient all-reduced between the first and last stage): its
    merged stages after the agreed last step are the weights of eager training on the same
    global batches (a missing tied all-reduce or a wrong gradient scale breaks this)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    import safetensors.torch

    from bench.wan_common import Workload
    from fusiond.train.data import make_source
    from fusiond.train.local import ReferenceTrainer
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import parse_job

    wl = Workload(size="tiny", n_layer=3, n_embd=32, n_head=2, seq_len=16, batch=8,
                  micro_batches=4)
    (tmp_path / "wl.json").write_text(json.dumps(wl.to_dict()))
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen(
        [sys.executable, str(repo / "bench" / "wan_ddp.py"), "--pipeline", f"--rank={r}",
         "--world=2", f"--master=127.0.0.1:{port}", "--budget=0",
         f"--workload={tmp_path / 'wl.json'}", f"--out={tmp_path / 'trace.json'}",
         f"--snapshot-dir={tmp_path / 'snap'}", f"--stop-dir={tmp_path}"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-2000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert [e[1] for e in trace["events"]] == [0, 1]  # budget 0: rank 0 stops after step 1
    merged: dict[str, torch.Tensor] = {}
    for r in (0, 1):
        merged |= safetensors.torch.load_file(
            str(tmp_path / "snap" / f"pipe-rank{r:03d}-step0000001.safetensors"))
    spec = parse_job(wl.job_toml(adatopk=False))
    model = build_model(spec.model, seed=spec.seed)
    ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                     data=make_source(spec.data, spec.seed), batch_size=wl.batch,
                     micro_batches=wl.micro_batches, total_steps=2).train(0, 2)
    want = model.state_dict()
    assert set(merged) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_replicated_fusion_runs_snapshots_are_its_stages_first_replicas(
        tmp_path: Path) -> None:
    """With replicas only each stage's first replica writes its checkpoint (the others hold
    the same weights; the end of the job checks that they do): the evaluator assembles a
    step from the stages' first replicas and ignores a replica slot's file."""
    import argparse

    from bench.wan import make_evaluator, prepare_data
    from bench.wan_common import Trace, Workload
    from bench.wan_fusion import load_captured, save_captured, snapshot_name
    from fusiond.graph.capture import state_to_bytes
    from fusiond.train.spec import parse_job

    wl = Workload(size="tiny", n_layer=2, n_embd=32, n_head=2, seq_len=16)
    args = argparse.Namespace(seed=0, train_mb=0.25, heldout_kb=16.0, seq=16, eval_windows=8)
    data = prepare_data(args, tmp_path / "corpus")
    spec = parse_job(wl.job_toml(adatopk=False))
    save_captured(spec, tmp_path / "cap")

    cap = load_captured(tmp_path / "cap")
    snap = tmp_path / "snap"
    snap.mkdir()
    blob = state_to_bytes(cap.state)
    (snap / snapshot_name(0, 0)).write_bytes(blob)  # one stage, its replica in slot 1
    (snap / snapshot_name(0, 1)).write_bytes(blob)
    # a replica slot's file (an older runtime's) is not needed, and not read
    (snap / snapshot_name(1, 1)).write_bytes(b"not a checkpoint")
    trace = Trace("replicas", [(0.5, 0, 5.0, 1), (1.5, 1, 4.0, 2)],
                  {"stages": ["00-a"], "replicas": {"0": ["01-b"]}})
    curve = make_evaluator(wl, data, 1.0, tmp_path / "cap")("replicas", snap, trace)
    assert [(p.t_s, p.step) for p in curve] == [(0.0, -1), (1.5, 1)]  # 0.5 s: before 1 s
