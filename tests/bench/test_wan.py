"""The pure parts of bench/wan.py: figures, host selection, same batches, outcomes of a run."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.wan import restrict, select_hosts, slowest_mbit
from bench.wan_common import (
    FAILED,
    OK,
    OUT_OF_MEMORY,
    Figures,
    Trace,
    Workload,
    figures,
    smoothed,
    throughput,
    time_to_target,
    window_offsets,
)
from deploy.testbed import MemoryReport
from deploy.testbed.topology import load_topology


def _trace(system: str, step_s: float, losses: list[float], tokens: int = 1024,
           pred: float | None = None) -> Trace:
    ev: list[tuple[float, int, float | None, int]] = [
        ((i + 1) * step_s, i, x, (i + 1) * tokens) for i, x in enumerate(losses)]
    return Trace(system, ev, {"predicted_tokens_per_s": pred} if pred else {})


def test_throughput_leaves_out_warmup_steps() -> None:
    # first step slow (model shipping), then 0.5 s per step of 1024 tokens
    ev = [(10.0, 0, 5.0, 1024), (10.5, 1, 4.0, 2048), (11.0, 2, 3.0, 3072)]
    assert throughput(ev, 1) == pytest.approx(2048.0)
    assert throughput(ev, 3) is None


def test_time_to_target_uses_the_smoothed_loss() -> None:
    ev = [(1.0, 0, 5.0, 1), (2.0, 1, 1.0, 2), (3.0, 2, 1.0, 3), (4.0, 3, 1.0, 4)]
    assert smoothed([5.0, 1.0, 1.0], 2) == [5.0, 3.0, 1.0]
    assert time_to_target(ev, 2.0, window=1) == 2.0
    assert time_to_target(ev, 2.0, window=2) == 3.0
    assert time_to_target(ev, 0.5, window=1) is None


def test_a_failed_run_is_a_row_not_a_figure() -> None:
    f = figures(Trace("hivemind", [], {}, "no venv"), target=3.0, window=1, skip=1,
                wire_bytes=None)
    assert isinstance(f, Figures) and f.steps == 0 and f.tokens_per_s is None


def test_a_run_killed_at_its_memory_limit_is_out_of_memory_not_a_miss() -> None:
    from bench.wan import delta_report, run_outcome

    before = MemoryReport(600 << 20, 1, 3, 0)
    after = MemoryReport(600 << 20, 600 << 20, 9, 1)
    d = delta_report(before, after)
    assert d == MemoryReport(600 << 20, 600 << 20, 6, 1)
    trace = Trace("ddp_fp16", [(1.0, 0, 5.0, 10)], {}, None)
    out, why = run_outcome(trace, {"a1": -9, "b1": 1}, {"a1": d, "b1": None}, 0)
    assert out == OUT_OF_MEMORY and "a1" in why and "600 MiB" in why
    # an earlier run's kill (counted before this one) does not make this one out of memory
    same = delta_report(after, after)
    out, why = run_outcome(trace, {"a1": 0}, {"a1": same}, 3)
    assert (out, why) == (OK, "")
    assert run_outcome(trace, {"a1": 0}, {"a1": same}, 0)[0] == FAILED  # nothing to evaluate
    # steps were trained but only the initial weights were evaluated: no snapshot was taken
    assert run_outcome(trace, {"a1": 0}, {"a1": same}, 1)[0] == FAILED
    assert run_outcome(Trace("ddp_fp16", [], {}, None), {"a1": 0}, {"a1": same}, 1)[0] == OK
    broken = Trace("ddp_fp16", [], {}, "no trace")
    assert run_outcome(broken, {"a1": 1}, {"a1": same}, 0) == (FAILED, "no trace")


def test_expected_systems_and_the_fastest_host() -> None:
    import dataclasses

    from bench.wan import NOT_YET, expected_systems, fastest_host

    assert "fsdp" in expected_systems("nofit") and "fsdp" not in expected_systems("fits")
    assert {"single", "ddp_fp16", "ddp_powersgd", "opfence", "adatopk"} <= set(
        expected_systems("fits")) - set(NOT_YET)
    topo = load_topology("mixed-slow")
    assert topo.cpu, "mixed-slow has quotas"
    best = fastest_host(topo)
    assert topo.cpu.get(best, float("inf")) == max(topo.cpu.get(h, float("inf"))
                                                   for h in topo.hosts)
    q = dataclasses.replace(topo, cpu={h: 0.1 for h in topo.hosts} | {topo.hosts[2]: 0.3})
    assert fastest_host(q) == topo.hosts[2]


def test_trace_round_trip(tmp_path: Path) -> None:
    t = _trace("ddp", 0.5, [5.0, 4.0])
    p = tmp_path / "t.json"
    p.write_text(t.to_json())
    assert Trace.load(p) == t


def test_host_cap_keeps_every_group() -> None:
    topo = load_topology("four-groups")
    hosts = select_hosts(topo, 4)
    assert hosts == ["a1", "b1", "c1", "d1"]
    sub = restrict(topo, hosts)
    assert sub.hosts == tuple(hosts) and slowest_mbit(sub) == 8.0
    assert select_hosts(load_topology("two-groups"), 4) == ["e1", "e2", "w1", "w2"]


def test_runners_draw_the_same_windows_as_fusion() -> None:
    import numpy as np

    from fusiond.train.data import TextWindows

    tokens = np.arange(1000, dtype=np.int64) % 251
    wl = Workload(seq_len=16)
    src = TextWindows(None, seq_len=16, seed=wl.seed, tokens=tokens)
    offs = window_offsets(tokens.size, 16, wl.seed, 3, 4)
    win = tokens[offs[:, None] + np.arange(17)[None, :]]
    b = src.batch(3, 4)
    assert (b.inputs.numpy() == win[:, :-1]).all() and (b.targets.numpy() == win[:, 1:]).all()


def test_a_missed_prediction_names_the_stage_furthest_off() -> None:
    from bench.wan import explain_miss

    t = Trace("adatopk", [], {
        "prediction": {"iteration_s": 0.5, "bottleneck": "link 00-a1->01-b1",
                       "stages": [{"stage": 0, "machine": "00-a1", "compute_s": 0.2},
                                  {"stage": 1, "machine": "01-b1", "compute_s": 0.1}],
                       "links": [{"src_stage": 0, "dst_stage": 1, "time_s": 0.4,
                                  "bytes": 4e5, "mbit": 8.0, "density": 0.1}]},
        "last_step": {"busy": {"0": 0.2, "1": 0.5}},
    })
    # 1024 tokens at 1024 tokens/s: a 1 s step; stage 1 computed 0.5 s vs 0.1 s predicted
    text = explain_miss(t, 1024.0, 1024)
    assert "step 1.000 s measured vs 0.500 s predicted" in text
    assert "stage 1 on 01-b1" in text and "(5.0x)" in text
    assert "8.0 Mbit/s" in text


def test_a_missed_prediction_names_the_replicas_exposed_reduction() -> None:
    """With replicas, the table says how long each replicated stage reduced its gradients
    after its last backward (the worst replica, median over the steps but the first) against
    the planner's exposed part, how many buckets started during the backward, and the
    reducer's CPU (the worst replica, median)."""
    from bench.wan import explain_miss, reduction_note

    def slot(exposed: float, early: int) -> dict[str, object]:
        return {"start": 0.0, "wall_s": 1.0, "tasks": [], "reduce_exposed_s": exposed,
                "buckets_early": early, "reduce_cpu_s": exposed / 4}

    steps = [{"0": slot(9.0, 0), "1": slot(0.0, 0), "2": slot(9.0, 0)},  # start-up: skipped
             {"0": slot(0.2, 3), "1": slot(0.0, 0), "2": slot(0.3, 4)},
             {"0": slot(0.1, 3), "1": slot(0.0, 0), "2": slot(0.5, 4)},
             {"0": slot(0.4, 2), "1": slot(0.0, 0), "2": slot(0.1, 4)}]
    t = Trace("replicas", [], {
        "prediction": {"iteration_s": 0.5, "bottleneck": "stage 0",
                       "stages": [{"stage": 0, "machine": "00-a1", "compute_s": 0.2}],
                       "links": [],
                       "syncs": [{"stage": 0, "scheme": "ring", "time_s": 0.6,
                                  "overlap_s": 0.45, "exposed_s": 0.15, "buckets": 4,
                                  "density": 1.0, "mbit": 47.5}]},
        "slot_stage": {"0": 0, "1": 1, "2": 0},
        "timelines": steps})
    note = reduction_note(t)
    # the worst of slots 0 and 2 per step: 0.3, 0.5, 0.4 -> 0.4; buckets 7, 7, 6 -> 7
    assert note is not None and "stage 0 (ring, 4 bucket(s)" in note
    assert "0.400 s/step after the last backward measured vs 0.150 s predicted" in note
    assert "7 bucket(s) started during it" in note
    assert "the reducer's CPU 0.100 s/step" in note
    assert note in explain_miss(t, 1024.0, 1024)
    # without replicas, or from a trace recorded before these figures: nothing
    assert reduction_note(Trace("opfence", [], {"timelines": steps})) is None


