"""Queries for subscriptions and their queues."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Insert, Integer, Select, Table, bindparam, func, literal, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import aliased

from queuekeeper import db
from queuekeeper.common.pagination import Page, Paged, fetch_paged
from queuekeeper.models import (
    Base,
    EventSubscription,
    EventSubscriptionQueue,
    Offering,
    OfferingAccess,
)
from queuekeeper.owners.repository import has_access
from queuekeeper.subscriptions.schemas import QueueFilter


def owned_subscriptions(user_uuid: uuid.UUID) -> Select[EventSubscription]:
    return select(EventSubscription).where(EventSubscription.user_uuid == user_uuid)


async def list_owned_subscriptions(
    session: AsyncSession, user_uuid: uuid.UUID, page: Page
) -> Paged[EventSubscription]:
    return await fetch_paged(
        session,
        owned_subscriptions(user_uuid),
        EventSubscription.created,
        EventSubscription.uuid,
        page=page,
    )


async def get_owned_subscription(
    session: AsyncSession, user_uuid: uuid.UUID, subscription_uuid: uuid.UUID
) -> EventSubscription | None:
    subscription: EventSubscription | None = await session.scalar(
        owned_subscriptions(user_uuid).where(EventSubscription.uuid == subscription_uuid)
    )
    return subscription


async def count_subscriptions(session: AsyncSession, user_uuid: uuid.UUID) -> int:
    total = await session.scalar(
        select(func.count()).where(EventSubscription.user_uuid == user_uuid)
    )
    return int(total or 0)


def owned_queues(user_uuid: uuid.UUID) -> Select[EventSubscriptionQueue]:
    return (
        select(EventSubscriptionQueue)
        .join(EventSubscription, EventSubscription.uuid == EventSubscriptionQueue.subscription_uuid)
        .where(EventSubscription.user_uuid == user_uuid)
    )


async def get_owned_queue(
    session: AsyncSession, user_uuid: uuid.UUID, queue_uuid: uuid.UUID
) -> EventSubscriptionQueue | None:
    queue: EventSubscriptionQueue | None = await session.scalar(
        owned_queues(user_uuid).where(EventSubscriptionQueue.uuid == queue_uuid)
    )
    return queue


async def list_owned_queues(
    session: AsyncSession, user_uuid: uuid.UUID, where: QueueFilter, page: Page
) -> Paged[EventSubscriptionQueue]:
    query = owned_queues(user_uuid)
    if where.offering_uuid is not None:
        query = query.where(EventSubscriptionQueue.offering_uuid == where.offering_uuid)
    if where.object_type is not None:
        query = query.where(EventSubscriptionQueue.object_type == where.object_type)
    if where.event_subscription_uuid is not None:
        query = query.where(
            EventSubscriptionQueue.subscription_uuid == where.event_subscription_uuid
        )
    return await fetch_paged(
        session, query, EventSubscriptionQueue.created, EventSubscriptionQueue.uuid, page=page
    )


_QUEUES: Table = Base.metadata.tables["event_subscription_queues"]


def _queues_held(owner: Any) -> Any:
    """The owner's queue rows, counted (a scalar subquery)."""
    # Aliased: the count is over all the owner's subscriptions, not correlated to any one.
    counted, of = aliased(EventSubscriptionQueue), aliased(EventSubscription)
    return (
        select(func.count())
        .select_from(counted)
        .join(of, of.uuid == counted.subscription_uuid)
        .where(of.user_uuid == owner)
        .scalar_subquery()
    )


def _insert_queue() -> Insert:
    granted = (
        select(OfferingAccess.user_uuid)
        .where(
            OfferingAccess.user_uuid == bindparam("user"),
            OfferingAccess.offering_uuid == bindparam("offering_uuid"),
        )
        .with_for_update(read=True)
    )
    owner = bindparam("user", type_=EventSubscription.user_uuid.type)
    row = select(
        *(bindparam(column.key, type_=column.type).label(column.key) for column in _QUEUES.c)
    ).where(granted.exists(), _queues_held(owner) < bindparam("limit", type_=Integer()))
    return (
        insert(_QUEUES)
        .from_select(_QUEUES.c.keys(), row)
        .on_conflict_do_nothing()
        .returning(_QUEUES.c.uuid)
    )


# On the table rather than the mapped class: the ORM's bulk insert path and a statement built
# per call were a tenth of a new create_queue's CPU (py-spy). The access re-check rides in
# the insert (one round trip of five).
_INSERT_QUEUE = _insert_queue()
_AT_QUOTA = select(literal(1)).where(
    _queues_held(bindparam("user", type_=EventSubscription.user_uuid.type))
    >= bindparam("limit", type_=Integer())
)


# A subscription queue's name registered in the vhost (consumer queues are named apart).
_QUEUE_NAME_REGISTERED = select(EventSubscriptionQueue.uuid).where(
    EventSubscriptionQueue.vhost == bindparam("vhost"),
    EventSubscriptionQueue.queue_name == bindparam("name"),
)


async def queue_name_registered(connection: AsyncConnection, vhost: str, name: str) -> bool:
    parameters = {"vhost": vhost, "name": name}
    return await connection.scalar(_QUEUE_NAME_REGISTERED, parameters) is not None


class QueueInsert(enum.Enum):
    INSERTED = "inserted"
    EXISTS = "exists"  # a concurrent call inserted it first
    NO_ACCESS = "no_access"  # the owner's grant to the offering is gone
    AT_QUOTA = "at_quota"  # the owner holds `max_queues_per_user` queues already


