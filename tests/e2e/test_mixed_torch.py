"""A real pair of torch versions: one daemon on torch 2.14.1 (a second virtual environment,
`scripts/mixed-torch-check` builds it; `.ci/run` too) and two on this environment's 2.13.0,
on loopback with mutual TLS, training GPT-2 tiny with `--stages 3` so every daemon runs a stage.

- `fusionctl status` shows each member's torch and warns that they differ;
- captured here (2.13.0) and captured by the 2.14.1 environment's own `fusionctl` (its export
  differs: 63 nodes instead of 68), the mixed cluster's losses equal the all-2.13.0 cluster's
  (the same daemon restarted on 2.13.0) to 1e-6, and single-process training to 1e-4;
- the 2.14.1 daemon restarted with `jobs.disabled_ops = ["aten.linear.default"]`: the planner
  keeps linear off it and a `--stages 3` cut onto it is refused naming the op.

Skips, saying how to get it, when the second environment is missing (fails instead when
FUSION_TORCH2_REQUIRED is set, as .ci/run sets it after building the environment). The
figures go to stdout (`pytest -s`), which the script prints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusionctl.local import merge
from fusiond.jobs.submit import prepare_job
from fusiond.train.spec import load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, start_cluster
from tests.e2e.test_jobs import GPT2, _reference

pytestmark = [pytest.mark.torch2, pytest.mark.multidaemon, pytest.mark.slow,
              pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
TORCH2_VENV = Path(os.environ.get("FUSION_TORCH2_VENV") or ROOT / ".venv-torch-2.14.1")
TORCH2 = os.environ.get("FUSION_TORCH2_VERSION", "2.14.1")
LINEAR = "aten.linear.default"
STEPS = 8


def _torch_of(python: Path) -> str | None:
    """The torch version `python` would import (from its metadata: no import), or None."""
    if not python.exists():
        return None
    r = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                        "print(m.version('torch')); import fusiond"],
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() if r.returncode == 0 else None


@pytest.fixture(scope="module")
def torch2_python() -> Path:
    python = TORCH2_VENV / "bin" / "python"
    version = _torch_of(python)
    if version is None or not version.startswith(TORCH2):
        # CI built it (FUSION_TORCH2_REQUIRED=1): missing is a failure
        if os.environ.get("FUSION_TORCH2_REQUIRED", "0") not in ("", "0"):
            pytest.fail(f"FUSION_TORCH2_REQUIRED is set but {TORCH2_VENV} has no torch "
                        f"{TORCH2} (found {version or 'none'})")
        pytest.skip(f"no torch {TORCH2} environment at {TORCH2_VENV} (found "
                    f"{version or 'none'}): run scripts/mixed-torch-check, which builds it "
                    "(about 6 GB, installs from local disk) and runs this test")
    return python


@pytest.fixture(scope="module")
def mixed(torch2_python: Path) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="fzm"))
    c = start_cluster(root, pythons={1: str(torch2_python)})
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def _job(dir_: Path) -> Path:
    dir_.mkdir(parents=True, exist_ok=True)
    p = dir_ / "job.toml"
    p.write_text(GPT2.replace("steps = 20", f"steps = {STEPS}").replace("{out}",
                                                                        str(dir_ / "out")))
    return p


def _losses(job: Path) -> list[float]:
    metrics = json.loads((job.parent / "out" / "metrics.json").read_text())
    return [float(s["loss"]) for s in metrics["steps"]]


def _restart(c: Cluster, i: int, *, python: str, settings: dict[str, Any]) -> None:
    node = c.nodes[i]
    node.stop()
    node.python = python
    node.settings = merge(node.settings, settings)
    node.start()
    c.wait_up()
    c.wait_agreement(timeout=60.0)

    def fresh() -> tuple[bool, str]:  # every member sees node i's new profile
        want = settings.get("jobs", {}).get("disabled_ops", [])
        me = c.node_id(node)
        for n in c.nodes:
            rows = {r["node_id"]: r for r in (n.status(2.0) or {}).get("software", {})
                    .get("nodes", [])}
            if rows.get(me, {}).get("ops_disabled") != want:
                return False, f"node{n.index} sees {rows.get(me)}"
        return True, "ok"

    c.wait_for(fresh, 30.0, f"node{i}'s new profile gossiped")


def _submit(c: Cluster, job: Path, capsys: pytest.CaptureFixture[str],
            python: Path | None = None) -> dict[str, Any]:
    """`fusionctl submit JOB --stages 3` against node0: here (this torch captures), or with
    `python`'s own fusionctl (its torch captures)."""
    if python is None:
        rc, res, err = ctl(c.nodes[0], "submit", str(job), "--stages", "3", "--json",
                           capsys=capsys)
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
        r = subprocess.run([str(python), "-m", "fusionctl", "--socket", c.nodes[0].socket,
                            "submit", str(job), "--stages", "3", "--json"],
                           capture_output=True, text=True, timeout=600, cwd=job.parent, env=env)
        rc, err = r.returncode, r.stderr
        res = json.loads(r.stdout) if rc == 0 else {}
    assert rc == 0 and res["state"] == "done", err + c.explain("job failed")
    assert len({s["node"] for s in res["status"]["stages"]}) == 3  # every daemon ran a stage
    return res


