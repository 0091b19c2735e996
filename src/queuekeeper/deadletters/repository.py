"""Queries for dead-letter redrive: given-up records, and which queues are still registered.

The caller commits."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.pagination import fetch_page
from queuekeeper.models import (
    EventConsumer,
    EventSubscriptionQueue,
    GivenUpDeadLetter,
    QueuePresence,
)


async def is_registered(session: AsyncSession, vhost: str, queue_name: str) -> bool:
    """A subscription queue's or a consumer's (contract §9): both are redriven alike."""
    found = await session.scalar(
        select(EventSubscriptionQueue.uuid)
        .where(
            EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name == queue_name
        )
        .union_all(
            select(EventConsumer.uuid).where(
                EventConsumer.vhost == vhost, EventConsumer.queue_name == queue_name
            )
        )
        .limit(1)
    )
    return found is not None


async def is_away(session: AsyncSession, vhost: str, queue_name: str) -> bool:
    """Whether the queue has had no consumer since some time (queue_presence)."""
    away_since = await session.scalar(
        select(QueuePresence.away_since).where(
            QueuePresence.vhost == vhost, QueuePresence.queue_name == queue_name
        )
    )
    return away_since is not None


def record_given_up(session: AsyncSession, records: Sequence[GivenUpDeadLetter]) -> None:
    session.add_all(records)


async def list_given_up(
    session: AsyncSession, *, vhost: str | None, offset: int, limit: int
) -> tuple[int, list[GivenUpDeadLetter]]:
    """Newest first."""
    query = select(GivenUpDeadLetter)
    if vhost:
        query = query.where(GivenUpDeadLetter.vhost == vhost)
    return await fetch_page(
        session,
        query,
        GivenUpDeadLetter.recorded.desc(),
        GivenUpDeadLetter.id.desc(),
        offset=offset,
        limit=limit,
    )