def test_a_predicted_hand_off_counts_the_micro_batchs_transfer() -> None:
    """The planner's hand-off between two stages is both hosts' wake-up and one micro-batch
    over the link between them (the link's time per step over the micro-batches, and half its
    RTT); it used to leave both out and call 44 ms of wire time and 15 ms of latency a miss."""
    from bench.wan import handoffs

    def task(name: str, ready: float, end: float) -> list[object]:
        return [name, ready, ready, end, 0.0, 0.0, 0.0, 0.0, 0.0]

    step = {"0": {"start": 10.0, "wall_s": 1.0,
                  "tasks": [task("F0", 0.0, 0.1), task("F1", 0.1, 0.2), task("B0", 0.5, 0.6),
                            task("B1", 0.7, 0.8)]},
            "1": {"start": 10.0, "wall_s": 1.0,
                  "tasks": [task("F0", 0.15, 0.25), task("B0", 0.25, 0.4),
                            task("F1", 0.4, 0.5), task("B1", 0.5, 0.6)]}}
    t = Trace("opfence", [], {
        "prediction": {"stages": [{"stage": 0, "wake_s": 0.006}, {"stage": 1, "wake_s": 0.006}],
                       "links": [{"src_stage": 0, "dst_stage": 1, "time_s": 0.08,
                                  "rtt_s": 0.03}]},
        "timelines": [step, step]})
    measured, predicted = handoffs(t)
    # F0: 0.15 - 0.1, F1: 0.4 - 0.2, B0: 0.5 - 0.4, B1: 0.7 - 0.6
    assert measured == pytest.approx((0.05 + 0.2 + 0.1 + 0.1) / 4)
    assert predicted == pytest.approx(0.012 + 0.08 / 2 + 0.03 / 2)
    # a trace written before the RTT was recorded: the transfer alone
    del t.extra["prediction"]["links"][0]["rtt_s"]
    assert handoffs(t)[1] == pytest.approx(0.012 + 0.08 / 2)


