"""Side-by-side on the emulated WAN (issue 6): fusion vs DDP vs hivemind on the same links.

For each reference topology (`deploy/testbed/topologies/`), it brings the testbed up (root),
then runs, one after another and each for the same wall-clock budget, the same model, data,
global batch and optimizer (`bench.wan_common.Workload`; GPT-2 `mini` at vocab 256 by default):

1. fusion, uniform split (equal op counts per host, host order), dense;
2. fusion, OP-Fence, dense;
3. fusion, OP-Fence + AdaTopK;
4. PyTorch DDP over gloo, one process per host (`bench/wan_ddp.py`);
5. hivemind 1.1.12 `hivemind.Optimizer`, one peer per host, in its own venv
   (`bench/wan_hivemind.py`; build the venv with `bench/hivemind/setup.sh`).

Fusion runs are a `JobWorker` over a `PeerNetwork` in every host (`bench/wan_fusion.py`) and
the `JobCoordinator` in host 0, planned on the testbed's configured links (no daemons) and on
the profile every host measures of itself (`fusiond.profile`, as a daemon gossips it).
Every process is limited to one thread and runs in its host's CPU cgroup: the hosts share this
machine's cores, so every host gets a quota and the quotas sum to at most `--cpu-cores`
(default 80 % of the CPUs; the topology's own quotas stay relative, see `share_quotas`). A host
reads its quota like a container does and the planner sees each host at its share.
Defaults: all topologies, GPT-2 mini, 60 s per run (45 s with --quick), 12 MB planner memory
per host (the model must be split), hosts per `DEFAULT_HOSTS`. Bytes on the wire = what every
host's eth0 transmitted during the run (all traffic: setup, model shipping, activations, gradients,
DHT). Writes a Markdown table per topology to `--doc` and a PNG of loss vs wall-clock per
topology; prints PASS/FAIL for the issue's targets.
The testbed (namespaces, processes) is removed on exit, also on failure or Ctrl-C.

    sudo .venv/bin/python bench/wan.py --quick                 # four-groups, 4 hosts, < 10 min
    sudo .venv/bin/python bench/wan.py                         # all three, < 30 min
    sudo .venv/bin/python bench/wan.py --topology two-groups --hosts 4 --budget 90
    sudo .venv/bin/python bench/wan.py --quick --host-memory-mb 0  # the model fits one host
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.wan_common import (  # noqa: E402
    LABELS,
    SYSTEMS,
    Figures,
    Trace,
    Verdict,
    Workload,
    figures,
    markdown_table,
    verdicts,
)
from deploy.testbed.bed import Testbed  # noqa: E402
from deploy.testbed.topology import Topology, format_rate, load_topology  # noqa: E402

TOPOLOGIES = ("two-groups", "four-groups", "mixed-slow")
DEFAULT_HOSTS: dict[str, int | None] = {"two-groups": None, "four-groups": 4, "mixed-slow": 4}
"""Hosts per topology without --hosts: all of two-groups (8: its two groups of 4);
four-groups with one host per group (its 8 would add about 4 minutes of process start-up on 2
cores to a run that must fit in 30 minutes, and 4 keep every kind of link); mixed-slow with 4
of its 5 (f1, f2, s1, r1: fast, slow and remote), because DDP's ranks must split the global
batch of 16 evenly."""
FUSION_PORT = 7600
DDP_PORT = 7700
HIVEMIND_PORT = 7800


def select_hosts(topo: Topology, cap: int | None) -> list[str]:
    """At most `cap` hosts, dealt round-robin over the groups (then group-less hosts), so a
    capped topology keeps every group and so every kind of link."""
    if cap is None or cap >= len(topo.hosts):
        return list(topo.hosts)
    buckets = [list(m) for m in topo.groups.values()]
    grouped = {h for m in buckets for h in m}
    buckets += [[h] for h in topo.hosts if h not in grouped]
    out: list[str] = []
    i = 0
    while len(out) < cap:
        for b in buckets:
            if i < len(b) and len(out) < cap:
                out.append(b[i])
        i += 1
    return [h for h in topo.hosts if h in out]


def restrict(topo: Topology, hosts: Sequence[str]) -> Topology:
    """The topology with only `hosts` (links between them are unchanged)."""
    keep = set(hosts)
    return dataclasses.replace(
        topo, hosts=tuple(h for h in topo.hosts if h in keep),
        groups={g: tuple(h for h in m if h in keep) for g, m in topo.groups.items()
                if any(h in keep for h in m)},
        cpu={h: c for h, c in topo.cpu.items() if h in keep})


def share_quotas(hosts: Sequence[str], relative: dict[str, float], cores: float
                 ) -> dict[str, float]:
    """A CPU quota (cores) for every host such that they sum to at most `cores`: hosts emulated
    on one machine share its cores, and a host without a quota would be profiled (and planned)
    as if it had the machine to itself. The topology's quotas stay relative (a 0.5-core host
    gets half of a full host's share); nothing is scaled up past the topology's own quota."""
    weights = {h: min(1.0, relative.get(h, 1.0)) for h in hosts}
    total = sum(weights.values())
    scale = min(1.0, cores / total) if total > 0 else 1.0
    # rounded down to 1/1000 core, so rounding never lifts the sum over `cores`
    return {h: math.floor(w * scale * 1000) / 1000 for h, w in weights.items()}


def cluster_desc(topo: Topology) -> dict[str, Any]:
    """The configured link matrix and CPU quotas, for the planner in the fusion lead."""
    hs = list(topo.hosts)
    return {
        "hosts": hs,
        "bandwidth_bits_per_s": {a: {b: topo.link(a, b).bandwidth_bits_per_s for b in hs if b != a}
                          for a in hs},
        "rtt_s": {a: {b: topo.link(a, b).rtt_s for b in hs if b != a} for a in hs},
        "cpu": dict(topo.cpu),
    }


def make_credentials(root: Path, hosts: Sequence[str]) -> dict[str, str]:
    """A cluster CA (key with the first host, as after `fusionctl init`) and a node
    certificate per host under `root/<host>`; returns each host's node id."""
    from fusiond.net import pki

    ids: dict[str, str] = {}
    ca, ident, _ = pki.init_cluster(root / hosts[0])
    ids[hosts[0]] = pki.TLSMaterial.in_state_dir(root / hosts[0]).node_id()
    for h in hosts[1:]:
        ident = pki.load_or_create_node_identity(root / h)
        cert = pki.issue_node_certificate(ca, ident.key.public_key())
        ids[h] = pki.store_node_credentials(root / h, cert, ca.cert).node_id()
    return ids


