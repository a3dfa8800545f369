"""Op sets: what a node runs (its torch's registry less `jobs.disabled_ops`), its digest, the
request/reply that carries the names, and the checks the scheduler and a stage make with them.

In memory: two `OpSetService`s wired by a fake network, a `JobService` with a fake view. Real
daemons: tests/e2e/test_opsets.py (one torch) and tests/e2e/test_mixed_torch.py (two)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusiond.graph import UnsupportedOpError, contiguous_assignment
from fusiond.graph.registry import check_ops, op_set, supported_ops
from fusiond.jobs.assign import assign_messages, layout_job
from fusiond.jobs.opsets import (
    FETCH_MIN_S,
    MemberOpSets,
    OpSetService,
    check_reply,
    refuse_stages,
    refuse_unrunnable,
)
from fusiond.jobs.planning import JobRefused, cluster_for_planner
from fusiond.jobs.service import JobService
from fusiond.opsets import OpSet, check_op_names, digest_of_profile, lacking_ops, ops_digest
from fusiond.train.remote import StageHost
from fusiond.train.stage import StageConfig
from protocol import ir
from protocol.messages import Message, NodeProfile, OpSetReply, OpSetRequest

NAMES = ["n0", "n1", "n2"]
LINEAR = "aten.linear.default"


# -- the op set and its digest -------------------------------------------------------------


def test_digest_is_of_the_set_not_the_order() -> None:
    a = ops_digest(["aten.add.Tensor", "sym.mul", "aten.add.Tensor"])
    assert a == ops_digest(["sym.mul", "aten.add.Tensor"])
    assert a != ops_digest(["sym.mul"]) and len(a) == 64
    assert digest_of_profile(NodeProfile(ops_digest=a)) == a
    assert digest_of_profile(NodeProfile(ops_digest="zz")) is None
    assert digest_of_profile(NodeProfile()) is None


def test_disabled_ops_leave_the_set_and_unknown_names_are_kept_apart() -> None:
    full = op_set()
    assert full.ops == supported_ops() and LINEAR in full.ops and not full.disabled
    s = op_set([LINEAR, "aten.no_such_op.default"])
    assert LINEAR not in s.ops and s.disabled == (LINEAR,)
    assert s.unknown == ("aten.no_such_op.default",)
    assert s.digest != full.digest
    assert s.profile_fields() == {"ops_digest": s.digest, "ops_count": len(full.ops) - 1,
                                  "ops_disabled": [LINEAR]}


def test_names_from_the_network_are_checked() -> None:
    assert check_op_names(["sym.mul", LINEAR], "x") == {"sym.mul", LINEAR}
    for bad in ([1], ["os.system"], ["aten.x"], ["aten." + "x" * 200 + ".default"]):
        with pytest.raises(ValueError, match="x: entry 0"):
            check_op_names(bad, "x")
    with pytest.raises(ValueError, match="more than 2"):
        check_op_names(["sym.a", "sym.b", "sym.c"], "x", limit=2)


def test_lacking_ops_names_who_lacks_what() -> None:
    got = lacking_ops({"a.b.c", LINEAR}, {"m0": frozenset({LINEAR}), "m1": None,
                                          "m2": frozenset()})
    assert got == {"a.b.c": ["m0", "m2"], LINEAR: ["m2"]}


def test_config_key_is_validated() -> None:
    from fusiond.config import load_config
    from fusiond.errors import ConfigError

    ok = load_config(env={"FUSION_JOBS_DISABLED_OPS": f"{LINEAR},sym.mul"})
    assert ok.config.jobs.disabled_ops == [LINEAR, "sym.mul"]
    with pytest.raises(ConfigError, match=r"jobs.disabled_ops = 'gelu' from environment"):
        load_config(env={"FUSION_JOBS_DISABLED_OPS": "gelu"})


# -- the stage's check at Assign -----------------------------------------------------------


def test_capture_records_torch_and_python(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    import platform

    import torch

    _, cap = captured_tiny
    assert cap.graph.captured_with == (torch.__version__, platform.python_version())
    again = ir.loads(ir.dumps(cap.graph))  # it travels with the graph, and into partitions
    assert again.captured_with == cap.graph.captured_with
    cut = contiguous_assignment(cap.graph, 2)
    layout = layout_job("j", cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})
    assert all(s.partition.graph.captured_with == cap.graph.captured_with
               for s in layout.stages)


def test_check_ops_names_the_op_why_and_both_torch_versions(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    _, cap = captured_tiny
    check_ops(cap.graph)  # everything runs here
    with pytest.raises(UnsupportedOpError, match=r"op 'aten.linear.default' in module '[^']+' "
                       r"\(node '[^']+'\) is disabled on this daemon by its operator "
                       r"\(jobs.disabled_ops"):
        check_ops(cap.graph, {LINEAR})
    # a graph from another torch with an op this registry lacks
    nodes = list(cap.graph.nodes)
    nodes[3] = dataclasses.replace(nodes[3], op="aten.new_in_9.default")
    other = dataclasses.replace(cap.graph, nodes=tuple(nodes),
                                meta={**cap.graph.meta, "torch": "9.9.9"})
    with pytest.raises(UnsupportedOpError, match=r"'aten.new_in_9.default'.* is not in this "
                       r"daemon's op registry \(torch .*\); the graph was captured with torch "
                       r"9.9.9"):
        check_ops(other)


def test_a_stage_refuses_an_assign_using_a_disabled_op(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    spec, cap = captured_tiny
    cut = contiguous_assignment(cap.graph, 3)
    layout = layout_job("j", cap.graph, cap.state, {op: NAMES[p] for op, p in cut.items()})
    assigns = assign_messages(layout, spec, cap.state, term=1, plan_version=1,
                              addresses={n: ("127.0.0.1", 1) for n in NAMES})

    class _NoNet:
        async def send(self, peer: str, msg: Message, payload: Any = ()) -> None:
            raise AssertionError("nothing is sent while building")

    msg, payload = assigns["n1"]
    StageHost(msg, payload, _NoNet())  # builds
    with pytest.raises(UnsupportedOpError, match=r"'aten.linear.default'.*jobs.disabled_ops"):
        StageHost(msg, payload, _NoNet(), config=StageConfig(disabled_ops=frozenset({LINEAR})))


# -- the request/reply between daemons -----------------------------------------------------


class _Wire:
    """In-memory peer network for `OpSetService`s; `drop` loses a peer's replies."""

    def __init__(self) -> None:
        self.services: dict[str, OpSetService] = {}
        self.drop: set[str] = set()
        self.tamper: Any = None
        self.requests = 0

    def send_for(self, me: str) -> Any:
        async def send(peer: str, msg: Message, payload: Any = ()) -> None:
            if isinstance(msg, OpSetRequest):
                self.requests += 1
            if me in self.drop:
                return
            if isinstance(msg, OpSetReply) and self.tamper is not None:
                msg = self.tamper(msg)
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self.services[peer].handle(me, msg)))

        return send

    def add(self, node: str, ops: OpSet) -> OpSetService:
        svc = OpSetService(node_id=node, local=ops, send=self.send_for(node))
        self.services[node] = svc
        return svc