async def insert_queue_with_access(
    unit: AsyncConnection, owner_uuid: uuid.UUID, queue: EventSubscriptionQueue, limit: int
) -> QueueInsert:
    """Insert the queue's row unless (subscription, offering, type) exists, and only while
    the owner has access to the offering and holds fewer than `limit` queues: the grant is
    locked (FOR SHARE) until the commit, as revoke_access locks it before it lists the
    queues to delete, so either it sees this row or this sees the grant gone; the caller
    holds the owner lock, so the count is not raced by the owner's other registrations.

    ON CONFLICT DO NOTHING lets two concurrent create_queue calls both succeed:
    one inserts (201), the other finds the row (200), neither sees an error.
    """
    values = {
        "user": owner_uuid,
        "uuid": queue.uuid,
        "subscription_uuid": queue.subscription_uuid,
        "offering_uuid": queue.offering_uuid,
        "object_type": queue.object_type,
        "queue_name": queue.queue_name,
        "vhost": queue.vhost,
        "created": queue.created,
        "limit": limit,
    }
    if await unit.scalar(_INSERT_QUEUE, values) is not None:
        return QueueInsert.INSERTED
    # Nothing inserted: a conflict, no grant or the quota. Which, the reads tell (rare).
    if not await has_access(unit, owner_uuid, queue.offering_uuid, lock=True):
        return QueueInsert.NO_ACCESS
    if await unit.scalar(_AT_QUOTA, {"user": owner_uuid, "limit": limit}) is not None:
        return QueueInsert.AT_QUOTA  # or a conflict too: the caller looks for the row
    return QueueInsert.EXISTS


@dataclass(frozen=True)
class QueueContext:
    """What create_queue needs to know before it goes to the broker."""

    subscription_uuid: uuid.UUID
    offering_known: bool
    has_access: bool
    registered: EventSubscriptionQueue | None  # the queue's row (detached), when it has one
    queues_held: int  # the owner's queues, for the quota


_QUEUE_COLUMNS = db.columns_of(EventSubscriptionQueue)


def _queue_context_statement() -> Select[Any]:
    owner = bindparam("owner", type_=EventSubscription.user_uuid.type)
    offering = bindparam("offering", type_=Offering.uuid.type)
    held = _queues_held(owner)
    # The queue's columns under their own names; the others prefixed so none collides.
    return (
        select(
            EventSubscription.uuid.label("context_subscription"),
            Offering.uuid.label("context_offering"),
            OfferingAccess.user_uuid.label("context_access"),
            held.label("context_held"),
            *_QUEUE_COLUMNS,
        )
        .select_from(EventSubscription)
        .outerjoin(Offering, Offering.uuid == offering)
        .outerjoin(
            OfferingAccess,
            (OfferingAccess.offering_uuid == Offering.uuid) & (OfferingAccess.user_uuid == owner),
        )
        .outerjoin(
            EventSubscriptionQueue,
            (EventSubscriptionQueue.offering_uuid == Offering.uuid)
            & (EventSubscriptionQueue.subscription_uuid == EventSubscription.uuid)
            & (EventSubscriptionQueue.object_type == bindparam("object_type")),
        )
        .where(EventSubscription.uuid == bindparam("subscription"))
        .where(EventSubscription.user_uuid == owner)
    )


# Built once (building it per call cost more CPU than the three statements it replaced:
# py-spy, 20 % of a repeat create_queue, in SQLAlchemy's construction of the aliases): an
# agent starting up calls once per (offering, object type).
QUEUE_CONTEXT = _queue_context_statement()


async def queue_context(
    engine: AsyncEngine,
    owner_uuid: uuid.UUID,
    subscription_uuid: uuid.UUID,
    offering_uuid: uuid.UUID,
    object_type: str,
) -> QueueContext | None:
    """The owner's subscription (None when it is not theirs), the offering, the owner's access
    to it, the queue's row and the owner's queue count: one statement, one round trip, on no
    session and in no transaction."""
    parameters = {
        "owner": owner_uuid,
        "subscription": subscription_uuid,
        "offering": offering_uuid,
        "object_type": object_type,
    }
    row = await db.read_one(engine, QUEUE_CONTEXT, parameters)
    if row is None:
        return None
    registered = None
    if row["uuid"] is not None:
        registered = db.detached(
            EventSubscriptionQueue, {column.key: row[column.key] for column in _QUEUE_COLUMNS}
        )
    return QueueContext(
        row["context_subscription"],
        row["context_offering"] is not None,
        row["context_access"] is not None,
        registered,
        row["context_held"],
    )


# Read in autocommit, like the context read: create_queue runs on no session.
_QUEUE_EXISTS = select(EventSubscriptionQueue.uuid).where(
    EventSubscriptionQueue.uuid == bindparam("queue")
)
_QUEUE_OF = select(*_QUEUE_COLUMNS).where(
    EventSubscriptionQueue.subscription_uuid == bindparam("subscription"),
    EventSubscriptionQueue.offering_uuid == bindparam("offering"),
    EventSubscriptionQueue.object_type == bindparam("object_type"),
)


async def queue_exists(engine: AsyncEngine, queue_uuid: uuid.UUID) -> bool:
    return await db.read_one(engine, _QUEUE_EXISTS, {"queue": queue_uuid}) is not None


async def find_queue(
    engine: AsyncEngine, subscription_uuid: uuid.UUID, offering_uuid: uuid.UUID, object_type: str
) -> EventSubscriptionQueue | None:
    """The queue's row, detached."""
    parameters = {
        "subscription": subscription_uuid,
        "offering": offering_uuid,
        "object_type": object_type,
    }
    row = await db.read_one(engine, _QUEUE_OF, parameters)
    return db.detached(EventSubscriptionQueue, row) if row is not None else None
