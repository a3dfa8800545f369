"""Child tasks, ended properly: `cancel_and_wait`.

The pattern it replaces, `t.cancel()` then `with suppress(CancelledError): await t`, has a
flaw: when the task doing the waiting is itself cancelled during the `await`, its own
CancelledError is the one suppressed, and it carries on as if nobody had asked it to stop.
Here the children's cancellations are consumed, the caller's never is, and a child that
ended with an error (not a cancellation) is logged instead of vanishing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
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
