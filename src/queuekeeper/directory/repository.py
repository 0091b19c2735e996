"""Queries for users, offerings and grants."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.broker import topology
from queuekeeper.models import (
    CONSUMER_ON_BROKER,
    EventConsumer,
    EventSubscription,
    EventSubscriptionQueue,
    OfferingAccess,
    Project,
    Role,
    User,
)


async def get_grant(
    session: AsyncSession, user_uuid: uuid.UUID, offering_uuid: uuid.UUID, *, lock: bool = False
) -> OfferingAccess | None:
    return await session.get(OfferingAccess, (user_uuid, offering_uuid), with_for_update=lock)


async def grantees(session: AsyncSession, offering_uuid: uuid.UUID) -> list[uuid.UUID]:
    """The users granted the offering, sorted (the order their owner locks are taken in)."""
    rows = await session.scalars(
        select(OfferingAccess.user_uuid)
        .where(OfferingAccess.offering_uuid == offering_uuid)
        .order_by(OfferingAccess.user_uuid)
    )
    return list(rows)


async def subscriptions_of_user(
    session: AsyncSession, user_uuid: uuid.UUID
) -> list[EventSubscription]:
    rows = await session.scalars(
        select(EventSubscription).where(EventSubscription.user_uuid == user_uuid)
    )
    return list(rows)


async def subscriptions_needing_password(
    session: AsyncSession,
    user_uuid: uuid.UUID,
    password_hash: str | None,
    *,
    also: Collection[str] = (),
) -> list[EventSubscription]:
    """The user's subscriptions whose row says another hash, and those whose broker user
    is named in `also` (found wrong on the broker)."""
    differs = EventSubscription.broker_password_hash.is_distinct_from(password_hash)
    named = [topology.uuid_of(name) for name in also]
    named_uuids = [found for found in named if found is not None]
    rows = await session.scalars(
        select(EventSubscription).where(
            EventSubscription.user_uuid == user_uuid,
            or_(differs, EventSubscription.uuid.in_(named_uuids)) if named_uuids else differs,
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


@dataclass(frozen=True)
class BrokerLogin:
    """A subscription's or a consumer's broker user, and the hash its owner wants it to hold."""

    owner_uuid: uuid.UUID
    name: str
    wanted: str | None


async def broker_logins(session: AsyncSession, now: datetime) -> list[BrokerLogin]:
    """Every broker login the rows describe (two queries, whatever the number of users)."""
    found: list[BrokerLogin] = []
    wanted = User.broker_login_hash_sql(now)
    for table, name in (
        (EventSubscription, topology.subscription_user_name),
        (EventConsumer, topology.consumer_user_name),
    ):
        query = select(table.uuid, table.user_uuid, wanted).join(User, User.uuid == table.user_uuid)
        if table is EventConsumer:
            query = query.where(CONSUMER_ON_BROKER)  # a webhook consumer has no broker user
        rows = await session.execute(query)
        found.extend(BrokerLogin(owner, name(row_uuid), hash_) for row_uuid, owner, hash_ in rows)
    return found


async def projects_of(session: AsyncSession, customer_uuid: uuid.UUID) -> list[uuid.UUID]:
    rows = await session.scalars(select(Project.uuid).where(Project.customer_uuid == customer_uuid))
    return list(rows)


async def delete_roles_on(session: AsyncSession, scopes: Collection[tuple[str, uuid.UUID]]) -> None:
    """Delete the roles held on these (scope type, uuid): their entity is going."""
    if scopes:
        await session.execute(
            delete(Role).where(tuple_(Role.scope_type, Role.scope_uuid).in_(list(scopes)))
        )
