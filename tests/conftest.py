"""The suite's two phases (scripts/test runs both; a plain `pytest` runs everything serially).

`FUSION_TEST_PHASE=parallel` keeps the tests that only compute: the pure rooms (graph capture,
the planner, the protocol's codecs and fuzzers) and any test marked `compute_only` (training
in one process, say), which never start a daemon, open a socket to another process or bound
wall-clock time, so they may share the cores with each other
(pytest-xdist, one file per worker). `FUSION_TEST_PHASE=serial` keeps the complement: every
test that starts daemons, shapes links, waits on timeouts or asserts how long something took
(marker `timed`), which would read another test's load as its own slowness. Unset: no
selection.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PARALLEL_DIRS = ("graph", "plan", "protocol")
"""Directories under tests/ whose tests only compute (see the module docstring)."""

_ROOT = Path(__file__).resolve().parent


def _parallel(item: pytest.Item) -> bool:
    try:
        rel = Path(str(item.path)).resolve().relative_to(_ROOT)
    except ValueError:
        return False
    if item.get_closest_marker("timed") is not None:
        return False
    return ((len(rel.parts) > 1 and rel.parts[0] in PARALLEL_DIRS)
            or item.get_closest_marker("compute_only") is not None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    phase = os.environ.get("FUSION_TEST_PHASE", "")
    if phase not in ("", "parallel", "serial"):
        raise pytest.UsageError(f"FUSION_TEST_PHASE={phase!r}: use 'parallel', 'serial' or "
                                "leave it unset (everything, serially)")
    if not phase:
        return
    keep = [it for it in items if _parallel(it) == (phase == "parallel")]
    drop = [it for it in items if _parallel(it) != (phase == "parallel")]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
