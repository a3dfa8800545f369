"""fusionctl against a real daemon: exit codes, --json purity, init/token/join/leave, the
unreachable-daemon message, status rendering (no quorum, dead members), local up/down."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from fusionctl.cli import EXIT_FAILED, EXIT_NOT_SERVING, EXIT_UNREACHABLE, EXIT_USAGE, run, serving
from fusionctl.local import LocalNode, wait_until
from fusionctl.render import render_job, render_links, render_status

Capture = pytest.CaptureFixture[str]


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output is piped here (never truncated) whatever COLUMNS the runner's shell or
    pytest-xdist's workers carry: the tests read whole lines."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(scope="module")
def daemon() -> Iterator[LocalNode]:
    """One real fusiond (TLS mode, not yet in a cluster) for the whole module."""
    root = Path(tempfile.mkdtemp(prefix="fzc"))
    node = LocalNode(0, root, {
        "profile_benchmark": False, "metrics": {"listen": ""}, "dashboard": {"listen": ""},
        "net": {"listen": "127.0.0.1:0"}, "api": {"tcp": "127.0.0.1:0"},
        "cluster": {"mdns": False, "probes": False, "election_grace_s": 0.2,
                    "election_timeout_s": 0.6, "leader_lease_s": 0.4,
                    "leader_heartbeat_s": 0.1, "election_stagger_s": 0.1}})
    node.start()
    ok, _, _ = wait_until(lambda: (node.status(1.0) is not None, ""), 30)
    assert ok, node.log_text()
    yield node
    node.stop(15)
    shutil.rmtree(root, ignore_errors=True)


def _json(capsys: Capture, argv: list[str], code: int = 0) -> dict[str, object]:
    assert run(argv) == code
    out = capsys.readouterr().out
    data = json.loads(out)  # stdout holds only JSON
    assert isinstance(data, dict)
    return data


def test_unreachable_daemon_has_its_own_exit_code(tmp_path: Path, capsys: Capture) -> None:
    code = run(["--socket", str(tmp_path / "none.sock"), "status"])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE == 3
    assert "no fusiond answers" in err and "systemctl start fusiond" in err
    assert "fusionctl local up" in err
    assert run(["--socket", str(tmp_path / "none.sock"), "status", "--json"]) == 3
    assert capsys.readouterr().out == ""  # nothing half-printed on stdout


def test_help_documents_exit_codes_and_usage_errors(capsys: Capture) -> None:
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for line in ("0  success", "2  usage error", "3  no daemon answers", "4  timed out"):
        assert line in out
    assert run(["frobnicate"]) == EXIT_USAGE
    assert run([]) == EXIT_USAGE


def test_read_commands_before_a_cluster_exists(daemon: LocalNode, capsys: Capture) -> None:
    sock = ["--socket", daemon.socket]
    # unconfigured: the answer says so and what to run, and the exit code lets a script
    # tell (it used to be 0)
    st = _json(capsys, [*sock, "status", "--json"], EXIT_NOT_SERVING)
    assert st["cluster"] is None
    assert run([*sock, "status"]) == EXIT_NOT_SERVING == 8
    out = capsys.readouterr().out
    assert "scheduler  (none)" in out and "peers      (none)" in out and "fusionctl init" in out
    paths = _json(capsys, [*sock, "paths", "--json"])
    assert paths["api_socket"] == daemon.socket
    ver = _json(capsys, [*sock, "version", "--json"])
    assert ver["fusionctl"] == ver["fusiond"] and ver["protocol"] == 1
    links = _json(capsys, [*sock, "links", "--json"])
    assert links["members"] == []


def test_loopback_tcp_api_needs_the_token(daemon: LocalNode, capsys: Capture) -> None:
    paths = _json(capsys, ["--socket", daemon.socket, "paths", "--json"])
    api, token_file = str(paths["api_tcp"]), str(paths["api_token_file"])
    st = _json(capsys, ["--api", api, "--token-file", token_file, "status", "--json"],
               EXIT_NOT_SERVING)
    assert st["node"]["name"] == "node0"  # type: ignore[index]
    assert run(["--api", api, "status"]) == EXIT_FAILED
    assert "token" in capsys.readouterr().err


def test_init_token_join_leave(daemon: LocalNode, capsys: Capture) -> None:
    sock = ["--socket", daemon.socket]
    assert run([*sock, "init"]) == 0
    out = capsys.readouterr().out
    assert "created cluster c" in out and "fusionctl join fusion1." in out
    # init twice: refused, and the message says what to run instead
    assert run([*sock, "init"]) == EXIT_FAILED
    assert "fusionctl token" in capsys.readouterr().err
    tok = _json(capsys, [*sock, "token", "--json"])
    assert str(tok["token"]).startswith("fusion1.") and tok["one_time"] is True
    # join is idempotent: this node is already in the token's cluster
    joined = _json(capsys, [*sock, "join", str(tok["token"]), "--json"])
    assert joined["already_member"] is True and joined["next"] == "fusionctl status"

    def elected() -> tuple[bool, str]:
        st = daemon.status()
        view = (st or {}).get("cluster") or {}
        return view.get("leader") == (st or {}).get("node", {}).get("node_id"), "electing"

    ok, _, _ = wait_until(elected, 10)
    assert ok, daemon.log_text()
    assert run([*sock, "status"]) == 0
    out = capsys.readouterr().out
    assert "(this node)" in out and "peers      (none)" in out
    assert "quorum     yes (1 of 1 voters alive, 1 needed)" in out
    # each member's software, from its gossiped profile: one torch, no warning
    sw = _json(capsys, [*sock, "status", "--json"])["software"]
    import importlib.metadata
    import platform

    [row] = sw["nodes"]
    assert row["torch"] == importlib.metadata.version("torch") and sw["warning"] is None
    assert row["python"] == platform.python_version() and row["ops_count"] > 100
    assert len(row["ops_digest"]) == 64 and row["ops_disabled"] == [] and not sw["mixed_torch"]
    assert "software" in out and f"{row['ops_count']} ops" in out
    assert run([*sock, "remove", "n0000"]) == EXIT_FAILED
    assert "not a member" in capsys.readouterr().err
    left = _json(capsys, [*sock, "leave", "--yes", "--json"])
    assert left["left"] is True
    st = _json(capsys, [*sock, "status", "--json"], EXIT_NOT_SERVING)
    assert st["cluster"] is None and "join" in str(st["hint"])


def test_status_says_no_quorum_in_plain_words(capsys: Capture) -> None:
    me, a, b = "nme", "nalive", "ndead1"
    member = {"address": ["10.0.0.1", 7420], "source": "bootstrap", "rtt_s": 0.01,
              "bandwidth_bits_per_s": 1e9, "role": "worker"}
    view: dict[str, object] = {"leader": None, "term": 7, "has_quorum": False, "links": {},
                               "members": [
        {**member, "node_id": me, "state": "alive"},
        {**member, "node_id": a, "state": "dead"},
        {**member, "node_id": b, "state": "dead"}]}
    status = {"node": {"node_id": me, "phase": "running"}, "cluster": view}
    assert not serving(status)  # `fusionctl status` exits EXIT_NOT_SERVING
    assert serving({**status, "cluster": {**view, "has_quorum": True}})
    render_status(status)
    out = capsys.readouterr().out
    assert "scheduler  (none)  term 7" in out
    assert "NO QUORUM: this node reaches 1 of 3 members and needs 2" in out
    assert f"fusionctl remove {a}; fusionctl remove {b}" in out
    assert f"{b} (10.0.0.1:7420) is dead" in out


def test_status_shows_versions_and_warns_when_members_run_different_torch(
        capsys: Capture) -> None:
    from fusiond.profile import software_summary
    from protocol.messages import NodeProfile

    def member(node: str, torch: str, state: str = "alive", off: list[str] | None = None
               ) -> SimpleNamespace:
        return SimpleNamespace(
            node_id=node, state=state, address=("10.0.0.1", 7420),
            profile=NodeProfile(torch_version=torch, python_version="3.11.7",
                                fusiond_version="0.1.0", protocol_version=1,
                                ops_digest="a" * 64, ops_count=211,
                                ops_disabled=tuple(off or ())))

    same = [member("na", "2.13.0"), member("nb", "2.13.0"), member("nc", "2.14.1", "dead")]
    assert software_summary(same)["warning"] is None  # a dead member does not count
    members = [member("na", "2.13.0"), member("nb", "2.14.1", off=["aten.gelu.default"])]
    sw = software_summary(members)
    assert sw["mixed_torch"] and sw["torch_versions"] == {"2.13.0": ["na"], "2.14.1": ["nb"]}
    view = {"leader": "na", "term": 1, "has_quorum": True, "links": {},
            "members": [{"node_id": m.node_id, "state": m.state, "address": list(m.address),
                         "profile": m.profile.to_wire()} for m in members]}
    render_status({"node": {"node_id": "na", "phase": "running"}, "cluster": view,
                   "software": sw})
    out = capsys.readouterr().out
    [warn] = [ln for ln in out.splitlines() if ln.startswith("WARNING")]
    assert "different torch versions (2.13.0 on na; 2.14.1 on nb)" in warn
    assert "the planner places each stage only where every op of it runs" in warn
    [row] = [ln for ln in out.splitlines() if ln.startswith("nb ") and "ops" in ln]
    assert row.split()[:4] == ["nb", "2.14.1", "3.11.7", "0.1.0"]
    assert "211 ops (disabled: aten.gelu.default)" in row


def test_links_show_each_figure_with_its_accuracy_and_age(capsys: Capture) -> None:
    """`fusionctl links` (and `--json`, which is the daemon's /v1/links as is) carries each
    link's rate in bits/s, the spread of the probe round behind it and that round's age."""
    from fusiond.cluster.membership import Link
    from fusiond.cluster.service import ClusterView
    from fusiond.daemon import view_json

    now = 1.7e9
    view = ClusterView("a", "c", (), "a", 1, True, 2, 2, 2, links={
        ("a", "b"): Link(20e6, 0.03, 0.05, now - 12.4),
        ("b", "a"): Link(19.5e6, 0.031, 0.0, now - 185.0),
        ("a", "c"): Link(0.0, 0.004)})  # RTT only, never measured: no age
    data = view_json(view, now)
    ab = data["links"]["a"]["b"]
    assert ab == {"bandwidth_bits_per_s": 20e6, "rtt_s": 0.03, "bandwidth_spread_ratio": 0.05,
                  "measured_at": now - 12.4, "age_s": 12.4}
    assert data["links"]["a"]["c"]["age_s"] is None
    json.dumps(data)
    render_links({"members": ["a", "b", "c"], "links": data["links"]})
    out = capsys.readouterr().out
    assert "20.0 Mbit/s ±5%" in out and "19.5 Mbit/s" in out and "±0%" not in out
    assert "12s" in out and "3m05s" in out
    assert "age of the measurement" in out


def test_job_view_shows_each_stage_busy_and_waiting(capsys: Capture) -> None:
    status = {"stages": [{"stage": 0, "node": "n0", "busy": 0.42, "wait": 0.31},
                         {"stage": 1, "node": "n1", "busy": None, "wait": None}],
              "edges": [{"edge": "h->1", "src": 0, "dst": 1, "density": 0.1,
                         "wire_bytes": {"forward": 2048}, "dense_bytes": {"forward": 20480}},
                        {"edge": "g->1", "src": 0, "dst": 1, "density": 1.0, "encoding": "int8",
                         "wire_bytes": {"forward": 5200}, "dense_bytes": {"forward": 20480}}]}
    render_job({"job_id": "j1", "name": "gpt2", "state": "running", "step": 3, "steps": 10,
                "loss": 4.2, "first_loss": 5.5, "eta_s": 12.0, "output": "runs/gpt2",
                "plan": "2 stages", "history": [{"step": 2, "held_out_loss": 4.4},
                                                 {"tokens_per_s": 1234.0}], "status": status})
    out = capsys.readouterr().out
    assert "held-out loss 4.4000 after step 3" in out
    assert "waiting" in out and "42%" in out and "31%" in out
    assert "1,234 tokens/s" in out and "top-k 0.1" in out
    assert "int8" in out and "exact" not in out  # an int8 edge is not exact


@pytest.mark.multidaemon
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_up_and_down(capsys: Capture) -> None:
    d = Path(tempfile.mkdtemp(prefix="fzl"))
    try:
        info = _json(capsys, ["local", "up", "-n", "2", "--dir", str(d), "--json",
                              "--wait", "40"])
        nodes = info["nodes"]
        assert isinstance(nodes, list) and len(nodes) == 2
        assert all(n["running"] and n["leader"] == nodes[0]["leader"] for n in nodes)
        assert run(["local", "up", "-n", "2", "--dir", str(d)]) == EXIT_FAILED  # already up
        capsys.readouterr()
        st = _json(capsys, ["--socket", nodes[0]["socket"], "status", "--json"])
        assert len(st["cluster"]["members"]) == 2  # type: ignore[index]
        # per-peer transport metrics, on loopback
        import urllib.request

        paths = _json(capsys, ["--socket", nodes[0]["socket"], "paths", "--json"])
        url = str(paths["metrics"])
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        other = nodes[1]["node_id"]
        assert f'fusion_net_sent_bytes_total{{peer="{other}",stage="wire"}}' in text
        assert 'fusion_cluster_members{state="alive"} 2.0' in text
        assert run(["local", "down", "--dir", str(d)]) == 0
        assert "stopped 2 daemon(s)" in capsys.readouterr().err
        assert run(["--socket", nodes[0]["socket"], "status"]) == EXIT_UNREACHABLE
    finally:
        run(["local", "down", "--dir", str(d)])
        shutil.rmtree(d, ignore_errors=True)


def test_join_errors_say_what_to_do(daemon: LocalNode, capsys: Capture) -> None:
    sock = ["--socket", daemon.socket]
    assert run([*sock, "join", "fusion1.bm90LWEtdG9rZW4"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "fusionctl token" in err and "copy the whole token" in err


@pytest.mark.timeout(60)
def test_local_up_fails_fast_with_the_cause() -> None:
    import socket
    import time

    from fusionctl import local

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    d = Path(tempfile.mkdtemp(prefix="fzf"))
    try:
        t0 = time.monotonic()
        with pytest.raises(local.LocalClusterError, match=r"node0 exited with code 1") as e:
            local.up(1, d, insecure=True, wait_s=40, settings={
                "net": {"listen": f"127.0.0.1:{busy.getsockname()[1]}"}})
        assert "service net failed to start" in str(e.value)
        assert time.monotonic() - t0 < 30  # not the whole wait
    finally:
        busy.close()
        local.down(d)
        shutil.rmtree(d, ignore_errors=True)


def test_job_commands_without_a_cluster(daemon: LocalNode, tmp_path: Path,
                                        capsys: Capture) -> None:
    """The job commands' exit codes are documented; before the node is in a cluster (or
    after it left) `jobs` is empty, an unknown job is named, and a missing job file is
    refused here before anything is sent."""
    assert run(["submit", "--help"]) == 0
    out = capsys.readouterr().out
    assert "5  submit: the job failed" in out and "6  submit: the job was cancelled" in out
    sock = ["--socket", daemon.socket]
    jobs = _json(capsys, [*sock, "jobs", "--json"])
    assert jobs["jobs"] == []
    assert run([*sock, "job", "nope-123"]) == EXIT_FAILED
    err = capsys.readouterr().err  # which one depends on whether the module's node left yet
    assert "no job 'nope-123'" in err or "this node is not in a cluster" in err, err
    assert run([*sock, "submit", str(tmp_path / "missing.toml")]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "job refused" in err and "missing.toml: no such file" in err


def test_status_names_peers_marks_stale_figures_and_needs_two_views_for_high_latency(
        capsys: Capture) -> None:
    """Peers by their gossiped names; a dead peer's RTT and bandwidth are what the link did
    (stale), not what it does; one measurer's slow RTT sample is no "high latency" (it used
    to be: a single 10x sample on a busy loop was reported)."""
    def m(node: str, name: str, state: str = "alive") -> dict[str, object]:
        return {"node_id": node, "state": state, "address": ["10.0.0.1", 7420],
                "source": "mdns", "rtt_s": 0.002, "bandwidth_bits_per_s": 1e9,
                "role": "worker", "profile": {"labels": {"name": name}}}

    fast = {"bandwidth_bits_per_s": 1e9, "rtt_s": 0.002}
    slow = {"bandwidth_bits_per_s": 1e9, "rtt_s": 0.2}
    ids = ("na", "nb", "nc", "nd")
    links = {a: {b: dict(fast) for b in ids if b != a} for a in ids}
    links["na"]["nb"] = slow  # one measurer's spike
    view = {"leader": "na", "term": 1, "has_quorum": True, "links": links,
            "members": [m("na", "alpha"), m("nb", "bravo"), m("nc", "charlie"),
                        m("nd", "delta", "dead")]}
    render_status({"node": {"node_id": "na", "phase": "running"}, "cluster": view})
    out = capsys.readouterr().out
    [bravo] = [ln for ln in out.splitlines() if ln.startswith("nb ")]
    assert bravo.split()[1] == "bravo"
    [delta] = [ln for ln in out.splitlines() if ln.startswith("nd ")]
    assert "delta" in delta and delta.count("(stale)") == 2
    [charlie] = [ln for ln in out.splitlines() if ln.startswith("nc ")]
    assert "stale" not in charlie
    assert "high latency" not in out
    links["nb"]["na"] = dict(slow)  # both ends agree: that link is slow
    render_status({"node": {"node_id": "na", "phase": "running"}, "cluster": view})
    assert "high latency na <-> nb: 200.00 ms and 200.00 ms" in capsys.readouterr().out


def test_a_daemon_that_does_not_answer_in_time_is_not_called_stopped(
        tmp_path: Path, capsys: Capture) -> None:
    """Something accepts on the socket and says nothing (a busy or wedged daemon): the advice
    is to wait or allow longer, not "the daemon is not running" (what it used to say)."""
    import socket
    import threading

    path = tmp_path / "busy.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        assert run(["--socket", str(path), "--timeout", "0.3", "status"]) == EXIT_UNREACHABLE
    finally:
        stop.set()
        t.join(5)
        for s in [srv, *held]:
            s.close()
    err = capsys.readouterr().err
    assert "did not answer within 0.3 s" in err and "busy or stuck, not stopped" in err
    assert "--timeout" in err and "not running" not in err


def test_a_socket_this_user_may_not_open_is_not_called_stopped(tmp_path: Path) -> None:
    """A real unprivileged user against a root-only socket: EACCES says to join the group,
    not that the daemon is not running (what it used to say)."""
    import socket

    from tests.users import plain_user

    d = Path(tempfile.mkdtemp(prefix="fzperm"))
    d.chmod(0o755)
    path = d / "fusiond.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(path))
        srv.listen(1)
        path.chmod(0o600)
        with plain_user() as user:
            r = user.fusionctl(str(path), "status", timeout=60)
    finally:
        srv.close()
        shutil.rmtree(d, ignore_errors=True)
    assert r.returncode == EXIT_UNREACHABLE, r.stderr
    assert "permission denied" in r.stderr and "usermod -aG fusion" in r.stderr
    assert "not running" not in r.stderr


def test_a_cancelled_job_says_at_which_step() -> None:
    from fusionctl.jobs import _outcome_text

    text = _outcome_text({"job_id": "j-1", "state": "cancelled", "step": 37, "steps": 100,
                          "outcome": {}})
    assert text == "job j-1 cancelled at step 37 of 100 (`fusionctl cancel`)"
    assert "(no report)" not in text  # what it used to print


def test_the_plan_shows_each_replica_s_samples_where_it_sizes_them(capsys: Capture) -> None:
    """Replicas in micro-batches of their own sizes: the plan's text, its summary and
    `fusionctl plan`'s table say how many samples each machine runs."""
    from fusionctl.render import render_plan
    from fusiond.plan import Cluster, JobSettings, plan_opfence, plan_summary
    from fusiond.plan.render import render_plan as plan_text
    from tests.plan.test_fence import _machine
    from tests.plan.test_replicas import _chain

    cluster = Cluster.build([_machine(0, speed=1.5e12), _machine(1)], [[0, 1e12], [1e12, 0]])
    plan = plan_opfence(_chain(4, params=1e3), cluster,
                        JobSettings(micro_batch_size=10, num_micro_batches=2,
                                    sized_micro_batches=True), replicate=True)
    text = plan_text(plan)
    assert "samples" in text and "(samples: each machine's share" in text
    summary = plan_summary(plan)
    assert summary["stages"][0]["samples"] == [12, 8]
    render_plan({"plan": text, "plan_summary": summary})
    out = capsys.readouterr().out
    assert "1 (12)" in out and "1 (8)" in out and "samples" in out