def test_mixed_torch_trains_like_one_torch_and_the_planner_avoids_a_node_lacking_an_op(
        mixed: Cluster, torch2_python: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    c = mixed
    ids = [c.node_id(n) for n in c.nodes]
    ours = _torch_of(Path(sys.executable))
    report: list[str] = []

    # 1. status: per-node versions, and the warning
    rc, st, err = ctl(c.nodes[0], "status", "--json", capsys=capsys)
    assert rc == 0, err
    rows = {r["node_id"]: r for r in st["software"]["nodes"]}
    assert rows[ids[1]]["torch"].startswith(TORCH2) and rows[ids[0]]["torch"] == ours
    assert st["software"]["mixed_torch"] and TORCH2 in st["software"]["warning"]
    rc, text, _ = ctl(c.nodes[0], "status", capsys=capsys)
    assert "WARNING    members run different torch versions" in text, text
    report.append(f"fusionctl status:\n{text}")

    # 2. the mixed cluster, captured with this torch and with the other one
    job_a = _job(tmp_path / "a")
    res = _submit(c, job_a, capsys)
    lines = c.nodes[0].api("GET", f"/v1/jobs/{res['job_id']}/logs")["lines"]
    assert any(f"members run torch {ours} on" in x and TORCH2 in x for x in lines), lines
    mixed_here = _losses(job_a)
    job_b = _job(tmp_path / "b")
    res = _submit(c, job_b, capsys, python=torch2_python)
    mixed_there = _losses(job_b)
    lines = c.nodes[0].api("GET", f"/v1/jobs/{res['job_id']}/logs")["lines"]
    assert any(f"graph captured with torch {TORCH2}" in x for x in lines), lines

    # 3. the 2.14.1 daemon without linear: the planner keeps linear off it; --stages refused
    _restart(c, 1, python=str(torch2_python), settings={"jobs": {"disabled_ops": [LINEAR]}})
    job_p = _job(tmp_path / "p")
    rc, plan, err = ctl(c.nodes[0], "plan", str(job_p), "--json", capsys=capsys)
    assert rc == 0, err
    order = [n.op for n in prepare_job(job_p).captured.graph.nodes]
    on_lacking = [s for s in plan["plan_summary"]["stages"] if s["machine_id"] == ids[1]]
    for s in on_lacking:
        assert LINEAR not in set(order[s["start_op"]:s["stop_op"]]), plan["plan"]
    report.append("plan with linear disabled on the 2.14.1 node:\n" + plan["plan"])
    rc, _, err = ctl(c.nodes[0], "submit", str(job_p), "--stages", "3", capsys=capsys)
    assert rc == 1 and f"goes to {ids[1]}, which cannot run op '{LINEAR}'" in err, err
    report.append("--stages 3 refused: " + next(x for x in err.splitlines() if LINEAR in x))

    # 4. the same daemon on this torch: the all-2.13.0 cluster
    _restart(c, 1, python="", settings={"jobs": {"disabled_ops": []}})
    rc, st, _ = ctl(c.nodes[0], "status", "--json", capsys=capsys)
    assert not st["software"]["mixed_torch"] and st["software"]["warning"] is None
    job_c = _job(tmp_path / "c")
    _submit(c, job_c, capsys)
    same = _losses(job_c)

    want, _ = _reference(load_job(job_c))
    d_here = max(abs(a - b) for a, b in zip(mixed_here, same, strict=True))
    d_there = max(abs(a - b) for a, b in zip(mixed_there, same, strict=True))
    report += [f"all-{ours} losses:         {same}",
               f"mixed, captured on {ours}: {mixed_here} (max |diff| {d_here:.3g}, "
               f"bit-identical {mixed_here == same})",
               f"mixed, captured on {TORCH2}: {mixed_there} (max |diff| {d_there:.3g}, "
               f"bit-identical {mixed_there == same})",
               f"single process:           {want}"]
    print("\n".join(["", "== mixed torch figures", *report]))
    assert len(same) == STEPS
    assert d_here <= 1e-6 and d_there <= 1e-6
    for got, exp in zip(same, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-4)