@given(st.dictionaries(st.sampled_from([f"h{i}" for i in range(10)]),
                       st.floats(min_value=0.01, max_value=1.0), max_size=10),
       st.integers(min_value=1, max_value=10), st.floats(min_value=0.1, max_value=16.0))
def test_host_quotas_share_the_machine_and_stay_relative(
        relative: dict[str, float], n: int, cores: float) -> None:
    from bench.wan import share_quotas

    hosts = [f"h{i}" for i in range(n)]
    q = share_quotas(hosts, relative, cores)
    assert set(q) == set(hosts)
    assert sum(q.values()) <= cores + 1e-9
    for h in hosts:
        w = relative.get(h, 1.0)
        assert q[h] <= w + 1e-9  # never above the topology's own quota
    full = [h for h in hosts if h not in relative]
    for h in hosts:  # a 0.5-core host keeps half of a full host's share
        if full and relative.get(h) is not None:
            assert q[h] == pytest.approx(q[full[0]] * relative[h], abs=2e-3)


def test_traffic_note_puts_each_cut_edge_on_its_link() -> None:
    from bench.wan import bytes_by_link, traffic_note

    topo = restrict(load_topology("two-groups"), ["e1", "e2", "w1", "w2"])

    def trace(system: str, edges: list[tuple[int, int, int]]) -> Trace:
        return Trace(system, [], {"stages": ["00-e1", "01-e2", "02-w1", "03-w2"],
                                  "last_step": {"edges": [
                                      {"src": a, "dst": b, "forward_wire": n,
                                       "backward_wire": n} for a, b, n in edges]}})

    dense = trace("opfence", [(0, 1, 500_000), (1, 2, 500_000), (2, 3, 500_000)])
    sparse = trace("adatopk", [(0, 1, 2_500_000), (1, 2, 150_000), (2, 3, 1_000_000)])
    assert bytes_by_link(dense, topo) == {100e6: 1e6, 10e9: 2e6}
    assert bytes_by_link(sparse, topo) == {100e6: 3e5, 10e9: 7e6}
    note = traffic_note({"opfence": dense, "adatopk": sparse}, topo)
    assert note is not None
    assert "(2) 100 Mbit/s: 1.00 MB, 10 Gbit/s: 2.00 MB" in note
    assert "(3) 100 Mbit/s: 0.30 MB, 10 Gbit/s: 7.00 MB" in note
    assert traffic_note({}, topo) is None