def _member(node: str, ops: OpSet | None, state: str = "alive", **extra: Any) -> Any:
    prof = NodeProfile(torch_version="2.13.0", gflops=100.0, memory_bytes=1 << 30, **extra)
    if ops is not None:
        prof = dataclasses.replace(prof, ops_digest=ops.digest, ops_count=len(ops.ops),
                                   ops_disabled=tuple(ops.disabled))
    return SimpleNamespace(node_id=node, state=state, address=("127.0.0.1", 1), profile=prof,
                           rtt_s=0.001)


async def test_the_scheduler_fetches_each_unseen_digest_once_and_checks_it() -> None:
    wire = _Wire()
    full, lacking = op_set(), op_set([LINEAR])
    sched = wire.add("n0", full)
    for n, s in (("n1", lacking), ("n2", lacking), ("n3", full)):
        wire.add(n, s)
    view = SimpleNamespace(members=[_member("n0", full), _member("n1", lacking),
                                    _member("n2", lacking), _member("n3", full),
                                    _member("old", None), _member("n4", lacking, "dead")])
    got = await sched.resolve(view)
    assert got.ops["n0"] == full.ops and got.ops["n3"] == full.ops  # its own: cached
    assert got.ops["n1"] == lacking.ops == got.ops["n2"]
    assert got.ops["old"] is None and "n4" not in got.ops and got.unknown == {}
    assert wire.requests == 1 and sched.fetched == 1  # one digest, one request
    again = await sched.resolve(view)
    assert again.ops == got.ops and wire.requests == 1  # cached per digest
    await sched.close()


