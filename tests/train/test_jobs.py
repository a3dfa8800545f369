"""A job end to end over loopback peer links: Assign -> Ready -> JobStart -> StageStep ->
JobResult, with the scheduler also running a stage; a dead stage and a cancel end the job with
a report, and leave every worker empty."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fusiond.graph import contiguous_assignment
from fusiond.harness.inproc import InProcNode, inproc_cluster
from fusiond.jobs.assign import layout_job
from fusiond.jobs.coordinator import JobCoordinator, write_outputs
from fusiond.jobs.results import load_model_state
from fusiond.jobs.worker import local_sender
from fusiond.net.transport import NetConfig
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer, StepMetrics
from fusiond.train.model import build_model, loss_fn
from fusiond.train.stage import StageConfig
from protocol.messages import Message

pytestmark = pytest.mark.slow

NAMES = ["n0", "n1", "n2"]


Node = InProcNode


@contextlib.asynccontextmanager
async def cluster(stage_config: StageConfig | None = None) -> AsyncIterator[dict[str, Node]]:
    cfg = NetConfig(connect_timeout_s=2, handshake_timeout_s=2, backoff_max_s=0.5)
    async with inproc_cluster(len(NAMES), stage_config=stage_config, net_config=cfg,
                              prefix="n") as nodes:
        yield nodes


def coordinator(nodes: dict[str, Node], spec: Any, cap: Any, job_id: str = "job-7",
                **kw: Any) -> JobCoordinator:
    cut = contiguous_assignment(cap.graph, 3)
    layout = layout_job(job_id, cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})
    n0 = nodes["n0"]
    c = JobCoordinator(send=local_sender("n0", n0.net.send, n0.dispatch), spec=spec,
                       captured=cap, layout=layout,
                       addresses={n: x.net.address for n, x in nodes.items()}, term=1, **kw)
    n0.coordinators.append(c)
    return c


async def test_job_runs_to_a_model_equal_to_single_process(captured_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=6, checkpoint_interval=2)
    seen: list[StepMetrics] = []
    ckpts: dict[int, dict[str, torch.Tensor]] = {}
    running: list[int] = []  # steps seen when on_running fired: every stage Ready, none run
    async with cluster() as nodes:
        c = coordinator(nodes, spec, cap, on_step=seen.append, tokens_per_sample=32,
                        on_checkpoint=lambda s, st: ckpts.__setitem__(s, st),
                        on_running=lambda: running.append(len(seen)))
        out = await asyncio.wait_for(c.run(), 120)
        assert out.ok, out.failure
        assert running == [0]
        assert all(not n.worker.jobs() for n in nodes.values())
    model = build_model(spec.model, seed=spec.seed)
    rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                          data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                          micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
    want = rt.train(0, 2)
    assert sorted(ckpts) == [1, 3]  # after 2 and 4 steps; the final model is the result
    for k, v in model.state_dict().items():  # the checkpoint after 2 steps is the eager model's
        torch.testing.assert_close(ckpts[1][k], v, rtol=1e-4, atol=1e-5, msg=k)
    want += rt.train(2, spec.steps - 2)
    assert [m.step for m in seen] == list(range(spec.steps))
    for m, w in zip(seen, want, strict=True):
        assert m.loss == pytest.approx(w, rel=1e-4)
        assert set(m.stage_busy) == {0, 1, 2} and m.wire_bytes > 0
    st = c.status()
    assert st["state"] == "done" and st["step"] == spec.steps - 1 and st["loss"] == seen[-1].loss
    assert [s["node"] for s in st["stages"]] == NAMES
    assert all(e["wire_bytes"]["forward"] > 0 and e["density"] == 1.0 for e in st["edges"]
               if e["dense_bytes"].get("backward", 0) > 0)
    from prometheus_client import generate_latest

    from fusiond.jobs.metrics import JobCollector
    from fusiond.metrics import make_registry

    text = generate_latest(make_registry(JobCollector(lambda: [c]))).decode()
    assert 'fusion_job_loss{job="job-7"}' in text
    assert 'fusion_job_edge_wire_bytes_total{direction="forward"' in text
    assert 'fusion_job_stage_busy_ratio{job="job-7",node="n1",stage="1"}' in text
    assert 'fusion_job_stage_wait_ratio{job="job-7",node="n1",stage="1"}' in text
    assert all(0 <= s["wait"] <= 1 for s in st["stages"])
    paths = write_outputs(out, tmp_path / "run")
    fresh = build_model(spec.model)
    fresh.load_state_dict(load_model_state(paths["model"]), strict=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)
    text = paths["metrics"].read_text()
    assert '"ok": true' in text and text.count('"tokens_per_s"') == spec.steps


async def test_dead_stage_fails_the_job_with_a_report(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=10_000)
    async with cluster(StageConfig(recv_timeout_s=5)) as nodes:
        killed = asyncio.Event()

        def on_step(m: StepMetrics) -> None:
            if m.step == 2 and not killed.is_set():
                killed.set()
                # the daemon on n2 dies: its sockets close, its stage stops
                asyncio.get_running_loop().create_task(kill(nodes["n2"]))

        async def kill(node: Node) -> None:
            await node.worker.close()
            await node.net.close()

        c = coordinator(nodes, spec, cap, on_step=on_step)
        t0 = asyncio.get_running_loop().time()
        out = await asyncio.wait_for(c.run(), 60)
        took = asyncio.get_running_loop().time() - t0
        assert not out.ok and out.failure is not None
        # no membership signal here: the neighbours' bounded waits expire, and the one stage
        # that stays silent is named
        assert (out.failure.node, out.failure.stage) == ("n2", 2), out.failure
        assert out.failure.step >= 2 and "stopped responding" in out.failure.cause
        assert "no backward" in out.failure.cause
        assert took < 30
        await asyncio.sleep(0.5)
        assert not nodes["n0"].worker.jobs() and not nodes["n1"].worker.jobs()


async def test_membership_failure_and_cancel_free_every_stage(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=10_000)
    async with cluster() as nodes:
        c = coordinator(nodes, spec, cap,
                        on_step=lambda m: m.step == 1 and c.node_failed("n1", "heartbeats lost"))
        out = await asyncio.wait_for(c.run(), 60)
        assert not out.ok and out.failure is not None
        assert (out.failure.node, out.failure.stage) == ("n1", 1)
        assert "heartbeats lost" in str(out.failure) and "stage 1" in str(out.failure)
        await asyncio.sleep(0.5)
        # every stage got JobCancel (n1 too: the detector may have been wrong) and is gone
        assert all(not n.worker.jobs() for n in nodes.values())
        # cancel: a second job on the same workers
        stepped = asyncio.Event()
        c2 = coordinator(nodes, spec, cap, job_id="job-8", on_step=lambda m: stepped.set())
        task = asyncio.create_task(c2.run())
        await asyncio.wait_for(stepped.wait(), 30)
        await c2.cancel()
        out2 = await asyncio.wait_for(task, 30)
        assert not out2.ok and out2.failure is not None and "cancelled" in out2.failure.cause
        await asyncio.sleep(0.5)
        assert all(not n.worker.jobs() for n in nodes.values())


async def test_densities_readapt_during_the_job(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    spec = replace(spec, steps=6)
    seen: list[StepMetrics] = []
    async with cluster() as nodes:
        c: JobCoordinator

        def on_step(m: StepMetrics) -> None:
            seen.append(m)
            if m.step == 1:
                edges = {e.edge for e in c.layout.edges()}
                asyncio.get_running_loop().create_task(c.set_densities(dict.fromkeys(edges, 0.1)))

        c = coordinator(nodes, spec, cap, on_step=on_step)
        out = await asyncio.wait_for(c.run(), 120)
        assert out.ok, out.failure
        with pytest.raises(Exception, match="not a cut edge"):
            await c.set_densities({"nope->1": 0.5})
    assert all(e.density is None for e in seen[0].edges)
    assert all(e.density == 0.1 for e in seen[-1].edges)
    assert seen[-1].wire_bytes < 0.25 * seen[0].wire_bytes


async def test_codecs_readapt_during_the_job(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """The per-link choice's re-adaptation: the scheduler switches every cut edge to int4, then
    one to top-k; the senders switch, the receivers answer each forward as it came."""
    from fusiond.train.codec import EdgeCodec

    spec, cap = captured_tiny
    spec = replace(spec, steps=8)
    seen: list[StepMetrics] = []
    async with cluster() as nodes:
        c: JobCoordinator

        def on_step(m: StepMetrics) -> None:
            seen.append(m)
            edges = sorted(e.edge for e in seen[0].edges if e.backward_dense)  # float ones
            if m.step == 1:
                asyncio.get_running_loop().create_task(
                    c.set_codecs(dict.fromkeys(edges, EdgeCodec("int4"))))
            if m.step == 4:
                asyncio.get_running_loop().create_task(
                    c.set_codecs({edges[0]: EdgeCodec("raw", 0.25)}))

        c = coordinator(nodes, spec, cap, on_step=on_step)
        out = await asyncio.wait_for(c.run(), 120)
        assert out.ok, out.failure
        with pytest.raises(Exception, match="not a cut edge"):
            await c.set_codecs({"nope->1": EdgeCodec("int8")})
        shown = {e["edge"]: e for e in c.status()["edges"]}  # fusionctl job ID's edges
    first = {e.edge: e for e in seen[0].edges if e.backward_dense}
    last = {e.edge: e for e in seen[-1].edges if e.backward_dense}
    assert len(first) >= 2 and all(e.forward_wire >= e.forward_dense for e in first.values())
    top, *rest = sorted(last)
    assert last[top].density == 0.25
    assert shown[top]["density"] == 0.25 and shown[top]["encoding"] == "raw"
    assert all(shown[e]["encoding"] == "int4" and shown[e]["density"] == 1.0 for e in rest)
    for e in rest:  # int4: half a byte per element and a scale per 256, both ways
        assert 0.12 < last[e].forward_wire / last[e].forward_dense < 0.15
        assert 0.12 < last[e].backward_wire / last[e].backward_dense < 0.15


async def test_a_lost_step_report_ends_the_attempt_instead_of_leaving_a_hole(  # type: ignore[no-untyped-def]
        captured_tiny) -> None:
    """The chaos check's finding: a failed dial drops the frames queued on it, so a stage's
    report of a step can be lost while its later reports arrive. The step then never had all
    its stages' reports and was silently missing from the history (metrics.json) of a job
    that ended `done`. A stage reports its steps in order: a later one than expected ends the
    attempt, naming the lost steps (the restart resumes from a checkpoint before them); a
    report lost at the very end (nothing follows it) fails the attempt when it finishes."""
    spec, cap = captured_tiny
    for lost in (2, 5):
        async with cluster() as nodes:
            c = coordinator(nodes, spec=replace(spec, steps=6), cap=cap, job_id=f"lost-{lost}")
            on_step = c._on_step

            def drop(peer: str, msg: Any, lost: int = lost, on_step: Any = on_step) -> None:
                if not (msg.step == lost and msg.partition == 1):  # this frame is lost
                    on_step(peer, msg)

            c._on_step = drop  # type: ignore[method-assign]
            out = await asyncio.wait_for(c.run(), 120)
            assert not out.ok and out.failure is not None, f"step {lost} lost, yet ok"
            assert f"its reports of steps {lost}.." in out.failure.cause, out.failure
            assert "never reached the scheduler" in out.failure.cause
            assert (out.failure.node, out.failure.stage) == ("n1", 1), out.failure
            assert [m.step for m in c._metrics] == list(range(lost))


async def test_stages_in_their_own_processes(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    from fusiond.harness.inproc import inproc_cluster
    from fusiond.harness.node import spawn_nodes

    spec, cap = captured_tiny
    spec = replace(spec, steps=3)
    losses: list[float | None] = []
    async with inproc_cluster(1) as here:
        n0 = here["node0"]
        async with spawn_nodes(["node1", "node2"], extra={"node0": n0.net.address}) as procs:
            for p in procs.values():
                n0.net.add_peer_address(p.name, p.address)
            names = ["node0", "node1", "node2"]
            cut = contiguous_assignment(cap.graph, 3)
            layout = layout_job("procs", cap.graph, cap.state,
                                {op: names[i] for op, i in cut.items()})
            c = JobCoordinator(send=n0.send_fn(), spec=spec, captured=cap, layout=layout,
                               addresses={"node0": n0.net.address}
                               | {n: p.address for n, p in procs.items()},
                               term=1, on_step=lambda m: losses.append(m.loss))
            n0.coordinators.append(c)
            out = await asyncio.wait_for(c.run(), 120)
        assert all(p.proc.returncode == 0 for p in procs.values())
    assert out.ok, out.failure
    rt = ReferenceTrainer(build_model(spec.model, seed=spec.seed), loss_fn(spec.loss),
                          spec.optimizer, data=make_source(spec.data, spec.seed),
                          batch_size=spec.batch.size, micro_batches=spec.batch.micro_batches,
                          total_steps=spec.steps)
    for got, exp in zip(losses, rt.train(0, spec.steps), strict=True):
        assert got == pytest.approx(exp, rel=1e-4)


async def test_killing_a_stage_process_fails_the_job_naming_it(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    from fusiond.harness.inproc import inproc_cluster
    from fusiond.harness.node import spawn_nodes

    spec, cap = captured_tiny
    spec = replace(spec, steps=10_000)
    async with inproc_cluster(1, stage_config=StageConfig(recv_timeout_s=5)) as here:
        n0 = here["node0"]
        async with spawn_nodes(["node1", "node2"], extra={"node0": n0.net.address},
                               recv_timeout_s=5) as procs:
            for p in procs.values():
                n0.net.add_peer_address(p.name, p.address)
            names = ["node0", "node1", "node2"]
            cut = contiguous_assignment(cap.graph, 3)
            layout = layout_job("kill", cap.graph, cap.state,
                                {op: names[i] for op, i in cut.items()})

            def on_step(m: StepMetrics) -> None:
                if m.step == 2 and procs["node2"].proc.returncode is None:
                    procs["node2"].proc.kill()  # SIGKILL: no goodbye

            c = JobCoordinator(send=n0.send_fn(), spec=spec, captured=cap, layout=layout,
                               addresses={"node0": n0.net.address}
                               | {n: p.address for n, p in procs.items()},
                               term=1, on_step=on_step)
            n0.coordinators.append(c)
            t0 = asyncio.get_running_loop().time()
            out = await asyncio.wait_for(c.run(), 60)
            took = asyncio.get_running_loop().time() - t0
            assert not out.ok and out.failure is not None
            assert (out.failure.node, out.failure.stage) == ("node2", 2), out.failure
            assert took < 30
            await asyncio.sleep(0.5)
            assert not n0.worker.jobs()
        # node1 took the JobCancel and shut down cleanly when asked
        assert procs["node1"].proc.returncode == 0


def test_custom_text_is_shipped_to_the_data_stages(captured_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from fusiond.graph import state_from_bytes
    from fusiond.jobs.assign import assign_messages
    from fusiond.train.data import TextWindows, _load_tokens
    from fusiond.train.remote import DATA_TOKENS_KEY, StageHost

    spec, cap = captured_tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("for i in range(10):\n    print(i * i)\n" * 300)
    spec = replace(spec, data=replace(spec.data, path=corpus))
    want = TextWindows(corpus, seq_len=spec.data.seq_len, seed=spec.seed,
                       heldout=spec.data.heldout).batch(3, 8)
    cut = contiguous_assignment(cap.graph, 3)
    layout = layout_job("ship", cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})
    assigns = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                              addresses={n: ("127.0.0.1", 1) for n in NAMES})
    has = {n: DATA_TOKENS_KEY in state_from_bytes(p) for n, (_, p) in assigns.items()}
    assert has == {"n0": True, "n1": False, "n2": True}  # inputs on stage 0, targets on 2
    corpus.unlink()  # the machines do not have the file
    _load_tokens.cache_clear()

    class _NoNet:
        async def send(self, peer: str, msg: Message, payload: Any = ()) -> None:
            raise AssertionError("nothing is sent while building")

    for n in ("n0", "n2"):
        msg, payload = assigns[n]
        host = StageHost(msg, payload, _NoNet())
        data = host.executor.data
        assert data is not None
        got = data.batch(3, 8)
        assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)


def test_corpus_is_read_where_needed_and_checked_against_the_submitters_hash(
        captured_tiny, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A daemon-submitted job carries the submitter's corpus hash: the data stages read the
    default corpus from their own standard library (not the scheduler's path) and refuse to
    train on different tokens; a shipped corpus needs no file anywhere."""
    import numpy as np

    from fusiond.errors import RemoteError
    from fusiond.jobs.assign import Corpus, assign_messages
    from fusiond.train import remote
    from fusiond.train.data import corpus_digest, text_tokens
    from fusiond.train.remote import StageHost

    spec, cap = captured_tiny
    tokens = text_tokens(spec.data)  # the submitter's read (the stdlib's json package)
    # "this machine's standard library" is, for the test, the same json package
    monkeypatch.setattr(remote, "default_text_path", lambda: spec.data.path)
    away = replace(spec, data=replace(spec.data, path=Path("/nonexistent/scheduler/stdlib")))
    cut = contiguous_assignment(cap.graph, 3)
    layout = layout_job("corpus", cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})

    class _NoNet:
        async def send(self, peer: str, msg: Message, payload: Any = ()) -> None:
            raise AssertionError("nothing is sent while building")

    def build(corpus: Corpus) -> list[StageHost]:
        assigns = assign_messages(layout, away, cap.state, term=1, plan_version=1,
                                  addresses={n: ("127.0.0.1", 1) for n in NAMES}, corpus=corpus)
        return [StageHost(*assigns[n], _NoNet()) for n in ("n0", "n2")]  # the data stages

    want = make_source(spec.data, spec.seed).batch(2, 8)
    for host in build(Corpus(corpus_digest(tokens), default=True)):
        data = host.executor.data
        assert data is not None and torch.equal(data.batch(2, 8).inputs, want.inputs)
    with pytest.raises(RemoteError, match="is not the submitter's"):
        build(Corpus(corpus_digest(tokens[:-1]), default=True))  # another Python's stdlib
    shipped = torch.from_numpy(tokens.astype(np.uint8))
    for host in build(Corpus(corpus_digest(tokens), default=False, tokens=shipped)):
        data = host.executor.data
        assert data is not None and torch.equal(data.batch(2, 8).targets, want.targets)