def test_hivemind_peers_start_together(tmp_path: Path) -> None:
    import threading
    import time

    from bench.wan_hivemind import barrier

    released: dict[int, float] = {}

    def peer(rank: int, delay: float) -> None:
        time.sleep(delay)
        barrier(tmp_path, rank, 3, timeout_s=20)
        released[rank] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=peer, args=(r, 0.3 * r)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # nobody starts before the last peer (0.6 s late) is ready
    assert min(released.values()) - t0 >= 0.55
    assert max(released.values()) - min(released.values()) < 0.5
    with pytest.raises(SystemExit, match="not every peer"):
        barrier(tmp_path / "other", 0, 2, timeout_s=0.2)


def test_ddp_runs_on_the_host_subset_a_user_would_pick() -> None:
    import dataclasses

    from bench.wan import ddp_hosts

    topo = restrict(load_topology("four-groups"), ["a1", "b1", "c1", "d1"])
    topo = dataclasses.replace(topo, cpu=dict.fromkeys(topo.hosts, 0.4))
    # 5 M parameters in fp16 over 8 Mbit/s would take seconds per step: one 50 Mbit/s pair
    pair = ddp_hosts(topo, "ddp_fp16", 5_000_000, 0.05, 16)
    assert pair in (["a1", "b1"], ["c1", "d1"]), pair
    # a tiny model whose compute dominates: every host
    assert ddp_hosts(topo, "ddp_powersgd", 1_000, 1.0, 16) == ["a1", "b1", "c1", "d1"]


def test_the_table_and_the_traces_say_what_each_run_did() -> None:
    from bench.wan import RunRecord, results_table
    from bench.wan_common import LABELS, HeldoutPoint, verdict

    curve = [HeldoutPoint(0.0, -1, 5.5), HeldoutPoint(5.0, 3, 3.4), HeldoutPoint(10.0, 8, 2.9)]
    recs = [RunRecord("single", Trace("single", [(1.0, 0, 5.0, 1)] * 9, {}), OK, "", curve,
                      1000, {"a1": 500 << 20}, 30.0, {"a1": 0.98}, {"a1": 520 << 20}),
            RunRecord("opfence", Trace("opfence", [], {}), OUT_OF_MEMORY,
                      "kernel killed a process of a1 at 404 MiB", [], None, {}, 20.0)]
    v = verdict("four-groups", "does not fit", [r.result(3.0) for r in recs],
                ("single", "opfence"))
    table = results_table(v, recs, LABELS)
    # 3.0 is crossed between the 5 s (3.4) and 10 s (2.9) snapshots: 9.0 s interpolated
    assert "| (0) fastest host alone | ok | 9.0 s (1 run) | 2.900 (1 run) | 9 |" in table
    assert "520 MiB" in table and "a1 98%" in table
    assert "out of memory" in table and "404 MiB" in table
    d = recs[0].to_dict(5.0, 10.0)
    assert d["heldout_at"] == [(5.0, 3.4), (10.0, 2.9)] and d["cpu_utilisation"] == {"a1": 0.98}


