"""`python -m fusiond.train`: a small job runs to a model and metrics; a bad one exits 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fusiond.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_cli_trains_and_writes_outputs(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[job]\nname = "t"\nsteps = 4\n[model]\nzoo = "gpt2"\n'
                   'config = { size = "tiny" }\n[data]\nseq_len = 16\n'
                   '[batch]\nsize = 4\nmicro_batches = 2\n')
    r = _run([str(job), "--stages", "2", "--sample", "30", "--density", "0.5"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step      4/4" in r.stderr and r.stdout.startswith("def ")
    out = tmp_path / "runs" / "t"
    assert (out / "model.safetensors").stat().st_size > 0
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["summary"]["ok"] is True and len(doc["steps"]) == 4
    # float edges travel top-k 0.5; integer ones (sizes) stay exact
    assert {e["density"] for e in doc["steps"][-1]["edges"]} in ({0.5}, {0.5, None})


def test_cli_refuses_a_bad_job(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[job]\nsteps = 0\n[model]\nzoo = "gpt2"\n')
    r = _run([str(job)], tmp_path)
    assert r.returncode == 2
    assert "job refused: job.steps: must be in [1," in r.stderr
