"""A fusion host for `bench/wan.py`, run inside one testbed namespace.

`node` mode: a PeerNetwork (mutual TLS, credentials made by wan.py) on this host's address
and a JobWorker; serves until SIGTERM/SIGINT. `lead` mode (host 0): the same, plus the
scheduler side: it reads the captured job (`--captured`: the IR and the initial weights, which
`bench/wan.py` captured once on the submitting side with `save_captured`, as `fusionctl submit`
does: a daemon never runs torch.export), plans it on the testbed's configured links (block
pipeline, OP-Fence, OP-Fence + AdaTopK, with replicas, or `swarm`: OP-Fence with every float
cut edge int8 block-quantized both ways, `compression.codec = "int8"`, no AdaTopK), runs a
`JobCoordinator` until every stage is Ready (start-up: the weights shipped), then for the
wall-clock budget of training, cancels the job and writes a trace (`bench/wan_common.py`)
with the planner's prediction.

Snapshots for the held-out evaluator (`bench/wan_eval.py`): the job checkpoints every step
(`checkpoint_interval` 1; `bench/wan.py` keeps the steps at its fixed wall-clock points and the
last one, by the lead's clock); each host writes its own stages' checkpoints
(`StageCheckpoint`, the partition's dense parameters) to `--snapshot-dir` instead of sending
them to the lead: on real machines each stage would keep its own, and the states must not
load the links the run is measured on. `bench/wan.py` gathers them after the run.

    python bench/wan_fusion.py node NAME --listen ADDR:PORT --peer N=ADDR:PORT ...
    python bench/wan_fusion.py lead NAME --listen ... --peer ... --mode adatopk --budget 60 \
        --cluster cluster.json --workload workload.json --captured DIR --out trace.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.wan_common import Trace, Workload
from fusiond.cli import run_on_loop
from fusiond.jobs.coordinator import JobCoordinator
from fusiond.jobs.planning import (
    layout_from_plan,
    plan_job,
    reserve_for_scheduler,
    scheduler_reserve_bytes,
)
from fusiond.jobs.worker import JobWorker, local_send_now, local_sender
from fusiond.net.pki import TLSMaterial
from fusiond.net.transport import NetConfig, PeerNetwork
from fusiond.plan import (
    Cluster,
    Plan,
)
from fusiond.profile import (
    compute_profile,
    free_memory_bytes,
    machine_from_profile,
    memory_allowance,
)
from fusiond.train.local import StepMetrics
from fusiond.train.programs import capture_job
from fusiond.train.spec import parse_job
from fusiond.train.stage import StageConfig
from fusiond.units import bits_per_s_from_bytes_per_s, bytes_per_s_from_bits_per_s
from protocol.messages import Message, NodeProfile, StageCheckpoint

T_PROCESS = time.perf_counter()
"""After the imports: start-up (reported apart from the budget) is what follows them."""


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def build_cluster(desc: dict[str, Any], hosts: list[str], profiles: dict[str, NodeProfile]
                  ) -> Cluster:
    """The planner's cluster: machine ids are `<index>-<host>` (so a uniform split takes
    the hosts in topology order; `node_of` maps them to the nodes' TLS ids); links as
    configured on the testbed (bytes/s at the measured 95 % goodput of a shaped link, RTT);
    each machine as its own host profiled itself (`fusiond.profile.compute_profile`, the
    daemon's profile: calibration per CPU second at the host's cgroup quota and 1 thread),
    read through `machine_from_profile` as the daemon's `cluster_for_planner` does."""
    machines = []
    for h in hosts:
        # what the bench gives every host (its limit less an idle process), or what is free
        # under the host's limit now where that is less (the lead's coordinator, the capture
        # read back, torch's first kernels: a daemon's free memory counts them the same way)
        memory = float(desc.get("memory_bytes") or 4 * 2**30)
        if profiles[h].free_memory_bytes > 0:
            memory = min(memory, float(profiles[h].free_memory_bytes))
        m = machine_from_profile(machine_id(hosts, h), profiles[h], memory)
        if m is None:
            raise SystemExit(f"host {h}'s profile has no calibration: {profiles[h]}")
        machines.append(m)
    bw_bytes_per_s = [[bytes_per_s_from_bits_per_s(desc["bandwidth_bits_per_s"][a][b] * 0.95)
                       if a != b else float("inf") for b in hosts] for a in hosts]
    rtt_s = [[desc["rtt_s"][a][b] if a != b else 0.0 for b in hosts] for a in hosts]
    return Cluster.build(machines, bw_bytes_per_s, rtt_s)


