"""The outbox's statements on SQLite, in SQLAlchemy Core: the twin of `outbox_postgres.py`.

Same statements, same rows in and out; SQLite has one writer at a time, so a plain
UPDATE already claims exclusively, and it cannot return columns of an UPDATE's FROM
tables, so a claim (and an unpark) reads its events apart. Parking's writes of a copy
live here too, as in the twin (docs/decisions/015-parking.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    String,
    Table,
    Text,
    and_,
    bindparam,
    cast,
    func,
    literal,
    literal_column,
    null,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects.sqlite import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from queuekeeper.events.recipients import CONSUMER, SUBSCRIPTION
from queuekeeper.events.repository import DELIVERIES, EVENTS
from queuekeeper.models import PARKED_OR_RELEASING, Base, DeliveryState

OFFERINGS = Base.metadata.tables["offerings"]
ACCESS = Base.metadata.tables["offering_access"]
USERS = Base.metadata.tables["users"]
SUBSCRIPTIONS = Base.metadata.tables["event_subscriptions"]
QUEUES = Base.metadata.tables["event_subscription_queues"]
CONSUMERS = Base.metadata.tables["event_consumers"]
SCOPES = Base.metadata.tables["event_consumer_scopes"]

PENDING = DeliveryState.PENDING
_WHEN = DELIVERIES.c.next_attempt_at.type  # binds datetimes as the column stores them (UTC)


def _reachable_owner() -> ColumnElement[bool]:
    """The grant's user is active and their token has not expired."""
    return and_(
        ACCESS.c.offering_uuid.in_(bindparam("offerings", expanding=True)),
        USERS.c.is_active.is_(True),
        or_(
            USERS.c.token_expires_at.is_(None),
            USERS.c.token_expires_at > bindparam("now", type_=USERS.c.token_expires_at.type),
        ),
    )


def _reachable(
    kind: str, recipient: Table, filter_: ColumnElement[Any], queue: Any, joined: Any
) -> Select[Any]:
    """Who of `kind` may receive events of the granted offerings: `recipient`'s rows with
    their `filter_`, and the subscription queue (`queue`) or the consumer's own."""
    return (
        select(
            literal(kind, String).label("kind"),
            ACCESS.c.offering_uuid,
            recipient.c.uuid.label("recipient_uuid"),
            recipient.c.user_uuid,
            filter_.label("filter"),
            *queue,
        )
        .select_from(ACCESS.join(USERS, USERS.c.uuid == ACCESS.c.user_uuid).join(*joined))
        .where(_reachable_owner())
    )


def _recipients_statement() -> Select[Any]:
    """`outbox_postgres.RECIPIENTS` in Core."""
    queue_of_type = and_(
        QUEUES.c.subscription_uuid == SUBSCRIPTIONS.c.uuid,
        QUEUES.c.offering_uuid == ACCESS.c.offering_uuid,
        QUEUES.c.object_type.in_(bindparam("object_types", expanding=True)),
    )
    subscriptions = _reachable(
        SUBSCRIPTION,
        SUBSCRIPTIONS,
        SUBSCRIPTIONS.c.observable_objects,
        (
            QUEUES.c.uuid.label("queue_uuid"),
            QUEUES.c.object_type,
            QUEUES.c.queue_name,
            QUEUES.c.vhost,
        ),
        (SUBSCRIPTIONS, SUBSCRIPTIONS.c.user_uuid == ACCESS.c.user_uuid),
    ).outerjoin_from(SUBSCRIPTIONS, QUEUES, queue_of_type)
    scoped = and_(
        CONSUMERS.c.uuid == SCOPES.c.consumer_uuid, CONSUMERS.c.user_uuid == ACCESS.c.user_uuid
    )
    consumers = _reachable(
        CONSUMER,
        CONSUMERS,
        CONSUMERS.c.object_types,
        (
            null().cast(QUEUES.c.uuid.type).label("queue_uuid"),
            null().cast(QUEUES.c.object_type.type).label("object_type"),
            CONSUMERS.c.queue_name,
            CONSUMERS.c.vhost,
        ),
        (SCOPES, SCOPES.c.offering_uuid == ACCESS.c.offering_uuid),
    ).join_from(SCOPES, CONSUMERS, scoped)
    reachable = union_all(subscriptions, consumers).subquery("reachable")
    return (
        select(OFFERINGS.c.uuid, *(c for c in reachable.c if c.name != "offering_uuid"))
        .select_from(OFFERINGS.outerjoin(reachable, reachable.c.offering_uuid == OFFERINGS.c.uuid))
        .where(OFFERINGS.c.uuid.in_(bindparam("offerings", expanding=True)))
    )


