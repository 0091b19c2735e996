"""In-process wake-ups between the accept path, the relay and `?wait=true` waiters."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


class Signal:
    """Wakes the tasks waiting on it in this process. Waiters also poll the database, so
    a signal from another replica is never needed for correctness, only for speed.

    `generation` counts notifications: a waiter that read it before looking at the
    database passes it as `since`, and a notification that came in between (while it
    was not yet waiting) makes the wait return at once instead of being lost.
    """

    def __init__(self) -> None:
        self.generation = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        """Call `callback` on every notification (for a waiter that also has other wake-ups)."""
        self._listeners.append(callback)

    def forget(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def notify(self) -> None:
        self.generation += 1
        for callback in self._listeners:
            callback()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait(self, seconds: float, since: int | None = None) -> None:
        if since is not None and since != self.generation:
            return
        # A future of its own and one timer, not `wait_for(shield(...))`: the relay waits
        # here after every batch, and those wrap it in three more futures and callbacks
        # (docs/decisions/017-single-event-cost.md).
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.add(waiter)
        timer = loop.call_later(seconds, _release, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiters.discard(waiter)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass
class OutboxSignals:
    accepted: Signal = field(default_factory=Signal)  # new deliveries: wake the relay
    webhooks: Signal = field(default_factory=Signal)  # new webhook copies: wake the dispatcher
    # The consumers those copies are for (filled before `webhooks` is notified; the
    # dispatcher takes them), so a dispatcher posting to them already claims nothing.
    webhook_consumers: set[uuid.UUID] = field(default_factory=set)
    settled: Signal = field(default_factory=Signal)  # deliveries settled: wake `?wait=true`
    # `?wait=true` requests in this process, from before their store to their answer: while
    # one is, the relay writes confirmed copies at once rather than every settle interval.
    waiting: int = 0
