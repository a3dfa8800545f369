"""The chaos checker on synthetic inputs: each check passes on a clean history and fails, naming
what it saw, on one that breaks what it checks (a checker that cannot fail is caught here)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.chaos import checker
from tests.chaos.checker import ProcessExit

A, B, C = "n1111aaaa", "n2222bbbb", "n3333cccc"


def line(stamp: str, leader: str, term: int, own: bool = False) -> str:
    """A leadership line as `Cluster._log_leadership` writes it (daemon.py's format)."""
    return (f"2026-12-01 {stamp},000 INFO fusiond.cluster.service: cluster: scheduler is "
            f"{leader}, term {term}" + (" (this node)" if own else ""))


def test_the_leader_line_matches_what_a_daemon_logs() -> None:
    # The pattern must match the real line, or check (a) sees nothing and passes vacuously.
    import logging

    from fusiond.cluster import service

    rec = logging.LogRecord(service.log.name, logging.INFO, __file__, 1,
                            "cluster: scheduler is %s, term %d%s", (A, 7, " (this node)"), None)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")  # daemon.py's
    m = checker.LEADER_LINE.match(fmt.format(rec))
    assert m is not None and (m["leader"], m["term"], bool(m["own"])) == (A, "7", True)


def test_one_scheduler_per_term_holds_across_terms_and_restarts() -> None:
    logs = {"node0": "\n".join([line("10:00:00", A, 1, own=True), "unrelated line",
                                line("10:00:05", B, 2), line("10:00:09", B, 2)]),
            "node1": "\n".join([line("10:00:01", A, 1), line("10:00:05", B, 2, own=True)]),
            "node2": line("10:00:06", B, 2)}
    v = checker.one_scheduler_per_term(logs)
    assert v.ok, v.violations
    assert "2 terms" in v.detail and "6 leadership lines" in v.detail


def test_two_schedulers_in_one_term_fail_naming_both() -> None:
    logs = {"node0": "\n".join([line("10:00:00", A, 1, own=True), line("10:00:03", A, 3,
                                                                         own=True)]),
            "node1": line("10:00:02", B, 1, own=True),  # led term 1 too
            "node2": line("10:00:04", A, 3)}
    v = checker.one_scheduler_per_term(logs)
    assert not v.ok and len(v.violations) == 1
    assert v.violations[0].startswith(f"term 1 had 2 schedulers ({A}, {B})")
    assert "node0 at" in v.violations[0] and "node1 at" in v.violations[0]
    # two followers that follow different leaders in one term show too
    v = checker.one_scheduler_per_term({"node3": line("10:00:00", A, 4),
                                        "node4": line("10:00:00", C, 4)})
    assert not v.ok and "term 4 had 2 schedulers" in v.violations[0]


def test_no_leadership_line_at_all_fails() -> None:
    v = checker.one_scheduler_per_term({"node0": "started\nstopped\n"})
    assert not v.ok and "saw nothing" in v.violations[0]


def metrics(steps: list[int], **summary: Any) -> dict[str, Any]:
    return {"steps": [{"step": s, "loss": 4.0 - 0.01 * s} for s in steps], "summary": summary}


def test_every_step_exactly_once() -> None:
    v = checker.steps_exactly_once(metrics(list(range(10))), 10)
    assert v.ok, v.violations


@pytest.mark.parametrize(("steps", "want"), [
    ([0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9], "1 step(s) recorded more than once: 3"),
    ([0, 1, 2, 4, 5, 6, 7, 8, 9], "1 step(s) missing: 3"),
    ([0, 1, 2, 3, 4, 5, 6, 7], "2 step(s) missing: 8-9"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "record(s) of steps outside 0..9: [10]"),
    ([1, 0, 2, 3, 4, 5, 6, 7, 8, 9], "the steps are not in order"),
    ([], "10 step(s) missing: 0-9"),
])
def test_a_duplicated_missing_or_foreign_step_fails(steps: list[int], want: str) -> None:
    v = checker.steps_exactly_once(metrics(steps), 10)
    assert not v.ok and want in v.violations, v.violations


def test_a_non_finite_loss_a_thinned_history_or_no_steps_list_fail() -> None:
    m = metrics(list(range(4)))
    m["steps"][2]["loss"] = float("nan")
    v = checker.steps_exactly_once(m, 4)
    assert not v.ok and "1 step(s) without a finite loss: [2]" in v.violations
    v = checker.steps_exactly_once(metrics(list(range(4)), thinned_steps=3), 4)
    assert not v.ok and "thinned" in v.violations[0]
    v = checker.steps_exactly_once({"steps": None}, 4)
    assert not v.ok
    assert checker.load_metrics(Path("/nonexistent/metrics.json")) == {"steps": None}


def test_exits_the_nemesis_did_not_cause_fail() -> None:
    ok = [ProcessExit("node0", 10, -9, "kill"), ProcessExit("node0", 11, 0, "term", 1.0)]
    assert checker.exits_expected(ok, 5.0).ok
    bad = [ProcessExit("node1", 12, 1, ""),  # a crash
           ProcessExit("node2", 13, None, "term"),  # still running
           ProcessExit("node3", 14, 0, "term", 30.0),  # a stop that hung
           ProcessExit("node4", 15, 1, "term")]  # SIGTERM, but not a clean stop
    v = checker.exits_expected(bad, 5.0)
    assert not v.ok and len(v.violations) == 4, v.violations
    assert "node1 (pid 12) exited 1 on its own (a crash)" in v.violations


def test_a_process_left_behind_is_found(tmp_path: Path) -> None:
    marker = str(tmp_path / "chaos-run-marker")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
    try:
        # Until it has exec'd, the child's command line is still pytest's (CI scanned /proc
        # that early once and found nothing).
        deadline = time.monotonic() + 10
        while marker.encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.01)
        v = checker.no_leftovers(marker)
        assert not v.ok and f"pid {p.pid}" in v.violations[0]
    finally:
        p.kill()
        p.wait(10)
    assert checker.no_leftovers(marker).ok