def slowest_mbit(topo: Topology) -> float:
    return min(topo.link(a, b).bandwidth_bits_per_s for a, b in topo.pairs()) / 1e6


def tx_bytes(tb: Testbed, hosts: Sequence[str]) -> int:
    """Bytes all `hosts` have sent on eth0 so far."""
    total = 0
    for h in hosts:
        out = tb.run(h, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], cpu_quota=False)
        total += int(out.strip())
    return total


def stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM each process group we started, then SIGKILL what is left after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


class Runner:
    """Runs the five systems on one testbed; each run returns its trace (or a failed one)."""

    def __init__(self, tb: Testbed, work: Path, args: argparse.Namespace, wl: Workload) -> None:
        self.tb = tb
        self.work = work
        self.args = args
        self.wl = wl
        self.hosts = list(tb.topology.hosts)
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        (work / "workload.json").write_text(json.dumps(wl.to_dict()))
        self.creds = make_credentials(work / "creds", self.hosts)
        desc = cluster_desc(tb.topology) | {"node_ids": self.creds}
        if args.host_memory_mb:
            desc["memory_bytes"] = args.host_memory_mb * 1e6
        (work / "cluster.json").write_text(json.dumps(desc))

    def _wait(self, main: subprocess.Popen[bytes], others: Sequence[subprocess.Popen[bytes]],
              out: Path, system: str, timeout: float) -> Trace:
        try:
            main.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop([main, *others])
        if out.exists():
            return Trace.load(out)
        logs = sorted(self.work.glob(f"{system}-*.log"))
        tail = " | ".join(p.name + ": " + p.read_text(errors="replace")[-600:].replace("\n", " ")
                          for p in logs[:2])
        return Trace(system, [], {}, f"no trace (exit {main.returncode}); {tail}"[:1500])

    def fusion(self, mode: str) -> Trace:
        addr = {h: (self.tb.address(h), FUSION_PORT) for h in self.hosts}
        peers = [f"--peer={self.creds[h]}={a}:{p}" for h, (a, p) in addr.items()]
        out = self.work / f"{mode}.json"
        profiles = f"--profile-dir={self.work / f'profiles-{mode}'}"
        procs = []
        py = sys.executable
        script = str(REPO / "bench" / "wan_fusion.py")
        for h in self.hosts[1:]:
            log = self.work / f"{mode}-{h}.log"
            others = [p for p in peers if not p.startswith(f"--peer={self.creds[h]}=")]
            procs.append(self.tb.exec(h, [py, script, "node", h, profiles,
                                          f"--state-dir={self.work / 'creds' / h}",
                                          f"--listen={addr[h][0]}:{FUSION_PORT}", *others],
                                      log=log, env=self.env))
        h0 = self.hosts[0]
        lead = self.tb.exec(h0, [
            py, script, "lead", h0, profiles, f"--listen={addr[h0][0]}:{FUSION_PORT}",
            f"--state-dir={self.work / 'creds' / h0}",
            *[p for p in peers if not p.startswith(f"--peer={self.creds[h0]}=")],
            f"--mode={mode}",
            f"--budget={self.args.budget}", f"--cluster={self.work / 'cluster.json'}",
            f"--workload={self.work / 'workload.json'}", f"--out={out}",
        ], log=self.work / f"{mode}-{h0}.log", env=self.env)
        # the lead's capture overlaps the nodes' start-up (it plans only once every host's
        # profile is there, and by then the nodes serve); capture + calibration + plan before
        # the budget starts, Assign and steps inside it
        try:
            for h, p in zip(self.hosts[1:], procs, strict=True):
                self.tb.wait_ready(p, self.work / f"{mode}-{h}.log", f"fusion node {h}",
                                   timeout=180)
        except Exception:
            stop([lead, *procs])
            raise
        return self._wait(lead, procs, out, mode, timeout=self.args.budget + 240)

    def ddp(self) -> Trace:
        out = self.work / "ddp.json"
        master = f"{self.tb.address(self.hosts[0])}:{DDP_PORT}"
        procs = [self.tb.exec(h, [
            sys.executable, str(REPO / "bench" / "wan_ddp.py"), f"--rank={i}",
            f"--world={len(self.hosts)}", f"--master={master}", f"--budget={self.args.budget}",
            f"--workload={self.work / 'workload.json'}", f"--out={out}",
        ], log=self.work / f"ddp-{h}.log", env=self.env | {"GLOO_SOCKET_IFNAME": "eth0"})
            for i, h in enumerate(self.hosts)]  # gloo would advertise 127.0.0.1 otherwise
        return self._wait(procs[0], procs[1:], out, "ddp", timeout=self.args.budget + 240)

    def hivemind(self) -> Trace:
        py = Path(self.args.hivemind_python)
        if not py.exists():
            return Trace("hivemind", [], {}, f"no hivemind venv at {py} "
                                             "(run bench/hivemind/setup.sh)")
        out = self.work / "hivemind.json"
        maddrs = self.work / "hivemind-maddrs.txt"
        maddrs.unlink(missing_ok=True)
        barrier = self.work / "hivemind-barrier"
        shutil.rmtree(barrier, ignore_errors=True)
        tokens = self.work / "tokens.npy"
        if not tokens.exists():
            import numpy as np

            from fusiond.train.data import TextWindows, make_source
            from fusiond.train.spec import parse_job

            spec = parse_job(self.wl.job_toml(adatopk=False))
            src = make_source(spec.data, spec.seed)
            assert isinstance(src, TextWindows)
            np.save(tokens, src.tokens)
        procs = [self.tb.exec(h, [
            str(py), str(REPO / "bench" / "wan_hivemind.py"), f"--rank={i}",
            f"--world={len(self.hosts)}", f"--listen={self.tb.address(h)}:{HIVEMIND_PORT}",
            f"--maddr-file={maddrs}", f"--barrier-dir={barrier}", f"--budget={self.args.budget}",
            f"--workload={self.work / 'workload.json'}", f"--tokens={tokens}", f"--out={out}",
        ], log=self.work / f"hivemind-{h}.log", env=self.env) for i, h in enumerate(self.hosts)]
        return self._wait(procs[0], procs[1:], out, "hivemind", timeout=self.args.budget + 240)

    def run(self, system: str) -> tuple[Trace, int]:
        """One run and the bytes the hosts sent during it."""
        before = tx_bytes(self.tb, self.hosts)
        if system == "ddp":
            trace = self.ddp()
        elif system == "hivemind":
            trace = self.hivemind()
        else:
            trace = self.fusion(system)
        return trace, tx_bytes(self.tb, self.hosts) - before


