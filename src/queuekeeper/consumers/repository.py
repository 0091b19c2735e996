"""Queries for consumers and their scopes. Nothing here commits."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

from sqlalchemy import Select, false, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.common.pagination import Page, Paged, fetch_paged
from queuekeeper.consumers.schemas import ConsumerFilters
from queuekeeper.models import AgentIdentity, EventConsumer, EventConsumerScope, User


def consumers(owner_uuid: uuid.UUID | None) -> Select[EventConsumer]:
    """Every consumer, or one owner's."""
    query = select(EventConsumer)
    if owner_uuid is not None:
        query = query.where(EventConsumer.user_uuid == owner_uuid)
    return query


async def get(
    session: AsyncSession, consumer_uuid: uuid.UUID, owner_uuid: uuid.UUID | None = None
) -> EventConsumer | None:
    found: EventConsumer | None = await session.scalar(
        consumers(owner_uuid).where(EventConsumer.uuid == consumer_uuid)
    )
    return found


def filtered(owner_uuid: uuid.UUID | None, filters: ConsumerFilters) -> Select[EventConsumer]:
    """`consumers(owner_uuid)` narrowed by the list filters of client 8.1.3."""
    query = consumers(owner_uuid)
    if filters.user_uuid is not None:
        query = query.where(EventConsumer.user_uuid == filters.user_uuid)
    if filters.user_username is not None:
        owners = select(User.uuid).where(User.username == filters.user_username)
        query = query.where(EventConsumer.user_uuid.in_(owners))
    if filters.is_global:
        query = query.where(false())  # every consumer here is bound to offerings
    return query


async def page(
    session: AsyncSession, owner_uuid: uuid.UUID | None, filters: ConsumerFilters, page: Page
) -> Paged[EventConsumer]:
    order = (
        (EventConsumer.created.desc(), EventConsumer.uuid.desc())
        if filters.descending
        else (EventConsumer.created, EventConsumer.uuid)
    )
    return await fetch_paged(session, filtered(owner_uuid, filters), *order, page=page)


async def count(
    session: AsyncSession, owner_uuid: uuid.UUID | None, filters: ConsumerFilters
) -> int:
    query = filtered(owner_uuid, filters)
    total = await session.scalar(select(func.count()).select_from(query.subquery()))
    return int(total or 0)


async def identity_with_owner(
    session: AsyncSession, identity_uuid: uuid.UUID
) -> tuple[AgentIdentity, User | None] | None:
    row = (
        await session.execute(
            select(AgentIdentity, User)
            .outerjoin(User, User.uuid == AgentIdentity.created_by)
            .where(AgentIdentity.uuid == identity_uuid)
        )
    ).first()
    return (row[0], row[1]) if row is not None else None


async def of_identity(session: AsyncSession, identity_uuid: uuid.UUID) -> EventConsumer | None:
    found: EventConsumer | None = await session.scalar(
        select(EventConsumer).where(EventConsumer.agent_identity_uuid == identity_uuid)
    )
    return found


async def with_scopes(
    session: AsyncSession, owner_uuid: uuid.UUID, offerings: Collection[uuid.UUID]
) -> EventConsumer | None:
    """The owner's consumer (not an agent identity's) bound to exactly these offerings."""
    wanted = set(offerings)
    bound = select(EventConsumerScope.consumer_uuid).where(
        EventConsumerScope.offering_uuid.in_(wanted)
    )
    candidates = await session.scalars(
        select(EventConsumer)
        .where(
            EventConsumer.user_uuid == owner_uuid,
            EventConsumer.agent_identity_uuid.is_(None),
            EventConsumer.uuid.in_(bound),
        )
        .order_by(EventConsumer.created, EventConsumer.uuid)
    )
    for consumer in candidates:
        if {scope.offering_uuid for scope in consumer.scopes} == wanted:
            return consumer
    return None


async def of_owner(session: AsyncSession, owner_uuid: uuid.UUID) -> list[EventConsumer]:
    return list(await session.scalars(consumers(owner_uuid)))


async def of_identities(
    session: AsyncSession, identity_uuids: Sequence[uuid.UUID]
) -> list[EventConsumer]:
    if not identity_uuids:
        return []
    rows = await session.scalars(
        select(EventConsumer).where(EventConsumer.agent_identity_uuid.in_(list(identity_uuids)))
    )
    return list(rows)


async def scoped_only_to(
    session: AsyncSession, offering_uuid: uuid.UUID, owner_uuid: uuid.UUID | None = None
) -> list[EventConsumer]:
    """Consumers bound to this offering and no other (of one owner, or anyone's).

    Those lose their reason to exist with the offering or the owner's access to it;
    a consumer bound to several offerings only loses this scope.
    """
    query = (
        select(EventConsumer)
        .join(EventConsumerScope, EventConsumerScope.consumer_uuid == EventConsumer.uuid)
        .where(EventConsumerScope.offering_uuid == offering_uuid)
    )
    if owner_uuid is not None:
        query = query.where(EventConsumer.user_uuid == owner_uuid)
    return [
        consumer
        for consumer in await session.scalars(query)
        if {scope.offering_uuid for scope in consumer.scopes} == {offering_uuid}
    ]


async def scopes_of_owner_for(
    session: AsyncSession, owner_uuid: uuid.UUID, offering_uuid: uuid.UUID
) -> list[EventConsumerScope]:
    rows = await session.scalars(
        select(EventConsumerScope)
        .join(EventConsumer, EventConsumer.uuid == EventConsumerScope.consumer_uuid)
        .where(
            EventConsumer.user_uuid == owner_uuid,
            EventConsumerScope.offering_uuid == offering_uuid,
        )
    )
    return list(rows)


async def count_of_owner(session: AsyncSession, owner_uuid: uuid.UUID) -> int:
    total = await session.scalar(select(func.count()).where(EventConsumer.user_uuid == owner_uuid))
    return int(total or 0)


async def registered_queue_names(
    session: AsyncSession, vhost: str, names: Collection[str]
) -> set[str]:
    if not names:
        return set()
    rows = await session.scalars(
        select(EventConsumer.queue_name).where(
            EventConsumer.vhost == vhost, EventConsumer.queue_name.in_(list(names))
        )
    )
    return set(rows)


async def existing(session: AsyncSession, consumer_uuids: Collection[uuid.UUID]) -> set[uuid.UUID]:
    if not consumer_uuids:
        return set()
    rows = await session.scalars(
        select(EventConsumer.uuid).where(EventConsumer.uuid.in_(list(consumer_uuids)))
    )
    return set(rows)


async def needing_password(
    session: AsyncSession, owner_uuid: uuid.UUID, password_hash: str | None
) -> list[EventConsumer]:
    """The owner's consumers whose broker user does not have the owner's current password."""
    rows = await session.scalars(
        consumers(owner_uuid).where(
            EventConsumer.broker_password_hash.is_distinct_from(password_hash)
        )
    )
    return list(rows)
