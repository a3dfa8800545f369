"""The default corpus on real daemons: a job submitted through a daemon that is not the
scheduler, with no `data.path`, is trained on each data stage's own standard library, checked
against the submitting machine's hash (here every daemon shares one Python, so it matches), and
its losses equal single-process training on the same corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusiond.train.spec import load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other
from tests.e2e.test_jobs import _reference

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(240)]

JOB = """
[job]
name = "e2e-stdlib"
steps = 3
seed = 2
output = "{out}"
[model]
zoo = "gpt2"
config = { size = "tiny" }
[data]
seq_len = 32
[batch]
size = 8
micro_batches = 2
[compression]
adatopk = false
"""


def test_forwarded_job_on_the_default_corpus(cluster3: Cluster, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB.replace("{out}", str(tmp_path / "out")))
    lead, other = leader_and_other(cluster3)
    rc, res, err = ctl(other, "submit", str(job), "--stages", "3", "--json", capsys=capsys)
    assert rc == 0, err[-3000:] + str(res)[-3000:] + cluster3.explain("job failed")
    assert res["state"] == "done" and res["scheduler"] == cluster3.node_id(lead)
    losses = [s["loss"] for s in json.loads((tmp_path / "out" / "metrics.json").read_text())
              ["steps"]]
    want, _ = _reference(load_job(job))
    assert losses == pytest.approx(want, rel=1e-4)