# Built once: constructing this join per request cost more than running it.
RECIPIENTS = _recipients_statement()
INSERT_EVENTS = insert(EVENTS).on_conflict_do_nothing().returning(EVENTS.c.event_id)
EVENT_COUNTS = select(EVENTS.c.event_id, EVENTS.c.queued, EVENTS.c.skipped_unregistered).where(
    EVENTS.c.event_id.in_(bindparam("event_ids", expanding=True))
)
INSERT_DELIVERIES = DELIVERIES.insert()
# RETURNING without asking for parameter order: SQLite would then insert row by row.
INSERT_DELIVERIES_RETURNING = DELIVERIES.insert().returning(
    DELIVERIES.c.id, DELIVERIES.c.event_id, DELIVERIES.c.queue_uuid, DELIVERIES.c.consumer_uuid
)

# What a claimed copy carries of its own row (`outbox.Claimed` less its event's columns,
# read apart by `EVENTS_OF`): the claim's and the unpark's alike.
_CLAIMED = (
    DELIVERIES.c.id,
    DELIVERIES.c.event_id,
    DELIVERIES.c.queue_uuid,
    DELIVERIES.c.consumer_uuid,
    DELIVERIES.c.queue_name,
    DELIVERIES.c.vhost,
    DELIVERIES.c.attempts,
    DELIVERIES.c.created,
    DELIVERIES.c.last_error,
    DELIVERIES.c.offering_uuid,
    DELIVERIES.c.replay,
)
_DUE = (
    select(DELIVERIES.c.id)
    .where(
        DELIVERIES.c.state == PENDING,
        DELIVERIES.c.next_attempt_at <= bindparam("b_now", type_=_WHEN),
    )
    .order_by(DELIVERIES.c.next_attempt_at, DELIVERIES.c.id)
    .limit(bindparam("b_limit"))
)
CLAIM = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id.in_(_DUE.scalar_subquery()))
    .values(
        attempts=DELIVERIES.c.attempts + 1,
        claimed_by=bindparam("b_relay"),
        claimed_until=bindparam("b_until", type_=_WHEN),
        next_attempt_at=bindparam("b_until", type_=_WHEN),
    )
    .returning(*_CLAIMED)
)
EVENTS_OF = select(
    EVENTS.c.event_id,
    EVENTS.c.offering_uuid,
    EVENTS.c.object_type,
    EVENTS.c.accepted,
    cast(EVENTS.c.payload, Text),
).where(EVENTS.c.event_id.in_(bindparam("b_event_ids", expanding=True)))

