"""Fixtures for daemon tests: every async test here runs under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Any]:
    """pytest-asyncio 1.x hook: parametrize this directory's async tests over both loops."""
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where the platform has it
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories
