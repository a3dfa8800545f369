"""Data parallelism inside a pipeline on real daemons: 2 stages x 2 replicas of GPT-2 tiny on
four daemons over loopback TLS train as single-process training on the global batch."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusiond.jobs.results import load_model_state
from fusiond.train.model import build_model
from fusiond.train.spec import load_job
from tests.daemon.harness import Cluster
from tests.e2e.conftest import ctl, leader_and_other, start_cluster
from tests.e2e.test_jobs import GPT2, _no_stages_left, _reference, _write

pytestmark = [pytest.mark.multidaemon, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster4() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="fzr"))
    c = start_cluster(root, 4)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_two_stages_by_two_replicas_match_single_process(
        cluster4: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each stage on two daemons, micro-batches dealt in turn, forwards and backwards routed to
    the replica that runs the micro-batch, the replicas' gradients (and the tied embedding's,
    on all four) summed before every step: losses and the final weights within 1e-5 of eager
    training on the whole batch (weights: atol 1e-5), and every daemon trained."""
    job = _write(tmp_path, GPT2)
    lead, _ = leader_and_other(cluster4)
    rc, res, err = ctl(lead, "submit", str(job), "--stages", "2", "--replicas", "2", "--json",
                       capsys=capsys)
    assert rc == 0, err + cluster4.explain("job failed")
    assert res["state"] == "done"
    assert len({s["node"] for s in res["status"]["stages"]}) == 4  # four daemons trained it
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    losses = [s["loss"] for s in metrics["steps"]]
    spec = load_job(job)
    want, ref = _reference(spec)
    assert len(losses) == spec.steps
    for got, exp in zip(losses, want, strict=True):
        assert got == pytest.approx(exp, rel=1e-5)
    fresh = build_model(spec.model)
    # gathering the outputs checked that both replicas of every parameter are bit-identical
    fresh.load_state_dict(load_model_state(tmp_path / "out" / "model.safetensors"), strict=True)
    for k, v in ref.state_dict().items():
        # atol 1e-5: Adam divides each element's step by its own gradient scale, so a
        # near-zero element's summation-order noise grows to ~2e-6 in 20 steps (measured;
        # 0.2 % of one step's update), as between eager and the plain pipeline
        torch.testing.assert_close(fresh.state_dict()[k], v, rtol=1e-5, atol=1e-5, msg=k)
    _no_stages_left(cluster4)


def test_replicas_without_stages_or_beyond_the_cluster_are_refused(
        cluster4: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _write(tmp_path, GPT2)
    lead, _ = leader_and_other(cluster4)
    rc, _, err = ctl(lead, "submit", str(job), "--replicas", "2", capsys=capsys)
    assert rc != 0 and "--replicas" in err and "--stages" in err
    rc, _, err = ctl(lead, "plan", str(job), "--stages", "2", "--replicas", "3", capsys=capsys)
    assert rc != 0 and "replicas" in err, err