def test_timeouts_follow_the_measured_links(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """The scheduler's Ready wait grows with the time the weights take over the measured link;
    a stage's input wait with the plan's predicted iteration, never below its own bound; a
    malformed bound in an Assign is refused."""
    from types import SimpleNamespace

    from fusiond.errors import RemoteError
    from fusiond.jobs.assign import assign_messages
    from fusiond.jobs.runner import RECV_TIMEOUT_ITERATIONS, SHIP_TIMEOUT_FACTOR, derived_timeouts
    from fusiond.plan import Cluster, MachineProfile
    from fusiond.train.remote import StageHost

    spec, cap = captured_tiny
    cut = contiguous_assignment(cap.graph, 3)
    layout = layout_job("t", cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})
    machines = [MachineProfile(id=n, flops={"other": 1e10}, mem_bw=5e9, op_overhead_s=2e-5,
                               memory_bytes=1e9) for n in NAMES]
    mbit = 1e6 / 8  # one Mbit/s in bytes per second, the planner's unit

    def cluster(bytes_per_s: float) -> Cluster:
        return Cluster.build(machines, [[bytes_per_s] * 3 for _ in range(3)], [[0.0] * 3] * 3)

    biggest = max(sum(cap.state[k].numel() * cap.state[k].element_size()
                      for k in s.partition.param_names if k in cap.state)
                  for s in layout.stages if s.node_id != "n0")
    plan = SimpleNamespace(iteration_s=7.5)
    ready, recv = derived_timeouts(layout, cap.state, plan, cluster(8 * mbit), "n0", 120.0)
    assert ready == pytest.approx(120.0 + SHIP_TIMEOUT_FACTOR * biggest / (8 * mbit))
    assert recv == RECV_TIMEOUT_ITERATIONS * 7.5
    fast, none = derived_timeouts(layout, cap.state, None, cluster(10_000 * mbit), "n0", 120.0)
    assert 120.0 < fast < ready and none is None
    # a fast plan (GPT-2 tiny on loopback: 26 ms) still asks for a bound an Assign may carry
    _, tiny = derived_timeouts(layout, cap.state, SimpleNamespace(iteration_s=0.026),
                               cluster(10_000 * mbit), "n0", 120.0)
    assert tiny == 1.0

    class _NoNet:
        async def send(self, peer: str, msg: Message, payload: Any = ()) -> None:
            raise AssertionError("nothing is sent while building")

    def host(recv_timeout_s: float | None, config: StageConfig | None = None) -> StageHost:
        assigns = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                                  addresses={n: ("127.0.0.1", 1) for n in NAMES},
                                  recv_timeout_s=recv_timeout_s)
        return StageHost(*assigns["n1"], _NoNet(), config=config)

    assert host(None).executor.config.recv_timeout_s == StageConfig().recv_timeout_s
    assert host(tiny).executor.config.recv_timeout_s == StageConfig().recv_timeout_s
    assert host(600.0).executor.config.recv_timeout_s == 600.0  # slow links: the plan's wait
    assert host(5.0, StageConfig(recv_timeout_s=30.0)).executor.config.recv_timeout_s == 30.0
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(RemoteError, match="recv_timeout_s"):
            host(bad)


async def test_a_refusal_fails_its_own_attempt_at_once(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """Once the scheduler has run a job, a node's refusal of the next job's Assign still
    reaches that job: every reply names its job and plan version and request ids are unique
    per process, so the finished job (still listed) does not swallow it. The attempt fails at
    once naming the node and its reason (it used to wait the whole Ready timeout and blame
    "the scheduler", before the first step)."""
    from fusiond.jobs.coordinator import FAULT_REFUSED
    from protocol.limits import Limits

    spec, cap = captured_tiny
    async with cluster() as nodes:
        first = coordinator(nodes, spec, cap, job_id="first")  # stays in n0's list
        out = await asyncio.wait_for(first.run(), 120)
        assert out.ok, out.failure
        # n2 cannot take a partition this big (its decoder limits), a real refusal path
        nodes["n2"].worker.limits = Limits(max_list_items=4)
        second = coordinator(nodes, spec, cap, job_id="second", ready_timeout_s=20.0)
        t0 = asyncio.get_running_loop().time()
        out2 = await asyncio.wait_for(second.run(), 60)
        took = asyncio.get_running_loop().time() - t0
        assert not out2.ok and out2.failure is not None
        f = out2.failure
        assert (f.node, f.stage, f.fault) == ("n2", 2, FAULT_REFUSED), f
        assert "refused its Assign (assign_failed): n2: Assign.graph" in f.cause, f.cause
        assert f.machines == ("n2",)
        assert took < 10, took  # not the 20 s Ready timeout
        await asyncio.sleep(0.5)
        assert all(not n.worker.jobs() for n in nodes.values())


async def test_the_ready_timeout_names_every_silent_node(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    from protocol.messages import Assign

    spec, cap = captured_tiny
    async with cluster() as nodes:
        for name in ("n1", "n2"):  # their daemons take the Assign and never answer
            worker = nodes[name].worker
            real = worker.handle

            async def swallow(peer: str, msg: Message, real: Any = real) -> bool:
                return True if isinstance(msg, Assign) else bool(await real(peer, msg))

            worker.handle = swallow  # type: ignore[method-assign]
        c = coordinator(nodes, spec, cap, ready_timeout_s=2.0)
        out = await asyncio.wait_for(c.run(), 30)
        assert not out.ok and out.failure is not None
        f = out.failure
        assert (f.node, f.others, f.machines) == ("n1", ("n2",), ("n1", "n2")), f
        assert "no Ready within 2s from n1 (stage 1), n2 (stage 2)" in f.cause, f.cause


async def test_a_resumed_attempts_first_tensors_wait_for_a_late_jobstart(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """The resume race: an attempt starting at step 60 (a restart or a failover from a
    checkpoint) sends JobStart to every stage; stage 0's first Forward (BULK lane) can reach
    stage 1 before stage 1's JobStart (CONTROL lane, another connection). It is kept (the
    Assign says the attempt starts at 60) and used when the step comes; it used to be refused
    ("stage 1 at step 0 got forward for step 60") and never resent, stalling the attempt for
    the stages' whole receive timeout."""
    from protocol.messages import JobStart

    spec, cap = captured_tiny
    spec = replace(spec, steps=63)
    async with cluster() as nodes:
        n1 = nodes["n1"]
        real = n1.dispatch

        async def late_start(peer: str, msg: Message) -> None:
            if isinstance(msg, JobStart):
                await asyncio.sleep(1.0)  # stage 0 is well into step 60 by then
            await real(peer, msg)

        n1.dispatch = late_start  # type: ignore[method-assign]
        seen: list[StepMetrics] = []
        c = coordinator(nodes, spec, cap, first_step=60, on_step=seen.append)
        t0 = asyncio.get_running_loop().time()
        out = await asyncio.wait_for(c.run(), 60)  # the old stall: 120 s (recv timeout)
        took = asyncio.get_running_loop().time() - t0
        assert out.ok, out.failure
        assert [m.step for m in seen] == [60, 61, 62]
        assert took < 30, took


async def test_the_jobs_own_error_blames_no_machine(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    """A job whose data has token ids past its model's vocabulary fails at step 0 on every
    machine: the stage says it is the job's fault, naming the op and module that raised, and
    the failure names no machine to exclude (a restart would fail the same way)."""
    from fusiond.jobs.coordinator import FAULT_JOB
    from fusiond.train.programs import capture_job

    spec, _ = captured_tiny
    small = replace(spec, model=replace(spec.model, config={"size": "tiny", "vocab_size": 100}))
    _, cap = capture_job(small)  # (prepare_job refuses it; an old client would not)
    async with cluster() as nodes:
        c = coordinator(nodes, small, cap)
        out = await asyncio.wait_for(c.run(), 60)
        assert not out.ok and out.failure is not None
        f = out.failure
        assert (f.fault, f.stage, f.step, f.machines) == (FAULT_JOB, 0, 0, ()), f
        text = str(f)
        assert "the job's own error, not the machine's" in text, text
        assert "IndexError" in text and "op aten.embedding.default" in text, text
        assert "module 'transformer.wte'" in text, text
        await asyncio.sleep(0.5)
        assert all(not n.worker.jobs() for n in nodes.values())


async def test_only_the_jobs_scheduler_controls_it(  # type: ignore[no-untyped-def]
        captured_tiny, caplog: pytest.LogCaptureFixture) -> None:
    """A member that is not the job's scheduler sends the stages JobCancel, JobStart,
    JobDensities and an Assign for the running job: each is ignored (logged once), and the
    job finishes. (Every stage used to obey a JobCancel from anyone: the job sat "running".)
    A JobCancel naming another attempt, even from the scheduler, stops nothing either."""
    import logging

    from fusiond.jobs.worker import Leadership
    from protocol.messages import Assign, JobCancel, JobDensities, JobStart

    spec, cap = captured_tiny
    spec = replace(spec, steps=8)
    caplog.set_level(logging.WARNING, logger="fusiond.jobs.worker")
    cfg = NetConfig(connect_timeout_s=2, handshake_timeout_s=2, backoff_max_s=0.5)
    async with inproc_cluster(3, net_config=cfg, prefix="n",
                              leadership=lambda: Leadership("n0", 1, True)) as nodes:
        c: JobCoordinator
        attacked = asyncio.Event()

        async def attack() -> None:
            n2 = nodes["n2"]
            v = c.plan_version
            edge = next(e.edge for e in c.layout.edges() if e.src_node == "n1")
            for _ in range(2):  # logged once each
                for msg in (JobCancel(job_id=c.job_id, reason="not yours"),
                            JobStart(job_id=c.job_id, plan_version=v, first_step=0),
                            JobDensities(job_id=c.job_id, plan_version=v,
                                         densities={edge: 0.01})):
                    await n2.net.send("n1", msg, ())
                await n2.net.send("n1", Assign(request_id=99, term=1, job_id=c.job_id,
                                               plan_version=v + 1, partition=1, graph=b""), ())
            # the scheduler's own cancel of another (an older) attempt stops nothing here
            await nodes["n0"].net.send("n1", JobCancel(job_id=c.job_id, reason="stale",
                                                       plan_version=v - 1), ())
            attacked.set()

        def on_step(m: StepMetrics) -> None:
            if m.step == 1:
                asyncio.get_running_loop().create_task(attack())

        seen: list[StepMetrics] = []
        c = coordinator(nodes, spec, cap, on_step=lambda m: (seen.append(m), on_step(m)),
                        plan_version=5)  # (a restarted job's: v4 was the attempt before)
        out = await asyncio.wait_for(c.run(), 120)
        assert attacked.is_set()
        assert out.ok, out.failure
        assert len(seen) == spec.steps
        assert all(e.density is None for e in seen[-1].edges)  # the densities stayed
    ignored = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    for kind in ("JobCancel", "JobStart", "JobDensities", "Assign"):
        mine = [x for x in ignored if x.startswith(f"{kind} for job {c.job_id} from n2")]
        assert len(mine) == 1, (kind, ignored)
    assert any("the scheduler of term 1 is n0, not n2" in x for x in ignored), ignored


@pytest.mark.parametrize("lost", ["Assign", "Ready"])
async def test_a_lost_assign_or_ready_is_sent_again_instead_of_waiting_out_the_timeout(  # type: ignore[no-untyped-def]
        captured_tiny, monkeypatch: pytest.MonkeyPatch, lost: str) -> None:
    """A failed dial drops the frames queued on it; the chaos check lost Assigns so, and the
    attempt waited out its whole Ready timeout (120 s by default) before restarting. The
    scheduler sends an Assign without a Ready again after a quarter of the timeout; the worker
    takes the repeat of an Assign it runs as the same one and answers Ready again. Here the
    first Assign to n1 (or n1's first Ready) is lost and the job still starts within its 4 s
    Ready timeout (the old code failed it: "no Ready within 4s")."""
    from fusiond.jobs import coordinator as coordinator_module
    from protocol.messages import Assign, Ready

    monkeypatch.setattr(coordinator_module, "ASSIGN_RESEND_MIN_S", 0.2, raising=False)
    spec, cap = captured_tiny
    spec = replace(spec, steps=2)
    assigns: list[str] = []
    async with cluster() as nodes:
        c = coordinator(nodes, spec, cap, ready_timeout_s=4.0)
        send, handle = c.send, c.handle
        dropped: list[Message] = []

        async def lossy_send(peer: str, msg: Message, payload: Any = ()) -> None:
            if isinstance(msg, Assign):
                assigns.append(peer)
                if lost == "Assign" and peer == "n1" and not dropped:
                    dropped.append(msg)  # lost on a failed dial
                    return
            await send(peer, msg, payload)

        async def lossy_handle(peer: str, msg: Message) -> bool:
            if lost == "Ready" and isinstance(msg, Ready) and peer == "n1" and not dropped:
                dropped.append(msg)
                return True
            return await handle(peer, msg)

        c.send = lossy_send  # type: ignore[method-assign]
        c.handle = lossy_handle  # type: ignore[method-assign]
        out = await asyncio.wait_for(c.run(), 60)
        assert out.ok, out.failure
    # n1's Assign went out again; on a slow machine n2 may not have answered within the 1 s
    # resend interval either and gets a repeat too, which it takes as the same Assign.
    assert dropped and assigns.count("n1") >= 2 and assigns.count("n2") >= 1, assigns
