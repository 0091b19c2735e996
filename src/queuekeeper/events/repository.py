"""Queries for events and the outbox (the `deliveries` table).

The outbox is written and read with Core statements on the tables: the relay
moves thousands of rows a second and needs neither ORM identity tracking nor
per-row round trips.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    Select,
    String,
    Table,
    Text,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from queuekeeper.models import Base, Event, EventConsumer, EventSubscriptionQueue

EVENTS: Table = Base.metadata.tables["events"]
DELIVERIES: Table = Base.metadata.tables["deliveries"]
PENDING = "pending"
# Written out, not bound: the partial index of pending rows is used only when the
# planner sees the literal it was defined with (asyncpg plans prepared statements).
IS_PENDING: ColumnElement[str] = literal_column("'pending'", String)


# The relay runs its statements on autocommit connections, the API in sessions.
Executor = AsyncSession | AsyncConnection


def _is_postgres(executor: Executor) -> bool:
    bind = executor if isinstance(executor, AsyncConnection) else executor.get_bind()
    return bind.dialect.name == "postgresql"


# --- accepting ----------------------------------------------------------------------------
OFFERINGS: Table = Base.metadata.tables["offerings"]
ACCESS: Table = Base.metadata.tables["offering_access"]
USERS: Table = Base.metadata.tables["users"]
SUBSCRIPTIONS: Table = Base.metadata.tables["event_subscriptions"]
QUEUES: Table = Base.metadata.tables["event_subscription_queues"]


CONSUMERS: Table = Base.metadata.tables["event_consumers"]
SCOPES: Table = Base.metadata.tables["event_consumer_scopes"]
SUBSCRIPTION = "subscription"
CONSUMER = "consumer"


@dataclass(frozen=True)
class SubscriptionQueueRow:
    """Someone whose owner may receive events of `offering_uuid` now.

    `kind` SUBSCRIPTION: a subscription (`recipient_uuid`) with `filter` = its observable
    objects, and its queue for one of the requested object types (queue fields None when
    it registered none). `kind` CONSUMER: a consumer scoped to the offering, `filter` = its
    object types (empty = all), `queue_name`/`vhost` its one queue, `queue_uuid` None.
    """

    kind: str
    recipient_uuid: uuid.UUID
    owner_uuid: uuid.UUID
    filter: list[Any]
    offering_uuid: uuid.UUID
    queue_uuid: uuid.UUID | None
    object_type: str | None
    queue_name: str | None
    vhost: str | None


def _reachable_owner() -> ColumnElement[bool]:
    """The grant's user is active and their token has not expired."""
    return and_(
        ACCESS.c.offering_uuid.in_(bindparam("access_offerings", expanding=True)),
        USERS.c.is_active.is_(True),
        or_(
            USERS.c.token_expires_at.is_(None),
            USERS.c.token_expires_at > bindparam("now", type_=USERS.c.token_expires_at.type),
        ),
    )


def _recipients_statement() -> Select[Any]:
    subscriptions = select(
        literal(SUBSCRIPTION, String).label("kind"),
        ACCESS.c.offering_uuid,
        SUBSCRIPTIONS.c.uuid.label("recipient_uuid"),
        SUBSCRIPTIONS.c.user_uuid,
        SUBSCRIPTIONS.c.observable_objects.label("filter"),
        QUEUES.c.uuid.label("queue_uuid"),
        QUEUES.c.object_type,
        QUEUES.c.queue_name,
        QUEUES.c.vhost,
    ).select_from(
        ACCESS.join(USERS, USERS.c.uuid == ACCESS.c.user_uuid)
        .join(SUBSCRIPTIONS, SUBSCRIPTIONS.c.user_uuid == ACCESS.c.user_uuid)
        .outerjoin(
            QUEUES,
            and_(
                QUEUES.c.subscription_uuid == SUBSCRIPTIONS.c.uuid,
                QUEUES.c.offering_uuid == ACCESS.c.offering_uuid,
                QUEUES.c.object_type.in_(bindparam("object_types", expanding=True)),
            ),
        )
    )
    consumers = select(
        literal(CONSUMER, String).label("kind"),
        ACCESS.c.offering_uuid,
        CONSUMERS.c.uuid.label("recipient_uuid"),
        CONSUMERS.c.user_uuid,
        CONSUMERS.c.object_types.label("filter"),
        null().cast(QUEUES.c.uuid.type).label("queue_uuid"),
        null().cast(QUEUES.c.object_type.type).label("object_type"),
        CONSUMERS.c.queue_name,
        CONSUMERS.c.vhost,
    ).select_from(
        ACCESS.join(USERS, USERS.c.uuid == ACCESS.c.user_uuid)
        .join(SCOPES, SCOPES.c.offering_uuid == ACCESS.c.offering_uuid)
        .join(
            CONSUMERS,
            and_(
                CONSUMERS.c.uuid == SCOPES.c.consumer_uuid,
                CONSUMERS.c.user_uuid == ACCESS.c.user_uuid,
            ),
        )
    )
    reachable = union_all(
        subscriptions.where(_reachable_owner()), consumers.where(_reachable_owner())
    ).subquery("reachable")
    return (
        select(
            OFFERINGS.c.uuid,
            reachable.c.kind,
            reachable.c.recipient_uuid,
            reachable.c.user_uuid,
            reachable.c.filter,
            reachable.c.queue_uuid,
            reachable.c.object_type,
            reachable.c.queue_name,
            reachable.c.vhost,
        )
        .select_from(OFFERINGS.outerjoin(reachable, reachable.c.offering_uuid == OFFERINGS.c.uuid))
        .where(OFFERINGS.c.uuid.in_(bindparam("offerings", expanding=True)))
    )


