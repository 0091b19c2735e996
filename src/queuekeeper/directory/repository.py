"""Queries for users, offerings and grants."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import exists, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.models import (
    EventConsumer,
    EventSubscription,
    EventSubscriptionQueue,
    OfferingAccess,
    User,
)


async def get_grant(
    session: AsyncSession, user_uuid: uuid.UUID, offering_uuid: uuid.UUID, *, lock: bool = False
) -> OfferingAccess | None:
    return await session.get(OfferingAccess, (user_uuid, offering_uuid), with_for_update=lock)


async def subscriptions_of_user(
    session: AsyncSession, user_uuid: uuid.UUID
) -> list[EventSubscription]:
    rows = await session.scalars(
        select(EventSubscription).where(EventSubscription.user_uuid == user_uuid)
    )
    return list(rows)


async def subscriptions_needing_password(
    session: AsyncSession, user_uuid: uuid.UUID, password_hash: str | None
) -> list[EventSubscription]:
    rows = await session.scalars(
        select(EventSubscription).where(
            EventSubscription.user_uuid == user_uuid,
            EventSubscription.broker_password_hash.is_distinct_from(password_hash),
        )
    )
    return list(rows)


async def queues_of_user_for_offering(
    session: AsyncSession, user_uuid: uuid.UUID, offering_uuid: uuid.UUID
) -> list[EventSubscriptionQueue]:
    rows = await session.scalars(
        select(EventSubscriptionQueue)
        .join(EventSubscription, EventSubscription.uuid == EventSubscriptionQueue.subscription_uuid)
        .where(
            EventSubscription.user_uuid == user_uuid,
            EventSubscriptionQueue.offering_uuid == offering_uuid,
        )
    )
    return list(rows)


async def queues_of_offering(
    session: AsyncSession, offering_uuid: uuid.UUID
) -> list[EventSubscriptionQueue]:
    rows = await session.scalars(
        select(EventSubscriptionQueue).where(EventSubscriptionQueue.offering_uuid == offering_uuid)
    )
    return list(rows)


async def users_with_revoked_logins(session: AsyncSession, now: datetime) -> list[User]:
    """Inactive users, or users whose token has expired, that still have a subscription
    whose broker user holds a password: their logins are to be taken away."""
    rows = await session.scalars(
        select(User)
        .where(
            or_(
                User.is_active.is_(False),
                User.token_expires_at.is_not(None) & (User.token_expires_at <= now),
            ),
            or_(
                exists().where(
                    EventSubscription.user_uuid == User.uuid,
                    EventSubscription.broker_password_hash.is_not(None),
                ),
                exists().where(
                    EventConsumer.user_uuid == User.uuid,
                    EventConsumer.broker_password_hash.is_not(None),
                ),
            ),
        )
        .order_by(User.uuid)
    )
    return list(rows)
