"""When a copy whose attempt failed is tried again: the cap both deliveries share.

The relay (events/relay.py, its capped exponential backoff) and the webhook dispatcher
(webhooks/schedule.py, the configured schedule) each choose a delay; neither schedules
past the copy's give-up time (`delivery_max_age` for a queue copy, retention for a webhook
copy), so an old copy is given up on time rather than up to a whole delay late.
"""

from __future__ import annotations

from datetime import datetime, timedelta


def not_past_give_up(
    now: datetime, delay: float, created: datetime, max_age: timedelta
) -> datetime:
    """`delay` seconds from `now`, but no later than `created + max_age` (and not before
    `now`, when that time has passed: the copy is then given up at its next claim)."""
    return min(now + timedelta(seconds=delay), max(created + max_age, now))