def test_a_runs_evaluation_runs_in_the_background_and_settles_its_outcome(
        tmp_path: Path) -> None:
    """The held-out evaluation of a run moves its snapshots out of the testbed, runs in a
    background thread (removing them after), and the run's outcome is settled from its
    curve; an evaluation that raises leaves a failed row naming why."""
    import threading

    from bench.wan import Evaluations, RunRecord
    from bench.wan_common import FAILED, OK, HeldoutPoint

    threads: list[str] = []

    def fake(system: str, snapdir: Path, trace: Trace) -> list[HeldoutPoint]:
        threads.append(threading.current_thread().name)
        assert (snapdir / "snap-00000.safetensors").exists()
        if system == "broken":
            raise ValueError("bad snapshot")
        return [HeldoutPoint(0.0, -1, 5.0), HeldoutPoint(1.0, 0, 4.0)]

    ev = Evaluations(fake, tmp_path / "keep")
    recs = []
    for system in ("single", "broken"):
        snap = tmp_path / f"snap-{system}"
        snap.mkdir()
        (snap / "snap-00000.safetensors").write_bytes(b"x")
        trace = Trace(system, [(1.0, 0, 4.0, 1)], {})
        rec = RunRecord(system, trace, FAILED, "pending", [], 0, {}, 1.0)
        rec.pending = (ev.submit(system, snap, trace), {}, {})
        assert not snap.exists()  # moved out of the testbed at once
        recs.append(rec)
    for rec in recs:
        rec.settle()
    ev.close()
    assert all(t.startswith("heldout") for t in threads) and len(threads) == 2
    assert recs[0].outcome == OK and [p.loss for p in recs[0].curve] == [5.0, 4.0]
    assert recs[1].outcome == FAILED and "bad snapshot" in recs[1].reason
    assert not list((tmp_path / "keep").iterdir())  # evaluated snapshots are removed


def test_each_fusion_run_is_judged_against_its_plans_prediction(tmp_path: Path) -> None:
    """The report says, per fusion run, measured over predicted throughput (the median step
    after the first against the plan's iteration) with PASS within 25 % and, on a miss, where
    the time went; `--explain` reads the same from a committed traces file."""
    import json

    from bench.wan import explain_traces, prediction_lines

    pred = {"iteration_s": 0.5, "bottleneck": "compute 00-a1",
            "stages": [{"stage": 0, "machine": "00-a1", "compute_s": 0.4}], "links": []}
    # steps 1 s apart after a slow first step: measured 1.0 s against 0.5 s predicted
    slow = Trace("opfence", [(3.0, 0, 5.0, 1024), (4.0, 1, 4.9, 2048), (5.0, 2, 4.8, 3072),
                             (6.0, 3, 4.7, 4096)],
                 {"prediction": pred, "last_step": {"busy": {"0": 0.9}}})
    on_time = Trace("swarm", [(1.0, 0, 5.0, 1024), (1.55, 1, 4.9, 2048), (2.1, 2, 4.8, 3072)],
                    {"prediction": pred})
    baseline = Trace("single", [(1.0, 0, 5.0, 1024), (2.0, 1, 4.9, 2048), (3.0, 2, 4.8, 3072)])
    killed = Trace("replicas", [], {"prediction": pred})
    lines = prediction_lines([slow, on_time, baseline, killed])
    assert len(lines) == 3  # the baseline has no prediction and is not judged
    assert lines[0].startswith("- FAIL (2)") and "throughput 0.50" in lines[0]
    assert "step 1.000 s measured vs 0.500 s predicted" in lines[0]  # explain_miss's text
    assert "stage 0 on 00-a1: compute 0.900 s/step measured vs 0.400 s predicted" in lines[0]
    assert lines[1].startswith("- PASS (6)") and "throughput 0.91" in lines[1]
    assert "(7)" in lines[2] and "trained 0 steps" in lines[2]

    doc = {"topology": "four-groups", "regime": "fits", "runs": [
        {"trace": {"system": t.system, "events": t.events, "extra": t.extra, "error": None}}
        for t in (slow, on_time)]}
    path = tmp_path / "four-groups-fits.json"
    path.write_text(json.dumps(doc))
    assert explain_traces(path)[:2] == lines[:2]
