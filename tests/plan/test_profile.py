"""Machine profiles (calibration, the gossiped dict) and the reference topologies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fusiond.plan import MachineProfile, PlanError, cluster_from_topology, fence_groups

TOPOLOGIES = Path(__file__).resolve().parents[2] / "bench" / "topologies"


def test_calibrate_measures_positive_rates() -> None:
    pytest.importorskip("torch")
    from fusiond.plan.calibrate import calibrate

    p = calibrate("here", scale=0.1, repeats=1)
    assert p.id == "here"
    for cls in ("matmul", "conv", "other"):
        assert 1e6 < p.rate(cls) < 1e16
    assert 1e6 < p.mem_bw < 1e14
    assert 0 < p.op_overhead_s < 1e-2
    assert p.memory_bytes > 2**20
    assert MachineProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_profile_dict_errors_name_the_field() -> None:
    good = MachineProfile("a", {"matmul": 1e9}, 1e9, 1e-6, 1e9).to_dict()
    bad = dict(good)
    del bad["mem_bw"]
    with pytest.raises(PlanError, match="mem_bw"):
        MachineProfile.from_dict(bad)
    with pytest.raises(PlanError, match="flops"):
        MachineProfile("a", {"matmul": -1.0}, 1e9, 1e-6, 1e9)
    # an unknown op class falls back to "other", else the slowest known class
    p = MachineProfile("a", {"matmul": 4e9, "other": 1e9}, 1e9, 0.0, 1e9)
    assert p.rate("conv") == 1e9


@pytest.mark.parametrize("path", sorted(TOPOLOGIES.glob("*.json")), ids=lambda p: p.stem)
def test_reference_topologies(path: Path) -> None:
    cluster, group = cluster_from_topology(json.loads(path.read_text()))
    assert len(cluster) == 48
    assert len(set(group)) == 6
    off = cluster.bandwidth[~np.eye(48, dtype=bool)] * 8 / 1e6
    assert off.min() >= 8 - 1e-9 and off.max() <= 10000 + 1e-9
    assert len({m.kind for m in cluster.machines}) >= 2
    # the fences find the sites (campus: its two 1 Gbit/s labs, joined at 1 Gbit/s, are one)
    assert 5 <= len(fence_groups(cluster)) <= 6
    assert all(math.isfinite(x) for x in cluster.rtt.ravel())


def test_topology_errors_name_the_field() -> None:
    with pytest.raises(PlanError, match="kinds"):
        cluster_from_topology({"name": "x", "groups": []})


def test_planner_is_pure() -> None:
    """fusiond.plan (all but calibrate, which imports torch lazily) pulls in no I/O or torch."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import sys, json, fusiond.plan, fusiond.plan.calibrate\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m.split(".")[0] in ("torch", "asyncio", "socket", "aiohttp")]
    assert not bad, f"fusiond.plan imported {bad[:5]}"
