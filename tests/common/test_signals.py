"""A signal wakes its waiters, lets a wait end by time, and never loses a notification."""

from __future__ import annotations

import asyncio

from queuekeeper.common.signals import Signal


async def test_a_notification_wakes_a_waiter_long_before_its_timeout() -> None:
    signal = Signal()
    loop = asyncio.get_running_loop()
    started = loop.time()
    waiting = asyncio.create_task(signal.wait(30))
    await asyncio.sleep(0.01)
    signal.notify()
    await asyncio.wait_for(waiting, 5)
    assert loop.time() - started < 5
    assert signal._waiters == set()


async def test_a_wait_ends_by_time_without_a_notification() -> None:
    signal = Signal()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await signal.wait(0.05)
    assert loop.time() - started >= 0.04
    assert signal._waiters == set()
    assert signal.generation == 0


async def test_a_notification_between_reading_and_waiting_is_not_lost() -> None:
    signal = Signal()
    seen = signal.generation
    signal.notify()  # while the waiter looked at the database, say
    loop = asyncio.get_running_loop()
    started = loop.time()
    await signal.wait(30, since=seen)
    assert loop.time() - started < 1


async def test_a_cancelled_wait_leaves_nothing_behind_and_later_waits_still_wake() -> None:
    signal = Signal()
    cancelled = asyncio.create_task(signal.wait(30))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert cancelled.cancelled()
    assert signal._waiters == set()
    heard: list[None] = []
    signal.listen(lambda: heard.append(None))
    waiting = asyncio.create_task(signal.wait(30))
    await asyncio.sleep(0.01)
    signal.notify()
    await asyncio.wait_for(waiting, 5)
    assert heard == [None]
