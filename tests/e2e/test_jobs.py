"""Jobs end to end on real daemons (separate fusiond processes, loopback, mutual TLS):
`fusionctl submit` captures here, the daemons train, the result lands where the job says.

- 3 daemons, compression off: the loss of every step equals single-process training of the
  same model on the same batches (rel 1e-4), and the written model loads strictly and equals
  the single-process weights (GPT-2 tiny, ResNet-18 on synthetic images, HF GPT-2);
- bad job file, unknown model, missing data, a job larger than the cluster's memory: refused
  at submit, nothing started;
- cancel mid-job: every stage stops, every daemon stays healthy, the next job succeeds.
"""

from __future__ import annotations

import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from fusiond.jobs.results import load_model_state
from fusiond.train.data import make_source
from fusiond.train.local import ReferenceTrainer
from fusiond.train.model import build_model, loss_fn
from fusiond.train.spec import default_text_path, load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(240)]

TEXT = default_text_path() / "json"

GPT2 = f"""
[job]
name = "e2e-gpt2"
steps = 20
seed = 3
output = "{{out}}"
[model]
zoo = "gpt2"
config = {{ size = "tiny" }}
[data]
path = "{TEXT}"
seq_len = 32
[optimizer]
lr = 1e-3
weight_decay = 0.1
schedule = "cosine"
warmup_steps = 3
[batch]
size = 8
micro_batches = 4
[compression]
adatopk = false
"""

RESNET = """
[job]
name = "e2e-resnet"
steps = 4
seed = 1
output = "{out}"
[model]
zoo = "resnet18"
config = { num_classes = 10, width = 8 }
[data]
kind = "images"
image_size = 16
[loss]
kind = "cross_entropy"
[optimizer]
kind = "sgd"
lr = 0.05
momentum = 0.9
weight_decay = 5e-4
[batch]
size = 8
micro_batches = 2
pipeline = "gpipe"
[compression]
adatopk = false
"""

HF = f"""
[job]
name = "e2e-hf"
steps = 4
seed = 1
output = "{{out}}"
[model]
zoo = "hf-gpt2"
[model.config]
n_layer = 2
n_head = 2
n_embd = 32
vocab_size = 256
n_positions = 64
resid_pdrop = 0.0
embd_pdrop = 0.0
attn_pdrop = 0.0
bos_token_id = 0
eos_token_id = 0
[data]
path = "{TEXT}"
seq_len = 32
[batch]
size = 8
micro_batches = 4
[compression]
adatopk = false
"""


def _write(tmp_path: Path, template: str, name: str = "job.toml") -> Path:
    p = tmp_path / name
    p.write_text(template.replace("{out}", str(tmp_path / "out")))
    return p


def _daemon_threads() -> int:
    """The intra-op thread count the test daemons run with: `LocalNode.start` passes this
    environment's OMP_NUM_THREADS, or 1 when it is unset."""
    return int(os.environ.get("OMP_NUM_THREADS") or "1")


def _reference(spec: Any) -> tuple[list[float], torch.nn.Module]:
    """Single-process training with the daemons' thread count. It must be the same: ResNet-18 on
    16 px images is chaotic (layer3/4 are 1x1, so BatchNorm normalises 4 values whose variance
    can be ~1e-4), and the float32 rounding of another summation order (2 threads instead of 1)
    grows from 5e-7 at step 0 to 2 % at step 2; with the same count the losses agree to 1e-7."""
    threads = torch.get_num_threads()
    torch.set_num_threads(_daemon_threads())
    try:
        model = build_model(spec.model, seed=spec.seed)
        rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                              data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                              micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
        return rt.train(0, spec.steps), model
    finally:
        torch.set_num_threads(threads)


def _no_stages_left(c: Cluster) -> None:
    """Every daemon answers and hosts no stage any more (their memory is freed)."""
    def check() -> tuple[bool, str]:
        for n in c.nodes:
            st = n.status(2.0)
            if st is None:
                return False, f"node{n.index} does not answer"
            hosted = n.api("GET", "/v1/jobs")["stages"]
            if hosted:
                return False, f"node{n.index} still hosts {hosted}"
        return True, "clean"

    c.wait_for(check, 15.0, "every stage freed")


