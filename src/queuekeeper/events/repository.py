"""Event records: the events the backend handed over and their outbox copies (`deliveries`).

Written and read with Core statements on the tables: accepting a batch inserts
thousands of rows in one statement and needs no ORM identity tracking. The intake's
statements run in a `db.transaction` (on PostgreSQL, on the driver itself). The relay's
statements on the same tables are in `outbox.py`; who gets a copy, in `recipients.py`.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Row, Table, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from queuekeeper.db import DriverInsert, DriverQuery, Transaction, one_of
from queuekeeper.models import Base, DeliveryState, Event

EVENTS: Table = Base.metadata.tables["events"]
DELIVERIES: Table = Base.metadata.tables["deliveries"]

# The relay runs its statements on autocommit connections, the API in sessions.
Executor = AsyncSession | AsyncConnection

# What the intake writes of an event: every column.
EVENT_COLUMNS = (
    "event_id",
    "offering_uuid",
    "offering_uuids",
    "object_type",
    "payload",
    "user_uuids",
    "queued",
    "skipped_unregistered",
    "accepted",
)
_INSERT_NEW_EVENTS = DriverInsert(
    EVENTS, EVENT_COLUMNS, returning=[EVENTS.c.event_id], if_absent=True
)


async def insert_new_events(transaction: Transaction, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert the events whose id is new; returns the ids this call inserted.

    ON CONFLICT DO NOTHING makes a concurrent repeat wait for the first insert and
    then see the conflict, so each event_id is accepted exactly once.
    """
    return {row["event_id"] for row in await transaction.insert(_INSERT_NEW_EVENTS, rows)}


_EVENT_COUNTS = DriverQuery(
    select(EVENTS.c.event_id, EVENTS.c.queued, EVENTS.c.skipped_unregistered).where(
        one_of(EVENTS.c.event_id, "event_ids")
    )
)


async def event_counts(
    transaction: Transaction, event_ids: Collection[str]
) -> dict[str, tuple[int, int]]:
    """(queued, skipped_unregistered) of events accepted before, by id."""
    if not event_ids:
        return {}
    rows = await transaction.all(_EVENT_COUNTS, {"event_ids": list(event_ids)})
    return {row["event_id"]: (row["queued"], row["skipped_unregistered"]) for row in rows}


_DELIVERY_COLUMNS = [
    "event_id",
    "queue_uuid",
    "consumer_uuid",
    "queue_name",
    "vhost",
    "offering_uuid",
    "state",
    "attempts",
    "claimed_by",
    "claimed_until",
    "next_attempt_at",
    "created",
]
_INSERT_DELIVERIES = DriverInsert(DELIVERIES, _DELIVERY_COLUMNS)
# RETURNING without asking for parameter order: SQLite would then insert row by row.
_INSERT_DELIVERIES_RETURNING = DriverInsert(
    DELIVERIES,
    _DELIVERY_COLUMNS,
    returning=[
        DELIVERIES.c.id,
        DELIVERIES.c.event_id,
        DELIVERIES.c.queue_uuid,
        DELIVERIES.c.consumer_uuid,
    ],
)


async def insert_deliveries(
    transaction: Transaction, rows: Sequence[dict[str, Any]], *, ids: bool = False
) -> dict[tuple[str, uuid.UUID | None], int]:
    """Insert outbox copies; with `ids`, returns each one's id by (event_id, target), the
    target being the copy's subscription queue or its consumer (each copy has one)."""
    if not ids:
        await transaction.insert(_INSERT_DELIVERIES, rows)
        return {}
    return {
        (row["event_id"], row["queue_uuid"] or row["consumer_uuid"]): row["id"]
        for row in await transaction.insert(_INSERT_DELIVERIES_RETURNING, rows)
    }


async def delivery_states(
    session: AsyncSession, event_ids: Collection[str]
) -> dict[str, list[tuple[str, str, DeliveryState, str | None]]]:
    """(queue_name, vhost, state, last_error) of every copy, by event, in creation order."""
    found: dict[str, list[tuple[str, str, DeliveryState, str | None]]] = {
        event_id: [] for event_id in event_ids
    }
    if not event_ids:
        return found
    rows = await session.execute(
        select(
            DELIVERIES.c.event_id,
            DELIVERIES.c.queue_name,
            DELIVERIES.c.vhost,
            DELIVERIES.c.state,
            DELIVERIES.c.last_error,
        )
        .where(DELIVERIES.c.event_id.in_(event_ids))
        .order_by(DELIVERIES.c.id)
    )
    for event_id, queue_name, vhost, state, last_error in rows:
        found[event_id].append((queue_name, vhost, state, last_error))
    return found


async def get_event(session: AsyncSession, event_id: str) -> Event | None:
    return await session.get(Event, event_id)


async def deliveries_of(session: AsyncSession, event_id: str) -> Sequence[Row[Any]]:
    rows = await session.execute(
        select(DELIVERIES).where(DELIVERIES.c.event_id == event_id).order_by(DELIVERIES.c.id)
    )
    return rows.all()
