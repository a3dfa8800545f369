"""Jepsen-style chaos on real daemons: a nemesis faults random nodes while a job trains, then a
checker (tests/chaos/checker.py) says whether what must hold held. docs/chaos.md has the design
and the figures.

    python -m tests.chaos.runner --minutes 10 --seed 7 [--nodes 5] [--dir DIR] [--keep]

(`scripts/chaos-check` runs it; tests/chaos/test_chaos.py runs a bounded form in CI.)

The run:

1. N fusiond processes on loopback (fixed ports, so a restarted daemon is where it was; mutual
   TLS; the test drop switch on; the e2e job tests' membership timers unless told otherwise),
   node0 the others' bootstrap address. The submitting node (the one `fusionctl submit` talks
   to) is the last one, not the first scheduler.
2. A calibration job (no faults): the fault-free steps/s, and a first check of the checker.
3. The chaos job(s): GPT-2 tiny, `--stages 3`, a checkpoint every few steps, `max_restarts`
   100, sized from the calibration to last about the fault window; `fusionctl submit` follows
   each one (a subprocess, as a user runs it) and writes its outputs. While the window lasts,
   a seeded nemesis applies at random intervals, to random nodes:
   - `kill`: SIGKILL, restart after a delay (same state dir, same port);
   - `freeze`: SIGSTOP for a while, then SIGCONT;
   - `partition`: a minority group and the rest drop each other's traffic (the drop switch,
     `POST /v1/test/block`, on every node of both sides), healed later;
   - `restart`: SIGTERM (a clean stop), restart after a delay.
   At most a minority is faulted at once (down, starting, frozen, or on the minority side of a
   partition): the cluster promises nothing beyond that. The submitting daemon is faulted
   only within what the design promises (docs/chaos.md, "What a job survives"): frozen, or on
   the minority side of a partition, for less than half the failure detector's `dead_after_s`;
   never killed or stopped (its job then reads failed, by design). A job that ends before the
   window does is checked, and the next one starts.
4. Everything heals; the last job runs to its end; the daemons get SIGTERM.
5. The checker: one scheduler per term in all logs, every step of each job's metrics.json
   exactly once, each job done with a sane model, every exit one the nemesis caused, no
   process left. The seed, every fault with its wall time, the progress samples and the
   verdicts go to `<dir>/history.json`; a summary is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusionctl.local import LocalNode, merge
from fusiond.train.spec import default_text_path
from tests.chaos import checker
from tests.daemon.harness import Cluster

JOB_TIMERS: dict[str, float] = {"suspect_after_s": 4.0, "dead_after_s": 8.0,
                                "election_timeout_s": 4.0, "leader_heartbeat_s": 0.3,
                                "leader_lease_s": 3.0}
"""The e2e job tests' membership timers (tests/e2e/conftest.py): five daemons training on two
shared cores stall their event loops for a second at times; `--timers harness` runs with the
harness's 1 s lease and 3 s failure detector instead."""

HARNESS_TIMERS: dict[str, float] = {}
"""tests/daemon/harness.py's own (lease 1 s, dead after 3 s)."""

JOB = """
[job]
name = "{name}"
steps = {steps}
seed = {seed}
output = "{out}"
checkpoint_interval = {checkpoint}
max_restarts = 100
[model]
zoo = "gpt2"
config = {{ size = "tiny" }}
[data]
path = "{text}"
seq_len = 32
[optimizer]
lr = 1e-3
weight_decay = 0.1
warmup_steps = 5
[batch]
size = 8
micro_batches = 4
[compression]
adatopk = false
"""
"""GPT-2 tiny on the json package's sources (shipped by fusionctl), constant lr after a short
warm-up: any number of steps trains it down."""


@dataclass
class Config:
    seconds: float = 150.0
    """The fault window."""
    seed: int = 1
    nodes: int = 5
    root: Path | None = None
    keep: bool = False
    """Keep the run's directory (logs, outputs) when every check held."""
    timers: str = "job"
    """'job' (JOB_TIMERS) or 'harness' (HARNESS_TIMERS)."""
    gap_s: tuple[float, float] = (4.0, 12.0)
    """Pause between two faults (uniform)."""
    down_s: tuple[float, float] = (1.0, 10.0)
    """How long a killed or stopped daemon stays down before its restart."""
    freeze_s: tuple[float, float] = (1.0, 20.0)
    partition_s: tuple[float, float] = (3.0, 25.0)
    weights: dict[str, float] = field(default_factory=lambda: {
        "kill": 3.0, "freeze": 2.0, "partition": 2.0, "restart": 1.0})
    two_at_once: float = 0.3
    """Chance that a kill or a freeze takes two nodes at once (when the minority allows)."""
    checkpoint_interval: int = 5
    calibration_steps: int = 30
    goodput_guess: float = 0.35
    """Share of the fault-free rate a chaos job is sized for (the rest of the window's steps
    are lost to failovers and restarts); a job that ends early is followed by the next one."""
    stages: int = 3
    settle_s: float = 90.0
    """How long a restarted daemon may take to see a quorum again before that is a finding."""
    stage_recv_timeout_s: float = 15.0
    """The daemons' `jobs.stage_recv_timeout_s`: how long a tensor lost under a fault stalls
    the job before its scheduler restarts it (the default, 120 s, would make a run a few long
    stalls; a fault-free step here takes well under a second)."""