def plot(traces: dict[str, Trace], title: str, path: Path, target: float) -> bool:
    """Loss vs wall-clock for every run with events; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in SYSTEMS:
        t = traces.get(s)
        if t is None or not t.events:
            continue
        pts = [(e[0], e[2]) for e in t.events if e[2] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=LABELS[s], linewidth=1.2)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="target loss")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def explain_miss(trace: Trace, measured_tokens_per_s: float, tokens_per_step: int) -> str:
    """Where a prediction missed: the measured step time against the planner's iteration, and
    the stage whose measured compute (busy fraction x step time) is furthest from its
    predicted compute, or the predicted bottleneck link when compute was on time."""
    extra = trace.extra
    pred = extra.get("prediction") or {}
    last = extra.get("last_step") or {}
    busy = {int(k): float(v) for k, v in (last.get("busy") or {}).items()}
    step_s = tokens_per_step / measured_tokens_per_s
    parts = [f"step {step_s:.3f} s measured vs {float(pred.get('iteration_s', 0)):.3f} s "
             f"predicted (planner's bottleneck: {pred.get('bottleneck', '?')})"]
    worst: tuple[float, str] | None = None
    ratios = []
    for st in pred.get("stages", []):
        b = busy.get(int(st["stage"]))
        # a stage's measured busy time is its compute (the executor); the planner's stage
        # time also holds the wire handling, which the event loop does beside it
        compute = float(st["compute_s"]) - float(st.get("wire_cpu_s", 0.0))
        if b is None or compute <= 0:
            continue
        r = b * step_s / compute
        ratios.append(r)
        text = (f"stage {st['stage']} on {st['machine']}: compute {b * step_s:.3f} s/step "
                f"measured vs {compute:.3f} s predicted ({r:.1f}x)")
        if worst is None or abs(r - 1) > abs(worst[0] - 1):
            worst = (r, text)
    if worst is not None:
        parts.append(worst[1])
    if ratios and all(abs(r - 1) <= 0.25 for r in ratios):
        parts.append(f"every stage's compute is within 25 % of its prediction: the miss is "
                     f"the {step_s - float(pred.get('iteration_s', 0)):.3f} s/step the stages "
                     "spend waiting on each other beyond the pipeline model "
                     "((M-1) x bottleneck + one micro-batch through every stage and hop)")
    measured, predicted = handoffs(trace)
    if measured is not None:
        parts.append(f"hand-offs between consecutive stages: {measured * 1e3:.1f} ms measured "
                     f"(mean, one stage's task end to the next one's inputs in) vs "
                     f"{predicted * 1e3:.1f} ms predicted (both hosts' wake-up under their "
                     "CPU quota)")
    slow_links = sorted(pred.get("links", []), key=lambda lk: -lk["time_s"])[:1]
    for lk in slow_links:
        parts.append(f"slowest predicted link: stage {lk['src_stage']} -> {lk['dst_stage']} "
                     f"at {lk['mbit']:.1f} Mbit/s, {lk['bytes'] / 1e3:.0f} kB, "
                     f"{lk['time_s']:.3f} s/step")
    return "; ".join(parts)


def handoffs(trace: Trace) -> tuple[float | None, float]:
    """The mean measured hand-off between consecutive stages (producer task's end to the
    consumer's inputs all in, on the hosts' shared monotonic clock, over the recorded steps'
    timelines, both directions) and the planner's (the two hosts' `wake_s`; the testbed's
    in-group links add no latency, the others half their RTT, left out here)."""
    pred = trace.extra.get("prediction") or {}
    wakes = [float(st.get("wake_s", 0.0)) for st in pred.get("stages", [])]
    predicted = (sum(a + b for a, b in itertools.pairwise(wakes))
                 / max(1, len(wakes) - 1))
    gaps: list[float] = []
    for step in trace.extra.get("timelines", [])[1:]:  # the first may hold start-up
        at: dict[tuple[int, str], tuple[float, float]] = {}
        for k, v in step.items():
            for name, ready, _start, end, _wait in v["tasks"]:
                at[(int(k), name)] = (v["start"] + ready, v["start"] + end)
        for (s, name), (ready, _end) in at.items():
            src = (s - 1, name) if name.startswith("F") else (s + 1, name)
            if src in at:
                gaps.append(ready - at[src][1])
    return (sum(gaps) / len(gaps) if gaps else None), predicted


def bytes_by_link(trace: Trace, topo: Topology) -> dict[float, float]:
    """Measured payload bytes per step (forward + backward, all edges of the last step) by the
    rate of the link each cut edge crosses, from the trace's stages (machine ids
    `<index>-<host>`) and the topology: shows where a partition puts its traffic."""
    stages = [str(m).split("-", 1)[1] for m in trace.extra.get("stages", [])]
    edges = (trace.extra.get("last_step") or {}).get("edges") or []
    out: dict[float, float] = {}
    for e in edges:
        a, b = int(e["src"]), int(e["dst"])
        if not (0 <= a < len(stages) and 0 <= b < len(stages)) or stages[a] == stages[b]:
            continue
        rate = topo.link(stages[a], stages[b]).bandwidth_bits_per_s
        out[rate] = out.get(rate, 0.0) + float(e["forward_wire"]) + float(e["backward_wire"])
    return out


def traffic_note(traces: dict[str, Trace], topo: Topology) -> str | None:
    """One line comparing (2) and (3)'s bytes per step on each kind of link, or None."""
    parts = []
    for s in ("opfence", "adatopk"):
        t = traces.get(s)
        got = bytes_by_link(t, topo) if t is not None else {}
        if got:
            parts.append(f"{LABELS[s][:3]} " + ", ".join(
                f"{format_rate(r)}: {b / 1e6:.2f} MB" for r, b in sorted(got.items())))
    if not parts:
        return None
    return ("payload per step by link rate (last step, forward + backward; a different "
            "partition can move traffic onto fast links while AdaTopK shrinks the slow ones): "
            + "; ".join(parts))


