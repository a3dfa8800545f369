"""Cluster tests: the service-level ones run under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency where the platform has it
    uvloop = None  # type: ignore[assignment]

_BOTH_LOOPS = {"test_cluster.py", "test_real_net.py", "test_mdns.py"}
"""Files whose tests run the whole service (timers, sockets, zeroconf) on both loops; the
state-machine tests are loop-agnostic and run once."""


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Any]:
    """pytest-asyncio 1.x hook: which event loops each async test runs under."""
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None and item.path.name in _BOTH_LOOPS:
        factories["uvloop"] = uvloop.new_event_loop
    return factories
