"""Queries for reconcile and stale cleanup: a few per vhost or per page, never one per queue.

The caller commits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar
from uuid import UUID

from sqlalchemy import ColumnElement, exists, literal, null, or_, select, union_all, update
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from queuekeeper.broker import topology
from queuekeeper.models import (
    CONSUMER_ON_BROKER,
    BrokerState,
    EventConsumer,
    EventSubscription,
    EventSubscriptionQueue,
    User,
    utcnow,
)


@dataclass(frozen=True)
class QueueRow:
    """A registered queue: a subscription's (per offering and type) or a consumer's
    (`consumer` True: `uuid` is the consumer's, the subscription fields are None)."""

    name: str
    uuid: UUID
    subscription_uuid: UUID | None
    offering_uuid: UUID | None
    object_type: str | None
    consumer: bool = False


A = TypeVar("A", "ConsumerAccess", "SubscriptionAccess")


@dataclass(frozen=True)
class ConsumerAccess:
    """What a consumer's broker user should look like."""

    uuid: UUID
    broker_state: str
    owner_uuid: UUID
    owner_password_hash: str | None


@dataclass(frozen=True)
class SubscriptionAccess:
    """What a subscription's broker user should look like."""

    uuid: UUID
    broker_state: str
    owner_uuid: UUID
    owner_password_hash: str | None


@asynccontextmanager
async def reader(engine: AsyncEngine) -> AsyncIterator[AsyncSession]:
    """A session on one connection in autocommit, for a run's many small reads.

    Each query is then one round trip: no pool check-out, BEGIN or ROLLBACK around
    it. Each still sees what was committed before it (nothing holds a snapshot).
    """
    async with engine.connect() as connection:
        await connection.execution_options(isolation_level="AUTOCOMMIT")
        async with AsyncSession(bind=connection) as session:
            yield session


async def subscribed_vhosts(session: AsyncSession) -> set[str]:
    """The vhosts that should exist: one per user with a subscription or a consumer."""
    rows = await session.scalars(
        select(EventSubscription.user_uuid).union(
            select(EventConsumer.user_uuid).where(CONSUMER_ON_BROKER)
        )
    )
    return {owner.hex for owner in rows}


async def rows_in_range(
    session: AsyncSession, vhost: str, after: str | None, limit: int
) -> list[QueueRow]:
    """Registered queues of `vhost` (subscriptions' and consumers') with names after
    `after`, in name order."""
    registered = union_all(
        select(
            EventSubscriptionQueue.queue_name.label("name"),
            EventSubscriptionQueue.uuid,
            EventSubscriptionQueue.subscription_uuid,
            EventSubscriptionQueue.offering_uuid,
            EventSubscriptionQueue.object_type,
            literal(False).label("consumer"),
        ).where(EventSubscriptionQueue.vhost == vhost),
        select(
            EventConsumer.queue_name.label("name"),
            EventConsumer.uuid,
            null().cast(EventSubscriptionQueue.subscription_uuid.type),
            null().cast(EventSubscriptionQueue.offering_uuid.type),
            null().cast(EventSubscriptionQueue.object_type.type),
            literal(True).label("consumer"),
        ).where(EventConsumer.vhost == vhost, CONSUMER_ON_BROKER),
    ).subquery("registered")
    name: ColumnElement[str] = registered.c.name
    name = name.collate("C")  # byte order, as RabbitMQ sorts names
    query = select(registered)
    if after is not None:
        query = query.where(name > after)
    result = await session.execute(query.order_by(name).limit(limit))
    return [QueueRow(*row) for row in result.all()]


async def registered_names(session: AsyncSession, vhost: str, names: Sequence[str]) -> set[str]:
    """Of these queue names, the ones a subscription queue or a consumer registered."""
    if not names:
        return set()
    rows = await session.scalars(
        select(EventSubscriptionQueue.queue_name)
        .where(
            EventSubscriptionQueue.vhost == vhost,
            EventSubscriptionQueue.queue_name.in_(list(names)),
        )
        .union_all(
            select(EventConsumer.queue_name).where(
                EventConsumer.vhost == vhost,
                EventConsumer.queue_name.in_(list(names)),
                CONSUMER_ON_BROKER,
            )
        )
    )
    return set(rows)


async def vhost_in_use(session: AsyncSession, vhost: str) -> bool:
    """True when a subscription of the vhost's owner, or a queue row or consumer in it,
    exists."""
    conditions: list[ColumnElement[bool]] = [
        exists().where(EventSubscriptionQueue.vhost == vhost),
        exists().where(EventConsumer.vhost == vhost, CONSUMER_ON_BROKER),
    ]
    owner = topology.uuid_of(vhost)
    if owner is not None:
        conditions.append(exists().where(EventSubscription.user_uuid == owner))
    return bool(await session.scalar(select(or_(*conditions))))


async def subscriptions_of_owners(
    session: AsyncSession, owners: Sequence[UUID]
) -> dict[UUID, list[SubscriptionAccess]]:
    """One query for a whole group of vhosts' owners."""
    return await _access_of_owners(session, EventSubscription, SubscriptionAccess, owners)


async def consumers_of_owners(
    session: AsyncSession, owners: Sequence[UUID]
) -> dict[UUID, list[ConsumerAccess]]:
    """One query for a whole group of vhosts' owners."""
    return await _access_of_owners(session, EventConsumer, ConsumerAccess, owners)


async def _access_of_owners(
    session: AsyncSession,
    model: type[EventSubscription] | type[EventConsumer],
    record: type[A],
    owners: Sequence[UUID],
) -> dict[UUID, list[A]]:
    found: dict[UUID, list[A]] = {owner: [] for owner in owners}
    if not owners:
        return found
    result = await session.execute(
        # The owner's password: None while inactive or expired, so reconcile never gives a
        # revoked login back.
        select(
            model.uuid, model.broker_state, model.user_uuid, User.broker_login_hash_sql(utcnow())
        )
        .join(User, User.uuid == model.user_uuid)
        .where(
            model.user_uuid.in_(list(owners)),
            *([CONSUMER_ON_BROKER] if model is EventConsumer else []),
        )
        .order_by(model.user_uuid, model.uuid)
    )
    for row in result.all():
        found[row.user_uuid].append(record(*row))
    return found


async def set_consumer_password_hash(
    session: AsyncSession, consumer_uuid: UUID, password_hash: str | None
) -> bool:
    """True when the row is still there."""
    result = await session.execute(
        update(EventConsumer)
        .where(EventConsumer.uuid == consumer_uuid)
        .values(broker_password_hash=password_hash, broker_state=BrokerState.OK)
    )
    return bool(getattr(result, "rowcount", 0))


async def owner_password_hash(session: AsyncSession, owner_uuid: UUID) -> str | None:
    value: str | None = await session.scalar(
        select(User.broker_login_hash_sql(utcnow())).where(User.uuid == owner_uuid)
    )
    return value


async def set_subscription_broker_state(
    session: AsyncSession,
    subscription_uuid: UUID,
    *,
    broker_state: str,
    password_hash: str | None = None,
    set_hash: bool = False,
) -> bool:
    """True when the row is still there."""
    values: dict[str, Any] = {"broker_state": broker_state}
    if set_hash:
        values["broker_password_hash"] = password_hash
    result = await session.execute(
        update(EventSubscription).where(EventSubscription.uuid == subscription_uuid).values(values)
    )
    return bool(getattr(result, "rowcount", 0))


async def existing_subscription_users(session: AsyncSession, names: Sequence[str]) -> set[str]:
    """Of these broker user names, the ones that belong to a subscription or consumer row."""
    uuids = [owner for owner in (topology.uuid_of(name) for name in names) if owner is not None]
    if not uuids:
        return set()
    rows = await session.scalars(
        select(EventSubscription.uuid)
        .where(EventSubscription.uuid.in_(uuids))
        .union_all(
            select(EventConsumer.uuid).where(EventConsumer.uuid.in_(uuids), CONSUMER_ON_BROKER)
        )
    )
    return {row.hex for row in rows}


async def queue_vhosts(session: AsyncSession) -> set[str]:
    rows = await session.scalars(
        select(EventSubscriptionQueue.vhost).union(
            select(EventConsumer.vhost).where(CONSUMER_ON_BROKER)
        )
    )
    return set(rows)


# --- stale subscriptions ------------------------------------------------------------------
def _stale(now: datetime) -> ColumnElement[bool]:
    return or_(
        User.is_active.is_(False),
        (User.token_expires_at.is_not(None)) & (User.token_expires_at <= now),
    )


async def stale_owners(session: AsyncSession, now: datetime) -> list[tuple[UUID, str]]:
    """Users with subscriptions or consumers who are inactive or whose token expired, with
    the reason."""
    result = await session.execute(
        select(User.uuid, User.is_active, User.token_expires_at)
        .where(
            _stale(now),
            or_(
                exists().where(EventSubscription.user_uuid == User.uuid),
                exists().where(EventConsumer.user_uuid == User.uuid),
            ),
        )
        .order_by(User.uuid)
    )
    owners = []
    for owner, active, expires in result.all():
        reason = (
            "user is inactive"
            if not active
            else f"token expired at {expires.isoformat() if expires else '?'}"
        )
        owners.append((owner, reason))
    return owners


async def lock_if_still_stale(session: AsyncSession, owner_uuid: UUID, now: datetime) -> bool:
    """Lock the user row (PostgreSQL) so a concurrent token update waits; True if still stale."""
    found = await session.scalar(
        select(User.uuid).where(User.uuid == owner_uuid, _stale(now)).with_for_update()
    )
    return found is not None


async def subscriptions_with_queues(
    session: AsyncSession, owner_uuid: UUID
) -> tuple[list[EventSubscription], list[EventSubscriptionQueue]]:
    subscriptions = list(
        await session.scalars(
            select(EventSubscription).where(EventSubscription.user_uuid == owner_uuid)
        )
    )
    if not subscriptions:
        return [], []
    queues = list(
        await session.scalars(
            select(EventSubscriptionQueue).where(
                EventSubscriptionQueue.subscription_uuid.in_([s.uuid for s in subscriptions])
            )
        )
    )
    return subscriptions, queues
