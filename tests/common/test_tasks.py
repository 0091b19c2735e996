"""A stop is bounded even when a task swallows its cancellation (as an AMQP client's close
can, on a vhost deleted under it)."""

from __future__ import annotations

import asyncio
import contextlib

from queuekeeper.common.tasks import cancel_within


async def test_a_task_that_swallows_its_cancellation_does_not_hold_the_stop() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)
        await release.wait()  # goes on after the cancel, as a swallowed one does

    task = asyncio.create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await cancel_within(task, 0.2)
    assert loop.time() - started < 1.0
    assert not task.done()
    release.set()
    await task


async def test_a_task_that_stops_is_awaited() -> None:
    task = asyncio.create_task(asyncio.sleep(3600))
    await cancel_within(task, 5)
    assert task.cancelled()