# Built once: constructing this join per request cost more than running it.
_RECIPIENTS = _recipients_statement()


async def recipients_of(
    session: AsyncSession,
    offering_uuids: Collection[uuid.UUID],
    object_types: Collection[str],
    now: datetime,
) -> tuple[set[uuid.UUID], list[SubscriptionQueueRow]]:
    """The known offerings among `offering_uuids`, and every subscription (joined with its
    queues for the object types) and every consumer of an active owner with access to one
    of them.

    One query for a whole request, whatever its fan-out: the offerings left-joined
    with who may receive their events (an unknown offering yields no row at all).
    """
    offerings = list(offering_uuids)
    result = await session.execute(
        _RECIPIENTS,
        {
            "offerings": offerings,
            "access_offerings": offerings,
            "object_types": list(object_types),
            "now": now,
        },
    )
    known: set[uuid.UUID] = set()
    rows: list[SubscriptionQueueRow] = []
    for offering, kind, recipient, *rest in result:
        known.add(offering)
        if recipient is not None:
            owner, filter_, queue, object_type, name, vhost = rest
            rows.append(
                SubscriptionQueueRow(
                    kind, recipient, owner, filter_, offering, queue, object_type, name, vhost
                )
            )
    return known, rows


async def insert_new_events(session: AsyncSession, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert the events whose id is new; returns the ids this call inserted.

    ON CONFLICT DO NOTHING makes a concurrent repeat wait for the first insert and
    then see the conflict, so each event_id is accepted exactly once.
    """
    if not rows:
        return set()
    insert = postgresql.insert if _is_postgres(session) else sqlite.insert
    statement = insert(EVENTS).on_conflict_do_nothing().returning(EVENTS.c.event_id)
    result = await session.execute(statement, list(rows))
    return set(result.scalars())


async def event_counts(
    session: AsyncSession, event_ids: Collection[str]
) -> dict[str, tuple[int, int]]:
    if not event_ids:
        return {}
    rows = await session.execute(
        select(Event.event_id, Event.queued, Event.skipped_unregistered).where(
            Event.event_id.in_(event_ids)
        )
    )
    return {event_id: (queued, skipped) for event_id, queued, skipped in rows}


async def insert_deliveries(session: AsyncSession, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        await session.execute(DELIVERIES.insert(), list(rows))


async def delivery_states(
    session: AsyncSession, event_ids: Collection[str]
) -> dict[str, list[tuple[str, str, str]]]:
    """(queue_name, vhost, state) of every copy, by event, in creation order."""
    found: dict[str, list[tuple[str, str, str]]] = {event_id: [] for event_id in event_ids}
    if not event_ids:
        return found
    rows = await session.execute(
        select(
            DELIVERIES.c.event_id,
            DELIVERIES.c.queue_name,
            DELIVERIES.c.vhost,
            DELIVERIES.c.state,
        )
        .where(DELIVERIES.c.event_id.in_(event_ids))
        .order_by(DELIVERIES.c.id)
    )
    for event_id, queue_name, vhost, state in rows:
        found[event_id].append((queue_name, vhost, state))
    return found


async def get_event(session: AsyncSession, event_id: str) -> Event | None:
    return await session.get(Event, event_id)


async def deliveries_of(session: AsyncSession, event_id: str) -> Sequence[Row[Any]]:
    rows = await session.execute(
        select(DELIVERIES).where(DELIVERIES.c.event_id == event_id).order_by(DELIVERIES.c.id)
    )
    return rows.all()


# --- the relay ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Claimed:
    id: int
    event_id: str
    queue_uuid: uuid.UUID | None
    consumer_uuid: uuid.UUID | None
    queue_name: str
    vhost: str
    attempts: int
    created: datetime
    last_error: str | None
    offering_uuid: uuid.UUID
    object_type: str
    accepted: datetime
    body: str  # the stored payload JSON, sent as it is


_DELIVERY_COLUMNS = (
    DELIVERIES.c.id,
    DELIVERIES.c.event_id,
    DELIVERIES.c.queue_uuid,
    DELIVERIES.c.consumer_uuid,
    DELIVERIES.c.queue_name,
    DELIVERIES.c.vhost,
    DELIVERIES.c.attempts,
    DELIVERIES.c.created,
    DELIVERIES.c.last_error,
)
_EVENT_COLUMNS = (
    EVENTS.c.offering_uuid,
    EVENTS.c.object_type,
    EVENTS.c.accepted,
    cast(EVENTS.c.payload, Text),
)


_WHEN = DELIVERIES.c.next_attempt_at.type  # binds datetimes as the column stores them
_DUE = (
    select(DELIVERIES.c.id)
    .where(
        DELIVERIES.c.state == IS_PENDING,
        DELIVERIES.c.next_attempt_at <= bindparam("b_now", type_=_WHEN),
    )
    .order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id)
    .limit(bindparam("b_limit"))
)
_CLAIM_VALUES = {
    "claimed_by": bindparam("b_relay"),
    "claimed_until": bindparam("b_lease", type_=_WHEN),
    "next_attempt_at": bindparam("b_lease", type_=_WHEN),
    "attempts": DELIVERIES.c.attempts + 1,
}
_DUE_CTE = _DUE.with_for_update(skip_locked=True).cte("due")
# PostgreSQL: one statement claims and returns what publishing needs.
_CLAIM_POSTGRES = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id == _DUE_CTE.c.id, DELIVERIES.c.event_id == EVENTS.c.event_id)
    .values(_CLAIM_VALUES)
    .returning(*_DELIVERY_COLUMNS, *_EVENT_COLUMNS)
)
# SQLite cannot return columns of an UPDATE's FROM tables: the events are read apart.
_CLAIM_SQLITE = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id.in_(_DUE.scalar_subquery()))
    .values(_CLAIM_VALUES)
    .returning(*_DELIVERY_COLUMNS)
)
_ANY_DUE = _DUE.with_only_columns(DELIVERIES.c.id)
_EVENTS_OF = select(EVENTS.c.event_id, *_EVENT_COLUMNS).where(
    EVENTS.c.event_id.in_(bindparam("b_events", expanding=True))
)


async def claim(
    session: Executor, relay_id: str, now: datetime, lease_until: datetime, limit: int
) -> list[Claimed]:
    """Take up to `limit` due deliveries for `relay_id` until `lease_until`.

    A claim moves `next_attempt_at` to the end of the lease, so claimed rows are
    simply not due for anyone else; a relay that dies leaves them due again when
    its lease runs out. On PostgreSQL `FOR UPDATE SKIP LOCKED` lets relays claim
    side by side without waiting on or double-claiming each other's rows; SQLite
    has one writer at a time, so a plain UPDATE is already exclusive.
    """
    params = {"b_now": now, "b_limit": limit, "b_relay": relay_id, "b_lease": lease_until}
    if _is_postgres(session):
        rows = (await session.execute(_CLAIM_POSTGRES, params)).all()
        claimed = [Claimed(*row) for row in rows]
    else:
        # Look before claiming, so an idle relay never takes SQLite's write lock.
        if await session.scalar(_ANY_DUE, {"b_now": now, "b_limit": 1}) is None:
            return []
        deliveries = (await session.execute(_CLAIM_SQLITE, params)).all()
        events: dict[str, tuple[Any, ...]] = {}
        if deliveries:
            result = await session.execute(
                _EVENTS_OF, {"b_events": list({row[1] for row in deliveries})}
            )
            events = {row[0]: tuple(row[1:]) for row in result}
        claimed = [Claimed(*row, *events[row[1]]) for row in deliveries]
    claimed.sort(key=lambda item: item.id)  # RETURNING has no order; publish oldest first
    return claimed


def _finish_statement(with_error: bool) -> Update:
    values: dict[str, Any] = {
        "state": bindparam("b_state"),
        "finished": bindparam("b_finished", type_=_WHEN),
        "claimed_by": None,
        "claimed_until": None,
    }
    if with_error:
        values["last_error"] = bindparam("b_error")
    return (
        update(DELIVERIES)
        .where(
            DELIVERIES.c.id.in_(bindparam("b_ids", expanding=True)),
            DELIVERIES.c.state == PENDING,
        )
        .values(values)
    )


_FINISH = _finish_statement(with_error=False)
_FINISH_WITH_ERROR = _finish_statement(with_error=True)


async def finish(
    session: Executor,
    ids: Collection[int],
    state: str,
    now: datetime,
    error: str | None = None,
) -> None:
    """Settle deliveries (published, rejected, given_up). A settled row stays settled."""
    if not ids:
        return
    params = {"b_ids": list(ids), "b_state": state, "b_finished": now}
    if error is None:
        await session.execute(_FINISH, params)
    else:
        await session.execute(_FINISH_WITH_ERROR, {**params, "b_error": error})


async def give_up(session: Executor, reasons: Sequence[tuple[int, str]], now: datetime) -> None:
    if not reasons:
        return
    statement = (
        update(DELIVERIES)
        .where(DELIVERIES.c.id == bindparam("b_id"), DELIVERIES.c.state == PENDING)
        .values(
            state="given_up",
            finished=now,
            claimed_by=None,
            claimed_until=None,
            last_error=bindparam("b_error"),
        )
    )
    await session.execute(statement, [{"b_id": i, "b_error": reason} for i, reason in reasons])


async def reschedule(
    session: Executor, relay_id: str, retries: Sequence[tuple[int, datetime, str]]
) -> None:
    """Release our claim on (id, next attempt, error), unless another relay took it since."""
    if not retries:
        return
    statement = (
        update(DELIVERIES)
        .where(
            DELIVERIES.c.id == bindparam("b_id"),
            DELIVERIES.c.state == PENDING,
            DELIVERIES.c.claimed_by == relay_id,
        )
        .values(
            next_attempt_at=bindparam("b_next"),
            last_error=bindparam("b_error"),
            claimed_by=None,
            claimed_until=None,
        )
    )
    await session.execute(
        statement,
        [{"b_id": i, "b_next": when, "b_error": error} for i, when, error in retries],
    )


async def existing_targets(
    session: Executor, target_uuids: Collection[uuid.UUID]
) -> set[uuid.UUID]:
    """Of these subscription queue and consumer uuids, the ones whose row still exists."""
    if not target_uuids:
        return set()
    rows = await session.scalars(
        select(EventSubscriptionQueue.uuid)
        .where(EventSubscriptionQueue.uuid.in_(target_uuids))
        .union_all(select(EventConsumer.uuid).where(EventConsumer.uuid.in_(target_uuids)))
    )
    return set(rows)


async def outbox_stats(session: Executor, now: datetime) -> tuple[int, int, datetime | None]:
    """(pending, claimed by a live lease, oldest pending creation time)."""
    row = (
        await session.execute(
            select(
                func.count(),
                func.coalesce(func.sum(case((DELIVERIES.c.claimed_until > now, 1), else_=0)), 0),
                func.min(DELIVERIES.c.created),
            ).where(DELIVERIES.c.state == IS_PENDING)
        )
    ).one()
    oldest = row[2]
    if isinstance(oldest, str):  # SQLite hands an aggregate back untyped
        oldest = datetime.fromisoformat(oldest)
    if oldest is not None and oldest.tzinfo is None:
        oldest = oldest.replace(tzinfo=now.tzinfo)
    return int(row[0]), int(row[1]), oldest


async def consumer_count(session: Executor) -> int:
    """Consumers registered (the `queuekeeper_consumers` gauge)."""
    return int(await session.scalar(select(func.count()).select_from(CONSUMERS)) or 0)


async def prune_events(session: Executor, cutoff: datetime, limit: int = 1000) -> int:
    """Delete up to `limit` events accepted before `cutoff` with no copy still pending."""
    pending = exists().where(
        DELIVERIES.c.event_id == EVENTS.c.event_id, DELIVERIES.c.state == PENDING
    )
    old = select(EVENTS.c.event_id).where(EVENTS.c.accepted < cutoff, ~pending).limit(limit)
    result = await session.execute(
        delete(EVENTS).where(EVENTS.c.event_id.in_(old.scalar_subquery()))
    )
    return int(getattr(result, "rowcount", 0) or 0)