@dataclass
class Proc:
    """One daemon process of the run, and how the nemesis stopped it (checker.ProcessExit)."""

    node: str
    popen: subprocess.Popen[bytes]
    expected: str = ""
    signalled_at: float | None = None
    stopped_after_s: float | None = None


@dataclass
class NodeState:
    node: LocalNode
    name: str
    node_id: str = ""
    state: str = "up"
    """up | down | starting | frozen | stopping."""
    fault: int | None = None
    """The fault that holds it (down, starting, frozen, stopping, or minority side)."""
    procs: list[Proc] = field(default_factory=list)
    blocked: frozenset[str] = frozenset()
    """The node ids this node should drop (the partition it is in)."""
    applied: frozenset[str] | None = frozenset()
    """What its drop switch holds now (None: unknown)."""
    started_at: float = 0.0


@dataclass
class Fault:
    id: int
    kind: str
    nodes: list[str]
    start_wall: float
    start_t: float
    planned_s: float
    roles: dict[str, str]
    step_before: int | None
    job: str | None
    other_side: list[str] = field(default_factory=list)
    healed_t: float | None = None
    back_t: float | None = None
    """For kill/restart: when the restarted daemon saw a quorum again."""
    note: str = ""


@dataclass
class JobRun:
    name: str
    steps: int
    toml: Path
    output: Path
    proc: subprocess.Popen[bytes] | None = None
    job_id: str | None = None
    started_t: float = 0.0
    ended_t: float | None = None
    rc: int | None = None
    result: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    stdout: Path | None = None
    stderr: Path | None = None
    calibration: bool = False


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class ChaosRun:
    """One run: `run()` returns the report (also written to `<root>/history.json`)."""

    def __init__(self, cfg: Config, say: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        self.root = cfg.root or Path(tempfile.mkdtemp(prefix="fzchaos"))
        self.root.mkdir(parents=True, exist_ok=True)
        timers = JOB_TIMERS if cfg.timers == "job" else HARNESS_TIMERS
        from tests.daemon.harness import TIMERS
        self.cluster_timers = {**TIMERS["cluster"], **timers}
        self.dead_after_s = float(self.cluster_timers["dead_after_s"])
        self.c = Cluster(self.root, cfg.nodes, {
            "job_memory_gib": 0.03, "stop_timeout_s": 5.0, "cluster": timers,
            "jobs": {"stage_recv_timeout_s": cfg.stage_recv_timeout_s}})
        self.stop_timeout_s = 5.0
        ports = _free_ports(cfg.nodes)
        for n, port in zip(self.c.nodes, ports, strict=True):
            n.settings = merge(n.settings, {"net": {"listen": f"127.0.0.1:{port}"}})
        self.nodes = {f"node{n.index}": NodeState(n, f"node{n.index}") for n in self.c.nodes}
        self.submitter = f"node{cfg.nodes - 1}"
        self.max_faulted = (cfg.nodes - 1) // 2
        self.faults: list[Fault] = []
        self.events: list[tuple[float, int, str]] = []
        """(due time, fault id, action): recoveries waiting."""
        self.samples: list[dict[str, Any]] = []
        self.views: list[dict[str, Any]] = []
        self.findings: list[str] = []
        """Things seen during the run that are violations (a crash, a node that never came
        back, a job that never ended)."""
        self.jobs: list[JobRun] = []
        self.t0 = time.monotonic()
        self.leader: str | None = None
        self.stages: dict[str, str] = {}
        self._last_view_t = 0.0

    # -- processes ---------------------------------------------------------------------------

    def _start(self, ns: NodeState) -> None:
        ns.node.start()
        assert ns.node.proc is not None
        ns.procs.append(Proc(ns.name, ns.node.proc))
        ns.applied = frozenset()
        ns.started_at = time.monotonic()

    def _proc(self, ns: NodeState) -> Proc:
        return ns.procs[-1]

    def _signal(self, ns: NodeState, sig: int) -> None:
        p = self._proc(ns).popen
        if p.poll() is None:
            os.kill(p.pid, sig)

    def _kill(self, ns: NodeState) -> None:
        pr = self._proc(ns)
        if pr.popen.poll() is None:
            pr.expected = "kill"
            pr.signalled_at = time.monotonic()
            os.kill(pr.popen.pid, signal.SIGCONT)  # a frozen one too
            pr.popen.kill()
            pr.popen.wait(10)

    def _term(self, ns: NodeState) -> None:
        pr = self._proc(ns)
        if pr.popen.poll() is None:
            pr.expected = "term"
            pr.signalled_at = time.monotonic()
            os.kill(pr.popen.pid, signal.SIGCONT)
            pr.popen.send_signal(signal.SIGTERM)

    # -- the cluster -------------------------------------------------------------------------

    def start_cluster(self) -> None:
        first = self.nodes["node0"]
        self._start(first)
        self.c.wait_up([first.node], timeout=60.0)
        addr = self.c.address(first.node)
        for ns in self.nodes.values():
            if ns is not first:
                ns.node.settings = merge(ns.node.settings, {"cluster": {"bootstrap": [addr]}})
                self._start(ns)
        self.c.wait_up(timeout=60.0)
        self.c.wait_agreement(timeout=60.0)
        for ns in self.nodes.values():
            ns.node_id = self.c.node_id(ns.node)
        self.ids = {ns.node_id: ns.name for ns in self.nodes.values()}

    def _status(self, ns: NodeState, timeout: float = 1.0) -> dict[str, Any] | None:
        if ns.state in ("down", "frozen", "stopping"):
            return None
        return ns.node.status(timeout)

    def _healthy(self, ns: NodeState) -> bool:
        """Up, and it sees a quorum with a scheduler (a restarted node has rejoined)."""
        st = self._status(ns)
        view = (st or {}).get("cluster") or {}
        return bool(st and st["node"]["phase"] == "running" and view.get("has_quorum")
                    and view.get("leader"))

    # -- the nemesis -------------------------------------------------------------------------

    def faulted(self) -> set[str]:
        return {n for n, ns in self.nodes.items() if ns.fault is not None}

    def _role(self, name: str) -> str:
        nid = self.nodes[name].node_id
        roles = []
        if name == self.submitter:
            roles.append("submitter")
        if self.leader == nid:
            roles.append("scheduler")
        if nid in self.stages.values():
            roles.append("stage " + ",".join(s for s, n in sorted(self.stages.items())
                                             if n == nid))
        return "+".join(roles) or "idle"

    def _step_now(self) -> int | None:
        return self.samples[-1]["step"] if self.samples else None

    def _new_fault(self, kind: str, nodes: list[str], planned_s: float,
                   other: list[str] | None = None) -> Fault:
        job = next((j for j in reversed(self.jobs) if j.ended_t is None), None)
        f = Fault(len(self.faults) + 1, kind, nodes, time.time(), time.monotonic(), planned_s,
                  {n: self._role(n) for n in nodes}, self._step_now(),
                  job.job_id if job else None, other or [])
        self.faults.append(f)
        for n in nodes:
            self.nodes[n].fault = f.id
        self.say(f"[{self._t():6.1f}s] fault {f.id}: {kind} "
                 + ", ".join(f"{n} ({f.roles[n]})" for n in nodes)
                 + f" for {planned_s:.1f}s")
        return f

    def _t(self) -> float:
        return time.monotonic() - self.t0

    def maybe_fault(self) -> None:
        faulted = self.faulted()
        budget = self.max_faulted - len(faulted)
        if budget <= 0:
            return
        free = [n for n, ns in self.nodes.items() if ns.fault is None and ns.state == "up"]
        if not free:
            return
        partition_on = any(f.kind == "partition" and f.healed_t is None for f in self.faults)
        kinds = {k: w for k, w in self.cfg.weights.items()
                 if w > 0 and not (k == "partition" and partition_on)}
        kind = self.rng.choices(list(kinds), weights=list(kinds.values()))[0]
        short = 0.45 * self.dead_after_s  # what the submitter's faults stay under
        if kind in ("kill", "restart"):
            free = [n for n in free if n != self.submitter]  # its job would read failed
            if not free:
                return
        count = 1
        if kind in ("kill", "freeze") and budget >= 2 and len(free) >= 2 \
                and self.rng.random() < self.cfg.two_at_once:
            count = 2
        if kind == "partition":
            count = self.rng.randint(1, min(budget, len(free)))
        victims = sorted(self.rng.sample(free, count))
        if kind == "kill":
            down = self.rng.uniform(*self.cfg.down_s)
            f = self._new_fault(kind, victims, down)
            for n in victims:
                ns = self.nodes[n]
                self._kill(ns)
                ns.state = "down"
            self.events.append((time.monotonic() + down, f.id, "restart"))
        elif kind == "restart":
            down = self.rng.uniform(*self.cfg.down_s) / 3
            f = self._new_fault(kind, victims, down)
            for n in victims:
                ns = self.nodes[n]
                self._term(ns)
                ns.state = "stopping"
        elif kind == "freeze":
            hi = self.cfg.freeze_s[1] if self.submitter not in victims else short
            dur = self.rng.uniform(self.cfg.freeze_s[0], max(self.cfg.freeze_s[0], hi))
            f = self._new_fault(kind, victims, dur)
            for n in victims:
                ns = self.nodes[n]
                self._signal(ns, signal.SIGSTOP)
                ns.state = "frozen"
            self.events.append((time.monotonic() + dur, f.id, "thaw"))
        else:
            hi = self.cfg.partition_s[1] if self.submitter not in victims else short
            dur = self.rng.uniform(self.cfg.partition_s[0], max(self.cfg.partition_s[0], hi))
            rest = sorted(set(self.nodes) - set(victims))
            f = self._new_fault(kind, victims, dur, rest)
            a = frozenset(self.nodes[n].node_id for n in victims)
            b = frozenset(self.nodes[n].node_id for n in rest)
            for n in victims:
                self.nodes[n].blocked = b
            for n in rest:
                self.nodes[n].blocked = a
            self.reconcile_blocks()
            self.events.append((time.monotonic() + dur, f.id, "heal"))

    def recover(self, f: Fault, action: str) -> None:
        now = time.monotonic()
        if action == "restart":
            for n in f.nodes:
                ns = self.nodes[n]
                if ns.state == "down":
                    self._start(ns)
                    ns.state = "starting"
            self.say(f"[{self._t():6.1f}s] fault {f.id}: restarted {', '.join(f.nodes)}")
        elif action == "thaw":
            for n in f.nodes:
                ns = self.nodes[n]
                if ns.state == "frozen":
                    self._signal(ns, signal.SIGCONT)
                    ns.state = "up"
                    ns.fault = None
            f.healed_t = now
            self.say(f"[{self._t():6.1f}s] fault {f.id}: thawed {', '.join(f.nodes)}")
        elif action == "heal":
            for ns in self.nodes.values():
                ns.blocked = frozenset()
            self.reconcile_blocks()
            for n in f.nodes:
                self.nodes[n].fault = None
            f.healed_t = now
            self.say(f"[{self._t():6.1f}s] fault {f.id}: partition healed")

    def reconcile_blocks(self) -> None:
        for ns in self.nodes.values():
            if ns.applied == ns.blocked or ns.state in ("down", "frozen", "stopping"):
                continue
            try:
                ns.node.api("POST", "/v1/test/block", {"node_ids": sorted(ns.blocked)},
                            timeout=2.0)
                ns.applied = ns.blocked
            except Exception:  # starting (no peer network yet) or busy: next round
                ns.applied = None

    def watch_processes(self) -> None:
        """Stopped daemons restart after their delay; a restarted one is back once it sees a
        quorum; any other exit is a crash (a finding), and the daemon is restarted."""
        now = time.monotonic()
        for ns in self.nodes.values():
            pr = self._proc(ns)
            code = pr.popen.poll()
            if ns.state == "stopping":
                if code is not None:
                    pr.stopped_after_s = now - (pr.signalled_at or now)
                    ns.state = "down"
                    f = self.faults[ns.fault - 1] if ns.fault else None
                    if f is not None:
                        self.events.append((now + f.planned_s, f.id, "restart"))
                elif now - (pr.signalled_at or now) > self.stop_timeout_s + 10:
                    self.findings.append(f"{ns.name} did not stop within "
                                         f"{self.stop_timeout_s + 10:g}s of SIGTERM; killed")
                    pr.popen.kill()
                    pr.popen.wait(10)
                continue
            if ns.state in ("up", "starting", "frozen") and code is not None:
                tail = "\n".join(ns.node.log_text().splitlines()[-30:])
                self.findings.append(f"{ns.name} exited {code} on its own at "
                                     f"{self._t():.1f}s; its log ends:\n{tail}")
                self.say(f"[{self._t():6.1f}s] {ns.name} CRASHED ({code}); restarting it")
                self._start(ns)
                ns.state = "starting"
                ns.fault = ns.fault or -1
            if ns.state == "starting" and self._healthy(ns):
                ns.state = "up"
                if ns.fault and ns.fault > 0:
                    f = self.faults[ns.fault - 1]
                    if all(self.nodes[n].state == "up" for n in f.nodes):
                        f.back_t = f.healed_t = now
                ns.fault = None
                self.say(f"[{self._t():6.1f}s] {ns.name} is back "
                         f"({now - ns.started_at:.1f}s after its start)")
            elif ns.state == "starting" and now - ns.started_at > self.cfg.settle_s:
                self.findings.append(f"{ns.name} did not see a quorum within "
                                     f"{self.cfg.settle_s:g}s of its restart")
                ns.started_at = now  # (reported once per period)

    def due_events(self, force: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for due, fid, action in sorted(self.events):
            if force or due <= now:
                self.recover(self.faults[fid - 1], action)
            else:
                keep.append((due, fid, action))
        self.events = keep

    # -- the job -----------------------------------------------------------------------------

    def _job_file(self, name: str, steps: int) -> JobRun:
        out = self.root / "out" / name
        toml = self.root / f"{name}.toml"
        toml.write_text(JOB.format(name=name, steps=steps, seed=3, out=out,
                                   checkpoint=self.cfg.checkpoint_interval,
                                   text=default_text_path() / "json"))
        return JobRun(name, steps, toml, out)

    def submit(self, job: JobRun) -> None:
        sub = self.nodes[self.submitter].node
        job.stdout = self.root / f"{job.name}.stdout"
        job.stderr = self.root / f"{job.name}.stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(job.stdout, "wb") as out, open(job.stderr, "wb") as err:
            job.proc = subprocess.Popen(
                [sys.executable, "-m", "fusionctl", "--socket", sub.socket, "submit",
                 str(job.toml), "--stages", str(self.cfg.stages), "--json"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                start_new_session=True)
        job.started_t = time.monotonic()
        self.jobs.append(job)
        self.say(f"[{self._t():6.1f}s] submitted {job.name} ({job.steps} steps) through "
                 f"{self.submitter}")

    def sample(self) -> None:
        """The job's progress as its submitter records it, and who schedules."""
        now = time.monotonic()
        sub = self.nodes[self.submitter]
        job = next((j for j in reversed(self.jobs) if j.ended_t is None), None)
        if job is not None and sub.state == "up":
            try:
                if job.job_id is None:
                    listed = sub.node.api("GET", "/v1/jobs", timeout=1.0)["jobs"]
                    job.job_id = next((j["job_id"] for j in listed if j["name"] == job.name
                                       and j["state"] == "running"), None)
                if job.job_id is not None:
                    d = sub.node.api("GET", f"/v1/jobs/{job.job_id}?history=0", timeout=1.0)
                    st = d.get("status") or {}
                    self.stages = {str(s["stage"]): s["node"] for s in st.get("stages", [])
                                   if isinstance(s, dict)}
                    self.samples.append({"t": round(self._t(), 2), "job": job.name,
                                         "step": int(d.get("step") or 0),
                                         "state": d.get("state"),
                                         "scheduler": d.get("scheduler")})
            except Exception:  # busy: the next sample
                pass
        if now - self._last_view_t >= 1.0:
            self._last_view_t = now
            for ns in self.nodes.values():
                if ns.state == "up" and ns.fault is None:
                    st = self._status(ns)
                    view = (st or {}).get("cluster") or {}
                    if view:
                        self.leader = view.get("leader")
                        self.views.append({"t": round(self._t(), 2), "from": ns.name,
                                           "leader": self.ids.get(self.leader or "", None),
                                           "term": view.get("term")})
                        break

    def job_ended(self, job: JobRun) -> bool:
        if job.ended_t is not None:
            return True
        assert job.proc is not None
        rc = job.proc.poll()
        if rc is None:
            return False
        job.rc = rc
        job.ended_t = time.monotonic()
        try:
            job.result = json.loads(job.stdout.read_text()) if job.stdout else {}
        except (OSError, ValueError):
            job.result = {}
        job.job_id = job.job_id or job.result.get("job_id")
        self.say(f"[{self._t():6.1f}s] {job.name} ended: fusionctl exit {rc}, state "
                 f"{job.result.get('state')}")
        return True

    def _wait_job(self, job: JobRun, timeout: float, tick: Callable[[], None]) -> None:
        end = time.monotonic() + timeout
        while not self.job_ended(job):
            if time.monotonic() > end:
                self.findings.append(f"{job.name} did not end within {timeout:.0f}s after the "
                                     "faults stopped")
                assert job.proc is not None
                job.proc.kill()
                job.proc.wait(10)
                self.job_ended(job)
                return
            tick()
            time.sleep(0.25)

    def _job_logs(self, job: JobRun) -> None:
        if job.job_id is None:
            return
        try:
            job.lines = self.nodes[self.submitter].node.api(
                "GET", f"/v1/jobs/{job.job_id}/logs", timeout=5.0)["lines"]
        except Exception as e:
            job.lines = [f"(logs not read: {e})"]

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        report: dict[str, Any] = {}
        try:
            self.say(f"chaos: {self.cfg.nodes} daemons in {self.root}, seed {self.cfg.seed}, "
                     f"{self.cfg.seconds:.0f}s of faults, timers {self.cfg.timers} "
                     f"({self.cluster_timers})")
            self.start_cluster()
            self.say(f"[{self._t():6.1f}s] cluster agreed; submitter {self.submitter} "
                     f"({self.nodes[self.submitter].node_id})")
            cal = self._job_file("calibration", self.cfg.calibration_steps)
            cal.calibration = True
            self.submit(cal)
            self._wait_job(cal, 300.0, self.sample)
            rate = self.calibration_rate = self._rate(cal)
            steps = max(60, int(rate * self.cfg.seconds * self.cfg.goodput_guess))
            self.say(f"[{self._t():6.1f}s] fault-free {rate:.2f} steps/s: chaos jobs of "
                     f"{steps} steps")
            window_t0 = time.monotonic()
            self.window = (self._t(), self._t() + self.cfg.seconds)
            end = window_t0 + self.cfg.seconds
            n = 1
            self.submit(self._job_file(f"chaos-{n}", steps))
            next_fault = time.monotonic() + self.rng.uniform(*self.cfg.gap_s)
            while time.monotonic() < end:
                self.due_events()
                self.watch_processes()
                self.reconcile_blocks()
                self.sample()
                if self.job_ended(self.jobs[-1]):
                    n += 1
                    self.submit(self._job_file(f"chaos-{n}", steps))
                if time.monotonic() >= next_fault:
                    self.maybe_fault()
                    next_fault = time.monotonic() + self.rng.uniform(*self.cfg.gap_s)
                time.sleep(0.2)
            self.say(f"[{self._t():6.1f}s] fault window over: healing everything")
            self.due_events(force=True)
            heal_end = time.monotonic() + 30
            while time.monotonic() < heal_end:
                self.watch_processes()
                self.due_events(force=True)
                self.reconcile_blocks()
                if all(ns.state == "up" for ns in self.nodes.values()):
                    break
                time.sleep(0.25)
            self.healed_t = self._t()

            def tick() -> None:
                self.watch_processes()
                self.due_events(force=True)
                self.reconcile_blocks()
                self.sample()

            last = self.jobs[-1]
            left = max(0, last.steps - (self._step_now() or 0))
            self._wait_job(last, 240.0 + 4 * left / max(rate, 0.1), tick)
            for job in self.jobs:
                self._job_logs(job)
        finally:
            self.stop_all()
        report = self.check()
        (self.root / "history.json").write_text(json.dumps(report, indent=1, default=str))
        return report

    def _rate(self, job: JobRun) -> float:
        """Steps per second of a job from its metrics.json (its steps' wall time)."""
        m = checker.load_metrics(job.output / "metrics.json")
        walls = [float(s.get("wall_s") or 0.0) for s in (m.get("steps") or [])][1:]
        return len(walls) / sum(walls) if walls and sum(walls) > 0 else 1.0

    def stop_all(self) -> None:
        for job in self.jobs:
            if job.proc is not None and job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait(10)
        for ns in self.nodes.values():
            if not ns.procs:
                continue
            pr = self._proc(ns)
            if pr.popen.poll() is None:
                self._term(ns)
        # Poll them all together: each one's stop time is when it exited, not when a wait
        # for the ones before it returned (that made quick stops read 7 s).
        waiting = [self._proc(ns) for ns in self.nodes.values() if ns.procs]
        deadline = time.monotonic() + self.stop_timeout_s + 10
        while waiting:
            now = time.monotonic()
            for pr in list(waiting):
                if pr.popen.poll() is not None:
                    if pr.signalled_at is not None and pr.stopped_after_s is None:
                        pr.stopped_after_s = now - pr.signalled_at
                    waiting.remove(pr)
                elif now > deadline:
                    pr.popen.kill()
                    pr.popen.wait(10)
                    waiting.remove(pr)
            time.sleep(0.05)
        for ns in self.nodes.values():
            ns.state = "down"

    # -- the checker -------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        logs = {ns.name: ns.node.log_text() for ns in self.nodes.values()}
        verdicts = [checker.one_scheduler_per_term(logs)]
        for job in self.jobs:
            m = checker.load_metrics(job.output / "metrics.json")
            v = checker.steps_exactly_once(m, job.steps)
            v.name = f"{job.name}: {v.name}"
            verdicts.append(v)
            state = str(job.result.get("state"))
            if job.rc != 0:
                state = f"{state} (fusionctl exit {job.rc})"
            v = checker.model_is_sane(job.toml, job.output, state)
            v.name = f"{job.name}: {v.name}"
            verdicts.append(v)
        exits = [checker.ProcessExit(p.node, p.popen.pid, p.popen.poll(), p.expected,
                                     p.stopped_after_s)
                 for ns in self.nodes.values() for p in ns.procs]
        verdicts.append(checker.exits_expected(exits, self.stop_timeout_s))
        verdicts.append(checker.no_leftovers(str(self.root)))
        if self.findings:
            verdicts.append(checker.Verdict("seen during the run", False,
                                            f"{len(self.findings)} finding(s)",
                                            list(self.findings)))
        ok = all(v.ok for v in verdicts)
        report = {
            "ok": ok, "seed": self.cfg.seed, "config": asdict(self.cfg) | {
                "root": str(self.root), "cluster_timers": self.cluster_timers},
            "nodes": {ns.name: ns.node_id for ns in self.nodes.values()},
            "submitter": self.submitter,
            "faults": [asdict(f) | {"start_t": round(f.start_t - self.t0, 2),
                                    "healed_t": None if f.healed_t is None
                                    else round(f.healed_t - self.t0, 2),
                                    "back_t": None if f.back_t is None
                                    else round(f.back_t - self.t0, 2)}
                       for f in self.faults],
            "jobs": [{"name": j.name, "job_id": j.job_id, "steps": j.steps, "rc": j.rc,
                      "state": j.result.get("state"),
                      "outcome": (j.result.get("outcome") or {}),
                      "started_t": round(j.started_t - self.t0, 1),
                      "ended_t": None if j.ended_t is None else round(j.ended_t - self.t0, 1),
                      "restarts": sum(1 for x in j.lines if "restart " in x and "/100:" in x),
                      "failovers": sum(1 for x in j.lines if "resubmitted to the new scheduler"
                                       in x or "this daemon is the new scheduler" in x),
                      "lines": j.lines, "calibration": j.calibration} for j in self.jobs],
            "samples": self.samples, "views": self.views,
            "verdicts": [v.as_dict() for v in verdicts],
        }
        report["calibration_steps_per_s"] = getattr(self, "calibration_rate", None)
        report["summary"] = summarize(report, getattr(self, "window", (0.0, 0.0)))
        return report

    def cleanup(self, ok: bool) -> None:
        if ok and not self.cfg.keep:
            shutil.rmtree(self.root, ignore_errors=True)


# -- the summary -------------------------------------------------------------------------------


def recovery_times(faults: list[dict[str, Any]], samples: list[dict[str, Any]]
                   ) -> list[dict[str, Any]]:
    """Per fault: seconds from its start until the job's recorded step first exceeds the step
    it had when the fault began (the work lost to a restart included); None if it never did
    (the job ended, or the next job started, first)."""
    out = []
    for f in faults:
        s0, t0 = f.get("step_before"), f["start_t"]
        rec: float | None = None
        job = next((s["job"] for s in reversed(samples) if s["t"] <= t0), None)
        if s0 is not None:
            for s in samples:
                if s["t"] <= t0 or s["job"] != job:
                    continue
                if s["step"] > s0:
                    rec = round(s["t"] - t0, 2)
                    break
        out.append({"fault": f["id"], "kind": f["kind"], "roles": f["roles"],
                    "recovered_s": rec})
    return out


def _rate_between(samples: list[dict[str, Any]], t0: float, t1: float) -> float | None:
    """Net steps per second of the job(s) in [t0, t1] (progress summed per job)."""
    total, span = 0.0, 0.0
    by_job: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        if t0 <= s["t"] <= t1:
            by_job.setdefault(s["job"], []).append(s)
    for got in by_job.values():
        if len(got) >= 2:
            total += max(0, got[-1]["step"] - got[0]["step"])
            span += got[-1]["t"] - got[0]["t"]
    return total / span if span > 0 else None


def summarize(report: dict[str, Any], window: tuple[float, float]) -> dict[str, Any]:
    faults = report["faults"]
    by_kind: dict[str, int] = {}
    for f in faults:
        key = f["kind"] + (" x2" if len(f["nodes"]) > 1 and f["kind"] != "partition" else "")
        by_kind[key] = by_kind.get(key, 0) + 1
    rec = recovery_times(faults, report["samples"])
    kinds: dict[str, dict[str, Any]] = {}
    for r in rec:
        hit = any("stage" in v or "scheduler" in v for v in r["roles"].values())
        key = f"{r['kind']} ({'job machines' if hit else 'idle or submitter'})"
        d = kinds.setdefault(key, {"n": 0, "recovered": []})
        d["n"] += 1
        if r["recovered_s"] is not None:
            d["recovered"].append(r["recovered_s"])
    for d in kinds.values():
        xs = sorted(d.pop("recovered"))
        d["median_s"] = round(statistics.median(xs), 2) if xs else None
        d["max_s"] = xs[-1] if xs else None
        d["not_recovered"] = d["n"] - len(xs)
    chaos_jobs = [j for j in report["jobs"] if not j["calibration"]]
    # The calibration job's own rate (its steps' wall time in metrics.json): the progress
    # sampled before the window included the cluster's start and the job's planning.
    fault_free = report.get("calibration_steps_per_s")
    return {
        "ok": report["ok"],
        "faults": len(faults), "faults_by_kind": by_kind,
        "submitter_faults": sum(1 for f in faults if report["submitter"] in f["nodes"]),
        "scheduler_faults": sum(1 for f in faults
                                if any("scheduler" in v for v in f["roles"].values())),
        "stage_faults": sum(1 for f in faults if any("stage" in v for v in f["roles"].values())),
        "jobs": [{k: j[k] for k in ("name", "steps", "state", "rc", "restarts", "failovers")}
                 | {"wall_s": None if j["ended_t"] is None else round(j["ended_t"]
                                                                      - j["started_t"], 1)}
                 for j in chaos_jobs],
        "steps_per_s_fault_free": None if fault_free is None else round(fault_free, 2),
        "steps_per_s_during_faults": _round(_rate_between(report["samples"], *window)),
        "steps_per_s_after_faults": _round(_rate_between(report["samples"], window[1],
                                                         math.inf)),
        "recovery_by_kind": kinds,
        "verdicts": {v["name"]: "ok" if v["ok"] else f"VIOLATED ({len(v['violations'])})"
                     for v in report["verdicts"]},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def render(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [f"chaos run, seed {report['seed']}: {'ALL CHECKS HELD' if s['ok'] else 'VIOLATIONS'}",
             f"faults: {s['faults']} {json.dumps(s['faults_by_kind'])}; on the submitter "
             f"{s['submitter_faults']}, the scheduler {s['scheduler_faults']}, a stage "
             f"{s['stage_faults']}"]
    for j in s["jobs"]:
        lines.append(f"job {j['name']}: {j['steps']} steps, {j['state']} (fusionctl exit "
                     f"{j['rc']}) in {j['wall_s']}s, {j['restarts']} restarts, "
                     f"{j['failovers']} failovers")
    lines.append(f"steps/s: fault-free (the calibration job) {s['steps_per_s_fault_free']}, "
                 f"during faults "
                 f"{s['steps_per_s_during_faults']}, after {s['steps_per_s_after_faults']}")
    lines.append("time to recover (the job's step past where it was), by fault kind:")
    for k, d in sorted(s["recovery_by_kind"].items()):
        lines.append(f"  {k:<40} n={d['n']:<3} median {d['median_s']}s max {d['max_s']}s"
                     + (f" ({d['not_recovered']} not before the job ended)"
                        if d["not_recovered"] else ""))
    for v in report["verdicts"]:
        lines.append(f"{'ok  ' if v['ok'] else 'FAIL'} {v['name']}: {v['detail']}")
        lines.extend(f"       - {x}" for x in v["violations"][:20])
    return "\n".join(lines)


def explain(report: dict[str, Any]) -> str:
    """The history and the log lines around each violation (for a failing CI run)."""
    parts = [render(report), "", "faults:"]
    for f in report["faults"]:
        parts.append(f"  {f['id']:>3} t={f['start_t']:>7}s {f['kind']:<9} "
                     f"{', '.join(f'{n} ({r})' for n, r in f['roles'].items())} "
                     f"planned {f['planned_s']:.1f}s healed {f['healed_t']} "
                     f"step before {f['step_before']}")
    for j in report["jobs"]:
        parts.append(f"job {j['name']} log:")
        parts.extend(f"  {x}" for x in j["lines"][-60:])
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=None, help="overrides --minutes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--timers", choices=("job", "harness"), default="job")
    ap.add_argument("--dir", default=None, help="run directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the directory when all held")
    ap.add_argument("--json", default=None, help="also write the summary to this file")
    ns = ap.parse_args(argv)
    cfg = Config(seconds=ns.seconds if ns.seconds is not None else ns.minutes * 60,
                 seed=ns.seed, nodes=ns.nodes, timers=ns.timers,
                 root=Path(ns.dir) if ns.dir else None, keep=ns.keep)
    run = ChaosRun(cfg)
    report = run.run()
    print(render(report))
    if not report["ok"]:
        print(f"\nhistory and logs kept in {run.root} (history.json, node*/fusiond.log)")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report["summary"], indent=1))
    run.cleanup(report["ok"])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
