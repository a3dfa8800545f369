"""A long-lived daemon's memory does not grow with the jobs it ran: after 50 short jobs it holds
no more job state than after one (issue 16). Every finished record used to stay in the job
service with its coordinator, the captured model and its initial weights, the partitions'
final weights and the last checkpoint: a model's worth of bytes or more per job, kept forever.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import warnings
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from fusiond.jobs import service
from fusiond.jobs.service import JobService
from tests.train.test_service import JOB, Net, View, upload

pytestmark = pytest.mark.slow

JOBS = 50


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from fusiond.jobs.submit import prepare_job
    from fusiond.train.spec import default_text_path

    tmp = tmp_path_factory.mktemp("retain")
    p = tmp / "job.toml"
    p.write_text(JOB.format(steps=2, out=tmp / "out", data=default_text_path() / "json"))
    return prepare_job(p)


def _tensor_bytes() -> int:
    """Bytes of every distinct tensor storage the interpreter can reach."""
    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on torch's deprecated module aliases
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                try:
                    st = obj.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
                except RuntimeError:  # a fake tensor (the capture's): holds no data
                    continue
    return sum(seen.values())


async def _run_one(svc: JobService, job: Any) -> tuple[str, weakref.ref[Any]]:
    summary = await svc.submit_upload(upload(job, stages=1, steps=2))
    job_id = str(summary["job_id"])
    rec = svc.get(job_id)
    assert isinstance(rec, service._Record)
    assert rec.task is not None
    await asyncio.wait_for(asyncio.shield(rec.task), 60)
    assert rec.state == "done", rec.outcome
    coord = weakref.ref(rec.coord)
    del rec
    for _ in range(200):  # its steps are written, then it leaves the live records
        if job_id not in svc._jobs:
            break
        await asyncio.sleep(0.02)
    return job_id, coord


async def test_fifty_jobs_leave_no_more_job_state_than_one(prepared: Any,
                                                           tmp_path: Path) -> None:
    net = Net()
    view = View(["m0"], leader="m0")
    svc = JobService(node_id="m0", send_raw=net.send, view=lambda: view,
                     state_dir=tmp_path / "state")
    net.svc = svc
    await svc.start()
    try:
        first, coord = await _run_one(svc, prepared)
        records_1 = len(svc._jobs) + len(svc._remote)
        tensors_1 = _tensor_bytes()
        tracemalloc.start()
        try:
            python_1 = tracemalloc.get_traced_memory()[0]
            ids = [(await _run_one(svc, prepared))[0] for _ in range(JOBS - 1)]
            gc.collect()
            python_50 = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        records_50 = len(svc._jobs) + len(svc._remote)
        tensors_50 = _tensor_bytes()
        per_job = (python_50 - python_1) / (JOBS - 1)
        figures = (f"live records {records_1} -> {records_50}; tensor bytes {tensors_1} -> "
                   f"{tensors_50}; Python heap +{(python_50 - python_1) / 1024:.0f} KiB over "
                   f"{JOBS - 1} jobs ({per_job / 1024:.1f} KiB per job: its past record)")
        print(figures)
        assert records_1 == 0 and records_50 == 0, figures
        assert coord() is None, "the first job's coordinator is still reachable"
        assert tensors_50 <= tensors_1 + (64 << 10), figures
        assert per_job < 64 << 10, figures
        # ... and every job still answers as a past one does after a restart
        for job_id in [first, *ids]:
            got = svc.job(job_id)
            assert got["state"] == "done" and got["history"], job_id
            assert svc.logs(job_id)["lines"]
        assert len(svc.jobs()["jobs"]) == JOBS
    finally:
        await svc.close()
