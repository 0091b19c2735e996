"""Queries for agent identities and the subscriptions registered through them."""

from __future__ import annotations

import uuid

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.pagination import Page, Paged, fetch_paged
from queuekeeper.models import (
    AgentIdentity,
    EventSubscription,
    EventSubscriptionQueue,
    User,
    utcnow,
)


def owned_identities(user_uuid: uuid.UUID) -> Select[AgentIdentity]:
    return select(AgentIdentity).where(AgentIdentity.created_by == user_uuid)


async def list_owned_identities(
    session: AsyncSession,
    user_uuid: uuid.UUID,
    *,
    name: str | None,
    offering_uuid: uuid.UUID | None,
    page: Page,
) -> Paged[AgentIdentity]:
    query = owned_identities(user_uuid)
    if name is not None:
        query = query.where(AgentIdentity.name == name)
    if offering_uuid is not None:
        query = query.where(AgentIdentity.offering_uuid == offering_uuid)
    return await fetch_paged(session, query, AgentIdentity.created, AgentIdentity.uuid, page=page)


async def count_identities(session: AsyncSession, user_uuid: uuid.UUID) -> int:
    total = await session.scalar(select(func.count()).where(AgentIdentity.created_by == user_uuid))
    return int(total or 0)


async def get_owned_identity(
    session: AsyncSession, user_uuid: uuid.UUID, identity_uuid: uuid.UUID
) -> AgentIdentity | None:
    identity: AgentIdentity | None = await session.scalar(
        owned_identities(user_uuid).where(AgentIdentity.uuid == identity_uuid)
    )
    return identity


async def find_by_name(
    session: AsyncSession, user_uuid: uuid.UUID, name: str
) -> AgentIdentity | None:
    identity: AgentIdentity | None = await session.scalar(
        owned_identities(user_uuid).where(AgentIdentity.name == name)
    )
    return identity


async def registered_subscription(
    session: AsyncSession, owner_uuid: uuid.UUID, identity_uuid: uuid.UUID, object_type: str
) -> EventSubscription | None:
    """The subscription register_event_subscription made for (identity, type), if any.

    A unique index keeps this to one row.
    """
    subscription: EventSubscription | None = await session.scalar(
        select(EventSubscription).where(
            EventSubscription.user_uuid == owner_uuid,
            EventSubscription.agent_identity_uuid == identity_uuid,
            EventSubscription.observable_object_type == object_type,
        )
    )
    return subscription


async def subscriptions_of_identity(
    session: AsyncSession, owner_uuid: uuid.UUID, identity_uuid: uuid.UUID
) -> list[EventSubscription]:
    rows = await session.scalars(
        select(EventSubscription).where(
            EventSubscription.user_uuid == owner_uuid,
            EventSubscription.agent_identity_uuid == identity_uuid,
        )
    )
    return list(rows)


async def admin_identities(
    session: AsyncSession,
    *,
    offering_uuid: uuid.UUID | None,
    user_uuid: uuid.UUID | None,
    offset: int,
    limit: int,
) -> tuple[list[tuple[AgentIdentity, User | None]], int]:
    """Identities with their owners, one page, and the total."""
    query = select(AgentIdentity, User).outerjoin(User, User.uuid == AgentIdentity.created_by)
    if offering_uuid is not None:
        query = query.where(AgentIdentity.offering_uuid == offering_uuid)
    if user_uuid is not None:
        query = query.where(AgentIdentity.created_by == user_uuid)
    total = await session.scalar(select(func.count()).select_from(query.subquery())) or 0
    rows = await session.execute(
        query.order_by(AgentIdentity.created, AgentIdentity.uuid).offset(offset).limit(limit)
    )
    return [(identity, owner) for identity, owner in rows.all()], int(total)


async def subscriptions_with_queues(
    session: AsyncSession, identity_uuids: list[uuid.UUID]
) -> list[tuple[EventSubscription, EventSubscriptionQueue | None]]:
    if not identity_uuids:
        return []
    rows = await session.execute(
        select(EventSubscription, EventSubscriptionQueue)
        .outerjoin(
            EventSubscriptionQueue,
            EventSubscriptionQueue.subscription_uuid == EventSubscription.uuid,
        )
        .where(EventSubscription.agent_identity_uuid.in_(identity_uuids))
        .order_by(EventSubscription.created, EventSubscription.uuid)
    )
    return [(subscription, queue) for subscription, queue in rows.all()]


async def registered_subscription_and_login(
    session: AsyncSession, owner_uuid: uuid.UUID, identity_uuid: uuid.UUID, object_type: str
) -> tuple[EventSubscription, str | None] | None:
    """`registered_subscription` and, in the same statement, the hash its broker user must
    hold now (`User.broker_login_hash`): what a repeat registration reads under the owner
    lock."""
    row = (
        await session.execute(
            select(EventSubscription, User.broker_login_hash_sql(utcnow()))
            .join(User, User.uuid == EventSubscription.user_uuid)
            .where(
                EventSubscription.user_uuid == owner_uuid,
                EventSubscription.agent_identity_uuid == identity_uuid,
                EventSubscription.observable_object_type == object_type,
            )
        )
    ).first()
    return (row[0], row[1]) if row is not None else None