@pytest.mark.parametrize("template", [GPT2, RESNET, HF], ids=["gpt2-tiny", "resnet18", "hf-gpt2"])
def test_three_daemons_match_single_process(cluster3: Cluster, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str],
                                            template: str) -> None:
    job = _write(tmp_path, template)
    lead, other = leader_and_other(cluster3)
    # GPT-2 goes through a daemon that is not the scheduler: forwarded (JobSubmit), trained,
    # and its outputs sent back (JobOutput) to be written here; the others go to the scheduler.
    submitter = other if template is GPT2 else lead
    rc, res, err = ctl(submitter, "submit", str(job), "--stages", "3", "--json",
                       capsys=capsys)
    assert rc == 0, err + cluster3.explain("job failed")
    assert res["state"] == "done"
    # the job ran at the scheduler (a lapsed lease hands it to the next one: lead, or another)
    assert res["scheduler"] != cluster3.node_id(submitter) or submitter is lead
    # fusionctl wrote the outputs (as this user) where the job says; the daemon kept them
    assert res["written"]["model.safetensors"] == str(tmp_path / "out" / "model.safetensors")
    assert set(res["outputs"]) == {"model.safetensors", "metrics.json"}
    assert len({s["node"] for s in res["status"]["stages"]}) == 3  # three daemons trained it
    import json

    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    losses = [s["loss"] for s in metrics["steps"]]
    spec = load_job(job)
    want, ref = _reference(spec)
    assert len(losses) == spec.steps
    for got, exp in zip(losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
    fresh = build_model(spec.model)
    fresh.load_state_dict(load_model_state(tmp_path / "out" / "model.safetensors"), strict=True)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)
    _no_stages_left(cluster3)


