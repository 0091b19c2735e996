"""Queries on what an owner holds: its grants, and the rows that keep its broker objects."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

from sqlalchemy import bindparam, exists, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper import db
from queuekeeper.models import (
    CONSUMER_ON_BROKER,
    EventConsumer,
    EventSubscription,
    EventSubscriptionQueue,
    OfferingAccess,
)

# Built once: registering a new queue runs the locked one on every call.
_ACCESS = select(OfferingAccess.user_uuid).where(
    OfferingAccess.user_uuid == bindparam("user"),
    OfferingAccess.offering_uuid == bindparam("offering"),
)
_ACCESS_LOCKED = _ACCESS.with_for_update(read=True)


async def has_access(
    session: db.Executor, user_uuid: uuid.UUID, offering_uuid: uuid.UUID, *, lock: bool = False
) -> bool:
    """Whether the user holds a grant for the offering; `lock` keeps the grant's row (FOR
    SHARE) until the transaction ends."""
    parameters = {"user": user_uuid, "offering": offering_uuid}
    statement = _ACCESS_LOCKED if lock else _ACCESS
    return await session.scalar(statement, parameters) is not None


async def owner_uses_vhost(session: AsyncSession, user_uuid: uuid.UUID) -> bool:
    """Whether the user still has a subscription or a consumer (each needs its vhost)."""
    used = await session.scalar(
        select(
            or_(
                exists().where(EventSubscription.user_uuid == user_uuid),
                exists().where(EventConsumer.user_uuid == user_uuid, CONSUMER_ON_BROKER),
            )
        )
    )
    return bool(used)


async def registered_queue_names(
    session: AsyncSession, vhost: str, names: Sequence[str]
) -> set[str]:
    """Of these queue names, those a subscription queue or a consumer has registered."""
    rows = await session.scalars(
        select(EventSubscriptionQueue.queue_name)
        .where(EventSubscriptionQueue.vhost == vhost, EventSubscriptionQueue.queue_name.in_(names))
        .union_all(
            select(EventConsumer.queue_name).where(
                EventConsumer.vhost == vhost, EventConsumer.queue_name.in_(names)
            )
        )
    )
    return set(rows)


async def queues_of_subscriptions(
    session: AsyncSession, subscription_uuids: Sequence[uuid.UUID]
) -> list[EventSubscriptionQueue]:
    if not subscription_uuids:
        return []
    rows = await session.scalars(
        select(EventSubscriptionQueue).where(
            EventSubscriptionQueue.subscription_uuid.in_(subscription_uuids)
        )
    )
    return list(rows)


async def existing_consumers(
    session: AsyncSession, consumer_uuids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Of these consumers, those that have a row."""
    if not consumer_uuids:
        return set()
    rows = await session.scalars(
        select(EventConsumer.uuid).where(EventConsumer.uuid.in_(list(consumer_uuids)))
    )
    return set(rows)