def host_profile(state_dir: Path) -> NodeProfile:
    """This host's profile as its daemon would gossip it (benchmarks cached in the host's
    state dir, so the later runs of a topology re-read only the CPU allowance)."""
    return compute_profile(state_dir / "cache", benchmark=True)


def read_profiles(profile_dir: Path, hosts: list[str], timeout_s: float = 300.0
                  ) -> dict[str, NodeProfile]:
    """Every host's profile (`<host>.json`, its wire form, written by each host once it
    serves)."""
    deadline = time.monotonic() + timeout_s
    out: dict[str, NodeProfile] = {}
    while len(out) < len(hosts):
        for h in hosts:
            p = profile_dir / f"{h}.json"
            if h not in out and p.exists():
                out[h] = NodeProfile.from_wire(json.loads(p.read_text()))
        if len(out) < len(hosts):
            if time.monotonic() > deadline:
                raise SystemExit(f"no profile from {sorted(set(hosts) - set(out))}")
            time.sleep(0.1)
    return out


def machine_id(hosts: list[str], h: str) -> str:
    return f"{hosts.index(h):02d}-{h}"


def layout_for(plan: Plan, spec: Any, captured: Any, node_of: dict[str, str]) -> Any:
    """`fusiond.jobs.planning.layout_from_plan` with the plan's machine ids mapped to node
    ids (the TLS identities the stages run under). (Until 2026-12-07 this was a copy that
    carried only the gradient rank: every replica split its reduction in the runtime's
    default buckets, and no memory decision of the plan reached a stage.)"""
    return layout_from_plan("wan", captured.graph, captured.state, plan, spec,
                            node_ids=node_of)


def make_plan(spec: Any, captured: Any, cluster: Cluster) -> Plan:
    """(2) OP-Fence dense, (3) with AdaTopK, (6) with int8 cut edges, (7) with replicas: the
    daemon's own planning (`plan_job`); the spec's `compression` and `batch.replicas` decide
    which (the planner costs the cuts as they will travel)."""
    return plan_job(spec, captured, cluster)


def job_toml(wl: Workload, mode: str) -> str:
    """The job file of a run mode: AdaTopK only for `adatopk`, int8 cut edges for `swarm`, the
    per-link codec choice (the default job) for `codecs`."""
    codec = {"swarm": "int8", "codecs": "auto"}.get(mode, "topk")
    return wl.job_toml(adatopk=mode == "adatopk", codec=codec, replicas=mode == "replicas")


CAPTURED_GRAPH = "graph.ir"
CAPTURED_STATE = "state.safetensors"


def save_captured(spec: Any, directory: Path) -> float:
    """Capture the job's model as `fusionctl submit` does on the submitting machine (the
    bench's own process, outside every host's quota and memory limit) and write what its
    upload carries: the IR's bytes and the initial weights (safetensors). Seconds taken."""
    from protocol import ir

    t = time.perf_counter()
    _, captured = capture_job(spec)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CAPTURED_GRAPH).write_bytes(ir.dumps(captured.graph))
    (directory / CAPTURED_STATE).write_bytes(captured.state_bytes())
    return time.perf_counter() - t


def load_captured(directory: Path) -> Any:
    """The lead's side of the upload: the IR (validated by `protocol.ir.loads`) and the
    weights, as a daemon restores a submission (no torch.export in a daemon)."""
    from fusiond.graph.capture import CapturedModel, state_from_bytes
    from protocol import ir

    graph = ir.loads((directory / CAPTURED_GRAPH).read_bytes())
    state = state_from_bytes((directory / CAPTURED_STATE).read_bytes())
    return CapturedModel(graph, state)