_HELD = update(DELIVERIES).where(
    DELIVERIES.c.id.in_(bindparam("b_ids", expanding=True)),
    DELIVERIES.c.state == PENDING,
    DELIVERIES.c.claimed_by == bindparam("b_relay"),
)
RENEW = _HELD.values(
    claimed_until=bindparam("b_until", type_=_WHEN),
    next_attempt_at=bindparam("b_until", type_=_WHEN),
).returning(DELIVERIES.c.id)
# Not an attempt: nothing was published.
RELEASE = _HELD.values(
    claimed_by=None,
    claimed_until=None,
    next_attempt_at=bindparam("b_now", type_=_WHEN),
    attempts=DELIVERIES.c.attempts - 1,
)
_SETTLE = update(DELIVERIES).values(
    finished=bindparam("b_now", type_=_WHEN), claimed_by=None, claimed_until=None
)
FINISH = _SETTLE.where(
    DELIVERIES.c.id.in_(bindparam("b_ids", expanding=True)), DELIVERIES.c.state == PENDING
).values(state=bindparam("b_state"))
FINISH_WITH_ERROR = FINISH.values(last_error=bindparam("b_error"))
# Each copy with its own `finished`: the time the broker confirmed it.
PUBLISHED_AT = _SETTLE.where(
    DELIVERIES.c.id == bindparam("b_id"), DELIVERIES.c.state == PENDING
).values(state=DeliveryState.PUBLISHED)
GIVE_UP = _SETTLE.where(DELIVERIES.c.id == bindparam("b_id"), DELIVERIES.c.state == PENDING).values(
    state=DeliveryState.GIVEN_UP, last_error=bindparam("b_error")
)
# Unless another relay took the copy since.
RESCHEDULE = (
    update(DELIVERIES)
    .where(
        DELIVERIES.c.id == bindparam("b_id"),
        DELIVERIES.c.state == PENDING,
        DELIVERIES.c.claimed_by == bindparam("b_relay"),
    )
    .values(
        next_attempt_at=bindparam("b_next", type_=_WHEN),
        last_error=bindparam("b_error"),
        claimed_by=None,
        claimed_until=None,
    )
)


# --- parking's writes (docs/decisions/015-parking.md) -------------------------------------
PARKED = DeliveryState.PARKED
# Written as `ix_deliveries_parked` is defined (migration 0011_parking), so SQLite uses it.
_PARKED_OR_RELEASING: ColumnElement[bool] = literal_column(PARKED_OR_RELEASING)
# A copy a relay holds (claimed or handed over) parks: not an attempt, nothing was published.
PARK = _HELD.values(
    state=PARKED,
    parked_at=func.coalesce(DELIVERIES.c.parked_at, bindparam("b_now", type_=_WHEN)),
    claimed_by=None,
    claimed_until=None,
    attempts=DELIVERIES.c.attempts - 1,
    last_error=bindparam("b_reason"),
)
_OLDEST_PARKED = (
    select(DELIVERIES.c.id)
    .where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.state == PARKED,
        DELIVERIES.c.vhost == bindparam("b_vhost"),
        DELIVERIES.c.queue_name == bindparam("b_queue"),
    )
    .order_by(DELIVERIES.c.id)
    .limit(bindparam("b_limit"))
)
# The queue's oldest parked copies, back to pending and claimed as `CLAIM` claims.
UNPARK = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id.in_(_OLDEST_PARKED.scalar_subquery()), DELIVERIES.c.state == PARKED)
    .values(
        state=PENDING,
        attempts=DELIVERIES.c.attempts + 1,
        claimed_by=bindparam("b_relay"),
        claimed_until=bindparam("b_until", type_=_WHEN),
        next_attempt_at=bindparam("b_until", type_=_WHEN),
    )
    .returning(*_CLAIMED)
)
_EXPIRED = (
    select(DELIVERIES.c.id)
    .where(
        _PARKED_OR_RELEASING,
        DELIVERIES.c.state == PARKED,
        DELIVERIES.c.created < bindparam("b_before", type_=_WHEN),
    )
    .limit(bindparam("b_limit"))
)
GIVE_UP_PARKED = (
    update(DELIVERIES)
    .where(DELIVERIES.c.id.in_(_EXPIRED.scalar_subquery()), DELIVERIES.c.state == PARKED)
    .values(
        state=DeliveryState.GIVEN_UP,
        finished=bindparam("b_now", type_=_WHEN),
        last_error=bindparam("b_reason"),
    )
)