def run_topology(name: str, args: argparse.Namespace, wl: Workload
                 ) -> tuple[str, dict[str, Figures], list[Verdict]]:
    topo = load_topology(name)
    hosts = select_hosts(topo, args.hosts if args.hosts else DEFAULT_HOSTS.get(name))
    topo = restrict(topo, hosts)
    relative = dict(topo.cpu)
    topo = dataclasses.replace(topo, cpu=share_quotas(hosts, relative, args.cpu_cores))
    traces: dict[str, Trace] = {}
    wire: dict[str, int] = {}
    tb = Testbed(topo)
    try:
        tb.up(latency=args.latency)
        work = tb.work_dir / "wan"
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o777)
        runner = Runner(tb, work, args, wl)
        for s in args.systems:
            t0 = time.monotonic()
            print(f"[{name}] {LABELS[s]} ...", flush=True)
            trace, nbytes = runner.run(s)
            traces[s], wire[s] = trace, nbytes
            status = trace.error or f"{len(trace.events)} steps"
            print(f"[{name}] {LABELS[s]}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
            Path(args.traces).mkdir(parents=True, exist_ok=True)
            (Path(args.traces) / f"{name}-{s}.json").write_text(trace.to_json())
    finally:
        keep = Path(args.traces) / f"{name}-logs"
        with contextlib.suppress(OSError):
            keep.mkdir(parents=True, exist_ok=True)
            for log in (tb.work_dir / "wan").glob("*.log"):
                shutil.copyfile(log, keep / log.name)
        tb.down()
    rows = {s: figures(t, target=args.target_loss, window=args.window, skip=args.skip,
                       wire_bytes=wire.get(s)) for s, t in traces.items()}
    slow = slowest_mbit(topo)
    vs = verdicts(rows, slowest_mbit=slow)
    suffix = f"-mem{args.host_memory_mb:g}" if args.host_memory_mb else ""
    png = Path(args.doc).with_name(f"benchmarks-{name}{suffix}.png")
    has_plot = plot(traces, f"{name} ({len(hosts)} hosts), GPT-2 {wl.size}", png,
                    args.target_loss)
    links = sorted({(topo.link(a, b).bandwidth_bits_per_s, topo.link(a, b).rtt_s)
                    for a, b in topo.pairs()})
    md = [f"### {name}: {', '.join(hosts)}", "",
          "links: " + ", ".join(f"{format_rate(bw)}/{rtt * 1e3:g} ms" for bw, rtt in links)
          + f"; CPU quota per host (cores, sum <= {args.cpu_cores:g}): "
          + ", ".join(f"{h} {c:g}" for h, c in topo.cpu.items())
          + (f" (topology's relative quotas {relative})" if relative else ""), "",
          markdown_table(rows), ""]
    for v in vs:
        md.append(f"- {v.line()}")
    for s in ("opfence", "adatopk"):
        f = rows.get(s)
        if f and f.tokens_per_s and f.predicted_tokens_per_s and abs(
                f.tokens_per_s / f.predicted_tokens_per_s - 1) > 0.25:
            md.append(f"- {LABELS[s]} prediction missed: "
                      f"{explain_miss(traces[s], f.tokens_per_s, wl.tokens_per_step)}")
    note = traffic_note(traces, topo)
    if note:
        md.append(f"- {note}")
    for s, t in traces.items():
        if t.error:
            md.append(f"- {LABELS[s]}: {t.error}")
    if has_plot:
        md += ["", f"![loss vs wall-clock on {name}]({png.name})"]
    return "\n".join(md), rows, vs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--topology", action="append", help=f"default: {', '.join(TOPOLOGIES)}")
    ap.add_argument("--quick", action="store_true",
                    help="four-groups only, 4 hosts, 45 s budget per run")
    ap.add_argument("--hosts", type=int, help="at most this many hosts per topology")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="wall-clock seconds per run (two-groups' 0.2-core hosts need ~40 "
                         "steps, 45-50 s, to reach the target loss)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)}")
    ap.add_argument("--size", default="mini", help="GPT-2 size (fusiond.models.gpt2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--target-loss", type=float, default=3.0,
                    help="loss (smoothed over --window steps) that counts as reached")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--skip", type=int, default=2,
                    help="steps excluded from throughput (model shipping, warm-up)")
    ap.add_argument("--host-memory-mb", type=float, default=12.0,
                    help="memory the planner may use per host (default 12 MB; 0: 4 GiB, the "
                         "model fits one host). A planner input only, nothing enforces it at "
                         "run time: GPT-2 mini needs 23.5 MB on one host in the planner's "
                         "accounting, so 12 MB makes it too big for one host, as in the "
                         "paper's setting, and fusion must split it over at least 3 hosts "
                         "(DDP and hivemind still hold a full copy)")
    ap.add_argument("--append", action="store_true",
                    help="add the sections to --doc instead of rewriting it")
    ap.add_argument("--latency", default="auto", help="testbed latency mode")
    ap.add_argument("--cpu-cores", type=float,
                    default=round(0.8 * len(os.sched_getaffinity(0)), 2),
                    help="cores the hosts' quotas share (default 80 %% of this process's "
                         "CPUs: the rest is for the delay stage, the bench, the kernel's "
                         "shaping and whatever else runs on the machine)")
    ap.add_argument("--hivemind-python", default=str(REPO / "bench" / ".venv-hivemind" / "bin"
                                                      / "python"))
    ap.add_argument("--doc", default=str(REPO / "docs" / "benchmarks.md"))
    ap.add_argument("--traces", default=str(REPO / "out" / "wan"),
                    help="where each run's raw trace is kept (JSON)")
    args = ap.parse_args()
    if args.quick:
        args.topology = args.topology or ["four-groups"]
        args.hosts = args.hosts or 4
        args.budget = min(args.budget, 45.0)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; known: {', '.join(SYSTEMS)}")
    if os.geteuid() != 0:
        ap.error("the testbed needs root")
    wl = Workload(size=args.size, batch=args.batch, micro_batches=args.micro,
                  seq_len=args.seq, lr=args.lr)
    sections = []
    all_ok = True
    for name in args.topology or TOPOLOGIES:
        md, _, vs = run_topology(name, args, wl)
        print(md, flush=True)
        sections.append(md)
        all_ok &= all(v.ok is not False for v in vs)
    header = [
        "# Benchmarks: fusion vs DDP vs hivemind on the emulated WAN",
        "",
        f"Generated by `bench/wan.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"command: `{' '.join(sys.argv[1:]) or '(defaults)'}`).",
        "",
        f"Workload (all five): GPT-2 `{wl.size}` (fusiond.models.gpt2, vocab {wl.vocab_size}, "
        f"byte tokens of the default corpus), global batch {wl.batch} x {wl.seq_len} tokens, "
        f"AdamW lr {wl.lr} constant, seed {wl.seed}; {args.budget:g} s wall-clock per run; "
        f"one thread per process, each host in its CPU quota. Target loss {args.target_loss} "
        f"(mean of the last {args.window} steps); tokens/s leave out the first {args.skip} "
        "steps. 'wire bytes' = all bytes the hosts' eth0 sent during the run. "
        "Time ratios are 'x sooner' (the other run's time / this run's)."
        + (f" Planner memory per host: {args.host_memory_mb:g} MB (forces fusion to split the "
           "model; DDP and hivemind hold full copies regardless)." if args.host_memory_mb
           else " Planner memory per host: 4 GiB (the model fits one host)."),
        "",
    ]
    doc = Path(args.doc)
    if args.append and doc.exists():
        old = doc.read_text()
        body = old[:old.index("\n## Notes")] if "\n## Notes" in old else old
        doc.write_text(body.rstrip("\n") + "\n\n## Run: " + " ".join(sys.argv[1:]) + "\n\n"
                       + "\n".join(header[2:]) + "\n" + "\n\n".join(sections) + "\n" + NOTES)
    else:
        doc.write_text("\n".join(header) + "\n" + "\n\n".join(sections) + "\n" + NOTES)
    print(f"wrote {doc}")
    sys.exit(0 if all_ok else 1)