async def test_a_bad_or_missing_reply_leaves_the_member_out_with_the_reason() -> None:
    wire = _Wire()
    full, lacking = op_set(), op_set([LINEAR])
    sched = wire.add("n0", full)
    wire.add("n1", lacking)
    view = SimpleNamespace(members=[_member("n0", full), _member("n1", lacking)])
    # names that do not hash to the digest (a lying or corrupted peer)
    wire.tamper = lambda m: dataclasses.replace(m, ops=(*m.ops, "aten.extra.default"))
    got = await sched.resolve(view)
    assert "n1" in got.unknown and "hash to" in got.unknown["n1"]
    # no reply at all: waits FETCH_MIN_S (the member's loop may be busy), then gives up
    wire.tamper = None
    wire.drop.add("n1")
    t0 = asyncio.get_running_loop().time()
    got = await sched.resolve(view)
    assert "no answer within" in got.unknown["n1"]
    assert asyncio.get_running_loop().time() - t0 >= FETCH_MIN_S * 0.9
    await sched.close()


def test_check_reply_refuses_what_it_should() -> None:
    s = op_set([LINEAR])
    good = OpSetReply(request_id=1, digest=s.digest, ok=True, ops=tuple(sorted(s.ops)))
    assert check_reply(good, s.digest) == s.ops
    from fusiond.errors import RemoteError

    for bad, why in ((dataclasses.replace(good, ok=False, reason="changed"), "refused"),
                     (dataclasses.replace(good, digest="0" * 64), "answered for digest"),
                     (dataclasses.replace(good, ops=("rm -rf /",)), "not an op name"),
                     (dataclasses.replace(good, ops=good.ops[1:]), "hash to")):
        with pytest.raises(RemoteError, match=why):
            check_reply(bad, s.digest)


async def test_a_request_for_another_digest_is_refused() -> None:
    wire = _Wire()
    a = wire.add("a", op_set())
    b = wire.add("b", op_set([LINEAR]))
    got: list[OpSetReply] = []

    async def keep(peer: str, msg: Message, payload: Any = ()) -> None:
        assert isinstance(msg, OpSetReply)
        got.append(msg)

    b.send = keep
    await b.handle("a", OpSetRequest(request_id=5, digest=a.local.digest))
    assert got and not got[0].ok and "runs op set" in got[0].reason


# -- the scheduler's checks ----------------------------------------------------------------


def test_cluster_for_planner_carries_the_op_sets() -> None:
    lacking = op_set([LINEAR])
    view = SimpleNamespace(members=[_member("n0", None), _member("n1", lacking)], links={})
    cluster, _, _ = cluster_for_planner(view, op_sets={"n1": lacking.ops})
    assert [m.ops for m in cluster.machines] == [None, lacking.ops]


def test_refusals_name_the_op_the_machines_and_why(captured_tiny) -> None:  # type: ignore[no-untyped-def]
    _, cap = captured_tiny
    lacking = op_set([LINEAR])
    profiles = {n: NodeProfile(ops_disabled=(LINEAR,), torch_version="2.13.0") for n in NAMES}
    everywhere = MemberOpSets({n: lacking.ops for n in NAMES}, {}, profiles)
    msg = refuse_unrunnable(cap.graph, everywhere, NAMES)
    assert msg is not None and "op 'aten.linear.default' runs on no live machine" in msg
    assert "n0 (disabled by its jobs.disabled_ops), n1 (" in msg and "captured with torch" in msg
    some = MemberOpSets({"n0": None, "n1": lacking.ops}, {}, profiles)
    assert refuse_unrunnable(cap.graph, some, ["n0", "n1"]) is None
    cut = contiguous_assignment(cap.graph, 2)
    stages = {p: (["n0", "n1"][p], [op for op, q in cut.items() if q == p]) for p in range(2)}
    why = refuse_stages(cap.graph, stages, some, 2)
    assert why is not None and why.startswith("--stages 2: stage 1 goes to n1, which cannot "
                                              "run op 'aten.linear.default' (disabled")
    assert "without --stages" in why


