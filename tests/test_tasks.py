"""fusiond.tasks.cancel_and_wait: children end, the caller's own cancellation is never lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from fusiond.tasks import cancel_and_wait


async def _stubborn(started: asyncio.Event) -> None:
    """A child that takes a while to end once cancelled (as a stage flushing its sends)."""
    started.set()
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.shield(asyncio.sleep(0.2))
        raise


async def _closer(children: list[asyncio.Task[None]], old_pattern: bool) -> str:
    if old_pattern:  # what six places in the daemon did
        for t in children:
            t.cancel()
        for t in children:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    else:
        await cancel_and_wait(children)
    await asyncio.sleep(0)  # a cancelled closer never gets here
    return "carried on"


@pytest.mark.parametrize("old_pattern", [True, False])
async def test_a_closer_cancelled_while_it_waits_stays_cancelled(old_pattern: bool) -> None:
    started = asyncio.Event()
    child = asyncio.create_task(_stubborn(started))
    await started.wait()
    closer = asyncio.create_task(_closer([child], old_pattern))
    await asyncio.sleep(0.05)  # the closer waits for the child
    closer.cancel()
    result = await asyncio.gather(closer, return_exceptions=True)
    await asyncio.gather(child, return_exceptions=True)
    if old_pattern:
        assert result == ["carried on"]  # the flaw: the closer's own cancel was swallowed
    else:
        assert isinstance(result[0], asyncio.CancelledError)
    assert child.cancelled()


async def test_children_end_and_a_failed_one_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failed = asyncio.create_task(fails(), name="failing-child")
    await asyncio.sleep(0)
    sleepers = [asyncio.create_task(asyncio.sleep(3600)) for _ in range(3)]
    with caplog.at_level(logging.WARNING, "fusiond.tasks"):
        await cancel_and_wait([*sleepers, failed], what="test child")
    assert all(t.cancelled() for t in sleepers)
    assert "test child failing-child had failed: RuntimeError: boom" in caplog.text


async def test_the_calling_task_and_nothing_are_fine() -> None:
    await cancel_and_wait([])
    me = asyncio.current_task()
    assert me is not None
    await cancel_and_wait([me])  # a task that closes itself is skipped, not cancelled
    assert not me.cancelling()


async def test_a_child_that_swallows_its_cancel_is_cancelled_again() -> None:
    """3.11's wait_for swallows a cancel that lands as its inner future completes: a daemon's
    close() then waited forever for the step writer (tests/train/test_service.py)."""
    swallowed = asyncio.Event()

    async def swallows_once() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)  # carries on as if nobody asked

    t = asyncio.create_task(swallows_once())
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await cancel_and_wait([t])
    assert swallowed.is_set() and t.cancelled()


async def test_a_task_set_logs_a_failure_when_it_happens_and_closes_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A background task's error is logged as it ends (it used to vanish with the set's
    reference); close cancels and awaits the rest; after close nothing starts."""
    from fusiond.tasks import TaskSet

    ts = TaskSet("test task")

    async def boom() -> None:
        raise ValueError("broken")

    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    ts.spawn(boom(), "boom")
    long = ts.spawn(forever(), "forever")
    await started.wait()
    await asyncio.sleep(0)
    assert "test task boom failed: ValueError: broken" in caplog.text
    assert list(ts) == [long] and len(ts) == 1
    await ts.close()
    assert long is not None and long.cancelled() and len(ts) == 0
    late = forever()
    assert ts.spawn(late, "late") is None and late.cr_frame is None  # closed unstarted
    await ts.close()  # idempotent
