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


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, what: str = "task"
                          ) -> None:
    """Cancel `tasks` (skipping the calling task and those already done) and wait until every
    one has ended. A cancellation of the caller during the wait propagates (the children are
    cancelled already and end on their own). A child's exception is logged, not raised."""
    me = asyncio.current_task()
    pending = [t for t in tasks if t is not me]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    for t in pending:
        if t.cancelled():
            continue
        exc = t.exception()
        if exc is not None:
            name = t.get_name() if isinstance(t, asyncio.Task) else what
            log.warning("%s %s had failed: %s: %s", what, name, type(exc).__name__, exc)
