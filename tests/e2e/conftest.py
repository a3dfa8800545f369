"""Real daemons on loopback for end-to-end job tests: a module-wide 3-node cluster (TLS, one
bootstrap address), and helpers to submit through fusionctl's own entry point."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from fusionctl.local import merge
from tests.daemon.harness import Cluster

JOB_MEMORY_GIB = 0.03
"""What each test daemon offers to jobs: the small test jobs fit, a 170 MB one does not."""


JOB_TIMERS = {"suspect_after_s": 4.0, "dead_after_s": 8.0, "election_timeout_s": 4.0,
              "leader_heartbeat_s": 0.3, "leader_lease_s": 3.0}
"""Membership timers for job tests: 3 daemons training and a reference trainer share 2 cores,
so an event loop can stall for a second; the harness's 1 s lease would then move the scheduler
between tests. A dead stage is still declared within 8 s (the failure test allows 30 s)."""


def start_cluster(root: Path, n: int = 3, *,
                  node_settings: Mapping[int, Mapping[str, Any]] | None = None,
                  pythons: Mapping[int, str] | None = None,
                  timers: dict[str, float] | None = None) -> Cluster:
    """`n` daemons, node0 first, the others with node0 as their only bootstrap address.
    `node_settings[i]`: settings of node i only (e.g. its `jobs.disabled_ops`); `pythons[i]`:
    the Python that runs node i (another virtual environment: another torch); `timers`
    override `JOB_TIMERS`."""
    c = Cluster(root, n, {"job_memory_gib": JOB_MEMORY_GIB,
                          "metrics": {"listen": "127.0.0.1:0"},
                          "cluster": {**JOB_TIMERS, **(timers or {})}})
    for i, extra in (node_settings or {}).items():
        c.nodes[i].settings = merge(c.nodes[i].settings, extra)
    for i, python in (pythons or {}).items():
        c.nodes[i].python = python
    c.start(c.nodes[:1])
    c.wait_up(c.nodes[:1])
    addr = c.address(c.nodes[0])
    for node in c.nodes[1:]:
        node.settings = merge(node.settings, {"cluster": {"bootstrap": [addr]}})
    c.start(c.nodes[1:])
    c.wait_up()
    c.wait_agreement(timeout=30.0)
    return c


@pytest.fixture(scope="module")
def cluster3() -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="fze"))
    c = start_cluster(root)
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(root, ignore_errors=True)


def leader_and_other(c: Cluster) -> tuple[Any, Any]:
    """The node that is the elected scheduler (once all agree on one), and one that is not."""
    agreed, _ = c.wait_agreement(timeout=30.0)
    lead = next(n for n in c.nodes if c.node_id(n) == agreed["leader"])
    return lead, next(n for n in c.nodes if n is not lead)


def ctl(node: Any, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, Any, str]:
    """Run fusionctl against `node` in this process; (exit code, stdout JSON or text, stderr)."""
    from fusionctl.cli import run

    capsys.readouterr()
    rc = run(["--socket", node.socket, *args])
    out, err = capsys.readouterr()
    try:
        return rc, json.loads(out), err
    except ValueError:
        return rc, out, err
