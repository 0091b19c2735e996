"""When a webhook copy whose attempt failed is posted again (contract §13): the configured
schedule (`QUEUEKEEPER_WEBHOOK_RETRY_SECONDS`), with jitter, never past retention
(docs/decisions/026-webhooks-on-the-outbox.md)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from queuekeeper.events.retry import not_past_give_up

JITTER = 0.2  # a retry waits up to 20 % longer than its delay, so receivers are not hit in step


def retry_delay(attempt: int, schedule: Sequence[float], draw: float) -> float:
    """Seconds before the next attempt after failed attempt number `attempt` (1 = the first):
    the schedule's delay for it (the last one repeated), plus up to `JITTER` of it, `draw`
    being a number in [0, 1)."""
    base = schedule[min(max(attempt, 1), len(schedule)) - 1]
    return base * (1.0 + JITTER * draw)


def retry_at(
    attempts: int,
    created: datetime,
    now: datetime,
    schedule: Sequence[float],
    retention: timedelta,
    draw: float,
) -> datetime:
    """When a copy created at `created` is due again after its failed attempt number
    `attempts`: the schedule's delay from `now`, capped at its give-up time (retention)."""
    return not_past_give_up(now, retry_delay(attempts, schedule, draw), created, retention)