def snapshot_name(partition: int, step: int) -> str:
    """A stage checkpoint's file under the snapshot directory."""
    return f"part-{partition:03d}-step-{step:07d}.safetensors"


def keep_checkpoints(send: Any, snapshot_dir: Path | None) -> Any:
    """`send`, except that StageCheckpoint messages are written to `snapshot_dir` (safetensors
    bytes as the stage made them) instead of going to the lead."""
    if snapshot_dir is None:
        return send

    async def wrapped(peer: str, msg: Message, payload: Any = ()) -> None:
        if isinstance(msg, StageCheckpoint):
            path = snapshot_dir / snapshot_name(msg.partition, msg.step)

            def write() -> None:
                snapshot_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                with tmp.open("wb") as f:  # the parts as they are: no joined copy
                    for part in payload:
                        f.write(part)
                tmp.replace(path)

            await asyncio.to_thread(write)
            return
        await send(peer, msg, payload)

    return wrapped


async def serve(tls: TLSMaterial, listen: tuple[str, int],
                peers: dict[str, tuple[str, int]], lead: argparse.Namespace | None,
                on_ready: Callable[[], None], snapshot_dir: Path | None = None) -> None:
    name = tls.node_id()
    coordinators: list[JobCoordinator] = []
    worker: JobWorker | None = None

    async def dispatch(peer: str, msg: Message) -> None:
        for c in coordinators:
            if await c.handle(peer, msg):
                return
        assert worker is not None
        await worker.handle(peer, msg)

    net = PeerNetwork(node_id=name, cluster_id=tls.cluster_id(), listen=listen, tls=tls,
                      handler=dispatch,
                      config=NetConfig(connect_timeout_s=10, handshake_timeout_s=10,
                                       backoff_max_s=1.0))
    await net.start()
    send = keep_checkpoints(local_sender(name, net.send, dispatch), snapshot_dir)
    worker = JobWorker(node_id=name, send=send, send_now=local_send_now(name, net.send_now),
                       stage_config=StageConfig(
                           recv_timeout_s=120.0,
                           memory_limit_bytes=memory_allowance().limit_bytes))
    net.set_receive_now(worker.receive_now)
    await worker.start()
    for n, a in peers.items():
        net.add_peer_address(n, a)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    on_ready()
    print(f"READY {name} {listen[0]} {listen[1]}", flush=True)
    try:
        if lead is None:
            await stop.wait()
        else:
            await run_lead(name, send, coordinators, peers | {name: listen}, lead, stop)
    finally:
        await worker.close()
        await net.close()