TOML = """
[job]
name = "chk"
steps = 40
seed = 3
output = "{out}"
[model]
zoo = "gpt2"
config = {{ size = "tiny" }}
[data]
path = "{text}"
seq_len = 32
[optimizer]
lr = 1e-3
warmup_steps = 5
[batch]
size = 8
micro_batches = 1
"""


@pytest.mark.slow
def test_a_model_is_sane_only_when_trained_finite_and_done(tmp_path: Path) -> None:
    import torch

    from fusiond.jobs.results import save_model
    from fusiond.train.data import make_source
    from fusiond.train.model import build_model, loss_fn
    from fusiond.train.spec import default_text_path, load_job

    toml = tmp_path / "job.toml"
    toml.write_text(TOML.format(out=tmp_path / "out", text=default_text_path() / "json"))
    spec = load_job(toml)
    out = tmp_path / "out"
    out.mkdir()
    model = build_model(spec.model, seed=spec.seed)
    save_model(out / "model.safetensors", model.state_dict())  # the initial weights
    v = checker.model_is_sane(toml, out, "done")
    assert not v.ok and "is not below" in v.violations[0], v.violations
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    source, fn = make_source(spec.data, spec.seed), loss_fn(spec.loss)
    for i in range(40):
        b = source.batch(i, spec.batch.size)
        opt.zero_grad()
        fn(model(b.inputs), b.targets).backward()
        opt.step()
    save_model(out / "model.safetensors", model.state_dict())
    v = checker.model_is_sane(toml, out, "done")
    assert v.ok, v.violations
    v = checker.model_is_sane(toml, out, "failed (fusionctl exit 1)")
    assert not v.ok and "the job ended failed (fusionctl exit 1), not done" in v.violations
    state = model.state_dict()
    first = next(k for k, t in state.items() if t.is_floating_point())
    state[first] = torch.full_like(state[first], float("inf"))
    save_model(out / "model.safetensors", state)
    v = checker.model_is_sane(toml, out, "done")
    assert not v.ok and any("non-finite weights" in x for x in v.violations)
    (out / "model.safetensors").write_bytes(b"torn")
    assert not checker.model_is_sane(toml, out, "done").ok
    (out / "model.safetensors").unlink()
    assert not checker.model_is_sane(toml, out, "done").ok
