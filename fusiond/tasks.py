"""Child tasks, ended properly: `cancel_and_wait`, and `TaskSet` for a service's background tasks.

The pattern it replaces, `t.cancel()` then `with suppress(CancelledError): await t`, has a
flaw: when the task doing the waiting is itself cancelled during the `await`, its own
CancelledError is the one suppressed, and it carries on as if nobody had asked it to stop.
Here the children's cancellations are consumed, the caller's never is, and a child that
ended with an error (not a cancellation) is logged instead of vanishing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any

log = logging.getLogger("fusiond.tasks")

RECANCEL_S = 1.0
"""A child still running this long after its cancel is cancelled again."""


def raise_if_cancelling() -> None:
    """Raise CancelledError when the calling task is being cancelled: for a loop that catches
    TimeoutError or OSError, as which a cancel can surface when it lands on an expiring
    deadline, and would otherwise go round again."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, what: str = "task"
                          ) -> None:
    """Cancel `tasks` (skipping the calling task and those already done) and wait until every
    one has ended (a child that swallowed the cancel is cancelled again every `RECANCEL_S`).
    A cancellation of the caller during the wait propagates (the children are
    cancelled already and end on their own). A child's exception is logged, not raised."""
    me = asyncio.current_task()
    children = [t for t in tasks if t is not me]
    for t in children:
        t.cancel()
    waiting = set(children)
    while waiting:
        _, waiting = await asyncio.wait(waiting, timeout=RECANCEL_S)
        for t in waiting:  # it swallowed the cancel (e.g. 3.11's wait_for, when its inner
            t.cancel()     # future completed at the same moment): ask again
    for t in children:
        if t.cancelled():
            continue
        exc = t.exception()
        if exc is not None:
            name = t.get_name() if isinstance(t, asyncio.Task) else what
            log.warning("%s %s had failed: %s: %s", what, name, type(exc).__name__, exc)


class TaskSet:
    """A service's background tasks, the one way fusiond keeps them: `spawn` starts a task and
    holds it until it ends; one that ends with an error is logged then (it used to vanish with
    the set's reference, or surface as asyncio's "exception was never retrieved" at garbage
    collection); `close` cancels and awaits every one still running (`cancel_and_wait`), and
    after it `spawn` closes the coroutine unstarted. Idempotent."""

    def __init__(self, what: str = "task") -> None:
        self._what = what
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        """Start `coro` as a task named `name` (None, and the coroutine closed, after close)."""
        if self._closed:
            coro.close()
            return None
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("%s %s failed: %s: %s", self._what, task.get_name(),
                        type(exc).__name__, exc)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    def running(self) -> list[asyncio.Task[Any]]:
        """The tasks not yet ended."""
        return [t for t in self._tasks if not t.done()]

    async def close(self, *also: asyncio.Future[Any]) -> None:
        """Cancel and await every task still running (and `also`); nothing spawns after."""
        self._closed = True
        await cancel_and_wait([*(t for t in also if not t.done()), *self.running()],
                              what=self._what)