JOB = """
[job]
name = "ops"
steps = 2
[model]
zoo = "gpt2"
config = { size = "tiny" }
[data]
path = "json"
seq_len = 32
[batch]
size = 4
micro_batches = 2
"""


async def test_submit_refuses_an_op_no_live_machine_runs_and_a_stages_cut_onto_one(
        tmp_path: Path) -> None:
    """JobService.submit (dry run) on a fake view: with every live member lacking linear the
    job is refused naming the op and the machines; with one lacking it, the planner avoids it
    and a `--stages 3` cut that puts a stage there is refused naming the stage."""
    from fusiond.jobs.submit import prepare_job
    from fusiond.jobs.upload import Upload
    from fusiond.train.spec import default_text_path

    (tmp_path / "job.toml").write_text(JOB.replace('"json"', f'"{default_text_path()}/json"'))
    job = prepare_job(tmp_path / "job.toml")
    from fusiond.jobs.submit import corpus_for_upload

    digest, corpus = corpus_for_upload(job.spec)
    meta = {"toml": job.toml_text, "base": job.base, "out_base": job.out_base,
            "data_digest": digest, "data_default": not corpus}
    upload = Upload(meta, job.graph_bytes, job.state_bytes, corpus)
    wire = _Wire()
    full, lacking = op_set(), op_set([LINEAR])
    sched = wire.add("n0", full)

    def service(sets: dict[str, OpSet], dead: set[str] = frozenset()) -> JobService:  # type: ignore[assignment]
        for n, s in sets.items():
            if n not in wire.services:
                wire.add(n, s)
            wire.services[n].local = s
        members = [_member(n, s, "dead" if n in dead else "alive") for n, s in sets.items()]
        view = SimpleNamespace(members=members, links={}, leader="n0", term=1,
                               has_quorum=True)  # n0 is the scheduler

        async def send_raw(peer: str, msg: object, payload: object = ()) -> None:
            raise AssertionError("a dry run sends nothing")

        return JobService(node_id="n0", send_raw=send_raw, view=lambda: view, op_sets=sched)

    sched.local = lacking
    sched._remember(lacking.digest, lacking.ops)
    svc = service({"n0": lacking, "n1": lacking, "n2": full}, dead={"n2"})
    with pytest.raises(JobRefused, match=r"op 'aten.linear.default' runs on no live machine "
                       r"\(n0 \(disabled by its jobs.disabled_ops\), n1 \(disabled"):
        await svc.submit(upload, dry_run=True)
    # the only member that runs linear does not answer for its op list: left out, and said so
    wire.drop.add("n2")
    svc = service({"n0": lacking, "n1": lacking, "n2": op_set(["sym.mul"])})
    with pytest.raises(JobRefused, match=r"runs on no live machine.*; n2 was left out: its op "
                       r"list \(digest \w+\) could not be fetched: n2: no answer within"):
        await svc.submit(upload, dry_run=True)
    wire.drop.clear()
    svc = service({"n0": full, "n1": full, "n2": lacking})
    sched.local = full
    summary = await svc.submit(upload, dry_run=True)
    on_n2 = [s for s in summary["plan_summary"]["stages"] if s["machine_id"] == "n2"]
    assert "note: n2 cannot run aten.linear.default" in summary["plan"]
    ops = {n.id: n.op for n in job.captured.graph.nodes}
    order = [n.id for n in job.captured.graph.nodes]
    for s in on_n2:
        assert LINEAR not in {ops[i] for i in order[s["start_op"]:s["stop_op"]]}
    with pytest.raises(JobRefused, match=r"--stages 3: stage 2 goes to n2, which cannot run "
                       r"op 'aten.linear.default'"):
        await svc.submit(Upload({**meta, "stages": 3}, job.graph_bytes, job.state_bytes, corpus),
                         dry_run=True)
    await sched.close()