NOTES = """
## Notes

- Model: GPT-2 `mini` of `fusiond.models.gpt2` (4 layers, width 128, 4 heads) at vocab 256
  (byte tokens), about 0.8 M parameters: what eight host processes on this machine's 2 cores
  can train at all. Same initial weights (seed) everywhere.
- CPU: the emulated hosts share this machine's cores, so every host runs in a CPU quota
  (cgroup, 10 ms CFS period) and the quotas sum to at most `--cpu-cores` (80 % of the cores
  by default: the rest is for the NFQUEUE delay stage, the bench itself and the machine's other
  work). A topology's own quotas (mixed-slow's 0.5 and 0.25 cores) stay relative: they scale
  into the share with everyone else (the quotas used are on each topology's `links:` line).
  The figures are what these runs saw on a machine shared with other engineers' tests;
  nothing is adjusted.
- Fusion's planner sees each host as it profiled itself, with the daemon's code
  (`fusiond.profile.compute_profile`, read by `machine_from_profile` as the daemon's
  `cluster_for_planner` does): the calibration is timed in CPU seconds of one thread (what no
  quota or neighbour bends) and multiplied by the cores the host may use, read from its cgroup
  (`cpu.max` on cgroup v2, `cpu.cfs_quota_us` on v1, up to the root) and its affinity. A
  host's time per byte it sends or receives (encoding, TLS, socket copies) is calibrated the
  same way and adds to its stages' busy time. So a stage's predicted compute is its work over
  the speed the host really has. The quota's CFS period comes with it: once a host has used
  its share of a period, a woken thread waits for the next one, so every hand-off between
  stages pays both hosts' wake-up, (1 - share) x period (8 ms at 0.2 core and 10 ms), in the
  pipeline's fill, and handing a task to a stage's worker thread half of one. The tied
  embedding/head gradient exchange counts only where it outlasts the next micro-batch's
  forward to the head's stage. Links: the configured rates at 95 % (the measured goodput).
- Fusion runs: `bench/wan_fusion.py` in each host (a JobWorker over a PeerNetwork with mutual
  TLS, credentials made per run); the JobCoordinator in the first host runs the planned job.
  The job is cancelled when the budget is over. The clock starts just before the Assign
  messages (weights included) go out.
- The planner memory cap (`--host-memory-mb`, 12 MB by default) is an input to the planner
  only: nothing enforces it at run time (every host process holds Python and torch, hundreds
  of MB). It emulates machines that cannot hold the whole model, the paper's setting: in the
  planner's accounting GPT-2 mini needs 23.5 MB on one host (3.5 MB of parameters, their
  gradients and Adam state, the activations of the micro-batches in flight), and 90 % of 12 MB
  per host forces a split over at least 3 hosts. The uniform split ignores it, as a naive
  pipeline would. With `--host-memory-mb 0` the model fits one host and OP-Fence rightly keeps
  it there (no network at all).
- OP-Fence + AdaTopK may send more bytes in all than OP-Fence alone: with the slow links
  compressed, a different partition becomes best, and it may cut wide tensors (the MLP's
  4x hidden activation) on the fast links, where AdaTopK keeps them dense because they are
  not the bottleneck. The `payload per step by link rate` line under each table shows it:
  on the slow links (3) sends a fraction of (2)'s bytes.
- DDP (`bench/wan_ddp.py`): every rank takes its contiguous share of the same global batch
  per step, gradients all-reduced over gloo (ring); loss = the global mean; the clock starts
  after the rendezvous, before DDP's constructor (its parameter broadcast counts).
- hivemind (`bench/wan_hivemind.py`, venv from `bench/hivemind/setup.sh`): `target_batch_size`
  = the global batch, each peer's local step = its share, `matchmaking_time` 2 s (the default
  15 s would leave a 45-60 s budget with one or two steps); loss = the first peer's mean local
  loss between global steps (noisier than the others: a share of the batch). All peers start
  the clock together: each waits, with its DHT and Optimizer up, until every peer is (a start
  barrier, as DDP's rendezvous), so no peer fills the target batch alone while the others
  are still starting.
- Bytes on the wire count everything the hosts' eth0 sent (TCP/IP headers, weights shipped at
  the start, tied-weight gradients, DHT traffic), so they are comparable across systems.
"""


if __name__ == "__main__":
    main()