REFUSED = {
    "bad-field": (GPT2.replace("steps = 20", "steps = 20\nstpes = 20"), "job.stpes"),
    "unknown-model": (GPT2.replace('zoo = "gpt2"', 'zoo = "gpt7"'), "gpt7"),
    "missing-data": (GPT2.replace(str(TEXT), "/nonexistent/corpus"), "/nonexistent/corpus"),
    "too-large": (GPT2.replace('{ size = "tiny" }', '{ size = "tiny", n_embd = 384, '
                               'n_layer = 6, n_head = 6 }'), "GiB"),
    # issue 18: a GPU-only job on daemons without a GPU says which machines and why
    "no-gpu": (GPT2.replace("seed = 3", 'seed = 3\ndevice = "cuda"'),
               "job.device = 'cuda' but no alive member offers a usable CUDA device"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_jobs_are_refused_at_submit(cluster3: Cluster, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str], case: str) -> None:
    template, needle = REFUSED[case]
    before = cluster3.nodes[0].api("GET", "/v1/jobs")["jobs"]
    rc, _, err = ctl(cluster3.nodes[0], "submit", str(_write(tmp_path, template)),
                     capsys=capsys)
    assert rc == 1, err
    assert "refused" in err and needle in err, err
    assert cluster3.nodes[0].api("GET", "/v1/jobs")["jobs"] == before  # nothing started
    assert not (tmp_path / "out").exists()
    _no_stages_left(cluster3)


def test_cancel_mid_job_then_the_next_job_succeeds(cluster3: Cluster, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lead, node0 = leader_and_other(cluster3)  # submitted to a non-scheduler: cancel travels
    long_job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 100000"), "long.toml")
    # followed in a terminal, Ctrl-C stops following (exit 130, the terminal's cursor given
    # back by the progress bar) and the job runs on; it used to exit 1 with the cursor hidden
    job_id = _submit_in_a_terminal_then_ctrl_c(node0, long_job, tmp_path)

    def running() -> tuple[bool, str]:
        d = node0.api("GET", f"/v1/jobs/{job_id}?history=0")
        return d["step"] >= 3, f"{d['state']} at step {d['step']}"

    cluster3.wait_for(running, 60.0, "the long job running")
    # Prometheus: the coordinating daemon (the scheduler) exports the job's live figures
    url = lead.api("GET", "/v1/paths")["metrics"]
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    assert f'fusion_job_steps{{job="{job_id}"}} 100000.0' in text, text[-2000:]
    assert f'fusion_job_step{{job="{job_id}"}}' in text
    assert "fusion_job_edge_wire_bytes_total" in text
    # `leave` on a node running a stage says what is lost and, without --yes, does not leave
    rc, _, err = ctl(node0, "leave", capsys=capsys)
    assert rc == 1 and f"of job {job_id} runs here" in err and "--yes" in err, err
    assert (node0.status() or {})["node"]["phase"] == "running"
    rc, res, err = ctl(node0, "cancel", job_id, "--json", capsys=capsys)
    assert rc == 0 and res["cancelled"], err
    assert node0.api("GET", f"/v1/jobs/{job_id}?history=0")["state"] == "cancelled"
    _no_stages_left(cluster3)
    rc, res, err = ctl(node0, "logs", job_id, "--json", capsys=capsys)
    assert any("cancel" in line for line in res["lines"])
    t0 = time.monotonic()
    rc, res, err = ctl(node0, "submit", str(_write(tmp_path, GPT2.replace(
        "steps = 20", "steps = 3"))), "--stages", "3", "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err
    assert time.monotonic() - t0 < 60
    assert (tmp_path / "out" / "model.safetensors").exists()


def _in_a_terminal_then_ctrl_c(node: Any, cwd: Path, *args: str) -> str:
    """`fusionctl --socket SOCK ARGS...` on a pseudo-terminal, SIGINT a second after its
    progress bar shows; asserts exit 130 and a visible cursor at the end; returns what it
    wrote."""
    import pty
    import select
    import signal
    import subprocess
    import sys

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    p = subprocess.Popen([sys.executable, "-m", "fusionctl", "--socket", node.socket, *args],
                         stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                         close_fds=True)
    os.close(slave)
    out = b""

    def read(until: float) -> None:
        nonlocal out
        while time.monotonic() < until:
            r, _, _ = select.select([master], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    return
                if not chunk:
                    return
                out += chunk
            elif p.poll() is not None:
                return

    try:
        deadline = time.monotonic() + 90
        while b"\x1b[?25l" not in out and time.monotonic() < deadline and p.poll() is None:
            read(time.monotonic() + 0.2)  # until the bar hides the cursor to draw
        assert b"\x1b[?25l" in out, out.decode(errors="replace")[-2000:]
        read(time.monotonic() + 1.0)
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        read(time.monotonic() + 0.5)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    text = out.decode(errors="replace")
    assert rc == 130, text[-2000:]
    assert out.rfind(b"\x1b[?25h") > out.rfind(b"\x1b[?25l"), text[-2000:]
    return text


def _submit_in_a_terminal_then_ctrl_c(node: Any, job: Path, cwd: Path) -> str:
    """`submit JOB --stages 3` followed on a terminal, then Ctrl-C: the job runs on (its id)."""
    import re

    text = _in_a_terminal_then_ctrl_c(node, cwd, "submit", str(job), "--stages", "3")
    assert "the job runs on" in text
    m = re.search(r"job (\S+) started", text)
    assert m is not None, text[-2000:]
    job_id = m.group(1)
    # `logs -f` re-attaches: the log lines, and the progress bar under them
    text = _in_a_terminal_then_ctrl_c(node, cwd, "logs", "-f", job_id)
    assert "submitted" in text or "started" in text, text[-2000:]
    assert "loss" in text and "ETA" in text
    return job_id


def test_plan_prints_the_planners_table_and_starts_nothing(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node0 = cluster3.nodes[0]
    before = node0.api("GET", "/v1/jobs")["jobs"]
    rc, res, err = ctl(node0, "plan", str(_write(tmp_path, GPT2)), "--json", capsys=capsys)
    assert rc == 0, err
    # the planner ran on the live view: its machines are this cluster's members
    ids = {cluster3.node_id(n) for n in cluster3.nodes}
    assert {s["node"] for s in res["stages"]} <= ids and res["stages"]
    assert res["plan"].startswith("plan ") and "iteration:" in res["plan"]
    assert node0.api("GET", "/v1/jobs")["jobs"] == before
    assert not (tmp_path / "out").exists()


def test_resume_from_a_checkpoint_matches_single_process(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`submit --resume checkpoint-5.safetensors` trains steps 5.. from those weights: each
    loss equals single-process training from the same weights (with a fresh optimizer, as the
    checkpoint holds weights only) on the same batches and learning rates."""
    lead, _ = leader_and_other(cluster3)
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    template = GPT2.replace("steps = 20", "steps = 10\ncheckpoint_interval = 5")
    job = _write(first_dir, template)
    rc, res, err = ctl(lead, "submit", str(job), "--stages", "3", "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err
    ckpt = first_dir / "out" / "checkpoint-5.safetensors"
    assert ckpt.exists(), sorted(p.name for p in (first_dir / "out").iterdir())
    # a checkpoint of another model is refused before anything starts
    other = _write(second_dir, template.replace('{ size = "tiny" }',
                                                '{ size = "tiny", n_layer = 3 }'), "other.toml")
    rc, _, err = ctl(lead, "submit", str(other), "--resume", str(ckpt), capsys=capsys)
    assert rc == 1 and "--resume refused" in err and "another model" in err, err
    # past the job's end: refused with the flag to use
    rc, _, err = ctl(lead, "submit", str(job), "--resume", str(ckpt), "--steps", "5",
                     capsys=capsys)
    assert rc == 1 and "--steps" in err, err
    job2 = _write(second_dir, template)
    rc, res, err = ctl(lead, "submit", str(job2), "--stages", "3", "--resume", str(ckpt),
                       "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err
    import json

    metrics = json.loads((second_dir / "out" / "metrics.json").read_text())
    assert [s["step"] for s in metrics["steps"]] == list(range(5, 10))
    spec = load_job(job2)
    threads = torch.get_num_threads()
    torch.set_num_threads(_daemon_threads())
    try:
        model = build_model(spec.model, seed=spec.seed)
        model.load_state_dict(load_model_state(ckpt), strict=True)
        rt = ReferenceTrainer(model, loss_fn(spec.loss), spec.optimizer,
                              data=make_source(spec.data, spec.seed), batch_size=spec.batch.size,
                              micro_batches=spec.batch.micro_batches, total_steps=spec.steps)
        want = rt.train(5, 5)
    finally:
        torch.set_num_threads(threads)
    got = [s["loss"] for s in metrics["steps"]]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-4)
    _no_stages_left(cluster3)


def test_a_planned_job_runs(cluster3: Cluster, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Without --stages the scheduler plans the job (OP-Fence + AdaTopK on the measured links),
    as `fusionctl submit` does by default and the README's demo relies on; the log gives the
    timeouts derived from those links."""
    lead, _ = leader_and_other(cluster3)
    job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 3").replace(
        "adatopk = false", "adatopk = true"))
    rc, res, err = ctl(lead, "submit", str(job), "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err + cluster3.explain("planned job")
    assert res["plan"].startswith("plan ")
    lines = lead.api("GET", f"/v1/jobs/{res['job_id']}/logs")["lines"]
    assert any("timeouts from the measured links" in x for x in lines), lines
    _no_stages_left(cluster3)


def test_an_earlier_runs_outputs_are_never_silently_overwritten(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second run into the same output is refused before anything starts (naming the files
    and --force); with --force it replaces them; resuming from a checkpoint in that directory
    continues the run there without --force."""
    lead, _ = leader_and_other(cluster3)
    job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 6\ncheckpoint_interval = 2"))
    rc, first, err = ctl(lead, "submit", str(job), "--stages", "2", "--json", capsys=capsys)
    assert rc == 0 and first["state"] == "done", err
    out = tmp_path / "out"
    model = (out / "model.safetensors").read_bytes()
    before = lead.api("GET", "/v1/jobs")["jobs"]
    rc, _, err = ctl(lead, "submit", str(job), "--stages", "2", capsys=capsys)
    assert rc == 1 and "already holds the outputs of an earlier run" in err, err
    assert "model.safetensors" in err and "--force" in err, err
    assert lead.api("GET", "/v1/jobs")["jobs"] == before  # nothing started
    assert (out / "model.safetensors").read_bytes() == model
    assert {"checkpoint-2.safetensors", "checkpoint-4.safetensors"} <= set(first["written"])
    rc, res, err = ctl(lead, "submit", str(job), "--stages", "2", "--resume",
                       str(out / "checkpoint-4.safetensors"), "--json", capsys=capsys)
    assert rc == 0 and res["state"] == "done", err
    import json

    steps = [s["step"] for s in json.loads((out / "metrics.json").read_text())["steps"]]
    assert steps == [4, 5]
    rc, res, err = ctl(lead, "submit", str(job), "--stages", "2", "--force", "--json",
                       capsys=capsys)
    assert rc == 0 and res["state"] == "done", err
    assert set(res["written"]) == set(first["written"])
    steps = [s["step"] for s in json.loads((out / "metrics.json").read_text())["steps"]]
    assert steps == list(range(6))


def test_the_notebook_example_trains_a_module_and_gets_it_back(
        cluster3: Cluster, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """examples/notebook.py (fusionctl.notebook.train): an nn.Module defined there, captured
    here, trained on the daemons, followed step by step, returned as a module with the
    weights the daemon stored."""
    import runpy

    node0 = cluster3.nodes[0]
    monkeypatch.setenv("FUSION_API_SOCKET", node0.socket)
    example = Path(__file__).resolve().parents[2] / "examples" / "notebook.py"
    main = runpy.run_path(str(example))["main"]
    model, trained, losses = main()
    out = capsys.readouterr().out
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5, losses
    assert "after 'def' it expects" in out
    assert type(trained) is type(model) and trained is not model
    changed = [k for k, v in model.state_dict().items()
               if not torch.equal(v, trained.state_dict()[k])]
    assert changed == list(model.state_dict())  # every tensor trained; the original untouched
    job_id = out.split("job ", 1)[1].split()[0]
    assert node0.api("GET", f"/v1/jobs/{job_id}?history=0")["state"] == "done"


def test_jobs_are_seen_and_cancelled_from_any_member(
        cluster3: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`fusionctl jobs`, `job`, `logs` and `cancel` on a member that neither took the job's
    submission nor schedules it: the scheduler answers (a JobsQuery). They used to answer
    "no job ... was submitted to this daemon" there."""
    lead, submitter = leader_and_other(cluster3)
    other = next(n for n in cluster3.nodes if n is not lead and n is not submitter)
    long_job = _write(tmp_path, GPT2.replace("steps = 20", "steps = 100000"), "long.toml")
    rc, res, err = ctl(submitter, "submit", str(long_job), "--stages", "2", "--detach",
                       "--json", capsys=capsys)
    assert rc == 0, err
    job_id = res["job_id"]
    try:
        def running() -> tuple[bool, str]:
            d = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")
            return d["step"] >= 2, f"{d['state']} at step {d['step']}"

        cluster3.wait_for(running, 60.0, "the long job running")
        rc, listing, err = ctl(other, "jobs", "--json", capsys=capsys)
        assert rc == 0, err
        assert listing["cluster"]["scheduler"] == cluster3.node_id(lead)
        [brief] = [j for j in listing["cluster"]["jobs"] if j["job_id"] == job_id]
        assert brief["submitter"] == cluster3.node_id(submitter) and brief["state"] == "running"
        rc, text, _ = ctl(other, "jobs", capsys=capsys)
        assert job_id in text and "submitted on any member" in text
        rc, d, err = ctl(other, "job", job_id, "--json", capsys=capsys)
        assert rc == 0 and d["state"] == "running" and d["step"] >= 2, err
        assert d["via_scheduler"] == cluster3.node_id(lead) and d["history"]
        rc, logs, err = ctl(other, "logs", job_id, "--json", capsys=capsys)
        assert rc == 0 and logs["lines"], err
        rc, res, err = ctl(other, "cancel", job_id, "--json", capsys=capsys)
        assert rc == 0 and res["cancelled"], (res, err)
    finally:
        submitter.api("POST", f"/v1/jobs/{job_id}/cancel")

    def cancelled() -> tuple[bool, str]:
        state = submitter.api("GET", f"/v1/jobs/{job_id}?history=0")["state"]
        return state == "cancelled", state

    cluster3.wait_for(cancelled, 30.0, "the submitter seeing the job cancelled")
    rc, _, err = ctl(other, "job", "no-such-job", capsys=capsys)
    assert rc == 1 and "nor at the scheduler" in err
