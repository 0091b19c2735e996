"""Queries for presence and a queue's status: the presence rows, the registered queues they
may describe, and what the outbox holds for a queue. The caller commits."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    and_,
    case,
    delete,
    exists,
    false,
    func,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from queuekeeper.consumers.repository import authorized_now, last_delivered
from queuekeeper.consumers.schemas import bindings_of
from queuekeeper.models import (
    CONSUMER_ON_BROKER,
    PARKED_OR_RELEASING,
    Delivery,
    DeliveryState,
    Event,
    EventConsumer,
    EventSubscription,
    EventSubscriptionQueue,
    OfferingAccess,
    QueuePresence,
    User,
)

Key = tuple[str, str]  # (vhost, queue name)
CHUNK = 500


def _chunks(items: list[Any]) -> Iterable[list[Any]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]


# --- presence rows ---------------------------------------------------------------------------
async def record(
    session: AsyncSession,
    vhost: str,
    queue_name: str,
    consumers: int,
    *,
    observed: datetime,
    away_from: datetime,
) -> bool:
    """Write what was observed at `observed` unless the row holds a newer observation (another
    replica's, or a later event's): replicas racing on one queue leave the newest answer.
    `away_since` is kept while the queue stays without consumer, set to `away_from` when it
    loses its last one, cleared when one arrives (and kept as `returned_from` until the
    release has redriven the queue's dead letters). True when written."""
    statement = insert(QueuePresence).values(
        vhost=vhost,
        queue_name=queue_name,
        consumers=consumers,
        away_since=None if consumers else away_from,
        changed=observed,
    )
    new = statement.excluded
    statement = statement.on_conflict_do_update(
        index_elements=[QueuePresence.vhost, QueuePresence.queue_name],
        set_={
            "consumers": new.consumers,
            "away_since": case(
                (new.consumers > 0, None),
                else_=func.coalesce(QueuePresence.away_since, new.away_since),
            ),
            "returned_from": case(
                (
                    and_(new.consumers > 0, QueuePresence.away_since.is_not(None)),
                    QueuePresence.away_since,
                ),
                else_=QueuePresence.returned_from,
            ),
            "changed": new.changed,
        },
        where=QueuePresence.changed <= new.changed,
    )
    result = await session.execute(statement)
    return bool(getattr(result, "rowcount", 0))


async def presence_of(session: AsyncSession, keys: Collection[Key]) -> dict[Key, QueuePresence]:
    wanted = list(keys)
    found: dict[Key, QueuePresence] = {}
    for part in _chunks(wanted):
        rows = await session.scalars(
            select(QueuePresence).where(
                tuple_(QueuePresence.vhost, QueuePresence.queue_name).in_(part)
            )
        )
        found.update({(row.vhost, row.queue_name): row for row in rows})
    return found


async def presence_in(session: AsyncSession, vhost: str) -> dict[str, QueuePresence]:
    rows = await session.scalars(select(QueuePresence).where(QueuePresence.vhost == vhost))
    return {row.queue_name: row for row in rows}


async def mark_checked(
    session: AsyncSession, vhost: str, names: Collection[str], when: datetime
) -> None:
    for part in _chunks(list(names)):
        await session.execute(
            update(QueuePresence)
            .where(QueuePresence.vhost == vhost, QueuePresence.queue_name.in_(part))
            .values(checked=when)
        )


async def forget_unregistered(session: AsyncSession) -> int:
    """Delete the rows of queues nobody registers any more; how many."""
    legacy = exists().where(
        EventSubscriptionQueue.vhost == QueuePresence.vhost,
        EventSubscriptionQueue.queue_name == QueuePresence.queue_name,
    )
    consumer = exists().where(
        EventConsumer.vhost == QueuePresence.vhost,
        EventConsumer.queue_name == QueuePresence.queue_name,
    )
    result = await session.execute(delete(QueuePresence).where(~legacy, ~consumer))
    return int(getattr(result, "rowcount", 0) or 0)


async def registered(session: AsyncSession, keys: Collection[Key]) -> set[Key]:
    """Which of these queues are registered (a subscription's or a consumer's)."""
    wanted = list(keys)
    found: set[Key] = set()
    for part in _chunks(wanted):
        rows = await session.execute(
            select(EventSubscriptionQueue.vhost, EventSubscriptionQueue.queue_name)
            .where(
                tuple_(EventSubscriptionQueue.vhost, EventSubscriptionQueue.queue_name).in_(part)
            )
            .union_all(
                select(EventConsumer.vhost, EventConsumer.queue_name).where(
                    tuple_(EventConsumer.vhost, EventConsumer.queue_name).in_(part),
                    CONSUMER_ON_BROKER,
                )
            )
        )
        found.update((vhost, name) for vhost, name in rows)
    return found


async def registered_vhosts(session: AsyncSession) -> set[str]:
    rows = await session.scalars(
        select(EventSubscriptionQueue.vhost).union(
            select(EventConsumer.vhost).where(CONSUMER_ON_BROKER)
        )
    )
    return set(rows)


async def registered_in(session: AsyncSession, vhost: str) -> set[str]:
    rows = await session.scalars(
        select(EventSubscriptionQueue.queue_name)
        .where(EventSubscriptionQueue.vhost == vhost)
        .union_all(
            select(EventConsumer.queue_name).where(EventConsumer.vhost == vhost, CONSUMER_ON_BROKER)
        )
    )
    return set(rows)


# --- what a queue's status is made of --------------------------------------------------------
@dataclass
class Registration:
    """A registered queue with what decides whether events can reach it."""

    vhost: str
    queue_name: str
    uuid: UUID  # the subscription queue's, or the consumer's
    consumer: bool
    broker_user: UUID  # the subscription's or the consumer's uuid (its hex is the name)
    owner_active: bool
    token_expires_at: datetime | None
    has_token: bool  # False once the marketplace pushed the owner with `"token": null`
    offerings: list[UUID]
    object_types: list[str]  # a legacy queue's one type; a consumer's filter (empty: all)
    registered_at: datetime  # when its filter was last set (a consumer's `modified`)
    granted: set[UUID] = field(default_factory=set)
    # A consumer: whether its owner may hold at least one of its bindings now (global
    # included), by the rule every copy is published by (`binding_allowed_sql`); a legacy
    # queue's access is `granted`.
    may_receive: bool = False
    bindings: list[str] = field(default_factory=list)  # a consumer's, as "type uuid-hex"

    @property
    def key(self) -> Key:
        return (self.vhost, self.queue_name)


async def registrations(session: AsyncSession, keys: Collection[Key]) -> dict[Key, Registration]:
    """The registrations of these queues (absent keys: not registered), with their owners'
    grants on their offerings; four queries per chunk, whatever the number of queues."""
    found: dict[Key, Registration] = {}
    for part in _chunks(list(keys)):
        legacy = await session.execute(
            select(EventSubscriptionQueue, EventSubscription.uuid, User)
            .join(
                EventSubscription,
                EventSubscription.uuid == EventSubscriptionQueue.subscription_uuid,
            )
            .join(User, User.uuid == EventSubscription.user_uuid)
            .where(
                tuple_(EventSubscriptionQueue.vhost, EventSubscriptionQueue.queue_name).in_(part)
            )
        )
        for queue, subscription_uuid, user in legacy:
            found[(queue.vhost, queue.queue_name)] = Registration(
                queue.vhost,
                queue.queue_name,
                queue.uuid,
                False,
                subscription_uuid,
                user.is_active,
                user.token_expires_at,
                user.token_hash is not None,
                [queue.offering_uuid],
                [queue.object_type],
                queue.created,
            )
        consumers = list(
            await session.scalars(
                select(EventConsumer).where(
                    tuple_(EventConsumer.vhost, EventConsumer.queue_name).in_(part),
                    CONSUMER_ON_BROKER,
                )
            )
        )
        allowed = await authorized_now(
            session,
            [
                (c.uuid, c.user_uuid, kind, entity)
                for c in consumers
                for kind, entity in ([("global", None)] if c.is_global else bindings_of(c))
            ],
        )
        for consumer in consumers:
            found[(consumer.vhost, consumer.queue_name)] = Registration(
                consumer.vhost,
                consumer.queue_name,
                consumer.uuid,
                True,
                consumer.uuid,
                consumer.owner.is_active,
                consumer.owner.token_expires_at,
                consumer.owner.token_hash is not None,
                [scope.offering_uuid for scope in consumer.scopes],
                [str(kind) for kind in consumer.object_types or []],
                consumer.modified,
                may_receive=consumer.uuid in allowed,
                bindings=["global"]
                if consumer.is_global
                else [f"{kind} {entity.hex}" for kind, entity in bindings_of(consumer)],
            )
    await _add_grants(session, found.values())
    return found


async def _add_grants(session: AsyncSession, regs: Iterable[Registration]) -> None:
    pairs = {(reg.vhost, offering) for reg in regs for offering in reg.offerings}
    if not pairs:
        return
    # The vhost is the owner's uuid hex (broker/topology.py): the grant's user.
    wanted = list({(UUID(vhost), offering) for vhost, offering in pairs})
    granted: set[tuple[UUID, UUID]] = set()
    for part in _chunks(wanted):
        rows = await session.execute(
            select(OfferingAccess.user_uuid, OfferingAccess.offering_uuid).where(
                tuple_(OfferingAccess.user_uuid, OfferingAccess.offering_uuid).in_(part)
            )
        )
        granted.update((user, offering) for user, offering in rows)
    for reg in regs:
        owner = UUID(reg.vhost)
        reg.granted = {offering for offering in reg.offerings if (owner, offering) in granted}


def _copies_of(regs: Collection[Registration]) -> ColumnElement[bool]:
    queues = [reg.uuid for reg in regs if not reg.consumer]
    consumers = [reg.uuid for reg in regs if reg.consumer]
    return or_(
        Delivery.queue_uuid.in_(queues) if queues else false(),
        Delivery.consumer_uuid.in_(consumers) if consumers else false(),
    )


@dataclass(frozen=True)
class Outbox:
    parked: int = 0
    oldest_parked_at: datetime | None = None
    last_delivered_at: datetime | None = None


async def outbox_of(session: AsyncSession, regs: Collection[Registration]) -> dict[UUID, Outbox]:
    """Per registration uuid: its parked copies (how many, the oldest's acceptance) and when
    a copy for it was last confirmed by the broker. Neither reads the copies delivered: the
    parked ones through `ix_deliveries_parked` (its predicate and the queues written out for
    the planner to match), the last confirmed one at the end of the owner's range in
    `ix_deliveries_delivered` (`last_delivered`)."""
    if not regs:
        return {}
    owner = func.coalesce(Delivery.queue_uuid, Delivery.consumer_uuid)
    rows = await session.execute(
        select(owner, func.count(), func.min(Delivery.created))
        .where(
            text(PARKED_OR_RELEASING),
            text("deliveries.state = 'parked'"),
            tuple_(Delivery.vhost, Delivery.queue_name).in_([reg.key for reg in regs]),
            _copies_of(regs),
        )
        .group_by(owner)
    )
    parked = {key: (int(count or 0), _aware(oldest)) for key, count, oldest in rows}
    delivered = await last_delivered(session, [reg.uuid for reg in regs])
    found: dict[UUID, Outbox] = {}
    for key in parked.keys() | delivered.keys():
        count, oldest = parked.get(key, (0, None))
        found[key] = Outbox(count, oldest, delivered.get(key))
    return found


def _aware(value: Any) -> datetime | None:
    """An aggregate's datetime, in UTC."""
    if value is None:
        return None
    if isinstance(value, datetime) and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value if isinstance(value, datetime) else None


async def types_published_since(
    session: AsyncSession, offerings: Collection[UUID], since: datetime
) -> set[str]:
    """The object types of the events accepted for these offerings since `since`."""
    if not offerings:
        return set()
    rows = await session.scalars(
        select(Event.object_type)
        .where(Event.offering_uuid.in_(list(offerings)), Event.accepted >= since)
        .distinct()
        .limit(100)
    )
    return set(rows)


# --- the gauges -------------------------------------------------------------------------------
async def without_consumer(session: AsyncSession) -> tuple[int, datetime | None]:
    """How many registered queues have no consumer, and the earliest `away_since` of them."""
    count, earliest = (
        await session.execute(
            select(func.count(), func.min(QueuePresence.away_since)).where(
                QueuePresence.consumers == 0
            )
        )
    ).one()
    return int(count or 0), _aware(earliest)


async def parked_totals(session: AsyncSession) -> tuple[int, datetime | None]:
    """How many copies are parked, and when the oldest one's event was accepted."""
    count, oldest = (
        await session.execute(
            select(func.count(), func.min(Delivery.created)).where(
                Delivery.state == DeliveryState.PARKED
            )
        )
    ).one()
    return int(count or 0), _aware(oldest)
