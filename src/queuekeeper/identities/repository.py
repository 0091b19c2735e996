"""Queries for agent identities and the subscriptions registered through them."""

from __future__ import annotations

import uuid

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.models import AgentIdentity, EventSubscription


def owned_identities(user_uuid: uuid.UUID) -> Select[AgentIdentity]:
    return select(AgentIdentity).where(AgentIdentity.created_by == user_uuid)


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
