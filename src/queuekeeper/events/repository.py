"""Event records read back: an event, its outbox copies (`deliveries`), the outbox's depth,
and the relay's housekeeping (pruning old events, the consumer gauge).

Core statements on the tables, run in a request's session or on a job's connection. What
writes the outbox (store, claim, renew, settle, release) is `outbox.py`'s alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, String, Table, case, func, literal_column, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from queuekeeper.models import Base, DeliveryState, Event, EventConsumer, EventSubscriptionQueue

EVENTS: Table = Base.metadata.tables["events"]
DELIVERIES: Table = Base.metadata.tables["deliveries"]

# The relay's housekeeping runs its statements on connections, the API in sessions.
Executor = AsyncSession | AsyncConnection

PENDING = DeliveryState.PENDING
# Written out, not bound: the partial index of pending rows is used only when the
# planner sees the literal it was defined with.
IS_PENDING = literal_column(f"'{PENDING.value}'", String)
# The queue relay's copies: with `state = 'pending'`, the predicate of that index (webhook
# copies are the webhook dispatcher's, counted apart; migration 0015_webhooks).
FOR_QUEUES = text("NOT deliveries.webhook")


async def delivery_states(
    session: AsyncSession, event_ids: Collection[str]
) -> dict[str, list[tuple[str, str, DeliveryState, str | None]]]:
    """(queue_name, vhost, state, last_error) of every copy, by event, in creation order."""
    found: dict[str, list[tuple[str, str, DeliveryState, str | None]]] = {
        event_id: [] for event_id in event_ids
    }
    if not event_ids:
        return found
    rows = await session.execute(
        select(
            DELIVERIES.c.event_id,
            DELIVERIES.c.queue_name,
            DELIVERIES.c.vhost,
            DELIVERIES.c.state,
            DELIVERIES.c.last_error,
        )
        .where(DELIVERIES.c.event_id.in_(event_ids))
        .order_by(DELIVERIES.c.id)
    )
    for event_id, queue_name, vhost, state, last_error in rows:
        found[event_id].append((queue_name, vhost, state, last_error))
    return found


async def get_event(session: AsyncSession, event_id: str) -> Event | None:
    return await session.get(Event, event_id)


async def deliveries_of(session: AsyncSession, event_id: str) -> Sequence[Row[Any]]:
    rows = await session.execute(
        select(DELIVERIES).where(DELIVERIES.c.event_id == event_id).order_by(DELIVERIES.c.id)
    )
    return rows.all()


async def existing_targets(
    session: Executor, target_uuids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Of these subscription queue and consumer uuids, the ones whose row still exists."""
    if not target_uuids:
        return set()
    rows = await session.scalars(
        select(EventSubscriptionQueue.uuid)
        .where(EventSubscriptionQueue.uuid.in_(target_uuids))
        .union_all(select(EventConsumer.uuid).where(EventConsumer.uuid.in_(target_uuids)))
    )
    return set(rows)


async def consumer_count(session: Executor) -> int:
    """Consumers registered (the `queuekeeper_consumers` gauge)."""
    return int(await session.scalar(select(func.count()).select_from(EventConsumer)) or 0)


@dataclass(frozen=True)
class OutboxDepth:
    pending: int
    claimed: int  # pending and held by a live lease
    oldest_pending_age_seconds: float  # 0 when nothing is pending


async def outbox_depth(session: Executor, now: datetime) -> OutboxDepth:
    row = (
        await session.execute(
            select(
                func.count(),
                func.coalesce(func.sum(case((DELIVERIES.c.claimed_until > now, 1), else_=0)), 0),
                func.min(DELIVERIES.c.created),
            ).where(DELIVERIES.c.state == IS_PENDING, FOR_QUEUES)
        )
    ).one()
    oldest = row[2]
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=now.tzinfo)
    return OutboxDepth(
        pending=int(row[0]),
        claimed=int(row[1]),
        oldest_pending_age_seconds=(now - oldest).total_seconds() if oldest else 0.0,
    )
