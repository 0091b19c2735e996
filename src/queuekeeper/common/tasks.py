"""Stopping background tasks within a bound."""

from __future__ import annotations

import asyncio

import structlog

log = structlog.get_logger(__name__)


async def cancel_within(task: asyncio.Task[None], seconds: float) -> None:
    """Cancel `task` and wait for it at most `seconds`. A task cancelled while it closes an
    AMQP connection can have the cancellation swallowed by the client library and wait on a
    broker that will not answer (a vhost deleted under it): the service stops within
    seconds whatever a task does, and one that has not stopped by then is left behind,
    named in the log."""
    task.cancel()
    # `asyncio.wait`, not `wait_for`: at its timeout `wait_for` cancels again and then waits
    # without a bound for the task to end.
    await asyncio.wait({task}, timeout=seconds)
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: its error was logged where it happened
    else:
        log.warning("task_not_stopped", task=task.get_name(), waited_seconds=seconds)
