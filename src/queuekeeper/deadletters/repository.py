"""Queries for dead-letter redrive: given-up records, and which queues are still registered."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.models import EventSubscriptionQueue, GivenUpDeadLetter


async def is_registered(session: AsyncSession, vhost: str, queue_name: str) -> bool:
    found = await session.scalar(
        select(EventSubscriptionQueue.uuid).where(
            EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name == queue_name
        )
    )
    return found is not None


async def record_given_up(session: AsyncSession, records: Sequence[GivenUpDeadLetter]) -> None:
    session.add_all(records)
    await session.commit()


async def list_given_up(
    session: AsyncSession, *, vhost: str | None, offset: int, limit: int
) -> tuple[int, list[GivenUpDeadLetter]]:
    """Newest first."""
    query = select(GivenUpDeadLetter)
    if vhost:
        query = query.where(GivenUpDeadLetter.vhost == vhost)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = await session.scalars(
        query.order_by(GivenUpDeadLetter.recorded.desc(), GivenUpDeadLetter.id.desc())
        .offset(offset)
        .limit(limit)
    )
    return int(total), list(rows)