def _add_replays(of: bool) -> Any:
    """`outbox_postgres.ADD_REPLAYS` in Core: one INSERT ... SELECT, in the order of each
    event's first copy for the queue (acceptance order); `of`: only some object types."""
    first_copy = (
        select(
            func.min(DELIVERIES.c.id).label("first_id"),
            DELIVERIES.c.event_id,
            DELIVERIES.c.offering_uuid,
        )
        .join(EVENTS, EVENTS.c.event_id == DELIVERIES.c.event_id)
        .where(
            DELIVERIES.c.vhost == bindparam("vhost"),
            DELIVERIES.c.queue_name == bindparam("queue_name"),
            DELIVERIES.c.replay.is_(False),
            EVENTS.c.accepted >= bindparam("since", type_=_WHEN),
            EVENTS.c.accepted < bindparam("until", type_=_WHEN),
            *([EVENTS.c.object_type.in_(bindparam("object_types", expanding=True))] if of else []),
        )
        .group_by(DELIVERIES.c.event_id, DELIVERIES.c.offering_uuid)
        .subquery()
    )
    source = select(
        first_copy.c.event_id,
        bindparam("queue_uuid", type_=DELIVERIES.c.queue_uuid.type),
        bindparam("consumer_uuid", type_=DELIVERIES.c.consumer_uuid.type),
        bindparam("queue_name", type_=DELIVERIES.c.queue_name.type),
        bindparam("vhost", type_=DELIVERIES.c.vhost.type),
        first_copy.c.offering_uuid,
        literal(PENDING.value, DELIVERIES.c.state.type),
        literal(0, DELIVERIES.c.attempts.type),
        bindparam("now", type_=_WHEN),
        bindparam("created", type_=_WHEN),
        literal(True, DELIVERIES.c.replay.type),
    ).order_by(first_copy.c.first_id)
    columns = ["event_id", "queue_uuid", "consumer_uuid", "queue_name", "vhost"]
    columns += ["offering_uuid", "state", "attempts", "next_attempt_at", "created", "replay"]
    return DELIVERIES.insert().from_select(columns, source)


ADD_REPLAYS = {types: _add_replays(types) for types in (False, True)}


class StoreUnit:
    """The store's statements, inside one transaction."""

    def __init__(self, connection: AsyncConnection) -> None:
        self.connection = connection

    async def recipients(
        self, offerings: Collection[Any], object_types: Collection[str], now: datetime
    ) -> list[tuple[Any, ...]]:
        """(offering, kind, recipient, owner, filter, queue, object type, name, vhost)."""
        parameters = {"offerings": list(offerings), "object_types": list(object_types)}
        result = await self.connection.execute(RECIPIENTS, {**parameters, "now": now})
        return [tuple(row) for row in result]

    async def event_counts(self, event_ids: Collection[str]) -> dict[str, tuple[int, int]]:
        result = await self.connection.execute(EVENT_COUNTS, {"event_ids": list(event_ids)})
        return {row[0]: (row[1], row[2]) for row in result}

    async def insert(
        self,
        events: Sequence[Mapping[str, Any]],
        copies: Sequence[Mapping[str, Any]],
        *,
        ids: bool = True,
    ) -> tuple[set[str], list[tuple[Any, ...]]]:
        """Insert the events whose id is new and the copies of those (the others' copies
        are dropped), in the store's transaction; returns the new event ids and, with
        `ids`, (id, event_id, queue_uuid, consumer_uuid) of each copy inserted."""
        if not events:
            return set(), []
        inserted = set((await self.connection.execute(INSERT_EVENTS, list(events))).scalars())
        rows = [row for row in copies if row["event_id"] in inserted]
        if not rows:
            return inserted, []
        if not ids:
            await self.connection.execute(INSERT_DELIVERIES, rows)
            return inserted, []
        returned = await self.connection.execute(INSERT_DELIVERIES_RETURNING, rows)
        return inserted, [tuple(r) for r in returned]