async def run_lead(name: str, send: Any, coordinators: list[JobCoordinator],
                   addresses: dict[str, tuple[str, int]], args: argparse.Namespace,
                   stop: asyncio.Event) -> None:
    wl = Workload.from_dict(args.workload_data)
    desc = args.cluster_data
    hosts: list[str] = list(desc["hosts"])
    # every step: bench/wan.py keeps those at its fixed wall-clock points and the last one
    # (a stage pays the serialisation each step; DDP's rank 0 only at those points); set
    # before planning, which counts each stage's snapshot in flight
    every = 1
    spec = dataclasses.replace(parse_job(job_toml(wl, args.mode)), checkpoint_interval=every)
    captured = load_captured(Path(args.captured))
    profiles = read_profiles(Path(args.profile_dir), hosts)
    # the lead's own free memory as it plans, its coordinator and the capture loaded
    profiles[args.name] = dataclasses.replace(profiles[args.name],
                                              free_memory_bytes=free_memory_bytes())
    cluster = reserve_for_scheduler(build_cluster(desc, hosts, profiles),
                                    machine_id(hosts, args.name),
                                    scheduler_reserve_bytes(captured))
    plan = make_plan(spec, captured, cluster)
    node_of = {machine_id(hosts, h): desc["node_ids"][h] for h in hosts}
    layout = layout_for(plan, spec, captured, node_of)
    extra: dict[str, Any] = {
        "mode": args.mode,
        "predicted_tokens_per_s": plan.samples_per_s * wl.seq_len,
        "predicted_iteration_s": plan.iteration_s,
        "stages": plan.machine_of_stage(),
        "slot_stage": {str(slot): st for (st, _), slot in layout.slots().items()},
        "replicas": {str(i): [plan.arrays.cluster.ids()[m] for m in st.replicas]
                     for i, st in enumerate(plan.stages) if st.replicas},
        "densities": plan.edge_densities(),
        "int8_edges": sorted(layout.int8_edges),
        "encodings": dict(sorted(layout.encodings.items())),
        "idle": dict(plan.idle),
        "profiles": {h: p.to_wire() for h, p in profiles.items()},
        "prediction": prediction_detail(plan, wl.micro_batches),
        "checkpoint_interval": every,
    }
    events: list[tuple[float, int, float | None, int]] = []
    tokens = 0
    t_assign = time.perf_counter()
    extra["plan_s"] = t_assign - T_PROCESS  # capture, profiles, plan
    running = asyncio.Event()
    t0 = t_assign  # the start of training: every stage Ready (weights shipped), JobStart out

    def on_running() -> None:
        nonlocal t0
        t0 = time.perf_counter()
        extra["ship_s"] = t0 - t_assign  # Assign (partition IR, weights) to every Ready
        extra["startup_s"] = t0 - T_PROCESS  # reported apart from the budget
        running.set()

    def on_step(m: StepMetrics) -> None:
        nonlocal tokens
        tokens += m.tokens
        events.append((time.perf_counter() - t0, m.step, m.loss, tokens))
        extra["last_step"] = {"busy": {str(k): v for k, v in m.stage_busy.items()},
                              "wait": {str(k): v for k, v in m.stage_wait.items()},
                              "edges": [e.__dict__ for e in m.edges] if m.edges else [],
                              "wall_s": m.wall_s}
        # the stages' task timelines of the last steps (the hosts share this machine's
        # monotonic clock, so they line up): where a step's time goes
        timelines = extra.setdefault("timelines", [])
        timelines.append({str(k): {"start": r.start_mono, "wall_s": r.wall_s,
                                   "reduce_exposed_s": r.reduce_exposed_s,
                                   "buckets_early": r.buckets_early,
                                   "reduce_cpu_s": r.reduce_cpu_s,
                                   "tasks": [[t.task, t.ready_s, t.start_s, t.end_s, t.wait_s,
                                              t.cpu_s, t.kernel_s, t.codec_s, t.send_s]
                                             for t in r.timeline]}
                          for k, r in m.reports.items()})
        del timelines[:-8]

    coord = JobCoordinator(send=send, spec=spec, captured=captured, layout=layout,
                           addresses=addresses, term=1, tokens_per_sample=wl.seq_len,
                           on_step=on_step, on_running=on_running, ready_timeout_s=300.0)
    coordinators.append(coord)
    task = asyncio.create_task(coord.run())
    stopper = asyncio.create_task(stop.wait())
    started = asyncio.create_task(running.wait())
    error: str | None = None
    try:
        # start-up (the weights shipped to every stage) is outside the budget, as DDP's
        # broadcast and hivemind's DHT are: the budget is training time
        await asyncio.wait({task, stopper, started}, return_when=asyncio.FIRST_COMPLETED)
        done: set[asyncio.Task[Any]] = set()
        if running.is_set() and not task.done() and not stopper.done():
            done, _ = await asyncio.wait({task, stopper}, timeout=args.budget,
                                         return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            out = task.result()
            error = None if out.ok else str(out.failure)
        else:
            await coord.cancel("wall-clock budget over" if not done else "stopped")
            async with asyncio.timeout(60):
                await task
    finally:
        for t in (stopper, started):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
    args.trace = Trace(args.mode, events, extra, error)


def prediction_detail(plan: Plan, micro_batches: int) -> dict[str, Any]:
    """What the planner expects per stage and per link (per step of all micro-batches), so the
    table can name the stage or link a prediction missed."""
    ev = plan.evaluation
    return {
        "iteration_s": ev.iteration_s,
        "bottleneck": ev.bottleneck,
        "stages": [{"stage": st.index, "machine": st.machine_id,
                    "compute_s": st.busy_s * micro_batches,
                    "wire_cpu_s": st.wire_cpu_s * micro_batches,
                    "wake_s": plan.arrays.cluster.machines[st.machine].wake_s,
                    "in_flight": st.inflight}
                   for st in ev.stages],
        "fill_s": ev.fill_s,
        "grad_sync_s": ev.grad_sync_s,
        "syncs": [{"stage": x.stage, "scheme": x.scheme, "time_s": x.time_s,
                   "overlap_s": x.overlap_s, "exposed_s": x.exposed_s, "buckets": x.buckets,
                   "density": x.density, "mbit": bits_per_s_from_bytes_per_s(
                       x.slowest_bytes_per_s) / 1e6} for x in ev.syncs],
        "links": [{"src_stage": lk.src_stage, "dst_stage": lk.dst_stage,
                   "time_s": lk.time_s * micro_batches,
                   "bytes": (lk.fwd_bytes + lk.bwd_bytes) * micro_batches,
                   "mbit": bits_per_s_from_bytes_per_s(lk.bandwidth_fwd_bytes_per_s) / 1e6,
                   "rtt_s": lk.rtt_s, "density": lk.density} for lk in ev.links],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("role", choices=["node", "lead"])
    ap.add_argument("name", help="the host's name (logs only)")
    ap.add_argument("--state-dir", required=True, type=Path,
                    help="this host's TLS credentials (ca.crt, node.crt, node key)")
    ap.add_argument("--listen", type=_addr, required=True)
    ap.add_argument("--peer", action="append", default=[], help="NODE_ID=ADDR:PORT")
    ap.add_argument("--mode", choices=["opfence", "adatopk", "swarm", "replicas", "codecs"],
                    default="adatopk")
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--cluster", help="JSON: hosts, bandwidth_bits_per_s, rtt_s, cpu")
    ap.add_argument("--workload", help="JSON of bench.wan_common.Workload")
    ap.add_argument("--captured", help="directory of the captured job (`save_captured`: the "
                                       "IR and the initial weights, as an upload carries them)")
    ap.add_argument("--out", help="where the lead writes its trace")
    ap.add_argument("--snapshot-dir", type=Path,
                    help="where this host writes its stages' checkpoints (held-out evaluator)")
    ap.add_argument("--snapshot-interval", type=float, default=5.0,
                    help="seconds between checkpoints at the planner's predicted step time")
    ap.add_argument("--loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                    help="the event loop (a daemon's `loop` setting; auto: uvloop if installed)")
    ap.add_argument("--profile-dir", type=Path, required=True,
                    help="where every host writes its profile (NAME.json) once it serves")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # profiled in the host's own namespace and cgroup, with the thread count the stages use
    prof = host_profile(args.state_dir)

    def publish() -> None:
        """The profile goes out once this host serves: the lead plans, and sends, only when
        every host's profile is there."""
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        tmp = args.profile_dir / f"{args.name}.tmp"
        # with what is free under the host's limit now, as a daemon's profile gossips it
        tmp.write_text(json.dumps(dataclasses.replace(
            prof, free_memory_bytes=free_memory_bytes()).to_wire()))
        tmp.replace(args.profile_dir / f"{args.name}.json")

    peers = {}
    for p in args.peer:
        n, _, a = p.partition("=")
        peers[n] = _addr(a)
    if args.role == "lead":
        args.workload_data = json.loads(Path(args.workload).read_text())
        args.cluster_data = json.loads(Path(args.cluster).read_text())
        args.trace = None
    # the loop a daemon runs (uvloop where installed, its config's "auto")
    run_on_loop(serve(TLSMaterial.in_state_dir(args.state_dir), args.listen, peers,
                      args if args.role == "lead" else None, publish, args.snapshot_dir),
                args.loop)
    if args.role == "lead" and args.trace is not None:
        Path(args.out).write_text(args.trace.to_json())


if __name__ == "__main__":
    main()