def test_tables_are_readable_at_80_columns(capsys: Capture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`status`, `jobs`, `job` and `plan` print rich tables that fit an 80-column terminal
    (COLUMNS=80): the plan comes from its structured summary, not the daemon's 117-column text,
    and keeps its stages, replicas, links, reductions, prediction and idle machines."""
    import numpy as np

    from fusionctl.render import render_jobs, render_plan
    from fusiond.plan import plan_opfence, plan_summary
    from fusiond.plan.render import render_plan as plan_text
    from tests.plan.synth import random_instance

    monkeypatch.setenv("COLUMNS", "80")
    # a random instance (seed 2: 4 machines, 8 ops) whose plan has replicas and links
    inst = random_instance(np.random.default_rng(2), max_machines=4, max_ops=8)
    plan = plan_opfence(inst.graph, inst.cluster, inst.settings, replicate=True)
    assert plan.evaluation.syncs and plan.evaluation.links
    assert max(len(ln) for ln in plan_text(plan).splitlines()) > 80  # what it used to print
    summary = plan_summary(plan)
    data = {"plan": plan_text(plan), "plan_summary": summary}
    render_plan(data)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 80, [ln for ln in lines if len(ln) > 80]
    assert "stages" in out and "links" in out and "gradient reductions" in out
    assert "bottleneck:" in out and "iteration:" in out and "throughput:" in out
    assert f"on {sum(1 + len(s['replica_machine_ids']) for s in summary['stages'])} of" in out
    assert sum(ln.strip().startswith("│     +") or ln.strip().startswith("+")
               or "│ + " in ln or "(replica)" in ln for ln in lines) >= 1
    for s in summary["stages"]:
        assert s["machine_id"][:10] in out
    # a job cut by hand has no plan summary: the daemon's stage list, as it wrote it
    render_plan({"plan": "stage  machine\n    0  n0", "plan_summary": None})
    assert "stage  machine" in capsys.readouterr().out

    status = {"stages": [{"stage": 0, "node": "n0" * 10, "busy": 0.42, "wait": 0.31}],
              "edges": [{"edge": "transformer.h.2.add_5->1", "src": 0, "dst": 1,
                         "density": 0.1, "wire_bytes": {"forward": 2048, "backward": 2048},
                         "dense_bytes": {"forward": 20480, "backward": 20480}}]}
    render_job({"job_id": "j" * 12, "name": "gpt2", "state": "running", "step": 3,
                "steps": 10, "loss": 4.2, "first_loss": 5.5, "eta_s": 12.0,
                "output": "runs/gpt2", "history": [{"tokens_per_s": 1234.0}],
                "status": status, **data})
    lines = capsys.readouterr().out.splitlines()
    assert max(len(ln) for ln in lines) <= 80 and any("gradient reductions" in ln
                                                      for ln in lines)
    render_jobs({"jobs": [{"job_id": "j" * 12, "name": "a-long-job-name", "state": "running",
                           "step": 30, "steps": 1000, "loss": 3.1, "submitted_at": 1.7e9,
                           "submitter": "n" * 30, "owner": "someone", "output": "/x" * 30}],
                 "stages": []})
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(ln) for ln in lines) <= 80
    member = {"address": ["10.0.0.1", 7420], "source": "bootstrap", "rtt_s": 0.01,
              "bandwidth_bits_per_s": 1e9, "role": "worker", "state": "alive"}
    view = {"leader": "n" * 20, "term": 7, "has_quorum": True, "links": {},
            "members": [{**member, "node_id": f"{'n' * 20}{i}"} for i in range(3)]}
    render_status({"node": {"node_id": "n" * 20 + "0", "phase": "running"}, "cluster": view})
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(ln) for ln in lines) <= 80


def test_status_shows_each_gpu_and_says_when_a_driver_fails(capsys: Capture) -> None:
    """Issue 18: the profile's devices on `fusionctl status`, and a GPU whose driver fails,
    on this node (a warning) and on a peer (a health line)."""
    from protocol.messages import DeviceProfile, NodeProfile

    gpu = DeviceProfile(kind="cuda", index=0, name="NVIDIA H100", memory_bytes=80 << 30,
                        free_bytes=79 << 30, flop_per_s={"matmul": 4e14, "other": 1e12},
                        matmul_bf16_flop_per_s=8e14, mem_bw_bytes_per_s=2e12,
                        h2d_bytes_per_s=2.4e10)
    bad = DeviceProfile(kind="cuda", index=1, name="NVIDIA H100", memory_bytes=80 << 30,
                        error="cuda:1 failed: RuntimeError('ECC error')")
    mine = NodeProfile(device_kind="cuda", device_name="NVIDIA H100", devices=(gpu, bad),
                       device_error="")
    peer = NodeProfile(device_error="an NVIDIA driver is present but torch cannot use it")
    view = {"leader": "na", "term": 1, "has_quorum": True, "links": {},
            "members": [{"node_id": "na", "state": "alive", "address": ["10.0.0.1", 7420],
                         "profile": mine.to_wire()},
                        {"node_id": "nb", "state": "alive", "address": ["10.0.0.2", 7420],
                         "profile": peer.to_wire()}]}
    render_status({"node": {"node_id": "na", "phase": "running", "profile": mine.to_wire()},
                   "cluster": view})
    out = capsys.readouterr().out
    assert "gpu        cuda:0 NVIDIA H100, 79.0 of 80.0 GiB free, 400.0 TFLOP/s fp32 " in out
    assert "800.0 bf16, host->device 24.0 GB/s" in out
    assert "gpu        cuda:1 NVIDIA H100, 0.0 of 80.0 GiB free: NOT USED: cuda:1 failed" in out
    assert "nb: its GPU is not used: an NVIDIA driver is present" in out
    render_status({"node": {"node_id": "nb", "phase": "running", "profile": peer.to_wire()},
                   "cluster": view})
    out = capsys.readouterr().out
    assert "WARNING    this machine's GPU is not used: an NVIDIA driver is present" in out