class SqliteOutbox:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @asynccontextmanager
    async def store(self) -> AsyncIterator[StoreUnit]:
        """One store's transaction: committed when the block ends, rolled back if it
        raises."""
        async with self.engine.begin() as connection:
            yield StoreUnit(connection)

    async def claim(
        self, relay_id: str, now: datetime, until: datetime, limit: int
    ) -> list[Sequence[Any]]:
        async with self.engine.begin() as connection:
            # Look before claiming, so an idle relay never takes SQLite's write lock.
            if await connection.scalar(_DUE, {"b_now": now, "b_limit": 1}) is None:
                return []
            parameters = {"b_now": now, "b_limit": limit, "b_relay": relay_id, "b_until": until}
            return await _with_events(connection, await connection.execute(CLAIM, parameters))

    async def renew(self, relay_id: str, ids: Collection[int], until: datetime) -> set[int]:
        async with self.engine.begin() as connection:
            parameters = {"b_ids": list(ids), "b_relay": relay_id, "b_until": until}
            return set((await connection.execute(RENEW, parameters)).scalars())

    async def release(self, relay_id: str, ids: Collection[int], now: datetime) -> None:
        async with self.engine.begin() as connection:
            await connection.execute(
                RELEASE, {"b_ids": list(ids), "b_relay": relay_id, "b_now": now}
            )

    async def finish(
        self, ids: Collection[int], state: str, now: datetime, error: str | None
    ) -> None:
        parameters = {"b_ids": list(ids), "b_state": state, "b_now": now}
        async with self.engine.begin() as connection:
            if error is None:
                await connection.execute(FINISH, parameters)
            else:
                await connection.execute(FINISH_WITH_ERROR, {**parameters, "b_error": error})

    async def published_at(self, confirmed: Sequence[tuple[int, datetime]]) -> None:
        rows = [{"b_id": i, "b_now": at} for i, at in confirmed]
        async with self.engine.begin() as connection:
            await connection.execute(PUBLISHED_AT, rows)

    async def give_up(self, reasons: Sequence[tuple[int, str]], now: datetime) -> None:
        rows = [{"b_id": i, "b_error": error, "b_now": now} for i, error in reasons]
        async with self.engine.begin() as connection:
            await connection.execute(GIVE_UP, rows)

    async def reschedule(self, relay_id: str, retries: Sequence[tuple[int, datetime, str]]) -> None:
        rows = [
            {"b_id": i, "b_next": when, "b_error": error, "b_relay": relay_id}
            for i, when, error in retries
        ]
        async with self.engine.begin() as connection:
            await connection.execute(RESCHEDULE, rows)

    async def park(self, relay_id: str, ids: Collection[int], now: datetime, reason: str) -> None:
        parameters = {"b_ids": list(ids), "b_relay": relay_id, "b_now": now, "b_reason": reason}
        async with self.engine.begin() as connection:
            await connection.execute(PARK, parameters)

    async def unpark(
        self, relay_id: str, vhost: str, queue: str, limit: int, until: datetime
    ) -> list[Sequence[Any]]:
        parameters = {"b_vhost": vhost, "b_queue": queue, "b_limit": limit}
        async with self.engine.begin() as connection:
            result = await connection.execute(
                UNPARK, {**parameters, "b_relay": relay_id, "b_until": until}
            )
            return await _with_events(connection, result)

    async def give_up_parked(self, before: datetime, limit: int, now: datetime, reason: str) -> int:
        parameters = {"b_before": before, "b_limit": limit, "b_now": now, "b_reason": reason}
        async with self.engine.begin() as connection:
            result = await connection.execute(GIVE_UP_PARKED, parameters)
        return int(result.rowcount or 0)

    async def add_replays(self, replay: Mapping[str, Any]) -> int:
        statement = ADD_REPLAYS[replay["object_types"] is not None]
        async with self.engine.begin() as connection:
            result = await connection.execute(statement, {**replay, "created": replay["now"]})
        return int(result.rowcount or 0)


async def _with_events(connection: AsyncConnection, claimed: Any) -> list[Sequence[Any]]:
    """The claimed rows with their events' columns, in `outbox.Claimed`'s order (SQLite
    cannot return an UPDATE's FROM tables)."""
    deliveries = claimed.all()
    if not deliveries:
        return []
    event_ids = list({row[1] for row in deliveries})
    result = await connection.execute(EVENTS_OF, {"b_event_ids": event_ids})
    events = {row[0]: tuple(row[1:]) for row in result}
    return [(*row[:-1], *events[row[1]], row[-1]) for row in deliveries]
